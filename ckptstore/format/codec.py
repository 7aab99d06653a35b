"""Tensor <-> blob bytes, and the content key of a tensor.

Blob layout (format version 1, all integers little-endian)::

    b"CKPB"  u8 version  u8 codec  u8 len(dtype)  dtype (ascii)
    u8 ndim  ndim x u64 shape  u64 raw_size  payload

``codec`` is RAW (payload = the tensor bytes), ZSTD, ZSTD_GROUPED (the bytes of every
element regrouped by significance, then one zstd frame), or ZSTD_PLANES: the same regrouping,
one *plane* per byte position, each stored as ``u8 compressed? u64 length data``. Exponent
planes of floats are alike and compress well; low mantissa planes are noise, and a sample
tells which is which, so noise is stored raw without spending time compressing it.
The key is the store's content hash (``ckptstore.hashing``: xxh3-128, or keyed BLAKE3 with a
key) of the dtype, the shape and the *uncompressed* bytes, so it does not depend on the codec,
and every decode re-hashes and compares.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

from .. import knobs
from ..errors import CorruptError, UnsupportedError
from ..hashing import PLAIN, ContentHash, Digest
from .cast import SERIAL_ELEMENTS, cast_into
from .config import check_version

MAGIC = b"CKPB"
FORMAT_VERSION = 1
RAW, ZSTD, ZSTD_GROUPED, ZSTD_PLANES = 0, 1, 2, 3
CODECS = (RAW, ZSTD, ZSTD_GROUPED, ZSTD_PLANES)
# A plane is compressed only if zstd shrinks a sample of it below this fraction.
_PLANE_SAMPLE = 1 << 16
# Elements a decode joins from byte planes at a time: 512 KiB of fp32 and its two 16-bit halves
# fit a core's L2 cache (64 Ki elements were 20% faster to join, hash and cast than 32 Ki, 2x
# faster than a whole tensor at once), cast in two of ``cast_into``'s copies.
_CHUNK = 2 * SERIAL_ELEMENTS

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
    digest = _key_digest(dtype_name(tensor.dtype), tuple(tensor.shape), content_hash)
    digest.update(raw)
    return digest.hexdigest()


def _key_digest(dtype: str, shape: tuple[int, ...], content_hash: ContentHash) -> Digest:
    """The content key's hash of a tensor of ``dtype`` (its name) and ``shape``, before its bytes."""
    digest = content_hash.digest()
    digest.update(f"{dtype}:{shape}:".encode())
    return digest


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


def _unzstd_into(frame: memoryview, out: np.ndarray) -> None:
    """``_unzstd`` of a byte plane into ``out`` (uint8, as many bytes as the plane holds).

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
    with _decompressor().stream_reader(frame) as reader:
        while done < size and (got := reader.readinto(view[done:])):
            done += got
        if done != size or reader.read(1):
            raise CorruptError(f"a byte plane's zstd frame holds other than the {size} bytes expected")


def _planes(
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
            _unzstd_into(data, plane)
        else:
            plane = np.frombuffer(
                _unzstd(data, count, "a byte plane") if compressed else data, dtype=np.uint8
            )
        if plane.size != count:
            raise CorruptError(f"a byte plane holds {plane.size} bytes, expected {count}")
        yield plane
    if offset != len(payload):
        raise CorruptError("blob payload has trailing bytes after its last byte plane")


def _store_planes(planes: Iterator[np.ndarray], out: np.ndarray) -> None:
    """Store each byte plane at its place in ``out`` (uint8, elements x bytes), taking the next
    only once one is stored: one decompressed plane in memory at a time, where joining words
    (``_join_planes``) needs every one, for a quarter less time."""
    for i, plane in enumerate(planes):
        out[:, i] = plane


def _chunk_memory(itemsize: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """This thread's memory for joining a ``_CHUNK`` of elements: the elements' bytes (uint8,
    ``_CHUNK`` x ``itemsize``), and two uint16 halves. Kept from call to call: fresh memory
    costs a page fault per 4 KiB page, more than joining the chunk."""
    cache = getattr(_local, "chunks", None)
    if cache is None:
        cache = _local.chunks = {}
    if itemsize not in cache:
        cache[itemsize] = (
            np.empty((_CHUNK, itemsize), dtype=np.uint8),
            np.empty(_CHUNK, dtype="<u2"),
            np.empty(_CHUNK, dtype="<u2"),
        )
    return cache[itemsize]


def _join_planes(
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
    for start in range(0, count, _CHUNK):
        end = min(count, start + _CHUNK)
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
    blob: bytes | memoryview,
    key: str | None,
    out: torch.Tensor,
    content_hash: ContentHash = PLAIN,
    staging: torch.Tensor | None = None,
) -> None:
    """Decode blob bytes straight into ``out`` (contiguous, of the blob's element count, any
    shape) and, when ``key`` is given, verify them against it by ``content_hash`` (the
    store's): ``decode`` without allocating.
    ``out`` has the blob's dtype or, for a floating blob, another floating dtype: the tensor is
    then cast as ``Tensor.to`` casts (bit for bit), and the key checked over its stored bytes.
    ``staging``: uint8 memory of at least the blob's uncompressed size for its compressed byte
    planes, which a caller decoding many blobs reuses (fresh memory faults); None: new memory.

    Raises CorruptError as ``decode`` does, and if ``out`` does not fit the blob.
    """
    info = parse_header(blob)
    payload = memoryview(blob)[info.header_size :]
    dtype = DTYPES[info.dtype]
    count = info.raw_size // dtype.itemsize
    fits = out.dtype == dtype or (out.is_floating_point() and dtype.is_floating_point)
    if not fits or out.numel() != count or not out.is_contiguous():
        raise CorruptError(
            f"blob of {info.raw_size} bytes of {info.dtype} does not fit {out.numel()} x {out.dtype}"
        )
    digest = None if key is None else _key_digest(info.dtype, info.shape, content_hash)
    try:
        if info.codec == ZSTD_PLANES:
            if staging is not None and staging.numel() < info.raw_size:
                raise ValueError(f"staging of {staging.numel()} bytes for a blob of {info.raw_size}")
            held = None if staging is None else staging.view(-1).numpy()
            planes = _planes(payload, dtype.itemsize, count, held)
            if out.dtype == dtype and held is None and dtype.itemsize > 2:
                # Into new memory, not reused: one plane at a time (a float32 export's page
                # faults were 150 MB so, 220 MB holding all four).
                target = out.reshape(-1).view(torch.uint8).numpy()
                _store_planes(planes, target.reshape(count, dtype.itemsize))
                if digest is not None:
                    digest.update(target)
            else:
                _join_planes(list(planes), dtype, out.reshape(-1), digest)
        else:
            raw = np.frombuffer(
                payload if info.codec == RAW else _unzstd(payload, info.raw_size, "the blob payload"),
                dtype=np.uint8,
            )
            if raw.size != info.raw_size:
                raise CorruptError(f"blob payload holds {raw.size} bytes, header says {info.raw_size}")
            if info.codec == ZSTD_GROUPED:
                raw = raw.reshape(dtype.itemsize, -1).T.reshape(-1)
            if digest is not None:
                digest.update(raw)
            if out.dtype == dtype:
                out.reshape(-1).view(torch.uint8).numpy()[:] = raw
            else:  # rare (these codecs hold 1-byte, incompressible or old tensors): a copy to cast from
                cast_into(torch.from_numpy(raw.copy()).view(dtype), out)
    except (zstandard.ZstdError, struct.error) as exc:
        raise CorruptError(f"blob payload does not decode: {exc}") from None
    if digest is not None and digest.hexdigest() != key:
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
