"""DCP's ``Metadata`` as plain JSON data, and back: what a step's description keeps of it.

DCP pickles its ``.metadata`` file; the store keeps the same facts as JSON (each item's dtype,
size and chunks, the planner's key paths, the version), so reading a step unpickles nothing.
``storage_data`` (where each chunk lies) is the store's own business and is never kept.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CorruptError, clip
from ..format.codec import DTYPES, dtype_name


def to_plain(metadata: Metadata) -> dict[str, Any]:
    """The facts of ``metadata`` a reader needs, as JSON-compatible data."""
    items: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, BytesStorageMetadata):
            items[fqn] = {"bytes": True}
        else:
            items[fqn] = {
                "dtype": dtype_name(entry.properties.dtype),
                "requires_grad": bool(entry.properties.requires_grad),
                "size": list(entry.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in entry.chunks],
            }
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else None
    return {
        "items": items,
        "paths": None if paths is None else {fqn: list(path) for fqn, path in paths.items()},
        "version": metadata.version,
    }


def from_plain(plain: dict[str, Any]) -> Metadata:
    """The ``Metadata`` that ``to_plain`` described (no ``storage_data``). CorruptError if the
    data is malformed."""
    try:
        entries: dict[str, Any] = {}
        for fqn, item in plain["items"].items():
            if item.get("bytes"):
                entries[fqn] = BytesStorageMetadata()
                continue
            properties = TensorProperties(
                dtype=DTYPES[item["dtype"]], requires_grad=bool(item["requires_grad"])
            )
            chunks = [
                ChunkStorageMetadata(offsets=torch.Size(_dims(o)), sizes=torch.Size(_dims(s)))
                for o, s in item["chunks"]
            ]
            entries[fqn] = TensorStorageMetadata(properties, torch.Size(_dims(item["size"])), chunks)
        paths = plain.get("paths")
        planner_data = None if paths is None else {fqn: tuple(path) for fqn, path in paths.items()}
        return Metadata(
            state_dict_metadata=entries,
            planner_data=planner_data,
            storage_meta=StorageMeta(),
            version=plain.get("version"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptError(f"the step's DCP metadata is malformed ({clip(repr(exc))})") from None


def _dims(values: Any) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(v, int) and v >= 0 for v in values):
        raise ValueError(f"not a list of sizes: {clip(repr(values))}")
    return values
