"""Model-parallel scenarios, run by tests/test_model_parallel.py under ``torch.distributed.run``.

    python -m torch.distributed.run --nproc_per_node 2 tests/model_parallel_worker.py MODE ROOT RESULT

Each rank writes what it observed to ``RESULT.<rank>.json``; the pytest side asserts on it.
MODE may name several modes, comma-separated (tests/dist_worker.py's ``run_modes``).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.dist_worker import run_modes  # noqa: E402
from tools import megatron_style  # noqa: E402
from tools.engines import (  # noqa: E402
    batches,
    build_autotp_engine,
    build_fused_qkv_engine,
    build_megatron_engine,
    build_pipeline_engine,
    destroy_engine,
    train,
    train_megatron,
    train_pipeline,
)

DATA = batches(10)
TAG = "global_step{}"


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor in a checkpoint file, by its path of keys."""
    found: dict[str, torch.Tensor] = {}

    def walk(obj, at: str) -> None:
        if isinstance(obj, torch.Tensor):
            found[at] = obj
        elif isinstance(obj, dict):
            for key, value in obj.items():
                walk(value, f"{at}/{key}")
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                walk(value, f"{at}/{i}")

    walk(torch.load(path, weights_only=False, map_location="cpu"), "")
    return found


def differences(ours: Path, theirs: Path) -> list[str]:
    """What differs between two checkpoint directories: missing or extra files, tensors
    missing or not bit-equal (with dtype and shape)."""
    names = sorted(p.name for p in ours.iterdir())
    wanted = sorted(p.name for p in theirs.iterdir())
    if names != wanted:
        return [f"files {names} != {wanted}"]
    wrong = []
    for name in names:
        mine, reference = tensors_of(ours / name), tensors_of(theirs / name)
        if set(mine) != set(reference):
            wrong.append(f"{name}: keys {sorted(set(mine) ^ set(reference))}")
            continue
        for key, tensor in reference.items():
            other = mine[key]
            if other.dtype != tensor.dtype or other.shape != tensor.shape or not torch.equal(other, tensor):
                wrong.append(f"{name}{key}")
    return wrong


# How each kind of model-parallel engine is built and trained, and its layer a composite saves.
ENGINES = {
    "pipeline": (build_pipeline_engine, train_pipeline, "1"),
    "autotp": (build_autotp_engine, train, "model.layers.1"),
    "megatron": (build_megatron_engine, train_megatron, "blocks.1"),
    "fused_qkv": (build_fused_qkv_engine, train, "model.layers.1"),
}
# What each kind's client passes to a save: a Megatron client says how its parameters are split.
CLIENT_STATE = {"megatron": megatron_style.UNIVERSAL_INFO}


def pipeline(root: Path, configs=((1, "fp32"), (1, "bf16"), (0, "fp32")), kind: str = "pipeline") -> dict:
    """A 2-stage pipeline (data parallel over the other ranks), or with ``kind`` "autotp" a
    tensor-parallel engine of 2 slices, at ZeRO ``configs``: commit step 2 (and DeepSpeed's own
    save of it), then resume from DeepSpeed's save, from a materialized directory and by
    restore; each resume saved again is compared with DeepSpeed's, file by file, then trained on."""
    import ckptstore

    build, train_some, _ = ENGINES[kind]
    results = {}
    for zero_stage, dtype in configs:
        name = f"zero{zero_stage}-{dtype}"
        here = root / name
        store = ckptstore.open(here / "store", create=True)
        engine = build(zero_stage=zero_stage, dtype=dtype)
        train_some(engine, DATA[:4])
        client_state = CLIENT_STATE.get(kind, {})
        store.commit(engine, step=2, client_state=client_state)
        engine.save_checkpoint(str(here / "deepspeed"), tag=TAG.format(2), client_state=client_state)
        if rank() == 0:
            store.materialize(2, here / "materialized")
        barrier()
        run = {"materialized_files": [], "differences": {}, "losses": {}}
        if zero_stage == 1 and dtype == "fp32":
            run["composite"] = composite(store, engine, kind)
        destroy_engine(engine)

        if rank() == 0:
            run["materialized_files"] = sorted(
                p.name for p in (here / "materialized" / TAG.format(2)).iterdir()
            )
            run["deepspeed_files"] = sorted(p.name for p in (here / "deepspeed" / TAG.format(2)).iterdir())
            run["as_written"] = differences(
                here / "materialized" / TAG.format(2), here / "deepspeed" / TAG.format(2)
            )
        # The first engine trained after the committing one, at ZeRO 0, ends its second step a
        # few ulps away from every later one whatever it loaded (measured: 25.161674 against
        # 25.161671, with every tensor it saves equal): a resume from DeepSpeed's save goes first.
        options = {"zero_stage": zero_stage, "dtype": dtype}
        resume(store, here, "deepspeed", kind, **options)
        saved = {}
        for how in ("materialized", "restore", "deepspeed"):
            run["losses"][how], saved[how] = resume(store, here, how, kind, **options)
        barrier()
        if rank() == 0:
            for how in ("materialized", "restore"):
                run["differences"][how] = differences(saved[how], saved["deepspeed"])
        results[name] = run
        barrier()
        if rank() == 0:
            shutil.rmtree(here / "deepspeed")
    return results


def resume(store, here: Path, how: str, kind: str, **engine_options) -> tuple[list[float], Path]:
    """A new engine of ``kind`` resumed from step 2 (by ``restore``, or ``load_checkpoint`` of
    the directory ``here / how``), saved again, then trained on: its losses and the saved folder."""
    build, train_some, _ = ENGINES[kind]
    engine = build(seed=1, **engine_options)
    if how == "restore":
        store.restore(engine, step=2)
    else:
        engine.load_checkpoint(str(here / how), tag=TAG.format(2))
    saved = here / f"resaved-{how}"
    engine.save_checkpoint(str(saved), tag="resumed")
    losses = train_some(engine, DATA[4:8])
    destroy_engine(engine)
    return losses, saved / "resumed"


def composite(store, engine, kind: str) -> dict:
    """Step 4 saves only one block (layer 1 of a pipeline's stage 0, a tensor-parallel Llama's
    ``model.layers.1``), in the background: a restore of it has that block as at step 4 and
    every other layer as at step 2."""
    from tests.dist_worker import matches_store

    _, train_some, layer = ENGINES[kind]
    at_step_2 = {name: tensor.detach().clone() for name, tensor in engine.module.state_dict().items()}
    train_some(engine, DATA[4:8])
    store.commit(engine, step=4, layers=[layer], blocking=False, client_state=CLIENT_STATE.get(kind, {}))
    store.wait()
    at_step_4 = {name: tensor.detach().clone() for name, tensor in engine.module.state_dict().items()}
    train_some(engine, DATA[8:10])
    store.restore(engine, step=4)
    now = engine.module.state_dict()
    expected = {name: (at_step_4 if name.startswith(f"{layer}.") else at_step_2)[name] for name in now}
    return {
        "sources": store.sources(4),
        "wrong": [name for name, tensor in now.items() if not torch.equal(tensor, expected[name])],
        "wrong_in_store": matches_store(engine, store, 4, CLIENT_STATE.get(kind)),
        "state_dict_keys": list(store.state_dict(4)),
    }


# What ds_to_universal needs from a pipeline's client: the tied weight every stage keeps a copy of.
UNIVERSAL_INFO = {
    "universal_checkpoint_info": {"pipeline_replicated_parameter_patterns": [r"tied_modules\.embed\.weight"]}
}


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of one tag folder, in this process."""
    from deepspeed.checkpoint import ds_to_universal

    argv = sys.argv
    sys.argv = ["ds_to_universal", "--input_folder", str(checkpoint), "--output_folder", str(out / checkpoint.name),
                "--num_extract_workers", "1", "--num_merge_workers", "1"]  # fmt: skip
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv
    (out / "latest").write_text(checkpoint.name)


def weights_unlike_universal(store, universal: Path) -> list[str]:
    """The names whose ``state_dict`` tensor (the model's fp32 weights) is not the universal
    checkpoint's ``zero/<name>/fp32.pt``, or which only one of them has."""
    weights = store.state_dict(2)
    theirs = {path.name for path in (universal / "zero").iterdir() if path.is_dir()}
    wrong = sorted(set(weights) ^ theirs)
    for name in set(weights) & theirs:
        param = torch.load(universal / "zero" / name / "fp32.pt", weights_only=True)["param"]
        if not torch.equal(weights[name], param):
            wrong.append(name)
    return wrong


def reshard(root: Path, kind: str = "pipeline") -> dict:
    """A step of 2 stages (or tensor-parallel slices, ``kind`` "autotp") restored into 1 (bf16),
    and one of 1 into 2 (fp32), each compared with DeepSpeed's universal checkpoint of the same
    state loaded into the same engine (``ds_to_universal``, then ``load_universal``): saved
    again file by file, trained on (``kind`` "fused_qkv": AutoTP's Phi-3 with a fused
    ``qkv_proj`` of grouped-query attention). For AutoTP, ``ds_to_universal`` of the materialized step
    gives DeepSpeed's universal checkpoint too."""
    import ckptstore

    split = {"pipeline": "stages", "autotp": "tp", "megatron": "tp", "fused_qkv": "tp"}[kind]
    build, train_some, _ = ENGINES[kind]
    results = {}
    for committed, restored, dtype in ((2, 1, "bf16"), (1, 2, "fp32")):
        # ds_to_universal needs universal_checkpoint_info: a pipeline's client says which weight
        # every stage keeps a copy of; AutoTP writes its own, an engine without it none.
        client_state = UNIVERSAL_INFO if kind == "pipeline" else CLIENT_STATE.get(kind, {})
        if kind in ("autotp", "fused_qkv") and committed == 1:
            client_state = {"universal_checkpoint_info": {}}
        here = root / f"{committed}to{restored}-{dtype}"
        store = ckptstore.open(here / "store", create=True)
        engine = build(**{split: committed}, dtype=dtype)
        train_some(engine, DATA[:4])
        store.commit(engine, step=2, client_state=client_state)
        engine.save_checkpoint(str(here / "deepspeed"), tag=TAG.format(2), client_state=client_state)
        if kind != "pipeline" and rank() == 0:
            store.materialize(2, here / "materialized")
        barrier()
        if rank() == 0:
            to_universal(here / "deepspeed" / TAG.format(2), here / "universal")
            if kind != "pipeline":
                to_universal(here / "materialized" / TAG.format(2), here / "universal-of-materialized")
        barrier()
        destroy_engine(engine)
        universal = {"checkpoint": {"load_universal": True}}
        options = {split: restored, "dtype": dtype}
        resume(store, here, "universal", kind, **options, **universal)  # the first resume: see pipeline()
        run = {"losses": {}}
        saved = {}
        for how, extra in (("restore", {}), ("universal", universal)):
            run["losses"][how], saved[how] = resume(store, here, how, kind, **options, **extra)
        barrier()
        if rank() == 0:
            run["differences"] = differences(saved["restore"], saved["universal"])
            run["weights_unlike_universal"] = weights_unlike_universal(
                store, here / "universal" / TAG.format(2)
            )
            if kind != "pipeline":
                run["universal_of_materialized"] = universal_differences(
                    here / "universal-of-materialized" / TAG.format(2), here / "universal" / TAG.format(2)
                )
        results[f"{committed}to{restored}-{dtype}"] = run
    return results


def same(one, other) -> bool:
    """Whether two loaded objects are equal, tensors bit for bit."""
    if isinstance(one, torch.Tensor) or isinstance(other, torch.Tensor):
        return isinstance(one, torch.Tensor) and isinstance(other, torch.Tensor) and torch.equal(one, other)
    if isinstance(one, dict) and isinstance(other, dict):
        return set(one) == set(other) and all(same(value, other[key]) for key, value in one.items())
    if type(one) is type(other) and hasattr(one, "__dict__"):  # a loss scaler: equal attributes
        return same(vars(one), vars(other))
    return one == other


def universal_differences(ours: Path, theirs: Path) -> list[str]:
    """The files of two universal checkpoint directories (``zero/<name>/<kind>.pt``) that
    differ, or that only one of them has."""
    mine = {path.relative_to(ours) for path in (ours / "zero").rglob("*.pt")}
    wanted = {path.relative_to(theirs) for path in (theirs / "zero").rglob("*.pt")}
    wrong = sorted(str(path) for path in mine ^ wanted)
    for path in sorted(mine & wanted):
        if not same(*(torch.load(root / path, weights_only=False) for root in (ours, theirs))):
            wrong.append(str(path))
    return wrong if mine else ["no zero/ folder"]


def universal_unlike(ours: Path, theirs: Path) -> list[str]:
    """Every file of two universal checkpoint folders (``zero/<name>/<kind>.pt``,
    ``zero/optimizer_state.pt``, the model-states files) that only one has or whose loaded
    objects differ (``same``)."""
    files = [
        {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}
        for folder in (ours, theirs)
    ]
    wrong = sorted(files[0] ^ files[1])
    for path in sorted(files[0] & files[1]):
        if not same(*(torch.load(folder / path, weights_only=False) for folder in (ours, theirs))):
            wrong.append(path)
    return wrong if files[0] else ["no files"]


MODES = {
    "pipeline": pipeline,
    "reshard": reshard,
    "pipeline_bf16": lambda root: pipeline(root, configs=((1, "bf16"),)),
    # One job for both kinds of tensor parallelism: each interpreter start costs seconds.
    "tensor_parallel": lambda root: {
        "autotp": {
            "resume": pipeline(root / "autotp", configs=((1, "fp32"), (2, "bf16")), kind="autotp"),
            "reshard": reshard(root / "autotp-reshard", kind="autotp"),
        },
        "megatron": {
            "resume": pipeline(root / "megatron", configs=((1, "fp32"),), kind="megatron"),
            "reshard": reshard(root / "megatron-reshard", kind="megatron"),
        },
        "fused_qkv": {
            "resume": pipeline(root / "fused_qkv", configs=((1, "fp32"),), kind="fused_qkv"),
            "reshard": reshard(root / "fused_qkv-reshard", kind="fused_qkv"),
        },
    },
}


def main() -> None:
    mode, root, result = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    run_modes(MODES, mode, root, result)
    import torch.distributed as dist

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
