"""A layer's fragment index (``model.LayerPacks``) as compact bytes, for manifests and the catalog.

Format 2 keeps no row per stored fragment: a ZeRO-3 step of a 70B model on 512 ranks is a
million of them. A layer's index is instead a few columns of integers, transformed so that
the regular partitions DeepSpeed makes turn into runs zstd all but erases (the fragments of a
tensor tile it, so each starts where the previous ended: a gap of 0), plus the layer's packs
and the names of its tensors once. Layout::

    b"CKLP"  u8 version  zstd frame (with checksum) of:
        u32 len(head)  head (JSON: {"tensors": [[name, kind, dtype], ...], "packs": n, "fragments": m})
        n x 16 bytes   pack keys
        int64 x n      pack ranks, stored sizes, raw sizes
        int64 x m      tensor index (delta), pack index (delta), gap before the fragment, numel
"""

from __future__ import annotations

import json
import struct

import numpy as np
import zstandard

from ..errors import CorruptError
from ..model import NUMEL, PACK, START, TENSOR, LayerPacks, PackRef
from . import codec
from .config import check_version

MAGIC = b"CKLP"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<4sB")
_LENGTH = struct.Struct("<I")
_INT = np.dtype("<i8")
# A layer index never decompresses to more than this (a million fragments take 32 MB).
_MAX_BYTES = 1 << 30


def build(
    step: int, layer: str, packs: list[tuple[PackRef, list[tuple[str, str, str, int, int]]]]
) -> LayerPacks:
    """The index of ``layer`` saved at ``step`` from its packs, each with its entries
    ``(name, kind, dtype, start, numel)``. Packs are kept in the order given."""
    tensors: dict[tuple[str, str, str], int] = {}
    rows = []
    for index, (_, entries) in enumerate(packs):
        for name, kind, dtype, start, numel in entries:
            rows.append((tensors.setdefault((name, kind, dtype), len(tensors)), index, start, numel))
    names = list(tensors)
    order = sorted(range(len(names)), key=lambda t: names[t][:2])
    renumber = {old: new for new, old in enumerate(order)}
    fragments = np.array([(renumber[t], p, s, n) for t, p, s, n in rows], dtype=np.int64).reshape(-1, 4)
    if len(fragments):
        fragments = fragments[np.lexsort((fragments[:, START], fragments[:, TENSOR]))]
    return LayerPacks(step, layer, [ref for ref, _ in packs], [names[t] for t in order], fragments)


def encode(index: LayerPacks) -> bytes:
    """The bytes of ``index`` (its step and layer are kept by whoever stores them)."""
    frags = index.fragments
    head = json.dumps(
        {"tensors": [list(t) for t in index.tensors], "packs": len(index.packs), "fragments": len(frags)},
        separators=(",", ":"),
    ).encode()
    tensor, pack, start, numel = (frags[:, c] for c in (TENSOR, PACK, START, NUMEL))
    body = [
        _LENGTH.pack(len(head)),
        head,
        b"".join(bytes.fromhex(p.key) for p in index.packs),
        np.array([[p.rank for p in index.packs], [p.size for p in index.packs],
                  [p.raw_size for p in index.packs]], dtype=_INT).tobytes(),
        np.diff(tensor, prepend=0).astype(_INT).tobytes(),
        np.diff(pack, prepend=0).astype(_INT).tobytes(),
        (start - _previous_ends(tensor, start, numel)).astype(_INT).tobytes(),
        numel.astype(_INT).tobytes(),
    ]  # fmt: skip
    compressor = zstandard.ZstdCompressor(level=9, write_checksum=True)
    return _PREAMBLE.pack(MAGIC, FORMAT_VERSION) + compressor.compress(b"".join(body))


def decode(data: bytes | memoryview, step: int, layer: str) -> LayerPacks:
    """The index of ``layer`` saved at ``step`` from its bytes. Raises CorruptError for
    anything malformed, UnsupportedError for an index of a newer format."""
    data = bytes(data)
    if len(data) < _PREAMBLE.size or data[:4] != MAGIC:
        raise CorruptError(f"the pack index of {layer} at step {step} is not one (bad magic)")
    check_version(f"the pack index of {layer} at step {step}", data[4], FORMAT_VERSION)
    try:
        body = codec.decompress_frame(data[_PREAMBLE.size :], _MAX_BYTES)
        (length,) = _LENGTH.unpack_from(body)
        head = json.loads(body[_LENGTH.size : _LENGTH.size + length])
        tensors = [(str(n), str(k), str(d)) for n, k, d in head["tensors"]]
        n, m = int(head["packs"]), int(head["fragments"])
        position = _LENGTH.size + length
        keys = body[position : position + 16 * n]
        position += 16 * n
        ints = np.frombuffer(body, dtype=_INT, offset=position)
        if len(keys) != 16 * n or len(ints) != 3 * n + 4 * m:
            raise CorruptError("wrong length")
        ranks, sizes, raws = ints[:n], ints[n : 2 * n], ints[2 * n : 3 * n]
        tensor, pack, gap, numel = (ints[3 * n + i * m : 3 * n + (i + 1) * m] for i in range(4))
    except CorruptError as exc:
        raise CorruptError(f"the pack index of {layer} at step {step} is malformed ({exc})") from None
    except (zstandard.ZstdError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise CorruptError(f"the pack index of {layer} at step {step} is malformed ({exc!r})") from None
    tensor, pack = np.cumsum(tensor), np.cumsum(pack)
    start = _starts(tensor, gap, numel)
    fragments = np.stack([tensor, pack, start, numel], axis=1) if m else np.zeros((0, 4), dtype=np.int64)
    if m and (tensor.min() < 0 or tensor.max() >= len(tensors) or pack.min() < 0 or pack.max() >= n
              or numel.min() < 0 or np.any(np.diff(tensor) < 0)):  # fmt: skip
        raise CorruptError(f"the pack index of {layer} at step {step} points outside itself")
    hexed = keys.hex()
    packs = [
        PackRef(hexed[32 * i : 32 * (i + 1)], rank, size, raw)
        for i, (rank, size, raw) in enumerate(zip(ranks.tolist(), sizes.tolist(), raws.tolist(), strict=True))
    ]
    return LayerPacks(step, layer, packs, tensors, fragments.astype(np.int64))


def _previous_ends(tensor: np.ndarray, start: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Where each fragment's predecessor of the same tensor ends (0 for a tensor's first)."""
    ends = np.concatenate([[0], start[:-1] + numel[:-1]]).astype(np.int64)
    first = np.concatenate([[True], tensor[1:] != tensor[:-1]]) if len(tensor) else np.zeros(0, bool)
    ends[first] = 0
    return ends


def _starts(tensor: np.ndarray, gap: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """The starts ``_previous_ends`` turned into gaps, back: a running sum restarted per tensor."""
    if not len(tensor):
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(gap + numel)
    first = np.flatnonzero(np.concatenate([[True], tensor[1:] != tensor[:-1]]))
    # Subtract what the tensors before this one summed to.
    before = np.concatenate([[0], ends[first[1:] - 1]])
    counts = np.diff(np.concatenate([first, [len(tensor)]]))
    return ends - np.repeat(before, counts) - numel
