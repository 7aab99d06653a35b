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


class FrameReader:
    """Exactly one zstd frame of ``size`` bytes, decompressed a part at a time into given memory
    (``read_into``), then ``finish``-ed: CorruptError if it held other than ``size`` bytes.

    Its ``decompressor`` serves this one frame until ``finish``; one per frame read at a time
    (a byte plane's reader runs beside its tensor's other planes). Parts are decompressed
    through zstd's window (the frame's, 512 KiB at level 1), so a plane of any size costs that
    much memory, kept by the decompressor for its next frame, never the plane's size.
    """

    def __init__(self, frame: memoryview, size: int, decompressor: zstandard.ZstdDecompressor) -> None:
        declared = zstandard.frame_content_size(frame)
        if declared not in (-1, size):
            raise CorruptError(f"a byte plane's zstd frame declares {declared} bytes, expected {size}")
        self._size, self._done = size, 0
        self._reader = decompressor.stream_reader(frame)

    def read_into(self, out: np.ndarray) -> None:
        """The frame's next ``out.size`` bytes into ``out`` (uint8, contiguous); CorruptError if
        the frame ends first. zstd runs without the GIL (a ``decompressobj`` holds it)."""
        view, done = memoryview(out).cast("B"), 0
        while done < len(view) and (got := self._reader.readinto(view[done:])):
            done += got
        self._done += done
        if done != len(view):
            raise CorruptError(f"a byte plane's zstd frame holds {self._done} bytes, expected {self._size}")

    def finish(self) -> None:
        """Check that the frame held exactly its ``size`` bytes, and ``close``. What follows the
        frame fails to decompress unless it is another frame, whose content is then one byte
        too many (an empty one passes: the content is the same, and hashed)."""
        try:
            if self._done != self._size or self._reader.read(1):
                raise CorruptError(
                    f"a byte plane's zstd frame holds other than the {self._size} bytes expected"
                )
        finally:
            self.close()

    def close(self) -> None:
        """Let the decompressor go (unread bytes are left unchecked)."""
        self._reader.close()
