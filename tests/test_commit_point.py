"""The manifest is the one commit point; the catalog is an index of the manifests (issue 28).

A step exists when its manifest exists: written create-only, last, after every pack. So a lost,
emptied or truncated catalog loses no step, a second commit of a step fails without touching
the first one's objects, and a manifest that cannot be read stops gc instead of letting it free
the step's packs.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ckptstore
from ckptstore import opening
from ckptstore.deepspeed.extract import extract
from ckptstore.errors import ConflictError, CorruptError
from ckptstore.format.layout import manifest_name
from tests.test_gc import WORKER, child_env, materialized, same
from tools.engines import batches, build_engine, train

LAYERS = [f"model.layers.{i}" for i in range(3)]


@pytest.fixture
def three_steps(tmp_path):
    """A local store with steps 2 and 4 full and step 6 saving model.layers.1 only; closed."""
    path = tmp_path / "store"
    store = ckptstore.open(path)
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=3)
    data = batches(6)
    for step in (2, 4, 6):
        train(engine, data[step - 2 : step])
        store.commit(engine, step=step, layers=["model.layers.1"] if step == 6 else None)
    store.close()
    return path


def contents(path, out) -> dict[int, dict]:
    """Every step of the store at ``path``, materialized and loaded."""
    with ckptstore.open(path, create=False) as store:
        return {step: materialized(store, step, out / str(step)) for step in store.steps()}


def engine_state(engine) -> dict:
    return {(p.name, p.kind): p.tensor.clone() for p in extract(engine).pieces}


# -- a lost catalog --------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["deleted", "emptied", "truncated"])
def test_a_lost_catalog_loses_no_step(three_steps, tmp_path, run, damage):
    before = contents(three_steps, tmp_path / "before")
    catalog = three_steps / "catalog.db"
    if damage == "deleted":
        catalog.unlink()
    elif damage == "emptied":
        catalog.write_bytes(b"")
    else:
        catalog.write_bytes(catalog.read_bytes()[: catalog.stat().st_size // 2])

    log = run("--store", three_steps, "log")
    assert log.returncode == 0, log.stderr
    assert [line.split()[0] for line in log.stdout.splitlines()[1:]] == ["2", "4", "6"]
    verify = run("--store", three_steps, "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    gc = run("--store", three_steps, "gc", "--grace", "0")
    assert gc.returncode == 0, gc.stderr
    after = contents(three_steps, tmp_path / "after")
    assert after.keys() == before.keys() == {2, 4, 6}
    assert all(same(after[step], before[step]) for step in before)
    if damage == "truncated":  # the damaged file is kept for inspection, not deleted
        assert list(three_steps.glob("catalog.db.damaged-*"))


def test_a_step_whose_commit_died_before_its_catalog_row_is_listed_and_cannot_be_committed_again(
    three_steps, tmp_path
):
    with ckptstore.open(three_steps) as store:
        store.catalog.drop_steps([6])  # as if the commit had died right after its manifest
    with ckptstore.open(three_steps) as store:
        assert store.steps() == [2, 4, 6]
        assert store.sources(6) == {"model.embed_tokens": 4, **dict.fromkeys(LAYERS, 4), "model.layers.1": 6,
                                    "model.norm": 4, "lm_head": 4}  # fmt: skip
        engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=1, num_layers=3)
        with pytest.raises(ConflictError, match="step 6 is already committed"):
            store.commit(engine, step=6)


# -- two writers of one step -----------------------------------------------------------------


def test_a_second_commit_of_a_step_fails_without_touching_the_first(three_steps, tmp_path, monkeypatch):
    winner = build_engine("llama", zero_stage=2, dtype="bf16", seed=1, num_layers=3)
    loser = build_engine("llama", zero_stage=2, dtype="bf16", seed=2, num_layers=3)
    train(winner, batches(1))
    expected = engine_state(winner)
    first, second = ckptstore.open(three_steps), ckptstore.open(three_steps)
    first.commit(winner, step=8)
    manifest = (three_steps / manifest_name(8)).read_bytes()
    # The second writer checked the step before the first recorded it, as a racing process does.
    monkeypatch.setattr("ckptstore.commit.step.check_new_step", lambda catalog, step: None)
    with pytest.raises(ConflictError, match="step 8 is already committed"):
        second.commit(loser, step=8)
    monkeypatch.undo()
    assert (three_steps / manifest_name(8)).read_bytes() == manifest
    second.close()
    first.close()
    with ckptstore.open(three_steps, create=False) as store:
        assert store.verify().ok
        fresh = build_engine("llama", zero_stage=2, dtype="bf16", seed=5, num_layers=3)
        store.restore(fresh, 8)
        assert all(torch.equal(t, expected[key]) for key, t in engine_state(fresh).items())


def test_two_processes_committing_the_same_step_twenty_times_leave_one_winner_each_time(tmp_path):
    store_path, dumps = tmp_path / "store", tmp_path / "dumps"
    dumps.mkdir()
    ckptstore.open(store_path).close()
    seeds = (1, 2)
    racers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "race", str(store_path), str(seed), str(dumps)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=child_env(),
        )  # fmt: skip
        for seed in seeds
    ]
    try:
        for racer in racers:
            while (line := racer.stdout.readline()) and line.strip() != "ready":
                pass  # DeepSpeed's own start-up lines
            assert line.strip() == "ready"
        winners = {}
        for step in range(1, 21):
            for racer in racers:
                racer.stdin.write(f"{step}\n")
                racer.stdin.flush()
            outcomes = [racer.stdout.readline().split() for racer in racers]
            assert sorted(outcome[0] for outcome in outcomes) == ["lost", "won"], (step, outcomes)
            winners[step] = next(
                seed for seed, outcome in zip(seeds, outcomes, strict=True) if outcome[0] == "won"
            )
    finally:
        for racer in racers:
            racer.stdin.close()
            racer.wait(timeout=120)

    steps = list(range(1, 21))
    report = opening.rebuild_catalog(store_path)
    assert report.steps == steps and not (report.corrupt or report.incomplete or report.lost)
    with ckptstore.open(store_path, create=False) as store:
        assert store.steps() == steps
        verified = store.verify()
        assert verified.ok, verified.manifest_problems + [p.describe() for p in verified.problems]
        store.gc(grace=0)
        engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=5, num_layers=3)
        for step in steps:
            store.restore(engine, step)
            expected = torch.load(dumps / f"{winners[step]}-{step}.pt")
            assert all(torch.equal(t, expected[key]) for key, t in engine_state(engine).items()), step


# -- manifests are checked ---------------------------------------------------------------------


def flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_manifest_is_reported_and_stops_gc_from_freeing_its_packs(three_steps, tmp_path, run):
    with ckptstore.open(three_steps) as store:
        needed = store.catalog.packs_of_steps([6])
    flip_a_byte(three_steps / manifest_name(6))

    verify = run("--store", three_steps, "verify")
    assert verify.returncode == 1
    assert f"step 6: manifest {manifest_name(6)} cannot be read" in verify.stdout
    rebuild = run("--store", three_steps, "catalog", "rebuild")
    assert rebuild.returncode == 1 and f"unreadable manifest {manifest_name(6)}" in rebuild.stdout
    assert list(three_steps.glob("catalog.db.before-rebuild-*"))  # the catalog that still knew step 6
    # The catalog no longer knows step 6: only its manifest could say which packs it needs.
    gc = run("--store", three_steps, "gc", "--grace", "0")
    assert gc.returncode == CorruptError.exit_code
    assert manifest_name(6) in gc.stderr and "gc will not run" in gc.stderr
    stored = {p.name for p in (three_steps / "packs").rglob("*") if p.is_file()}
    assert needed <= stored


def test_a_deleted_manifest_is_reported_against_its_step_and_the_rebuild_keeps_the_old_catalog(
    three_steps, tmp_path, run
):
    (three_steps / manifest_name(4)).unlink()
    verify = run("--store", three_steps, "verify")
    assert verify.returncode == 1 and "step 4 has no manifest" in verify.stdout
    rebuild = run("--store", three_steps, "catalog", "rebuild")
    assert rebuild.returncode == 1
    assert "step 4 left out" in rebuild.stdout
    assert list(three_steps.glob("catalog.db.before-rebuild-*"))
    with ckptstore.open(three_steps, create=False) as store:
        assert store.steps() == [2, 6]
        store.materialize(6, tmp_path / "six")  # self-contained: it names the packs it inherits


def test_a_catalog_row_that_disagrees_with_its_manifest_is_reported(three_steps, run):
    import sqlite3

    db = sqlite3.connect(three_steps / "catalog.db")
    db.execute("INSERT INTO files (step, path, key, size) VALUES (4, 'notes.txt', ?, 3)", ["0" * 32])
    db.commit()
    db.close()
    verify = run("--store", three_steps, "verify")
    assert verify.returncode == 1
    assert (
        "step 4: manifest" in verify.stdout
        and "other than the catalog about the auxiliary files" in verify.stdout
    )
