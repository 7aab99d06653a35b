"""The bases of delta entries: a pack entry stored as a delta (``format.pack``) is decoded
against its base, the same tensor's previous version in another pack, which may itself be a
delta against an older one. Every base pack a step needs is listed in its layer indexes
(``LayerPacks.bases``), with its recorded size, so a base is found as any entry is: its pack's
index fetched once and verified against its key, then its own bytes. Those are decoded along
the chain without hashing each level: the delta's own content key verifies what the chain
gives, and only when it does not match is the chain checked level by level, to name the base
that is broken (``BaseOf.check``). From a local store a base's bytes are one mapped range; across
a network a base pack is fetched whole at the first base wanted of it (the deltas of one pack
mostly have their bases in one pack) and kept, within ``CKPTSTORE_READAHEAD_BYTES``, for the
others: a request per base pack, not per entry.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import numpy as np

from .. import knobs
from ..errors import CorruptError, NotFoundError
from ..format import codec, pack
from ..format.layout import pack_name
from ..hashing import ContentHash
from ..model import PackRef
from ..objects import ObjectStore
from .fetch import fetch_pack_index

# No chain ckptstore writes is longer (``knobs.delta_chain`` is held below it); a longer one is
# a store that lies, read no further.
MAX_CHAIN = 64


class BaseMissing(NotFoundError):
    """A delta's base pack is missing: what is wrong is the base, not the delta's pack."""


class BaseCorrupt(CorruptError):
    """A delta's base fails its checks: what is wrong is the base, not the delta's pack."""


class BaseOf:
    """The base of one delta entry: called, its byte planes (``codec.Base``), decoded along its
    chain unverified (the delta's own key verifies what the chain gives); ``check()``, after
    that key did not match, finds which base of the chain is broken and raises BaseCorrupt
    naming it (or returns: the delta itself is)."""

    def __init__(self, bases: DeltaBases, entry: pack.Entry, depth: int) -> None:
        self._bases, self._entry, self._depth = bases, entry, depth

    def __call__(self, raw_size: int) -> np.ndarray:
        what, base, data = self._bases._found(self._entry)
        with _as_base(what):
            info = codec.parse_header(data[: base.length])
            codec.check_raw_size(info, raw_size)
            return codec.decode_planes(data[: base.length], self._bases.of(base, self._depth + 1), info)

    def check(self) -> None:
        what, base, data = self._bases._found(self._entry)
        with _as_base(what):  # verified against its key, its own base checked likewise
            pack.decode_entry(
                data, base, None, self._bases.content_hash, self._bases.of(base, self._depth + 1)
            )


class DeltaBases:
    """Where the delta entries of a step's packs find their bases: ``of(entry)`` is what
    ``pack.decode_entry`` takes as ``base``, or what ``pack.decode`` takes as ``bases``.

    ``refs``: every base pack the step's layers list. Base pack indexes are fetched once and
    kept; a base's bytes are read when a delta needs them. Errors name the base pack.
    """

    def __init__(self, objects: ObjectStore, refs: Iterable[PackRef]) -> None:
        self._objects = objects
        self._refs = {ref.key: ref for ref in refs}
        self._indexes: dict[str, dict[tuple[str, str, int], pack.Entry]] = {}
        self._lock = threading.Lock()
        # Across a network: whole base packs, least recently used first, within a budget.
        self._packs: OrderedDict[str, bytes] = OrderedDict()
        self._pack_bytes = 0
        self._budget = 0 if objects.reads_are_local else knobs.readahead_bytes()
        self._fetching: dict[str, threading.Lock] = {}

    @property
    def content_hash(self) -> ContentHash:
        """The store's content hash, that bases are verified by."""
        return self._objects.content_hash

    def add(self, refs: Iterable[PackRef]) -> None:
        """Know these base packs too (another layer's)."""
        self._refs.update((ref.key, ref) for ref in refs)

    def of(self, entry: pack.Entry, depth: int = 1) -> BaseOf | None:
        """The base of ``entry`` (None for an entry stored whole), read when called."""
        if entry.base is None:
            return None
        if depth > MAX_CHAIN:
            raise CorruptError(f"its chain of deltas is longer than {MAX_CHAIN}")
        return BaseOf(self, entry, depth)

    def _found(self, entry: pack.Entry) -> tuple[str, pack.Entry, bytes | memoryview]:
        """``(what it is, the base entry, its bytes)`` of the base of ``entry``."""
        key = entry.base
        what = f"its base, {entry.name} {entry.kind} from element {entry.start} in pack {key}"
        ref = self._refs.get(key)
        if ref is None:
            raise BaseCorrupt(f"{what}, is no base its step lists")
        with _as_base(what):
            base = self._index(ref).get((entry.name, entry.kind, entry.start))
            if base is None:
                raise CorruptError("that pack has no such entry")
            return what, base, self._bytes(ref, base)

    def _bytes(self, ref: PackRef, entry: pack.Entry) -> bytes | memoryview:
        """The bytes of ``entry`` of the base pack ``ref``."""
        if ref.size > self._budget:  # a local store, or a pack past the budget: its own range
            return self._objects.get_range(pack_name(ref.key), entry.offset, entry.length)
        return memoryview(self._whole(ref))[entry.offset : entry.offset + entry.length]

    def _whole(self, ref: PackRef) -> bytes:
        """The whole base pack ``ref``, fetched once while it stays within the budget."""
        with self._fetching_lock(ref):  # one fetch however many threads want its entries
            with self._lock:
                data = self._packs.get(ref.key)
                if data is not None:
                    self._packs.move_to_end(ref.key)
                    return data
            # No more than its recorded size is read, whatever the object holds.
            data = bytes(self._objects.get_range(pack_name(ref.key), 0, ref.size))
            if len(data) != ref.size:
                raise CorruptError(f"it holds {len(data)} bytes, its step records {ref.size}")
            with self._lock:
                self._packs[ref.key] = data
                self._pack_bytes += len(data)
                while self._pack_bytes > self._budget and len(self._packs) > 1:
                    self._pack_bytes -= len(self._packs.popitem(last=False)[1])
            return data

    def _index(self, ref: PackRef) -> dict[tuple[str, str, int], pack.Entry]:
        """The entries of the base pack ``ref`` by (name, kind, start), verified against its key."""
        with self._lock:
            found = self._indexes.get(ref.key)
        if found is not None:
            return found
        if ref.size <= self._budget:  # across a network: the pack is wanted whole anyway
            entries = pack.parse_index(self._whole(ref), ref.key, ref.size, self._objects.content_hash)
            found = {(e.name, e.kind, e.start): e for e in entries}
        else:
            with self._fetching_lock(ref):
                found = self._indexes.get(ref.key) or fetch_pack_index(self._objects, ref)
        with self._lock:
            self._indexes[ref.key] = found
        return found

    def _fetching_lock(self, ref: PackRef) -> threading.Lock:
        with self._lock:
            return self._fetching.setdefault(ref.key, threading.Lock())


@contextlib.contextmanager
def _as_base(what: str) -> Iterator[None]:
    """Errors reading a base as BaseMissing or BaseCorrupt, naming it; a base's base's pass as
    they are (named already)."""
    try:
        yield
    except (BaseMissing, BaseCorrupt):
        raise
    except NotFoundError:
        raise BaseMissing(f"{what}, is missing") from None
    except CorruptError as exc:
        raise BaseCorrupt(f"{what}: {exc}") from None
