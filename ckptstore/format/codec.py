"""Tensor <-> blob bytes: the codecs, and verified decodes (the header and the content key are
``format.blobheader``'s).

``codec`` is RAW (payload = the tensor bytes), ZSTD, ZSTD_GROUPED (the bytes of every
element regrouped by significance, then one zstd frame), or ZSTD_PLANES: the same regrouping,
one *plane* per byte position, each stored as ``u8 compressed? u64 length data``. Exponent
planes of floats are alike and compress well; low mantissa planes are noise, and a sample
tells which is which, so noise is stored raw without spending time compressing it.
XOR_PLANES is a *delta*: ZSTD_PLANES of the tensor's bytes XOR those of its *base*, the same
tensor's previous version (of the same dtype and shape). The blob cannot be read without the
base: whoever points at the blob names it (``pack``: the entry's base pack), and the key is
still that of the tensor itself, so a delta decodes to exactly what a full blob would.
Every decode re-hashes the tensor and compares it with its key.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch
import zstandard

from .. import knobs
from ..errors import CorruptError
from ..hashing import PLAIN, ContentHash
from . import devicecopy, planes, zstd
from .blobheader import (  # noqa: F401 (the header's names are every codec user's too)
    CODECS,
    DTYPES,
    FORMAT_VERSION,
    MAGIC,
    RAW,
    XOR_PLANES,
    ZSTD,
    ZSTD_GROUPED,
    ZSTD_PLANES,
    BlobInfo,
    check_raw_size,
    dtype_name,
    header,
    key_digest,
    parse_header,
    raw_bytes,
    tensor_key,
)
from .cast import cast, cast_into

# A delta's base as byte planes (uint8, element size x elements: ``decode_planes``), the
# caller's to change, asked for when needed with how many bytes the delta's tensor holds: what
# the base must hold too, checked before anything is allocated for it.
Base = Callable[[int], np.ndarray]


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
    shape = tuple(tensor.shape)
    itemsize = tensor.element_size()
    size = tensor.numel() * itemsize
    # A tensor on a GPU is split into planes there and never copied to the host whole.
    device = not devicecopy.on_host(tensor)
    raw = None if device and itemsize > 1 else raw_bytes(tensor)
    key = tensor_key(tensor, raw, content_hash) if key is None else key
    payload, codec, split = None, RAW, None
    if size and itemsize > 1:
        split = devicecopy.host_planes(tensor) if device else planes.split_planes(raw, itemsize)
        packed = planes.encode_planes(split)
        if sum(len(part) for part in packed) < size * knobs.min_compress_ratio():
            payload, codec = packed, ZSTD_PLANES
    elif size:
        packed = zstd.compressor().compress(raw)
        if len(packed) < size * knobs.min_compress_ratio():
            payload, codec = [packed], ZSTD
    if payload is None:
        packed = split = None  # a GPU tensor's planes go before its bytes come to the host
        payload = [raw_bytes(tensor) if raw is None else raw]
    return key, [header(codec, dtype, shape, size), *payload]


def encode_delta_parts(
    tensor: torch.Tensor, base: np.ndarray, key: str | None = None, content_hash: ContentHash = PLAIN
) -> tuple[str, list]:
    """Encode a host tensor as a delta against ``base`` (the raw bytes of its previous version,
    of the same dtype and shape): ``(key, buffers)`` as ``encode_parts`` gives them, the key
    being the tensor's own. The XOR of two versions of a trained tensor keeps the bits that did
    not move as zeros: its sign and exponent planes compress to almost nothing."""
    dtype = dtype_name(tensor.dtype)
    raw = raw_bytes(tensor)
    if base.dtype != np.uint8 or base.size != raw.size:
        raise ValueError(f"a delta's base holds {base.size} bytes, its tensor {raw.size}")
    key = tensor_key(tensor, raw, content_hash) if key is None else key
    itemsize = tensor.element_size()
    payload = planes.encode_planes(planes.split_planes(np.bitwise_xor(raw, base), itemsize))
    return key, [header(XOR_PLANES, dtype, tuple(tensor.shape), raw.size), *payload]


def decode(
    blob: bytes | memoryview,
    key: str | None = None,
    raw_size: int | None = None,
    content_hash: ContentHash = PLAIN,
    base: Base | None = None,
) -> torch.Tensor:
    """Decode blob bytes into a tensor; when ``key`` is given, verify that the content hashes
    to it by ``content_hash`` (the store's).

    ``raw_size``: the uncompressed size the blob's referrer records; the header must declare
    exactly that before anything is allocated (``check_raw_size``). Without it a RAW blob is
    still held to its payload's length, but a compressed one is trusted up to its header.
    ``base``: where a delta's base comes from (a delta without one is CorruptError).
    Raises CorruptError if the bytes are malformed, the payload does not decompress to the
    recorded size, or the content does not hash to ``key``.
    """
    info = parse_header(blob)
    check_raw_size(info, raw_size)
    payload = memoryview(blob).nbytes - info.header_size
    if info.codec == RAW and payload != info.raw_size:
        raise CorruptError(f"blob payload holds {payload} bytes, header says {info.raw_size}")
    tensor = torch.empty(info.shape, dtype=DTYPES[info.dtype])
    decode_into(blob, key, tensor, content_hash, base)
    return tensor


def decode_into(
    blob: bytes | memoryview,
    key: str | None,
    out: torch.Tensor,
    content_hash: ContentHash = PLAIN,
    base: Base | None = None,
) -> None:
    """Decode blob bytes straight into ``out`` (contiguous, of the blob's element count, any
    shape) and, when ``key`` is given, verify them against it by ``content_hash`` (the
    store's): ``decode`` without allocating.
    ``out`` has the blob's dtype or, for a floating blob, another floating dtype: the tensor is
    then cast as ``Tensor.to`` casts (bit for bit), and the key checked over its stored bytes.
    ``base``: as for ``decode``.

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
    digest = None if key is None else key_digest(info.dtype, info.shape, content_hash)
    try:
        if info.codec in (ZSTD_PLANES, XOR_PLANES):
            # A delta's planes are XOR-ed onto its base's plane by plane and joined into
            # elements once, however long the chain: the chain's bases are not hashed on the
            # way, the tensor it gives is, against its key.
            stored = (
                planes.read_planes(payload, dtype.itemsize, count)
                if info.codec == ZSTD_PLANES
                else iter(decode_planes(blob, base, info))
            )
            if out.dtype == dtype and dtype.itemsize > 2:
                # One plane at a time into ``out`` (a float32 export's page faults were 150 MB
                # so, 220 MB holding all four).
                target = out.reshape(-1).view(torch.uint8).numpy()
                planes.store_planes(stored, target.reshape(count, dtype.itemsize))
                if digest is not None:
                    digest.update(target)
            else:
                planes.join_planes(list(stored), dtype, out.reshape(-1), digest)
        else:
            raw = np.frombuffer(
                payload if info.codec == RAW else zstd.unzstd(payload, info.raw_size, "the blob payload"),
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


def check_delta_layout(blob: bytes | memoryview) -> bool:
    """What of a delta blob can be checked without its base: its header, and its planes'
    layout (nothing decompressed): True once checked; False (nothing checked past its
    header) for a blob that is no delta. CorruptError if what is checked is malformed."""
    info = parse_header(blob)
    if info.codec != XOR_PLANES:
        return False
    itemsize = DTYPES[info.dtype].itemsize
    planes.check_layout(memoryview(blob)[info.header_size :], itemsize, info.raw_size // itemsize)
    return True


# A chain's planes live in memory this thread keeps for the next chain (up to this size): fresh
# memory costs a page fault per 4 KiB, a quarter of a restore's time at the end of a chain.
_CHAIN_MEMORY = 32 << 20
_chains = threading.local()


def _chain_memory(itemsize: int, count: int) -> np.ndarray:
    """Memory for the planes of one chain (element size x elements): this thread's own, reused
    by its next chain, which starts once this one's tensor is decoded."""
    size = itemsize * count
    if size > _CHAIN_MEMORY:
        return np.empty((itemsize, count), dtype=np.uint8)
    memory = getattr(_chains, "memory", None)
    if memory is None or memory.size < size:
        memory = _chains.memory = np.empty(max(size, 1 << 20), dtype=np.uint8)
    return memory[:size].reshape(itemsize, count)


def decode_planes(
    blob: bytes | memoryview, base: Base | None = None, info: BlobInfo | None = None
) -> np.ndarray:
    """The blob's bytes as byte planes (uint8, element size x elements), a delta XOR-ed onto
    its ``base``'s: what a delta against this blob starts from. Not verified against any key:
    whoever reads the chain's last tensor verifies that. CorruptError if the bytes are
    malformed, or a delta comes without its base or with one of another size."""
    info = info or parse_header(blob)
    payload = memoryview(blob)[info.header_size :]
    itemsize = DTYPES[info.dtype].itemsize
    count = info.raw_size // itemsize
    try:
        if info.codec == XOR_PLANES:
            if base is None:
                raise CorruptError("a delta blob is read without its base")
            out = base(info.raw_size)
            if out.dtype != np.uint8 or out.shape != (itemsize, count):
                raise CorruptError(f"a delta's base holds {out.size} bytes, the delta {info.raw_size}")
            for row, plane in zip(out, planes.read_planes(payload, itemsize, count), strict=True):
                np.bitwise_xor(row, plane, out=row)
            return out
        if info.codec == ZSTD_PLANES:
            out = _chain_memory(itemsize, count)
            for row, plane in zip(out, planes.read_planes(payload, itemsize, count), strict=True):
                row[:] = plane
            return out
        tensor = torch.empty(count, dtype=DTYPES[info.dtype])
        decode_into(blob, None, tensor)
        return planes.split_planes(raw_bytes(tensor), itemsize)
    except (zstandard.ZstdError, struct.error) as exc:
        raise CorruptError(f"blob payload does not decode: {exc}") from None


def decode_pieces(
    blob: bytes | memoryview,
    key: str | None,
    dtype: torch.dtype,
    raw_size: int | None = None,
    content_hash: ContentHash = PLAIN,
) -> Iterator[tuple[int, torch.Tensor]]:
    """The blob's elements as ``(first element, 1-D tensor)`` pieces in element order, of
    ``dtype``: the blob's or, for a floating blob, another floating dtype (cast as ``Tensor.to``
    casts, bit for bit); when ``key`` is given, its content verified against it by
    ``content_hash`` (the store's) once the last piece is out. ``raw_size``: as for ``decode``,
    checked before the first piece.

    A piece is memory reused for the next (``planes.decode_pieces``, ZSTD_PLANES blobs): a
    caller writing a tensor out holds a piece of it in memory, never all of it. Other codecs
    are decoded whole first. Raises CorruptError as ``decode_into`` does, perhaps after some
    pieces: nothing handed out is to be trusted until the iteration has ended. A delta needs
    its base: ``pack.decode_entry_pieces`` decodes it whole.
    """
    info = parse_header(blob)
    check_raw_size(info, raw_size)
    stored = DTYPES[info.dtype]
    count = info.raw_size // stored.itemsize
    if dtype != stored and not (dtype.is_floating_point and stored.is_floating_point):
        raise CorruptError(f"blob of {info.dtype} cannot be decoded as {dtype}")
    if info.codec != ZSTD_PLANES:
        yield 0, cast(decode(blob, key, raw_size, content_hash).reshape(-1), dtype)
        return
    digest = None if key is None else key_digest(info.dtype, info.shape, content_hash)
    try:
        yield from planes.decode_pieces(memoryview(blob)[info.header_size :], stored, count, dtype, digest)
    except (zstandard.ZstdError, struct.error) as exc:
        raise CorruptError(f"blob payload does not decode: {exc}") from None
    if digest is not None and digest.hexdigest() != key:
        raise CorruptError(f"blob content does not hash to its key {key}")
