"""The stored tensors of one step, fetched from the object store only when the writer asks.

Materializing streams: the writer asks for one parameter's tensors at a time, from several
threads, and drops them once written, so memory holds a few parameters, never the model.
A blob that several tensors share (identical layer norms, say) is fetched and verified once
and kept only until its last user has it.
"""

from __future__ import annotations

import math
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import torch

from .. import knobs
from ..errors import CorruptError, NotFoundError, UnsupportedError
from ..format import codec
from ..format.layout import blob_name
from ..model import FP32, BlobRow, TensorRow
from ..objects import ObjectStore


def fetch_blob(objects: ObjectStore, key: str, cpu: threading.Semaphore) -> torch.Tensor:
    """The blob ``key``, fetched, decoded and verified, its CPU work done holding a ``cpu`` slot.

    Many threads may fetch while only as many as there are slots decode. A local read is a
    copy out of the page cache, CPU work like decoding, so it holds the slot too; a network
    read waits outside it. Raises NotFoundError (no such blob) or CorruptError.
    """
    if objects.reads_are_local:
        with cpu:
            return codec.decode(objects.get(blob_name(key)), key)
    data = objects.get(blob_name(key))
    with cpu:
        return codec.decode(data, key)


class _SharedBlobs:
    """Fetch-once access to decoded blobs: each key is fetched when first asked for and
    forgotten when its last expected user has it."""

    def __init__(self, fetch: Callable[[str], torch.Tensor], uses: Counter[str]) -> None:
        self._fetch = fetch
        self._uses = uses
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> torch.Tensor:
        with self._lock:
            future = self._pending.get(key)
            owner = future is None
            if owner:
                future = self._pending[key] = Future()
            self._uses[key] -= 1
            if self._uses[key] <= 0:
                del self._pending[key]
        if owner:
            try:
                future.set_result(self._fetch(key))
            except BaseException as exc:
                future.set_exception(exc)
                raise
        return future.result()


class StepReader:
    """The tensors of one step (or compose plan), read lazily: a ``TensorSource`` for the writer.

    ``rows`` are the catalog's tensor rows of every layer the step needs, ``sizes`` the
    recorded sizes of their blobs. Each stored tensor is expected to be read once (``__call__``
    or ``fragments``); a second read fetches its blobs again. Reads raise NotFoundError (blob
    missing) or CorruptError (blob fails verification), naming the blob, the tensor and the
    step it was saved at.
    """

    def __init__(
        self,
        objects: ObjectStore,
        params: dict,
        rows: Iterable[TensorRow],
        sizes: dict[str, BlobRow],
        step: int,
    ) -> None:
        self.params = params
        self.step = step
        self._objects = objects
        self._sizes = sizes
        self.rows: dict[tuple[str, str], list[TensorRow]] = defaultdict(list)
        self._where: dict[str, TensorRow] = {}
        for row in sorted(rows, key=lambda r: r.start):
            self.rows[(row.name, row.kind)].append(row)
            self._where.setdefault(row.blob, row)
        uses = Counter(row.blob for parts in self.rows.values() for row in parts)
        self._blobs = _SharedBlobs(self._fetch, uses)
        # Readers may be many threads waiting on a network; decoding is kept to one per core.
        self._cpu = threading.BoundedSemaphore(knobs.cpu_threads())

    def _fetch(self, key: str) -> torch.Tensor:
        row = self._where[key]
        where = f"{row.layer}: {row.name} {row.kind}, saved at step {row.step}"
        try:
            return fetch_blob(self._objects, key, self._cpu)
        except NotFoundError:
            raise NotFoundError(
                f"blob {key} ({where}) is missing; step {self.step} cannot be materialized"
            ) from None
        except CorruptError as exc:
            raise CorruptError(
                f"blob {key} ({where}) is corrupt: {exc}; step {self.step} cannot be materialized"
            ) from None
        except UnsupportedError as exc:
            raise UnsupportedError(f"blob {key} ({where}): {exc}") from None

    def dtype(self, name: str, kind: str) -> torch.dtype | None:
        """The dtype of the stored ``kind`` of ``name`` without reading it, or None if none is stored.

        Told from the recorded blob size: fp32 masters are float32, and a state of the module
        dtype's width has the module dtype (the writer checks the decoded dtype anyway).
        """
        parts = self.rows.get((name, kind))
        if not parts:
            return None
        if kind == FP32:
            return torch.float32
        row = next((r for r in parts if r.numel), parts[0])
        size = self._sizes.get(row.blob)
        if size is None:
            raise CorruptError(f"blob {row.blob} ({name} {kind}) has no size record in the catalog")
        itemsize = size.raw_size // max(row.numel, 1)
        module = codec.DTYPES[self.params[name]["dtype"]] if name in self.params else None
        if module is not None and module.itemsize == itemsize:
            return module
        by_width = {4: torch.float32, 8: torch.float64}
        if itemsize not in by_width:
            raise UnsupportedError(f"cannot tell the dtype of {name} {kind} ({itemsize}-byte elements)")
        return by_width[itemsize]

    def fragments(self, name: str, kind: str) -> list[tuple[int, torch.Tensor]]:
        """Stored pieces of ``kind`` of ``name`` as (start, 1-D tensor), in order."""
        return [(row.start, self._blobs.get(row.blob).reshape(-1)) for row in self.rows.get((name, kind), [])]

    def __call__(self, name: str, kind: str) -> torch.Tensor | None:
        """The whole ``kind`` of ``name`` in its own shape, assembled from its fragments, or None."""
        parts = self.rows.get((name, kind), [])
        if not parts:
            return None
        if len(parts) == 1 and parts[0].start == 0:
            whole = self._blobs.get(parts[0].blob)
            shape = self.params[name]["shape"] if name in self.params else list(whole.shape)
            if whole.numel() == math.prod(shape):
                return whole.reshape(shape)
            fragments = [(0, whole.reshape(-1))]
        else:
            fragments = self.fragments(name, kind)
        shape = self.params[name]["shape"] if name in self.params else [sum(f.numel() for _, f in fragments)]
        numel = math.prod(shape)
        full = torch.empty(numel, dtype=fragments[0][1].dtype)
        covered = 0
        for start, fragment in fragments:
            if start != covered:
                raise CorruptError(
                    f"fragments of {name} {kind} do not tile the tensor (gap or overlap at {covered})"
                )
            full[start : start + fragment.numel()] = fragment
            covered += fragment.numel()
        if covered != numel:
            raise CorruptError(f"fragments of {name} {kind} cover {covered} of {numel} elements")
        return full.reshape(shape)
