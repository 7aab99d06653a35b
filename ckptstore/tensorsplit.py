"""A tensor-parallel parameter as a step keeps it: its slices one after another.

A parameter that tensor-parallel ranks hold in slices along one dimension is described at its
logical shape with its ``split``: ``{"dim": d, "sizes": [s0, s1, ...]}``, slice ``t`` holding
``sizes[t]`` of dimension ``d``. Its pieces are addressed in one flat space of the logical
numel: slice 0 flattened, then slice 1, and so on, so each rank's ZeRO fragments are
contiguous ranges of it and a slice is a piece of its logical parameter like any other. Split
along dimension 0 that order is the logical tensor's own; along another dimension it is a
permutation of it, which ``to_logical`` and ``from_logical`` undo and redo.
"""

from __future__ import annotations

import math

import torch


def split_of(info: dict) -> dict | None:
    """The parameter's tensor-parallel split (``info`` is its description entry), or None."""
    return info.get("split")


def in_logical_order(info: dict) -> bool:
    """Whether the parameter's flat stored order is its logical tensor's (unsplit, or split
    along dimension 0)."""
    split = split_of(info)
    return split is None or split["dim"] == 0 or len(split["sizes"]) == 1


def slice_shape(info: dict, index: int) -> list[int]:
    """The shape of slice ``index`` (the whole shape for an unsplit parameter)."""
    shape = list(info["shape"])
    split = split_of(info)
    if split is not None:
        shape[split["dim"]] = split["sizes"][index]
    return shape


def slice_offset(info: dict, index: int) -> int:
    """Where slice ``index`` starts in the flat stored order (0 for an unsplit parameter)."""
    split = split_of(info)
    if split is None:
        return 0
    return sum(math.prod(slice_shape(info, t)) for t in range(index))


def to_logical(flat: torch.Tensor, info: dict) -> torch.Tensor:
    """The logical tensor (in ``info["shape"]``) of a flat tensor in stored order."""
    flat = flat.reshape(-1)
    if in_logical_order(info):
        return flat.view(info["shape"])
    split = split_of(info)
    slices, start = [], 0
    for index in range(len(split["sizes"])):
        shape = slice_shape(info, index)
        slices.append(flat[start : start + math.prod(shape)].view(shape))
        start += math.prod(shape)
    return torch.cat(slices, dim=split["dim"])


def from_logical(tensor: torch.Tensor, info: dict) -> torch.Tensor:
    """The flat stored order of the logical ``tensor`` for the split ``info`` describes."""
    if in_logical_order(info):
        return tensor.reshape(-1)
    split = split_of(info)
    tensor = tensor.view(info["shape"])
    slices = tensor.split(split["sizes"], dim=split["dim"])
    return torch.cat([piece.reshape(-1) for piece in slices])


def same_order(one: dict, other: dict) -> bool:
    """Whether two descriptions of one parameter store its elements in the same flat order."""
    if in_logical_order(one) and in_logical_order(other):
        return True
    return split_of(one) == split_of(other)
