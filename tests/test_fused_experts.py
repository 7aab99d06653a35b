"""A Hugging Face MoE model's fused experts (Mixtral's ``mlp.experts.gate_up_proj``
[experts, 2 x intermediate, hidden]) are stored as a piece per expert, each expert a layer."""

import deepspeed
import pytest
import torch

import ckptstore
from ckptstore import fused_experts, tensorsplit
from ckptstore.errors import BadInputError
from ckptstore.model import FP32, Piece
from tests.model_parallel_worker import differences
from tests.moe_worker import resume_three_ways
from tools.engines import batches, destroy_engine, train
from tools.moe_engines import VOCAB, build_mixtral_engine

DATA = batches(5, vocab=VOCAB)
FUSED = "model.layers.1.mlp.experts.gate_up_proj"  # [4, 48, 16]
EXPERT = "model.layers.1.mlp.experts.{}"


def test_a_fused_parameters_pieces_are_cut_at_expert_boundaries_and_named_by_expert():
    params = {FUSED: {"shape": [4, 3, 2], "dtype": "bfloat16", "trainable": True}}
    fused_experts.mark(params, {FUSED: 4})
    assert params[FUSED]["experts"] == {"dim": 0, "sizes": [1, 1, 1, 1]}
    master = torch.arange(24, dtype=torch.float32)
    # a rank's fragment from element 4 to 17: the end of expert 0, expert 1 whole, the start of expert 2
    pieces = fused_experts.cut([Piece(FUSED, FP32, 4, master[4:17])], params)
    assert [(p.name, p.start, p.tensor.tolist()) for p in pieces] == [
        ("model.layers.1.mlp.experts.0.gate_up_proj", 4, [4.0, 5.0]),
        ("model.layers.1.mlp.experts.1.gate_up_proj", 0, master[6:12].view(1, 3, 2).tolist()),
        ("model.layers.1.mlp.experts.2.gate_up_proj", 0, [12.0, 13.0, 14.0, 15.0, 16.0]),
    ]
    assert list(fused_experts.piece_params(params)) == [
        f"model.layers.1.mlp.experts.{e}.gate_up_proj" for e in range(4)
    ]


def test_experts_that_are_no_slices_of_a_parameters_rows_are_a_malformed_description():
    good = {
        "shape": [4, 3, 2],
        "dtype": "float32",
        "trainable": True,
        "experts": {"dim": 0, "sizes": [1] * 4},
    }
    assert tensorsplit.description_problem({"params": {FUSED: good}}) is None
    for bad in ({"dim": 1, "sizes": [1, 1, 1]}, {"dim": 0, "sizes": [1, 1]}, {"dim": 0, "sizes": [0, 2, 1, 1]},
                {"dim": True, "sizes": [1] * 4}, [1, 1, 1, 1], {"dim": 0, "sizes": [1] * 4, "sub": [[1]]}):  # fmt: skip
        problem = tensorsplit.description_problem({"params": {FUSED: {**good, "experts": bad}}})
        assert problem is not None and FUSED in problem, bad


@pytest.mark.parametrize("stage", [2, 3])
def test_a_fused_expert_model_stores_a_piece_per_expert_and_resumes_as_deepspeeds_own(tmp_path, stage):
    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_mixtral_engine(stage, "bf16")
    train(engine, DATA[:3])
    report = store.commit(engine, step=3)
    engine.save_checkpoint(str(tmp_path / "deepspeed"))
    fused = dict(engine.module.named_parameters())[FUSED]
    with deepspeed.zero.GatheredParameters([fused], enabled=stage == 3):
        live = fused.detach().clone()
    destroy_engine(engine)

    assert report.layers_saved[:6] == ["model.embed_tokens", "model.layers.0"] + [
        f"model.layers.0.mlp.experts.{e}" for e in range(4)
    ]
    stored = {row.name for row in store.catalog.tensors(3, [EXPERT.format(2)])} | {
        name for index in store.catalog.layer_packs(3, [EXPERT.format(2)]) for name, _, _ in index.tensors
    }
    assert stored == {"model.layers.1.mlp.experts.2.gate_up_proj", "model.layers.1.mlp.experts.2.down_proj"}

    store.materialize(3, tmp_path / "materialized")
    own = tmp_path / "deepspeed" / "global_step3"
    assert differences(tmp_path / "materialized" / "global_step3", own) == []
    run = resume_three_ways(store, lambda seed: build_mixtral_engine(stage, "bf16", seed=seed), tmp_path, own)
    assert run["restored_step"] == 3
    assert run["deepspeed_resaved"] == run["materialized_resaved"] == run["restored_resaved"] == []
    assert run["materialized_losses"] == run["restored_losses"] == run["deepspeed_losses"]

    # export writes the fused parameter whole, under the model's own name
    from safetensors.torch import load_file

    store.export(3, tmp_path / "export")
    exported = load_file(next((tmp_path / "export").rglob("*.safetensors")))
    assert torch.equal(exported[FUSED], live)


def test_one_expert_of_a_fused_parameter_is_saved_alone_and_experts_without_tokens_are_stored_once(tmp_path):
    from ckptstore.strategies import UpdateMagnitude

    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_mixtral_engine(2, "bf16", weight_decay=0.0)
    for name, param in engine.module.named_parameters():
        if ".mlp.experts." in name:  # expert 0 of every layer sees no tokens: its gradient is 0
            param.register_hook(lambda grad: grad.index_fill(0, torch.tensor([0]), 0.0))
    train(engine, DATA[:3])
    first = store.commit(engine, step=3)
    train(engine, DATA[3:4])
    composite = store.commit(engine, step=4, layers=[EXPERT.format(2)])
    engine.save_checkpoint(str(tmp_path / "deepspeed"))
    train(engine, DATA[4:5])
    again = store.commit(engine, step=5)  # every layer saved
    train(engine, DATA[:2])
    picked = store.commit(engine, step=6, layers=UpdateMagnitude(threshold=0.0))
    train(engine, DATA[:1])
    unmoved = [f"model.layers.{layer}.mlp.experts.0" for layer in (0, 1)]
    # the experts that did not move, saved again, add nothing (the store's own figure)
    assert store.commit(engine, step=7, layers=unmoved).bytes_added == 0
    destroy_engine(engine)

    assert composite.layers_saved == [EXPERT.format(2)]
    assert {layer: store.sources(4)[layer] for layer in ("model.layers.1", EXPERT.format(1), EXPERT.format(2))} == {
        "model.layers.1": 3, EXPERT.format(1): 3, EXPERT.format(2): 4,
    }  # fmt: skip
    store.materialize(4, tmp_path / "composite")
    store.materialize(3, tmp_path / "step3")
    state = {
        how: torch.load(root / f"global_step{n}" / "mp_rank_00_model_states.pt", weights_only=False)["module"][FUSED]
        for how, root, n in (("own", tmp_path / "deepspeed", 4), ("composite", tmp_path / "composite", 4),
                             ("step3", tmp_path / "step3", 3))
    }  # fmt: skip
    assert torch.equal(state["composite"][2], state["own"][2])
    assert all(torch.equal(state["composite"][e], state["step3"][e]) for e in (0, 1, 3))
    assert not torch.equal(state["own"][1], state["step3"][1])

    assert all(first.updates[layer] is None for layer in unmoved)
    assert [again.updates[layer] for layer in unmoved] == [0.0, 0.0]
    assert all(again.updates[EXPERT.format(e)] > 0 for e in (1, 2, 3))
    assert set(unmoved) <= set(picked.layers_inherited) and EXPERT.format(2) in picked.layers_saved
    assert store.verify().ok


def test_a_step_that_kept_each_fused_tensor_whole_still_reads_and_the_next_commit_saves_every_layer(
    tmp_path, monkeypatch
):
    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_mixtral_engine(2, "bf16")
    train(engine, DATA[:3])
    with monkeypatch.context() as before:  # as commits did before experts were pieces
        before.setattr(fused_experts, "find", lambda module, params: {})
        assert "model.layers.1.mlp.experts.2" not in store.commit(engine, step=3).layers_saved
    engine.save_checkpoint(str(tmp_path / "deepspeed"))
    train(engine, DATA[3:4])
    with pytest.raises(BadInputError, match="model or world size changed since step 3"):
        store.commit(engine, step=4, layers=[EXPERT.format(2)])
    assert EXPERT.format(2) in store.commit(engine, step=4).layers_saved
    destroy_engine(engine)

    own = tmp_path / "deepspeed" / "global_step3"
    store.materialize(3, tmp_path / "materialized")
    assert differences(tmp_path / "materialized" / "global_step3", own) == []
    engine = build_mixtral_engine(2, "bf16", seed=7)
    assert store.restore(engine, 3)[0] == 3
    engine.save_checkpoint(str(tmp_path / "restored"))
    destroy_engine(engine)
    assert differences(tmp_path / "restored" / "global_step3", own) == []
