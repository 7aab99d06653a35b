"""Dtype conversion of tensors (exported ones, decoded ones), on the calling thread only.

``tensor.to(bfloat16)`` of 32768 elements or more runs on torch's intra-op (OpenMP) threads,
and a parallel region waits for its slowest thread: on a 2-core box busy with the export's
own threads (and others') a 0.2 ms cast of 590k elements took 20 ms, 0.5-0.9 s of an 81M
model's 1.0-1.4 s bf16 export. Export already runs several tensors at once on its own
threads, so each cast is done in copies small enough that torch keeps them on the caller
(``SERIAL_ELEMENTS``).
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
    for start in range(0, source.numel(), SERIAL_ELEMENTS):
        out[start : start + SERIAL_ELEMENTS].copy_(source[start : start + SERIAL_ELEMENTS])


def cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(dtype)`` (the same tensor when it has that dtype), by ``cast_into``."""
    if tensor.dtype == dtype:
        return tensor
    out = torch.empty(tensor.shape, dtype=dtype)
    cast_into(tensor, out)
    return out
