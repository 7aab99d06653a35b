"""Model-parallel DeepSpeed engines: pipeline and tensor-parallel steps are DeepSpeed's own checkpoints.

The jobs run under ``torch.distributed.run`` (gloo on CPU) in tests/model_parallel_worker.py;
one job runs every configuration, since each start costs a fresh interpreter per rank.
"""

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, UnsupportedError
from tests.test_many_ranks import torchrun_modes
from tools.engines import (
    batches,
    build_engine,
    build_pipeline_engine,
    destroy_engine,
    train_pipeline,
)

WORKER = Path(__file__).with_name("model_parallel_worker.py")
sys.path.insert(0, str(WORKER.parent))
from model_parallel_worker import universal_unlike  # noqa: E402


def torchrun(mode: str, root: Path, nproc: int = 2) -> list[dict]:
    """Run one worker mode on ``nproc`` ranks; returns each rank's observations."""
    return torchrun_modes([mode], root, nproc, worker=WORKER, timeout=900)[mode]


@pytest.fixture(scope="module")
def two_rank_job(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """One job of 2 ranks for every two-rank scenario here (the two-stage pipeline, the pipeline
    resharded, tensor parallelism), each in its own folder: each start costs a fresh
    interpreter per rank."""
    root = tmp_path_factory.mktemp("two_ranks")
    return root, torchrun_modes(["pipeline", "reshard", "tensor_parallel"], root, worker=WORKER, timeout=900)


@pytest.fixture(scope="module")
def two_stage_pipeline(two_rank_job) -> tuple[Path, list[dict]]:
    root, observed = two_rank_job
    return root / "pipeline", observed["pipeline"]


CONFIGS = ["zero1-fp32", "zero1-bf16", "zero0-fp32"]


@pytest.mark.parametrize("config", CONFIGS)
def test_a_materialized_pipeline_step_is_deepspeeds_own_checkpoint_bit_for_bit(two_stage_pipeline, config):
    _, observed = two_stage_pipeline
    run = observed[0][config]
    assert run["materialized_files"] == run["deepspeed_files"]
    assert "layer_04-model_states.pt" in run["materialized_files"]
    assert "mp_rank_01_model_states.pt" in run["materialized_files"]
    assert run["as_written"] == []


@pytest.mark.parametrize("config", CONFIGS)
def test_a_pipeline_resumes_from_materialize_and_restore_as_from_deepspeeds_save(two_stage_pipeline, config):
    _, observed = two_stage_pipeline
    assert observed[0][config]["differences"] == {"materialized": [], "restore": []}
    for stage in observed:  # each stage trains on, and gets the last stage's losses
        losses = stage[config]["losses"]
        assert losses["materialized"] == losses["restore"] == losses["deepspeed"], config


def test_a_two_stage_pipeline_on_four_ranks_data_parallel_in_each_stage_resumes_bit_exactly(tmp_path):
    observed = torchrun("pipeline_bf16", tmp_path, nproc=4)
    run = observed[0]["zero1-bf16"]
    assert "bf16_zero_pp_rank_1_mp_rank_01_optim_states.pt" in run["materialized_files"]
    assert run["materialized_files"] == run["deepspeed_files"] and run["as_written"] == []
    assert run["differences"] == {"materialized": [], "restore": []}
    for rank in observed:
        losses = rank["zero1-bf16"]["losses"]
        assert losses["materialized"] == losses["restore"] == losses["deepspeed"]


def test_a_pipeline_layer_is_a_layer_index_and_a_composite_takes_each_from_its_step(two_stage_pipeline):
    root, observed = two_stage_pipeline
    for stage in observed:
        run = stage["zero1-fp32"]["composite"]
        assert run["wrong"] == [] and run["wrong_in_store"] == []
        assert run["sources"] == {"tied_modules.embed": 2, "1": 4, "2": 2, "3": 2, "4": 2}
    # every stage's weights under the pipeline module's names; the tied weight once
    assert observed[0]["zero1-fp32"]["composite"]["state_dict_keys"] == [
        "tied_modules.embed.weight", *[f"{layer}.{p}" for layer in (1, 2, 3, 4)
                                       for p in ("fc.weight", "fc.bias", "norm.weight", "norm.bias")],
    ]  # fmt: skip
    store = ckptstore.open(root / "zero1-fp32" / "store")
    assert store.verify().ok


def test_a_pipeline_step_restored_into_another_number_of_stages_equals_deepspeeds_universal_checkpoint(
    two_rank_job,
):
    observed = two_rank_job[1]["reshard"]
    for config in ("2to1-bf16", "1to2-fp32"):
        assert observed[0][config]["differences"] == [], config
        # the weights out, whatever the split, are the universal checkpoint's full tensors
        assert observed[0][config]["weights_unlike_universal"] == [], config
    for rank in observed:
        for config, run in rank.items():
            assert run["losses"]["restore"] == run["losses"]["universal"], config


def test_a_pipeline_step_restores_only_into_a_pipeline(two_stage_pipeline):
    root, _ = two_stage_pipeline
    store = ckptstore.open(root / "zero1-fp32" / "store")
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=2)
    with pytest.raises(BadInputError, match="committed by a pipeline engine, this is an engine without"):
        store.restore(engine, step=2)


def test_a_tensor_parallel_engine_without_autotp_or_universal_info_is_refused_naming_what_is_missing(
    tmp_path,
):
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=2)
    engine.mp_world_size = 2  # what a job with a Megatron-style mpu reports
    try:
        with pytest.raises(UnsupportedError, match="universal_checkpoint_info"):
            ckptstore.open(tmp_path / "store", create=True).commit(engine, step=1)
    finally:
        destroy_engine(engine)


@pytest.fixture(scope="module")
def tensor_parallel(two_rank_job) -> tuple[Path, dict]:
    """AutoTP-2 steps (ZeRO 1 fp32, ZeRO 2 bf16), steps of a Megatron-style model with its own
    mpu (ZeRO 1 fp32) and of AutoTP's Phi-3, whose fused ``qkv_proj`` of grouped-query attention
    is cut unevenly per sub-parameter (ZeRO 1 fp32), resumed, then each kind resharded to 1 and
    from 1 (the two-rank job's "tensor_parallel" mode)."""
    root, observed = two_rank_job
    return root / "tensor_parallel", observed["tensor_parallel"]


TP_CONFIGS = [
    ("autotp", "zero1-fp32"), ("autotp", "zero2-bf16"), ("megatron", "zero1-fp32"), ("fused_qkv", "zero1-fp32"),
]  # fmt: skip


@pytest.mark.parametrize("kind, config", TP_CONFIGS)
def test_a_tensor_parallel_step_materializes_as_deepspeeds_own_and_resumes_bit_exactly(
    tensor_parallel, kind, config
):
    _, observed = tensor_parallel
    run = observed[0][kind]["resume"][config]
    assert run["materialized_files"] == run["deepspeed_files"]
    assert "mp_rank_01_model_states.pt" in run["materialized_files"]
    assert run["as_written"] == []
    assert run["differences"] == {"materialized": [], "restore": []}
    for rank in observed:
        losses = rank[kind]["resume"][config]["losses"]
        assert losses["materialized"] == losses["restore"] == losses["deepspeed"], config


def test_a_tensor_parallel_layer_is_one_layer_whatever_the_slices_and_a_composite_takes_it_from_its_step(
    tensor_parallel,
):
    root, observed = tensor_parallel
    layers = {
        "autotp": {
            "model.embed_tokens": 2,
            "model.layers.0": 2,
            "model.layers.1": 4,
            "model.norm": 2,
            "lm_head": 2,
        },
        "megatron": {"embed": 2, "blocks.0": 2, "blocks.1": 4, "norm": 2, "head": 2},
    }
    layers["fused_qkv"] = layers["autotp"]
    for rank in observed:
        for kind, sources in layers.items():
            run = rank[kind]["resume"]["zero1-fp32"]["composite"]
            assert run["wrong"] == [] and run["wrong_in_store"] == [], kind
            assert run["sources"] == sources
    store = ckptstore.open(root / "autotp" / "zero1-fp32" / "store")
    assert store.verify().ok
    description = json.loads(store.catalog.description(2))
    # each parameter once, at its logical shape; a row-parallel one says how it is split
    o_proj = description["params"]["model.layers.0.self_attn.o_proj.weight"]
    assert o_proj["shape"] == [32, 32] and o_proj["split"] == {"dim": 1, "sizes": [16, 16]}
    assert "split" not in description["params"]["model.norm.weight"]
    assert store.state_dict(2)["model.layers.0.mlp.down_proj.weight"].shape == (32, 88)


def test_a_fused_qkv_proj_is_one_logical_parameter_each_rank_holding_a_piece_of_q_k_and_v(tensor_parallel):
    """AutoTP cuts grouped-query attention's q, k and v on head boundaries, unevenly on 2 ranks
    (6 query heads of 8 rows, 3 key/value heads): rank 0 holds 4 query heads, 2 key and 2 value
    heads, rank 1 the rest. The step keeps the parameter at the shape ds_to_universal writes
    (q, k and v whole, one after another; their equality is the reshard test's)."""
    root, _ = tensor_parallel
    store = ckptstore.open(root / "fused_qkv" / "zero1-fp32" / "store")
    assert store.verify().ok
    params = json.loads(store.catalog.description(2))["params"]
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["shape"] == [96, 48]
    assert qkv["split"] == {"dim": 0, "sizes": [64, 32], "sub": [[32, 16], [16, 8], [16, 8]]}
    gate_up = params["model.layers.1.mlp.gate_up_proj.weight"]  # two halves, each cut in two
    assert gate_up["split"] == {"dim": 0, "sizes": [64, 64], "sub": [[32, 32], [32, 32]]}
    assert params["model.layers.0.self_attn.o_proj.weight"]["split"] == {"dim": 1, "sizes": [32, 16]}
    assert store.state_dict(2)["model.layers.1.self_attn.qkv_proj.weight"].shape == (96, 48)


@pytest.mark.parametrize("kind", ["autotp", "megatron", "fused_qkv"])
def test_a_tensor_parallel_step_exports_its_full_tensors_under_the_models_own_names(
    tensor_parallel, kind, tmp_path
):
    from safetensors.torch import load_file

    root, _ = tensor_parallel
    store = ckptstore.open(root / kind / "zero1-fp32" / "store")
    weights = store.state_dict(2)  # equal to the universal checkpoint's (the reshard test)
    store.export(2, tmp_path / "out", dtype="float32")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(exported) == sorted(weights)
    assert [name for name, tensor in weights.items() if not torch.equal(exported[name], tensor)] == []


@pytest.mark.parametrize("kind", ["autotp", "megatron", "fused_qkv"])
def test_a_tensor_parallel_step_restored_into_another_degree_equals_deepspeeds_universal_checkpoint(
    tensor_parallel, kind
):
    _, observed = tensor_parallel
    for config in ("2to1-bf16", "1to2-fp32"):
        run = observed[0][kind]["reshard"][config]
        assert run["differences"] == [], config
        # state_dict gives the universal checkpoint's full tensors, a row-parallel one included
        assert run["weights_unlike_universal"] == [], config
        # ds_to_universal reads a materialized step as DeepSpeed's own
        assert run["universal_of_materialized"] == [], config
    for rank in observed:
        for config, run in rank[kind]["reshard"].items():
            assert run["losses"]["restore"] == run["losses"]["universal"], config


@pytest.mark.parametrize("kind", ["autotp", "megatron", "fused_qkv"])
def test_materialize_universal_of_a_tensor_parallel_step_is_ds_to_universal_of_deepspeeds_save(
    tensor_parallel, kind, tmp_path, run
):
    # the TP 2 bf16 step of the reshard job, on the command line: every file of ds_to_universal
    # of save_checkpoint's files of the same state, equal (AutoTP's affine maps, a fused
    # qkv_proj of uneven sub-parameters, Megatron-style row and column parallel patterns)
    root, _ = tensor_parallel
    here = root / f"{kind}-reshard" / "2to1-bf16"
    done = run("--store", here / "store", "materialize", "--universal", "--step", 2, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "latest_universal").read_text() == "global_step2_universal"
    ours = tmp_path / "out" / "global_step2_universal"
    assert universal_unlike(ours, here / "universal" / "global_step2") == []
    assert (ours / "mp_rank_01_model_states.pt").is_file()


def test_an_attached_pipeline_keeps_the_client_state_not_a_layer_file_for_it(tmp_path):
    from ckptstore.integrations.deepspeed import attach, detach

    engine = build_pipeline_engine(stages=1, dtype="fp32", num_layers=2)  # one stage: this process
    train_pipeline(engine, batches(2))
    store = ckptstore.open(tmp_path / "store", create=True)
    attach(engine, store)
    try:
        engine.save_checkpoint(str(tmp_path / "out"), client_state={"epoch": 7})
    finally:
        detach(engine)
    step = store.log()[-1].step
    model_state = json.loads(store.catalog.description(step))["model_parallel"]["ranks"][0]["model_state"]
    assert model_state["epoch"] == 7 and "fc.weight" not in model_state
    assert sorted(store.sources(step)) == ["1", "2", "tied_modules.embed"]
    destroy_engine(engine)


BAD_SPLITS = {
    "dim past the shape": {"dim": 7, "sizes": [1, 1]},
    "no sizes": {"dim": 0, "sizes": []},
    "dim as text": {"dim": "0", "sizes": None},
    "a negative size": {"dim": 0, "sizes": None},
}


def test_materialize_and_export_of_a_step_whose_manifest_has_a_malformed_split_exit_4_naming_it(
    run, tmp_path
):
    """A malformed tensor-parallel ``split`` is a corrupt step, not an internal error or a silent export."""
    from ckptstore.format import manifest
    from ckptstore.format.layout import manifest_name

    engine = build_engine("gpt2", zero_stage=1, dtype="fp32", seed=0, num_layers=2)
    clean = tmp_path / "clean"
    ckptstore.open(clean).commit(engine, step=3)
    destroy_engine(engine)
    for bad, split in BAD_SPLITS.items():
        root = tmp_path / bad.replace(" ", "-")
        shutil.copytree(clean, root)
        path = root / manifest_name(3)
        record = manifest.decode(path.read_bytes())
        description = json.loads(record.description)
        name, info = next((n, i) for n, i in description["params"].items() if len(i["shape"]) == 2)
        rows = info["shape"][0]
        sizes = {"dim as text": [rows], "a negative size": [rows + 1, -1]}.get(bad, split["sizes"])
        info["split"] = {**split, "sizes": sizes}
        path.write_bytes(manifest.encode(dataclasses.replace(record, description=json.dumps(description))))
        (root / "catalog.db").unlink()  # rebuilt from the manifests: the step's record is read again
        for command in ("materialize", "export"):
            result = run("--store", root, command, "--step", 3, tmp_path / f"out-{command}-{root.name}")
            assert result.returncode == 4, (bad, command, result)
            assert "step 3" in result.stderr and "Traceback" not in result.stderr, (bad, command, result)
            assert not (tmp_path / f"out-{command}-{root.name}").exists()
