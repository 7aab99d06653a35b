"""Where a DCP step's chunks are stored, and fetching them.

A chunk (a box of a tensor: offsets and sizes per dimension) is a pack entry of its stored name
and kind (``naming``), starting at the flat index of its first element: disjoint boxes have
distinct first elements, so that index names the chunk among its tensor's entries. Its box is
in the step's DCP metadata. A bytes item is an entry of uint8 from element 0.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..catalog import Catalog
from ..errors import CorruptError
from ..format import codec, pack
from ..format.layout import pack_name
from ..materialize.bases import DeltaBases
from ..materialize.fetch import coalesce, entry_in_head, fetch_pack_head
from ..model import NUMEL, PACK, START, PackRef
from ..objects import ObjectStore
from . import item_names


def chunk_start(offsets: Iterable[int], size: Iterable[int]) -> int:
    """The flat (row-major) index of a chunk's first element in a tensor of ``size``."""
    start, stride = 0, 1
    for offset, dim in reversed(list(zip(offsets, size, strict=True))):
        start += offset * stride
        stride *= dim
    return start


@dataclass(frozen=True)
class ChunkLocation:
    """Where one stored chunk is: the step that saved it, its layer, its pack entry's key."""

    source: int
    layer: str
    name: str
    kind: str
    start: int
    sizes: tuple[int, ...] | None  # the chunk's box; None for a bytes item


def locations(
    description: dict, sources: dict[str, int], step: int
) -> dict[tuple[str, tuple | None], ChunkLocation]:
    """Every stored chunk of a DCP step: ``(item, offsets)`` -> its location (a bytes item's
    offsets are ``None``). CorruptError if an item's layer is not one of the step's."""
    found = {}
    names = item_names(description)
    for fqn, entry in description["dcp"]["items"].items():
        if fqn not in names:
            raise CorruptError(f"step {step}: item {fqn} is not named in its description")
        name, kind, layer = names[fqn]
        if layer not in sources:
            raise CorruptError(f"step {step}: item {fqn} belongs to layer {layer}, which the step lacks")
        if entry.get("bytes"):
            found[(fqn, None)] = ChunkLocation(sources[layer], layer, name, kind, 0, None)
            continue
        for offsets, sizes in entry["chunks"]:
            start = chunk_start(offsets, entry["size"])
            found[(fqn, tuple(offsets))] = ChunkLocation(
                sources[layer], layer, name, kind, start, tuple(sizes)
            )
    return found


class ChunkFetcher:
    """The chunks of one step a reader wants: each layer's index once, each pack's head once,
    then each entry by a ranged read (unless the head holds it), verified. Thread-safe."""

    def __init__(
        self, objects: ObjectStore, catalog: Catalog, step: int, wanted: Iterable[ChunkLocation]
    ) -> None:
        self.objects, self.step = objects, step
        self.entries: dict[tuple[str, str, int], tuple[PackRef, int, str]] = {}
        self._bases = DeltaBases(objects, ())
        by_source: dict[int, set[str]] = defaultdict(set)
        for where in wanted:
            by_source[where.source].add(where.layer)
        for source, layers in by_source.items():
            for index in catalog.layer_packs(source, layers):
                self._bases.add(index.bases)
                for (name, kind), (dtype, rows) in index.by_tensor().items():
                    for row in rows:
                        ref = index.packs[int(row[PACK])]
                        self.entries[(name, kind, int(row[START]))] = (ref, int(row[NUMEL]), dtype)
        self._heads: dict[str, tuple] = {}
        self._locks: dict[str, threading.Lock] = defaultdict(threading.Lock)

    def _head(self, ref: PackRef) -> tuple:
        """The pack's index and first bytes, fetched once however many chunks it holds."""
        with self._locks[ref.key]:
            if ref.key not in self._heads:
                self._heads[ref.key] = fetch_pack_head(self.objects, ref)
            return self._heads[ref.key]

    def stored_numel(self, where: ChunkLocation) -> int:
        """Elements the layer index records for the chunk at ``where`` (0 if none holds it)."""
        found = self.entries.get((where.name, where.kind, where.start))
        return 0 if found is None else found[1]

    def pack_of(self, where: ChunkLocation) -> PackRef:
        """The pack holding the chunk at ``where``; CorruptError if none does."""
        found = self.entries.get((where.name, where.kind, where.start))
        if found is None:
            raise CorruptError(
                f"step {self.step} layer {where.layer}: no pack holds {where.name} {where.kind} "
                f"from element {where.start}"
            )
        return found[0]

    def fetch(self, where: ChunkLocation) -> torch.Tensor:
        """The chunk at ``where``, decoded and verified (see ``fetch_pack``)."""
        return self.fetch_pack(self.pack_of(where), [where])[0][1]

    def fetch_pack(
        self, ref: PackRef, wanted: list[ChunkLocation]
    ) -> list[tuple[ChunkLocation, torch.Tensor]]:
        """The chunks ``wanted`` of pack ``ref``, decoded and verified: flat for a bytes item,
        in their box otherwise. Neighbouring entries come in one ranged read, so a
        reader of a whole pack makes two requests (its head, its body; ``coalesce``). CorruptError naming
        step, layer and pack."""
        source, layer = wanted[0].source, wanted[0].layer
        try:
            head = self._head(ref)
            located = []
            for where in wanted:
                entry, data = entry_in_head(head, where.name, where.kind, where.start)
                located.append((where, entry, data))
            fetched: dict[int, memoryview] = {}
            missing = sorted(
                {entry.offset: entry for _, entry, data in located if data is None}.values(),
                key=lambda e: e.offset,
            )
            for start, end, members in coalesce(missing):
                body = memoryview(self.objects.get_range(pack_name(ref.key), start, end - start))
                for entry in members:
                    fetched[entry.offset] = body[entry.offset - start :]
            out = []
            for where, entry, data in located:
                numel, dtype = self.entries[(where.name, where.kind, where.start)][1:]
                blob = data if data is not None else fetched[entry.offset]
                out.append(
                    (
                        where,
                        self._shaped(
                            where,
                            pack.decode_entry(
                                blob,
                                entry,
                                numel * codec.DTYPES[dtype].itemsize,
                                self.objects.content_hash,
                                self._bases.of(entry),
                            ),
                        ),
                    )
                )
            return out
        except CorruptError as exc:
            raise CorruptError(
                f"step {self.step} layer {layer}: pack {ref.key} (saved at step {source}) is corrupt: {exc}"
            ) from None

    def _shaped(self, where: ChunkLocation, tensor: torch.Tensor) -> torch.Tensor:
        if where.sizes is None:
            return tensor.reshape(-1)
        if tensor.numel() != math.prod(where.sizes):
            raise CorruptError(
                f"the chunk of {where.name} {where.kind} holds {tensor.numel()} elements, its box {list(where.sizes)}"
            )
        return tensor.reshape(where.sizes)
