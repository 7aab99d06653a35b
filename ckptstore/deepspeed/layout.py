"""The vocabulary shared by extraction and writing: pieces, the step description, partition math.

A *piece* is one stored tensor: the ``kind`` of data (``fp32`` master, module ``weight``,
``buffer``, or an optimizer state name such as ``exp_avg``) of one named parameter or buffer,
either whole (in its own shape) or as a 1-D fragment starting at element ``start`` of the
flattened tensor (what one data-parallel rank owns). Pieces never depend on how the engine
flattened and padded its groups, so they can be cut again for any world size.

The *description* (a plain JSON-compatible dict) says everything else a writer needs: the
optimizer flavour, the groups and their parameter order, hyperparameters and step counters,
module key order, aliases, and the non-tensor state DeepSpeed stores (scheduler, counters,
client state, loss scaler).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Optimizer flavours, named after the DeepSpeed class whose state dict they follow.
ZERO12 = "DeepSpeedZeroOptimizer"
BF16_OPTIMIZER = "BF16_Optimizer"
ZERO3 = "DeepSpeedZeroOptimizer_Stage3"
FP16_OPTIMIZER = "FP16_Optimizer"
BASIC = "basic"  # ZeRO 0 with fp32: the torch optimizer itself

FP32 = "fp32"
WEIGHT = "weight"
BUFFER = "buffer"

# ZeRO 1/2 pad every flat group to a multiple of this times the world size
# (DeepSpeedZeroOptimizer.nccl_start_alignment_factor).
ALIGNMENT_FACTOR = 2


@dataclass
class Piece:
    """One tensor to store: ``kind`` of ``name``, whole (start 0, full shape) or a 1-D fragment.

    A module weight that may just be its fp32 master cast down carries that master as
    ``unless_equal_to``: it is stored only if ``unless_equal_to.to(tensor.dtype)`` differs
    from it (``redundant``). The comparison is left to the store so it can run after the
    snapshot, off the training loop.
    """

    name: str
    kind: str
    start: int
    tensor: torch.Tensor
    unless_equal_to: torch.Tensor | None = None

    def redundant(self) -> bool:
        """Whether this piece can be rebuilt from ``unless_equal_to`` and need not be stored."""
        if self.unless_equal_to is None:
            return False
        return torch.equal(self.unless_equal_to.reshape(-1).to(self.tensor.dtype), self.tensor.reshape(-1))


@dataclass
class Snapshot:
    """What one rank extracted from an engine: the step description and its pieces."""

    description: dict
    pieces: list[Piece]
    rank: int
    world_size: int


def numel_of(shape: list[int] | tuple[int, ...]) -> int:
    """Number of elements of a tensor of ``shape``."""
    return math.prod(shape)


def flat_partition_size(used: int, world_size: int) -> int:
    """Per-rank partition length of a ZeRO-1/2 flat group holding ``used`` elements."""
    alignment = ALIGNMENT_FACTOR * world_size
    total = -(-used // alignment) * alignment
    return total // world_size


def zero3_slice(numel: int, world_size: int) -> int:
    """Per-rank slice length of one ZeRO-3 parameter (ceil(numel / world_size))."""
    return -(-numel // world_size)
