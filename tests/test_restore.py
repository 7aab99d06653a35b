"""``store.restore``: a step straight into a live engine, as ``load_checkpoint`` of its
materialized directory would leave it, each rank reading only its share."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, NotFoundError, WeightsOnlyError
from tools.engines import batches, build_engine, destroy_engine, train

DATA = batches(6)
CONFIGS = [(stage, dtype) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]


def optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    """Every tensor of the engine's optimizer state dict (the fp32 masters and Adam moments)."""
    found = {}

    def walk(prefix, item):
        if isinstance(item, torch.Tensor):
            found[prefix] = item
        elif isinstance(item, dict):
            for key, value in item.items():
                walk(f"{prefix}/{key}", value)
        elif isinstance(item, list | tuple):
            for i, value in enumerate(item):
                walk(f"{prefix}/{i}", value)

    walk("", engine.optimizer.state_dict())
    return found


def own_memory(engine) -> list[int]:
    """Where the engine keeps its fp32 master partitions, their Adam moments and (ZeRO 1/2) its
    module weights."""
    optimizer = engine.optimizer
    partitions = next(
        getattr(optimizer, name)
        for name in (
            "single_partition_of_fp32_groups",
            "fp32_groups_flat_partition",
            "fp32_partitioned_groups_flat",
        )
        if hasattr(optimizer, name)
    )
    moments = [  # not torch Adam's 0-dim step count, which a load replaces
        t
        for p in partitions
        for t in optimizer.optimizer.state[p].values()
        if isinstance(t, torch.Tensor) and t.shape == p.shape
    ]
    weights = [] if engine.zero_optimization_stage() == 3 else list(engine.module.parameters())
    return [t.data_ptr() for t in [*weights, *partitions, *moments]]


@pytest.mark.parametrize("stage,dtype", CONFIGS, ids=[f"zero{s}-{d}" for s, d in CONFIGS])
@pytest.mark.either_key  # each configuration with a key or without, alternating (conftest)
def test_a_restored_engine_trains_on_as_one_loaded_from_the_materialized_step(tmp_path, stage, dtype):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=stage, dtype=dtype, seed=0, num_layers=2)
    train(engine, DATA[:3])
    store.commit(engine, 3, client_state={"epoch": 7})
    destroy_engine(engine)

    loaded = build_engine("llama", zero_stage=stage, dtype=dtype, seed=1, num_layers=2)
    _, client = loaded.load_checkpoint(str(store.materialize(3, tmp_path / "out")))
    restored = build_engine("llama", zero_stage=stage, dtype=dtype, seed=2, num_layers=2)
    if stage > 0:
        train(restored, DATA[5:])  # an engine that holds optimizer state, as after a rollback
        before = own_memory(restored)
    step, restored_client = store.restore(restored)
    if stage > 0:  # decoded straight into the engine's own tensors: no second copy of the state
        assert own_memory(restored) == before
    assert step == 3 and restored_client["epoch"] == client["epoch"] == 7
    assert restored.global_steps == loaded.global_steps == 3
    assert restored.lr_scheduler.state_dict() == loaded.lr_scheduler.state_dict()
    theirs, ours = optimizer_tensors(loaded), optimizer_tensors(restored)
    assert theirs.keys() == ours.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert train(restored, DATA[3:]) == train(loaded, DATA[3:])
    destroy_engine(loaded)
    destroy_engine(restored)


def test_restore_takes_a_step_the_load_options_and_refuses_what_it_cannot_restore(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    with pytest.raises(NotFoundError, match="no committed step"):
        store.restore(engine)
    for step in (1, 2, 3):
        train(engine, DATA[step - 1 : step])
        store.commit(engine, step)
    module_only = build_engine("llama", zero_stage=2, dtype="bf16", seed=3, num_layers=2)
    assert store.restore(module_only, 2, load_module_only=True)[0] == 2
    reference = build_engine("llama", zero_stage=2, dtype="bf16", seed=4, num_layers=2)
    reference.load_checkpoint(str(store.materialize(2, tmp_path / "out")), load_module_only=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(module_only.module.parameters(), reference.module.parameters(), strict=True)
    )
    assert module_only.global_steps == reference.global_steps == 0  # only the module was loaded
    other_stage = build_engine("llama", zero_stage=3, dtype="bf16", seed=5, num_layers=2)
    with pytest.raises(BadInputError, match="committed by a ZeRO-2 engine.*this one runs ZeRO-3.*unchanged"):
        store.restore(other_stage, 3)
    destroy_engine(other_stage)
    # an engine that loads universal checkpoints reads nothing else: refused before it is touched
    universal = build_engine("llama", zero_stage=2, dtype="bf16", seed=6, num_layers=2,
                             checkpoint={"load_universal": True})  # fmt: skip
    with pytest.raises(BadInputError, match='"load_universal": true.*the engine is unchanged'):
        store.restore(universal, 3)
    destroy_engine(universal)
    store.gc(keep_last=1, keep_weights_every=2, grace=0)
    with pytest.raises(WeightsOnlyError):
        store.restore(module_only, 2)
    for e in (engine, module_only, reference):
        destroy_engine(e)


@pytest.fixture(scope="module")
def two_rank_restores(tmp_path_factory, store_key) -> tuple[Path, dict[str, list[dict]]]:
    """One two-rank job for both multi-rank restore scenarios: "restore" (the one-rank commits
    of every configuration, made here first, and the job's own, restored on two ranks), then
    "restore_fail" (a rank failing mid-restore); each in its own folder of the root."""
    from tests.test_many_ranks import torchrun_modes

    root = tmp_path_factory.mktemp("restores")
    for stage, dtype in CONFIGS:  # the one-rank commits the two-rank job restores
        engine = build_engine("llama", zero_stage=stage, dtype=dtype, seed=0, num_layers=2)
        train(engine, DATA[:3])
        ckptstore.open(root / "restore" / f"zero{stage}-{dtype}" / "store1").commit(engine, 3)
        destroy_engine(engine)
    return root, torchrun_modes(["restore", "restore_fail"], root)


@pytest.mark.either_key(job="two_rank_restores")  # one job, with a key or without (conftest)
def test_restore_across_world_sizes_1_to_2_2_to_2_and_2_to_1(two_rank_restores, tmp_path):
    root, observed_by_mode = two_rank_restores
    for rank, observed in enumerate(observed_by_mode["restore"]):
        assert len(observed) == 2 * len(CONFIGS)
        for case, run in observed.items():
            assert run["step"] == 3 and run["optimizer_equal"], (rank, case)
            assert run["restored"] == run["loaded"], (rank, case)
    for stage, dtype in CONFIGS:  # 2 -> 1
        store = ckptstore.open(root / "restore" / f"zero{stage}-{dtype}" / "store2")
        loaded = build_engine("llama", zero_stage=stage, dtype=dtype, seed=1, num_layers=2)
        loaded.load_checkpoint(str(store.materialize(3, tmp_path / f"w1-{stage}-{dtype}", world_size=1)))
        restored = build_engine("llama", zero_stage=stage, dtype=dtype, seed=2, num_layers=2)
        assert store.restore(restored)[0] == 3
        theirs, ours = optimizer_tensors(loaded), optimizer_tensors(restored)
        assert theirs.keys() == ours.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs), (
            stage,
            dtype,
        )
        assert train(restored, DATA[3:]) == train(loaded, DATA[3:]), (stage, dtype)
        destroy_engine(loaded)
        destroy_engine(restored)


@pytest.mark.either_key(job="two_rank_restores")  # one job, with a key or without (conftest)
def test_a_rank_failing_mid_restore_fails_it_on_every_rank_and_says_what_it_left(two_rank_restores):
    rank0, rank1 = two_rank_restores[1]["restore_fail"]
    left = {
        "masters": " (the engine's module weights are unchanged, its fp32 masters and optimizer state"
        " may be partly overwritten: restore again before training)",
        "state": " (the engine's module weights and fp32 masters are the step's, its optimizer state"
        " may be partly overwritten: restore again before training)",
    }
    for phase, said in left.items():
        assert rank0[phase]["outcome"] == (
            "StorageError: restore of step 3 failed on rank 1: injected: disk on fire" + said
        )
        assert rank1[phase]["outcome"] == "StorageError: injected: disk on fire" + said
        assert rank0[phase]["global_steps"] == rank1[phase]["global_steps"] == 0
    # what the errors say holds: the module weights untouched, then derived from the step's masters
    assert rank0["masters"]["weights_unchanged"] and rank1["masters"]["weights_unchanged"]
    assert rank0["state"]["weights_the_steps"] and rank1["state"]["weights_the_steps"]
    # and restoring again leaves the engine exactly as load_checkpoint of the step does
    assert rank0["again"] and rank1["again"]
