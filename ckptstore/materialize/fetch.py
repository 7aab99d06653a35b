"""Fetching stored objects for a reader: whole blobs and packs, a pack's head (its index and
what follows it in the first read), and the byte ranges that cover several of its entries.

Every tensor fetched is verified as it is decoded; CPU work holds a slot of the caller's
semaphore, network waits do not.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..errors import CorruptError
from ..format import codec, pack
from ..format.layout import blob_name, pack_name
from ..model import PackRef
from ..objects import ObjectStore

# The first read of a pack asks for this much, which holds the index of any pack of a few
# hundred tensors; a longer index takes a second read.
_HEAD_GUESS = 64 * 1024

# Entries this close are read together (the gap is read and dropped), up to a span this long.
_GAP = 1 << 20
_SPAN = 64 << 20


def coalesce(entries: list[pack.Entry]) -> list[tuple[int, int, list[pack.Entry]]]:
    """``(start, end, entries)`` byte ranges covering ``entries`` (sorted by offset): neighbours
    within ``_GAP`` of each other share a range of at most ``_SPAN`` (or one entry's length)."""
    spans: list[tuple[int, int, list]] = []
    for entry in entries:
        end = entry.offset + entry.length
        if spans and entry.offset - spans[-1][1] <= _GAP and end - spans[-1][0] <= _SPAN:
            start, _, members = spans[-1]
            spans[-1] = (start, end, [*members, entry])
        else:
            spans.append((entry.offset, end, [entry]))
    return spans


def fetch_blob(
    objects: ObjectStore, key: str, cpu: threading.Semaphore, raw_size: int | None = None
) -> torch.Tensor:
    """The blob ``key``, fetched, decoded and verified, its CPU work done holding a ``cpu`` slot.
    ``raw_size``: its uncompressed size as the catalog records it (checked before decoding).

    Many threads may fetch while only as many as there are slots decode. A local read is a
    copy out of the page cache, CPU work like decoding, so it holds the slot too; a network
    read waits outside it. Raises NotFoundError (no such blob) or CorruptError, also when
    ``raw_size`` is None: a blob the catalog records no size of is not decoded at whatever
    size its header declares.
    """
    if raw_size is None:
        raise CorruptError(f"blob {key}: the catalog records no size to decode it within")
    if objects.reads_are_local:
        with cpu:
            return codec.decode(objects.get(blob_name(key)), key, raw_size, objects.content_hash)
    data = objects.get(blob_name(key))
    with cpu:
        return codec.decode(data, key, raw_size, objects.content_hash)


def fetch_pack(
    objects: ObjectStore,
    key: str,
    cpu: threading.Semaphore,
    raw_size: int | None = None,
    bases: pack.Bases | None = None,
) -> list[tuple[pack.Entry, torch.Tensor]]:
    """Every entry of the pack ``key`` with its tensor, all verified (``fetch_blob``'s rules);
    ``raw_size``: the bytes of tensors its layer index records (see ``pack.decode``);
    ``bases``: where its delta entries' bases come from."""
    data = objects.get(pack_name(key))
    with cpu:
        return pack.decode(data, key, raw_size, objects.content_hash, bases)


def fetch_pack_index(objects: ObjectStore, ref: PackRef) -> dict[tuple[str, str, int], pack.Entry]:
    """The entries of pack ``ref`` by (name, kind, start), from its first bytes, verified against its key."""
    return fetch_pack_head(objects, ref)[0]


def fetch_pack_head(
    objects: ObjectStore, ref: PackRef
) -> tuple[dict[tuple[str, str, int], pack.Entry], bytes]:
    """``fetch_pack_index``, plus the bytes that first read got (the index and whatever entries
    follow it within them), so that those entries need no read of their own."""
    name = pack_name(ref.key)
    head = objects.get_range(name, 0, min(ref.size, _HEAD_GUESS))
    # The recorded size bounds the index before its second read (a preamble can claim 64 MiB).
    needed = pack.PREAMBLE.size + pack.index_length(head, ref.size)
    if needed > len(head):
        head = objects.get_range(name, 0, needed)
    entries = {
        (e.name, e.kind, e.start): e for e in pack.parse_index(head, ref.key, ref.size, objects.content_hash)
    }
    return entries, head


def entry_in_head(
    head: tuple[dict[tuple[str, str, int], pack.Entry], bytes], name: str, kind: str, start: int
) -> tuple[pack.Entry, memoryview | None]:
    """The entry for the fragment of ``kind`` of ``name`` from ``start`` in a pack's index
    (``fetch_pack_head``'s answer), and its bytes when that first read already holds them."""
    entries, first_bytes = head
    entry = entries.get((name, kind, start))
    if entry is None:
        raise CorruptError(f"its index has no {name} {kind} from element {start}")
    if entry.offset + entry.length <= len(first_bytes):
        return entry, memoryview(first_bytes)[entry.offset :]
    return entry, None


class SharedFetches:
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
