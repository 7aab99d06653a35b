"""Layer selection strategies: which layers each commit saves, exactly, over a run of commits."""

import pytest
import torch

import ckptstore
from ckptstore.deepspeed.extract import extract
from ckptstore.errors import BadInputError
from ckptstore.layers import layer_of
from ckptstore.strategies import CommitContext, Filter, Parity, UpdateMagnitude
from tests.test_many_ranks import torchrun
from tools.engines import batches, build_engine, train

DATA = batches(12)
AUX = ["model.embed_tokens", "model.norm", "lm_head"]


def blocks(*numbers):
    return [f"model.layers.{n}" for n in numbers]


def in_model_order(layers, num_blocks):
    order = ["model.embed_tokens", *blocks(*range(num_blocks)), "model.norm", "lm_head"]
    return [layer for layer in order if layer in layers]


def commit_run(tmp_path, strategy, commits, num_blocks=6, stage=2, dtype="bf16"):
    """Train one step before each of ``commits`` commits under ``strategy``; the layers each saved."""
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=stage, dtype=dtype, seed=0, num_layers=num_blocks)
    saved = {}
    for step in range(1, commits + 1):
        train(engine, DATA[step - 1 : step])
        saved[step] = store.commit(engine, step=step, layers=strategy).layers_saved
    return store, saved


def test_parity_saves_odd_then_even_blocks_and_aux_layers_every_time(tmp_path):
    store, saved = commit_run(tmp_path, Parity(), commits=5)
    odd = in_model_order(AUX + blocks(1, 3, 5), 6)
    even = in_model_order(AUX + blocks(0, 2, 4), 6)
    assert saved == {1: in_model_order(AUX + blocks(*range(6)), 6), 2: odd, 3: even, 4: odd, 5: even}
    assert store.sources(5) == {
        "model.embed_tokens": 5, "model.layers.0": 5, "model.layers.1": 4, "model.layers.2": 5,
        "model.layers.3": 4, "model.layers.4": 5, "model.layers.5": 4, "model.norm": 5, "lm_head": 5,
    }  # fmt: skip


def test_filter_saves_edge_blocks_every_commit_and_the_rest_every_nth(tmp_path):
    _, saved = commit_run(tmp_path, Filter(first=1, last=2, every=3), commits=7)
    everything = in_model_order(AUX + blocks(*range(6)), 6)
    edges = in_model_order(AUX + blocks(0, 4, 5), 6)
    assert saved == {1: everything, 2: edges, 3: edges, 4: everything, 5: edges, 6: edges, 7: everything}


def test_a_callable_decides_per_layer_from_the_context(tmp_path):
    def round_robin(layer, context: CommitContext) -> bool:
        return layer == context.blocks[len(context.steps) % len(context.blocks)]

    _, saved = commit_run(tmp_path, round_robin, commits=5, num_blocks=3)
    assert saved == {
        1: in_model_order(AUX + blocks(0, 1, 2), 3),  # a store's first commit saves everything
        2: blocks(1),
        3: blocks(2),
        4: blocks(0),
        5: blocks(1),
    }


def scale_(engine, layer, factor):
    """Multiply every fp32 master of ``layer`` by ``factor`` (ZeRO 0, fp32: the masters are the params)."""
    with torch.no_grad():
        for name, param in engine.module.named_parameters():
            if layer_of(name) == layer:
                param.mul_(factor)


def test_update_magnitude_saves_layers_that_moved_since_their_last_save(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=0, dtype="fp32", seed=0, num_layers=4)
    train(engine, DATA[:1])
    strategy = UpdateMagnitude(threshold=1e-3, max_age=3)

    first = store.commit(engine, step=1, layers=strategy)
    assert first.layers_saved == in_model_order(AUX + blocks(0, 1, 2, 3), 4)
    assert set(first.updates.values()) == {None}  # nothing to compare with yet

    scale_(engine, "model.layers.1", 1.01)  # moves by 1e-2
    scale_(engine, "lm_head", 1.0006)  # moves by 6e-4: below the threshold
    second = store.commit(engine, step=2, layers=strategy)
    assert second.layers_saved == ["model.layers.1"]
    assert second.updates["model.layers.1"] == pytest.approx(1e-2, rel=1e-4)
    assert second.updates["lm_head"] == pytest.approx(6e-4, rel=1e-3)
    assert second.updates["model.layers.0"] == 0.0

    scale_(engine, "lm_head", 1.0006)  # 1.2e-3 since its last save at step 1: now over
    third = store.commit(engine, step=3, layers=strategy)
    assert third.layers_saved == ["lm_head"]
    assert third.updates["lm_head"] == pytest.approx(1.0006**2 - 1, rel=1e-3)
    assert third.updates["model.layers.1"] == 0.0  # compared with its save at step 2

    fourth = store.commit(engine, step=4, layers=strategy)  # nothing moved, but max_age=3
    assert fourth.layers_saved == in_model_order(["model.embed_tokens", "model.norm", *blocks(0, 2, 3)], 4)
    assert sorted(fourth.layers_saved + list(fourth.layers_inherited)) == sorted(first.layers_saved)
    assert fourth.layers_inherited == {"model.layers.1": 2, "lm_head": 3}


def test_recorded_updates_estimate_the_true_relative_change(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=0, dtype="fp32", seed=0, num_layers=2)
    train(engine, DATA[:3])
    store.commit(engine, step=3)
    before = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    train(engine, DATA[3:6])
    report = store.commit(engine, step=6)
    after = {name: p.detach() for name, p in engine.module.named_parameters()}
    for layer, estimate in report.updates.items():
        names = [name for name in before if layer_of(name) == layer]
        moved = sum(float((after[n] - before[n]).double().norm() ** 2) for n in names)
        size = sum(float(before[n].double().norm() ** 2) for n in names)
        assert estimate == pytest.approx((moved / size) ** 0.5, rel=0.1), layer
    assert [row.update for row in store.show(6)] == list(report.updates.values())


def test_a_parity_run_resumed_from_a_composite_step_trains_on(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=4)
    batch = DATA[:2]  # the same two batches over and over: the loss must fall
    saved = {}
    for step in (2, 4, 6, 8):
        train(engine, batch)
        store.commit(engine, step=step, layers=Parity())
        saved[step] = {(p.name, p.kind): p.tensor.clone() for p in extract(engine).pieces}
    sources = store.sources(8)
    assert sorted(set(sources.values())) == [6, 8]

    store.materialize(8, tmp_path / "out")
    resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=7, num_layers=4)
    resumed.load_checkpoint(str(tmp_path / "out"))
    assert resumed.global_steps == 8
    for piece in extract(resumed).pieces:
        expected = saved[sources[layer_of(piece.name)]][(piece.name, piece.kind)]
        assert torch.equal(piece.tensor, expected), (piece.name, piece.kind)
    losses = train(resumed, batch * 3)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


def test_strategy_arguments_are_checked():
    with pytest.raises(BadInputError, match="every"):
        Filter(first=1, last=1, every=0)
    with pytest.raises(BadInputError, match="threshold"):
        UpdateMagnitude(threshold=-1)
    with pytest.raises(BadInputError, match="max_age"):
        UpdateMagnitude(threshold=0.1, max_age=0)


@pytest.mark.either_key  # multi-process: with a key or without, alternating (conftest)
def test_two_ranks_choose_the_same_layers_and_record_whole_tensor_samples(tmp_path):
    rank0, rank1 = torchrun("tailor", tmp_path)
    for config in ("tailor-zero2", "tailor-zero3"):
        assert rank0[config]["runs"] == rank1[config]["runs"], config
        assert rank0[config]["mismatched"] == [], config
        saved = [len(run["saved"]) for run in rank0[config]["runs"]]
        assert saved[0] == 6 and min(saved[1:]) < 6, (config, saved)  # some commits were partial


def test_block_strategies_count_an_expert_with_its_block():
    experts = "blocks.{}.moe.deepspeed_moe.experts.deepspeed_experts.{}"
    layers = ("embed", "blocks.0", "blocks.1", experts.format(1, 0), experts.format(1, 1), "blocks.2",
              "blocks.3", experts.format(3, 0), "head")  # fmt: skip
    context = CommitContext(
        step=5, layers=layers, steps=(1, 2, 3, 4), sources=dict.fromkeys(layers, 4), updates={}
    )
    # the edge blocks 0 and 3, block 3's expert included; block 1's experts wait with block 1
    assert Filter(first=1, last=1, every=4).select(context) == [
        "embed",
        "blocks.0",
        "blocks.3",
        experts.format(3, 0),
        "head",
    ]
    # the odd blocks with their experts
    assert Parity().select(context) == [
        "embed",
        "blocks.1",
        experts.format(1, 0),
        experts.format(1, 1),
        "blocks.3",
        experts.format(3, 0),
        "head",
    ]
