"""Authenticated stores: with a key, someone who can write the store but holds no key cannot
change what any step restores, add a step, or make gc delete what an authentic step needs.

Each attack is crafted as such a writer would: by writing the store's objects (and a local
store's ``catalog.db``) directly, never through ckptstore. With a key every one is refused or
ignored; the same attack on a store without a key documents today's limits there.
"""

from __future__ import annotations

import os
import sqlite3

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, CorruptError
from ckptstore.format import deletions, layout, manifest
from ckptstore.format.pack import PREAMBLE, Entry, index_bytes, parse_index
from ckptstore.model import StepRecord
from ckptstore.objects import open_objects
from tests.test_gc import load_checkpoint_files, same
from tools.engines import batches, train

KEY = bytes(range(7, 39))
LAYER = "model.layers.0"


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """The URI of a new store on each backend."""
    if request.param == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3").uri()


@pytest.fixture(params=[True, False], ids=["with-key", "without-key"])
def keyed(request) -> bool:
    return request.param


def open_store(uri: str, keyed: bool):
    return ckptstore.open(uri, key=KEY if keyed else None)


def commit_two_steps(uri: str, keyed: bool, engine) -> dict[int, dict]:
    """Commit steps 2 and 4 of ``engine``, one batch apart; what each restores before any attack."""
    store = open_store(uri, keyed)
    store.commit(engine, 2)
    train(engine, batches(1, seed=7))
    store.commit(engine, 4)
    truth = {step: store.state_dict(step) for step in (2, 4)}
    store.close()
    return truth


@pytest.fixture
def committed(where, keyed, zero1_engine):
    """A store holding steps 2 and 4, and what each restores before any attack."""
    return where, commit_two_steps(where, keyed, zero1_engine)


def attacker(uri: str):
    """The store's objects as someone with write access but no key sees them."""
    return open_objects(uri, create=False)


def read_record(objects, step: int, generation: int = 0) -> StepRecord:
    """A manifest decoded the way an attacker can: its tag, if any, is simply cut off."""
    data = objects.get(layout.manifest_name(step, generation))
    if data[4] == manifest.AUTHENTICATED_VERSION:
        data = data[:4] + bytes([manifest.MANIFEST_VERSION]) + data[5 + manifest.TAG_BYTES :]
    return manifest.decode(data)


def forge(objects, record: StepRecord, generation: int = 0) -> None:
    """Write ``record`` as ``record.step``'s manifest of ``generation``, tagged with random
    bytes when the store has a key (the best a writer without the key can do)."""
    data = manifest.encode(record)
    config = objects.get(layout.CONFIG)
    if b"key_check" in config:
        data = data[:4] + bytes([manifest.AUTHENTICATED_VERSION]) + os.urandom(32) + data[5:]
    name = layout.manifest_name(record.step, generation)
    objects.delete(name)
    objects.put_if_absent(name, data)


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def layer_weights(weights: dict) -> dict:
    return {name: tensor for name, tensor in weights.items() if name.startswith(f"{LAYER}.")}


def packs_on(objects) -> set[str]:
    return set(layout.list_packs(objects).found)


def test_a_manifest_that_repoints_a_step_is_ignored_with_a_key_and_obeyed_without(committed, keyed, tmp_path):
    uri, truth = committed
    warm = open_store(uri, keyed)  # this node's index already holds step 4
    before = load_checkpoint_files(warm.materialize(4, tmp_path / "before"))
    objects = attacker(uri)
    record = read_record(objects, 4)
    record.packs[LAYER] = read_record(objects, 2).packs[LAYER]
    record.layer_sources[LAYER] = 2
    forge(objects, record, generation=1)
    warm.close()

    store = open_store(uri, keyed)
    if keyed:
        assert store.steps() == [2, 4]
        assert same_weights(store.state_dict(4), truth[4])
        assert same(load_checkpoint_files(store.materialize(4, tmp_path / "after")), before)
        problems = store.verify(deep=False).manifest_problems
        assert len(problems) == 1 and "000000000004.1.json is not authentic" in problems[0]
    else:  # today's limit: without a key the forged generation is step 4's record
        assert same_weights(layer_weights(store.state_dict(4)), layer_weights(truth[2]))
        assert store.verify(deep=True).ok


def test_another_steps_manifest_replayed_under_a_newer_generation_is_ignored(committed, keyed):
    uri, truth = committed
    objects = attacker(uri)
    objects.put_if_absent(layout.manifest_name(4, 1), objects.get(layout.manifest_name(2)))
    store = open_store(uri, keyed)
    if keyed:
        assert same_weights(store.state_dict(4), truth[4])
        assert same_weights(store.state_dict(2), truth[2])
    else:  # without a key: step 4 is unreadable (the record names step 2)
        with pytest.raises(CorruptError, match="describes step 2"):
            store.state_dict(4)


def empty_record(step: int, like: StepRecord) -> StepRecord:
    return StepRecord(
        step=step, created_at=like.created_at, world_size=like.world_size,
        description=like.description, layer_sources={}, tensors=[], blobs=[],
    )  # fmt: skip


def test_fake_steps_are_not_steps_and_gc_will_not_count_them(committed, keyed):
    uri, truth = committed
    objects = attacker(uri)
    real = read_record(objects, 4)
    for step in range(5, 10):
        forge(objects, empty_record(step, real))
    packs = packs_on(objects)

    store = open_store(uri, keyed)
    if keyed:
        assert store.steps() == [2, 4]
        with pytest.raises(CorruptError, match="gc will not run"):
            store.gc(keep_last=5, grace=0)
        assert packs_on(objects) == packs
        assert len(store.verify(deep=False).manifest_problems) == 5
        assert same_weights(store.state_dict(2), truth[2])
    else:  # without a key: the five fakes are the five newest steps, and every real pack goes
        report = store.gc(keep_last=5, grace=0)
        assert report.steps_dropped == [2, 4] and not packs_on(objects)


def test_an_empty_newer_generation_cannot_make_gc_delete_a_steps_packs(committed, keyed):
    uri, truth = committed
    objects = attacker(uri)
    forge(objects, empty_record(4, read_record(objects, 4)), generation=1)
    packs = packs_on(objects)

    store = open_store(uri, keyed)
    store.gc(grace=0)
    if keyed:
        assert packs_on(objects) == packs
        assert same_weights(store.state_dict(4), truth[4])
    else:  # without a key: step 4 is the empty record, and its packs are swept
        assert len(packs_on(objects)) < len(packs)


def substitute_first_entry(objects, pack_key: str) -> None:
    """Replace the first tensor of a pack by other bytes under the same entry key: the pack's
    name, its index's contents and so its key stay as they were (what a second preimage of
    the entry key would let a writer do without a key)."""
    name = layout.pack_name(pack_key)
    data = objects.get(name)
    entries = parse_index(data)
    first = next(e for e in entries if e.kind == "fp32" and e.length > 1000)  # what state_dict reads
    blob = bytearray(data[first.offset : first.offset + first.length])
    blob[-1] ^= 0xFF  # the last payload byte: raw noise planes take it as they are
    data = data[: first.offset] + bytes(blob) + data[first.offset + first.length :]
    assert index_bytes(entries) == data[PREAMBLE.size : PREAMBLE.size + len(index_bytes(entries))]
    assert isinstance(first, Entry)
    objects.delete(name)
    objects.put_if_absent(name, data)


def test_a_substituted_tensor_inside_a_pack_is_refused_naming_the_pack(committed, keyed, tmp_path):
    uri, _ = committed
    objects = attacker(uri)
    ref = read_record(objects, 4).packs[LAYER].packs[0]
    substitute_first_entry(objects, ref.key)

    store = open_store(uri, keyed)
    with pytest.raises(CorruptError, match=ref.key):
        store.state_dict(4)
    with pytest.raises(CorruptError, match=ref.key):
        store.materialize(4, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    problems = store.verify(deep=True).problems
    assert [p.blob for p in problems] == [ref.key]


def test_a_planted_catalog_cannot_change_a_step_with_a_key(tmp_path, zero1_engine):
    """A local store keeps its catalog in its own folder, where a store writer can change its
    rows; a store with a key keeps none there and trusts only its authentic manifests."""
    for keyed in (False, True):
        uri = str(tmp_path / f"store-{keyed}")
        truth = commit_two_steps(uri, keyed, zero1_engine)
        catalog = tmp_path / f"store-{keyed}" / "catalog.db"
        assert catalog.exists() != keyed
        if keyed:  # the writer plants the catalog of the same steps, from another store
            catalog.write_bytes((tmp_path / "store-False" / "catalog.db").read_bytes())
        with sqlite3.connect(catalog) as db:
            db.execute(
                "UPDATE layer_packs SET packs = (SELECT packs FROM layer_packs WHERE step = 2 AND layer = ?) "
                "WHERE step = 4 AND layer = ?",
                (LAYER, LAYER),
            )
        if keyed:
            assert same_weights(open_store(uri, keyed).state_dict(4), truth[4])
        else:  # without a key the rows no longer match the digest kept with them
            with pytest.raises(CorruptError, match="rows of step 4 are not what its manifest says"):
                open_store(uri, keyed).state_dict(4)


def test_a_store_opens_only_with_the_key_it_was_created_with(tmp_path, run, monkeypatch):
    keyed = ckptstore.open(tmp_path / "keyed", key=KEY)
    assert b"blake3-keyed-128" in keyed.objects.get(layout.CONFIG)
    assert KEY.hex() not in keyed.objects.get(layout.CONFIG).hex()
    keyed.close()
    with pytest.raises(BadInputError, match="created with a key and opens only with it: pass key="):
        ckptstore.open(tmp_path / "keyed")
    with pytest.raises(BadInputError, match="not the key of the store"):
        ckptstore.open(tmp_path / "keyed", key=bytes(32))
    ckptstore.open(tmp_path / "plain").close()
    with pytest.raises(BadInputError, match="created without a key"):
        ckptstore.open(tmp_path / "plain", key=KEY)
    with pytest.raises(BadInputError, match="at least 32"):
        ckptstore.open(tmp_path / "short", key=b"short")

    key_file = tmp_path / "store.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o644)
    refused = run("--store", tmp_path / "keyed", "--key-file", key_file, "log")
    assert refused.returncode == 2 and "chmod 600" in refused.stderr and KEY.hex() not in refused.stderr
    key_file.chmod(0o600)
    assert run("--store", tmp_path / "keyed", "--key-file", key_file, "log").returncode == 0
    without = run("--store", tmp_path / "keyed", "log")
    assert without.returncode == 2 and "--key-file" in without.stderr
    monkeypatch.setenv("CKPTSTORE_KEY_FILE", str(key_file))
    assert run("--store", tmp_path / "keyed", "log").returncode == 0
    ckptstore.open(tmp_path / "keyed").close()


# -- rollback: a deleted step's manifest put back ----------------------------------------------


def test_a_deleted_steps_manifest_put_back_is_not_the_step_before_or_after_it_is_committed_again(
    committed, keyed, zero1_engine, machine
):
    uri, truth = committed
    objects = attacker(uri)
    old = layout.manifest_name(4)
    kept = objects.get(old)  # the writer keeps step 4's manifest (and its packs, which gc spares a while)
    machine("warm")
    store = open_store(uri, keyed)
    store.delete(4)
    objects.put_if_absent(old, kept)
    machine("fresh-1")
    assert open_store(uri, keyed).steps() == [2]

    train(zero1_engine, batches(1, seed=11))
    store.commit(zero1_engine, 4)  # rewinding a run: step 4 again, written above its deletion
    again = store.state_dict(4)
    store.close()
    assert not same_weights(again, truth[4])
    assert objects.exists(layout.manifest_name(4, 1)) and objects.get(old) == kept

    machine("fresh-2")
    fresh = open_store(uri, keyed)
    assert fresh.steps() == [2, 4] and same_weights(fresh.state_dict(4), again)
    report = fresh.verify(deep=False)
    assert report.ok and report.buried_manifests == [old] and report.buried_kept != keyed
    packs = packs_on(objects)
    fresh.gc(grace=0)
    if keyed:  # the buried manifest goes, and the packs only it named
        assert not objects.exists(old) and packs_on(objects) < packs
    else:  # the record alone is anyone's word: the manifest stays, and what it needs
        assert objects.exists(old) and packs_on(objects) == packs
    assert same_weights(fresh.state_dict(4), again)


def test_a_rollback_of_the_deletion_record_shows_in_verify_and_a_warm_node_keeps_the_newer_step(
    where, zero1_engine, machine
):
    """What a writer without the key can still do: roll back the deletion record and the newer
    manifest together, as a whole-store snapshot would. A fresh node then reads the old step
    (the README's limit); a node that read the newer one keeps it, and its verify says so."""
    truth = commit_two_steps(where, True, zero1_engine)
    objects = attacker(where)
    kept = objects.get(layout.manifest_name(4))
    machine("warm")
    store = open_store(where, True)
    store.delete(4)
    train(zero1_engine, batches(1, seed=13))
    store.commit(zero1_engine, 4)
    again = store.state_dict(4)
    store.close()

    records = [info.name for info in objects.list(layout.DELETIONS)]
    objects.delete_many(records)  # the record alone: the newer manifest still wins, verify tells
    machine("fresh-1")
    fresh = open_store(where, True)
    assert same_weights(fresh.state_dict(4), again)
    problems = fresh.verify(deep=False).manifest_problems
    assert len(problems) == 1 and "lacks that deletion" in problems[0]

    objects.delete(layout.manifest_name(4, 1))
    objects.put_if_absent(layout.manifest_name(4), kept)
    machine("fresh-2")
    assert same_weights(open_store(where, True).state_dict(4), truth[4])  # the limit
    machine("warm")
    warm = open_store(where, True)
    assert same_weights(warm.state_dict(4), again)
    problems = warm.verify(deep=False).manifest_problems
    assert any("older than generation 1 this node read before" in problem for problem in problems)


def plant_deletion(objects, deleted: dict[int, int], sequence: int = 0) -> None:
    """Write a deletion record saying ``deleted`` (step -> generation), create-only, as someone
    allowed to put objects but not to delete them can; tagged with random bytes when the store
    has a key."""
    name = layout.deletions_name(sequence)
    data = deletions.encode(deleted, name, objects.content_hash)
    if b"key_check" in objects.get(layout.CONFIG):
        data = b"CKPD" + bytes([deletions.AUTHENTICATED_VERSION]) + os.urandom(32) + data[5:]
    assert objects.put_if_absent(name, data)


def packs_of(objects, step: int) -> set[str]:
    return {ref.key for index in read_record(objects, step).packs.values() for ref in index.packs}


def test_a_planted_deletion_record_never_makes_gc_free_a_live_step(committed, keyed, run, tmp_path):
    """PutObject alone (no delete right) must not become deletion: the operator's routine gc
    after a planted record deletes neither step 4's manifest nor its packs."""
    uri, truth = committed
    objects = attacker(uri)
    manifest4, only4 = layout.manifest_name(4), packs_of(objects, 4) - packs_of(objects, 2)
    plant_deletion(objects, {4: 0})
    packs = packs_on(objects)
    store = open_store(uri, keyed)

    if keyed:  # as before: the unauthentic record stops gc until it is moved aside
        with pytest.raises(CorruptError, match="deletion record .* is not authentic"):
            store.gc(grace=0)
        assert store.steps() == [2, 4] and packs_on(objects) == packs
        return
    assert store.steps() == [2]  # the record still buries it (a reader's limit without a key) ...
    report = store.gc(grace=0)
    assert report.steps_dropped == [] and report.blobs_freed == 0
    assert objects.exists(manifest4) and packs_on(objects) == packs  # ... but frees nothing
    assert store.gc(keep_last=1, grace=0).steps_dropped == []  # retention counts steps only
    assert objects.exists(manifest4) and packs_on(objects) == packs
    verified = store.verify(deep=True)
    assert verified.ok and verified.buried_manifests == [manifest4] and verified.buried_kept
    assert not set(verified.orphans) & only4  # gc keeps them: no orphans
    cli = run("--store", uri, "verify", "--fast")
    assert cli.returncode == 0 and "without a key a deletion record alone deletes nothing" in cli.stdout
    store.close()

    removed = run("--store", uri, "delete", "--step", "4")  # the remedy, with the delete right
    assert removed.returncode == 0 and not objects.exists(manifest4)
    store = open_store(uri, keyed)
    store.gc(grace=0)
    assert packs_on(objects) == packs - only4 and store.steps() == [2]
    assert same_weights(store.state_dict(2), truth[2])


def test_a_real_delete_then_gc_frees_the_step(committed, keyed):
    uri, truth = committed
    objects = attacker(uri)
    only4 = packs_of(objects, 4) - packs_of(objects, 2)
    store = open_store(uri, keyed)
    store.delete(4)
    assert not objects.exists(layout.manifest_name(4))
    store.gc(grace=0)
    assert not packs_on(objects) & only4 and store.steps() == [2]
    assert store.verify(deep=False).ok and same_weights(store.state_dict(2), truth[2])


def test_a_planted_record_over_an_unreadable_manifest_stops_gc_until_quarantined(where, zero1_engine, run):
    """Without a key gc keeps a buried manifest and what it needs, so it must read it; one it
    cannot read stops it, as a kept step's does, and verify --quarantine moves it aside. (With
    a key the unauthentic record stops gc first, as above.)"""
    uri, keyed = where, False
    truth = commit_two_steps(uri, keyed, zero1_engine)
    objects = attacker(uri)
    junk = layout.manifest_name(6)
    objects.put_if_absent(junk, b"CKPM\x03" + os.urandom(64))
    plant_deletion(objects, {6: 0})
    refused = run("--store", uri, "gc")
    assert refused.returncode == 4 and junk in refused.stderr and "verify --quarantine" in refused.stderr
    moved = run("--store", uri, "verify", "--fast", "--quarantine")
    assert moved.returncode == 1 and f"quarantined: {junk}" in moved.stdout
    assert run("--store", uri, "gc").returncode == 0
    store = open_store(uri, keyed)
    assert store.steps() == [2, 4] and same_weights(store.state_dict(4), truth[4])


# -- junk names and unreadable manifests -------------------------------------------------------


def test_junk_names_under_manifests_are_strays_that_stop_nothing(committed, keyed, run):
    uri, truth = committed
    objects = attacker(uri)
    junk = ["manifests/000000000004.\u00b2.json", "manifests/" + "9" * 25 + ".json", "manifests/deleted.x"]
    for name in junk:
        objects.put_if_absent(name, b"junk")

    store = open_store(uri, keyed)
    assert store.steps() == [2, 4] and [row.step for row in store.log()] == [2, 4]
    assert same_weights(store.state_dict(4), truth[4])
    report = store.verify(deep=False)
    assert report.ok and report.stray_objects == sorted(junk)
    assert store.gc(keep_last=1, grace=0).steps_dropped == [2]
    assert all(objects.exists(name) for name in junk)


def test_verify_quarantine_moves_what_stops_gc_aside_and_gc_runs_again(committed, keyed, run, tmp_path):
    uri, truth = committed
    objects = attacker(uri)
    unreadable = [layout.manifest_name(6), layout.deletions_name(9)]
    for name in unreadable:
        objects.put_if_absent(name, b"CKPM\x03" + os.urandom(64))
    if keyed:  # a newer generation without the key's tag: ignored, moved aside all the same
        forge(objects, empty_record(4, read_record(objects, 4)), generation=1)
        unreadable.append(layout.manifest_name(4, 1))
    key_file = tmp_path / "store.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    cli = ["--store", uri, *(["--key-file", key_file] if keyed else [])]

    refused = run(*cli, "gc", "--keep-last", "1")
    assert refused.returncode == 4 and "verify --quarantine" in refused.stderr
    moved = run(*cli, "verify", "--fast", "--quarantine")
    assert moved.returncode == 1
    for name in unreadable:
        assert f"quarantined: {name} -> quarantine/{name}" in moved.stdout
        assert not objects.exists(name) and objects.exists(f"quarantine/{name}")
    assert run(*cli, "gc", "--keep-last", "1").returncode == 0
    assert run(*cli, "verify", "--fast").returncode == 0
    store = open_store(uri, keyed)
    assert store.steps() == [4] and same_weights(store.state_dict(4), truth[4])
    assert all(objects.exists(f"quarantine/{name}") for name in unreadable)


def catalog_folder(cache) -> object:
    """The one per-store folder a store's catalog made under the cache ``cache``."""
    (folder,) = [path for path in cache.iterdir() if path.is_dir()]
    return folder


def test_a_keyed_store_refuses_a_cache_others_can_write_and_a_store_without_a_key_does_not(
    where, tmp_path, monkeypatch, run
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("CKPTSTORE_CACHE", str(cache))
    ckptstore.open(where, key=KEY).close()
    folder = catalog_folder(cache)
    assert (cache.stat().st_mode & 0o777, folder.stat().st_mode & 0o777) == (0o700, 0o700)  # made private
    key_file = tmp_path / "store.key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    for path, mode in ((cache, 0o775), (folder, 0o1777), (folder / "catalog.db", 0o666)):
        before = path.stat().st_mode & 0o7777
        path.chmod(mode)
        with pytest.raises(
            BadInputError, match=f"is writable by its group or others .*: run `chmod go-w {path}`"
        ):
            ckptstore.open(where, key=KEY)
        refused = run("--store", where, "--key-file", key_file, "log")
        assert refused.returncode == 2 and f"chmod go-w {path}" in refused.stderr
        ckptstore.open(f"{where}-plain").close()  # a store without a key trusts its store, not the cache
        path.chmod(before)
    assert run("--store", where, "--key-file", key_file, "log").returncode == 0


def test_a_sticky_folder_above_the_cache_is_fine_and_another_users_cache_is_not(tmp_path, monkeypatch):
    shared = tmp_path / "tmp"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp: others cannot rename or remove what this user makes in it
    monkeypatch.setenv("CKPTSTORE_CACHE", str(shared / "cache"))
    ckptstore.open(tmp_path / "store", key=KEY).close()
    shared.chmod(0o777)
    with pytest.raises(
        BadInputError, match=f"a folder above the catalog folder is writable .*`chmod go-w {shared}`"
    ):
        ckptstore.open(tmp_path / "store", key=KEY)
    shared.chmod(0o1777)
    if os.geteuid() == 0:  # giving a folder to another user takes root
        os.chown(shared / "cache", 65534, 65534)
        with pytest.raises(BadInputError, match=f"{shared / 'cache'} belongs to another user"):
            ckptstore.open(tmp_path / "store", key=KEY)


def test_a_keyed_store_refuses_a_local_tier_others_can_write(s3, tmp_path):
    tier = tmp_path / "tier"
    ckptstore.open(s3.uri(), key=KEY, local=tier).close()
    assert tier.stat().st_mode & 0o777 == 0o700
    tier.chmod(0o770)
    with pytest.raises(BadInputError, match=f"the local tier is writable .* `chmod go-w {tier}`"):
        ckptstore.open(s3.uri(), key=KEY, local=tier)
    plain = tmp_path / "plain-tier"
    plain.mkdir(mode=0o777)
    plain.chmod(0o777)
    ckptstore.open(s3.uri("plain"), local=plain).close()


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o640, 0o604])
def test_a_key_file_group_or_others_may_read_or_write_is_refused(tmp_path, monkeypatch, mode):
    key_file = tmp_path / "store.key"
    key_file.write_bytes(KEY)
    key_file.chmod(mode)
    monkeypatch.setenv("CKPTSTORE_KEY_FILE", str(key_file))
    with pytest.raises(BadInputError, match=f"readable or writable by others .* `chmod 600 {key_file}`"):
        ckptstore.open(tmp_path / "store")


def flip_lr(description: str) -> str:
    """``description`` with one digit of its first learning rate changed (``"lr":0.005`` -> ``0.006``)."""
    at = description.index('"lr":') + len('"lr":')
    at += next(i for i, c in enumerate(description[at:]) if c in "123456789")
    return description[:at] + str(int(description[at]) % 9 + 1) + description[at + 1 :]


def test_a_flipped_byte_in_a_steps_catalog_rows_is_refused_until_the_catalog_is_rebuilt(
    committed, keyed, tmp_path
):
    uri, truth = committed
    store = open_store(uri, keyed)
    path = store.catalog.path
    store.close()
    with sqlite3.connect(path) as db:
        (description,) = db.execute("SELECT description FROM steps WHERE step = 4").fetchone()
        db.execute("UPDATE steps SET description = ? WHERE step = 4", [flip_lr(description)])
        db.execute("UPDATE metrics SET value = 0.5 WHERE step = 2")

    store = open_store(uri, keyed)
    for read in (lambda: store.state_dict(4), lambda: store.materialize(4, tmp_path / "out")):
        with pytest.raises(CorruptError, match="catalog's rows of step 4 are not what its manifest says"):
            read()
    assert not (tmp_path / "out").exists()
    with pytest.raises(CorruptError, match="rows of step 4"):  # gc decides from every step's rows
        store.gc(keep_last=1, grace=0)
    problems = store.verify(deep=False).manifest_problems
    assert len(problems) == 1 and "says other than the catalog about the description" in problems[0]
    store.close()

    ckptstore.rebuild_catalog(uri, key=KEY if keyed else None)
    store = open_store(uri, keyed)
    assert same_weights(store.state_dict(4), truth[4]) and store.verify(deep=False).ok
    store.close()


def test_rows_rewritten_with_a_matching_plain_digest_are_refused_with_a_key(committed, keyed):
    from ckptstore.catalog import digests
    from ckptstore.hashing import PLAIN

    uri, truth = committed
    store = open_store(uri, keyed)
    path = store.catalog.path
    store.close()
    with sqlite3.connect(path) as db:  # as a catalog writer without the key: the digest made anew
        (description,) = db.execute("SELECT description FROM steps WHERE step = 4").fetchone()
        db.execute("UPDATE steps SET description = ? WHERE step = 4", [flip_lr(description)])
    with sqlite3.connect(path) as db:
        wrapped = type("Db", (), {"execute": lambda self, *a: db.execute(*a)})()
        forged = digests.of_parts(digests.row_parts(wrapped, 4), 4, 0, PLAIN)
        db.execute("UPDATE steps SET rows_digest = ? WHERE step = 4", [forged])

    store = open_store(uri, keyed)
    if keyed:
        with pytest.raises(CorruptError, match="rows of step 4"):
            store.state_dict(4)
    else:  # without a key a digest catches accidents, not a writer: the rows are believed
        assert store.catalog.description(4) == flip_lr(description)


def test_rows_recorded_before_digests_are_checked_against_the_manifest_once(committed, keyed):
    uri, truth = committed
    store = open_store(uri, keyed)
    path = store.catalog.path
    store.close()
    with sqlite3.connect(path) as db:  # as a catalog an older ckptstore wrote
        db.execute("UPDATE steps SET rows_digest = NULL")
        (description,) = db.execute("SELECT description FROM steps WHERE step = 4").fetchone()
        db.execute("UPDATE steps SET description = ? WHERE step = 4", [flip_lr(description)])

    store = open_store(uri, keyed)
    assert same_weights(store.state_dict(2), truth[2])
    with pytest.raises(CorruptError, match="rows of step 4"):
        store.state_dict(4)
    store.close()
    with sqlite3.connect(path) as db:  # the manifest's digest, kept: step 4's rows still do not match it
        assert db.execute("SELECT count(*) FROM steps WHERE rows_digest IS NULL").fetchone() == (0,)
    with pytest.raises(CorruptError, match="rows of step 4"):
        open_store(uri, keyed).state_dict(4)
