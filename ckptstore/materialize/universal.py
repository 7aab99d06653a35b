"""Materialize ``--universal``: what DeepSpeed's ``ds_to_universal`` writes for a step, from the store.

DeepSpeed's universal checkpoint (``deepspeed/checkpoint/ds_to_universal.py``) holds, under
``OUT/global_step<N>_universal/``, ``zero/<param name>/{fp32,exp_avg,exp_avg_sq}.pt`` (each
``{"param": the logical tensor}`` with the keys its ``merge_tp_slices`` adds for the
parameter's ``universal_checkpoint_info`` pattern: ``cat_dim``, ``param_n_sub_params``,
``sub_param_shape``, ``vocab_tensor``), ``zero/<param name>/step.pt`` (its group's ``step``,
as the base optimizer keeps it), ``zero/optimizer_state.pt`` (the ZeRO optimizer's state
without its partitions, with the base optimizer's ``param_groups``) and a copy of the
``mp_rank_XX_model_states.pt`` files; ``OUT/latest_universal`` names the folder, which is what
``load_checkpoint`` with ``{"checkpoint": {"load_universal": true}}`` reads. The store keeps the
logical tensors already (a tensor-parallel parameter's slices are pieces of it, joined as
``ds_to_universal`` joins them: ``tensorsplit``, what ``export`` reads), so they are written
straight from it, and the model-states files as materialize writes them: no DeepSpeed
directory is built on the way. A parameter is taken from the first model-parallel rank that
holds it (pipe-major: a tied weight from the first stage, ``step`` from tensor-parallel rank
0), as ``ds_to_universal`` reads it.

Reached: ZeRO-1/2 steps (and bf16's ``BF16_Optimizer``) of any data-parallel size, with or
without a pipeline and tensor parallelism (AutoTP, whose ``affine_map`` DeepSpeed's
``ParamAffineMap`` applies to the stored slices, Megatron-style patterns, Megatron-DeepSpeed's
3D). An averaged parameter (``parameter_to_average_patterns``) keeps every rank's copy, and is
written as ``ds_to_universal``'s mean of them (``tensorsplit``). A state-dict entry no
optimizer group holds (frozen, tied under another name, a buffer) gets ``fp32.pt`` alone from
the model-states file, as ``ds_to_universal`` writes it. Refused (``UnsupportedError`` naming
it, before anything is written): other optimizers and ZeRO 3, DeepSpeed MoE layers, sub-parameters described as
before universal checkpoint version 0.4, a vocabulary pattern without ``original_vocab_size``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from .. import pathnames, tensorsplit
from ..catalog import Catalog
from ..deepspeed import parallel
from ..deepspeed import universal_info as info_keys
from ..deepspeed.fill import Filler, TensorSource, stored_tensor
from ..deepspeed.layout import BF16_OPTIMIZER, ZERO12
from ..deepspeed.stepfiles import StepWriter
from ..deepspeed.torchfile import save_skeleton
from ..errors import CorruptError, UnsupportedError
from ..model import FP32
from ..objects import ObjectStore
from . import outputs
from .directory import check_resumable, step_reader

LATEST = "latest_universal"
# The optimizer states ds_to_universal writes per parameter (besides ``step``), in its order.
STATES = (FP32, "exp_avg", "exp_avg_sq")
# What ds_to_universal leaves out of zero/optimizer_state.pt: the partitions themselves.
_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


def tag_of(step: int) -> str:
    """The universal checkpoint folder of ``step``."""
    return f"global_step{step}_universal"


def materialize_universal(
    objects: ObjectStore, catalog: Catalog, step: int, out: str | os.PathLike | None, *, force: bool
) -> Path:
    """``Store.materialize(step, out, universal=True)``: ``out/latest_universal`` and
    ``out/global_step<step>_universal/``, built beside ``out`` and renamed into place.

    Raises UnsupportedError naming what this version cannot write as a universal checkpoint
    (nothing is written), and what ``Store.materialize`` raises otherwise.
    """
    check_resumable(catalog, step)
    description = json.loads(catalog.description(step))
    check_reachable(description, step)
    out = outputs.check_out(out, force=force, store_root=getattr(objects, "root", None), verb="materialize")
    tensors = step_reader(objects, catalog, step, description)
    with outputs.building(out, "materialize", step) as staging:
        write_universal(description, tensors, staging / tag_of(step))
        (staging / LATEST).write_text(tag_of(step))
    return out


def check_reachable(description: dict, step: int) -> None:
    """UnsupportedError unless a universal checkpoint of the step can be written here."""
    what = f"materialize --universal of step {step}"
    flavour, stage = description.get("flavour"), description.get("zero_stage")
    if not ((flavour == ZERO12 and stage in (1, 2)) or (flavour == BF16_OPTIMIZER and stage in (0, 1))):
        raise UnsupportedError(
            f"{what}: only ZeRO-1/2 steps (bf16's BF16_Optimizer too) are written as universal "
            f"checkpoints yet, not ZeRO {stage} ({flavour}); use ds_to_universal on its materialize"
        )
    if description.get("experts"):
        raise UnsupportedError(
            f"{what}: its DeepSpeed MoE layers have no universal form (DeepSpeed's universal checkpoints "
            "know only AutoEP's experts); materialize --ep-size writes it for another expert-parallel size"
        )
    trainable = {
        name for m in range(parallel.size(description))
        for group in parallel.rank_description(description, m)["groups"] for name in group["params"]
    }  # fmt: skip
    module_keys = {
        key for m in range(parallel.size(description))
        for key, _ in parallel.rank_description(description, m).get("module_keys", ())
    }  # fmt: skip
    for name in sorted(trainable | module_keys):
        # Each becomes zero/<name>/ (ds_to_universal joins the name to the folder as it is, so
        # a name with '/' is nested folders both ways, and an absolute one would leave the output)
        pathnames.join(Path(), name, f"{what}: the parameter", UnsupportedError)
    info = universal_info(description)
    # Every pattern against every name once, bounded in time, before anything is written.
    info_keys.check_patterns(info, sorted(trainable | module_keys), f"step {step}", CorruptError)
    for name in sorted(trainable):
        if merge_kind(info, name) == SUB and legacy_sub_params(info, name):
            raise UnsupportedError(
                f"{what}: {name} has sub-parameters described as before universal checkpoint "
                "version 0.4 (a count, no widths), not written yet"
            )
        if _matches(info, info_keys.VOCABULARY, name) and type(info.get(info_keys.ORIGINAL_VOCAB)) is not int:
            raise UnsupportedError(f"{what}: vocabulary parameter {name} has no original_vocab_size")


def universal_info(description: dict) -> dict:
    """The step's ``universal_checkpoint_info`` (as its first model-parallel rank saved it)."""
    return parallel.stored_universal_info(description) or {}


# How ds_to_universal's merge_tp_slices joins a parameter's slices, tried in its order.
AFFINE, REPLICATED, AVERAGED, TWO_SUB, SUB, CAT = "affine", "replicated", "averaged", "two", "sub", "cat"
# The universal_checkpoint_info keys it reads for them.
_PATTERNS = {
    REPLICATED: info_keys.REPLICATED, AVERAGED: info_keys.AVERAGED, TWO_SUB: info_keys.TWO_SUB_PARAMS,
}  # fmt: skip


def _matches(info: dict, key: str, name: str) -> bool:
    return info_keys.matches(info.get(key), name)


def _affine_map(info: dict, name: str) -> dict | None:
    params = (info.get("affine_map") or {}).get("params") or {}
    matched = [pattern for pattern in params if info_keys.match(pattern, name) is not None]
    return params[matched[0]] if matched else None


def _sub_params(info: dict, name: str) -> tuple[dict, str] | tuple[None, None]:
    for entry in info.get(info_keys.SUB_PARAMS) or ():
        for pattern in entry["patterns"]:
            if info_keys.match(pattern, name) is not None:
                return entry, pattern
    return None, None


def merge_kind(info: dict, name: str) -> str:
    """Which of merge_tp_slices' branches ``name`` takes (the affine map first, as it does)."""
    if _affine_map(info, name) is not None:
        return AFFINE
    for kind, key in _PATTERNS.items():
        if _matches(info, key, name):
            return kind
    return SUB if _sub_params(info, name)[0] is not None else CAT


def legacy_sub_params(info: dict, name: str) -> bool:
    """Whether the sub-parameters of ``name`` are given by a count (before version 0.4)."""
    entry, _ = _sub_params(info, name)
    spec = entry["shape"][entry["partition_dim"]]
    return info.get("universal_checkpoint_version", 0.0) < 0.4 and not isinstance(spec, tuple)


def merged(info: dict, name: str, param: dict, degree: int, stored: torch.Tensor, kind: str) -> dict:
    """What ds_to_universal writes to ``zero/<name>/<kind>.pt`` for a parameter (its
    description entry ``param``) whose ``kind`` the store holds as ``stored`` (its flat stored
    order): the logical tensor the export path reads (``tensorsplit``), with the keys its
    branch of merge_tp_slices adds; the vocabulary's padding cut as it cuts it."""
    how = merge_kind(info, name)
    saved: dict = {}
    if how == AFFINE:
        from deepspeed.checkpoint.affine import SCALE_POWER_BY_STATE, ParamAffineMap

        flat = stored.reshape(-1)
        shards = {
            t: flat[tensorsplit.slice_offset(param, t) :][: math.prod(shape)].view(shape)
            for t, shape in enumerate(tensorsplit.slice_shape(param, t) for t in range(degree))
        }
        tensor = ParamAffineMap.from_dict(_affine_map(info, name)).rebuild(shards, SCALE_POWER_BY_STATE[kind])
    else:
        tensor = tensorsplit.to_logical(stored, param)
    if how == AVERAGED and not tensorsplit.averaged(param):
        # a step committed before every rank's copy was kept holds the first: ds_to_universal's
        # mean of equal copies (an averaged split's logical tensor is the mean already)
        tensor = sum([tensor] * degree) / degree
    elif how == TWO_SUB:
        saved.update(cat_dim=0, param_n_sub_params=2)
    elif how == SUB:
        saved["sub_param_shape"] = _subparam_shape(info, name)
    elif how == CAT:
        saved["cat_dim"] = 1 if _matches(info, info_keys.ROW_PARALLEL, name) else 0
    if _matches(info, info_keys.VOCABULARY, name):
        tensor = tensor[: info[info_keys.ORIGINAL_VOCAB]]
        saved["vocab_tensor"] = True
    # a clone: torch.save writes a view's whole storage, which may hold other tensors
    saved["param"] = tensor.clone(memory_format=torch.contiguous_format)
    return saved


def _subparam_shape(info: dict, name: str):
    from deepspeed.checkpoint import SubparamShape

    entry, _ = _sub_params(info, name)
    return SubparamShape(**entry)


def write_universal(description: dict, tensors: TensorSource, folder: Path) -> None:
    """Write the universal checkpoint folder of a step ``check_reachable`` accepts."""
    writer = StepWriter(description, tensors, description["world_size"])
    files = writer.files()
    optim = {
        mp: obj["optimizer_state_dict"]
        for name, obj, (mp, dp) in files if name.endswith("_optim_states.pt") and dp == 0
    }  # fmt: skip
    info, degree = universal_info(description), parallel.tensor_size(description)
    zero = folder / "zero"
    zero.mkdir(parents=True)
    written: set[str] = set()
    # Each parameter from the first model-parallel rank holding it (pipe-major: the first
    # stage's copy of a tied weight, tensor-parallel rank 0's step), as ds_to_universal reads it.
    for rank in writer.writers:
        state = optim[rank.mp_rank]["base_optimizer_state"]["state"]
        for g, group in enumerate(rank.d["groups"]):
            for name in group["params"]:
                if name in written:
                    continue
                written.add(name)
                target = parameter_folder(zero, name)
                if "step" in state[g]:
                    save_new(state[g]["step"], target / "step.pt")
                for kind in STATES:
                    stored = stored_tensor(tensors, name, kind)
                    save_new(
                        merged(info, name, writer.params[name], degree, stored, kind), target / f"{kind}.pt"
                    )
    if not description.get("model_parallel", {}).get("pipeline", False):
        write_module_entries(writer, tensors, zero, written)
    # zero/optimizer_state.pt: the first rank's, as DeepSpeedCheckpoint reads it
    osd = optim[0]
    common = {key: value for key, value in osd.items() if key not in _SHARDED}
    common["param_groups"] = osd["base_optimizer_state"]["param_groups"]
    if common.get("group_paddings"):
        common["group_paddings"] = [0] * len(common["group_paddings"])
    if common.get("partition_count"):
        common["partition_count"] = [description["world_size"]] * len(common["partition_count"])
    save_new(common, zero / "optimizer_state.pt")
    # The model-states files, as ds_to_universal copies them: materialize's, filled on disk.
    models = [
        (pathnames.new_file(pathnames.join(folder, name, "a file of the step", flat=True), "a file of the step"), obj)
        for name, obj, _ in files if name.startswith("mp_rank_")
    ]  # fmt: skip
    Filler(writer.holes, tensors, writer.params).fill(
        [(path, save_skeleton(obj, path)) for path, obj in models]
    )


def parameter_folder(zero: Path, name: str) -> Path:
    """``zero/<name>``, made now: a name ``check_reachable`` let through, made only once (a
    name another one landed on already, ``a`` beside ``a/fp32.pt``, is refused)."""
    return pathnames.new_folder(
        pathnames.join(zero, name, "the parameter", UnsupportedError), "the parameter"
    )


def save_new(obj: object, path: Path) -> None:
    """``torch.save(obj, path)`` into a file that did not exist (``pathnames.new_file``)."""
    torch.save(obj, pathnames.new_file(path, "the universal checkpoint"))


def write_module_entries(writer: StepWriter, tensors: TensorSource, zero: Path, written: set[str]) -> None:
    """What ds_to_universal writes for the entries of a model's state dict that no optimizer
    group holds (a frozen parameter, a tied one under its other name, a buffer): ``fp32.pt``
    alone, ``{"param": the model-states file's tensor as float}``, each from the first
    model-parallel rank's file that has it (a frozen tensor-parallel parameter: rank 0's
    slice, as it reads it). A pipeline's model-states files hold no module: nothing then.
    ``written``: the names written already (each parameter's folder), to which these are added."""
    filler = Filler(writer.holes, tensors, writer.params)
    for rank in writer.writers:
        missing = {key: tensor for key, tensor in rank.module().items() if key not in written}
        filler.fill_in_memory(filler.in_memory(list(missing.values())), desc="universal")
        for key, tensor in missing.items():
            written.add(key)
            save_new({"param": tensor.float().clone()}, parameter_folder(zero, key) / "fp32.pt")
