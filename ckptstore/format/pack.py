"""Packs: many tensors in one object, each readable on its own (the building block of format 2).

A ZeRO-3 job stores every parameter split across every rank: one object per fragment is a
million objects a step at 70B on 512 ranks. A pack holds one rank's fragments of one layer, so
a step has ranks x layers objects. Layout (integers little-endian)::

    b"CKPK"  u8 version  u32 len(index)  index  entry blob  entry blob  ...

The index is canonical JSON: ``[[name, kind, start, key, offset, length], ...]`` in entry order,
where ``key`` is the entry tensor's content key (``codec.tensor_key``) and ``offset``/``length``
place its blob (a ``codec`` blob, self-describing) in the pack, counted from the pack's first
byte. An entry stored as a delta (``codec.XOR_PLANES``) has a seventh column, its *base*: the
key of the pack holding the same tensor's (name, kind, start) previous version.
The pack's key is the store's content hash (``format.hashing``) of its *contents*, ``[[name, kind, start, key], ...]``
(``[name, kind, start, key, base]`` for a delta): equal contents make equal packs whatever
the codec made of them, so a commit knows a pack's key, and whether the store has it, before
compressing anything, and an unchanged layer is stored once. A delta's base is part of what
the key covers, so the index names bases that the pack key vouches for.

Reading one entry needs the first 9 bytes, the index, and that entry's range; every entry read
re-hashes its tensor, ``parse_index`` checks the index against the pack key, and the entries
must lie end to end from the index on.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CorruptError, clip
from ..hashing import PLAIN, ContentHash
from . import codec, layout
from .cast import cast
from .config import check_version

# Where a delta entry's base comes from: None for an entry stored whole.
Bases = Callable[["Entry"], "codec.Base | None"]

MAGIC = b"CKPK"
FORMAT_VERSION = 1
PREAMBLE = struct.Struct("<4sBI")  # magic, version, index length
# An index longer than this is not one ckptstore wrote (about 100 bytes an entry).
MAX_INDEX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Entry:
    """One tensor of a pack: ``kind`` of ``name`` from element ``start``, its content ``key``,
    and where its blob lies in the pack."""

    name: str
    kind: str
    start: int
    key: str
    offset: int
    length: int
    base: str | None = None  # the key of the pack of its base (a delta), else None

    @property
    def contents(self) -> tuple:
        """What of it the pack key covers: ``(name, kind, start, key)``, and ``base`` if any."""
        row = (self.name, self.kind, self.start, self.key)
        return row if self.base is None else (*row, self.base)


def pack_key(contents: list[tuple], content_hash: ContentHash = PLAIN) -> str:
    """The key of a pack holding ``(name, kind, start, content key)`` entries in this order
    (``(..., base pack key)`` for a delta): 32 hex digits of ``content_hash`` (the store's)
    over their canonical JSON."""
    return content_hash.key_of(json.dumps([list(c) for c in contents], separators=(",", ":")).encode())


def encode_parts(
    tensors: list[tuple[str, str, int, torch.Tensor]],
    keys: list[str] | None = None,
    content_hash: ContentHash = PLAIN,
) -> tuple[str, list, list[Entry]]:
    """Encode ``(name, kind, start, tensor)`` items as one pack: ``(key, buffers, entries)``.

    The pack is the buffers laid end to end (written without joining them, as blobs are).
    ``keys``: the tensors' content keys when the caller has them (not hashed again); the
    store's ``content_hash`` makes the others and the pack key.
    """
    keys = keys or [None] * len(tensors)
    blobs = [
        codec.encode_parts(tensor, key, content_hash)
        for (_, _, _, tensor), key in zip(tensors, keys, strict=True)
    ]
    return assemble(
        [
            (name, kind, start, key, parts)
            for (name, kind, start, _), (key, parts) in zip(tensors, blobs, strict=True)
        ],
        content_hash,
    )


def assemble(items: list[tuple], content_hash: ContentHash = PLAIN) -> tuple[str, list, list[Entry]]:
    """One pack of already encoded entries ``(name, kind, start, content key, blob buffers)``
    (``(..., base pack key, blob buffers)`` for a delta): ``(key, buffers, entries)`` as
    ``encode_parts`` returns them. Thinning a pack (``thin``) copies the entries it keeps
    this way, byte for byte."""
    sizes = [sum(memoryview(part).nbytes for part in parts) for *_, parts in items]
    contents = [tuple(item[:-1]) for item in items]
    key, head, entries = head_for(contents, sizes, content_hash)
    parts = [head]
    for *_, blob_parts in items:
        parts.extend(blob_parts)
    return key, parts, entries


def spill(
    tensors: list[tuple[str, str, int, torch.Tensor]],
    keys: list[str],
    fd: int,
    bases: list[tuple[str, np.ndarray] | None] | None = None,
) -> tuple[bytes, int]:
    """Encode ``(name, kind, start, tensor)`` items (content ``keys`` known) one at a time,
    appending each blob to the open file ``fd`` as soon as it is encoded, so memory holds one
    blob, never the whole pack: ``(head, body length)``. The pack is ``head`` followed by the
    file's first ``body length`` bytes; its key is ``pack_key`` of the contents.
    ``bases``: per item, None (stored whole) or ``(base pack key, the base's raw bytes)``:
    stored as a delta against them (``codec.encode_delta_parts``)."""
    bases = bases or [None] * len(tensors)
    sizes = []
    for (_, _, _, tensor), key, base in zip(tensors, keys, bases, strict=True):
        if base is None:
            _, parts = codec.encode_parts(tensor, key)
        else:
            _, parts = codec.encode_delta_parts(tensor, base[1], key)
        views = [memoryview(part).cast("B") for part in parts]
        sizes.append(sum(view.nbytes for view in views))
        for view in views:
            while view.nbytes:
                view = view[os.write(fd, view) :]
        del parts, views
    contents = [
        (name, kind, start, key) if base is None else (name, kind, start, key, base[0])
        for (name, kind, start, _), key, base in zip(tensors, keys, bases, strict=True)
    ]
    return _head(contents, sizes)[0], sum(sizes)


def head_for(
    contents: list[tuple], sizes: list[int], content_hash: ContentHash = PLAIN
) -> tuple[str, bytes, list[Entry]]:
    """The key (by ``content_hash``, the store's), preamble and index (``head``) and entries
    of a pack whose ``contents``' blobs of ``sizes`` bytes follow the head end to end."""
    head, entries = _head(contents, sizes)
    return pack_key(contents, content_hash), head, entries


def _head(contents: list[tuple], sizes: list[int]) -> tuple[bytes, list[Entry]]:
    # The offsets depend on the index's length, which depends on the offsets' digits: settle it.
    length = 0
    while True:
        offset = PREAMBLE.size + length
        entries = []
        for (name, kind, start, key, *base), size in zip(contents, sizes, strict=True):
            entries.append(Entry(name, kind, start, key, offset, size, *base))
            offset += size
        index = index_bytes(entries)
        if len(index) == length:
            break
        length = len(index)
    return PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(index)) + index, entries


def index_bytes(entries: list[Entry]) -> bytes:
    """The canonical index of ``entries`` (what follows a pack's preamble)."""
    rows = [
        [e.name, e.kind, e.start, e.key, e.offset, e.length, *([e.base] if e.base else [])] for e in entries
    ]
    return json.dumps(rows, separators=(",", ":")).encode()


def index_length(preamble: bytes | memoryview, size: int | None = None) -> int:
    """The index length a pack's first ``PREAMBLE.size`` bytes declare; refuses what is no pack,
    and an index longer than the pack's recorded ``size`` leaves room for (before it is read)."""
    if len(preamble) < PREAMBLE.size:
        raise CorruptError("truncated pack (no preamble)")
    magic, version, length = PREAMBLE.unpack_from(preamble)
    if magic != MAGIC:
        raise CorruptError("not a ckptstore pack (bad magic)")
    check_version("pack", version, FORMAT_VERSION)
    if length > MAX_INDEX_BYTES:
        raise CorruptError(f"pack index of {length} bytes is implausibly large")
    if size is not None and PREAMBLE.size + length > size:
        raise CorruptError(f"pack index of {length} bytes does not fit the pack's recorded {size} bytes")
    return length


def parse_index(
    head: bytes | memoryview,
    key: str | None = None,
    size: int | None = None,
    content_hash: ContentHash = PLAIN,
) -> list[Entry]:
    """The entries of a pack from its first bytes (preamble and index; more is ignored).

    With ``key``, the index must hash to it by ``content_hash`` (the store's); with ``size`` (the pack's stored size, as the
    layer index records it), the index and every entry must lie within that many bytes.
    Raises CorruptError for anything malformed, UnsupportedError for a pack of a newer format.
    """
    length = index_length(head, size)
    index = bytes(memoryview(head)[PREAMBLE.size : PREAMBLE.size + length])
    if len(index) != length:
        raise CorruptError("truncated pack index")
    try:
        entries = [_entry(*row) for row in json.loads(index)]
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise CorruptError(f"malformed pack index: {clip(repr(exc))}") from None
    if key is not None and pack_key([e.contents for e in entries], content_hash) != key:
        raise CorruptError(f"pack index does not hash to {key}")
    position = PREAMBLE.size + length
    for entry in entries:
        if entry.offset != position or entry.length < 0:
            raise CorruptError(f"pack entry {_named(entry)} is not where the index puts it")
        position += entry.length
    if size is not None and position > size:
        raise CorruptError(f"pack index places {position} bytes in a pack of {size}")
    return entries


def _entry(name, kind, start, tensor, offset, size, *base) -> Entry:
    """An index row as an Entry; ValueError or TypeError if it is not one."""
    # A base names an object: held to the store's one rule for names (``layout``).
    if len(base) > 1 or (
        base and not (isinstance(base[0], str) and layout.parse_pack_name(layout.pack_name(base[0])))
    ):
        raise ValueError(f"a row has a base that is no pack key: {clip(repr(base), 80)}")
    return Entry(str(name), str(kind), int(start), str(tensor), int(offset), int(size), *base)


def _named(entry: Entry) -> str:
    return clip(f"{entry.name} {entry.kind}", 120)


def decode_entry(
    data: bytes | memoryview,
    entry: Entry,
    raw_size: int | None = None,
    content_hash: ContentHash = PLAIN,
    base: codec.Base | None = None,
) -> torch.Tensor:
    """The tensor of ``entry`` from ``data``, the pack's bytes from ``entry.offset`` on (at least
    ``entry.length`` of them), verified against its content key by ``content_hash`` (the
    store's). ``raw_size``: the bytes the layer index says the entry's tensor holds (see
    ``codec.decode``); ``base``: a delta entry's base (``codec.decode``)."""
    blob = memoryview(data)[: entry.length]
    if len(blob) != entry.length:
        raise CorruptError(f"pack entry {_named(entry)} is truncated")
    try:
        return codec.decode(blob, entry.key, raw_size, content_hash, base)
    except CorruptError as exc:
        _blame_base(exc, base)
        raise type(exc)(f"pack entry {_named(entry)}: {exc}") from None  # a broken base stays one


def decode_entry_into(
    data: bytes | memoryview,
    entry: Entry,
    out: torch.Tensor,
    content_hash: ContentHash = PLAIN,
    base: codec.Base | None = None,
) -> None:
    """``decode_entry`` straight into ``out`` (see ``codec.decode_into``)."""
    blob = memoryview(data)[: entry.length]
    if len(blob) != entry.length:
        raise CorruptError(f"pack entry {_named(entry)} is truncated")
    try:
        codec.decode_into(blob, entry.key, out, content_hash, base)
    except CorruptError as exc:
        _blame_base(exc, base)
        raise


def decode_entry_pieces(
    data: bytes | memoryview,
    entry: Entry,
    dtype: torch.dtype,
    raw_size: int | None = None,
    content_hash: ContentHash = PLAIN,
    base: codec.Base | None = None,
) -> Iterator[tuple[int, torch.Tensor]]:
    """``decode_entry`` a piece at a time, cast to ``dtype`` (see ``codec.decode_pieces``); a
    delta, whole (at once)."""
    if base is not None:
        return iter([(0, cast(decode_entry(data, entry, raw_size, content_hash, base).reshape(-1), dtype))])
    blob = memoryview(data)[: entry.length]
    if len(blob) != entry.length:
        raise CorruptError(f"pack entry {_named(entry)} is truncated")
    return codec.decode_pieces(blob, entry.key, dtype, raw_size, content_hash)


def decode(
    data: bytes | memoryview,
    key: str | None = None,
    raw_size: int | None = None,
    content_hash: ContentHash = PLAIN,
    bases: Bases | None = None,
) -> list[tuple[Entry, torch.Tensor]]:
    """Every entry of a whole pack with its tensor, verified by ``content_hash`` (the store's);
    the pack must end after its last.

    ``raw_size``: the bytes of tensors the layer index records for the pack; its entries'
    headers must declare that much together before any is decoded. ``bases``: where its
    delta entries' bases come from (without it, a delta entry is CorruptError).
    """
    view = memoryview(data)
    return [
        (entry, decode_entry(view[entry.offset :], entry, None, content_hash, _base(bases, entry)))
        for entry in whole_index(view, key, raw_size, content_hash)
    ]


def check(
    data: bytes | memoryview,
    key: str,
    raw_size: int,
    content_hash: ContentHash = PLAIN,
    bases: Bases | None = None,
) -> None:
    """``decode`` for its checks alone: CorruptError unless every entry of the whole pack
    ``data`` hashes to its key and the index to ``key``, its entries declaring ``raw_size``
    bytes together (what its referrer records, checked before anything is decompressed).
    Holds one entry's tensor at a time. Without ``bases``, a delta entry's payload is held to
    its planes' layout alone: its content cannot be checked without its base."""
    view = memoryview(data)
    for entry in whole_index(view, key, raw_size, content_hash):
        blob = view[entry.offset : entry.offset + entry.length]
        if entry.base is not None and bases is None and codec.check_delta_layout(blob):
            continue
        decode_entry(blob, entry, None, content_hash, _base(bases, entry))


def _blame_base(error: CorruptError, base: codec.Base | None) -> None:
    """After a delta failed its checks, raise what is wrong with its chain of bases, if
    anything (a base that can check itself, ``materialize.bases.BaseOf``): a base is read
    unverified, and a broken one makes its delta fail, not itself."""
    check = getattr(base, "check", None)
    if check is not None and type(error) is CorruptError:
        check()


def _base(bases: Bases | None, entry: Entry) -> codec.Base | None:
    if entry.base is None:
        return None
    if bases is None:
        raise CorruptError(f"pack entry {_named(entry)} is a delta, read without its base")
    return bases(entry)


def check_layout(data: bytes | memoryview, key: str, content_hash: ContentHash = PLAIN) -> None:
    """What of the whole pack ``data`` can be checked with no size of its tensors at hand,
    decompressing nothing: its index hashes to ``key``, its entries lie end to end to its last
    byte, each behind a blob header that parses. CorruptError otherwise. Its entries'
    contents are left to a read that knows their sizes (``check``, ``decode``)."""
    view = memoryview(data)
    for entry in whole_index(view, key, None, content_hash):
        codec.parse_header(view[entry.offset : entry.offset + entry.length])


def whole_index(
    view: bytes | memoryview, key: str | None, raw_size: int | None, content_hash: ContentHash = PLAIN
) -> list[Entry]:
    """The entries of the whole pack ``view`` (``parse_index``'s checks, with ``key``), which must
    end after its last; with ``raw_size`` (what its referrer records), its entries' headers
    must declare that many bytes together. Nothing is decompressed. CorruptError otherwise."""
    view = memoryview(view)
    entries = parse_index(view, key, content_hash=content_hash)
    end = entries[-1].offset + entries[-1].length if entries else PREAMBLE.size + index_length(view)
    if len(view) != end:
        raise CorruptError(f"pack holds {len(view)} bytes, its index accounts for {end}")
    if raw_size is not None:
        declared = sum(codec.parse_header(view[e.offset : e.offset + e.length]).raw_size for e in entries)
        if declared != raw_size:
            raise CorruptError(
                f"pack entries declare {declared} bytes of tensors, its referrer records {raw_size}"
            )
    return entries
