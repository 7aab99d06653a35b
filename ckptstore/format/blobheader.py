"""The blob header and the content key: what every blob of a store says of itself, and the
hash that names a tensor whatever codec stored it.

Blob layout (format version 1, all integers little-endian)::

    b"CKPB"  u8 version  u8 codec  u8 len(dtype)  dtype (ascii)
    u8 ndim  ndim x u64 shape  u64 raw_size  payload

The payload is ``codec``'s (``format.codec``). The key is the store's content hash
(``ckptstore.hashing``: xxh3-128, or keyed BLAKE3 with a key) of the dtype, the shape and the
*uncompressed* bytes, so it does not depend on the codec, and every decode re-hashes and compares.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import CorruptError, UnsupportedError, clip
from ..hashing import PLAIN, ContentHash, Digest
from . import devicecopy
from .config import check_version

MAGIC = b"CKPB"
FORMAT_VERSION = 1
RAW, ZSTD, ZSTD_GROUPED, ZSTD_PLANES, XOR_PLANES = 0, 1, 2, 3, 4
CODECS = (RAW, ZSTD, ZSTD_GROUPED, ZSTD_PLANES, XOR_PLANES)
# Only plain numeric dtypes ever become blobs; anything else is refused rather than guessed.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    )
}  # fmt: skip


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
    digest = key_digest(dtype_name(tensor.dtype), tuple(tensor.shape), content_hash)
    if raw is None and not devicecopy.on_host(tensor):
        for chunk in devicecopy.host_chunks(tensor):
            digest.update(chunk)
    else:
        digest.update(raw_bytes(tensor) if raw is None else raw)
    return digest.hexdigest()


def key_digest(dtype: str, shape: tuple[int, ...], content_hash: ContentHash) -> Digest:
    """The content key's hash of a tensor of ``dtype`` (its name) and ``shape``, before its bytes."""
    digest = content_hash.digest()
    digest.update(f"{dtype}:{shape}:".encode())
    return digest


def header(codec: int, dtype: str, shape: tuple[int, ...], raw_size: int) -> bytes:
    """The header of a blob of ``codec`` holding a tensor of ``dtype`` (its name) and ``shape``,
    ``raw_size`` bytes uncompressed."""
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
            raise CorruptError(f"unknown dtype {clip(repr(dtype), 40)} in blob header")
        (ndim,) = struct.unpack_from("<B", view, offset)
        shape = struct.unpack_from(f"<{ndim}Q", view, offset + 1)
        offset += 1 + 8 * ndim
        (raw_size,) = struct.unpack_from("<Q", view, offset)
        offset += 8
    except (struct.error, UnicodeDecodeError) as exc:
        raise CorruptError(f"truncated or malformed blob header: {exc}") from None
    # Zero elements may still declare dimensions no tensor can have (torch's strides overflow).
    if math.prod(max(dim, 1) for dim in shape) * DTYPES[dtype].itemsize >= 1 << 63:
        raise CorruptError(f"blob header declares an impossible shape {clip(str(shape), 120)}")
    if math.prod(shape) * DTYPES[dtype].itemsize != raw_size:
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
