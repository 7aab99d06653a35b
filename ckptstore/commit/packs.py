"""A rank's pieces into packs: one pack per layer (cut past ``knobs.pack_bytes``), each stored once.

Format 2 stores what one rank saved of one layer as one object (``format.pack``), so a step is
ranks x layers objects however finely ZeRO-3 cuts the parameters. A pack's key follows from its
tensors' content keys alone, so an unchanged layer (frozen, or committed again) is only
hashed and its pack freshened: nothing is compressed or written.

More threads than cores run at once, so that fsyncs and uploads overlap compression, while a
semaphore of CPU slots keeps the hashing and compressing threads to one per core. Every rank
on this machine commits at the same time, so each takes its share of the slots. A pack is
streamed: each blob is appended to a spill file as it is encoded and the object is copied
from that file (``objects.FileRange``), so memory grows by a blob per slot, not by packs.
"""

from __future__ import annotations

import functools
import tempfile
import threading
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import knobs
from ..errors import storage_error
from ..format import codec, pack
from ..format.layout import pack_name
from ..layers import layer_of
from ..model import PackRef, Piece
from ..objects import FileRange, ObjectStore, data_size
from .background import lower_thread_priority, thread_niceness
from .deltas import Version, Versions

# (name, kind, dtype, start, numel) of one tensor in a pack: what the layer's index records.
Entry = tuple[str, str, str, int, int]


@dataclass
class StoredPacks:
    """What storing one rank's pieces gave: per layer its packs with their entries and the base
    packs their deltas need, and the packs this call created (key -> stored size; the others
    already existed)."""

    layers: dict[str, list[tuple[PackRef, list[Entry]]]] = field(default_factory=dict)
    created: dict[str, int] = field(default_factory=dict)
    bases: dict[str, list[PackRef]] = field(default_factory=dict)

    def object_names(self) -> dict[str, int]:
        """Every pack these pieces are in or need (object name -> stored size), created or found."""
        names = {pack_name(ref.key): ref.size for packs in self.layers.values() for ref, _ in packs}
        names.update((pack_name(ref.key), ref.size) for refs in self.bases.values() for ref in refs)
        return names

    @property
    def tensors(self) -> int:
        """How many tensors (whole or fragments) the packs hold."""
        return sum(len(entries) for packs in self.layers.values() for _, entries in packs)


def store_pieces(
    objects: ObjectStore,
    rank: int,
    pieces: list[Piece],
    *,
    background: bool = False,
    layer: Callable[[Piece], str] | None = None,
    versions: Versions | None = None,
) -> StoredPacks:
    """Store every piece that is not ``redundant`` in packs of its layer; durable when it returns.

    ``background`` (a non-blocking commit) runs the work at a lower CPU priority. ``layer``:
    a piece's layer, when the layer rule on its name (``layers.layer_of``) is not it.
    ``versions``: this rank's previous commit, to store what changed as deltas against
    (``commit.deltas``), updated to this one; None stores every piece whole. Raises what the
    object store raises (nothing is recorded anyway).
    """
    cpus = knobs.background_cpus() if background else None
    threads = knobs.cpu_threads() if cpus is None else min(knobs.cpu_threads(), len(cpus))
    slots = max(1, threads // knobs.ranks_on_this_machine())
    cpu = threading.BoundedSemaphore(slots)

    def content_key(piece: Piece) -> str | None:
        with cpu:
            return (
                None
                if piece.redundant()
                else codec.tensor_key(piece.tensor, content_hash=objects.content_hash)
            )

    def encode(members: list[tuple[Piece, str]], bases: list[Version | None], fd: int) -> tuple[bytes, int]:
        with cpu:
            return pack.spill(
                [(p.name, p.kind, p.start, p.tensor) for p, _ in members],
                [k for _, k in members],
                fd,
                [None if base is None else (base.pack, base.raw) for base in bases],
            )

    chain = knobs.delta_chain()
    fresh: dict[str, bool] = {}  # base packs found still stored (or not) by this commit

    def plan(members: list[tuple[Piece, str]]) -> list[Version | None]:
        if versions is None:
            return [None] * len(members)
        bases = [versions.plan(p, chain) for p, _ in members]
        stored = versions.freshen(objects, {b.pack for b in bases if b is not None}, fresh)
        return [b if b is not None and b.pack in stored else None for b in bases]

    def store(members: list[tuple[Piece, str]]) -> tuple[PackRef, list[Entry], bool, tuple[PackRef, ...]]:
        found = None if versions is None else versions.unchanged_pack(members)
        if found is not None and versions.freshen(objects, {found.ref.key}, fresh):
            # An unchanged layer: its pack as last committed, deltas and all (its versions stand).
            return found.ref, _entries(members), False, found.chain
        bases = plan(members)
        contents = [
            (p.name, p.kind, p.start, k) if b is None else (p.name, p.kind, p.start, k, b.pack)
            for (p, k), b in zip(members, bases, strict=True)
        ]
        key = pack.pack_key(contents, objects.content_hash)
        raw_size = sum(p.nbytes for p, _ in members)
        # Hashing is cheap, compressing is not: an existing pack is only freshened.
        size = objects.touch(pack_name(key))
        created, written = False, None
        if size is None:
            # Each blob goes to a spill file as soon as it is encoded, and the pack is copied
            # from there into its object: memory holds the blob being encoded, not the pack.
            # Encoding runs on its own threads, one per CPU slot: glibc gives each thread that
            # allocates large buffers an arena it keeps, so encoding on all the I/O threads
            # grew the process by several packs' worth (measured: 391 MB against 128 MB).
            try:
                with tempfile.TemporaryFile(dir=objects.spill_directory, buffering=0) as body:
                    head, length = encoder.submit(encode, members, bases, body.fileno()).result()
                    written = pack.parse_index(head)
                    parts = [head, FileRange(body.fileno(), 0, length)]
                    created = objects.put_if_absent(pack_name(key), parts)
                    size = data_size(parts)
            except OSError as exc:  # the spill file's disk is full, read-only, past ulimit -f
                spill = objects.spill_directory or tempfile.gettempdir()
                raise storage_error(f"spill pack {pack_name(key)} into", spill, exc) from None
        ref, used = PackRef(key, rank, size, raw_size), ()
        if versions is not None:
            used = versions.chain_of({b.pack for b in bases if b is not None})
            versions.record(ref, members, bases, written, used)
        return ref, _entries(members), created, used

    # Encoding threads are started by I/O threads, already lowered: both take the caller's level.
    initializer = functools.partial(lower_thread_priority, thread_niceness()) if background else None
    with (
        ThreadPoolExecutor(knobs.io_threads(), initializer=initializer) as pool,
        ThreadPoolExecutor(slots, initializer=initializer) as encoder,
    ):
        keyed = [(p, k) for p, k in zip(pieces, pool.map(content_key, pieces), strict=True) if k is not None]
        groups = _pack_groups(keyed, knobs.pack_bytes(), layer or (lambda piece: layer_of(piece.name)))
        # Largest first, so that no big pack starts last while the other threads sit idle.
        order = sorted(range(len(groups)), key=lambda i: -sum(p.nbytes for p, _ in groups[i][1]))
        tasks = {i: pool.submit(store, groups[i][1]) for i in order}
        stored = StoredPacks()
        for i, (layer, _) in enumerate(groups):
            ref, entries, created, bases = tasks[i].result()
            stored.layers.setdefault(layer, []).append((ref, entries))
            if bases:
                stored.bases.setdefault(layer, []).extend(bases)
            if created:
                stored.created[ref.key] = ref.size
    if versions is not None:
        versions.forget_packs_unused()
    return stored


def _entries(members: list[tuple[Piece, str]]) -> list[Entry]:
    """What the layer's index records of the pack of ``members``."""
    return [(p.name, p.kind, codec.dtype_name(p.tensor.dtype), p.start, p.tensor.numel()) for p, _ in members]


def _pack_groups(
    keyed: list[tuple[Piece, str]], limit: int, layer: Callable[[Piece], str]
) -> list[tuple[str, list[tuple[Piece, str]]]]:
    """``(layer, members)`` of every pack: each layer's pieces in name, start and kind order, cut
    where the next piece would take a pack past ``limit`` tensor bytes."""
    by_layer: dict[str, list[tuple[Piece, str]]] = defaultdict(list)
    for piece, key in keyed:
        by_layer[layer(piece)].append((piece, key))
    groups = []
    for layer, members in by_layer.items():
        members.sort(key=lambda m: (m[0].name, m[0].start, m[0].kind))
        groups += [(layer, members[part]) for part in cut_points([p.nbytes for p, _ in members], limit)]
    return groups


def cut_points(sizes: list[int], limit: int) -> list[slice]:
    """Where one layer's pack is cut: consecutive runs of ``sizes`` (tensor bytes, in pack order).

    A run ends where the next tensor would take it past ``limit``, once it holds a quarter of
    ``limit``; a shorter tail joins the run before it. So a cut pack is never small (the
    per-object costs of a store stay negligible), and past ``limit`` only by one tensor or the tail.
    """
    parts, first, total = [], 0, 0
    for i, size in enumerate(sizes):
        if total >= limit // 4 and total + size > limit:
            parts.append(slice(first, i))
            first, total = i, 0
        total += size
    if parts and total < limit // 4:
        parts[-1] = slice(parts[-1].start, len(sizes))
    else:
        parts.append(slice(first, len(sizes)))
    return parts
