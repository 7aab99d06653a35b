"""Pack entries a reader will read, fetched together at the first one it asks for.

From a store across a network every request costs, so a reader that knows which entries of a
pack it will read (all of a step's, or a rank's share) fetches them in coalesced ranged reads
(``fetch.coalesce``: neighbours in one request) at the first of them, and keeps each entry's
bytes apart until it is read, within ``CKPTSTORE_READAHEAD_BYTES``; past that, entries are
read one by one. Nothing is verified here: the reader decodes and checks every entry however
it was fetched.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from .. import knobs
from ..format import pack
from ..format.layout import pack_name
from ..objects import ObjectStore
from .fetch import coalesce

# An entry of a pack as a reader names it: (tensor name, kind, first element).
Which = tuple[str, str, int]


class ReadAhead:
    """The entries to read ahead, per pack, and the bytes fetched ahead until taken."""

    def __init__(self, objects: ObjectStore) -> None:
        self._objects = objects
        self._wanted: dict[str, set[Which]] = defaultdict(set)
        self._fetched: dict[tuple[str, str, str, int], bytes] = {}
        self._fetched_bytes = 0
        self._lock = threading.Lock()
        self._pack_locks: dict[str, threading.Lock] = {}

    def want(self, key: str, which: Which) -> None:
        """Read ahead the entry ``which`` of pack ``key`` (before the first read of any)."""
        self._wanted[key].add(which)
        self._pack_locks.setdefault(key, threading.Lock())

    def entry_bytes(self, key: str, head: tuple, entry: pack.Entry, which: Which) -> bytes:
        """The stored bytes of ``entry`` (``which``) of pack ``key``, whose head is ``head``:
        fetched ahead with the pack's other wanted entries, or by a ranged read of its own."""
        if key in self._pack_locks:
            # Another thread's read-ahead of this pack may be under way: its entries are there after.
            with self._pack_locks[key]:
                wanted = self._wanted.pop(key, None)
                if wanted is not None:
                    self._read_ahead(key, head, wanted)
        with self._lock:
            data = self._fetched.pop((key, *which), None)
            if data is not None:
                self._fetched_bytes -= len(data)
                return data
        return self._objects.get_range(pack_name(key), entry.offset, entry.length)

    def _read_ahead(self, key: str, head: tuple, wanted: set[Which]) -> None:
        """Fetch every entry of pack ``key`` in ``wanted`` that its head does not hold, in
        coalesced ranged reads, and keep each entry's bytes until read; nothing when they would
        take the kept bytes past ``CKPTSTORE_READAHEAD_BYTES`` (then each is read alone)."""
        index, first_bytes = head
        entries = {
            (e.offset, e.length): (which, e) for which in wanted if (e := index.get(which)) is not None
        }
        missing = sorted(
            (e for _, e in entries.values() if e.offset + e.length > len(first_bytes)), key=lambda e: e.offset
        )
        total = sum(e.length for e in missing)
        with self._lock:
            if not missing or self._fetched_bytes + total > knobs.readahead_bytes():
                return
            self._fetched_bytes += total  # reserved before the reads, so threads keep within it
        which_of = {(e.offset, e.length): which for which, e in entries.values()}
        fetched = {}
        try:
            for start, end, members in coalesce(missing):
                body = memoryview(self._objects.get_range(pack_name(key), start, end - start))
                for e in members:
                    # A copy each, so that the span is freed as its entries are read.
                    fetched[(key, *which_of[(e.offset, e.length)])] = bytes(
                        body[e.offset - start : e.offset - start + e.length]
                    )
        except BaseException:
            with self._lock:
                self._fetched_bytes -= total
            raise
        with self._lock:
            self._fetched.update(fetched)
            self._fetched_bytes -= total - sum(len(data) for data in fetched.values())
