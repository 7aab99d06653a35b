"""S3 stores end to end: the bucket alone is the store, and any machine with its URI restores.

A "machine" here is a catalog cache (CKPTSTORE_CACHE) that starts empty, as on a fresh node.
The bucket lives on a loopback moto server; faults are injected into botocore's request path.
"""

from __future__ import annotations

import shutil

import pytest

import ckptstore
from ckptstore.errors import ConflictError, NotFoundError, StorageError
from ckptstore.format.layout import manifest_name
from tests.dist_worker import matches_store
from tests.moto_s3 import inject_faults
from tests.test_many_ranks import torchrun
from tools.engines import batches, build_engine, train

DATA = batches(6)


def manifests(s3) -> list[str]:
    return [key for key in s3.keys("run/manifests/")]


def test_a_step_committed_on_one_machine_resumes_bit_exactly_on_another(s3, machine, tmp_path):
    cache_a = machine("a")
    store = ckptstore.open(s3.uri())
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0)
    train(engine, DATA[:3])
    store.commit(engine, step=3)
    uninterrupted = train(engine, DATA[3:])
    store.commit(engine, step=6, layers=["model.layers.1"])
    log_a = store.log()
    store.close()
    shutil.rmtree(cache_a)  # machine A is gone: the bucket alone must suffice

    machine("b")
    elsewhere = ckptstore.open(s3.uri(), create=False)
    assert elsewhere.steps() == [3, 6]
    assert elsewhere.sources(6)["model.layers.1"] == 6 and elsewhere.sources(6)["model.layers.0"] == 3
    assert elsewhere.log() == log_a  # even the bytes each step added
    assert elsewhere.verify().ok
    elsewhere.materialize(3, tmp_path / "out")
    resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=99)
    resumed.load_checkpoint(str(tmp_path / "out"))
    assert resumed.global_steps == 3
    assert train(resumed, DATA[3:]) == uninterrupted


@pytest.mark.either_key  # multi-process: with a key or without, alternating (conftest)
def test_two_ranks_commit_into_s3_and_another_machine_resumes_exactly(s3, machine, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_STORE", s3.uri())  # the torchrun children inherit the endpoint too
    for rank, observed in enumerate(torchrun("s3", tmp_path)):
        assert observed["steps"] == [3, 6], rank  # each rank's own index knows both steps
        assert observed["shared_cache_steps"] == [3, 6], rank
        assert observed["sources"]["model.layers.1"] == 6 and observed["sources"]["model.layers.0"] == 3
        assert observed["loaded_step"] == 3, rank
        assert observed["resumed"] == observed["reference"], rank
        # restore: no shared directory, an empty cache, and only this rank's share fetched
        restored = observed["restore"]
        assert restored["step"] == 3 and restored["losses"] == observed["reference"], rank
        assert restored["fetched"] <= 0.6 * restored["step_bytes"], (rank, restored)
        print(
            f"rank {rank} fetched {restored['fetched'] / restored['step_bytes']:.3f}x of step 3's pack bytes"
        )
    machine("c")
    store = ckptstore.open(s3.uri(), create=False)
    assert store.steps() == [3, 6]
    store.materialize(6, tmp_path / "w1", world_size=1)
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=99, num_layers=3)
    engine.load_checkpoint(str(tmp_path / "w1"))
    assert matches_store(engine, store, 6) == []


@pytest.fixture
def small_engine():
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    train(engine, DATA[:2])
    return engine


def test_the_manifest_is_the_commit_point(s3, machine, small_engine, monkeypatch):
    machine("a")
    store = ckptstore.open(s3.uri())
    # Dies before its manifest: not a step anywhere; its packs are orphans for gc.
    inject_faults(
        store.objects.client, "PutObject", (403, "AccessDenied"), when=lambda r: "/manifests/" in r.url
    )
    with pytest.raises(StorageError):
        store.commit(small_engine, step=2)
    assert store.steps() == [] and manifests(s3) == []
    assert s3.keys("run/packs/")
    # Dies after its manifest, before the local index has it: committed, seen on every open.
    store = ckptstore.open(s3.uri())

    def crash(*_, **__):
        raise RuntimeError("killed after the manifest")

    monkeypatch.setattr(store.catalog, "record_step", crash)
    with pytest.raises(RuntimeError):
        store.commit(small_engine, step=2)
    assert manifests(s3) == ["run/" + manifest_name(2)]
    assert ckptstore.open(s3.uri()).steps() == [2]
    machine("b")
    assert ckptstore.open(s3.uri()).steps() == [2]


def test_transient_faults_during_commit_and_materialize_are_recovered(s3, machine, tmp_path):
    machine("a")
    store = ckptstore.open(s3.uri())
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=2)
    train(engine, DATA[:2])
    client = store.objects.client
    injected = [
        inject_faults(client, "PutObject", "connection"),
        inject_faults(client, "PutObject", (500, "InternalError")),
        inject_faults(client, "PutObject", (503, "SlowDown")),
        inject_faults(client, "PutObject", (409, "ConditionalRequestConflict")),
        inject_faults(client, "HeadObject", (503, "SlowDown")),
    ]
    store.commit(engine, step=2)
    uninterrupted = train(engine, DATA[2:4])
    assert all(fault.answered == 1 for fault in injected)

    machine("b")
    elsewhere = ckptstore.open(s3.uri())
    client = elsewhere.objects.client
    injected = [
        inject_faults(client, "GetObject", "connection"),
        inject_faults(client, "GetObject", (500, "InternalError")),
        inject_faults(client, "GetObject", (503, "SlowDown")),
    ]
    elsewhere.materialize(2, tmp_path / "out")
    assert all(fault.answered == 1 for fault in injected)
    resumed = build_engine("llama", zero_stage=1, dtype="fp32", seed=99, num_layers=2)
    resumed.load_checkpoint(str(tmp_path / "out"))
    assert train(resumed, DATA[2:4]) == uninterrupted


@pytest.mark.parametrize(
    ("fault", "error", "says"),
    [
        ((403, "AccessDenied"), StorageError, "access denied"),
        ((403, "InvalidAccessKeyId"), StorageError, "check the AWS credentials"),
        ((404, "NoSuchBucket"), NotFoundError, "does not exist"),
    ],
)
def test_permanent_faults_fail_the_commit_with_one_clear_error_and_record_nothing(
    s3, machine, small_engine, fault, error, says
):
    machine("a")
    store = ckptstore.open(s3.uri())
    inject_faults(store.objects.client, "PutObject", fault, times=None)
    with pytest.raises(error, match=says) as raised:
        store.commit(small_engine, step=2)
    assert "\n" not in str(raised.value) and s3.bucket in str(raised.value)
    assert store.steps() == [] and manifests(s3) == []
    machine("b")
    assert ckptstore.open(s3.uri()).steps() == []


def test_a_missing_bucket_fails_open_and_leaves_nothing_behind(s3, machine):
    cache = machine("a")
    with pytest.raises(NotFoundError, match="bucket ckpt-no-such-bucket does not exist"):
        ckptstore.open("s3://ckpt-no-such-bucket/run")
    assert not cache.exists()


def test_a_step_committed_elsewhere_since_open_is_never_overwritten(s3, machine, small_engine):
    machine("a")
    first = ckptstore.open(s3.uri())
    machine("b")
    second = ckptstore.open(s3.uri())
    first.commit(small_engine, step=5)
    committed = s3.client.get_object(Bucket=s3.bucket, Key="run/" + manifest_name(5))["Body"].read()
    train(small_engine, DATA[2:3])
    with pytest.raises(ConflictError, match="step 5 is already committed"):
        second.commit(small_engine, step=5)
    assert s3.client.get_object(Bucket=s3.bucket, Key="run/" + manifest_name(5))["Body"].read() == committed


def test_a_step_dropped_on_another_machine_disappears_on_the_next_open(s3, machine, small_engine, tmp_path):
    machine("a")
    store = ckptstore.open(s3.uri())
    store.commit(small_engine, step=2)
    train(small_engine, DATA[2:3])
    store.commit(small_engine, step=3, layers=["model.layers.0"])
    machine("b")
    assert ckptstore.open(s3.uri()).steps() == [2, 3]
    machine("a")
    store.delete(2)
    machine("b")
    elsewhere = ckptstore.open(s3.uri())
    assert elsewhere.steps() == [3]
    assert elsewhere.sources(3)["model.layers.1"] == 2  # still inherited
    elsewhere.materialize(3, tmp_path / "out")


def test_a_corrupt_cache_index_is_rebuilt_on_open(s3, machine, small_engine):
    cache = machine("a")
    ckptstore.open(s3.uri()).commit(small_engine, step=2)
    (index,) = cache.rglob("catalog.db")
    index.write_bytes(b"this is not a database" * 100)
    assert ckptstore.open(s3.uri()).steps() == [2]


def test_manifests_are_written_in_one_request_even_past_the_multipart_threshold(
    s3, machine, small_engine, monkeypatch
):
    # A real S3-compatible server let two racing multipart completions with If-None-Match both
    # succeed: a commit point must be one create-only PutObject. A multipart ETag ends in -<parts>.
    machine("a")
    monkeypatch.setenv("CKPTSTORE_S3_MULTIPART_THRESHOLD", "1")
    ckptstore.open(s3.uri()).commit(small_engine, step=1)
    etag = {key: s3.client.head_object(Bucket=s3.bucket, Key=key)["ETag"] for key in s3.keys("run/")}
    assert "-" not in etag["run/" + manifest_name(1)]
    assert all("-" in tag for key, tag in etag.items() if key.startswith("run/packs/"))


def two_layer_step_on_s3(s3) -> list[float]:
    """Step 1 of a 2-layer engine with layers of about 1 MB a pack (their entries lie past the
    first read of a pack, 64 KiB), committed to S3; the losses of two more steps after it."""
    store = ckptstore.open(s3.uri())
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2, hidden=96)
    train(engine, DATA[:1])
    store.commit(engine, step=1)
    store.close()
    return train(engine, DATA[1:3])


def gets_of(store) -> list[str]:
    """The URLs of every GET ``store`` sends from now on (a list that grows)."""
    gets = []
    store.objects.client.meta.events.register(
        "before-send.s3.GetObject", lambda request, **kwargs: gets.append(request.url)
    )
    return gets


def packs_of(store, step: int) -> set[str]:
    """The keys of the packs ``step`` reads (known once the fresh node has imported the step)."""
    return {ref.key for index in store.catalog.layer_packs(step) for ref in index.packs}


def test_a_fresh_node_materializes_and_exports_with_at_most_two_requests_a_pack(s3, machine, tmp_path):
    two_layer_step_on_s3(s3)
    machine("fresh")
    with ckptstore.open(s3.uri(), create=False) as fresh:
        gets = gets_of(fresh)
        fresh.materialize(1, tmp_path / "out")
        packs = packs_of(fresh, 1)
        pack_gets = [url for url in gets if "/packs/" in url]
        assert len(pack_gets) <= 2 * len(packs), (len(pack_gets), len(packs))
        assert len(gets) - len(pack_gets) <= 5, [url for url in gets if "/packs/" not in url]
        gets.clear()
        fresh.export(1, tmp_path / "hf")
        assert len([url for url in gets if "/packs/" in url]) <= 2 * len(packs)
    print(f"materialize: {len(pack_gets)} GETs for {len(packs)} packs")
    resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=9, num_layers=2, hidden=96)
    resumed.load_checkpoint(str(tmp_path / "out"))
    assert matches_store(resumed, ckptstore.open(s3.uri(), create=False), 1) == []


def test_a_fresh_node_restores_with_at_most_two_requests_a_pack(s3, machine):
    after = two_layer_step_on_s3(s3)
    machine("fresh")
    with ckptstore.open(s3.uri(), create=False) as fresh:
        gets = gets_of(fresh)
        resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=9, num_layers=2, hidden=96)
        assert fresh.restore(resumed)[0] == 1
        packs = packs_of(fresh, 1)
        pack_gets = [url for url in gets if "/packs/" in url]
        # One rank reads every pack: its index, then its entries in one request (not one a tensor).
        assert len(pack_gets) <= 2 * len(packs), (len(pack_gets), len(packs))
    print(f"restore: {len(pack_gets)} GETs for {len(packs)} packs")
    assert train(resumed, DATA[1:3]) == after


def test_a_fresh_node_reads_a_chain_of_deltas_with_at_most_two_requests_a_pack(s3, machine, tmp_path):
    store = ckptstore.open(s3.uri())
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2, hidden=96, lr=1e-4)
    for step in (1, 2, 3):
        train(engine, DATA[step - 1 : step])
        store.commit(engine, step=step)  # steps 2 and 3: deltas against the step before
    expected = store.state_dict(3, dtype=None)
    store.close()
    machine("fresh")
    with ckptstore.open(s3.uri(), create=False) as fresh:
        gets = gets_of(fresh)
        got = fresh.state_dict(3, dtype=None)
        pack_gets = [url for url in gets if "/packs/" in url]
        needed = {ref.key for index in fresh.catalog.layer_packs(3) for ref in index.all_packs}
        own = packs_of(fresh, 3)
        assert needed - own, "step 3's deltas need base packs"
        # Each own pack: its index, then its entries; each base pack: once, whole.
        assert len(pack_gets) <= 2 * len(own) + len(needed - own), (len(pack_gets), len(own), len(needed))
    assert got.keys() == expected.keys() and all(got[k].equal(expected[k]) for k in got)
