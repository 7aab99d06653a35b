"""Weights-only steps: gc keeps old steps' weights for evaluation and drops their optimizer state.

A thinned step exports exactly as before, costs a fraction of a full step, refuses to
materialize with one clear line, and never takes from a resumable step what it needs.
"""

from __future__ import annotations

import json

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, WeightsOnlyError
from tests.test_gc import load_checkpoint_files, same
from tools.engines import batches, build_engine, destroy_engine, train

DATA = batches(6)


def commit_steps(store, layers_of=lambda step: None, steps=(1, 2, 3, 4, 5)) -> None:
    engine = build_engine("llama", zero_stage=2, dtype="bf16", num_layers=2)
    for step in steps:
        train(engine, DATA[step - 1 : step])
        store.commit(engine, step, layers=layers_of(step))
    destroy_engine(engine)


def step_bytes(store, step: int) -> int:
    return sum(row.bytes for row in store.show(step))


def exported(store, step, out) -> dict[str, bytes]:
    folder = store.export(step, out, dtype="float32").path
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_gc_keeps_older_steps_weights_only_and_they_export_as_before(tmp_path, run):
    store = ckptstore.open(tmp_path / "store")
    commit_steps(store)
    full = {step: step_bytes(store, step) for step in (2, 4)}
    before = {step: exported(store, step, tmp_path / f"before{step}") for step in (2, 4)}
    weights_before = store.state_dict(4)
    resumable_before = load_checkpoint_files(store.materialize(5, tmp_path / "m5-before"))

    result = run("--store", store.objects.uri, "gc", "--keep-last", "1", "--keep-weights-every", "2",
                 "--grace", "0s", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["steps_dropped"] == [1, 3] and report["steps_kept"] == [2, 4, 5]
    assert report["steps_weights_only"] == report["steps_thinned"] == [2, 4]
    assert report["layers_thinned"] == 2 * 5  # embedding, 2 blocks, norm, head of each

    store = ckptstore.open(tmp_path / "store")
    for step in (2, 4):
        assert step_bytes(store, step) <= 0.4 * full[step], (step, step_bytes(store, step), full[step])
        assert exported(store, step, tmp_path / f"after{step}") == before[step]
        assert not store.resumable(step)
    after = store.state_dict(4)
    assert all(torch.equal(after[name], weights_before[name]) for name in weights_before)
    # What is on disk is what the kept steps need: their packs and the bases of step 5's deltas
    # (the thinned steps' deltas were stored whole); the other old packs went in the sweep.
    packs = sum(p.stat().st_size for p in (tmp_path / "store" / "packs").rglob("*") if p.is_file())
    assert not any(index.bases for step in (2, 4) for index in store.catalog.layer_packs(step))
    needed = {
        ref.key: ref.size
        for step in (2, 4, 5)
        for i in store.catalog.layer_packs(step)
        for ref in i.all_packs
    }
    assert packs == sum(needed.values())

    with pytest.raises(WeightsOnlyError, match="step 2 keeps only weights"):
        store.materialize(2, tmp_path / "m2")
    refused = run("--store", store.objects.uri, "materialize", "--step", 4, tmp_path / "m4")
    assert (
        refused.returncode == 8 and refused.stderr.count("\n") == 1 and "export still works" in refused.stderr
    )
    assert not (tmp_path / "m2").exists() and not (tmp_path / "m4").exists()
    # The resumable step is untouched: the same checkpoint, byte for byte.
    assert same(load_checkpoint_files(store.materialize(5, tmp_path / "m5-after")), resumable_before)
    assert store.verify().ok

    log = [
        json.loads(line) for line in run("--store", store.objects.uri, "log", "--json").stdout.splitlines()
    ]
    assert [(row["step"], row["resumable"]) for row in log] == [(2, False), (4, False), (5, True)]
    assert "weights-only" in run("--store", store.objects.uri, "show", "--step", 2).stdout


def test_what_a_resumable_composite_step_inherits_stays_whole(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    commit_steps(store, layers_of=lambda step: ["model.layers.1"] if step == 3 else None, steps=(1, 2, 3))
    checkpoint = load_checkpoint_files(store.materialize(3, tmp_path / "before"))
    report = store.gc(keep_last=1, keep_weights_every=2, grace=0)
    assert report.steps_weights_only == [2] and report.layers_thinned == 1  # only the layer step 3 re-saved
    assert same(load_checkpoint_files(store.materialize(3, tmp_path / "after")), checkpoint)
    assert store.export(2, tmp_path / "weights").tensors == 21


def test_a_weights_only_step_is_never_inherited_from(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    commit_steps(store, steps=(1, 2, 3))
    store.gc(keep_steps=[1], keep_weights_last=1, grace=0)
    assert [(row.step, row.resumable) for row in store.log()] == [(1, True), (3, False)]
    engine = build_engine("llama", zero_stage=2, dtype="bf16", num_layers=2)
    with pytest.raises(BadInputError, match="step 3 keeps only its weights"):
        store.commit(engine, 4, layers=["model.layers.0"])
    report = store.commit(engine, 4, layers=ckptstore.strategies.Parity())
    assert len(report.layers_saved) == 5  # a strategy saves every layer instead
    destroy_engine(engine)


def test_rules_that_would_leave_no_resumable_step_are_refused(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    commit_steps(store, steps=(1, 2))
    with pytest.raises(BadInputError, match="no resumable step"):
        store.gc(keep_weights_every=1)
    assert all(row.resumable for row in store.log())


def test_other_machines_see_a_step_become_weights_only_and_keep_its_new_packs(s3, monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "a"))
    with ckptstore.open(s3.uri()) as store:
        commit_steps(store, steps=(1, 2, 3))
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "b"))
    with ckptstore.open(s3.uri()) as other:
        assert [row.resumable for row in other.log()] == [True, True, True]  # imported before the gc
        expected = other.state_dict(2)
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "a"))
    with ckptstore.open(s3.uri()) as store:
        store.gc(keep_last=1, keep_weights_every=2, grace=0)
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "b"))
    with ckptstore.open(s3.uri()) as other:
        assert [(row.step, row.resumable) for row in other.log()] == [(2, False), (3, True)]
        assert other.gc(grace=0).blobs_freed == 0  # its index references the thinned packs
        assert all(torch.equal(t, expected[n]) for n, t in other.state_dict(2).items())
        with pytest.raises(WeightsOnlyError):
            other.materialize(2, tmp_path / "out")
    assert s3.keys("run/manifests/") == [
        "run/manifests/000000000002.1.json",
        "run/manifests/000000000003.json",
        "run/manifests/deleted.000000000000",  # step 1's deletion (format/deletions.py)
    ]


def test_a_dry_run_says_which_steps_would_become_weights_only_and_changes_nothing(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    commit_steps(store, steps=(1, 2, 3))
    report = store.gc(keep_last=1, keep_weights_every=2, grace=0, dry_run=True)
    assert report.steps_thinned == [2] and report.layers_thinned == 5 and report.steps_dropped == [1]
    assert [(row.step, row.resumable) for row in store.log()] == [(1, True), (2, True), (3, True)]
    store.materialize(2, tmp_path / "still")
