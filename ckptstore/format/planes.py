"""Byte planes: the bytes of every element regrouped by position (plane ``i`` holds byte ``i``
of each), compressed plane by plane, and joined back into elements a cache-sized chunk at a
time, hashed and cast on the way (``codec``'s ZSTD_PLANES payload)."""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterator

import numpy as np
import torch
import zstandard

from .. import knobs
from ..errors import CorruptError
from ..hashing import Digest
from . import zstd
from .cast import SERIAL_ELEMENTS, copy_serially, serial_views

# A plane is compressed only if zstd shrinks a sample of it below this fraction.
_PLANE_SAMPLE = 1 << 16
# Elements a decode joins from byte planes at a time, cast in ``cast_into``'s copies. Alone, a
# thread joined, hashed and cast 64 Ki elements (fp32 and its halves fitting a core's L2 cache)
# 20% faster than 32 Ki and 2x faster than a whole tensor, and 256 Ki as fast. Beside other
# decoding threads fewer, longer numpy calls hand the GIL over less often (futex wake-ups were
# 15% of a bf16 export's CPU samples): at 256 Ki its CPU was 5-10% less, its time 6-15% less.
CHUNK = 8 * SERIAL_ELEMENTS
# Elements ``decode_pieces`` decompresses and hands out at a time: few enough that its planes'
# parts stay in cache, enough that the pwrite of each and the Python around it are few.
PIECE = 2 * CHUNK

_local = threading.local()


def split_planes(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """The bytes of every element regrouped by position: row ``i`` holds byte ``i`` of each."""
    words = raw.view(f"<u{itemsize}")  # little-endian: byte 0 in memory is the low byte
    planes = np.empty((itemsize, words.size), dtype=np.uint8)
    for i, plane in enumerate(planes):
        # A plane is the words shifted right and cut to their low byte, one contiguous pass
        # each: for bf16 3.5x faster than gathering every byte at a stride of 2 (``.T.copy()``).
        np.right_shift(words, 8 * i, out=plane, casting="unsafe")
    return planes


def encode_planes(planes: np.ndarray) -> list[bytes | np.ndarray]:
    parts = []
    ratio = knobs.min_compress_ratio()
    compressor = zstd.compressor(planes=True)
    for plane in planes:
        sample = plane[:_PLANE_SAMPLE]
        packed = None
        if len(compressor.compress(sample)) < sample.size * ratio:
            packed = compressor.compress(plane)
            if len(packed) >= plane.size * ratio:
                packed = None
        data = plane if packed is None else packed
        parts += [struct.pack("<BQ", packed is not None, len(data)), data]
    return parts


def _frames(payload: memoryview, itemsize: int, count: int) -> list[tuple[bool, memoryview]]:
    """``(compressed?, bytes)`` of each of the ``itemsize`` byte planes of a ZSTD_PLANES payload
    of ``count`` elements, in byte order; CorruptError unless the payload is exactly planes, a
    raw one of ``count`` bytes."""
    frames, offset = [], 0
    for _ in range(itemsize):
        compressed, length = struct.unpack_from("<BQ", payload, offset)
        offset += 9
        data = payload[offset : offset + length]
        if len(data) != length:
            raise CorruptError("blob payload is truncated inside a byte plane")
        if not compressed and length != count:
            raise CorruptError(f"a byte plane holds {length} bytes, expected {count}")
        offset += length
        frames.append((bool(compressed), data))
    if offset != len(payload):
        raise CorruptError("blob payload has trailing bytes after its last byte plane")
    return frames


def check_layout(payload: memoryview, itemsize: int, count: int) -> None:
    """CorruptError unless ``payload`` is laid out as ``itemsize`` planes of ``count`` elements
    (nothing is decompressed)."""
    _frames(payload, itemsize, count)


def read_planes(payload: memoryview, itemsize: int, count: int) -> Iterator[np.ndarray]:
    """The ``itemsize`` byte planes of a ZSTD_PLANES payload of ``count`` elements, in byte
    order (plane 0 holds every element's first byte), one by one: views of ``payload`` where
    stored raw, decompressed into new memory where not (the caller's to drop before taking the
    next). CorruptError if the payload does not hold exactly that (its layout is checked
    before the first plane)."""
    for compressed, data in _frames(payload, itemsize, count):
        plane = np.frombuffer(
            zstd.unzstd(data, count, "a byte plane") if compressed else data, dtype=np.uint8
        )
        if plane.size != count:
            raise CorruptError(f"a byte plane holds {plane.size} bytes, expected {count}")
        yield plane


class _Kit:
    """What one ``decode_pieces`` decodes with: a zstd decompressor per plane, the decompressed
    part of each plane, and the piece it hands out (per dtype). Kept for the next decode while
    ``kept_memory`` blocks run: fresh memory costs a page fault per 4 KiB, ~0.4 ms a MB here."""

    def __init__(self, itemsize: int) -> None:
        self.decompressors = [zstandard.ZstdDecompressor() for _ in range(itemsize)]
        self.planes = np.empty((itemsize, PIECE), dtype=np.uint8)
        self.pieces: dict[torch.dtype, torch.Tensor] = {}

    def piece(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self.pieces:
            self.pieces[dtype] = torch.empty(PIECE, dtype=dtype)
        return self.pieces[dtype]


_kits: dict[int, list[_Kit]] = {}  # idle kits by element size, while kept_memory blocks run
_kits_lock = threading.Lock()
_keepers = 0


def _unlock_in_child() -> None:
    # A forked export worker (forked) decodes too: a lock another thread of the
    # parent held at the fork would stay held in the child, by no one.
    global _kits_lock
    _kits_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_unlock_in_child)


@contextlib.contextmanager
def kept_memory() -> Iterator[None]:
    """Keep the memory ``decode_pieces`` decodes with, for the next, while the block runs (an
    export's, decoding every tensor): as many kits as decodes ran at once. Released when the
    last such block (of any thread) ends; outside any, each decode has memory of its own."""
    global _keepers
    with _kits_lock:
        _keepers += 1
    try:
        yield
    finally:
        with _kits_lock:
            _keepers -= 1
            if not _keepers:
                _kits.clear()


@contextlib.contextmanager
def _kit(itemsize: int) -> Iterator[_Kit]:
    with _kits_lock:
        idle = _kits.get(itemsize)
        kit = idle.pop() if idle else None
    kit = kit or _Kit(itemsize)
    try:
        yield kit
    finally:
        with _kits_lock:
            if _keepers:
                _kits.setdefault(itemsize, []).append(kit)


def decode_pieces(
    payload: memoryview, dtype: torch.dtype, count: int, out_dtype: torch.dtype, digest: Digest | None
) -> Iterator[tuple[int, torch.Tensor]]:
    """The ``count`` elements of ``dtype`` of a ZSTD_PLANES payload, ``PIECE`` at a time in
    element order as ``(first element, 1-D tensor)``, of ``out_dtype`` (``dtype`` or, cast as
    ``Tensor.to`` casts, another floating dtype), their bytes fed to ``digest`` when given.

    Each piece is memory reused for the next: used up before asking for it. The planes are
    decompressed side by side a piece at a time, so no plane is ever whole in memory, however
    large the tensor (a bf16 export of an 81M model touched 76 MB of fresh memory holding them).
    CorruptError, perhaps after some pieces, if the payload does not hold exactly that.
    """
    frames = _frames(payload, dtype.itemsize, count)
    with _kit(dtype.itemsize) as kit:
        readers = [
            zstd.FrameReader(data, count, kit.decompressors[i]) if compressed else None
            for i, (compressed, data) in enumerate(frames)
        ]
        raw = [None if compressed else np.frombuffer(data, dtype=np.uint8) for compressed, data in frames]
        try:
            for start in range(0, count, PIECE):
                end = min(count, start + PIECE)
                parts = []
                for i, reader in enumerate(readers):
                    if reader is None:
                        parts.append(raw[i][start:end])
                    else:
                        reader.read_into(kit.planes[i, : end - start])
                        parts.append(kit.planes[i, : end - start])
                piece = kit.piece(out_dtype)[: end - start]
                join_planes(parts, dtype, piece, digest)
                yield start, piece
            for reader in readers:
                if reader is not None:
                    reader.finish()
        finally:
            for reader in readers:
                if reader is not None:
                    reader.close()


def store_planes(planes: Iterator[np.ndarray], out: np.ndarray) -> None:
    """Store each byte plane at its place in ``out`` (uint8, elements x bytes), taking the next
    only once one is stored: one decompressed plane in memory at a time, where joining words
    (``join_planes``) needs every one, for a quarter less time."""
    for i, plane in enumerate(planes):
        out[:, i] = plane


def _chunk_memory(itemsize: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's memory for joining a ``CHUNK`` of elements: the elements' bytes (uint8,
    ``CHUNK`` x ``itemsize``), and two uint16 halves. Kept from call to call: fresh memory
    costs a page fault per 4 KiB page, more than joining the chunk."""
    cache = getattr(_local, "chunks", None)
    if cache is None:
        cache = _local.chunks = {}
    if itemsize not in cache:
        cache[itemsize] = (
            np.empty((CHUNK, itemsize), dtype=np.uint8),
            np.empty(CHUNK, dtype="<u2"),
            np.empty(CHUNK, dtype="<u2"),
        )
    return cache[itemsize]


def join_planes(
    planes: list[np.ndarray], dtype: torch.dtype, out: torch.Tensor, digest: Digest | None
) -> None:
    """Put the elements of ``dtype`` whose bytes ``planes`` hold together into ``out`` (1-D,
    contiguous, as many elements; ``dtype`` or, cast as ``Tensor.to`` casts, another floating
    dtype), feeding their bytes, in element order, to ``digest`` when given.

    A chunk at a time, so that each chunk is joined, hashed and cast while it is in the core's
    cache: joined straight into ``out`` when it has ``dtype``, else into this thread's chunk
    memory and cast from there. Exporting bf16 from fp32 masters so reads the masters' bytes
    once, and never writes them out whole.
    """
    itemsize, count = dtype.itemsize, out.numel()
    memory, low, high = _chunk_memory(itemsize)
    same = out.dtype == dtype
    target = out.view(torch.uint8).numpy().reshape(count, itemsize) if same else None
    if not same:  # cast_into's copies, without its checks, the views made once a call
        staged = _staged_views(memory, dtype)
        outs = serial_views(out)
    for start in range(0, count, CHUNK):
        end = min(count, start + CHUNK)
        chunk = target[start:end] if same else memory[: end - start]
        _join_chunk([plane[start:end] for plane in planes], chunk, low, high)
        if digest is not None:
            digest.update(chunk)
        if not same:
            first = start // SERIAL_ELEMENTS  # CHUNK is a multiple of SERIAL_ELEMENTS
            views = outs[first : first + CHUNK // SERIAL_ELEMENTS]
            sources = staged[: len(views)]
            if views[-1].numel() != SERIAL_ELEMENTS:
                sources = [*sources[:-1], sources[-1][: views[-1].numel()]]
            copy_serially(views, sources)


def _staged_views(memory: np.ndarray, dtype: torch.dtype) -> list[torch.Tensor]:
    """``serial_views`` of this thread's chunk ``memory`` read as ``dtype``, kept with it."""
    cache = _local.staged = getattr(_local, "staged", {})
    if dtype not in cache:
        cache[dtype] = serial_views(torch.from_numpy(memory.reshape(-1)).view(dtype))
    return cache[dtype]


def _join_chunk(planes: list[np.ndarray], chunk: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:
    """Fill ``chunk`` (uint8, elements x bytes, contiguous) from the byte ``planes`` of its
    elements; ``low`` and ``high``: uint16 scratch of at least as many elements.

    2- and 4-byte elements are built as little-endian words in contiguous passes (a plane
    shifted into a wider word, or-ed with the next): storing each byte at the element's
    stride was 2.5x slower for 2-byte elements, and for 4-byte ones most of a decode. Other
    widths keep the strided store; it is done a chunk at a time, in the cache, all the same.
    """
    n, itemsize = chunk.shape
    if itemsize == 2:
        words = chunk.reshape(-1).view("<u2")
        np.left_shift(planes[1], 8, out=words, dtype=words.dtype)
        np.bitwise_or(words, planes[0], out=words)
    elif itemsize == 4:
        low, high = low[:n], high[:n]
        np.left_shift(planes[1], 8, out=low, dtype=low.dtype)
        np.bitwise_or(low, planes[0], out=low)
        np.left_shift(planes[3], 8, out=high, dtype=high.dtype)
        np.bitwise_or(high, planes[2], out=high)
        words = chunk.reshape(-1).view("<u4")
        np.left_shift(high, 16, out=words, dtype=words.dtype)
        np.bitwise_or(words, low, out=words)
    else:
        for i, plane in enumerate(planes):
            chunk[:, i] = plane
