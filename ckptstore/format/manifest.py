"""Manifests: a step's ``StepRecord`` as canonical JSON, one object per step in the store.

A manifest is written after every blob the step references and before (local stores) or as
(S3 stores) the step's commit point. It is self-contained (see ``StepRecord``), so manifests
alone rebuild the catalog on another machine. The same record always encodes to the same
bytes (sorted keys, no whitespace), which the golden tests pin.
"""

from __future__ import annotations

import json

from ..errors import CorruptError
from ..model import BlobRow, FileRow, StepRecord, TensorRow
from .config import check_version

MANIFEST_VERSION = 1


def encode(record: StepRecord) -> bytes:
    """Canonical bytes of ``record``. Update statistics, files and the counts of what the commit
    added are encoded only when present (readers of older manifests ignore keys they lack)."""
    body = {
        "version": MANIFEST_VERSION,
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
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def decode(data: bytes) -> StepRecord:
    """The record in manifest bytes. Each tensor row gets its layer's source step.

    Raises UnsupportedError for a manifest a newer ckptstore wrote, CorruptError for anything
    malformed.
    """
    try:
        body = json.loads(data)
        if not isinstance(body, dict):
            raise CorruptError("malformed manifest: not a JSON object")
        check_version("manifest", body.get("version"), MANIFEST_VERSION)
        step = int(body["step"])
        sources = {str(layer): int(source) for layer, source in body["layers"]}
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
        )
    except CorruptError:
        raise
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise CorruptError(f"malformed manifest: {exc!r}") from None
