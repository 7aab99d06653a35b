"""A local tier in front of S3: commits durable on node-local disk, uploaded later, nothing lost.

The store is a bucket on a loopback moto server; "S3 unreachable" is every request of the
tier's own boto3 client failing with a dropped connection (a before-send hook, the client
itself real). Another node is an empty catalog cache and no local tier.
"""

from __future__ import annotations

import filecmp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, ConflictError, NotFoundError, StorageError
from ckptstore.format import layout
from tests.moto_s3 import inject_faults
from tools.engines import batches, build_engine, free_port, train

DATA = batches(8)


@pytest.fixture
def node(machine):
    """Switch to the node called ``name`` (an empty catalog cache); returns its local tier's path."""
    return lambda name: machine(name).with_name(f"nvme-{name}")


def bucket_steps(s3) -> list[int]:
    return sorted(layout.parse_manifest_name(k[len("run/") :])[0] for k in s3.keys("run/manifests/"))


def local_bytes(path) -> int:
    return sum(
        f.stat().st_size
        for prefix in ("packs", "blobs", "files")
        if (path / prefix).exists()
        for f in (path / prefix).rglob("*")
        if f.is_file()
    )


def same_tree(a, b) -> bool:
    compared = filecmp.dircmp(a, b)
    if compared.left_only or compared.right_only or compared.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, compared.common_files, shallow=False)
    return not mismatch and not errors and all(same_tree(a / d, b / d) for d in compared.common_dirs)


@pytest.fixture(scope="module")
def engine():
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0)
    yield engine


@pytest.fixture
def quick_retries(monkeypatch):
    """Background uploads retry and look for new steps every few tens of milliseconds."""
    monkeypatch.setenv("CKPTSTORE_LOCAL_RETRY_FIRST", "0.05")
    monkeypatch.setenv("CKPTSTORE_LOCAL_RETRY_LONGEST", "0.2")
    monkeypatch.setenv("CKPTSTORE_LOCAL_POLL_SECONDS", "0.05")


def eventually(condition, what: str, within: float = 120.0) -> None:
    """Wait until ``condition()`` holds (uploads run on another thread); fail naming ``what``."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def test_commits_go_on_while_s3_is_unreachable_and_drain_uploads_them_later(
    s3, node, tmp_path, engine, quick_retries, caplog
):
    nvme = node("a")
    store = ckptstore.open(s3.uri(), local=nvme)  # uploads in the background
    outage = inject_faults(store.objects.remote.client, "*", "connection", times=None)
    for step in (1, 2, 3):
        train(engine, DATA[step - 1 : step])
        store.commit(engine, step)  # returns: the outage never reaches training
    assert bucket_steps(s3) == [] and not s3.keys("run/packs/")
    eventually(lambda: outage.answered > 0 and all(p.error for p in store.pending()), "an upload failing")
    assert [p.step for p in store.pending()] == [1, 2, 3]
    assert "uploads to s3://" in caplog.text and "are failing" in caplog.text  # said once, not per try
    assert caplog.text.count("are failing") == 1
    assert store.locations() == {1: "local", 2: "local", 3: "local"}
    expected = {
        step: store.materialize(step, tmp_path / f"here-{step}") for step in (1, 2, 3)
    }  # from the tier

    with pytest.raises(StorageError, match=r"steps 1, 2, 3 not uploaded to s3://"):
        store.drain()
    assert bucket_steps(s3) == []

    outage.over = True  # S3 is reachable again
    store.drain()
    assert bucket_steps(s3) == [1, 2, 3] and store.pending() == []
    store.close()

    node("b")  # another node: an empty cache, no local tier
    elsewhere = ckptstore.open(s3.uri(), create=False, local="")
    assert elsewhere.steps() == [1, 2, 3]
    for step in (1, 2, 3):
        out = elsewhere.materialize(step, tmp_path / f"there-{step}")
        assert same_tree(out, expected[step]), step
    assert elsewhere.verify().ok


def test_uploads_run_behind_training_and_a_commit_never_waits_for_them(s3, node, engine, quick_retries):
    with ckptstore.open(s3.uri(), local=node("a")) as store:
        store.commit(engine, 1)
        eventually(lambda: bucket_steps(s3) == [1], "step 1 in S3")
        eventually(lambda: store.locations() == {1: "both"}, "step 1 marked uploaded")
        store.commit(engine, 2, blocking=False).result()  # a non-blocking commit is found by polling
        eventually(lambda: bucket_steps(s3) == [1, 2], "step 2 in S3")


def test_the_next_open_on_the_node_uploads_what_a_finished_process_left(s3, node, engine, quick_retries):
    nvme = node("a")
    with ckptstore.open(s3.uri(), local=nvme, local_upload="drain") as store:
        store.commit(engine, 1)
        store.commit(engine, 2, layers=["model.layers.0"])
    assert bucket_steps(s3) == []  # the tier is the queue: it is on disk
    with ckptstore.open(s3.uri(), local=nvme) as store:
        eventually(lambda: bucket_steps(s3) == [1, 2], "steps 1 and 2 in S3")


def test_close_uploads_what_is_left_and_a_failure_there_names_the_drain_command(
    s3, node, engine, quick_retries, caplog
):
    nvme = node("a")
    store = ckptstore.open(s3.uri(), local=nvme)
    inject_faults(store.objects.remote.client, "*", "connection", times=None)
    store.commit(engine, 1)
    store.close()  # does not raise: the step is safe in the tier
    assert f"ckptstore drain --local {nvme}" in caplog.text and bucket_steps(s3) == []
    store = ckptstore.open(s3.uri(), local=nvme, local_upload="drain")
    store.commit(engine, 2)
    store.close()
    assert bucket_steps(s3) == []  # drain-only: close leaves uploading to drain


def test_a_backlog_past_local_max_bytes_makes_the_next_commit_wait_and_say_so_once(s3, node, engine, capfd):
    nvme = node("a")
    with ckptstore.open(s3.uri(), local=nvme, local_upload="drain", local_max_bytes=1) as store:
        store.commit(engine, 1)
        assert bucket_steps(s3) == []
        store.commit(engine, 2)  # waits for step 1's upload first
        assert bucket_steps(s3) == [1]
        store.commit(engine, 3)
        assert bucket_steps(s3) == [1, 2]
    assert capfd.readouterr().err.count("local_max_bytes=1: the commit waits") == 1


def counting_reads(objects) -> list[int]:
    """Count the bytes read through ``objects`` (an S3 store's own methods, wrapped)."""
    fetched = [0]

    def counted(read):
        def counting(*args, **kwargs):
            data = read(*args, **kwargs)
            fetched[0] += memoryview(data).nbytes
            return data

        return counting

    objects.get, objects.get_range = counted(objects.get), counted(objects.get_range)
    return fetched


def test_the_committing_node_reads_an_uploaded_step_from_its_tier_not_from_s3(s3, node, tmp_path, engine):
    store = ckptstore.open(s3.uri(), local=node("a"), local_upload="drain")
    train(engine, DATA[:1])
    store.commit(engine, 10)
    store.drain()
    assert store.locations() == {10: "both"}
    fetched = counting_reads(store.objects.remote)
    store.materialize(10, tmp_path / "out")
    restored = build_engine("llama", zero_stage=1, dtype="bf16", seed=5)
    store.restore(restored, 10)
    store.export(10, tmp_path / "hf")
    assert fetched[0] == 0
    store.close()


def test_the_report_shows_how_long_each_upload_from_the_tier_took(s3, node, engine):
    nvme = node("a")
    with ckptstore.open(s3.uri(), local=nvme, local_upload="drain", local_keep=3) as store:
        for step in (1, 2, 3):
            train(engine, DATA[:1])
            store.commit(engine, step)
        assert store.report().upload_seconds == [None, None, None]  # not uploaded yet
        store.drain()
        (nvme / "tier" / "uploaded" / f"{3:012d}").write_bytes(b"")  # as older ckptstores marked it
        figures = store.report()
    assert all(seconds > 0 for seconds in figures.upload_seconds[:2]) and figures.upload_seconds[2] is None
    assert all(seconds > 0 for seconds in figures.commit_seconds)


def test_local_keep_holds_about_two_steps_locally_while_s3_holds_all_five(s3, node, engine, monkeypatch):
    # Whole pieces: with deltas the tier also holds the older packs the kept steps' deltas need.
    monkeypatch.setenv("CKPTSTORE_DELTA_CHAIN", "1")
    nvme = node("a")
    store = ckptstore.open(s3.uri(), local=nvme, local_keep=2, local_upload="drain")
    sizes = []
    for step in range(1, 6):
        train(engine, DATA[step : step + 1])  # every tensor changes
        sizes.append(store.commit(engine, step).bytes_added)
        store.drain()
    assert bucket_steps(s3) == [1, 2, 3, 4, 5]
    assert store.steps() == [1, 2, 3, 4, 5]
    assert store.locations() == {1: "store", 2: "store", 3: "store", 4: "both", 5: "both"}
    held = local_bytes(nvme)
    assert 0.9 * (sizes[3] + sizes[4]) <= held <= 1.1 * (sizes[3] + sizes[4]), (held, sizes)
    print(f"local tier holds {held} bytes; the five steps added {sum(sizes)}")
    store.close()

    # a step pruned from the tier is read from S3 on this node, and everything still verifies
    again = ckptstore.open(s3.uri(), local=nvme, local_keep=2, local_upload="drain")
    assert again.steps() == [1, 2, 3, 4, 5]
    assert again.state_dict(1).keys() == again.state_dict(5).keys()
    again.close()
    assert ckptstore.open(s3.uri(), local="").verify().ok


def test_a_tier_fronts_one_store_and_is_not_a_store_of_its_own(s3, node, tmp_path):
    nvme = node("a")
    ckptstore.open(s3.uri(), local=nvme).close()
    with pytest.raises(BadInputError, match="is the local tier of s3://"):
        ckptstore.open(s3.uri("other"), local=nvme)
    with pytest.raises(BadInputError, match="is the local tier of s3://.*local="):
        ckptstore.open(nvme)
    ckptstore.open(tmp_path / "plain").close()
    with pytest.raises(BadInputError, match="a store of its own"):
        ckptstore.open(s3.uri(), local=tmp_path / "plain")
    with pytest.raises(BadInputError, match="gc works on the store itself"):
        ckptstore.open(s3.uri(), local=nvme).gc(keep_last=1)


def test_only_an_open_to_commit_makes_a_tier_one_to_read_names_the_missing_one(tmp_path):
    ckptstore.open(tmp_path / "store").close()
    typo = tmp_path / "nvme-typo" / "tier"
    with pytest.raises(NotFoundError, match=f"no local tier at {typo}"):
        ckptstore.open(tmp_path / "store", create=False, local=typo)
    assert not typo.parent.exists()
    ckptstore.open(tmp_path / "store", local=typo, local_upload="drain").close()  # create=True, as a commit's
    assert (typo / layout.TIER_REMOTE).is_file()
    with ckptstore.open(tmp_path / "store", create=False, local=typo) as store:
        assert store.tier is not None and store.tier.local.root == typo


def test_ckptstore_local_in_the_environment_gives_every_open_a_tier(s3, node, monkeypatch, engine):
    nvme = node("a")
    monkeypatch.setenv("CKPTSTORE_LOCAL", str(nvme))
    store = ckptstore.open(s3.uri())
    assert store.tier is not None and store.tier.local.root == nvme
    store.close()
    assert ckptstore.open(s3.uri(), local="").tier is None


def test_a_job_killed_after_a_commit_loses_nothing_drain_uploads_it_later(s3, node, tmp_path, run):
    nvme, dump = node("a"), tmp_path / "weights.pt"
    worker = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("tier_worker.py")), s3.uri(), str(nvme), str(dump)],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "MASTER_PORT": str(free_port())},
    )  # fmt: skip
    try:
        assert "committed" in iter(lambda: worker.stdout.readline().strip(), "")  # DeepSpeed prints too
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    assert bucket_steps(s3) == []

    listed = run("--local", str(nvme), "log")
    assert listed.returncode == 0 and "local" in listed.stdout.splitlines()[1], listed.stdout
    drained = run("--local", str(nvme), "drain")
    assert drained.returncode == 0 and f"uploaded step 1 to {s3.uri()}" in drained.stdout, drained.stderr
    assert bucket_steps(s3) == [1]
    assert "nothing to upload" in run("--local", str(nvme), "drain").stdout

    node("b")  # another node restores it equal
    elsewhere = ckptstore.open(s3.uri(), create=False, local="")
    restored = build_engine("llama", zero_stage=1, dtype="bf16", seed=5)
    elsewhere.restore(restored, 1)
    expected = torch.load(dump)
    for name, param in restored.module.named_parameters():
        assert torch.equal(param.detach().float(), expected[name]), name


def test_drain_needs_the_tier_and_exits_7_while_the_store_cannot_be_reached(
    s3, node, run, monkeypatch, engine
):
    assert run("drain").returncode == 2  # no --local, no CKPTSTORE_LOCAL
    nvme = node("a")
    with ckptstore.open(s3.uri(), local=nvme, local_upload="drain") as store:
        store.commit(engine, 1)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("CKPTSTORE_S3_MAX_ATTEMPTS", "1")
    unreachable = run("--local", str(nvme), "drain")
    assert (
        unreachable.returncode == 7
        and "error:" in unreachable.stderr
        and "Traceback" not in unreachable.stderr
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint)
    assert run("--local", str(nvme), "drain").returncode == 0 and bucket_steps(s3) == [1]


def test_an_upload_that_broke_off_is_never_published_half_and_the_next_drain_finishes_it(
    s3, node, tmp_path, engine
):
    store = ckptstore.open(s3.uri(), local=node("a"), local_upload="drain")
    store.commit(engine, 1)
    puts = []

    def after_two_packs(request) -> bool:  # two packs go up, then the connection drops for good
        puts.append(request.url)
        return len(puts) > 2

    breaks = inject_faults(
        store.objects.remote.client, "PutObject", "connection", times=None, when=after_two_packs
    )
    with pytest.raises(StorageError, match="step 1 not uploaded"):
        store.drain()
    assert s3.keys("run/packs/") and bucket_steps(s3) == []  # some packs, no manifest
    breaks.over = True
    assert store.drain().uploaded[0].found >= 1  # the packs already there are not sent again
    assert bucket_steps(s3) == [1]
    assert ckptstore.open(s3.uri(), local="").verify().ok


def test_a_step_another_writer_put_in_s3_first_stays_local_and_drain_says_so(s3, node, engine):
    with ckptstore.open(s3.uri(), local=node("a"), local_upload="drain") as store:
        store.commit(engine, 7)
        other = ckptstore.open(s3.uri(), local="")
        train(engine, DATA[:1])
        other.commit(engine, 7)  # a second job writing the same store
        with pytest.raises(ConflictError, match="step 7 not uploaded.*another commit of step 7"):
            store.drain()
        assert [p.step for p in store.pending()] == [7]


def test_non_blocking_commits_and_dcp_saves_land_in_the_tier_and_drain_like_any_other(s3, node, engine):
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import StoreReader, StoreWriter
    from tests.test_dcp_store import emptied, training_state

    nvme = node("a")
    with ckptstore.open(s3.uri(), local=nvme, local_upload="drain") as store:
        store.commit(engine, 1, blocking=False).result()
        assert store.locations() == {1: "local"} and bucket_steps(s3) == []
        store.drain()
    with ckptstore.open(s3.uri("dcp"), local=node("dcp"), local_upload="drain") as store:
        state = training_state()
        dcp.save(state, storage_writer=StoreWriter(store, step=3), no_dist=True)
        assert store.locations() == {3: "local"} and not s3.keys("dcp/manifests/")
        store.drain()
    node("b")
    with ckptstore.open(s3.uri("dcp"), create=False, local="") as elsewhere:
        loaded = emptied(state)
        dcp.load(loaded, storage_reader=StoreReader(elsewhere, step=3), no_dist=True)
        assert all(torch.equal(loaded["model"][k], v) for k, v in state["model"].items())
    assert bucket_steps(s3) == [1]


def test_two_ranks_on_two_nodes_each_upload_their_own_share_and_the_step_lands_whole(
    s3, tmp_path, monkeypatch
):
    from tests.test_many_ranks import torchrun

    monkeypatch.setenv("CKPTSTORE_STORE", s3.uri())  # the torchrun children inherit the endpoint too
    for rank, observed in enumerate(torchrun("tiered", tmp_path)):
        assert observed["locations_after_commit"] == {"2": "local"}, rank  # rank 1's node got the manifest
        assert observed["pending"] == [], rank
        assert observed["ranks_of_local_packs"] == [rank], rank  # each node holds (and sent) its own packs
        assert observed["bucket_steps"] == [2, 3], rank
        assert observed["wrong"] == [], rank  # the bucket holds exactly each rank's state
    assert ckptstore.open(s3.uri(), local="").verify().ok


def test_a_dcp_save_on_two_nodes_is_uploaded_by_each_node_and_published_by_rank_zeros(
    s3, tmp_path, monkeypatch, run
):
    from tests.dcp_runs import assert_same_state, load, run_job

    monkeypatch.setenv("CKPTSTORE_LOCAL", str(tmp_path / "nvme-{rank}"))  # a node per rank
    monkeypatch.setenv("CKPTSTORE_LOCAL_UPLOAD", "drain")  # nothing goes up until the drains below
    spec = f"store:{s3.uri()}:3"
    run_job(["train-save", "--steps", 3, "--save", spec, "--dump", tmp_path / "saved.pt"], 2, tmp_path)
    assert bucket_steps(s3) == []
    node1 = run("--local", tmp_path / "nvme-1", "drain")  # rank 1's node: its packs, not the manifest
    assert node1.returncode == 0 and "uploaded rank 1's share of step 3" in node1.stdout, node1
    assert bucket_steps(s3) == [] and s3.keys("run/packs/")
    node0 = run("--local", tmp_path / "nvme-0", "drain")
    assert node0.returncode == 0 and "uploaded step 3" in node0.stdout, node0
    assert bucket_steps(s3) == [3]

    monkeypatch.delenv("CKPTSTORE_LOCAL")
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "cache-elsewhere"))
    run_job(["dump-full", "--load", spec, "--out", tmp_path / "loaded.pt"], None, tmp_path)
    assert assert_same_state(load(tmp_path / "saved.pt"), load(tmp_path / "loaded.pt")) > 0


def test_a_job_restarted_during_an_outage_opens_on_its_tier_and_commits_on(
    s3, node, monkeypatch, engine, caplog
):
    from tools.netproxy import Proxy

    nvme = node("a")
    with Proxy.for_endpoint(s3.endpoint) as link:
        monkeypatch.setenv("AWS_ENDPOINT_URL", link.endpoint)
        monkeypatch.setenv("CKPTSTORE_S3_MAX_ATTEMPTS", "1")
        with ckptstore.open(s3.uri(), local=nvme, local_upload="drain") as store:
            store.commit(engine, 1)
            store.drain()
        link.cut()  # S3 goes away; the job restarts
        with pytest.raises(StorageError):
            ckptstore.open(s3.uri(), local="")  # without a tier there is nothing to work on
        with pytest.raises(StorageError):
            ckptstore.open(s3.uri(), local=node("fresh"))  # a tier that never fronted the store
        store = ckptstore.open(s3.uri(), local=nvme, local_upload="drain")
        assert "cannot be reached" in caplog.text
        assert store.steps() == [1]  # what S3 had is still listed
        train(engine, DATA[:1])
        store.commit(engine, 2)
        assert store.locations() == {1: "both", 2: "local"}
        with pytest.raises(StorageError, match="step 2 not uploaded"):
            store.drain()
        link.restore()
        store.drain()
        store.close()
    assert bucket_steps(s3) == [1, 2]


def test_a_new_node_commits_into_its_tier_while_s3_is_away_and_asks_it_nothing(s3, node, engine):
    node("a")  # another node committed steps 1 and 2 straight to S3
    with ckptstore.open(s3.uri(), local="") as elsewhere:
        elsewhere.commit(engine, 1)
        train(engine, DATA[:1])
        elsewhere.commit(engine, 2)
        layers = list(elsewhere.sources(2))
    store = ckptstore.open(s3.uri(), local=node("b"), local_upload="drain")  # a new node
    assert store.steps() == [1, 2]
    outage = inject_faults(store.objects.remote.client, "*", "connection", times=None)
    with pytest.raises(
        BadInputError, match=r"step 2, the one before step 3, is not in this node's local tier"
    ):
        store.commit(engine, 3, layers=layers[:1])  # its base is only in S3: said, not asked
    store.commit(engine, 3)  # a full commit needs nothing of step 2
    train(engine, DATA[1:2])
    report = store.commit(engine, 4, layers=layers[:1])  # step 3 is at hand: inherited from it
    assert set(report.layers_inherited.values()) == {3}
    assert outage.seen == []  # not one request reached (or tried to reach) S3
    outage.over = True
    store.drain()
    assert bucket_steps(s3) == [1, 2, 3, 4]
    store.close()


def test_a_step_deleted_in_s3_and_committed_again_through_the_tier_goes_up_as_the_new_one(s3, node, engine):
    """Rewinding a run: the tier still holds (and has marked uploaded) the old step, which the
    store's deletion record buries; the new commit of it is a newer generation, uploaded."""
    nvme = node("a")
    with ckptstore.open(s3.uri(), local=nvme, local_upload="drain") as store:
        for step in (1, 2):
            train(engine, DATA[step : step + 1])
            store.commit(engine, step)
        store.drain()
    with ckptstore.open(s3.uri(), local="") as direct:
        direct.delete(2)
    with ckptstore.open(s3.uri(), local=nvme, local_upload="drain") as store:
        assert store.steps() == [1]
        train(engine, DATA[5:6])
        store.commit(engine, 2)
        again = store.state_dict(2)
        store.drain()
    node("b")
    with ckptstore.open(s3.uri(), local="") as fresh:
        assert fresh.steps() == [1, 2]
        assert all(torch.equal(t, again[name]) for name, t in fresh.state_dict(2).items())
        assert fresh.verify(deep=False).buried_manifests == []
