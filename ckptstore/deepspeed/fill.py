"""Filling saved file skeletons with the stored tensors' bytes, a parameter at a time.

``write`` builds each checkpoint file's object with placeholder tensors (``Placeholders``),
recording which *segments* of which stored tensors fill each placeholder, and saves that
skeleton with holes (``torchfile``). ``fill`` then reads each parameter's stored tensors once,
from a ``TensorSource``, on a thread pool, and ``pwrite``s every segment they fill: memory holds
a few parameters' tensors, never the model.
"""

from __future__ import annotations

import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from .. import knobs
from ..errors import CorruptError
from ..format.codec import DTYPES, raw_bytes
from ..model import FP32, WEIGHT
from ..progress import progress_bar
from .torchfile import pwrite_all, storage_bytes


class TensorSource(Protocol):
    """Where the writer gets stored tensors from."""

    def __call__(self, name: str, kind: str) -> torch.Tensor | None:
        """The whole tensor in its own shape, or None when the store holds none."""

    def fragments(self, name: str, kind: str) -> list[tuple[int, torch.Tensor]]:
        """Stored pieces as ``(start, tensor)`` in the flattened tensor, possibly not covering it."""

    def dtype(self, name: str, kind: str) -> torch.dtype | None:
        """The dtype of the stored tensor, known before reading it; None when none is stored."""


# A segment kind of its own: the module weight, i.e. the fp32 master cast down and overlaid
# with any weight fragments stored apart.
MODULE = "module"


@dataclass(frozen=True)
class Segment:
    """Elements ``[source_start, source_start + length)`` of the flattened ``kind`` of ``name``,
    placed at element ``target_start`` of a placeholder."""

    name: str
    kind: str
    source_start: int
    length: int
    target_start: int


class Placeholders:
    """Untouched ``torch.empty`` tensors standing in for file contents, with their segments."""

    def __init__(self) -> None:
        self.segments: dict[int, tuple[torch.Tensor, list[Segment]]] = {}

    def new(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A placeholder of ``numel`` elements (virtual memory only, never written here)."""
        tensor = torch.empty(numel, dtype=dtype)
        if numel:
            self.segments[tensor.untyped_storage().data_ptr()] = (tensor, [])
        return tensor

    def place(self, tensor: torch.Tensor, segment: Segment) -> None:
        """Record that ``segment`` of a stored tensor fills part of the placeholder ``tensor``."""
        if segment.length:
            self.segments[tensor.untyped_storage().data_ptr()][1].append(segment)


def stored_tensor(tensors: TensorSource, name: str, kind: str) -> torch.Tensor:
    """The whole ``kind`` of ``name``; CorruptError when the store holds none."""
    found = tensors(name, kind)
    if found is None:
        raise CorruptError(f"the store holds no {kind} tensor for {name}")
    return found


class Filler:
    """Writes the bytes of saved skeletons from a ``TensorSource``."""

    def __init__(self, holes: Placeholders, tensors: TensorSource, params: dict) -> None:
        self.holes = holes
        self._tensors = tensors
        self.params = params

    def fill(self, skeletons: list[tuple[Path, list[tuple[torch.UntypedStorage, int]]]]) -> None:
        """Write the bytes of every storage of the saved skeletons, a parameter per task."""
        by_param: dict[str, list[tuple[int, int, Segment, torch.dtype]]] = defaultdict(list)
        fds = []
        try:
            for path, storages in skeletons:
                fd = os.open(path, os.O_WRONLY)
                fds.append(fd)
                for storage, offset in storages:
                    entry = self.holes.segments.get(storage.data_ptr())
                    if entry is None:  # a real tensor (a buffer, a scalar): small, written now
                        pwrite_all(fd, storage_bytes(storage), offset)
                        continue
                    placeholder, segments = entry
                    for segment in segments:
                        by_param[segment.name].append((fd, offset, segment, placeholder.dtype))
            # Largest first, so no big parameter starts last while the other threads sit idle.
            by_size = sorted(
                by_param.items(), key=lambda item: -sum(s.length * d.itemsize for _, _, s, d in item[1])
            )
            with ThreadPoolExecutor(knobs.io_threads()) as pool:
                tasks = [pool.submit(self.fill_parameter, name, targets) for name, targets in by_size]
                try:
                    for task in progress_bar(
                        as_completed(tasks), total=len(tasks), desc="write", unit="param"
                    ):
                        task.result()
                except BaseException:
                    for task in tasks:
                        task.cancel()
                    raise
        finally:
            for fd in fds:
                os.close(fd)

    def fill_parameter(self, name: str, targets: list[tuple[int, int, Segment, torch.dtype]]) -> None:
        """Read ``name``'s stored tensors once each and write every segment that comes from them."""
        by_kind: dict[str, list[tuple[int, int, Segment, torch.dtype]]] = defaultdict(list)
        for target in targets:
            by_kind[target[2].kind].append(target)
        master = None
        # One kind at a time, so a task holds at most two of them: the fp32 master first, then
        # the module weight cast from it, then the rest.
        for kind in sorted(by_kind, key=lambda k: (k != FP32, k != MODULE)):
            if kind == MODULE:
                source = self.module_weight(name, self.tensor(name, FP32) if master is None else master)
                master = None
            else:
                source = self.tensor(name, kind).reshape(-1)
                if kind == FP32 and MODULE in by_kind:
                    master = source
            for fd, offset, segment, dtype in by_kind[kind]:
                if source.dtype != dtype:
                    raise CorruptError(
                        f"{name} {kind} is stored as {source.dtype}, the checkpoint needs {dtype}"
                    )
                end = segment.source_start + segment.length
                if end > source.numel():
                    raise CorruptError(f"{name} {kind} holds {source.numel()} elements, {end} are needed")
                pwrite_all(
                    fd,
                    raw_bytes(source[segment.source_start : end]),
                    offset + segment.target_start * dtype.itemsize,
                )

    def module_weight(self, name: str, master: torch.Tensor) -> torch.Tensor:
        """The flat module weight: ``master`` cast down, overlaid with any weight stored apart."""
        fragments = self._tensors.fragments(name, WEIGHT)
        weight = master.reshape(-1).to(DTYPES[self.params[name]["dtype"]], copy=bool(fragments))
        for start, fragment in fragments:
            weight[start : start + fragment.numel()] = fragment.reshape(-1)
        return weight

    def tensor(self, name: str, kind: str) -> torch.Tensor:
        return stored_tensor(self._tensors, name, kind)
