"""Mixture-of-Experts engines (DeepSpeed's ``deepspeed.moe.layer.MoE``): a step holds every
expert, ``materialize`` writes every file DeepSpeed's own save writes (the expert files, the
model states with ``num_experts``, the ZeRO-0 ``expp_rank`` optimizer file) with equal tensors,
and resumes from it and from ``restore`` train on as DeepSpeed's own resume does."""

import pytest
import torch

import ckptstore
from tests.model_parallel_worker import differences, tensors_of
from tools.engines import batches, destroy_engine, train
from tools.moe_engines import VOCAB, build_moe_engine

DATA = batches(5, vocab=VOCAB)


def stored_files(root) -> list:
    """The store's objects: every file but its catalog and its lock (a commit takes the lock)."""
    return sorted(p for p in root.rglob("*") if "catalog" not in p.name and p.name != "lock")


def train_seeded(engine, data) -> list[float]:
    # The top-2 gate draws Gumbel noise, and a checkpoint holds no RNG state: every resume
    # trains from the same RNG state, or no two would agree.
    torch.manual_seed(5)
    return train(engine, data)


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.either_key  # each configuration with a key or without, alternating (conftest)
def test_a_moe_step_materializes_deepspeeds_own_files_and_resumes_as_its_own_resume(tmp_path, stage, dtype):
    store = ckptstore.open(tmp_path / "store")
    engine = build_moe_engine(stage, dtype)
    train(engine, DATA[:3])
    store.commit(engine, step=3, blocking=stage != 1)  # non-blocking once
    store.wait()
    engine.save_checkpoint(str(tmp_path / "deepspeed"))
    destroy_engine(engine)

    store.materialize(3, tmp_path / "materialized")
    own = tmp_path / "deepspeed" / "global_step3"
    assert differences(tmp_path / "materialized" / "global_step3", own) == []
    names = {p.name for p in own.iterdir()}
    assert {
        f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)
    } <= names
    assert ("expp_rank_0_mp_rank_00_optim_states.pt" in names) == (stage == 0)
    states = torch.load(tmp_path / "materialized" / "global_step3" / "mp_rank_00_model_states.pt")
    assert states["num_experts"] == [4, 4] and states["ds_autoep_layers"] is None
    assert not any("deepspeed_experts" in key for key in states["module"])
    expert = tensors_of(
        tmp_path / "materialized" / "global_step3" / "layer_1_expert_2_mp_rank_00_model_states.pt"
    )
    assert sorted(expert) == [
        f"/blocks.3.moe.deepspeed_moe.experts.deepspeed_experts.2.{p}"
        for p in ("fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight")
    ]

    # Each resume saved again at once equals DeepSpeed's own save, and trains on as DeepSpeed's
    # own resume does; restore goes into an engine that trained on, as after a rollback.
    losses, resaved = {}, {}
    for seed, how in enumerate(("deepspeed", "materialized", "restored"), start=41):
        resumed = build_moe_engine(stage, dtype, seed=seed)
        if how == "restored":
            train(resumed, DATA[3:])
            assert store.restore(resumed, 3)[0] == 3
        else:
            resumed.load_checkpoint(str(tmp_path / how))
        assert resumed.global_steps == 3
        resumed.save_checkpoint(str(tmp_path / f"{how}-resaved"))
        resaved[how] = differences(tmp_path / f"{how}-resaved" / "global_step3", own)
        losses[how] = train_seeded(resumed, DATA[3:])
        destroy_engine(resumed)
    assert resaved == {"deepspeed": [], "materialized": [], "restored": []}
    assert losses["materialized"] == losses["restored"] == losses["deepspeed"]
