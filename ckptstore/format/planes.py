"""Byte planes: the bytes of every element regrouped by position (plane ``i`` holds byte ``i``
of each), compressed plane by plane, and joined back into elements a cache-sized chunk at a
time, hashed and cast on the way (``codec``'s ZSTD_PLANES payload)."""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator

import numpy as np
import torch

from .. import knobs
from ..errors import CorruptError
from ..hashing import Digest
from . import zstd
from .cast import SERIAL_ELEMENTS

# A plane is compressed only if zstd shrinks a sample of it below this fraction.
_PLANE_SAMPLE = 1 << 16
# Elements a decode joins from byte planes at a time: 512 KiB of fp32 and its two 16-bit halves
# fit a core's L2 cache (64 Ki elements were 20% faster to join, hash and cast than 32 Ki, 2x
# faster than a whole tensor at once), cast in two of ``cast_into``'s copies.
CHUNK = 2 * SERIAL_ELEMENTS

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


def read_planes(
    payload: memoryview, itemsize: int, count: int, staging: np.ndarray | None
) -> Iterator[np.ndarray]:
    """The ``itemsize`` byte planes of a ZSTD_PLANES payload of ``count`` elements, in byte
    order (plane 0 holds every element's first byte), one by one: views of ``payload`` where
    stored raw, decompressed where not, plane ``i`` into ``staging[i * count :]`` (None: new
    memory, the caller's to drop before taking the next). CorruptError, once the last is
    taken, if the payload does not hold exactly that."""
    offset = 0
    for i in range(itemsize):
        compressed, length = struct.unpack_from("<BQ", payload, offset)
        offset += 9
        data = payload[offset : offset + length]
        if len(data) != length:
            raise CorruptError("blob payload is truncated inside a byte plane")
        offset += length
        if compressed and staging is not None:
            plane = staging[i * count : (i + 1) * count]
            zstd.unzstd_into(data, plane)
        else:
            plane = np.frombuffer(
                zstd.unzstd(data, count, "a byte plane") if compressed else data, dtype=np.uint8
            )
        if plane.size != count:
            raise CorruptError(f"a byte plane holds {plane.size} bytes, expected {count}")
        yield plane
    if offset != len(payload):
        raise CorruptError("blob payload has trailing bytes after its last byte plane")


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
    staged = None if same else torch.from_numpy(memory.reshape(-1)).view(dtype)
    for start in range(0, count, CHUNK):
        end = min(count, start + CHUNK)
        chunk = target[start:end] if same else memory[: end - start]
        _join_chunk([plane[start:end] for plane in planes], chunk, low, high)
        if digest is not None:
            digest.update(chunk)
        if not same:  # cast_into's copies, without its checks and views every chunk
            for first in range(start, end, SERIAL_ELEMENTS):
                last = min(end, first + SERIAL_ELEMENTS)
                out[first:last].copy_(staged[first - start : last - start])


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
