"""Each optimizer flavour's state, as ``state_dict()`` gives it on one rank, cut into pieces.

ZeRO 1/2 and ``FP16_Optimizer`` keep flat partitions, ZeRO 3 a padded slice of every parameter,
a torch optimizer (and ``FP16_UnfusedOptimizer``) a state per parameter; each function here cuts
its flavour's tensors into per-parameter ``Piece``s (``extract`` uses them) and returns the
groups of the step's description: parameter order, options, scalars and state kinds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import UnsupportedError
from ..model import FP32, Piece
from .layout import flat_fragments, zero3_bounds, zero3_slice


def partition_ranks(engine: Any, groups: int, rank: int) -> list[int]:
    """This rank's rank in the group each ZeRO-1/2 param group is partitioned over: the
    data-parallel group, or for an expert group its expert-data-parallel group."""
    process_groups = getattr(engine.optimizer, "real_dp_process_group", None)
    if not process_groups or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return [rank] * groups
    return [torch.distributed.get_rank(group=group) for group in process_groups]


def _split_state(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split one optimizer state entry into partition-sized tensors and scalars (``step``)."""
    tensors, scalars = {}, {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            tensors[key] = value
        else:
            scalars[key] = value
    return tensors, scalars


def _hyper(param_group: dict) -> dict:
    return {k: v for k, v in param_group.items() if k != "params"}


def _cut_flat(
    names, shapes, flat_start: int, partition: torch.Tensor, kind: str, pieces: list[Piece]
) -> None:
    """Cut the pieces of ``names`` (laid end to end from element 0) that fall in a partition.

    ``partition`` covers flat elements ``[flat_start, flat_start + len(partition))``.
    """
    numels = [int(torch.Size(shape).numel()) for shape in shapes]
    for i, start, count, position in flat_fragments(numels, flat_start, flat_start + partition.numel()):
        chunk = partition[position - flat_start : position - flat_start + count]
        pieces.append(Piece.cut(names[i], kind, start, chunk, shapes[i]))


def zero12_groups(
    osd: dict, param_shapes: list, ranks: list[int], rename: Callable[[str], str], pieces: list[Piece]
) -> list[dict]:
    """Groups of a ZeRO-1/2 optimizer state ``osd`` whose partition ``ranks[g]`` of group g
    this rank holds (its rank in the group's data-parallel group), names ``rename``d."""
    base = osd["base_optimizer_state"]
    if not isinstance(base, dict):
        raise UnsupportedError("elastic ZeRO checkpoints are not supported")
    groups = []
    for g, shapes in enumerate(param_shapes):
        names, sizes = [rename(name) for name in shapes], list(shapes.values())
        tensors, scalars = _split_state(base["state"].get(g, {}))
        lean_fp32 = osd["single_partition_of_fp32_groups"][g]
        # The torch state covers the whole partition, padding included; the fp32 partition
        # drops the trailing padding (ZeRO 1/2) or keeps it (BF16_Optimizer).
        partition_size = lean_fp32.numel() + (osd["group_paddings"][g] if "zero_stage" in osd else 0)
        start = ranks[g] * partition_size
        _cut_flat(names, sizes, start, lean_fp32, FP32, pieces)
        for kind, tensor in tensors.items():
            _cut_flat(names, sizes, start, tensor, kind, pieces)
        groups.append({"params": names, "hyper": _hyper(base["param_groups"][g]), "scalars": scalars,
                       "state_kinds": list(tensors)})  # fmt: skip
    return groups


def zero3_groups(engine: Any, osd: dict, param_shapes: list, rank: int, pieces: list[Piece]) -> list[dict]:
    if "ds_zero_partition_groups" in osd:
        raise UnsupportedError("ZeRO-3 expert-parallel (AutoEP MoE) checkpoints are not supported")
    world_size = osd["partition_count"]
    torch_osd = osd["optimizer_state_dict"]
    subgroup_scalars, subgroup_kinds = [], []
    for i, shapes in enumerate(param_shapes):
        tensors, scalars = _split_state(torch_osd["state"].get(i, {}))
        subgroup_scalars.append(scalars)
        subgroup_kinds.append(list(tensors))
        flats = {FP32: osd["fp32_flat_groups"][i], **tensors}
        offset = 0
        for name, shape in shapes.items():
            first, count = zero3_bounds(int(shape.numel()), world_size, rank)
            if count:
                for kind, flat in flats.items():
                    pieces.append(Piece.cut(name, kind, first, flat[offset : offset + count], shape))
            offset += zero3_slice(int(shape.numel()), world_size)
    groups = []
    for param_group in torch_osd["param_groups"]:
        subgroups = [list(param_shapes[i].keys()) for i in param_group["params"]]
        groups.append({
            "params": [n for sub in subgroups for n in sub],
            "subgroups": subgroups,
            "subgroup_scalars": [subgroup_scalars[i] for i in param_group["params"]],
            "subgroup_kinds": [subgroup_kinds[i] for i in param_group["params"]],
            "hyper": _hyper(param_group),
        })  # fmt: skip
    return groups


def basic_groups(
    param_names: dict, osd: dict, params: list[list], masters: list[list[torch.Tensor]], pieces: list[Piece]
) -> list[dict]:
    """Groups of a torch optimizer's state dict ``osd`` over the module's ``params`` (per
    group, in its order, named by ``param_names``), whose fp32 values are ``masters``: the
    parameters themselves (fp32 ZeRO 0), or ``FP16_UnfusedOptimizer``'s fp32 copies of them."""
    names_by_index = [param_names[p] for group in params for p in group]
    if not len(masters) == len(params) == len(osd["param_groups"]):
        raise UnsupportedError("the optimizer's fp32 groups do not match its parameter groups")
    groups = []
    for param_group, group_masters in zip(osd["param_groups"], masters, strict=True):
        names, param_state = [], {}
        for index, master in zip(param_group["params"], group_masters, strict=True):
            name = names_by_index[index]
            names.append(name)
            pieces.append(Piece(name, FP32, 0, master))
            if index not in osd["state"]:
                continue  # torch keeps no state for a param that never had a gradient
            tensors, scalars = _split_state(osd["state"][index])
            param_state[name] = {"scalars": scalars, "kinds": list(tensors)}
            for kind, tensor in tensors.items():
                pieces.append(Piece(name, kind, 0, tensor))
        groups.append({"params": names, "hyper": _hyper(param_group), "param_state": param_state})
    return groups


def fp16_optimizer_groups(engine: Any, param_names: dict, osd: dict, pieces: list[Piece]) -> list[dict]:
    torch_osd = osd["optimizer_state_dict"]
    groups = []
    for g, params in enumerate(engine.optimizer.fp16_groups):
        names = [param_names[p] for p in params]
        shapes = [tuple(p.shape) for p in params]
        tensors, scalars = _split_state(torch_osd["state"].get(g, {}))
        _cut_flat(names, shapes, 0, osd["fp32_groups_flat"][g], FP32, pieces)
        for kind, tensor in tensors.items():
            _cut_flat(names, shapes, 0, tensor, kind, pieces)
        groups.append({"params": names, "hyper": _hyper(torch_osd["param_groups"][g]), "scalars": scalars,
                       "state_kinds": list(tensors)})  # fmt: skip
    return groups
