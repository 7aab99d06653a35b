"""The stored tensors of one step, fetched from the object store only when the writer asks.

Materializing streams: the writer asks for one parameter's tensors at a time, from several
threads, and drops them once written, so memory holds a few parameters, never the model.
A layer stored in packs (format 2) is read entry by entry: each pack's index is fetched once
(its first bytes) and kept until the last of its entries is read. A reader that reads every
entry it was built for (``readahead``: materialize, export, state_dict) from a store across a
network fetches (``readahead.ReadAhead``), at the first entry of a pack it needs, every entry of that pack it will read,
neighbours in one ranged read (``coalesce``), so a pack costs two requests however many
tensors it holds; the bytes wait, each entry's apart, until read, within
``CKPTSTORE_READAHEAD_BYTES`` (past it, entries are read one by one). Otherwise (a local store,
whose ranged reads are mapped) each tensor is one ranged read of its own bytes. Restore,
which reads only a rank's share, announces it first (``plan``) and reads ahead the same way. Every entry is verified as it is decoded, however it was
fetched. A format-1 blob that several tensors share (identical layer norms, say) is fetched
and verified once and kept only until its last user has it.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator
from functools import partial
from typing import TypeVar

import numpy as np
import torch

from .. import knobs
from ..errors import CorruptError, NotFoundError, UnsupportedError
from ..format import codec, pack
from ..format.layout import blob_name, pack_name
from ..model import FP32, NUMEL, PACK, START, TENSOR, BlobRow, LayerPacks, PackRef, TensorRow
from ..objects import ObjectStore
from .bases import DeltaBases
from .fetch import SharedFetches, entry_in_head, fetch_blob, fetch_pack_head
from .readahead import ReadAhead

T = TypeVar("T")


def _overlapping(fragments: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """The rows of a tensor's ``fragments`` that hold any of its elements ``[lo, hi)``."""
    return fragments[(fragments[:, START] < hi) & (fragments[:, START] + fragments[:, NUMEL] > lo)]


class StepReader:
    """The tensors of one step (or compose plan), read lazily: a ``TensorSource`` for the writer.

    ``packs`` are the pack indexes of every format-2 layer the step needs; ``rows`` the
    catalog's tensor rows of its format-1 layers, ``sizes`` the recorded sizes of their blobs.
    ``only``, if given, limits it to those ``(name, kind)`` tensors (the others read as absent).
    Each stored tensor is expected to be read once (``__call__`` or ``fragments``); a second
    read fetches it again. Reads raise NotFoundError (pack or blob missing) or CorruptError
    (it fails verification), naming the object, the tensor and the step it was saved at.
    """

    def __init__(
        self,
        objects: ObjectStore,
        params: dict,
        rows: Iterable[TensorRow],
        sizes: dict[str, BlobRow],
        step: int,
        packs: Iterable[LayerPacks] = (),
        only: Collection[tuple[str, str]] | None = None,
        readahead: bool = False,
    ) -> None:
        self.params = params
        self.step = step
        # A local read maps the range: one request per entry costs nothing to coalesce away.
        readahead = readahead and not objects.reads_are_local
        # Whether reads are of local files (CPU work, as decoding is) or cross a network.
        self.reads_are_local = objects.reads_are_local
        self._objects = objects
        self._sizes = sizes
        self.rows: dict[tuple[str, str], list[TensorRow]] = defaultdict(list)
        self._where: dict[str, TensorRow] = {}
        if only is not None:
            only = set(only)
            rows = [row for row in rows if (row.name, row.kind) in only]
        for row in sorted(rows, key=lambda r: r.start):
            self.rows[(row.name, row.kind)].append(row)
            self._where.setdefault(row.blob, row)
        uses = Counter(row.blob for parts in self.rows.values() for row in parts)
        self._blobs = SharedFetches(self._fetch, uses)
        # (name, kind) -> (dtype, fragment rows, the layer's index) of format-2 layers
        self._packed: dict[tuple[str, str], tuple[str, np.ndarray, LayerPacks]] = {}
        pack_uses: Counter[str] = Counter()
        # readahead: the entries this reader will read from each pack, fetched together
        self._ahead = ReadAhead(objects)
        self._pack_layer: dict[str, LayerPacks] = {}
        self._refs: dict[str, PackRef] = {}
        self._bases = DeltaBases(objects, ())
        for index in packs:
            self._bases.add(index.bases)
            read = [
                t for t, (name, kind, _) in enumerate(index.tensors) if only is None or (name, kind) in only
            ]
            by_tensor = index.by_tensor()
            for t in read:
                name, kind, _ = index.tensors[t]
                self._packed[(name, kind)] = (*by_tensor[(name, kind)], index)
            fragments = index.fragments[np.isin(index.fragments[:, TENSOR], read)]
            if readahead:
                for row in fragments:
                    self._want(index, row, *index.tensors[int(row[TENSOR])][:2])
            counts = np.bincount(fragments[:, PACK], minlength=len(index.packs))
            for ref, count in zip(index.packs, counts, strict=True):
                pack_uses[ref.key] += int(count)
                self._pack_layer[ref.key] = index
                self._refs[ref.key] = ref
        self._indexes = SharedFetches(self._fetch_index, pack_uses)
        # Readers may be many threads waiting on a network; decoding is kept to one per core.
        self._cpu = threading.BoundedSemaphore(knobs.cpu_threads())

    def plan(self, spans: Iterable[tuple[str, str, int, int]]) -> None:
        """Announce the reads to come, ``(name, kind, lo, hi)`` element ranges (a rank's share),
        before the first: from a store across a network, each pack's entries overlapping them
        are then fetched together at the first of them (readahead), as for a reader that reads
        everything. Nothing changes for a local store."""
        if self._objects.reads_are_local:
            return
        for name, kind, lo, hi in spans:
            found = self._packed.get((name, kind))
            if found is None or hi <= lo:
                continue
            _, fragments, index = found
            for row in _overlapping(fragments, lo, hi):
                self._want(index, row, name, kind)

    def objects(self, spans: Iterable[tuple[str, str, int, int]]) -> dict[str, int]:
        """The stored objects (name -> stored size) reads of ``spans`` (``plan``'s ranges) touch,
        without reading any: what a restore needs at hand (``tier.recover``)."""
        found = {}
        for name, kind, lo, hi in spans:
            if hi <= lo:
                continue
            packed = self._packed.get((name, kind))
            if packed is not None:
                _, fragments, index = packed
                for row in _overlapping(fragments, lo, hi):
                    ref = index.packs[int(row[PACK])]
                    found[pack_name(ref.key)] = ref.size
                found.update((pack_name(ref.key), ref.size) for ref in index.bases)
                continue
            for row in self.rows.get((name, kind), []):
                if row.start < hi and row.start + row.numel > lo and row.blob in self._sizes:
                    found[blob_name(row.blob)] = self._sizes[row.blob].size
        return found

    def _want(self, index: LayerPacks, row: np.ndarray, name: str, kind: str) -> None:
        """Read ahead the fragment ``row`` (of ``kind`` of ``name``) of ``index``."""
        self._ahead.want(index.packs[int(row[PACK])].key, (name, kind, int(row[START])))

    def _pack_where(self, key: str) -> str:
        index = self._pack_layer[key]
        return f"{index.layer}: rank {self._refs[key].rank}'s tensors, saved at step {index.step}"

    @contextlib.contextmanager
    def _naming(self, what: str) -> Iterator[None]:
        """Restate errors reading ``what`` (the object and whose tensors it holds) as this
        step's, naming it."""
        try:
            yield
        except NotFoundError:
            raise NotFoundError(f"{what} is missing; step {self.step} cannot be materialized") from None
        except CorruptError as exc:
            raise CorruptError(f"{what} is corrupt: {exc}; step {self.step} cannot be materialized") from None
        except UnsupportedError as exc:
            raise UnsupportedError(f"{what}: {exc}") from None

    def _read(self, read: Callable[[], bytes], decode: Callable[[bytes], T]) -> T:
        # As in fetch_blob: a local read is CPU work and holds a slot, a network read waits outside.
        if self._objects.reads_are_local:
            with self._cpu:
                return decode(read())
        data = read()
        with self._cpu:
            return decode(data)

    def _fetch_index(self, key: str) -> tuple[dict, bytes]:
        with self._naming(f"pack {key} ({self._pack_where(key)})"):
            if self._objects.reads_are_local:  # a local read is CPU work (see _read)
                with self._cpu:
                    return fetch_pack_head(self._objects, self._refs[key])
            return fetch_pack_head(self._objects, self._refs[key])

    def _packed_fragments(
        self, name: str, kind: str, lo: int = 0, hi: int | None = None
    ) -> list[tuple[int, torch.Tensor]]:
        dtype, fragments, index = self._packed[(name, kind)]
        itemsize = codec.DTYPES[dtype].itemsize
        if hi is not None:
            fragments = _overlapping(fragments, lo, hi)
        out = []
        for row in fragments:
            ref = index.packs[row[PACK]]
            head = self._indexes.get(ref.key)
            with self._naming(f"pack {ref.key} ({self._pack_where(ref.key)})"):
                entry, in_head = entry_in_head(head, name, kind, int(row[START]))
                raw_size = int(row[NUMEL]) * itemsize  # what the layer index allows the entry
                if in_head is not None:
                    with self._cpu:
                        tensor = pack.decode_entry(
                            in_head, entry, raw_size, self._objects.content_hash, self._bases.of(entry)
                        )
                else:
                    tensor = self._read(
                        partial(self._ahead.entry_bytes, ref.key, head, entry, (name, kind, int(row[START]))),
                        partial(
                            pack.decode_entry,
                            entry=entry,
                            raw_size=raw_size,
                            content_hash=self._objects.content_hash,
                            base=self._bases.of(entry),
                        ),
                    )
                if tensor.numel() != row[NUMEL]:
                    raise CorruptError(f"its {name} {kind} has {tensor.numel()} elements, not {row[NUMEL]}")
            out.append((int(row[START]), tensor))
        return out

    def _fetch(self, key: str) -> torch.Tensor:
        row = self._where[key]
        size = self._sizes.get(key)
        with self._naming(f"blob {key} ({row.layer}: {row.name} {row.kind}, saved at step {row.step})"):
            return fetch_blob(self._objects, key, self._cpu, None if size is None else size.raw_size)

    def dtype(self, name: str, kind: str) -> torch.dtype | None:
        """The dtype of the stored ``kind`` of ``name`` without reading it, or None if none is stored.

        Told from the recorded blob size: fp32 masters are float32, and a state of the module
        dtype's width has the module dtype (the writer checks the decoded dtype anyway).
        """
        if (name, kind) in self._packed:
            return codec.DTYPES[self._packed[(name, kind)][0]]
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
        if (name, kind) in self._packed:
            return [(start, tensor.reshape(-1)) for start, tensor in self._packed_fragments(name, kind)]
        return [(row.start, self._blobs.get(row.blob).reshape(-1)) for row in self.rows.get((name, kind), [])]

    def pieces(self, name: str, kind: str) -> list[tuple[int, int]] | None:
        """``(start, numel)`` of each stored fragment of ``kind`` of ``name``, in order, without
        reading any: what ``read_into`` can decode; None when it is not stored in packs."""
        found = self._packed.get((name, kind))
        if found is None:
            return None
        return [(int(row[START]), int(row[NUMEL])) for row in found[1]]

    def _exact(self, name: str, kind: str, start: int, numel: int) -> tuple[str, str] | None:
        """(stored dtype name, pack key) of the one stored fragment of ``kind`` of ``name`` that is
        exactly elements ``[start, start + numel)``, or None."""
        found = self._packed.get((name, kind))
        if found is None:
            return None
        dtype, fragments, index = found
        match = fragments[(fragments[:, START] == start) & (fragments[:, NUMEL] == numel)]
        return (dtype, index.packs[match[0][PACK]].key) if len(match) == 1 else None

    def _entry(
        self, key: str, head: tuple, name: str, kind: str, start: int
    ) -> tuple[pack.Entry, bytes | memoryview]:
        """The entry of pack ``key`` (its ``head``) for the fragment from ``start``, and its bytes."""
        entry, data = entry_in_head(head, name, kind, start)
        return entry, self._ahead.entry_bytes(key, head, entry, (name, kind, start)) if data is None else data

    def read_into(self, name: str, kind: str, start: int, out: torch.Tensor) -> bool:
        """Decode the stored fragment of ``kind`` of ``name`` that is exactly elements
        ``[start, start + out.numel())`` straight into ``out`` (contiguous; cast when of another
        floating dtype, see ``codec.decode_into``), verified; False
        (nothing read) when no stored fragment is exactly that. Saves a copy of a rank's own share."""
        found = self._exact(name, kind, start, out.numel())
        if found is None:
            return False
        key = found[1]
        head = self._indexes.get(key)  # names what fails itself
        with self._naming(f"pack {key} ({self._pack_where(key)})"):
            entry, data = self._entry(key, head, name, kind, start)
            with self._cpu:
                pack.decode_entry_into(data, entry, out, self._objects.content_hash, self._bases.of(entry))
        return True

    def read_pieces(
        self, name: str, kind: str, start: int, numel: int, dtype: torch.dtype
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """Decode the stored fragment of ``kind`` of ``name`` that is exactly elements ``[start,
        start + numel)`` a piece at a time, as ``(first element in the tensor, 1-D tensor)`` of
        ``dtype`` (cast when another floating dtype), in memory reused for the next piece
        (``codec.decode_pieces``), verified once the last is out; CorruptError when no one
        stored fragment is exactly that. A decoding slot is held while the pieces are taken."""
        found = self._exact(name, kind, start, numel)
        if found is None:
            raise CorruptError(f"step {self.step}: {name} {kind} has no one stored fragment of "
                               f"elements {start} to {start + numel}")  # fmt: skip
        stored, key = found
        raw_size = numel * codec.DTYPES[stored].itemsize  # what the layer index allows the entry
        head = self._indexes.get(key)  # names what fails itself
        with self._naming(f"pack {key} ({self._pack_where(key)})"):
            entry, data = self._entry(key, head, name, kind, start)
            with self._cpu:
                for first, piece in pack.decode_entry_pieces(
                    data, entry, dtype, raw_size, self._objects.content_hash, self._bases.of(entry)
                ):
                    yield start + first, piece

    def span(self, name: str, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        """Elements ``[lo, hi)`` of the flattened ``kind`` of ``name``, reading only the stored
        fragments that overlap them (what one rank's partition needs), or None if none is stored.
        CorruptError if the stored fragments leave a gap in the range."""
        if (name, kind) in self._packed:
            fragments = self._packed_fragments(name, kind, lo, hi)
        else:
            rows = [r for r in self.rows.get((name, kind), []) if r.start < hi and r.start + r.numel > lo]
            fragments = [(r.start, self._blobs.get(r.blob).reshape(-1)) for r in rows]
        if not fragments:
            return None if hi > lo else torch.empty(0, dtype=self.dtype(name, kind))
        if len(fragments) == 1 and fragments[0][0] <= lo and fragments[0][0] + fragments[0][1].numel() >= hi:
            start, fragment = fragments[0]  # one fragment holds it all (a rank's own share): no copy
            return fragment.reshape(-1)[lo - start : hi - start]
        out = torch.empty(hi - lo, dtype=fragments[0][1].dtype)
        covered = 0
        for start, fragment in fragments:
            flat = fragment.reshape(-1)
            first, last = max(lo, start), min(hi, start + flat.numel())
            out[first - lo : last - lo] = flat[first - start : last - start]
            covered += last - first
        if covered != hi - lo:
            raise CorruptError(f"stored fragments of {name} {kind} cover {covered} of elements {lo}..{hi}")
        return out

    def __call__(self, name: str, kind: str) -> torch.Tensor | None:
        """The whole ``kind`` of ``name`` in its own shape, assembled from its fragments, or None."""
        parts = self.rows.get((name, kind), [])
        if (name, kind) in self._packed:
            fragments = self._packed_fragments(name, kind)
            if not fragments:
                return None
            return self._assemble(name, kind, fragments)
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
        return self._assemble(name, kind, fragments)

    def _assemble(self, name: str, kind: str, fragments: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        if len(fragments) == 1 and fragments[0][0] == 0:
            whole = fragments[0][1]
            shape = self.params[name]["shape"] if name in self.params else list(whole.shape)
            if whole.numel() == math.prod(shape):
                return whole.reshape(shape)
        shape = self.params[name]["shape"] if name in self.params else [sum(f.numel() for _, f in fragments)]
        numel = math.prod(shape)
        # Checked before allocating: the shape is the description's, and must be what is stored.
        covered = 0
        for start, fragment in fragments:
            if start != covered:
                raise CorruptError(
                    f"fragments of {name} {kind} do not tile the tensor (gap or overlap at {covered})"
                )
            covered += fragment.numel()
        if covered != numel:
            raise CorruptError(f"fragments of {name} {kind} cover {covered} of {numel} elements")
        full = torch.empty(numel, dtype=fragments[0][1].dtype)
        for start, fragment in fragments:
            full[start : start + fragment.numel()] = fragment.reshape(-1)
        return full.reshape(shape)
