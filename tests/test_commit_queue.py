"""What a non-blocking commit does while the previous one still runs (``when_busy``): wait for
it, queue the latest snapshot behind it (replacing one still waiting), or skip the step."""

import fcntl
import threading
import time
from contextlib import contextmanager

import pytest
from click.testing import CliRunner

import ckptstore
from ckptstore.cli import cli
from ckptstore.errors import BadInputError, StorageError
from tests.dist_worker import commit_every_step
from tests.model_parallel_worker import differences
from tools.engines import batches, build_engine, destroy_engine, train

DATA = batches(8)


@contextmanager
def store_held(store):
    """The store's lock held exclusively, as a gc holds it: a commit cannot start storing
    until it is let go, so the one in flight stays in flight."""
    with open(store.objects.root / "lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def in_thread(work, timeout=300):
    """Run ``work`` on a thread of its own; what it returned, once it ended within ``timeout``
    (it must not wait for the commit held behind the store's lock)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(work()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the training loop waited for a commit in flight"
    return out[0]


def test_latest_queues_the_newest_snapshot_behind_a_running_commit_and_skip_skips(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2, scheduler=False)

    def training():
        handles = commit_every_step(store, engine, tmp_path / "deepspeed")
        train(engine, DATA[4:6])  # the optimizer steps wait for step 3's copy, never for a commit
        return handles

    with store_held(store):
        handles = in_thread(training)
        assert [handles[step].outcome for step in range(1, 5)] == [None, "replaced", None, "skipped"]
    assert handles[1].result().step == 1 and handles[3].result().step == 3
    assert handles[2].result() is None and handles[4].result() is None
    assert [handles[step].outcome for step in range(1, 5)] == [
        "committed",
        "replaced",
        "committed",
        "skipped",
    ]
    assert store.steps() == [1, 3]
    train(engine, DATA[6:7])
    store.commit(engine, step=5, blocking=False, when_busy="latest").result()
    destroy_engine(engine)

    # each commit records what it held training, and the steps before it not committed
    log = {row.step: row for row in store.log()}
    assert [log[step].not_committed for step in (1, 3, 5)] == [[], [(2, "replaced")], [(4, "skipped")]]
    assert all(log[step].stall_seconds is not None for step in (1, 3, 5))
    shown = CliRunner().invoke(cli, ["--store", str(tmp_path / "store"), "log"])
    assert shown.exit_code == 0 and "not committed before it: replaced 2" in shown.output
    assert "stall s" in shown.output and "not committed before it: skipped 4" in shown.output
    figures = store.report(tmp_path / "report")
    assert figures.not_committed == [[], [(2, "replaced")], [(4, "skipped")]]
    assert "2 replaced" in (tmp_path / "report" / "index.html").read_text()

    # step 3 is the snapshot taken at step 3, though training went on while it waited
    store.materialize(3, tmp_path / "materialized")
    own = tmp_path / "deepspeed" / "global_step3"
    assert differences(tmp_path / "materialized" / "global_step3", own) == []
    assert store.verify().ok


def test_a_commit_that_finds_none_running_starts_at_once_under_every_policy(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=2)
    for step, when_busy in enumerate(("latest", "skip", "wait"), start=1):
        train(engine, DATA[step - 1 : step])
        handle = store.commit(engine, step=step, blocking=False, when_busy=when_busy)
        assert handle.result().step == step and handle.outcome == "committed"
    assert store.steps() == [1, 2, 3]
    destroy_engine(engine)


def test_an_error_of_a_queued_commit_surfaces_once_at_the_next_commit(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=0, dtype="fp32", seed=0, num_layers=2)
    train(engine, DATA[:1])
    healthy_put = store.objects.put_if_absent
    store.objects.put_if_absent = lambda name, data, **_: (_ for _ in ()).throw(StorageError("injected"))
    failed = store.commit(engine, step=1, blocking=False, when_busy="latest")
    with pytest.raises(StorageError, match="injected"):
        failed.result()  # delivered here: the next commit does not raise it again
    store.objects.put_if_absent = healthy_put
    assert failed.outcome == "failed"
    assert store.commit(engine, step=2, blocking=False, when_busy="latest").result().step == 2

    store.objects.put_if_absent = lambda name, data, **_: (_ for _ in ()).throw(
        StorageError("injected again")
    )
    failing = store.commit(engine, step=3, blocking=False, when_busy="skip")
    while not failing.done():
        time.sleep(0.05)
    store.objects.put_if_absent = healthy_put
    with pytest.raises(StorageError, match="injected again"):
        store.commit(engine, step=4, blocking=False, when_busy="skip")  # raised here, once
    assert store.commit(engine, step=4, blocking=False, when_busy="skip").result().step == 4
    store.close()
    assert ckptstore.open(tmp_path / "store").steps() == [2, 4]
    destroy_engine(engine)


def test_when_busy_takes_a_known_policy_for_non_blocking_commits_only(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=0, dtype="fp32", seed=0, num_layers=2)
    with pytest.raises(BadInputError, match="when_busy= takes one of wait, latest, skip"):
        store.commit(engine, step=1, blocking=False, when_busy="newest")
    with pytest.raises(BadInputError, match="non-blocking"):
        store.commit(engine, step=1, when_busy="latest")
    assert store.steps() == []
    destroy_engine(engine)
