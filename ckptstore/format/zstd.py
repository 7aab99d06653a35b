"""zstd for every stored format: one compression context per thread, and decompression that
refuses whatever is not exactly the frame a referrer expects (sizes checked before allocating)."""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from .. import knobs
from ..errors import CorruptError

_local = threading.local()


def compressor(planes: bool = False) -> zstandard.ZstdCompressor:
    # zstd contexts are not safe to share between threads; one per thread, level and use.
    level = knobs.zstd_level()
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if (level, planes) not in cache:
        if planes:
            # A byte plane is nearly all literals: what zstd gains there is its entropy coding,
            # not matches. The longest minimum match and the smallest hash table make match
            # search nearly free: on fp32 exponent planes 3x faster to compress and 2x faster
            # to decompress than the plain level, and a little smaller.
            params = zstandard.ZstdCompressionParameters.from_level(level, min_match=7, hash_log=6)
            cache[(level, planes)] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[(level, planes)] = zstandard.ZstdCompressor(level=level)
    return cache[(level, planes)]


def decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def unzstd(frame: memoryview, size: int, what: str) -> bytes:
    """Decompress exactly one zstd frame that must hold ``size`` bytes.

    One-shot decompression releases the GIL (a ``decompressobj`` holds it), so decoding
    threads run in parallel. The declared size is checked first: a damaged header must not
    make it allocate whatever the frame claims.
    """
    declared = zstandard.frame_content_size(frame)
    if declared not in (-1, size):
        raise CorruptError(f"{what}'s zstd frame declares {declared} bytes, expected {size}")
    return decompressor().decompress(frame, max_output_size=size, allow_extra_data=False)


def unzstd_into(frame: memoryview, out: np.ndarray) -> None:
    """``unzstd`` of a byte plane into ``out`` (uint8, as many bytes as the plane holds).

    A ``stream_reader`` decompresses into given memory, releasing the GIL as ``decompress``
    does, so that a caller can reuse memory: the fresh bytes ``decompress`` returns cost a page
    fault per 4 KiB, most of a bf16 export's system time on the 2-core bench box. It reads on
    past the frame: bytes there fail unless they are another frame, whose content shows as
    more bytes than ``out`` holds (an empty frame passes; the content is the same, and hashed).
    """
    size = out.size
    declared = zstandard.frame_content_size(frame)
    if declared not in (-1, size):
        raise CorruptError(f"a byte plane's zstd frame declares {declared} bytes, expected {size}")
    view, done = memoryview(out), 0
    with decompressor().stream_reader(frame) as reader:
        while done < size and (got := reader.readinto(view[done:])):
            done += got
        if done != size or reader.read(1):
            raise CorruptError(f"a byte plane's zstd frame holds other than the {size} bytes expected")


def decompress_frame(data: bytes, max_size: int) -> bytes:
    """The content of ``data``, which must be exactly one whole zstd frame (its checksum checked
    when it has one) of at most ``max_size`` declared bytes; CorruptError otherwise."""
    try:
        declared = zstandard.frame_content_size(data)
        if declared < 0 or declared > max_size:
            raise CorruptError(f"a compressed frame declares {declared} bytes")
        stream = decompressor().decompressobj()
        content = stream.decompress(data)
    except zstandard.ZstdError as exc:
        raise CorruptError(f"a compressed frame is damaged ({exc})") from None
    if not stream.eof or stream.unused_data or len(content) != declared:
        raise CorruptError("a compressed frame is truncated or followed by other bytes")
    return content


def frame_size(data: bytes) -> int:
    """The content size the zstd frame ``data`` declares; CorruptError if it declares none."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise CorruptError(f"a compressed frame is damaged ({exc})") from None
    if declared < 0:
        raise CorruptError("a compressed frame does not declare its size")
    return declared


def peek_frame(data: bytes, size: int) -> bytes:
    """The first ``size`` bytes (fewer if the frame holds fewer) of the zstd frame ``data``,
    decompressing no more than that: how a reader checks what a frame's head declares before
    deciding how much of it may be decompressed."""
    try:
        with decompressor().stream_reader(data) as reader:
            return reader.read(size)
    except zstandard.ZstdError as exc:
        raise CorruptError(f"a compressed frame is damaged ({exc})") from None
