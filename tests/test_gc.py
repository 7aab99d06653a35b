"""Retention, garbage collection and crash safety: nothing a kept step needs is ever lost.

Scenarios follow shared/RELIABILITY.md (Commit, GC, Integrity) for a local store.
"""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.catalog import sync
from ckptstore.errors import BadInputError, CorruptError, NotFoundError
from ckptstore.format import codec
from ckptstore.format.layout import blob_name, manifest_name, pack_name
from ckptstore.gc import steps_to_keep
from tools.engines import batches, build_engine, train

WORKER = Path(__file__).with_name("crash_worker.py")
LAYERS = [f"model.layers.{i}" for i in range(3)]


def load_checkpoint_files(directory: Path) -> dict:
    return {
        p.relative_to(directory).as_posix(): torch.load(p, weights_only=False)
        for p in directory.rglob("*.pt")
    }


def same(a, b) -> bool:
    """Deep equality of loaded checkpoint contents (tensors bitwise, objects by attributes)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and same(vars(a), vars(b))
    return a == b


def materialized(store, step, path) -> dict:
    store.materialize(step, path, force=True)
    return load_checkpoint_files(path)


def child_env() -> dict:
    """This environment minus the rendezvous port this process's DeepSpeed already uses."""
    return {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}


def worker(*args, timeout=300):
    return subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=child_env())  # fmt: skip


@pytest.fixture
def composite_store(tmp_path):
    """Steps 2 and 4 full, step 6 saving only model.layers.1 (the rest inherited from step 4)."""
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=3)
    data = batches(6)
    for step in (2, 4, 6):
        train(engine, data[step - 2 : step])
        store.commit(engine, step=step, layers=None if step < 6 else ["model.layers.1"])
    return store


# -- retention rules ---------------------------------------------------------------------------


def test_retention_keeps_the_last_n_every_kth_and_named_steps():
    steps = [100, 200, 300, 1000, 1100, 1200, 2000, 2100]
    assert steps_to_keep(steps, keep_last=2) == [2000, 2100]
    assert steps_to_keep(steps, keep_every=1000) == [1000, 2000]
    assert steps_to_keep(steps, keep_last=1, keep_every=1000, keep_steps=[300]) == [300, 1000, 2000, 2100]
    assert steps_to_keep(steps) == steps  # no rule: nothing is dropped
    with pytest.raises(BadInputError, match="do not exist: 7"):
        steps_to_keep(steps, keep_steps=[7])


def test_gc_keeps_blobs_inherited_by_composite_step(composite_store, tmp_path):
    before = materialized(composite_store, 6, tmp_path / "before")
    report = composite_store.gc(keep_last=1, grace=0)
    assert report.steps_dropped == [2, 4] and composite_store.steps() == [6]
    assert report.blobs_freed > 0
    assert composite_store.sources(6)["model.layers.0"] == 4  # still answered for the kept step
    assert composite_store.verify().ok
    assert same(materialized(composite_store, 6, tmp_path / "after"), before)


def test_dry_run_changes_nothing_and_predicts_what_the_real_run_frees(composite_store, tmp_path):
    root = Path(composite_store.objects.root)
    listing = sorted(
        (p.relative_to(root), p.stat().st_size) for p in root.rglob("*") if p.is_file() and p.name != "lock"
    )
    preview = composite_store.gc(keep_last=1, grace=0, dry_run=True)
    assert preview.dry_run and preview.steps_dropped == [2, 4] and preview.bytes_freed > 0
    assert composite_store.steps() == [2, 4, 6]
    after = sorted(
        (p.relative_to(root), p.stat().st_size) for p in root.rglob("*") if p.is_file() and p.name != "lock"
    )
    assert [name for name, _ in after if "catalog" not in str(name)] == [
        name for name, _ in listing if "catalog" not in str(name)
    ]
    real = composite_store.gc(keep_last=1, grace=0)
    assert (real.blobs_freed, real.bytes_freed, real.steps_dropped) == (
        preview.blobs_freed, preview.bytes_freed, preview.steps_dropped,
    )  # fmt: skip


def test_orphans_younger_than_the_grace_period_survive_and_older_ones_go(composite_store):
    key, data = codec.encode(torch.arange(7.0))
    composite_store.objects.put_if_absent(blob_name(key), data)
    now = time.time()
    young = composite_store.gc(grace=3600, now=now)
    assert young.blobs_spared == 1 and young.blobs_freed == 0
    assert composite_store.objects.exists(blob_name(key))
    old = composite_store.gc(grace=3600, now=now + 7200)  # the fake clock is two hours later
    assert old.blobs_freed == 1 and not composite_store.objects.exists(blob_name(key))
    assert composite_store.steps() == [2, 4, 6]


def test_gc_refuses_to_drop_every_step_unless_told(composite_store):
    with pytest.raises(BadInputError, match="drop every step"):
        composite_store.gc(keep_last=0, grace=0)
    assert composite_store.steps() == [2, 4, 6]
    report = composite_store.gc(keep_last=0, grace=0, allow_empty=True)
    assert composite_store.steps() == [] and report.steps_dropped == [2, 4, 6]
    assert list(composite_store.objects.list("packs/")) == []


def test_gc_refuses_to_run_when_a_kept_step_misses_a_pack(composite_store):
    victim = sorted(composite_store.catalog.packs_of_steps([6]))[0]
    composite_store.objects.delete(pack_name(victim))
    with pytest.raises(CorruptError, match="verify"):
        composite_store.gc(keep_last=1, grace=0)
    assert composite_store.steps() == [2, 4, 6]


def test_gc_refuses_while_a_kept_manifest_is_unreadable_as_verify_reports_it(composite_store, run):
    root = Path(composite_store.objects.root)
    assert composite_store.catalog.is_recorded(4)  # gc keeps it by its rows, read before the damage
    path = root / manifest_name(4)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the zstd frame
    path.write_bytes(bytes(data))
    packs = sorted(p.name for p in (root / "packs").rglob("*") if p.is_file())

    assert any(manifest_name(4) in p for p in composite_store.verify(deep=False).manifest_problems)
    for rules in ({}, {"keep_steps": [4, 6]}):
        with pytest.raises(CorruptError, match=f"gc will not run.*{manifest_name(4)}"):
            composite_store.gc(grace=0, **rules)
    gc = run("--store", root, "gc", "--grace", "0")
    assert gc.returncode == 4 and manifest_name(4) in gc.stderr and "gc will not run" in gc.stderr
    assert composite_store.steps() == [2, 4, 6]
    assert sorted(p.name for p in (root / "packs").rglob("*") if p.is_file()) == packs
    # A step gc drops is never read: its manifest goes whatever it holds.
    assert composite_store.gc(keep_last=1, grace=0).steps_dropped == [2, 4]


def test_gc_reports_a_kept_step_whose_manifest_is_gone_as_verify_does(composite_store):
    root = Path(composite_store.objects.root)
    composite_store.close()
    (root / manifest_name(2)).unlink()
    store = ckptstore.open(root)
    if not sync.catalog_is_shared(store.objects):
        # A catalog of its own (a store with a key) takes it for a gc elsewhere: neither reports it.
        assert store.steps() == [4, 6] and store.verify(deep=False).ok
        assert store.gc(grace=0).steps_kept == [4, 6]
        return
    assert store.steps() == [2, 4, 6]  # the shared catalog keeps it: damage, not a gc
    assert "step 2 has no manifest" in " ".join(store.verify(deep=False).catalog_problems)
    with pytest.raises(CorruptError, match=f"{manifest_name(2)}: it is gone"):
        store.gc(grace=0)
    store.delete(2)  # what the error says to do: the step goes, and gc runs again
    store.gc(grace=0)
    assert store.steps() == [4, 6] and store.verify().ok


def test_delete_drops_one_step_and_the_next_gc_frees_what_only_it_needed(composite_store, tmp_path):
    before = materialized(composite_store, 6, tmp_path / "before")
    composite_store.delete(4)
    assert composite_store.steps() == [2, 6]
    with pytest.raises(NotFoundError):
        composite_store.materialize(4, tmp_path / "four")
    with pytest.raises(NotFoundError, match="step 4 does not exist"):
        composite_store.delete(4)
    composite_store.gc(grace=0)
    assert composite_store.verify().ok
    assert same(materialized(composite_store, 6, tmp_path / "after"), before)


def test_verify_reports_orphans_as_information_not_problems(composite_store):
    key, data = codec.encode(torch.ones(3))
    composite_store.objects.put_if_absent(blob_name(key), data)
    report = composite_store.verify()
    assert report.ok and report.orphans == [key]


@pytest.mark.parametrize("damage", ["truncate", "append", "swap"])
def test_verify_detects_truncation_trailing_garbage_and_a_pack_under_another_name(composite_store, damage):
    root = Path(composite_store.objects.root)
    blobs = sorted((p for p in (root / "packs").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    target = blobs[-1]
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:-10])
    elif damage == "append":
        target.write_bytes(target.read_bytes() + b"junk")
    else:
        same_size = [p for p in blobs[:-1] if p.stat().st_size == target.stat().st_size] or blobs[:1]
        target.write_bytes(same_size[0].read_bytes())
    report = composite_store.verify(deep=True)
    assert [p.blob for p in report.problems] == [target.name]
    if damage != "swap":
        assert [p.blob for p in composite_store.verify(deep=False).problems] == [target.name]


# -- crashes and concurrency -------------------------------------------------------------------


DIE_AT = ["blob", "manifest", "catalog"]


@pytest.fixture(scope="module")
def killed_commits(tmp_path_factory, store_key) -> dict[str, tuple[Path, int, str]]:
    """A die-at worker per stage, the three started together (each its own interpreter and
    store): each stage's store, exit code and stderr."""
    root = tmp_path_factory.mktemp("die-at")
    procs = {}
    for stage in DIE_AT:
        with open(root / f"{stage}.err", "w") as err:  # a file: no pipe to fill while another is awaited
            procs[stage] = subprocess.Popen([sys.executable, str(WORKER), "die-at", str(root / stage), stage],
                                            stdout=subprocess.DEVNULL, stderr=err, env=child_env())  # fmt: skip
    try:
        codes = {stage: proc.wait(timeout=300) for stage, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()  # none outlives a timeout (a no-op once it has ended)
    return {stage: (root / stage, codes[stage], (root / f"{stage}.err").read_text()) for stage in DIE_AT}


@pytest.mark.parametrize("stage", DIE_AT)
@pytest.mark.either_key(job="killed_commits")  # one set of workers, with a key or without (conftest)
def test_a_commit_killed_at_any_stage_leaves_the_previous_step_and_its_own_only_once_its_manifest_is_written(
    killed_commits, tmp_path, stage
):
    store_path, returncode, stderr = killed_commits[stage]
    assert returncode == 9, stderr[-3000:]
    store = ckptstore.open(store_path)
    # The manifest is the commit point: killed before it, step 2 is not there; after it, it is.
    assert store.steps() == ([1] if stage == "blob" else [1, 2])
    report = store.verify()
    assert report.ok, (
        [p.describe() for p in report.problems] + report.catalog_problems + report.manifest_problems
    )
    # The surviving step resumes exactly: same engine state as a fresh commit of step 1.
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=3)
    train(engine, batches(1))
    fresh = ckptstore.open(tmp_path / "fresh")
    fresh.commit(engine, step=1)
    assert same(materialized(store, 1, tmp_path / "a"), materialized(fresh, 1, tmp_path / "b"))
    store.gc(grace=0)  # the next gc cleans the leftovers
    assert store.verify().orphans == []


@pytest.mark.either_key  # multi-process: with a key or without, alternating (conftest)
def test_kill_9_during_commits_never_leaves_a_broken_step(tmp_path):
    rng = random.Random(7)
    store_path = tmp_path / "store"
    # The four committers start at once and build their engines side by side; each opens the
    # store only when its trial begins (a line on its stdin).
    procs = [subprocess.Popen([sys.executable, str(WORKER), "commit-loop", str(store_path), "--wait"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              env=child_env()) for _ in range(4)]  # fmt: skip
    try:
        for trial, proc in enumerate(procs):
            proc.stdin.write("go\n")
            proc.stdin.flush()
            while (line := proc.stdout.readline()) and line.strip() != "ready":
                pass  # DeepSpeed's own start-up lines
            assert line.strip() == "ready"
            time.sleep(rng.uniform(0.0, 1.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            store = ckptstore.open(store_path)
            report = store.verify()
            assert report.ok, (trial, [p.describe() for p in report.problems], report.catalog_problems)
            for step in store.steps()[-2:]:
                store.materialize(step, tmp_path / "out", force=True)
            store.gc(keep_last=0, grace=0, allow_empty=True)  # next trial starts from an empty store
            store.close()
    finally:
        for proc in procs:
            proc.kill()  # none outlives a failed trial (a no-op once it has ended)


@pytest.mark.either_key  # multi-process: with a key or without, alternating (conftest)
def test_gc_and_commits_in_parallel_processes_lose_nothing(tmp_path):
    store_path, dumps = tmp_path / "store", tmp_path / "dumps"
    dumps.mkdir()
    ckptstore.open(store_path).close()
    committer = subprocess.Popen([sys.executable, str(WORKER), "commit-n", str(store_path), "10", str(dumps)],
                                 stderr=subprocess.PIPE, text=True, env=child_env())  # fmt: skip
    last = str(dumps / "10.pt")  # gc runs over and over until the committer has saved its last step
    collector = subprocess.Popen([sys.executable, str(WORKER), "gc-loop", str(store_path), "120", last],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())  # fmt: skip
    assert committer.wait(timeout=300) == 0, committer.stderr.read()[-3000:]
    out, err = collector.communicate(timeout=300)
    assert collector.returncode == 0, err[-3000:]
    assert int(out.split()[-1]) > 1  # gc really ran alongside the commits

    store = ckptstore.open(store_path)
    assert store.verify(deep=True).ok
    assert store.steps()[-1] == 10
    for step in store.steps():
        sources = store.sources(step)
        store.materialize(step, tmp_path / f"out{step}")
        engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=5, num_layers=3)
        engine.load_checkpoint(str(tmp_path / f"out{step}"))
        from ckptstore.deepspeed.extract import extract
        from ckptstore.layers import layer_of

        expected = {source: torch.load(dumps / f"{source}.pt") for source in set(sources.values())}
        for piece in extract(engine).pieces:
            reference = expected[sources[layer_of(piece.name)]][(piece.name, piece.kind)]
            assert torch.equal(piece.tensor, reference), (step, piece.name, piece.kind)


def test_a_gc_killed_half_way_is_finished_by_the_next_one(tmp_path):
    store_path = tmp_path / "store"
    store = ckptstore.open(store_path)
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=3)
    data = batches(6)
    # Six steps: step 6's deltas need step 5's packs (its chain restarted there), not older ones.
    for step in range(1, 7):
        train(engine, data[step - 1 : step])
        store.commit(engine, step=step)
    before = materialized(store, 6, tmp_path / "before")
    result = worker("gc-die-after", store_path, 3)
    assert result.returncode == 9, result.stderr[-3000:]
    half = store.verify()
    assert half.ok  # the dropped steps' records went first; what is left are orphans
    assert store.steps() == [6] and half.orphans
    store.gc(grace=0)
    final = store.verify(deep=True)
    assert final.ok and final.orphans == []
    assert same(materialized(store, 6, tmp_path / "after"), before)


@pytest.mark.either_key  # multi-process: with a key or without, alternating (conftest)
def test_gc_over_ten_thousand_steps_keeps_exactly_what_the_kept_steps_need(tmp_path):
    from tools.bench_gc import build_synthetic_store

    store = build_synthetic_store(tmp_path / "store", steps=10_000, layers=40)
    started = time.perf_counter()
    report = store.gc(keep_last=5, grace=0)
    elapsed = time.perf_counter() - started
    print(f"gc over 10,000 steps x 40 layers: {elapsed:.2f} s")
    assert store.steps() == list(range(9995, 10_000))
    assert len(report.steps_dropped) == 9995
    assert store.verify(deep=False).ok
    remaining = {info.name.rsplit("/", 1)[-1] for info in store.objects.list("blobs/")}
    assert remaining == store.catalog.blobs_of_steps(store.steps())


def test_a_commit_that_raises_after_its_manifest_is_committed_all_the_same(
    composite_store, tmp_path, monkeypatch
):
    before = materialized(composite_store, 6, tmp_path / "before")

    def failing_record(*record, **rows):
        raise OSError("disk full while recording")

    monkeypatch.setattr(composite_store.catalog, "record_step", failing_record)
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=3, num_layers=3)
    with pytest.raises(OSError):
        composite_store.commit(engine, step=8)
    monkeypatch.undo()
    # Its manifest, the commit point, was written: the step is committed, and the next open lists it.
    reopened = ckptstore.open(composite_store.objects.root)
    assert reopened.steps() == [2, 4, 6, 8]
    assert reopened.verify().ok
    assert same(materialized(reopened, 6, tmp_path / "after"), before)
    reopened.materialize(8, tmp_path / "eight")


def test_a_commit_reusing_orphans_that_a_running_gc_is_sweeping_keeps_them(tmp_path):
    import threading

    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    train(engine, batches(1))
    store.commit(engine, step=1)
    store.delete(1)  # every pack of step 1 is now an orphan ...
    for info in store.objects.list("packs/"):
        os.utime(Path(store.objects.root) / info.name, (1, 1))  # ... and an old one

    sweeping, release = threading.Event(), threading.Event()

    def collect_slowly():
        collector_store = ckptstore.open(tmp_path / "store")  # each thread its own connection
        delete = collector_store.objects.delete

        def slow_delete(name):
            if name.startswith("packs/"):
                sweeping.set()
                release.wait(timeout=60)
            delete(name)

        collector_store.objects.delete = slow_delete
        collector_store.gc(grace=3600)

    collector = threading.Thread(target=collect_slowly)
    collector.start()
    assert sweeping.wait(timeout=60)  # gc has marked the orphans and started deleting them
    committed = threading.Thread(target=lambda: ckptstore.open(tmp_path / "store").commit(engine, step=2))
    committed.start()
    time.sleep(0.5)
    release.set()
    collector.join(timeout=60)
    committed.join(timeout=60)
    assert store.steps() == [2]
    report = store.verify()  # the commit wrote back what the gc had swept
    assert report.ok and report.orphans == []


def test_a_dropped_step_whose_layers_are_inherited_cannot_be_committed_again(composite_store):
    composite_store.gc(keep_last=1, grace=0)  # drops 2 and 4; step 6 inherits from 4
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=3)
    with pytest.raises(ckptstore.ConflictError, match="step 6 still uses layers it saved"):
        composite_store.commit(engine, step=4)
    composite_store.commit(engine, step=2)  # nothing inherits from step 2 any more
    assert composite_store.steps() == [2, 6] and composite_store.verify().ok
