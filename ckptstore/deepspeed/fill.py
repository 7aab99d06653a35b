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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Protocol

import torch

from .. import forked, knobs
from ..errors import CorruptError
from ..format.cast import cast
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

    def span(self, name: str, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        """Elements ``[lo, hi)`` of the flattened tensor, reading only what covers them; None when none is stored."""


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
        self.reused = 0  # how many are an engine's own buffers

    def new(self, numel: int, dtype: torch.dtype, reuse: torch.Tensor | None = None) -> torch.Tensor:
        """A placeholder of ``numel`` elements (virtual memory only, never written here), or
        ``reuse`` (an engine's own buffer) when it is exactly that and alone in its storage:
        filling it in memory then writes the stored tensors straight into it."""
        if reuse is not None and _sole_buffer(reuse, numel, dtype):
            tensor = reuse.detach()  # filled outside autograd, like the optimizer's own copies
            self.reused += 1
        else:
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


# Where a segment's elements go: given the segment and its elements of the stored tensor.
Put = Callable[[Segment, torch.Tensor], None]


class Filler:
    """Writes the bytes of saved skeletons (``fill``), or fills placeholders in memory
    (``fill_in_memory``), from a ``TensorSource``."""

    def __init__(self, holes: Placeholders, tensors: TensorSource, params: dict) -> None:
        self.holes = holes
        self._tensors = tensors
        self.params = params

    def fill(self, skeletons: list[tuple[Path, list[tuple[torch.UntypedStorage, int]]]]) -> None:
        """Write the bytes of every storage of the saved skeletons, a parameter per task: when
        the tensors are read from local files, in forked worker processes where that pays
        (``forked.worth_running``), else on threads."""
        by_param: dict[str, list[tuple[Put, Segment, torch.dtype]]] = defaultdict(list)
        fds = []
        try:
            for path, storages in skeletons:
                fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                fds.append(fd)
                for storage, offset in storages:
                    entry = self.holes.segments.get(storage.data_ptr())
                    if entry is None:  # a real tensor (a buffer, a scalar): small, written now
                        pwrite_all(fd, storage_bytes(storage), offset)
                        continue
                    placeholder, segments = entry
                    put = partial(_pwrite_segment, fd, offset, placeholder.dtype.itemsize)
                    for segment in segments:
                        by_param[segment.name].append((put, segment, placeholder.dtype))
            self._run(by_param, whole=True, desc="write", fork=True)
        finally:
            for fd in fds:
                os.close(fd)

    def in_memory(self, objects: list) -> list[tuple[Put, list[Segment], torch.dtype]]:
        """The placeholders inside ``objects`` (the files one rank reads), each as where its
        segments go in memory, its segments and its dtype, for ``fill_in_memory``; what no
        segment covers (padding) is zeroed now. The other placeholders are never touched."""
        found = []
        for storage_ptr in _storages(objects):
            entry = self.holes.segments.get(storage_ptr)
            if entry is not None:
                placeholder, segments = entry
                put = _CopyInto(placeholder.view(-1))
                _zero_gaps(put.placeholder, segments)
                found.append((put, segments, placeholder.dtype))
        return found

    def fill_in_memory(
        self,
        targets: list[tuple[Put, list[Segment], torch.dtype]],
        skip: Callable[[Segment], bool] = lambda segment: False,
        desc: str = "restore",
    ) -> None:
        """Fill ``targets`` (``in_memory``'s) in place, reading only the elements their segments
        need (``TensorSource.span``); segments ``skip`` says are left as they are. ``desc``: the
        progress bar's."""
        by_param: dict[str, list[tuple[Put, Segment, torch.dtype]]] = defaultdict(list)
        for put, segments, dtype in targets:
            for segment in segments:
                if not skip(segment):
                    by_param[segment.name].append((put, segment, dtype))
        self._run(by_param, whole=False, desc=desc)

    def _run(
        self,
        by_param: dict[str, list[tuple[Put, Segment, torch.dtype]]],
        whole: bool,
        desc: str,
        fork: bool = False,
    ) -> None:
        def size(item: tuple[str, list[tuple[Put, Segment, torch.dtype]]]) -> int:
            return sum(s.length * d.itemsize for _, s, d in item[1])

        # Largest first, so no big parameter starts last while the other threads sit idle.
        by_size = sorted(by_param.items(), key=lambda item: -size(item))
        # Read from local files, decoding is CPU work: a thread or process per core. More threads
        # only hand the GIL to each other (a restore on 2 cores: 0.56x of 1 core's time on 2
        # threads, 0.64x on 8); across a network, the I/O threads keep the cores busy.
        local = getattr(self._tensors, "reads_are_local", False)
        processes = (
            forked.worth_running(sum(map(size, by_size)), knobs.cpu_threads()) if fork and local else 1
        )
        if processes > 1:
            bar = progress_bar(range(len(by_size)), desc=desc, unit="param")

            def fill(item: tuple[str, list[tuple[Put, Segment, torch.dtype]]]) -> None:
                self.fill_parameter(*item, whole=whole)

            forked.run_forked(by_size, fill, lambda: next(bar, None), processes)
            return
        with ThreadPoolExecutor(knobs.cpu_threads() if local else knobs.io_threads()) as pool:
            tasks = [pool.submit(self.fill_parameter, name, targets, whole) for name, targets in by_size]
            try:
                for task in progress_bar(as_completed(tasks), total=len(tasks), desc=desc, unit="param"):
                    task.result()
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise

    def fill_parameter(
        self, name: str, targets: list[tuple[Put, Segment, torch.dtype]], whole: bool = True
    ) -> None:
        """Read ``name``'s stored tensors once each (all of each, or with ``whole`` False only the
        span its segments cover) and put every segment that comes from them."""
        by_kind: dict[str, list[tuple[Put, Segment, torch.dtype]]] = defaultdict(list)
        for target in targets:
            by_kind[target[1].kind].append(target)
        master, master_base = None, 0
        # One kind at a time, so a task holds at most two of them: the fp32 master first, then
        # the module weight cast from it, then the rest.
        for kind in sorted(by_kind, key=lambda k: (k != FP32, k != MODULE)):
            if not whole and kind != MODULE and not (kind == FP32 and MODULE in by_kind):
                by_kind[kind] = [t for t in by_kind[kind] if not self._read_into(name, kind, *t)]
                if not by_kind[kind]:
                    continue
            segments = [segment for _, segment, _ in by_kind[kind]]
            lo = 0 if whole else min(s.source_start for s in segments)
            hi = None if whole else max(s.source_start + s.length for s in segments)
            if kind == MODULE:
                if master is None or (
                    hi is not None and (master_base > lo or master_base + master.numel() < hi)
                ):
                    master, master_base = self.tensor(name, FP32, lo, hi), lo
                source, base = self.module_weight(name, master, master_base), master_base
                master = None
            else:
                source, base = self.tensor(name, kind, lo, hi), lo
                if kind == FP32 and MODULE in by_kind:
                    master, master_base = source, base
            for put, segment, dtype in by_kind[kind]:
                if source.dtype != dtype:
                    raise CorruptError(
                        f"{name} {kind} is stored as {source.dtype}, the checkpoint needs {dtype}"
                    )
                end = segment.source_start + segment.length
                if end - base > source.numel():
                    raise CorruptError(
                        f"{name} {kind} holds {base + source.numel()} elements, {end} are needed"
                    )
                put(segment, source[segment.source_start - base : end - base])

    def _read_into(self, name: str, kind: str, put: Put, segment: Segment, dtype: torch.dtype) -> bool:
        """Decode a stored fragment that is exactly ``segment`` straight into its placeholder
        (``fill_in_memory`` only); False when none is, or the source cannot do it."""
        read_into = getattr(self._tensors, "read_into", None)
        if not isinstance(put, _CopyInto) or read_into is None or put.placeholder.dtype != dtype:
            return False
        if put.placeholder.device.type != "cpu":  # decoded on the host, then copied (``put``)
            return False
        out = put.placeholder[segment.target_start : segment.target_start + segment.length]
        return read_into(name, kind, segment.source_start, out)

    def module_weight(self, name: str, master: torch.Tensor, base: int = 0) -> torch.Tensor:
        """The flat module weight from element ``base`` on: ``master`` (those elements of the fp32
        master) cast down, overlaid with any weight stored apart."""
        fragments = self._tensors.fragments(name, WEIGHT)
        dtype, flat = DTYPES[self.params[name]["dtype"]], master.reshape(-1)
        # On this thread (``cast``): torch's own parallel cast would run on every core from
        # each of the threads filling parameters at once.
        weight = flat.clone() if fragments and flat.dtype == dtype else cast(flat, dtype)
        for start, fragment in fragments:
            first, last = max(start, base), min(start + fragment.numel(), base + weight.numel())
            if first < last:
                weight[first - base : last - base] = fragment.reshape(-1)[first - start : last - start]
        return weight

    def tensor(self, name: str, kind: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """The flat ``kind`` of ``name`` (whole, or elements ``[lo, hi)``); CorruptError if none is stored."""
        if hi is None:
            return stored_tensor(self._tensors, name, kind).reshape(-1)
        found = self._tensors.span(name, kind, lo, hi)
        if found is None:
            raise CorruptError(f"the store holds no {kind} tensor for {name}")
        return found


def _pwrite_segment(fd: int, offset: int, itemsize: int, segment: Segment, data: torch.Tensor) -> None:
    pwrite_all(fd, raw_bytes(data), offset + segment.target_start * itemsize)


class _CopyInto:
    """Puts segments into a placeholder in memory (``fill_in_memory``)."""

    def __init__(self, placeholder: torch.Tensor) -> None:
        self.placeholder = placeholder

    def __call__(self, segment: Segment, data: torch.Tensor) -> None:
        self.placeholder[segment.target_start : segment.target_start + segment.length] = data


def _zero_gaps(placeholder: torch.Tensor, segments: list[Segment]) -> None:
    # What no segment covers is padding, which a saved file holds as zeros; an engine buffer
    # or fresh memory may hold anything there.
    covered = 0
    for segment in sorted(segments, key=lambda s: s.target_start):
        if segment.target_start > covered:
            placeholder[covered : segment.target_start] = 0
        covered = max(covered, segment.target_start + segment.length)
    if covered < placeholder.numel():
        placeholder[covered:] = 0


def _sole_buffer(tensor: torch.Tensor, numel: int, dtype: torch.dtype) -> bool:
    """Whether ``tensor`` is exactly ``numel`` x ``dtype``, contiguous, alone in its storage.
    It may be on a GPU: segments are then copied into it from host memory, a parameter at a
    time, rather than the whole state put together in host memory first for the load to copy."""
    return (
        tensor.dtype == dtype
        and tensor.numel() == numel
        and tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == numel * dtype.itemsize
    )


def _storages(obj) -> set[int]:
    """The storage addresses of every tensor inside ``obj`` (dicts, lists, tuples, objects' attributes)."""
    found: set[int] = set()
    stack, seen = [obj], set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            found.add(item.untyped_storage().data_ptr())
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, type):
            stack.extend(vars(item).values())
    return found
