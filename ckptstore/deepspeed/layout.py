"""DeepSpeed's partitioning: optimizer flavours and where each rank's partition starts and ends.

Extraction cuts an engine's flat partitions into pieces (``ckptstore.model.Piece``) with this
math, and the writer lays pieces out again for any world size with the same math.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

# Optimizer flavours, named after the DeepSpeed class whose state dict they follow.
ZERO12 = "DeepSpeedZeroOptimizer"
BF16_OPTIMIZER = "BF16_Optimizer"
ZERO3 = "DeepSpeedZeroOptimizer_Stage3"
FP16_OPTIMIZER = "FP16_Optimizer"
# ZeRO 0 with fp16/bf16 and an optimizer DeepSpeed cannot fuse (a client's torch optimizer,
# torch_adam): an fp32 master per parameter, not one flat group.
FP16_UNFUSED = "FP16_UnfusedOptimizer"
BASIC = "basic"  # ZeRO 0 with fp32: the torch optimizer itself

# ZeRO 1/2 pad every flat group to a multiple of this times the world size
# (DeepSpeedZeroOptimizer.nccl_start_alignment_factor).
ALIGNMENT_FACTOR = 2


def flat_partition_size(used: int, world_size: int) -> int:
    """Per-rank partition length of a ZeRO-1/2 flat group holding ``used`` elements."""
    alignment = ALIGNMENT_FACTOR * world_size
    total = -(-used // alignment) * alignment
    return total // world_size


def flat_fragments(
    numels: Iterable[int], flat_start: int, flat_end: int
) -> Iterator[tuple[int, int, int, int]]:
    """The parts of parameters laid end to end from flat element 0 (a ZeRO-1/2 group) that fall
    in ``[flat_start, flat_end)``: ``(index, start, count, flat_position)`` for ``count`` elements
    from element ``start`` of parameter ``index``, found at ``flat_position`` of the group."""
    offset = 0
    for index, numel in enumerate(numels):
        lo, hi = max(offset, flat_start), min(offset + numel, flat_end)
        if lo < hi:
            yield index, lo - offset, hi - lo, lo
        offset += numel
        if offset >= flat_end:
            return


def zero3_slice(numel: int, world_size: int) -> int:
    """Per-rank slice length of one ZeRO-3 parameter (ceil(numel / world_size))."""
    return -(-numel // world_size)


def zero3_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(first, count)``: the elements ``rank`` holds of a ZeRO-3 parameter of ``numel``
    elements, from flat position ``first`` (its slice of ``zero3_slice`` elements, less the
    padding past the end of the tensor; ``count`` may be 0)."""
    part = zero3_slice(numel, world_size)
    first = rank * part
    return first, max(0, min(part, numel - first))
