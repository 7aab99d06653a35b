"""A model's weights into safetensors files: each tensor decoded, cast and written by a few
threads, or (a local store on Linux) by forked worker processes (``forked``), each taking the
next largest tensor as it gets free.

Several tensors are in flight, largest first across every file, so that one's decoding (zstd
and the hash release the GIL) overlaps another's cast and ``pwrite``. A tensor stored in packs
is decoded, cast and written a piece at a time (``codec.decode_pieces``: half a million
elements, its byte planes decompressed side by side), so a decoding thread holds a piece,
never a tensor; one read whole is cast a 4 MiB window at a time into ``Scratch`` memory, each
window written at its offset. Both memories are kept and reused from one tensor to the next
because fresh pages cost a page fault each: ~0.4 ms a MB on the 2-core bench box. Decoding
whole tensors into reused memory touched ~76 MB (19k page faults) in an 81M model's bf16
export, for the largest tensor's planes and output; in pieces, a few MB.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

from .. import forked, knobs
from ..format import planes
from ..format.cast import cast_into
from ..model import BUFFER, Weight
from .safetensors_file import SafetensorsFile, tensor_bytes
from .weights import StepWeights

# The window a tensor read whole is cast in.
_CAST_WINDOW = 4 << 20


class Scratch:
    """Memory for the tensors in flight: one arena of ``budget`` bytes, handed out in pieces
    (lowest address first, so the pages touched stay few) and taken back, for reuse, at the
    end of each ``take``. A tensor that needs more than the whole arena waits until nothing
    is in use and gets an arena of its own size."""

    def __init__(self, budget: int) -> None:
        self._size = _aligned(max(budget, 1))
        self._arena: torch.Tensor | None = None  # allocated at the first take
        self._free = [(0, self._size)]  # (start, end) of each free piece, in order
        self._in_use = 0
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def take(self, nbytes: int) -> Iterator[torch.Tensor]:
        """``nbytes`` of memory (uint8, 64-byte aligned) until the block ends; waits for room."""
        size = _aligned(max(nbytes, 1))
        with self._changed:
            while (start := self._carve(size)) is None:
                if size > self._size and self._in_use == 0:
                    self._size, self._arena, self._free = size, None, [(0, size)]
                else:
                    self._changed.wait()
            self._in_use += 1
            if self._arena is None:
                self._arena = torch.empty(self._size, dtype=torch.uint8)  # pages come as touched
            arena = self._arena
        try:
            yield arena[start : start + nbytes]
        finally:
            with self._changed:
                self._in_use -= 1
                if arena is self._arena:
                    self._give_back(start, start + size)
                self._changed.notify_all()

    def _carve(self, size: int) -> int | None:
        for i, (start, end) in enumerate(self._free):
            if end - start >= size:
                if end - start == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, end)
                return start
        return None

    def _give_back(self, start: int, end: int) -> None:
        i = bisect.bisect(self._free, (start, end))
        if i < len(self._free) and self._free[i][0] == end:  # joins the piece after it
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:  # and the piece before it
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64


class _Files:
    """The output files, each opened at its first tensor and closed after its last."""

    def __init__(self, layouts: dict[Path, dict], metadata: dict[str, str]) -> None:
        self._layouts = layouts
        self._metadata = metadata
        self._left = {path: len(layout) for path, layout in layouts.items()}
        self._open: dict[Path, SafetensorsFile] = {}
        self._lock = threading.Lock()

    def get(self, path: Path) -> SafetensorsFile:
        with self._lock:
            if path not in self._open:
                self._open[path] = SafetensorsFile(path, self._layouts[path], self._metadata)
            return self._open[path]

    def done(self, path: Path) -> None:
        with self._lock:
            self._left[path] -= 1
            if self._left[path] == 0:
                self._open.pop(path).close()

    def close(self) -> None:
        with self._lock:
            for file in self._open.values():
                file.close()
            self._open.clear()


def write_files(
    files: dict[Path, dict[str, tuple[tuple[int, ...], torch.dtype]]],
    metadata: dict[str, str],
    entries: dict[str, Weight],
    weights,
    dtype: torch.dtype,
    buffers: dict[str, torch.Tensor],
    bar,
    threads: int,
    processes: int = 1,
) -> None:
    """Write safetensors ``files`` (path -> name -> (shape, dtype), the header's order) with the
    tensors of ``entries`` (name -> Weight) read from ``weights`` (``StepWeights`` or
    ``DcpStepWeights``), floating point ones cast to ``dtype``, or taken from ``buffers``, on
    ``threads`` threads, or, ``processes`` > 1, in that many forked processes of one thread
    each (``forked.run_forked``: only for a store whose reads are local files). ``next(bar)``
    as each is written. Raises what reading raises (NotFoundError, CorruptError)."""
    stored = {
        name: weights.stored_dtype(weight) if isinstance(weights, StepWeights) else None
        for name, weight in entries.items()
        if weight.kind != BUFFER
    }
    # Only tensors read whole (not from packs) are cast through scratch memory, a window each.
    needs = [
        min(tensor_bytes(entries[name].shape, dtype), _CAST_WINDOW) for name in stored if stored[name] is None
    ]
    per_process = 1 if processes > 1 else knobs.cpu_threads()
    scratch = Scratch(knobs.export_buffer_bytes() or max(needs, default=1) * per_process)
    opened = _Files(files, metadata)

    def write(path: Path, name: str) -> None:
        weight, file = entries[name], opened.get(path)
        if weight.kind == BUFFER:
            file.write(name, buffers[name])
        elif stored[name] is not None:
            for start, piece in weights.read_pieces(weight, _written_dtype(stored[name], dtype)):
                file.write_part(name, start, piece)
        else:
            window = min(tensor_bytes(weight.shape, dtype), _CAST_WINDOW)
            with scratch.take(window) as memory:
                _write_whole(file, weight, weights, dtype, memory)
        opened.done(path)

    # Largest first, so no big tensor starts last while the other threads sit idle.
    tasks = sorted(
        ((path, name) for path, layout in files.items() for name in layout),
        key=lambda task: -tensor_bytes(*files[task[0]][task[1]]),
    )
    try:
        if processes > 1:
            for path in files:  # each worker writes into the files opened here
                opened.get(path)
            with planes.kept_memory():
                forked.run_forked(tasks, lambda task: write(*task), lambda: next(bar, None), processes)
            return
        with planes.kept_memory(), ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(write, path, name) for path, name in tasks]
            try:
                for future in as_completed(futures):
                    future.result()
                    next(bar, None)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
    finally:
        opened.close()


def _written_dtype(stored: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor stored as ``stored`` is exported in: ``dtype`` if both are floating."""
    return dtype if stored.is_floating_point and dtype.is_floating_point else stored


def _write_whole(
    file: SafetensorsFile, weight: Weight, weights, dtype: torch.dtype, memory: torch.Tensor
) -> None:
    """Read ``weight`` whole (a DCP step's, a format-1 blob's), cast it to ``dtype`` if floating
    point a window of ``memory`` at a time, and write it to ``file``."""
    source = weights.read(weight)
    if not source.is_floating_point() or source.dtype == dtype:
        file.write(weight.name, source)
        return
    # Cast a window at a time and write it: the cast copy of the tensor is never all in memory.
    window = memory[len(memory) - min(tensor_bytes(weight.shape, dtype), _CAST_WINDOW) :].view(dtype)
    flat = source.reshape(-1)
    for start in range(0, flat.numel(), max(window.numel(), 1)):
        part = flat[start : start + window.numel()]
        cast_into(part, window[: part.numel()])
        file.write_part(weight.name, start, window[: part.numel()])
