"""Megatron-DeepSpeed's 3D setting through DeepSpeed's own machinery, run by
tests/test_megatron3d.py as one ``torch.distributed.run`` job of 4 ranks:

    python -m torch.distributed.run --nproc_per_node 4 tests/megatron3d_worker.py ROOT RESULT

For ``tools/megatron_gpt``'s ``GPTModelPipe`` at PP 2 × TP 2 and at PP 2 × TP 1 × DP 2 (bf16,
ZeRO-1): train two steps, save, train on (the uninterrupted run); resume a fresh engine with
``load_checkpoint`` and train the same batches; convert the save with ``ds_to_universal`` and
load it with ``load_universal`` into other layouts of the 4 ranks, save again and train on. A
ckptstore commit of the state saved is materialized (compared file by file with the save) and
resumed from, restored into a fresh engine of the same layout, and exported; it is restored
into each of the other layouts too (a reshard), saved again (compared tensor for tensor with
the universal load's save) and trained on. At PP 2 × TP 2, step 4 is committed saving one
block alone (a composite), materialized, and resumed from. PP 2 × TP 2 at fp32 ZeRO-1, fp32
ZeRO-0 and bf16 ZeRO-0, and PP 2 × TP 1 × DP 2 at bf16 ZeRO-0 (``VARIANTS``) is committed
behind training, materialized (compared file by file with the save of the same state), and
restored (saved again, compared file by file with the save) and resumed beside DeepSpeed's own
resume. At PP 2 × TP 1 × DP 2, a restore is run once more with the first stage's async
all-gathers held until waited on (``gathers_at_wait``). Each rank writes what it observed to
``RESULT.<rank>.json``; the pytest side asserts on it. At PP 2 × TP 2, the final norm (an
averaged parameter) is let drift apart on TP rank 1 before the save and the commit.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.model_parallel_worker import differences, tensors_of, universal_unlike  # noqa: E402
from tools import megatron_gpt  # noqa: E402
from tools.engines import destroy_engine, setup_single_process_env  # noqa: E402

DATA = megatron_gpt.batches(8)  # two train_batch steps of 2 micro-batches, then two more
TAG = "global_step2"
UNIVERSAL = {"checkpoint": {"load_universal": True}}
BLOCK = "3"  # the transformer block (its LayerSpec index) the composite step 4 saves


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of one tag folder, in this process (strict pattern check
    on, its default: every pattern of ``universal_checkpoint_info`` must match a parameter)."""
    from deepspeed.checkpoint import ds_to_universal

    argv = sys.argv
    sys.argv = ["ds_to_universal", "--input_folder", str(checkpoint), "--output_folder", str(out / checkpoint.name),
                "--num_extract_workers", "1", "--num_merge_workers", "1"]  # fmt: skip
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv
    (out / "latest_universal").write_text(checkpoint.name)


def open_store(root: Path):
    import ckptstore

    return ckptstore.open(root / "store", create=True)


def universal_summary(universal: Path) -> dict:
    """Per parameter folder of a universal checkpoint: its fp32 shape and the keys DeepSpeed
    wrote beside ``param`` (cat_dim, vocab_tensor, param_n_sub_params)."""
    summary = {}
    for folder in sorted(path for path in (universal / "zero").iterdir() if path.is_dir()):
        saved = torch.load(folder / "fp32.pt", weights_only=False)
        summary[folder.name] = {key: value for key, value in saved.items() if key != "param"}
        summary[folder.name]["shape"] = list(saved["param"].shape)
    return summary


def against_universal(store, universal: Path) -> dict:
    """Per parameter of the store's step 2 (its logical fp32 tensors, ``store.state_dict``): its
    shape, and whether it equals the ``fp32`` that ``ds_to_universal`` wrote for it (the
    vocabulary's padding left out, ckptstore's ``original_vocab_size``)."""
    ours = store.state_dict(2)
    compared = {}
    for folder in sorted(path for path in (universal / "zero").iterdir() if path.is_dir()):
        theirs = torch.load(folder / "fp32.pt", weights_only=False)["param"]
        mine = ours[folder.name]
        compared[folder.name] = {"shape": list(mine.shape), "equal": torch.equal(mine, theirs)}
    return compared


def exported(store, out: Path, universal: Path) -> dict:
    """``store.export`` of step 2: its tensors' names, and per tensor its dtype and shape and
    whether it equals the ``fp32`` ``ds_to_universal`` wrote for it cast to the model's bf16."""
    from safetensors.torch import load_file

    report = store.export(2, out)
    tensors = load_file(out / "model.safetensors")
    compared = {}
    for name, tensor in tensors.items():
        theirs = torch.load(universal / "zero" / name / "fp32.pt", weights_only=False)["param"]
        compared[name] = {
            "dtype": str(tensor.dtype), "shape": list(tensor.shape),
            "equal": torch.equal(tensor, theirs.to(torch.bfloat16)),
        }  # fmt: skip
    return {"files": report.weight_files, "tensors": compared}


def same_file(one: Path, other: Path) -> bool:
    """Whether two torch files hold the same keys and bit-equal tensors."""
    mine, theirs = tensors_of(one), tensors_of(other)
    return set(mine) == set(theirs) and all(
        mine[key].dtype == tensor.dtype and mine[key].shape == tensor.shape and torch.equal(mine[key], tensor)
        for key, tensor in theirs.items()
    )


def universal_from_store(root: Path, store) -> dict:
    """``store.materialize(2, universal=True)`` beside ``ds_to_universal`` of DeepSpeed's own
    save of the same state: its files, and those that differ from it (or only one has)."""
    out = store.materialize(2, root / "universal-materialized", universal=True)
    ours = out / f"{TAG}_universal"
    return {
        "files": sorted(str(path.relative_to(ours)) for path in ours.rglob("*") if path.is_file()),
        "latest": (out / "latest_universal").read_text(),
        "differences": universal_unlike(ours, root / "universal" / TAG),
    }


def composite(root: Path, store) -> dict:
    """The composite step 4 (block ``BLOCK`` saved, the rest inherited from step 2): its
    sources, verify, and its materialize's layer files, each compared with DeepSpeed's own
    save of step 4 and step 2's materialize."""
    store.materialize(4, root / "composite")
    ours, new, old = (
        root / "composite" / "global_step4",
        root / "deepspeed4" / "global_step4",
        root / "materialized" / TAG,
    )
    return {
        "sources": store.sources(4),
        "verify": store.verify().ok,
        "files": sorted(path.name for path in ours.iterdir()) == sorted(path.name for path in new.iterdir()),
        "layer_files": {
            path.name: {"new": same_file(path, new / path.name), "old": same_file(path, old / path.name)}
            for path in sorted(ours.glob("layer_*"))
        },
    }


def resumed(
    layout: tuple[int, int, int],
    checkpoint: Path | None,
    universal: bool = False,
    resave: Path | None = None,
    store=None,
    tag: str | None = TAG,
    data: list = DATA[4:8],
    gathers_held: bool = False,
) -> dict:
    """A fresh engine of ``layout`` (another seed: nothing of its own survives a load) loaded
    from ``checkpoint``'s ``tag`` (or restored from ``store``'s step 2, with ``gathers_held``
    under ``gathers_at_wait``, and saved again to ``resave``), then trained on ``data`` (the
    next two steps)."""
    engine = megatron_gpt.build_engine(*layout, seed=1, **(UNIVERSAL if universal else {}))
    try:
        if store is not None:
            with gathers_at_wait() if gathers_held else contextlib.nullcontext():
                store.restore(engine, step=2)
        else:
            engine.load_checkpoint(str(checkpoint), tag=tag)
        if resave is not None:
            engine.save_checkpoint(str(resave), tag=TAG)
        run = {"global_steps": engine.global_steps, "losses": megatron_gpt.train(engine, data)}
    except Exception as error:  # DeepSpeed refusing a layout is a result, not a crash of the job
        run = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    destroy_engine(engine)
    return run


@contextlib.contextmanager
def gathers_at_wait(first_rank: int = 0):
    """Every async ``all_gather_into_tensor`` of a group holding global rank ``first_rank`` (at
    PP 2 × TP 1 × DP 2: the first stage's data-parallel group) runs only when its handle is
    waited on: as late as ``async_op`` allows, as gloo's own thread may run it on a loaded host.
    Restore all-gathers the module weights from the masters so (``start_module_weights``)."""
    from deepspeed import comm

    real = comm.all_gather_into_tensor

    class AtWait:
        def __init__(self, output: torch.Tensor, tensor: torch.Tensor, group) -> None:
            self.args = output, tensor, group

        def wait(self) -> None:
            output, tensor, group = self.args
            real(output, tensor, group=group)

    def held(output, tensor, group=None, async_op=False):
        if async_op and first_rank in dist.get_process_group_ranks(group):
            return AtWait(output, tensor, group)
        return real(output, tensor, group=group, async_op=async_op)

    comm.all_gather_into_tensor = held
    try:
        yield
    finally:
        comm.all_gather_into_tensor = real


AVERAGED = "6.weight"  # the final norm, a parameter_to_average_patterns one in GPTModelPipe's info


def perturb_averaged(engine) -> list[list[float]]:
    """Let TP rank 1's copy of the final norm drift from TP rank 0's, as bf16 training let
    BLOOM's: its fp32 master and Adam moments shifted (DeepSpeed's own setters), before both
    DeepSpeed's save and the commit see the state. Collective; every rank gets the fp32 copies
    of the last stage's TP ranks, in TP order."""
    from deepspeed import utils

    param = dict(engine.module.named_parameters()).get(AVERAGED)
    copy = None
    if param is not None:
        if engine.grid.get_slice_parallel_rank() == 1:
            utils.safe_set_full_fp32_param(param, utils.safe_get_full_fp32_param(param) + 2**-12)
            for state in ("exp_avg", "exp_avg_sq"):
                utils.safe_set_full_optimizer_state(
                    param, utils.safe_get_full_optimizer_state(param, state) * 1.5, state
                )
        copy = utils.safe_get_full_fp32_param(param).tolist()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, copy)
    return [copy for copy in gathered if copy is not None]


def averaged_against(copies: list[list[float]], store, root: Path) -> dict:
    """The drifted final norm: whether its TP copies differ, and whether ds_to_universal's fp32
    (of DeepSpeed's save), the store's state_dict, export and materialize --universal of the
    commit are all their mean as merge_tp_slices computes it (bit for bit; export in bf16)."""
    from safetensors.torch import load_file

    tensors = [torch.tensor(copy, dtype=torch.float32) for copy in copies]
    mean = sum(tensors) / len(tensors)
    theirs = torch.load(root / "universal" / TAG / "zero" / AVERAGED / "fp32.pt", weights_only=False)["param"]
    ours = root / "universal-materialized" / f"{TAG}_universal" / "zero" / AVERAGED / "fp32.pt"
    return {
        "copies": len(tensors),
        "copies_differ": not torch.equal(tensors[0], tensors[1]),
        "ds_to_universal": torch.equal(theirs, mean),
        "state_dict": torch.equal(store.state_dict(2)[AVERAGED], mean),
        "export": torch.equal(
            load_file(root / "exported" / "model.safetensors")[AVERAGED], mean.to(torch.bfloat16)
        ),
        "materialize_universal": torch.equal(torch.load(ours, weights_only=False)["param"], mean),
    }


def note(what: str) -> None:
    # progress on stderr, where a failing test shows it
    if os.environ.get("RANK") == "0":
        print(f"[megatron3d {time.strftime('%X')}] {what}", file=sys.stderr, flush=True)


def scenario(root: Path, layout: tuple[int, int, int], targets: list[tuple[int, int, int]]) -> dict:
    """Train ``layout`` two steps, commit, save and go on; resume it natively, from the
    materialized commit and by a restore; convert to universal and load that into each of
    ``targets``, and restore the commit into each of them."""
    root.mkdir(parents=True, exist_ok=True)
    saved = root / "deepspeed"
    note(f"{layout} build")
    engine = megatron_gpt.build_engine(*layout, seed=0)
    note(f"{layout} train")
    run = {"losses": megatron_gpt.train(engine, DATA[:4])}
    if layout == (2, 2, 1):  # TP copies of an averaged parameter that drifted apart
        copies = perturb_averaged(engine)
    store = open_store(root)
    note(f"{layout} commit")
    store.commit(engine, step=2)  # blocking: the state save_checkpoint writes next
    engine.save_checkpoint(str(saved), tag=TAG)
    run["continued"] = megatron_gpt.train(engine, DATA[4:8])
    if layout == (2, 2, 1):  # a composite: step 4 saves one block, inherits the rest from step 2
        store.commit(engine, step=4, layers=[BLOCK])
        engine.save_checkpoint(str(root / "deepspeed4"), tag="global_step4")
    destroy_engine(engine)
    dist.barrier()
    if dist.get_rank() == 0:
        run["files"] = sorted(path.name for path in (saved / TAG).iterdir())
        model_states = torch.load(saved / TAG / "mp_rank_00_model_states.pt", weights_only=False)
        wanted = ("universal_checkpoint_info", "checkpoint_parallel_dimensions", "mp_world_size", "module")
        run["mp_rank_00"] = {key: model_states[key] for key in wanted}
        to_universal(saved / TAG, root / "universal")
        run["universal"] = universal_summary(root / "universal" / TAG)
        run["logical"] = against_universal(store, root / "universal" / TAG)
        note(f"{layout} materialize")
        store.materialize(2, root / "materialized")
        run["materialized_differences"] = differences(root / "materialized" / TAG, saved / TAG)
        run["exported"] = exported(store, root / "exported", root / "universal" / TAG)
        note(f"{layout} materialize --universal")
        run["universal_from_store"] = universal_from_store(root, store)
        if layout == (2, 2, 1):
            run["averaged"] = averaged_against(copies, store, root)
            note(f"{layout} composite")
            run["composite"] = composite(root, store)
    dist.barrier()
    note(f"{layout} resume")
    run["resumed"] = resumed(layout, saved, resave=root / "resaved")
    run["resumed_from_materialized"] = resumed(
        layout, root / "materialized", resave=root / "resaved-materialized"
    )
    if layout == (2, 2, 1):  # fresh engines resume from the composite and train on
        run["composite_resumed"] = resumed(layout, root / "composite", tag="global_step4", data=DATA[4:6])
    note(f"{layout} restore")
    run["restored"] = resumed(layout, None, resave=root / "resaved-restored", store=store)
    if layout == (2, 1, 2):  # the first stage's module-weight all-gathers run late
        run["restored_gathers_held"] = resumed(layout, None, store=store, gathers_held=True)
    dist.barrier()
    if dist.get_rank() == 0:
        run["resaved_differences"] = {
            how: differences(root / folder / TAG, saved / TAG) if (root / folder).exists() else ["not saved"]
            for how, folder in (("deepspeed", "resaved"), ("materialized", "resaved-materialized"),
                                ("restored", "resaved-restored"))
        }  # fmt: skip
    note(f"{layout} universal")
    run["universal_resumed"] = {
        layout_name(target): resumed(
            target, root / "universal", universal=True, resave=root / f"universal-{layout_name(target)}"
        )
        for target in targets
    }
    if layout == (2, 2, 1):  # and load_universal of the store's own universal checkpoint of it
        note(f"{layout} universal from the store resumed")
        run["universal_from_store_resumed"] = resumed(
            (2, 1, 2), root / "universal-materialized", universal=True, tag=None
        )  # tag None: the folder latest_universal names
    run["restored_elsewhere"] = restored_elsewhere(root, store, targets)
    return run


def layout_name(layout: tuple[int, int, int]) -> str:
    return "x".join(map(str, layout))


def restored_elsewhere(root: Path, store, targets: list[tuple[int, int, int]]) -> dict:
    """Step 2 restored into a fresh engine of each of ``targets`` (another P × T × D: a reshard),
    saved again and trained on; on rank 0, what differs between that save and the save of the
    engine ``load_universal`` filled from ``ds_to_universal`` of DeepSpeed's own save (the
    ``universal_resumed`` runs, saved to ``universal-<target>``), tensor for tensor, and the
    optimizer's step counters of both."""
    note(f"{root.name} restore into {', '.join(map(layout_name, targets))}")
    runs = {layout_name(target): resumed(target, None, store=store, resave=root / f"restored-{layout_name(target)}")
            for target in targets}  # fmt: skip
    dist.barrier()
    if dist.get_rank() == 0:
        for target, run in runs.items():
            ours, theirs = root / f"restored-{target}" / TAG, root / f"universal-{target}" / TAG
            run["differences"] = (
                differences(ours, theirs) if ours.exists() and theirs.exists() else ["not saved"]
            )
            run["steps"] = {how: optimizer_steps(folder) for how, folder in (("restored", ours), ("universal", theirs))
                            if folder.exists()}  # fmt: skip
    return runs


def optimizer_steps(folder: Path) -> dict:
    """The step counters of a save's optimizer files, file by file (plain ints, which a tensor
    comparison passes over): the base optimizer's per flat fp32 group, and its param_groups'."""
    steps = {"state": [], "param_groups": []}
    for path in sorted(folder.glob("*optim_states.pt")):
        base = torch.load(path, weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]
        steps["state"] += [state["step"] for state in base["state"].values()]
        steps["param_groups"] += [group.get("step") for group in base["param_groups"]]
    return steps


# PP 2 × TP 2 in the other dtypes and ZeRO stages DeepSpeed saves otherwise: fp32 ZeRO-1
# (zero_pp_rank_D_mp_rank_XX files of DeepSpeedZeroOptimizer), fp32 ZeRO-0 (the plain torch
# optimizer inside the mp_rank files), bf16 ZeRO-0 (BF16_Optimizer, bf16 gradient accumulation),
# and bf16 ZeRO-0 with data parallelism in a stage (PP 2 × TP 1 × DP 2)
VARIANTS = {
    "fp32-zero1": ((2, 2, 1), "fp32", 1), "fp32-zero0": ((2, 2, 1), "fp32", 0),
    "bf16-zero0": ((2, 2, 1), "bf16", 0), "bf16-zero0-dp2": ((2, 1, 2), "bf16", 0),
}  # fmt: skip


def variants(root: Path) -> dict:
    """Each of ``VARIANTS`` (``variant``)."""
    return {name: variant(root / name, *how) for name, how in VARIANTS.items()}


def variant(root: Path, layout: tuple[int, int, int], dtype: str, zero_stage: int) -> dict:
    """Train ``layout`` two steps, commit behind training (``blocking=False``), save and train
    on; materialize the commit (compared file by file with the save) and resume a fresh engine
    from DeepSpeed's save and another by a restore from the store, each trained two steps."""
    root.mkdir(parents=True, exist_ok=True)
    options, saved = {"dtype": dtype, "zero_stage": zero_stage}, root / "deepspeed"
    note(f"{root.name} train and commit behind it")
    engine = megatron_gpt.build_engine(*layout, seed=0, **options)
    run = {"losses": megatron_gpt.train(engine, DATA[:4])}
    store = open_store(root)
    handle = store.commit(engine, step=2, blocking=False)
    engine.save_checkpoint(str(saved), tag=TAG)
    run["continued"] = megatron_gpt.train(engine, DATA[4:8])
    run["committed"] = {"handle": type(handle).__name__, "step": handle.result().step}
    destroy_engine(engine)
    dist.barrier()
    if dist.get_rank() == 0:
        run["files"] = sorted(path.name for path in (saved / TAG).iterdir())
        store.materialize(2, root / "materialized")
        run["materialized_differences"] = differences(root / "materialized" / TAG, saved / TAG)
    dist.barrier()
    note(f"{root.name} resume and restore")
    run["resumed"] = variant_resumed(layout, options, checkpoint=saved)
    run["restored"] = variant_resumed(layout, options, store=store, resave=root / "resaved-restored")
    dist.barrier()
    if dist.get_rank() == 0:
        resaved = root / "resaved-restored" / TAG
        run["resaved_differences"] = differences(resaved, saved / TAG) if resaved.exists() else ["not saved"]
    return run


def variant_resumed(
    layout: tuple[int, int, int],
    options: dict,
    checkpoint: Path | None = None,
    store=None,
    resave: Path | None = None,
) -> dict:
    """A fresh engine of ``layout`` and ``options`` (another seed) loaded from ``checkpoint``
    or restored from ``store``'s step 2 (and saved again to ``resave``), then trained the next
    two steps."""
    engine = megatron_gpt.build_engine(*layout, seed=1, **options)
    try:
        if store is not None:
            store.restore(engine, step=2)
        else:
            engine.load_checkpoint(str(checkpoint), tag=TAG)
        if resave is not None:
            engine.save_checkpoint(str(resave), tag=TAG)
        run = {"global_steps": engine.global_steps, "losses": megatron_gpt.train(engine, DATA[4:8])}
    except Exception as error:  # a refusal is a result, not a crash of the job
        run = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
    destroy_engine(engine)
    return run


def main() -> None:
    root, result = Path(sys.argv[1]), sys.argv[2]
    setup_single_process_env()
    note("start")
    started = time.monotonic()
    observed = {
        # PP × TP × DP
        "2x2x1": scenario(root / "2x2x1", (2, 2, 1), [(1, 1, 4), (2, 1, 2), (1, 2, 2)]),
        "2x1x2": scenario(root / "2x1x2", (2, 1, 2), [(2, 2, 1)]),
        "variants": variants(root / "variants"),
    }
    observed["seconds"] = time.monotonic() - started
    Path(f"{result}.{dist.get_rank()}.json").write_text(json.dumps(observed, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
