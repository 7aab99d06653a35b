"""Stores written in format version 1 keep working: list, verify, materialize bit for bit,
take new commits, collect garbage. The fixture (tests/data/v1-store) was committed by the
ckptstore of that format; tests/data/make_v1_store.py says how."""

import json
import shutil
from pathlib import Path

import pytest

import ckptstore
from tests.data.make_v1_store import MATERIALIZED, file_digests
from tools.engines import batches, build_engine, train

DATA = Path(__file__).with_name("data")
EXPECTED = json.loads((DATA / "v1-store.expected.json").read_text())


@pytest.fixture
def v1_store(tmp_path):
    path = tmp_path / "v1-store"
    shutil.copytree(DATA / "v1-store", path)
    with ckptstore.open(path, create=False) as store:
        yield store


def test_a_v1_store_lists_its_steps_and_verifies_clean(v1_store):
    assert v1_store.steps() == [10, 20, 30]
    sources = v1_store.sources(20)
    assert sources["model.layers.1"] == 20 and {
        s for layer, s in sources.items() if layer != "model.layers.1"
    } == {10}
    report = v1_store.verify()
    assert report.ok and report.orphans == [] and report.stray_objects == []


@pytest.mark.parametrize("name", sorted(MATERIALIZED))
def test_a_v1_store_materializes_every_step_bit_for_bit(v1_store, tmp_path, name):
    step = int(name.split("@")[0])
    out = v1_store.materialize(step, tmp_path / "out", **MATERIALIZED[name])
    assert file_digests(out) == EXPECTED[name]


def test_a_v1_store_takes_a_composite_commit_and_gc_keeps_what_it_inherits(v1_store, tmp_path):
    engine = build_engine("llama", zero_stage=3, dtype="fp32", seed=0, num_layers=2)
    train(engine, batches(2))
    report = v1_store.commit(engine, step=40, layers=["model.layers.0"])
    assert report.layers_saved == ["model.layers.0"] and set(report.layers_inherited.values()) == {30}
    gc = v1_store.gc(keep_last=2, grace=0)
    assert gc.steps_dropped == [10, 20] and v1_store.steps() == [30, 40]
    assert v1_store.verify().ok
    assert file_digests(v1_store.materialize(30, tmp_path / "out30")) == EXPECTED["30"]
    engine.load_checkpoint(str(v1_store.materialize(40, tmp_path / "out40")))
    # The new step is format 2 (packs), its inherited layers format 1 (blobs); an older
    # ckptstore now refuses the store as a whole rather than misreading step 40.
    assert json.loads(v1_store.objects.get("config.json"))["format_version"] == 2
    assert [index.layer for index in v1_store.catalog.layer_packs(40)] == ["model.layers.0"]
    assert {row.layer for row in v1_store.catalog.tensors(30)} >= {"model.layers.1"}
    # Manifests alone rebuild the mixed store.
    path = Path(v1_store.objects.root)
    v1_store.close()
    assert ckptstore.rebuild_catalog(path).steps == [30, 40]
    with ckptstore.open(path) as rebuilt:
        assert file_digests(rebuilt.materialize(30, tmp_path / "again30")) == EXPECTED["30"]
        assert rebuilt.verify().ok
