"""Megatron-DeepSpeed's 3D setting (issue 47): ``tools/megatron_gpt``'s ``GPTModelPipe`` is a
model DeepSpeed's own machinery saves, converts and resumes, and ckptstore commits, materializes
and restores in the same layout as DeepSpeed's own save, restores into other layouts as
DeepSpeed's universal checkpoint does, composes a step from two, and exports as the universal
checkpoint's fp32 tensors.

One ``torch.distributed.run`` job of 4 ranks (tests/megatron3d_worker.py) trains PP 2 × TP 2
and PP 2 × TP 1 × DP 2 (bf16, ZeRO-1), saves, resumes with ``load_checkpoint``, converts with
``ds_to_universal`` and loads that with ``load_universal`` into other layouts; a ckptstore
commit of the same state is materialized and restored beside it, into the same layout and
into the others. PP 2 × TP 2 at fp32 ZeRO-1, fp32 ZeRO-0 and bf16 ZeRO-0 is committed behind
training (``blocking=False``), materialized and restored beside DeepSpeed's own save and
resume. Every test here reads what it observed.

What must be equal is compared bit for bit: a ckptstore restore or materialize against
DeepSpeed's own resume (or save) of the same state. DeepSpeed's save and load are not always
bit-exact on this CPU, most of all on a loaded host, so a resume against the uninterrupted run
(DeepSpeed's own or ckptstore's) is only asserted close (``CLOSE``).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tools.engines import free_port

WORKER = Path(__file__).with_name("megatron3d_worker.py")
RANKS = 4
# (source, target): each step's layout, and the other layouts the job loads it into
RESHARDS = [("2x2x1", "1x1x4"), ("2x2x1", "2x1x2"), ("2x2x1", "1x2x2"), ("2x1x2", "2x2x1")]
# How close a resumed run's losses stay to the uninterrupted run's (a relative tolerance): a
# few ulps of the fp32 losses apart (measured under load: 4.02712965 against 4.02713537).
CLOSE = 1e-4


def close_to_the_uninterrupted_run(losses: list[float], continued: list[float]) -> bool:
    return len(losses) == len(continued) and all(
        math.isclose(loss, other, rel_tol=CLOSE) for loss, other in zip(losses, continued, strict=True)
    )


@pytest.fixture(scope="module")
def observed(tmp_path_factory) -> list[dict]:
    """Each rank's observations of the one job."""
    root = tmp_path_factory.mktemp("megatron3d")
    result = root / "result"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(RANKS),
         "--master_port", str(free_port()), str(WORKER), str(root / "runs"), str(result)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(Path(f"{result}.{rank}.json").read_text()) for rank in range(RANKS)]


def test_a_3d_save_has_a_layer_file_per_stage_layer_and_tp_rank_and_bf16_optimizer_partitions(observed):
    files = observed[0]["2x2x1"]["files"]
    # specs 1 (the tied embedding) to 6 (the final norm); the head on the last stage reuses the
    # embedding and gets no file of its own, nor do the function specs 0 and 8
    layers = [f"layer_{index:02d}-model_{tp:02d}-model_states.pt" for index in range(1, 7) for tp in (0, 1)]
    model = [f"mp_rank_{mp:02d}_model_states.pt" for mp in range(4)]  # pipe-major: stage × TP
    optim = [f"bf16_zero_pp_rank_0_mp_rank_{mp:02d}_optim_states.pt" for mp in range(4)]
    assert files == sorted(layers + model + optim)
    assert observed[0]["2x1x2"]["files"] == sorted(
        [f"layer_{index:02d}-model_00-model_states.pt" for index in range(1, 7)]
        + ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
        + [f"bf16_zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt" for dp in (0, 1) for mp in (0, 1)]
    )


def test_deepspeed_writes_the_modules_universal_checkpoint_info_and_the_3d_degrees(observed):
    from tools.megatron_gpt import universal_checkpoint_info

    for layout, tp in (("2x2x1", 2), ("2x1x2", 1)):
        saved = observed[0][layout]["mp_rank_00"]
        assert saved["module"] is None  # a pipeline's weights are in its layer files
        assert saved["checkpoint_parallel_dimensions"] == {"pp_degree": 2, "tp_degree": tp}
        assert saved["universal_checkpoint_info"] == universal_checkpoint_info(tp)
    info = universal_checkpoint_info(2)
    assert (info["original_vocab_size"], info["padded_vocab_size"]) == (49, 52)


def test_deepspeeds_resume_of_a_pp2_tp2_step_restores_what_it_saved_and_trains_on_close_to_the_run(observed):
    # DeepSpeed alone: saved again right after load_checkpoint, every file is bit-equal to the
    # save; the next two steps' losses are the uninterrupted run's to a few ulps (bit-equal on a
    # quiet host, not under load), the reference ckptstore's resumes are held to bit for bit below
    assert observed[0]["2x2x1"]["resaved_differences"]["deepspeed"] == []
    for rank in observed:
        run = rank["2x2x1"]
        assert run["resumed"]["global_steps"] == 2
        assert close_to_the_uninterrupted_run(run["resumed"]["losses"], run["continued"])


def test_deepspeeds_resume_of_a_pp2_dp2_step_restores_what_it_saved_but_not_every_last_bit(observed):
    # Saved again right after load_checkpoint, every file is bit-equal to the save. On a quiet
    # host the first step after equals the uninterrupted run's and the second ends a few ulps
    # away (measured: 3.98947668 against 3.98954535), the same in every resumed engine and in
    # every uninterrupted one: some state DeepSpeed does not save, with data parallelism in a
    # stage. A DeepSpeed-only comparison: asserted close, not bit for bit
    assert observed[0]["2x1x2"]["resaved_differences"]["deepspeed"] == []
    for rank in observed:
        run = rank["2x1x2"]
        assert run["resumed"]["global_steps"] == 2
        assert close_to_the_uninterrupted_run(run["resumed"]["losses"], run["continued"])


def test_ds_to_universal_joins_every_kind_of_split_of_the_3d_step(observed):
    universal = observed[0]["2x2x1"]["universal"]
    # the vocabulary-parallel tied embedding: padding stripped to original_vocab_size, read
    # from the first stage only
    embedding = universal["tied_modules.embed.word_embeddings.weight"]
    assert embedding["shape"] == [49, 32] and embedding["vocab_tensor"] is True
    layer = "2"
    # SwiGLU's two sub-parameters, each joined over TP, then one after the other
    for name in ("mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias"):
        assert universal[f"{layer}.{name}"]["param_n_sub_params"] == 2
    assert universal[f"{layer}.mlp.dense_h_to_4h.weight"]["shape"] == [128, 32]
    # row parallel: joined along the input dimension
    assert universal[f"{layer}.self_attention.dense.weight"] == {"cat_dim": 1, "shape": [32, 32]}
    assert universal[f"{layer}.mlp.dense_4h_to_h.weight"] == {"cat_dim": 1, "shape": [32, 64]}
    # column parallel fused QKV: joined along the output dimension
    assert universal[f"{layer}.self_attention.query_key_value.weight"] == {"cat_dim": 0, "shape": [96, 32]}
    # TP-replicated and averaged parameters: one copy, no joining
    assert universal[f"{layer}.input_layernorm.weight"] == {"shape": [32]}
    assert universal["6.weight"] == {"shape": [32]}
    assert sorted(universal) == sorted(observed[0]["2x1x2"]["universal"])  # one model, any split


@pytest.mark.parametrize("source, target", RESHARDS)
def test_load_universal_of_a_3d_step_trains_on_in_another_layout(observed, source, target):
    for rank in observed:
        run = rank[source]["universal_resumed"][target]
        assert "error" not in run, run.get("traceback")
        assert run["global_steps"] == 2
        assert all(math.isfinite(loss) for loss in run["losses"])
    # at the same TP degree (the same padded vocabulary) the first step after is the
    # uninterrupted run's, to a few ulps of the fp32 master weights cast again to bf16
    if source == "2x2x1" and target == "1x2x2":
        run = observed[0][source]
        assert math.isclose(run["universal_resumed"][target]["losses"][0], run["continued"][0], rel_tol=1e-3)


def test_a_3d_step_is_stored_as_the_logical_parameters_ds_to_universal_writes(observed):
    # each (stage, TP rank) stored its slices as pieces of the logical parameters: the step's
    # fp32 tensors are ds_to_universal's, SwiGLU's two sub-parameters joined as it joins them
    for layout in ("2x2x1", "2x1x2"):
        logical = observed[0][layout]["logical"]
        assert sorted(logical) == sorted(observed[0][layout]["universal"])
        assert [name for name, seen in logical.items() if not seen["equal"]] == []
    logical = observed[0]["2x2x1"]["logical"]
    assert logical["2.mlp.dense_h_to_4h.weight"]["shape"] == [128, 32]
    assert logical["2.self_attention.dense.weight"]["shape"] == [32, 32]
    # the vocabulary is stored at its padded size (52 rows at TP 2, 50 at TP 1: materialize
    # writes the ranks' rows back), and read without its padding, as ds_to_universal writes it
    for layout in ("2x2x1", "2x1x2"):
        assert observed[0][layout]["logical"]["tied_modules.embed.word_embeddings.weight"]["shape"] == [
            49,
            32,
        ]


@pytest.mark.parametrize("layout", ["2x2x1", "2x1x2"])
def test_materialize_of_a_3d_step_writes_deepspeeds_own_files_bit_equal(observed, layout):
    # the file names (layer_XX-model_YY, pipe-major mp_rank_XX, bf16_zero_pp_rank_D) and every
    # tensor of save_checkpoint's files of the same state
    assert observed[0][layout]["materialized_differences"] == []


@pytest.mark.parametrize("layout", ["2x2x1", "2x1x2"])
def test_resume_from_materialize_or_restore_of_a_3d_step_equals_deepspeeds_own_resume(observed, layout):
    # saved again right after the load, every file equals DeepSpeed's own save; the next two
    # steps' losses are, bit for bit, those of the resume from DeepSpeed's own directory (not
    # the uninterrupted run's: DeepSpeed's own resume is only close to those)
    assert observed[0][layout]["resaved_differences"] == {"deepspeed": [], "materialized": [], "restored": []}
    for rank in observed:
        run = rank[layout]
        assert "error" not in run["resumed"], run["resumed"].get("traceback")
        for how in ("resumed_from_materialized", "restored"):
            assert "error" not in run[how], run[how].get("traceback")
            assert run[how]["global_steps"] == 2
            assert run[how]["losses"] == run["resumed"]["losses"]


def test_a_restore_whose_module_weight_all_gathers_run_late_still_equals_deepspeeds_own_resume(observed):
    # PP 2 x TP 1 x DP 2 (bf16 ZeRO-1): restore casts the loaded masters down and all-gathers
    # the module weights over each stage's data-parallel group on gloo's own thread while it
    # reads the optimizer state. Here the first stage's all-gathers run only when waited on, as
    # late as a loaded host may run them; DeepSpeed's load broadcasts the tied embedding from
    # the first stage to the last, so restore must have them done before it loads. Every rank
    # (the last stage's data-parallel rank 1 most: the one whose embedding came from a peer)
    # trains on bit for bit as DeepSpeed's own resume
    for rank in observed:
        run = rank["2x1x2"]
        held = run["restored_gathers_held"]
        assert "error" not in held, held.get("traceback")
        assert held["global_steps"] == 2
        assert held["losses"] == run["resumed"]["losses"]


def test_a_3d_composite_saves_one_block_and_inherits_the_rest_from_the_earlier_step(observed):
    # PP 2 × TP 2: step 2 committed whole, two more steps trained, step 4 committed saving
    # block 3 alone (a pipeline layer is its LayerSpec index)
    composite = observed[0]["2x2x1"]["composite"]
    assert composite["sources"] == {
        "tied_modules.embed.word_embeddings": 2, "2": 2, "3": 4, "4": 2, "5": 2, "6": 2,
    }  # fmt: skip
    assert composite["verify"] is True
    # its materialize writes DeepSpeed's file names; each layer file of block 3 (one per TP
    # rank) is step 4's (DeepSpeed's own save of it), every other one step 2's materialize
    assert composite["files"] is True
    layer_files = composite["layer_files"]
    assert sorted(layer_files) == [f"layer_{index:02d}-model_{tp:02d}-model_states.pt" for index in range(1, 7)
                                   for tp in (0, 1)]  # fmt: skip
    for name, same in layer_files.items():
        from_new_step = name.startswith("layer_03-")
        assert same == {"new": from_new_step, "old": not from_new_step}, name


def test_fresh_3d_engines_resume_from_the_materialized_composite_and_train_on(observed):
    for rank in observed:
        run = rank["2x2x1"]["composite_resumed"]
        assert "error" not in run, run.get("traceback")
        assert run["global_steps"] == 4
        assert all(math.isfinite(loss) for loss in run["losses"])


@pytest.mark.parametrize("layout", ["2x2x1", "2x1x2"])
def test_export_of_a_3d_step_is_the_universal_checkpoints_fp32_in_the_model_dtype(observed, layout):
    exported = observed[0][layout]["exported"]
    tensors = exported["tensors"]
    # the model's own names, each parameter once (the tied embedding too), as
    # ds_to_universal names its folders
    assert exported["files"] == ["model.safetensors"]
    assert sorted(tensors) == sorted(observed[0][layout]["universal"])
    assert [
        name for name, seen in tensors.items() if not seen["equal"] or seen["dtype"] != "torch.bfloat16"
    ] == []
    assert [
        name
        for name, seen in tensors.items()
        if seen["shape"] != observed[0][layout]["universal"][name]["shape"]
    ] == []
    # the vocabulary without its padding (original_vocab_size rows); SwiGLU's dense_h_to_4h
    # its gate whole, then its up projection
    assert tensors["tied_modules.embed.word_embeddings.weight"]["shape"] == [49, 32]
    assert tensors["2.mlp.dense_h_to_4h.weight"]["shape"] == [128, 32]


@pytest.mark.parametrize("source, target", RESHARDS)
def test_a_3d_step_restored_into_another_layout_equals_deepspeeds_universal_checkpoint(
    observed, source, target
):
    # PP 2 x TP 2 into PP 1 x TP 1 x DP 4, PP 2 x TP 1 x DP 2 and PP 1 x TP 2 x DP 2, and
    # PP 2 x TP 1 x DP 2 into PP 2 x TP 2: the vocabulary repadded for the engine's degree (52 rows
    # to 50, 50 to 52), SwiGLU's sub-parameters and the row-parallel weights cut anew, the tied
    # embedding on every stage holding it, averaged and replicated parameters on every TP rank.
    # Saved again, every tensor (module weights, fp32 master partitions, exp_avg, exp_avg_sq)
    # equals the save of the engine load_universal filled from ds_to_universal of DeepSpeed's
    # own save, and so do the optimizer's step counters
    restored = observed[0][source]["restored_elsewhere"][target]
    assert "error" not in restored, restored.get("traceback")
    assert restored["differences"] == []
    steps = restored["steps"]
    assert steps["restored"] == steps["universal"]
    assert steps["restored"]["state"] and set(steps["restored"]["state"]) == {2}
    # and both train on to the same losses, on every rank
    for rank in observed:
        run, universal = rank[source]["restored_elsewhere"][target], rank[source]["universal_resumed"][target]
        assert run["global_steps"] == universal["global_steps"] == 2
        assert run["losses"] == universal["losses"]


@pytest.mark.parametrize("layout", ["2x2x1", "2x1x2"])
def test_materialize_universal_of_a_3d_step_is_ds_to_universal_of_deepspeeds_save_file_for_file(
    observed, layout
):
    # store.materialize(2, out, universal=True) of the commit beside ds_to_universal of
    # save_checkpoint's files of the same state: the same files, every loaded object equal
    # (tensors bit for bit, and the keys beside each param: cat_dim, param_n_sub_params,
    # vocab_tensor), the model-states files as ds_to_universal copies them, no layer file
    seen = observed[0][layout]["universal_from_store"]
    assert seen["latest"] == "global_step2_universal"
    assert seen["differences"] == []
    names = {
        path.split("/")[1] for path in seen["files"] if path.startswith("zero/") and path.count("/") == 2
    }
    assert names == set(observed[0][layout]["universal"])
    for kind in ("fp32", "exp_avg", "exp_avg_sq", "step"):
        assert f"zero/tied_modules.embed.word_embeddings.weight/{kind}.pt" in seen["files"]
    assert {"zero/optimizer_state.pt", "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"} <= set(
        seen["files"]
    )
    assert [path for path in seen["files"] if path.startswith("layer_")] == []


def test_load_universal_of_the_stores_universal_checkpoint_of_a_3d_step_trains_as_ds_to_universals(observed):
    # PP 2 x TP 2 into PP 2 x TP 1 x DP 2 (another padded vocabulary): the same losses as
    # load_universal of ds_to_universal's output into the same layout
    for rank in observed:
        run = rank["2x2x1"]
        ours = run["universal_from_store_resumed"]
        assert "error" not in ours, ours.get("traceback")
        assert ours["global_steps"] == 2
        assert ours["losses"] == run["universal_resumed"]["2x1x2"]["losses"]


def test_an_averaged_parameters_drifted_tp_copies_are_kept_and_read_as_ds_to_universals_mean(observed):
    # PP 2 x TP 2: TP rank 1's copy of the final norm (parameter_to_average_patterns) drifted
    # from TP rank 0's before the save and the commit. The store keeps both: materialize and
    # restore give each rank its own (bit-equal files, resumes as DeepSpeed's, tested above),
    # and its logical tensor is their mean, bit for bit as ds_to_universal's merge_tp_slices
    # computes it, in state_dict, export (bf16) and materialize --universal
    averaged = observed[0]["2x2x1"]["averaged"]
    assert averaged == {
        "copies": 2, "copies_differ": True, "ds_to_universal": True, "state_dict": True, "export": True,
        "materialize_universal": True,
    }  # fmt: skip
    assert observed[0]["2x2x1"]["materialized_differences"] == []
    assert observed[0]["2x2x1"]["universal_from_store"]["differences"] == []


# PP 2 x TP 2 in the other dtypes and ZeRO stages: (name, the optimizer files save_checkpoint
# writes beside the model-states files, or none where the optimizer is inside them)
VARIANTS = [("fp32-zero1", "zero_pp_rank_0_mp_rank_{:02d}_optim_states.pt"), ("fp32-zero0", None),
            ("bf16-zero0", "bf16_zero_pp_rank_0_mp_rank_{:02d}_optim_states.pt")]  # fmt: skip


@pytest.mark.parametrize("variant, optim", VARIANTS)
def test_a_3d_step_committed_behind_training_materializes_deepspeeds_own_files_bit_equal(
    observed, variant, optim
):
    # store.commit(engine, 2, blocking=False), then save_checkpoint, then two more steps of
    # training before the handle's result: materialize of step 2 writes every file of the save,
    # under its names, every tensor bit for bit (at ZeRO 0 the optimizer is in the mp_rank files:
    # fp32's torch AdamW, bf16's BF16_Optimizer state as well as in its bf16_zero files)
    run = observed[0]["variants"][variant]
    assert run["committed"] == {"handle": "CommitHandle", "step": 2}
    layers = [f"layer_{index:02d}-model_{tp:02d}-model_states.pt" for index in range(1, 7) for tp in (0, 1)]
    model = [f"mp_rank_{mp:02d}_model_states.pt" for mp in range(4)]
    assert run["files"] == sorted(layers + model + ([optim.format(mp) for mp in range(4)] if optim else []))
    assert run["materialized_differences"] == []


@pytest.mark.parametrize("variant", [name for name, _ in VARIANTS])
def test_a_3d_step_committed_behind_training_restores_and_trains_as_deepspeeds_own_resume(observed, variant):
    # a fresh PP 2 x TP 2 engine restored from the store, saved again right after, writes every
    # file of DeepSpeed's own save of the state committed, bit for bit; it trains the next two
    # steps to the losses of a fresh engine resumed with load_checkpoint from that save, bit for
    # bit, and both to the uninterrupted run's, to a few ulps
    assert observed[0]["variants"][variant]["resaved_differences"] == []
    for rank in observed:
        run = rank["variants"][variant]
        assert "error" not in run["restored"], run["restored"].get("traceback")
        assert run["restored"]["global_steps"] == 2
        assert close_to_the_uninterrupted_run(run["restored"]["losses"], run["continued"])
        if variant == "bf16-zero0" and "error" in run["resumed"]:
            # DeepSpeed 0.19 cannot load its own save of BF16_Optimizer at ZeRO 0: it hands the
            # mp_rank file's optimizer state to load_state_dict, which indexes it by
            # data-parallel rank; ckptstore's restore gives it the rank's state so. What it
            # restored is then held to the save alone (above)
            assert run["resumed"]["error"] == "KeyError: 0"
            continue
        assert run["resumed"]["global_steps"] == 2
        assert run["restored"]["losses"] == run["resumed"]["losses"]


def test_a_3d_bf16_zero0_step_with_data_parallel_stages_materializes_and_restores(observed):
    # PP 2 x TP 1 x DP 2 at bf16 ZeRO-0, committed behind training: materialize writes every file
    # of the save bit for bit (each data-parallel rank's BF16_Optimizer partition, and rank 0's
    # state in the mp_rank files); the restored engine (each rank given its own partition's state,
    # the module weights all-gathered from the masters), saved again, writes every file of the
    # save bit for bit, and trains on as the uninterrupted run to a few ulps, as DeepSpeed's own
    # 2x1x2 resume (above)
    run = observed[0]["variants"]["bf16-zero0-dp2"]
    assert run["committed"] == {"handle": "CommitHandle", "step": 2}
    assert run["files"] == sorted(
        [f"layer_{index:02d}-model_00-model_states.pt" for index in range(1, 7)]
        + ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]
        + [f"bf16_zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt" for dp in (0, 1) for mp in (0, 1)]
    )
    assert run["materialized_differences"] == []
    assert run["resaved_differences"] == []
    for rank in observed:
        run = rank["variants"]["bf16-zero0-dp2"]
        assert "error" not in run["restored"], run["restored"].get("traceback")
        assert run["restored"]["global_steps"] == 2
        assert close_to_the_uninterrupted_run(run["restored"]["losses"], run["continued"])
        # DeepSpeed 0.19's own load fails (KeyError: the rank); where it does not, the same losses
        assert (
            run["resumed"].get("error", "").startswith("KeyError")
            or run["resumed"]["losses"] == run["restored"]["losses"]
        )
