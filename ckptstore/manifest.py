"""Per-step manifests: the catalog rows of one step as a canonical JSON object in the store.

A manifest is written after the step's blobs and before its catalog row. It is
self-contained: besides the tensors the step saved it lists those its layers inherit (each
row belongs to its layer's source step), so it alone rebuilds the step's catalog rows on
another machine, and dropping an older step's manifest never strands a composite step. The same step always encodes to the same
bytes (sorted keys, no whitespace), which the golden tests pin.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .catalog import BlobRow, FileRow, TensorRow
from .errors import CorruptError

MANIFEST_VERSION = 1


def manifest_name(step: int) -> str:
    """Object name of ``step``'s manifest (zero-padded so names sort by step)."""
    return f"manifests/{step:012d}.json"


@dataclass
class Manifest:
    """Everything the catalog records about one step."""

    step: int
    created_at: str
    world_size: int
    description: str
    layer_sources: dict[str, int]
    tensors: list[TensorRow]
    blobs: list[BlobRow]
    # Optional parts, encoded only when present (older manifests lack them):
    # layer -> (step compared with, relative update), and the step's auxiliary files.
    updates: dict[str, tuple[int | None, float | None]] = field(default_factory=dict)
    files: list[FileRow] = field(default_factory=list)

    def encode(self) -> bytes:
        """Canonical bytes of the manifest."""
        body = {
            "version": MANIFEST_VERSION,
            "step": self.step,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "description": json.loads(self.description),
            "layers": [[layer, source] for layer, source in self.layer_sources.items()],
            "tensors": [[t.layer, t.name, t.kind, t.start, t.numel, t.blob] for t in self.tensors],
            "blobs": sorted([b.key, b.size, b.raw_size] for b in self.blobs),
        }
        measured = [[layer, *update] for layer, update in self.updates.items() if update[0] is not None]
        if measured:
            body["updates"] = measured
        if self.files:
            body["files"] = sorted([f.path, f.key, f.size] for f in self.files)
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        """Parse manifest bytes; raises CorruptError on anything malformed."""
        try:
            body = json.loads(data)
            if body["version"] != MANIFEST_VERSION:
                raise CorruptError(f"manifest version {body['version']} is not supported")
            step = int(body["step"])
            sources = {str(layer): int(source) for layer, source in body["layers"]}
            return cls(
                step=step,
                created_at=str(body["created_at"]),
                world_size=int(body["world_size"]),
                description=json.dumps(body["description"], sort_keys=True, separators=(",", ":")),
                layer_sources=sources,
                tensors=[
                    TensorRow(step, str(a), str(b), str(c), int(d), int(e), str(f))
                    for a, b, c, d, e, f in body["tensors"]
                ],  # fmt: skip
                blobs=[BlobRow(str(k), int(s), int(r)) for k, s, r in body["blobs"]],
                updates={
                    str(layer): (int(since), None if size is None else float(size))
                    for layer, since, size in body.get("updates", [])
                },
                files=[FileRow(str(p), str(k), int(n)) for p, k, n in body.get("files", [])],
            )
        except CorruptError:
            raise
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CorruptError(f"malformed manifest: {exc!r}") from None
