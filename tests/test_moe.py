"""Mixture-of-Experts engines (DeepSpeed's ``deepspeed.moe.layer.MoE``): a step holds every
expert by its global index, ``materialize`` writes every file DeepSpeed's own save writes (the
expert files, the model states with ``num_experts``, the ZeRO-0 ``expp_rank`` optimizer files)
with equal tensors and entries, resumes from it and from ``restore`` train on as DeepSpeed's
own resume does, and a step moves across expert-parallel degrees, which DeepSpeed cannot do.

The two-rank scenarios run in one ``torch.distributed.run`` job (tests/moe_worker.py)."""

from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, UnsupportedError
from tests.model_parallel_worker import differences, tensors_of
from tests.moe_worker import logical_state, resume_three_ways, unlike
from tests.test_many_ranks import torchrun_modes
from tools.engines import batches, destroy_engine, train
from tools.moe_engines import VOCAB, build_mixtral_engine, build_moe_engine, build_moe_pipeline_engine

DATA = batches(5, vocab=VOCAB)
WORKER = Path(__file__).with_name("moe_worker.py")


def stored_files(root) -> list:
    """The store's objects: every file but its catalog and its lock (a commit takes the lock)."""
    return sorted(p for p in root.rglob("*") if "catalog" not in p.name and p.name != "lock")


# One rank, at two of the configurations; the 2-rank job runs ZeRO 0, 1 and 2 in fp32 and bf16.
@pytest.mark.parametrize(("stage", "dtype"), [(0, "fp32"), (2, "bf16")])
@pytest.mark.either_key  # each configuration with a key or without, alternating (conftest)
def test_a_moe_step_materializes_deepspeeds_own_files_and_resumes_as_its_own_resume(tmp_path, stage, dtype):
    store = ckptstore.open(tmp_path / "store")
    engine = build_moe_engine(stage, dtype)
    train(engine, DATA[:3])
    store.commit(engine, step=3, blocking=stage != 2)  # non-blocking once
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
    run = resume_three_ways(store, lambda seed: build_moe_engine(stage, dtype, seed=seed), tmp_path, own)
    assert (
        run["restored_step"] == run["deepspeed_step"] == run["materialized_step"] == run["restored_step"] == 3
    )
    assert run["deepspeed_resaved"] == run["materialized_resaved"] == run["restored_resaved"] == []
    assert run["materialized_losses"] == run["restored_losses"] == run["deepspeed_losses"]


def assert_as_deepspeeds_own(run: dict, where: tuple) -> None:
    """A configuration of the 2-rank job (``moe_worker.same_layout``) materialized DeepSpeed's own
    files and entries, and its three resumes saved again equal DeepSpeed's save and train alike."""
    assert run["materialized"] == run["materialized_layout"] == [], where
    assert run["restored_step"] == 3, where
    assert run["deepspeed_resaved"] == run["materialized_resaved"] == run["restored_resaved"] == [], where
    assert run["materialized_losses"] == run["restored_losses"] == run["deepspeed_losses"], where


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """One two-rank job: steps at expert parallelism 1 (expert data parallelism) and 2, each
    resharded into the other degree, a Hugging Face model's fused experts under ZeRO 2 and 3, and
    MoE layers inside a pipeline of 2 stages. Ep 1 first: DeepSpeed's ZeRO-0 load names its optimizer
    file after the largest expert group the process ever made."""
    root = tmp_path_factory.mktemp("moe")
    modes = ["ep1", "ep1_into_ep2", "ep2", "ep2_into_ep1", "fused", "pipeline"]
    return root, torchrun_modes(modes, root, worker=WORKER, timeout=600)


@pytest.mark.parametrize("layout", ["ep2", "ep1"])
def test_expert_parallel_steps_materialize_deepspeeds_own_files_and_resume_as_its_own_resume(
    two_ranks, layout
):
    _, observed = two_ranks
    configs = {"ep2": {f"zero{s}-{d}" for s in (0, 1, 2) for d in ("fp32", "bf16")},
               "ep1": {"zero0-bf16", "zero1-fp32", "zero2-bf16"}}[layout]  # fmt: skip
    for rank, runs in enumerate(observed[layout]):
        assert set(runs) == configs
        for config, run in runs.items():
            where = (layout, rank, config)
            assert_as_deepspeeds_own(run, where)
            # ep 2 at ZeRO 0: each expert-parallel rank's optimizer file; ep 1: one
            expp = [name for name in run["files"] if name.startswith("expp_rank_")]
            assert len(expp) == (0 if not config.startswith("zero0") else 2 if layout == "ep2" else 1), where


def test_fused_experts_cut_by_two_ranks_partitions_materialize_and_resume_as_deepspeeds_own(two_ranks):
    root, observed = two_ranks
    for rank, runs in enumerate(observed["fused"]):
        assert set(runs) == {"zero2-bf16", "zero3-bf16"}
        for config, run in runs.items():
            where = (rank, config)
            assert_as_deepspeeds_own(run, where)

    # the two ranks' step restores into one: every expert's weights, masters and moments
    config = root / "fused" / "zero3-bf16"
    store = ckptstore.open(config / "store")
    assert "model.layers.1.mlp.experts.3" in store.sources(3)
    engine = build_mixtral_engine(3, "bf16", seed=9)
    assert store.restore(engine, 3)[0] == 3
    assert unlike(logical_state(engine), torch.load(config / "logical.pt")) == []
    train(engine, DATA[3:4])
    destroy_engine(engine)


def test_moe_layers_inside_a_pipeline_materialize_deepspeeds_own_files_and_resume_as_its_own_resume(
    two_ranks,
):
    root, observed = two_ranks
    for rank, runs in enumerate(observed["pipeline"]):
        assert set(runs) == {"zero1-bf16", "zero0-fp32"}
        for config, run in runs.items():
            where = (rank, config)
            assert_as_deepspeeds_own(run, where)
            # No layer files: each stage's module is in its model-states file, and each stage
            # numbers its MoE layers from 0 in its expert files (docs/moe.md section 13).
            assert not [name for name in run["files"] if name.startswith("layer_0") and "expert" not in name]
            assert {
                f"layer_0_expert_{e}_mp_rank_{s:02d}_model_states.pt" for e in range(4) for s in (0, 1)
            } <= set(run["files"]), where
            expp = {name for name in run["files"] if name.startswith("expp_rank_")}
            assert expp == (
                {f"expp_rank_0_mp_rank_{s:02d}_optim_states.pt" for s in (0, 1)}
                if config == "zero0-fp32"
                else set()
            ), where
    store = ckptstore.open(root / "pipeline" / "zero1-bf16" / "store")
    engine = build_moe_pipeline_engine(1, "bf16", stages=1)  # the same model in one stage
    with pytest.raises(UnsupportedError, match="restore it into the same split"):
        store.restore(engine, 3)
    destroy_engine(engine)
    assert {
        "2.block.moe.deepspeed_moe.experts.deepspeed_experts.3",
        "4.block.moe.deepspeed_moe.experts.deepspeed_experts.0",
    } <= set(store.sources(3))
    assert store.verify().ok


@pytest.mark.parametrize("reshard", ["ep2_into_ep1", "ep1_into_ep2"])
def test_a_step_restores_and_materializes_at_another_expert_parallel_degree(two_ranks, reshard):
    _, observed = two_ranks
    for rank, runs in enumerate(observed[reshard]):
        assert set(runs) == {"zero0-bf16", "zero2-bf16"}
        for config, run in runs.items():
            where = (reshard, rank, config)
            assert run["restored_step"] == 3 and run["restored"] == [] and run["restored_trains"], where
            assert run["group_names"] == ["dense-params", f"ep_size_{reshard[-1]}"], where
            expp = [name for name in run["files"] if name.startswith("expp_rank_")]
            assert len(expp) == (0 if config == "zero2-bf16" else 2 if reshard == "ep1_into_ep2" else 1), (
                where
            )
            if "materialized" in run:  # (see moe_worker.reshard: not ep 2 -> 1 at ZeRO 0 in this job)
                assert run["materialized"] == [], where
        assert "materialized" in runs["zero2-bf16"]


@pytest.mark.parametrize("stage", [0, 2])
def test_an_expert_parallel_step_restores_and_materializes_into_one_rank(two_ranks, tmp_path, stage):
    root, _ = two_ranks
    config = root / "ep2" / f"zero{stage}-bf16"
    committed = torch.load(config / "logical.pt")
    store = ckptstore.open(config / "store")

    engine = build_moe_engine(stage, "bf16", seed=9, ep_size=1)
    assert store.restore(engine, 3)[0] == 3
    assert unlike(logical_state(engine), committed) == []
    destroy_engine(engine)

    store.materialize(3, tmp_path / "one-rank", world_size=1, ep_size=1)
    engine = build_moe_engine(stage, "bf16", seed=10, ep_size=1)
    engine.load_checkpoint(str(tmp_path / "one-rank"))
    assert unlike(logical_state(engine), committed) == []
    train(engine, DATA[3:4])
    destroy_engine(engine)


def test_expert_parallel_sizes_that_do_not_fit_are_refused_before_anything_is_written(
    two_ranks, tmp_path, run
):
    root, _ = two_ranks
    store = root / "ep2" / "zero2-bf16" / "store"
    out = tmp_path / "out"
    for args, code, message in [
        (
            ["--ep-size", "3", "--world-size", "3"],
            2,
            "4 experts of the MoE layer blocks.1.moe cannot be split over 3",
        ),
        (["--ep-size", "2", "--world-size", "1"], 2, "expert parallelism 2 does not divide the 1 ranks"),
        (["--world-size", "3"], 2, "expert parallelism 2 does not divide the 3 ranks"),
        (["--universal"], 6, "MoE layers have no universal form"),
    ]:
        result = run("--store", store, "materialize", "--step", "3", *args, out)
        assert (result.returncode, message in result.stderr) == (code, True), (args, result.stderr)
        assert "Traceback" not in result.stderr and not out.exists()
    with pytest.raises(UnsupportedError, match="no universal form"):
        ckptstore.open(store).materialize(3, out, universal=True)


def test_an_expert_parallel_size_for_a_step_without_experts_is_refused(tmp_path):
    from tools.engines import build_engine

    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_engine("llama", 2, "bf16", num_layers=1, hidden=16)
    store.commit(engine, step=1)
    destroy_engine(engine)
    with pytest.raises(BadInputError, match="step 1 has no Mixture-of-Experts layer"):
        store.materialize(1, tmp_path / "out", ep_size=1)
    assert not (tmp_path / "out").exists()


def test_an_expert_parallel_step_verifies_and_exports_every_expert_by_global_index(two_ranks, tmp_path):
    from safetensors.torch import load_file

    root, _ = two_ranks
    config = root / "ep2" / "zero2-bf16"
    store = ckptstore.open(config / "store")
    assert store.verify().ok
    report = store.export(3, tmp_path / "exported")
    exported = {}
    for name in report.weight_files:
        exported.update(load_file(tmp_path / "exported" / name))
    own = config / "deepspeed" / "global_step3"
    for layer in (0, 1):
        for expert in range(4):  # experts 2 and 3 were rank 1's local 0 and 1
            saved = torch.load(own / f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt")
            assert saved and all(torch.equal(exported[key], tensor) for key, tensor in saved.items())
    assert len(exported) == report.tensors == len(store.state_dict(3))


@pytest.mark.xfail(raises=TypeError, strict=True, reason=(
    "deepspeed 0.19's AutoEP calls transformers' output-recorder registry as a dict, which "
    "transformers 5.23 and later refuse (docs/moe.md section 10); once this passes, support AutoEP"
))  # fmt: skip
def test_an_autoep_engine_starts_with_the_installed_transformers_and_its_commit_is_refused(tmp_path):
    engine = build_mixtral_engine(
        2, "bf16", expert_parallel={"enabled": True, "autoep_size": 1, "preset_model": "mixtral"}
    )
    train(engine, DATA[:1])
    with pytest.raises(UnsupportedError, match="AutoEP"):
        ckptstore.open(tmp_path / "store", create=True).commit(engine, step=1)
    destroy_engine(engine)


def test_attach_commits_a_moe_engines_save_checkpoint_and_its_load_restores_it(tmp_path):
    from ckptstore.integrations.deepspeed import attach, detach

    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_moe_engine(0, "bf16")
    train(engine, DATA[:3])
    engine.save_checkpoint(str(tmp_path / "deepspeed"))
    attach(engine, store)
    engine.save_checkpoint(str(tmp_path / "attached"))
    destroy_engine(engine)
    assert store.steps() == [3] and not list((tmp_path / "attached").glob("*/*expert*"))

    resumed = build_moe_engine(0, "bf16", seed=3)
    attach(resumed, store)
    resumed.load_checkpoint(str(tmp_path / "attached"))
    detach(resumed)
    resumed.save_checkpoint(str(tmp_path / "resaved"))
    destroy_engine(resumed)
    assert differences(tmp_path / "resaved" / "global_step3", tmp_path / "deepspeed" / "global_step3") == []


EXPERT = "blocks.3.moe.deepspeed_moe.experts.deepspeed_experts.{}"


def test_each_expert_is_a_layer_a_commit_can_save_alone_inheriting_the_others(tmp_path):
    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_moe_engine(2, "bf16")
    train(engine, DATA[:3])
    store.commit(engine, step=3)
    train(engine, DATA[3:4])
    report = store.commit(engine, step=4, layers=[EXPERT.format(2)])
    engine.save_checkpoint(str(tmp_path / "deepspeed"))
    destroy_engine(engine)

    assert report.layers_saved == [EXPERT.format(2)]
    sources = store.sources(4)
    assert {layer: sources[layer] for layer in ("blocks.3", EXPERT.format(1), EXPERT.format(2))} == {
        "blocks.3": 3,
        EXPERT.format(1): 3,
        EXPERT.format(2): 4,
    }
    store.materialize(4, tmp_path / "composite")
    store.materialize(3, tmp_path / "step3")
    own, composite = tmp_path / "deepspeed" / "global_step4", tmp_path / "composite" / "global_step4"
    expert_file = "layer_1_expert_{}_mp_rank_00_model_states.pt"
    assert (
        tensors_of(composite / expert_file.format(2)).keys() == tensors_of(own / expert_file.format(2)).keys()
    )
    assert all(
        torch.equal(tensor, tensors_of(own / expert_file.format(2))[key])
        for key, tensor in tensors_of(composite / expert_file.format(2)).items()
    )
    # a compose spec's block range takes each block with its experts
    spec = {"state": 4, "slices": [{"layer_range": [0, 2], "step": 3}, {"layer_range": [2, 4], "step": 4}]}
    store.materialize(spec=spec, out=tmp_path / "composed")
    assert differences(tmp_path / "composed" / "global_step4", composite) == []
    inherited = tmp_path / "step3" / "global_step3" / expert_file.format(1)
    assert all(
        torch.equal(tensor, tensors_of(inherited)[key])
        for key, tensor in tensors_of(composite / expert_file.format(1)).items()
    )


def test_frozen_experts_are_stored_once_and_a_strategy_picks_the_experts_that_moved(tmp_path):
    from ckptstore.strategies import UpdateMagnitude

    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_moe_engine(2, "bf16", frozen_experts=1)  # expert 0 of each MoE layer frozen
    train(engine, DATA[:3])
    first = store.commit(engine, step=3)
    train(engine, DATA[3:5])
    again = store.commit(engine, step=5)  # every layer saved: the frozen experts add nothing
    train(engine, DATA[:2])
    picked = store.commit(engine, step=6, layers=UpdateMagnitude(threshold=0.0))
    destroy_engine(engine)

    frozen = [EXPERT.format(0), "blocks.1.moe.deepspeed_moe.experts.deepspeed_experts.0"]
    assert all(first.updates.get(layer) is None for layer in frozen)
    assert [again.updates[layer] for layer in frozen] == [0.0, 0.0]
    assert set(frozen) <= set(picked.layers_inherited) and EXPERT.format(2) in picked.layers_saved
    assert again.blobs_added < first.blobs_added

    # the frozen experts saved again add nothing (the store's own figure of bytes added)
    engine = build_moe_engine(2, "bf16", frozen_experts=1)
    store.restore(engine, 6)
    train(engine, DATA[:1])
    assert store.commit(engine, step=7, layers=frozen).bytes_added == 0
    destroy_engine(engine)
    assert store.verify().ok
