"""Dtype conversion of tensors (exported ones, decoded ones), on the calling thread only.

``tensor.to(bfloat16)`` of 32768 elements or more runs on torch's intra-op (OpenMP) threads,
and a parallel region waits for its slowest thread: on a 2-core box busy with the export's
own threads (and others') a 0.2 ms cast of 590k elements took 20 ms, 0.5-0.9 s of an 81M
model's 1.0-1.4 s bf16 export. Export, restore and materialize already run several tensors at
once on their own threads, so each cast is done in copies small enough that torch keeps them
on the caller (``SERIAL_ELEMENTS``), all of them in one ``torch._foreach_copy_`` call: one
release of the GIL for the whole cast, not one per copy (a loop of copies held it for the
Python between them: ~10 us a copy, half of it the copy itself, so two decoding threads waited
for each other).
The conversion is torch's own copy kernel: bit for bit what ``Tensor.to`` gives.
"""

from __future__ import annotations

import torch

# at::internal::GRAIN_SIZE: TensorIterator copies fewer elements than this without OpenMP.
SERIAL_ELEMENTS = 32768 - 1


def cast_into(source: torch.Tensor, out: torch.Tensor) -> None:
    """Copy ``source`` into ``out`` (contiguous, as many elements), converting its dtype as
    ``Tensor.to`` does, on this thread only. ValueError if the element counts differ."""
    source, out = source.reshape(-1), out.view(-1)
    if source.numel() != out.numel():
        raise ValueError(f"cannot cast {source.numel()} elements into {out.numel()}")
    copy_serially(serial_views(out), serial_views(source))


def serial_views(tensor: torch.Tensor) -> list[torch.Tensor]:
    """``tensor`` (1-D) as consecutive views of ``SERIAL_ELEMENTS`` (the last fewer)."""
    return list(tensor.split(SERIAL_ELEMENTS))


def copy_serially(outs: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each of ``sources`` into the view of ``outs`` beside it (``serial_views`` of both,
    as many elements each), converting dtypes, in one call that releases the GIL once. On the
    CPU ``_foreach_copy_`` copies one pair after another on this thread, each by ``copy_``."""
    if outs:
        torch._foreach_copy_(outs, sources)


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` (the same tensor when it has that dtype), by ``cast_into``."""
    if tensor.dtype == dtype:
        return tensor
    out = torch.empty(tensor.shape, dtype=dtype)
    cast_into(tensor, out)
    return out
