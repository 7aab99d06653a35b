"""The catalog as an index of manifests: ``ckptstore catalog rebuild`` and syncing on open."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore.catalog.sync import cache_path
from ckptstore.errors import CorruptError
from ckptstore.format.layout import manifest_name, pack_name
from ckptstore.integrations.dcp import StoreWriter
from tools.engines import batches, build_engine, train

DATA = batches(4)


def commit_three_steps(store) -> None:
    engine = build_engine("gpt2", zero_stage=1, dtype="bf16", seed=0, num_layers=2)
    train(engine, DATA[:1])
    store.commit(engine, step=1)
    train(engine, DATA[1:2])
    store.commit(engine, step=2, layers=["transformer.h.1"])
    train(engine, DATA[2:3])
    store.commit(engine, step=3)


def test_catalog_rebuild_restores_every_step_of_an_s3_store(s3, run, tmp_path):
    store = ckptstore.open(s3.uri())
    commit_three_steps(store)
    log, sources = store.log(), store.sources(2)
    index = cache_path(store.objects)
    store.close()
    shutil.rmtree(index.parent)

    code, out, _ = run("--store", s3.uri(), "catalog", "rebuild")
    assert code == 0
    assert out.strip() == f"rebuilt the catalog of {s3.uri()}: 3 step(s): 1, 2, 3"
    assert index.exists()
    rebuilt = ckptstore.open(s3.uri(), create=False)
    assert rebuilt.log() == log and rebuilt.sources(2) == sources
    code, out, _ = run("--store", s3.uri(), "log", "--json")
    assert [json.loads(line)["step"] for line in out.splitlines()] == [1, 2, 3]
    rebuilt.materialize(2, tmp_path / "out")


def test_a_garbage_local_catalog_is_rebuilt_from_the_manifests_and_kept_aside(tmp_path, run):
    store = ckptstore.open(tmp_path / "store")
    commit_three_steps(store)
    log = store.log()
    store.close()
    (tmp_path / "store" / "catalog.db").write_bytes(b"garbage" * 1000)
    reopened = ckptstore.open(tmp_path / "store")
    assert reopened.log() == log
    reopened.close()
    [damaged] = (tmp_path / "store").glob("catalog.db.damaged-*")
    assert damaged.read_bytes() == b"garbage" * 1000

    code, out, _ = run("--store", tmp_path / "store", "catalog", "rebuild", "--json")
    assert code == 0
    assert json.loads(out)["steps"] == [1, 2, 3]
    rebuilt = ckptstore.open(tmp_path / "store")
    assert rebuilt.log() == log
    assert rebuilt.verify().ok
    rebuilt.materialize(3, tmp_path / "out")


def test_rebuild_leaves_out_and_reports_unreadable_manifests_and_steps_missing_blobs(s3, run, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_DELTA_CHAIN", "1")  # whole pieces: step 1 has packs of its own
    store = ckptstore.open(s3.uri())
    commit_three_steps(store)
    only_in_step1 = store.catalog.packs_of_steps([1]) - store.catalog.packs_of_steps([2, 3])
    assert only_in_step1
    for key in only_in_step1:
        store.objects.delete(pack_name(key))
    s3.client.put_object(Bucket=s3.bucket, Key="run/" + manifest_name(3), Body=b"{not json")

    code, out, _ = run("--store", s3.uri(), "catalog", "rebuild")
    assert code == 1
    lines = out.splitlines()
    assert lines[0].startswith(f"problem: unreadable manifest {manifest_name(3)}: malformed manifest")
    assert lines[1] == "problem: step 1 left out: blobs it needs are missing"
    assert lines[2].startswith("info: the previous catalog is kept at ")  # it still had steps 1 and 3
    assert lines[3] == f"rebuilt the catalog of {s3.uri()}: 1 step(s): 2"


def test_opening_an_s3_store_imports_steps_committed_elsewhere_since(s3, monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "writer"))
    writer = ckptstore.open(s3.uri())
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "reader"))
    reader = ckptstore.open(s3.uri())
    assert reader.steps() == []
    commit_three_steps(writer)
    assert reader.steps() == []  # an open store does not poll the bucket
    assert ckptstore.open(s3.uri()).steps() == [1, 2, 3]
    assert cache_path(reader.objects).is_relative_to(tmp_path / "reader")


def test_processes_sharing_one_cache_can_import_the_same_steps_at_once(s3, monkeypatch, tmp_path):
    # The ranks of a job on one node open the store together and share ~/.cache/ckptstore.
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "writer"))
    commit_three_steps(ckptstore.open(s3.uri()))
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "node"))
    barrier = threading.Barrier(6)
    seen, errors = [], []

    def open_store():
        barrier.wait()
        try:
            seen.append(ckptstore.open(s3.uri()).steps())
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_store) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert seen == [[1, 2, 3]] * 6


def test_a_fresh_cache_lists_the_steps_and_reads_only_the_manifests_it_needs(s3, monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "writer"))
    commit_three_steps(ckptstore.open(s3.uri()))
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "reader"))
    reader = ckptstore.open(s3.uri())
    assert reader.steps() == [1, 2, 3] and reader.catalog.recorded_steps() == []  # one listing
    reader.materialize(2, tmp_path / "out")  # a composite: its manifest carries what it inherits
    assert reader.catalog.recorded_steps() == [2]
    assert reader.sources(2) == {**dict.fromkeys(reader.sources(2), 1), "transformer.h.1": 2}
    assert reader.catalog.recorded_steps() == [2]
    # gc on another fresh machine reads the kept steps' manifests, and drops the others unread:
    # step 1's manifest, now garbage, goes without stopping it.
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "gc"))
    collector = ckptstore.open(s3.uri())
    collector.objects.delete_many([manifest_name(1)])
    collector.objects.put_if_absent(manifest_name(1), b"CKPM\x03" + bytes(64))
    report = collector.gc(keep_last=1, grace=0)
    assert report.steps_dropped == [1, 2] and collector.catalog.recorded_steps() == [3]
    assert not collector.objects.exists(manifest_name(1))
    assert collector.verify().ok
    # The reader's listing still names step 1: asking for it now finds it gone, cleanly.
    with pytest.raises(ckptstore.NotFoundError, match="step 1 does not exist"):
        reader.sources(1)
    assert reader.steps() == [2, 3]


def test_a_lazily_imported_store_logs_what_each_step_added_as_its_committer_did(s3, monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "writer"))
    writer = ckptstore.open(s3.uri())
    commit_three_steps(writer)
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "reader"))
    reader = ckptstore.open(s3.uri())
    reader.sources(3)  # imported out of order: step 3 before steps 1 and 2
    assert reader.log() == writer.log()


@pytest.mark.parametrize("kind", ["s3", "local"])
def test_verify_beside_a_gc_reports_only_what_is_still_wrong_when_it_ends(
    s3, machine, tmp_path, zero1_engine, kind
):
    from importlib import import_module

    verify = import_module("ckptstore.verify").verify
    uri = s3.uri() if kind == "s3" else str(tmp_path / "store")
    machine("writer")
    with ckptstore.open(uri) as writer:
        for step in (1, 2, 3, 4):
            train(zero1_engine, DATA[step - 1 : step])  # every layer moves: each step its own packs
            writer.commit(zero1_engine, step)
    machine("verifier")  # on S3 its own cache; a local store's catalog is shared by both
    store = ckptstore.open(uri)
    swept = []

    def gc_elsewhere(phase: str) -> None:
        """At these seams a gc elsewhere drops the oldest step and sweeps its packs: right after
        verify read step 1's manifest, after it took the catalog's references, at its end."""
        if phase in ("indexed", "checked") or phase == "manifest" and not swept:
            machine("collector")
            with ckptstore.open(uri) as collector:
                swept.append(collector.gc(keep_steps=collector.steps()[1:], grace=0).blobs_freed)
            machine("verifier")

    report = verify(store.objects, store.catalog, between=gc_elsewhere)
    assert report.ok, report.as_dict()
    assert swept and all(swept)  # each gc really dropped packs verify had been told about
    assert report.passed_on_recheck > 0  # problems were seen on the way, and were gone at the end
    assert store.steps() == [4] and verify(store.objects, store.catalog).ok


# -- a damaged catalog is rebuilt at open, or named with its repair; never an internal error --------


def save_dcp_steps(path) -> None:
    """A local store of DCP steps 1-2-3 (no engine to build), its catalog folded into catalog.db."""
    state = {"model": {f"model.layers.{i}.w": torch.full((8, 4), float(i)) for i in range(3)}, "train": {}}
    with warnings.catch_warnings(), ckptstore.open(path) as store:
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        for step in (1, 2, 3):
            state["model"]["model.layers.0.w"] += 1
            state["train"]["step"] = step
            dcp.save(state, storage_writer=StoreWriter(store, step=step))
    assert not (path / "catalog.db-wal").exists()


def flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def first_page_of(path, table: str) -> int:
    """The byte offset of the root page of ``table`` in the catalog file at ``path``."""
    with sqlite3.connect(path) as db:
        page_size = db.execute("PRAGMA page_size").fetchone()[0]
        (page,) = db.execute("SELECT rootpage FROM sqlite_schema WHERE name = ?", [table]).fetchone()
    db.close()
    return (page - 1) * page_size


def assert_whole(run, store, tmp_path) -> None:
    """Every step is listed, verify is clean and the newest step materializes."""
    code, out, err = run("--store", store, "log", "--json")
    assert code == 0, err
    assert [json.loads(line)["step"] for line in out.splitlines()] == [1, 2, 3]
    code, out, err = run("--store", store, "verify")
    assert code == 0 and "clean" in out, err
    code, _, err = run("--store", store, "materialize", "--step", 3, tmp_path / "out", "--force")
    assert code == 0, err


@pytest.mark.parametrize("where", ["header", "listed_steps"])
def test_a_catalog_damaged_where_the_open_reads_is_rebuilt_at_the_next_open_and_kept_aside(
    tmp_path, run, where
):
    # Offset 20 of the header (the space SQLite reserves per page): SQLite opens the file and
    # misreads its pages later. listed_steps: every open rewrites it.
    store = tmp_path / "store"
    save_dcp_steps(store)
    catalog = store / "catalog.db"
    flip(catalog, 20 if where == "header" else first_page_of(catalog, "listed_steps"))
    damaged = catalog.read_bytes()
    with ckptstore.open(store, create=False) as opened:
        assert opened.steps() == [1, 2, 3] and opened.verify().ok
    [aside] = store.glob("catalog.db.damaged-*")
    assert aside.read_bytes() == damaged
    assert_whole(run, store, tmp_path)


def test_a_catalog_page_damaged_where_only_a_later_query_reads_is_one_line_naming_catalog_rebuild(
    tmp_path, run
):
    store = tmp_path / "store"
    save_dcp_steps(store)
    flip(store / "catalog.db", first_page_of(store / "catalog.db", "layer_packs"))  # its page type
    for command in (["verify"], ["materialize", "--step", 3, tmp_path / "out"]):
        code, out, err = run("--store", store, *command)
        assert code == 4 and out == "", err
        assert err.startswith(f"error: the catalog {store / 'catalog.db'} is damaged (")
        assert "`ckptstore catalog rebuild` rebuilds it from the manifests" in err
        assert len(err.splitlines()) == 1
    with ckptstore.open(store, create=False) as opened, pytest.raises(CorruptError, match="catalog rebuild"):
        opened.verify()  # the API raises it too, never a raw sqlite3 error
    code, out, err = run("--store", store, "catalog", "rebuild")
    assert code == 0, err
    assert_whole(run, store, tmp_path)


def test_text_that_is_not_utf8_in_a_catalog_row_is_damage_naming_catalog_rebuild(tmp_path, run):
    # Bytes a writer of the catalog file put into steps.description: Python's sqlite3 cannot
    # decode the row, which is damage like a bad page (exit 4), never an internal error.
    store = tmp_path / "store"
    save_dcp_steps(store)
    with sqlite3.connect(store / "catalog.db") as db:
        db.execute("UPDATE steps SET description = CAST(X'7bff22fe' AS TEXT) WHERE step = 3")
    db.close()
    for command in (["verify"], ["show", "--step", 3], ["materialize", "--step", 3, tmp_path / "out"],
                    ["gc", "--dry-run", "--keep-last", 1]):  # fmt: skip
        code, out, err = run("--store", store, *command)
        assert code == 4, (command, err)
        assert "is damaged (Could not decode to UTF-8 column 'description'" in err, err
        assert "`ckptstore catalog rebuild` rebuilds it from the manifests" in err
    code, out, err = run("--store", store, "catalog", "rebuild")
    assert code == 0, err
    assert_whole(run, store, tmp_path)


def test_a_step_whose_steps_row_is_gone_while_its_layers_rows_remain_is_imported_again(tmp_path, run):
    # What a killed writer's log replayed onto another file left: rows of a step without its row.
    store = tmp_path / "store"
    save_dcp_steps(store)
    with ckptstore.open(store, create=False) as opened:
        sources, files = opened.sources(2), opened.files(2)
    with sqlite3.connect(store / "catalog.db") as db:
        db.execute("DELETE FROM steps WHERE step = 2")
        assert db.execute("SELECT count(*) FROM layers WHERE step = 2").fetchone()[0] > 0
    db.close()
    with ckptstore.open(store, create=False) as opened:
        assert [row.step for row in opened.log()] == [1, 2, 3]
        assert opened.sources(2) == sources and opened.files(2) == files
        assert opened.verify().ok
    assert_whole(run, store, tmp_path)
    assert not list(store.glob("catalog.db.*"))  # nothing was rebuilt or kept aside
