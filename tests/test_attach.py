"""``attach``: DeepSpeed's own save_checkpoint/load_checkpoint calls go through the store.

The reference is DeepSpeed resuming from its own directory of the same state (its save/load
is what the user would otherwise call)."""

import pytest

import ckptstore
from ckptstore.integrations.deepspeed import MARKER, attach, detach
from tools.engines import batches, build_engine, train

DATA = batches(6)


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (3, "fp32")])
def test_save_and_load_checkpoint_through_the_store_resume_like_deepspeeds_own(tmp_path, stage, dtype):
    engine = build_engine("llama", zero_stage=stage, dtype=dtype, seed=0, num_layers=2)
    train(engine, DATA[:3])
    engine.save_checkpoint(str(tmp_path / "deepspeed"), client_state={"epoch": 7})  # the reference
    store = ckptstore.open(tmp_path / "store")
    attach(engine, store)
    engine.save_checkpoint(str(tmp_path / "run"), client_state={"epoch": 7})

    # The directory names the step; the tensors are in the store only (DeepSpeed still copies
    # its zero_to_fp32 scripts in at ZeRO 1-3).
    files = {p.relative_to(tmp_path / "run").as_posix() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert files - {"zero_to_fp32.py", "zero_to_torch.py"} == {"global_step3/" + MARKER, "latest"}
    assert store.steps() == [3]

    reference = build_engine("llama", zero_stage=stage, dtype=dtype, seed=1, num_layers=2)
    _, reference_client = reference.load_checkpoint(str(tmp_path / "deepspeed"))
    resumed = build_engine("llama", zero_stage=stage, dtype=dtype, seed=2, num_layers=2)
    attach(resumed, store)
    path, client = resumed.load_checkpoint(str(tmp_path / "run"))
    assert path is not None and client["epoch"] == reference_client["epoch"] == 7
    assert resumed.global_steps == reference.global_steps == 3
    assert train(resumed, DATA[3:]) == train(reference, DATA[3:])


def test_a_strategy_and_a_tag_pass_through_and_detach_restores_deepspeed(tmp_path):
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    store = ckptstore.open(tmp_path / "store")
    attach(engine, store, layers=ckptstore.strategies.Parity())
    for step in (1, 2):
        train(engine, DATA[step - 1 : step])
        engine.save_checkpoint(str(tmp_path / "run"), tag="pytorch_model")  # accelerate's tag
    assert (tmp_path / "run" / "latest").read_text() == "pytorch_model"
    assert store.steps() == [1, 2] and store.log()[1].layers_saved < store.log()[0].layers_saved
    resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=1, num_layers=2)
    attach(resumed, store)
    resumed.load_checkpoint(str(tmp_path / "run"), tag="pytorch_model")
    assert resumed.global_steps == 2
    detach(engine)
    engine.save_checkpoint(str(tmp_path / "plain"))
    assert any(p.suffix == ".pt" for p in (tmp_path / "plain").rglob("*"))
    assert store.steps() == [1, 2]
