"""Committing real DeepSpeed engines and resuming from materialized checkpoints, bit-exactly."""

import pytest
import torch

import ckptstore
from ckptstore.deepspeed.extract import extract
from ckptstore.errors import BadInputError, ConflictError, CorruptError, NotFoundError
from tests.model_parallel_worker import differences
from tests.test_restore import own_memory
from tools.engines import batches, build_engine, destroy_engine, train

DATA = batches(6)


def state_values(engine) -> dict[tuple[str, str], torch.Tensor]:
    """Every (name, kind) tensor of a one-rank engine's checkpoint state, copied."""
    return {(p.name, p.kind): p.tensor.clone() for p in extract(engine).pieces}


def module_weights(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.module_state_dict().items()}


@pytest.mark.parametrize("model", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.either_key  # each configuration with a key or without, alternating (conftest)
def test_resume_from_materialized_step_gives_the_uninterrupted_losses(tmp_path, model, stage, dtype):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine(model, zero_stage=stage, dtype=dtype, seed=0)
    train(engine, DATA[:3])
    store.commit(engine, step=3)
    uninterrupted = train(engine, DATA[3:])

    store.materialize(3, tmp_path / "out")
    resumed = build_engine(model, zero_stage=stage, dtype=dtype, seed=99)
    resumed.load_checkpoint(str(tmp_path / "out"))
    assert resumed.global_steps == 3  # load_checkpoint silently loads nothing without `latest`
    assert train(resumed, DATA[3:]) == uninterrupted


@pytest.mark.parametrize("stage", [0, 2, 3])
@pytest.mark.either_key  # each configuration with a key or without, alternating (conftest)
def test_composite_step_gives_each_layer_the_tensors_of_the_step_that_saved_it(tmp_path, stage):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=stage, dtype="bf16", seed=0, num_layers=4)
    train(engine, DATA[:2])
    store.commit(engine, step=4)
    at_4 = state_values(engine)
    train(engine, DATA[2:4])
    store.commit(engine, step=6, layers=["model.layers.1", "model.layers.3"])
    at_6 = state_values(engine)

    assert store.steps() == [4, 6]
    sources = store.sources(6)
    assert sources == {
        "model.embed_tokens": 4, "model.layers.0": 4, "model.layers.1": 6, "model.layers.2": 4,
        "model.layers.3": 6, "model.norm": 4, "lm_head": 4,
    }  # fmt: skip

    store.materialize(6, tmp_path / "out")
    resumed = build_engine("llama", zero_stage=stage, dtype="bf16", seed=99, num_layers=4)
    resumed.load_checkpoint(str(tmp_path / "out"))
    assert resumed.global_steps == engine.global_steps
    loaded = state_values(resumed)
    assert loaded.keys() == at_6.keys()
    for (name, kind), tensor in loaded.items():
        layer = ckptstore.layers.layer_of(name)
        expected = (at_6 if sources[layer] == 6 else at_4)[(name, kind)]
        assert torch.equal(tensor, expected), (name, kind)
    if stage < 3:  # module weights are the masters cast down, for inherited layers too
        for name, weight in module_weights(resumed).items():
            if (name, "fp32") in loaded:
                assert torch.equal(weight, loaded[(name, "fp32")].to(weight.dtype)), name
    losses = train(resumed, DATA[4:])
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses)


def test_recommits_and_partial_commits_add_few_bytes(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=8)
    train(engine, DATA[:2])
    full = store.commit(engine, step=2)
    unchanged = store.commit(engine, step=3)
    train(engine, DATA[2:3])
    partial = store.commit(engine, step=4, layers=["model.layers.2", "model.layers.5"])
    assert full.bytes_added > 0
    layers = len(store.sources(2))
    assert full.blobs_added == layers  # one pack per layer on one rank (all far under PACK_BYTES)
    assert (unchanged.blobs_added, unchanged.bytes_added) == (0, 0)  # every pack already stored
    assert partial.blobs_added == 2 and partial.bytes_added < 0.30 * full.bytes_added
    assert partial.layers_saved == ["model.layers.2", "model.layers.5"]
    log = {row.step: row for row in store.log()}
    assert log[2].bytes_added == full.bytes_added and log[4].layers_saved == 2 and log[4].layers_total == 11


@pytest.fixture(scope="module")
def small_store(tmp_path_factory, store_key):
    root = tmp_path_factory.mktemp("small")
    store = ckptstore.open(root / "store")
    engine = build_engine("gpt2", zero_stage=1, dtype="bf16", seed=0, num_layers=2)
    train(engine, DATA[:2])
    store.commit(engine, step=2)
    train(engine, DATA[2:3])
    store.commit(engine, step=3, layers=["transformer.h.1"])
    store.close()
    return root / "store"


def pack_files(store_path):
    return sorted(p for p in (store_path / "packs").rglob("*") if p.is_file())


def test_every_flipped_pack_is_named_by_verify_and_stops_materialize(small_store, tmp_path):
    store = ckptstore.open(small_store)
    assert store.verify().ok
    assert len(pack_files(small_store)) >= 3
    for path in pack_files(small_store):
        original = path.read_bytes()
        damaged = bytearray(original)
        damaged[len(damaged) // 2] ^= 0xFF
        path.write_bytes(bytes(damaged))
        try:
            report = store.verify()
            assert [p.blob for p in report.problems] == [path.name]
            assert "corrupt" in report.problems[0].describe()
            needed_by = {u[0] for u in report.problems[0].users}
            with pytest.raises(CorruptError, match=path.name):
                store.materialize(max(needed_by), tmp_path / "out")
            assert not (tmp_path / "out").exists()
        finally:
            path.write_bytes(original)
    assert store.verify().ok


def test_a_deleted_pack_is_reported_against_every_step_that_needs_it(small_store, tmp_path):
    store = ckptstore.open(small_store)
    sources = store.sources(3)
    inherited_layer = next(layer for layer, source in sources.items() if source == 2)
    (index,) = store.catalog.layer_packs(2, [inherited_layer])
    key = index.packs[0].key
    path = small_store / "packs" / key[:2] / key
    original = path.read_bytes()
    path.unlink()
    try:
        report = store.verify(deep=False)
        assert len(report.problems) == 1 and report.problems[0].problem == "is missing"
        assert sorted({u[0] for u in report.problems[0].users}) == [2, 3]
        assert (
            report.problems[0]
            .describe()
            .startswith(f"pack {key} ({inherited_layer}: rank 0's tensors) is missing")
        )
        with pytest.raises(NotFoundError, match=key):
            store.materialize(3, tmp_path / "out")
    finally:
        path.write_bytes(original)


def test_materialize_refuses_unknown_steps_and_non_empty_output(small_store, tmp_path):
    store = ckptstore.open(small_store)
    with pytest.raises(NotFoundError, match="step 7 does not exist; committed steps: 2, 3"):
        store.materialize(7, tmp_path / "out")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ConflictError, match="not empty"):
        store.materialize(3, tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    with pytest.raises(ConflictError, match="--force replaces only a folder materialize or export wrote"):
        store.materialize(3, tmp_path / "out", force=True)  # not one materialize wrote
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    store.materialize(2, tmp_path / "made")
    store.materialize(3, tmp_path / "made", force=True)
    assert (tmp_path / "made" / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["made", "out"]  # no staging directories left behind


def test_commit_refuses_bad_layer_selections_and_duplicate_steps(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=0, dtype="fp32", seed=0, num_layers=2)
    train(engine, DATA[:1])
    with pytest.raises(BadInputError, match="first step, so it must save every layer"):
        store.commit(engine, step=1, layers=["model.layers.0"])
    store.commit(engine, step=1)
    with pytest.raises(BadInputError, match="unknown layer model.layers.9"):
        store.commit(engine, step=2, layers=["model.layers.9"])
    with pytest.raises(BadInputError, match="not a single string"):
        store.commit(engine, step=2, layers="model.layers.0")
    with pytest.raises(BadInputError, match=r"layers=\[\] saves no layer"):  # a step of counters alone
        store.commit(engine, step=50, layers=[])
    with pytest.raises(ConflictError, match="step 1 is already committed"):
        store.commit(engine, step=1)
    with pytest.raises(BadInputError, match="non-negative integer"):
        store.commit(engine, step=-1)
    assert store.steps() == [1]


def test_client_state_round_trips_into_the_checkpoint(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="fp32", seed=0, num_layers=2)
    train(engine, DATA[:1])
    store.commit(engine, step=1, client_state={"epoch": 3, "position": (17, 2)})
    store.materialize(1, tmp_path / "out")
    resumed = build_engine("llama", zero_stage=2, dtype="fp32", seed=5, num_layers=2)
    _, client_state = resumed.load_checkpoint(str(tmp_path / "out"))
    assert client_state["epoch"] == 3 and client_state["position"] == (17, 2)


def build_variant(stage, dtype, seed, freeze=None, **overrides):
    """An engine whose layers listed in ``freeze`` do not train (requires_grad=False)."""
    import deepspeed

    from tools.engines import build_model, ds_config

    module = build_model("llama", seed=seed, num_layers=3)
    for name, param in module.named_parameters():
        if freeze and any(name.startswith(prefix + ".") for prefix in freeze):
            param.requires_grad_(False)
    trainable = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in trainable if p.dim() <= 1], "weight_decay": 0.0},
    ]
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=groups, config=ds_config(stage, dtype, **overrides)
    )
    return engine


@pytest.mark.parametrize(
    "stage, dtype, freeze, overrides",
    [
        (1, "bf16", None, {"data_types": {"grad_accum_dtype": "fp32"}}),  # BF16_Optimizer
        (0, "fp32", None, {"optimizer": {"params": {"torch_adam": True}}}),  # torch AdamW, tensor steps
        (0, "bf16", None, {"optimizer": {"params": {"torch_adam": True}}}),  # FP16_UnfusedOptimizer
        (2, "bf16", None, {"optimizer": {"params": {"torch_adam": True}}}),
        (1, "fp32", ["model.layers.0"], {}),
        (2, "bf16", ["model.layers.0"], {}),
        (3, "bf16", ["model.layers.0"], {}),
        (3, "fp32", None, {"zero_optimization": {"sub_group_size": 2000}}),  # several ZeRO-3 sub-groups
    ],
    ids=["bf16-optimizer", "torch-adam-zero0", "unfused-zero0-bf16", "torch-adam-zero2", "frozen-zero1", "frozen-zero2", "frozen-zero3",
         "zero3-subgroups"],
)  # fmt: skip
@pytest.mark.either_key  # multi-process: with a key or without, alternating (conftest)
def test_engine_variants_resume_bit_exactly(tmp_path, stage, dtype, freeze, overrides):
    store = ckptstore.open(tmp_path / "store")
    engine = build_variant(stage, dtype, 0, freeze, **overrides)
    train(engine, DATA[:3])
    store.commit(engine, step=3)
    uninterrupted = train(engine, DATA[3:])
    store.materialize(3, tmp_path / "out")
    resumed = build_variant(stage, dtype, 42, freeze, **overrides)
    resumed.load_checkpoint(str(tmp_path / "out"))
    assert resumed.global_steps == 3
    assert train(resumed, DATA[3:]) == uninterrupted
    restored = build_variant(stage, dtype, 43, freeze, **overrides)
    store.restore(restored, 3)
    assert restored.global_steps == 3
    assert train(restored, DATA[3:]) == uninterrupted


# ZeRO-Offload as Trainer users run it to fine-tune on few GPUs: the fp32 masters and Adam moments
# on the CPU, stepped by DeepSpeedCPUAdam (its cpu_adam op is JIT-built on first use), and at
# ZeRO 3 the parameters' partitions too.
CPU = {"device": "cpu", "pin_memory": True}


@pytest.mark.parametrize(
    "stage, dtype, offload",
    [
        (2, "bf16", {"offload_optimizer": CPU}),
        (3, "bf16", {"offload_optimizer": CPU}),
        (3, "fp32", {"offload_optimizer": CPU, "offload_param": CPU}),
    ],
    ids=["offload-optimizer-zero2", "offload-optimizer-zero3", "offload-param-zero3"],
)
@pytest.mark.either_key  # each configuration with a key or without, alternating (conftest)
def test_zero_offload_steps_materialize_deepspeeds_own_files_and_resume_as_its_own_resume(
    tmp_path, stage, dtype, offload
):
    overrides = {"zero_optimization": offload}
    store = ckptstore.open(tmp_path / "store")
    engine = build_variant(stage, dtype, 0, **overrides)
    assert type(engine.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    assert (engine.zero_offload_param() is not None) == ("offload_param" in offload)
    train(engine, DATA[:3])
    store.commit(engine, step=3)
    engine.save_checkpoint(str(tmp_path / "deepspeed"))
    destroy_engine(engine)
    store.materialize(3, tmp_path / "materialized")
    own = tmp_path / "deepspeed" / "global_step3"
    assert differences(tmp_path / "materialized" / "global_step3", own) == []

    # Each resume saved again at once equals DeepSpeed's own save, and trains on as DeepSpeed's
    # own resume does (not the uninterrupted run: DeepSpeed's own save and load of a step is not
    # always bit-exact on this CPU). Restore fills the engine's own CPU partitions and moments,
    # here of an engine that has trained a step, as after a rollback.
    losses, resaved = {}, {}
    for seed, how in enumerate(("deepspeed", "materialized", "restored"), start=41):
        resumed = build_variant(stage, dtype, seed, **overrides)
        if how == "restored":
            train(resumed, DATA[5:])
            before = own_memory(resumed)
            assert store.restore(resumed, 3)[0] == 3
            assert own_memory(resumed) == before
        else:
            resumed.load_checkpoint(str(tmp_path / how))
        assert resumed.global_steps == 3
        resumed.save_checkpoint(str(tmp_path / f"{how}-resaved"))
        resaved[how] = differences(tmp_path / f"{how}-resaved" / "global_step3", own)
        losses[how] = train(resumed, DATA[3:])
        destroy_engine(resumed)
    assert resaved == {"deepspeed": [], "materialized": [], "restored": []}
    assert losses["materialized"] == losses["restored"] == losses["deepspeed"]


def _cpu_has_fp16() -> bool:
    return bool(getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)())


def _loss_scale(engine) -> float:
    scaler = getattr(engine.optimizer, "loss_scaler", None) or engine.optimizer.loss_scale_config
    return scaler.cur_scale


@pytest.mark.skipif(not _cpu_has_fp16(), reason="DeepSpeed refuses fp16 on CPUs without AVX512-FP16")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_with_a_moving_loss_scale_resumes_bit_exactly(tmp_path, stage):
    # A huge initial scale overflows at once and a window of 2 raises it again, so the
    # dynamic loss scaler's state differs from a fresh one's when the step is committed.
    fp16 = {"initial_scale_power": 20, "loss_scale_window": 2}
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=stage, dtype="fp16", seed=0, num_layers=2, fp16=fp16)
    train(engine, DATA[:3])
    scale = _loss_scale(engine)
    assert scale != 2.0**20
    store.commit(engine, step=3)
    uninterrupted = train(engine, DATA[3:])
    store.materialize(3, tmp_path / "out")
    resumed = build_engine("llama", zero_stage=stage, dtype="fp16", seed=9, num_layers=2, fp16=fp16)
    resumed.load_checkpoint(str(tmp_path / "out"))
    assert resumed.global_steps == 3 and _loss_scale(resumed) == scale
    assert train(resumed, DATA[3:]) == uninterrupted
