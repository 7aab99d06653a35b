"""Tensor <-> blob bytes, and the content key of a tensor.

Blob layout (format version 1, all integers little-endian)::

    b"CKPB"  u8 version  u8 codec  u8 len(dtype)  dtype (ascii)
    u8 ndim  ndim x u64 shape  u64 raw_size  payload

``codec`` is RAW (payload = the tensor bytes), ZSTD, ZSTD_GROUPED (the bytes of every
element regrouped by significance, then one zstd frame), or ZSTD_PLANES: the same regrouping,
one *plane* per byte position, each stored as ``u8 compressed? u64 length data``. Exponent
planes of floats are alike and compress well; low mantissa planes are noise, and a sample
tells which is which, so noise is stored raw without spending time compressing it.
The key is the store's content hash (``format.hashing``: xxh3-128, or keyed BLAKE3 with a key)
of the dtype, the shape and the *uncompressed* bytes, so it does not depend on the codec, and
every decode re-hashes and compares.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from .. import knobs
from ..errors import CorruptError, UnsupportedError
from ..hashing import PLAIN, ContentHash
from .config import check_version

MAGIC = b"CKPB"
FORMAT_VERSION = 1
RAW, ZSTD, ZSTD_GROUPED, ZSTD_PLANES = 0, 1, 2, 3
CODECS = (RAW, ZSTD, ZSTD_GROUPED, ZSTD_PLANES)
# A plane is compressed only if zstd shrinks a sample of it below this fraction.
_PLANE_SAMPLE = 1 << 16

# Only plain numeric dtypes ever become blobs; anything else is refused rather than guessed.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip

_local = threading.local()


@dataclass(frozen=True)
class BlobInfo:
    """What a blob header says: codec, dtype, shape and uncompressed size."""

    codec: int
    dtype: str
    shape: tuple[int, ...]
    raw_size: int
    header_size: int


def dtype_name(dtype: torch.dtype) -> str:
    """The name ckptstore records for a torch dtype; raises UnsupportedError for exotic ones."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise UnsupportedError(f"tensors of dtype {dtype} cannot be stored")
    return name


def raw_bytes(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes in C order as a uint8 array (a view when already contiguous on CPU)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensor_key(tensor: torch.Tensor, raw: np.ndarray | None = None, content_hash: ContentHash = PLAIN) -> str:
    """The content key: 32 hex digits of ``content_hash`` (the store's) over dtype, shape and raw bytes."""
    if raw is None:
        raw = raw_bytes(tensor)
    digest = content_hash.digest()
    digest.update(f"{dtype_name(tensor.dtype)}:{tuple(tensor.shape)}:".encode())
    digest.update(raw)
    return digest.hexdigest()


def _compressor(planes: bool = False) -> zstandard.ZstdCompressor:
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


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor


def _header(codec: int, dtype: str, shape: tuple[int, ...], raw_size: int) -> bytes:
    name = dtype.encode("ascii")
    return b"".join(
        [
            MAGIC,
            struct.pack("<BBB", FORMAT_VERSION, codec, len(name)),
            name,
            struct.pack(f"<B{len(shape)}Q", len(shape), *shape),
            struct.pack("<Q", raw_size),
        ]
    )


def encode(
    tensor: torch.Tensor, key: str | None = None, content_hash: ContentHash = PLAIN
) -> tuple[str, bytes]:
    """Encode a tensor as ``(key, blob bytes)``: ``encode_parts`` joined into one bytes object."""
    key, parts = encode_parts(tensor, key, content_hash)
    return key, b"".join(parts)


def encode_parts(
    tensor: torch.Tensor, key: str | None = None, content_hash: ContentHash = PLAIN
) -> tuple[str, list]:
    """Encode a tensor as ``(key, buffers)``: the blob is the buffers laid end to end.

    The payload is zstd-compressed (byte-grouped for multi-byte elements) unless compression
    saves too little to be worth the decode time, in which case the raw bytes are stored.
    ``key``: the tensor's ``tensor_key``, when the caller has just computed it (not hashed again;
    else it is hashed with ``content_hash``). The parts are written as they are (``os.writev``): joining them would copy every blob
    once more, holding the GIL.
    """
    dtype = dtype_name(tensor.dtype)
    raw = raw_bytes(tensor)
    key = tensor_key(tensor, raw, content_hash) if key is None else key
    shape = tuple(tensor.shape)
    itemsize = tensor.element_size()
    payload, codec = [raw], RAW
    if raw.size and itemsize > 1:
        packed = _encode_planes(_split_planes(raw, itemsize))
        if sum(len(part) for part in packed) < raw.size * knobs.min_compress_ratio():
            payload, codec = packed, ZSTD_PLANES
    elif raw.size:
        packed = _compressor().compress(raw)
        if len(packed) < raw.size * knobs.min_compress_ratio():
            payload, codec = [packed], ZSTD
    return key, [_header(codec, dtype, shape, raw.size), *payload]


def _split_planes(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """The bytes of every element regrouped by position: row ``i`` holds byte ``i`` of each."""
    words = raw.view(f"<u{itemsize}")  # little-endian: byte 0 in memory is the low byte
    planes = np.empty((itemsize, words.size), dtype=np.uint8)
    for i, plane in enumerate(planes):
        # A plane is the words shifted right and cut to their low byte, one contiguous pass
        # each: for bf16 3.5x faster than gathering every byte at a stride of 2 (``.T.copy()``).
        np.right_shift(words, 8 * i, out=plane, casting="unsafe")
    return planes


def _encode_planes(planes: np.ndarray) -> list[bytes | np.ndarray]:
    parts = []
    ratio = knobs.min_compress_ratio()
    compressor = _compressor(planes=True)
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


def _unzstd(frame: memoryview, size: int, what: str) -> bytes:
    """Decompress exactly one zstd frame that must hold ``size`` bytes.

    One-shot decompression releases the GIL (a ``decompressobj`` holds it), so decoding
    threads run in parallel. The declared size is checked first: a damaged header must not
    make it allocate whatever the frame claims.
    """
    declared = zstandard.frame_content_size(frame)
    if declared not in (-1, size):
        raise CorruptError(f"{what}'s zstd frame declares {declared} bytes, expected {size}")
    return _decompressor().decompress(frame, max_output_size=size, allow_extra_data=False)


def _decode_planes(payload: memoryview, itemsize: int, raw_size: int, out: np.ndarray) -> None:
    count = raw_size // itemsize
    elements = out.reshape(count, itemsize)
    pair = []
    offset = 0
    for i in range(itemsize):
        compressed, length = struct.unpack_from("<BQ", payload, offset)
        offset += 9
        data = payload[offset : offset + length]
        if len(data) != length:
            raise CorruptError("blob payload is truncated inside a byte plane")
        offset += length
        if compressed:
            data = _unzstd(data, count, "a byte plane")
        plane = np.frombuffer(data, dtype=np.uint8)
        if plane.size != count:
            raise CorruptError(f"a byte plane holds {plane.size} bytes, expected {count}")
        if itemsize == 2:
            pair.append(plane)
        else:
            elements[:, i] = plane  # plane by plane: one decompressed plane held at a time
    if offset != len(payload):
        raise CorruptError("blob payload has trailing bytes after its last byte plane")
    if pair:
        # bf16 and fp16: the two planes become 16-bit words in two contiguous passes (high
        # byte << 8, then | low byte), 2.5x faster than storing every byte at a stride of 2,
        # which was most of a bf16 decode. Four and eight byte elements gain nothing this way
        # (the wider shifts need temporaries as large as the tensor), so they keep the strided
        # store. "<u2": plane 0 is the first byte in memory, whatever the host's byte order.
        words = out.view("<u2")
        np.left_shift(pair[1], 8, out=words, dtype=words.dtype)
        np.bitwise_or(words, pair[0], out=words)


def parse_header(blob: bytes | memoryview) -> BlobInfo:
    """Read and validate a blob header; raises CorruptError on anything malformed."""
    view = memoryview(blob)
    try:
        if bytes(view[:4]) != MAGIC:
            raise CorruptError("not a ckptstore blob (bad magic)")
        version, codec, name_len = struct.unpack_from("<BBB", view, 4)
        check_version("blob", version, FORMAT_VERSION)
        if codec not in CODECS:
            raise CorruptError(f"unknown blob codec {codec}")
        offset = 7
        dtype = bytes(view[offset : offset + name_len]).decode("ascii")
        offset += name_len
        if dtype not in DTYPES:
            raise CorruptError(f"unknown dtype {dtype!r} in blob header")
        (ndim,) = struct.unpack_from("<B", view, offset)
        shape = struct.unpack_from(f"<{ndim}Q", view, offset + 1)
        offset += 1 + 8 * ndim
        (raw_size,) = struct.unpack_from("<Q", view, offset)
        offset += 8
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptError(f"truncated or malformed blob header: {exc}") from None
    numel = 1
    for dim in shape:
        numel *= dim
    if numel * DTYPES[dtype].itemsize != raw_size:
        raise CorruptError(f"blob header is inconsistent: shape {shape} of {dtype} is not {raw_size} bytes")
    return BlobInfo(codec, dtype, tuple(shape), raw_size, offset)


def check_raw_size(info: BlobInfo, raw_size: int | None) -> None:
    """Refuse a header declaring other than ``raw_size`` bytes (what the blob's referrer
    records: the catalog's size row, or the element count the layer index gives the entry).

    A header is the blob's own claim: a few bytes of zstd can declare a gigabyte of zeros, so
    nothing is allocated for it until whoever points at the blob has agreed on its size.
    """
    if raw_size is not None and info.raw_size != raw_size:
        raise CorruptError(f"blob header declares {info.raw_size} bytes, its referrer records {raw_size}")


def decode(
    blob: bytes | memoryview,
    key: str | None = None,
    raw_size: int | None = None,
    content_hash: ContentHash = PLAIN,
) -> torch.Tensor:
    """Decode blob bytes into a tensor; when ``key`` is given, verify that the content hashes
    to it by ``content_hash`` (the store's).

    ``raw_size``: the uncompressed size the blob's referrer records; the header must declare
    exactly that before anything is allocated (``check_raw_size``). Without it a RAW blob is
    still held to its payload's length, but a compressed one is trusted up to its header.
    Raises CorruptError if the bytes are malformed, the payload does not decompress to the
    recorded size, or the content does not hash to ``key``.
    """
    info = parse_header(blob)
    check_raw_size(info, raw_size)
    payload = memoryview(blob).nbytes - info.header_size
    if info.codec == RAW and payload != info.raw_size:
        raise CorruptError(f"blob payload holds {payload} bytes, header says {info.raw_size}")
    tensor = torch.empty(info.shape, dtype=DTYPES[info.dtype])
    decode_into(blob, key, tensor, content_hash)
    return tensor


def decode_into(
    blob: bytes | memoryview, key: str | None, out: torch.Tensor, content_hash: ContentHash = PLAIN
) -> None:
    """Decode blob bytes straight into ``out`` (contiguous, of the blob's dtype and element
    count, any shape) and, when ``key`` is given, verify them against it: ``decode`` without
    allocating.

    Raises CorruptError as ``decode`` does, and if ``out`` does not fit the blob.
    """
    info = parse_header(blob)
    payload = memoryview(blob)[info.header_size :]
    dtype = DTYPES[info.dtype]
    if out.dtype != dtype or out.numel() * dtype.itemsize != info.raw_size or not out.is_contiguous():
        raise CorruptError(
            f"blob of {info.raw_size} bytes of {info.dtype} does not fit {out.numel()} x {out.dtype}"
        )
    target = out.reshape(-1).view(torch.uint8).numpy()
    try:
        if info.codec == ZSTD_PLANES:
            _decode_planes(payload, dtype.itemsize, info.raw_size, out=target)
        else:
            raw = np.frombuffer(
                payload if info.codec == RAW else _unzstd(payload, info.raw_size, "the blob payload"),
                dtype=np.uint8,
            )
            if raw.size != info.raw_size:
                raise CorruptError(f"blob payload holds {raw.size} bytes, header says {info.raw_size}")
            target[:] = raw.reshape(dtype.itemsize, -1).T.reshape(-1) if info.codec == ZSTD_GROUPED else raw
    except (zstandard.ZstdError, struct.error) as exc:
        raise CorruptError(f"blob payload does not decode: {exc}") from None
    if key is not None and tensor_key(out.reshape(info.shape), content_hash=content_hash) != key:
        raise CorruptError(f"blob content does not hash to its key {key}")


def decompress_frame(data: bytes, max_size: int) -> bytes:
    """The content of ``data``, which must be exactly one whole zstd frame (its checksum checked
    when it has one) of at most ``max_size`` declared bytes; CorruptError otherwise."""
    try:
        declared = zstandard.frame_content_size(data)
        if declared < 0 or declared > max_size:
            raise CorruptError(f"a compressed frame declares {declared} bytes")
        stream = _decompressor().decompressobj()
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
        with _decompressor().stream_reader(data) as reader:
            return reader.read(size)
    except zstandard.ZstdError as exc:
        raise CorruptError(f"a compressed frame is damaged ({exc})") from None
