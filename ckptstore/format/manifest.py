"""Manifests: a step's ``StepRecord``, one object per step in the store.

A manifest is written after every object the step references and before (local stores) or as
(S3 stores) the step's commit point. It is self-contained (see ``StepRecord``), so manifests
alone rebuild the catalog on another machine. The same record always encodes to the same
bytes, which the golden tests pin.

Format 1 (JSON text, ``{"version": 1, ...}``) names every stored tensor; ckptstore reads it.
Format 2, which ckptstore writes, is ``b"CKPM" u8 2`` then one zstd frame (with its checksum)
of ``u32 len(body) body`` and the pack indexes (``format.layerpacks``) back to back: ``body``
is format 1's JSON without ``version``, plus ``"packs": [[layer, source, length], ...]``; its
``tensors`` and ``blobs`` are only those of layers inherited from format-1 steps.

Format 3 is format 2 in a store with a key: ``b"CKPM" u8 3``, a 32-byte tag, then the same
frame. The tag (``hashing.ContentHash.tag``) binds the frame to the manifest's object name, so
step and generation: a manifest written without the key, or moved to another step's or
generation's name, does not match and is refused before a byte of it is decompressed.
"""

from __future__ import annotations

import json
import struct

import zstandard

from .. import knobs, tensorsplit
from ..errors import CorruptError, clip
from ..hashing import PLAIN, ContentHash
from ..model import REPLACED, SKIPPED, BlobRow, FileRow, StepRecord, TensorRow
from . import layerpacks, layout, zstd
from .config import check_version

MANIFEST_VERSION = 2
AUTHENTICATED_VERSION = 3
MAGIC = b"CKPM"
TAG_BYTES = 32
# What parsing a damaged manifest raises besides CorruptError (a nesting past the stack too).
_MALFORMED = (
    ValueError,
    KeyError,
    TypeError,
    UnicodeDecodeError,
    RecursionError,
    struct.error,
    zstandard.ZstdError,
)
_LENGTH = struct.Struct("<I")


def _body(record: StepRecord) -> dict:
    """The JSON fields both formats share. Update statistics, files, the counts of what the
    commit added, metrics, the weights-only mark and the generation a commit after a deletion
    supersedes are encoded only when present (readers of older manifests ignore keys they lack)."""
    body = {
        "step": record.step,
        "created_at": record.created_at,
        "world_size": record.world_size,
        "description": json.loads(record.description),
        "layers": [[layer, source] for layer, source in record.layer_sources.items()],
        "tensors": [[t.layer, t.name, t.kind, t.start, t.numel, t.blob] for t in record.tensors],
        "blobs": sorted([b.key, b.size, b.raw_size] for b in record.blobs),
    }
    measured = [[layer, *update] for layer, update in record.updates.items() if update[0] is not None]
    if measured:
        body["updates"] = measured
    if record.files:
        body["files"] = sorted([f.path, f.key, f.size] for f in record.files)
    if record.added is not None:
        body["added"] = list(record.added)
    if record.metrics:
        body["metrics"] = sorted([name, value] for name, value in record.metrics.items())
    if record.weights_only:
        body["weights_only"] = True
    if record.supersedes is not None:
        body["supersedes"] = record.supersedes
    if record.seconds is not None:
        body["seconds"] = round(record.seconds, 6)
    if record.stall is not None:
        body["stall"] = round(record.stall, 6)
    if record.not_committed:
        body["not_committed"] = [[step, outcome] for step, outcome in record.not_committed]
    return body


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode_v1(record: StepRecord) -> bytes:
    """Format-1 bytes of a record without packs (what older ckptstores wrote; for tests and tools)."""
    if record.packs:
        raise ValueError("format 1 cannot hold pack indexes")
    return _canonical({"version": 1, **_body(record)})


def encode(record: StepRecord, content_hash: ContentHash = PLAIN, generation: int = 0) -> bytes:
    """Canonical bytes of ``record``: format 2, or with a keyed ``content_hash`` (the store's)
    format 3, tagged for its name (``record.step`` and ``generation``)."""
    indexes = [(layer, packs.step, layerpacks.encode(packs)) for layer, packs in record.packs.items()]
    body = _canonical(
        {**_body(record), "packs": [[layer, source, len(data)] for layer, source, data in indexes]}
    )
    payload = b"".join([_LENGTH.pack(len(body)), body, *(data for _, _, data in indexes)])
    frame = zstandard.ZstdCompressor(level=9, write_checksum=True).compress(payload)
    if not content_hash.authenticated:
        return MAGIC + bytes([MANIFEST_VERSION]) + frame
    tag = content_hash.tag(layout.manifest_name(record.step, generation), frame)
    return MAGIC + bytes([AUTHENTICATED_VERSION]) + tag + frame


def decode(
    data: bytes, content_hash: ContentHash = PLAIN, name: str | None = None, *, lazy: bool = False
) -> StepRecord:
    """The record in manifest bytes of any format. Each tensor row gets its layer's source step.
    ``lazy``: its pack indexes are checked and decoded when first used
    (``layerpacks.decode_lazily``), as a catalog import, which stores their bytes, needs them.

    With a keyed ``content_hash`` (the store's) only format 3 is read, and only when its tag
    matches the object ``name`` it was read from; without, format 3 is refused (nothing can
    check it). Raises UnsupportedError for a manifest a newer ckptstore wrote, CorruptError for
    anything malformed or not authentic (naming ``name``).
    """
    if content_hash.authenticated:
        data = _authentic_frame(data, content_hash, name)
    try:
        if bytes(data[:4]) == MAGIC:
            body, indexes = _unwrap(data)
        else:
            body, indexes = json.loads(data), b""
            if not isinstance(body, dict):
                raise CorruptError("malformed manifest: not a JSON object")
            check_version("manifest", body.get("version"), 1)
        return _record(body, indexes, lazy)
    except CorruptError:
        raise
    except _MALFORMED as exc:
        raise CorruptError(f"malformed manifest: {clip(repr(exc))}") from None


def _authentic_frame(data: bytes, content_hash: ContentHash, name: str | None) -> bytes:
    """Format 3 ``data`` turned into the format-2 bytes of its frame once its tag matches ``name``."""
    if name is None:
        raise ValueError("an authenticated manifest is read with its object name")
    if len(data) < 5 + TAG_BYTES or bytes(data[:4]) != MAGIC or data[4] != AUTHENTICATED_VERSION:
        raise CorruptError(
            f"manifest {name} is not authentic: it has no tag (it was written without the store's key)"
        )
    tag, frame = bytes(data[5 : 5 + TAG_BYTES]), bytes(data[5 + TAG_BYTES :])
    if not content_hash.tag_matches(name, frame, tag):
        raise CorruptError(
            f"manifest {name} is not authentic: its tag does not match (written without the store's "
            "key, changed, or moved from another step or generation)"
        )
    return MAGIC + bytes([MANIFEST_VERSION]) + frame


def _unwrap(data: bytes) -> tuple[dict, bytes]:
    """Format 2's JSON body and the pack indexes after it."""
    if len(data) < 5:
        raise CorruptError("malformed manifest: truncated")
    if data[4] == AUTHENTICATED_VERSION:
        raise CorruptError("malformed manifest: a tagged manifest in a store without a key")
    check_version("manifest", data[4], AUTHENTICATED_VERSION)
    frame = bytes(data[5:])
    # The manifest is where a step's sizes start: nothing refers to it but its name, so the
    # only referrer of its size is its own stored length. Its JSON compresses tens of times,
    # its pack indexes (compressed already) hardly at all; a bomb compresses thousands of times.
    most = max(knobs.manifest_min_bound(), len(frame) * knobs.manifest_max_expansion())
    declared = zstd.frame_size(frame)
    if declared > most:
        raise CorruptError(f"malformed manifest: {len(frame)} bytes that declare {declared} uncompressed")
    payload = zstd.decompress_frame(frame, most)
    (length,) = _LENGTH.unpack_from(payload)
    body = json.loads(payload[_LENGTH.size : _LENGTH.size + length])
    if not isinstance(body, dict):
        raise CorruptError("malformed manifest: not a JSON object")
    return body, payload[_LENGTH.size + length :]


def _record(body: dict, indexes: bytes, lazy: bool = False) -> StepRecord:
    step = int(body["step"])
    # The model-parallel layout is indexes and sizes the reading code slices tensors by.
    if (problem := tensorsplit.description_problem(body["description"])) is not None:
        raise CorruptError(f"malformed manifest: step {step}: {clip(problem, 300)}")
    sources = {str(layer): int(source) for layer, source in body["layers"]}
    packs, position = {}, 0
    numels = layerpacks.numels(body["description"]) if body.get("packs") else None
    for layer, source, length in body.get("packs", []):
        chunk = indexes[position : position + int(length)]
        if len(chunk) != int(length):
            raise CorruptError("malformed manifest: truncated pack index")
        packs[str(layer)] = (layerpacks.decode_lazily if lazy else layerpacks.decode)(
            chunk, int(source), str(layer), numels
        )
        position += int(length)
    if position != len(indexes):
        raise CorruptError("malformed manifest: bytes past its last pack index")
    return StepRecord(
        step=step,
        created_at=str(body["created_at"]),
        world_size=int(body["world_size"]),
        description=json.dumps(body["description"], sort_keys=True, separators=(",", ":")),
        layer_sources=sources,
        tensors=[
            TensorRow(sources.get(str(a), step), str(a), str(b), str(c), int(d), int(e), str(f))
            for a, b, c, d, e, f in body["tensors"]
        ],  # fmt: skip
        blobs=[BlobRow(str(k), int(s), int(r)) for k, s, r in body["blobs"]],
        updates={
            str(layer): (int(since), None if size is None else float(size))
            for layer, since, size in body.get("updates", [])
        },
        files=[FileRow(str(p), str(k), int(n)) for p, k, n in body.get("files", [])],
        added=None if "added" not in body else (int(body["added"][0]), int(body["added"][1])),
        packs=packs,
        metrics={
            str(name): None if value is None else float(value) for name, value in body.get("metrics", [])
        },
        weights_only=body.get("weights_only") is True,
        supersedes=None if body.get("supersedes") is None else int(body["supersedes"]),
        seconds=_seconds(body.get("seconds")),
        stall=_seconds(body.get("stall"), "stall"),
        not_committed=_not_committed(body.get("not_committed", []), step),
    )


# A commit's duration above this (about three years) is no measurement but damage.
_MAX_SECONDS = 1e8


def _seconds(value: object, what: str = "seconds") -> float | None:
    """A manifest's ``seconds`` (or ``stall``): None, or a finite duration from 0 to ``_MAX_SECONDS``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= _MAX_SECONDS:
        raise CorruptError(f"malformed manifest: {what} is {str(value)[:40]!r}, not a duration")
    return float(value)


def _not_committed(value: object, step: int) -> list[tuple[int, str]]:
    """A manifest's ``not_committed``: ``[step, "replaced" | "skipped"]`` pairs of steps before
    ``step``, ascending."""
    pairs = []
    for entry in value if isinstance(value, list) else [value]:
        earlier = entry[0] if isinstance(entry, list) and len(entry) == 2 else None
        if (
            type(earlier) is not int
            or not 0 <= earlier < step
            or entry[1] not in (REPLACED, SKIPPED)
            or (pairs and earlier <= pairs[-1][0])
        ):
            raise CorruptError(f"malformed manifest: not_committed holds {str(entry)[:40]!r}")
        pairs.append((earlier, entry[1]))
    return pairs
