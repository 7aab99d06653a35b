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

Version 2, written only for a layer whose packs hold deltas, adds ``"bases": b`` to the head
and the b base packs (``LayerPacks.bases``) after its n packs, in the keys and in each of the
three pack columns; a layer with no bases is written as version 1, byte for byte as before.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping

import numpy as np
import zstandard

from ..errors import CorruptError, clip
from ..model import NUMEL, PACK, START, TENSOR, LayerPacks, PackRef
from . import zstd
from .config import check_version

MAGIC = b"CKLP"
FORMAT_VERSION = 2
_PLAIN_VERSION = 1  # no bases
_PREAMBLE = struct.Struct("<4sB")
_LENGTH = struct.Struct("<I")
_INT = np.dtype("<i8")
# The head names the layer's tensors (about 60 bytes each): no layer ckptstore writes comes close.
_MAX_HEAD = 1 << 22
# A pack's deltas need a chain of bases (``knobs.delta_chain`` long at most): no more than this.
_MAX_BASES_PER_PACK = 64


def build(
    step: int,
    layer: str,
    packs: list[tuple[PackRef, list[tuple[str, str, str, int, int]]]],
    bases: list[PackRef] = (),
) -> LayerPacks:
    """The index of ``layer`` saved at ``step`` from its packs, each with its entries
    ``(name, kind, dtype, start, numel)``, and the ``bases`` their deltas need. Packs are
    kept in the order given, bases by key."""
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
    unique = {ref.key: ref for ref in bases}
    return LayerPacks(
        step, layer, [ref for ref, _ in packs], [names[t] for t in order], fragments,
        bases=[unique[key] for key in sorted(unique)],
    )  # fmt: skip


def encode(index: LayerPacks) -> bytes:
    """The bytes of ``index`` (its step and layer are kept by whoever stores them): those it
    was decoded from or first encoded to (``LayerPacks.encoded``)."""
    if index.encoded is None:
        # A step's indexes are encoded for its manifest, its catalog rows and their digest
        # (catalog.digests); one of a 512-rank layer takes ~20 ms to compress.
        index.encoded = _encode(index)
    return index.encoded


def _encode(index: LayerPacks) -> bytes:
    frags = index.fragments
    fields = {"tensors": [list(t) for t in index.tensors], "packs": len(index.packs), "fragments": len(frags)}
    if index.bases:
        fields["bases"] = len(index.bases)
    head = json.dumps(fields, separators=(",", ":")).encode()
    tensor, pack, start, numel = (frags[:, c] for c in (TENSOR, PACK, START, NUMEL))
    refs = [*index.packs, *index.bases]
    body = [
        _LENGTH.pack(len(head)),
        head,
        b"".join(bytes.fromhex(p.key) for p in refs),
        np.array([[p.rank for p in refs], [p.size for p in refs],
                  [p.raw_size for p in refs]], dtype=_INT).tobytes(),
        np.diff(tensor, prepend=0).astype(_INT).tobytes(),
        np.diff(pack, prepend=0).astype(_INT).tobytes(),
        (start - _previous_ends(tensor, start, numel)).astype(_INT).tobytes(),
        numel.astype(_INT).tobytes(),
    ]  # fmt: skip
    compressor = zstandard.ZstdCompressor(level=9, write_checksum=True)
    version = FORMAT_VERSION if index.bases else _PLAIN_VERSION
    return _PREAMBLE.pack(MAGIC, version) + compressor.compress(b"".join(body))


def decode(
    data: bytes | memoryview, step: int, layer: str, numels: Mapping[str, int] | None = None
) -> LayerPacks:
    """The index of ``layer`` saved at ``step`` from its bytes. Raises CorruptError for
    anything malformed, UnsupportedError for an index of a newer format.

    ``numels``: elements of each parameter, from the step's description (its referrer). A
    fragment holds at least one element (an empty tensor is one whole fragment), so a tensor
    of n elements has at most n fragments, and a layer's packs hold at least one fragment
    each: with ``numels`` the counts the head declares are held to that before the rest of
    the frame is decompressed. Without it they are held only to the frame's declared size.
    """
    data = bytes(data)  # kept as the index's ``encoded``; no copy of what is bytes already
    what, tensors, n, m, keys, ints = _parse(data, step, layer, numels)
    t = len(keys) // 16  # its packs, then its bases
    ranks, sizes, raws = ints[:t], ints[t : 2 * t], ints[2 * t : 3 * t]
    tensor, pack, gap, numel = (ints[3 * t + i * m : 3 * t + (i + 1) * m] for i in range(4))
    tensor, pack = np.cumsum(tensor), np.cumsum(pack)
    start = _starts(tensor, gap, numel)
    fragments = np.stack([tensor, pack, start, numel], axis=1) if m else np.zeros((0, 4), dtype=np.int64)
    if m and (tensor.min() < 0 or tensor.max() >= len(tensors) or pack.min() < 0 or pack.max() >= n
              or numel.min() < 0 or np.any(np.diff(tensor) < 0)):  # fmt: skip
        raise CorruptError(f"{what} points outside itself")
    if m and numels is not None:
        # -1: a tensor the description gives no shape (a buffer), bounded by the manifest alone
        limit = np.array([numels.get(name, -1) for name, _, _ in tensors], dtype=np.int64)[tensor]
        if np.any((limit >= 0) & ((start < 0) | (start + numel > limit))):
            raise CorruptError(f"{what} has fragments past the end of their parameters")
    hexed = keys.hex()
    refs = list(
        map(
            PackRef,
            [hexed[i : i + 32] for i in range(0, 32 * t, 32)],
            ranks.tolist(),
            sizes.tolist(),
            raws.tolist(),
        )
    )
    return LayerPacks(
        step, layer, refs[:n], tensors, fragments.astype(np.int64), encoded=data, bases=refs[n:]
    )


class EncodedLayerPacks(LayerPacks):
    """A layer's index as its bytes (``encoded``) and sizes, decoded (``decode``) only when its
    packs, tensors or fragments are first used: what a catalog import needs of the thousands of
    indexes a gc with an empty cache imports, none of which it reads (the catalog decodes, and
    checks, the rows it is asked for)."""

    encoded: bytes
    _numels: Mapping[str, int] | None
    _sizes: tuple[int, int]

    def __getattr__(self, name: str):
        # Only called for attributes not set yet: the decoded fields.
        if name not in ("packs", "tensors", "fragments", "bases") or "encoded" not in self.__dict__:
            raise AttributeError(name)
        full = decode(self.encoded, self.step, self.layer, self._numels)
        self.packs, self.tensors, self.fragments, self.bases = (
            full.packs,
            full.tensors,
            full.fragments,
            full.bases,
        )
        return getattr(self, name)

    @property
    def size(self) -> int:
        return self.__dict__["_sizes"][0] if "_sizes" in self.__dict__ else super().size

    @property
    def raw_size(self) -> int:
        return self.__dict__["_sizes"][1] if "_sizes" in self.__dict__ else super().raw_size


def decode_lazily(
    data: bytes | memoryview, step: int, layer: str, numels: Mapping[str, int] | None = None
) -> LayerPacks:
    """The index in ``data`` as ``decode`` gives it, with what makes it up checked and decoded
    when first used (``EncodedLayerPacks``): now only its frame, head and sizes. CorruptError,
    UnsupportedError as ``decode`` for those; its fragments raise them on first use."""
    data = bytes(data)
    _, _, n, _, keys, ints = _parse(data, step, layer, numels)
    t = len(keys) // 16  # its packs, then its bases
    index = EncodedLayerPacks.__new__(EncodedLayerPacks)
    index.step, index.layer, index.encoded, index._numels = step, layer, data, numels
    index._sizes = (int(ints[t : t + n].sum()), int(ints[2 * t : 2 * t + n].sum()))
    return index


def _parse(
    data: bytes, step: int, layer: str, numels: Mapping[str, int] | None
) -> tuple[str, list[tuple[str, str, str]], int, int, bytes, np.ndarray]:
    """``(what, tensors, n packs, m fragments, pack keys, the integer columns)`` of an index's
    bytes, its frame and lengths checked (see ``decode``)."""
    what = f"the pack index of {layer} at step {step}"
    if len(data) < _PREAMBLE.size or data[:4] != MAGIC:
        raise CorruptError(f"{what} is not one (bad magic)")
    check_version(what, data[4], FORMAT_VERSION)
    frame = data[_PREAMBLE.size :]
    try:
        length, tensors, n, m, b = _head(frame, numels)
        if b and data[4] < FORMAT_VERSION:
            raise CorruptError(f"a version {data[4]} index declares bases")
        n += b  # the keys and pack columns hold its bases after its packs
        size = _LENGTH.size + length + 40 * n + 32 * m
        if zstd.frame_size(frame) != size:
            raise CorruptError(f"its frame does not hold the {n} packs and {m} fragments its head declares")
        body = zstd.decompress_frame(frame, size)
        position = _LENGTH.size + length
        keys = body[position : position + 16 * n]
        position += 16 * n
        ints = np.frombuffer(body, dtype=_INT, offset=position)
        if len(keys) != 16 * n or len(ints) != 3 * n + 4 * m:
            raise CorruptError("wrong length")
    except CorruptError as exc:
        raise CorruptError(f"{what} is malformed ({clip(str(exc))})") from None
    except (zstandard.ZstdError, ValueError, KeyError, TypeError, RecursionError, struct.error) as exc:
        raise CorruptError(f"{what} is malformed ({clip(repr(exc))})") from None
    return what, tensors, n - b, m, keys, ints


def numels(description: object) -> dict[str, int]:
    """Elements of each parameter a step's description (JSON data or text) lists: what bounds its
    layers' indexes (``decode``). CorruptError if it lists none, or a shape is malformed."""
    if isinstance(description, str):  # the catalog's JSON text
        try:
            description = json.loads(description)
        except ValueError:
            raise CorruptError("a step description is not JSON") from None
    params = description.get("params") if isinstance(description, dict) else None
    if not isinstance(params, dict):
        raise CorruptError("its description lists no parameters")
    numels = {}
    for name, param in params.items():
        shape = param.get("shape") if isinstance(param, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise CorruptError(f"parameter {clip(name)} has no valid shape")
        numels[name] = math.prod(shape)
    return numels


def _head(
    frame: bytes, numels: Mapping[str, int] | None
) -> tuple[int, list[tuple[str, str, str]], int, int, int]:
    """``(len(head), tensors, packs, fragments, bases)`` from the start of the frame,
    decompressing only the head, its counts checked against ``numels`` (see ``decode``)."""
    (length,) = _LENGTH.unpack(zstd.peek_frame(frame, _LENGTH.size).ljust(_LENGTH.size, b"\0"))
    if length > _MAX_HEAD:
        raise CorruptError(f"its head of {length} bytes is implausibly large")
    head = json.loads(zstd.peek_frame(frame, _LENGTH.size + length)[_LENGTH.size :])
    tensors = [(str(n), str(k), str(d)) for n, k, d in head["tensors"]]
    n, m, b = head["packs"], head["fragments"], head.get("bases", 0)
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in (n, m, b)):
        raise CorruptError("its head declares no valid counts")
    if b > _MAX_BASES_PER_PACK * n:
        raise CorruptError(f"its head declares {b} bases for {n} packs")
    if numels is not None:
        most = sum(max(1, numels.get(name, 1)) for name, _, _ in tensors)
        if m > most or n > m:
            raise CorruptError(
                f"its head declares {n} packs and {m} fragments; its {len(tensors)} tensors have room for {most}"
            )
    return length, tensors, n, m, b


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
