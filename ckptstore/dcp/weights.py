"""A DCP step's model weights as full tensors under the model's own names.

The model's items are those of the state dict's ``model`` entry (``model.*`` kinds), or for a
flat state dict every item that is a parameter's own (kind ``*``); optimizer state and bytes
items are left out. Each full tensor is assembled from its chunks (boxes) as stored.
"""

from __future__ import annotations

import json
import math

import torch

from ..catalog import Catalog
from ..errors import CorruptError
from ..format.codec import DTYPES
from ..objects import ObjectStore
from . import chunks, item_names


def model_items(description: dict) -> list[tuple[str, str]]:
    """``(name in the model, DCP item)`` of every model tensor of a DCP step, in saved order."""
    names, items = item_names(description), description["dcp"]["items"]
    kinds = {kind for _, kind, _ in names.values()}
    model_kind = "model.*" if "model.*" in kinds else "*"
    return [
        (name, fqn)
        for fqn, (name, kind, _) in names.items()
        if kind == model_kind and fqn in items and not items[fqn].get("bytes")
    ]


def state_dict(
    objects: ObjectStore, catalog: Catalog, step: int, dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """Every model tensor of DCP step ``step``, whole, floating ones cast to ``dtype`` (None:
    as stored). CorruptError if the stored chunks do not tile a tensor."""
    description = json.loads(catalog.description(step))
    found = chunks.locations(description, catalog.sources(step), step)
    wanted = {name: fqn for name, fqn in model_items(description)}
    by_item: dict[str, list[tuple[list[int], chunks.ChunkLocation]]] = {}
    for (fqn, offsets), where in found.items():
        if fqn in wanted.values():
            by_item.setdefault(fqn, []).append((list(offsets), where))
    fetcher = chunks.ChunkFetcher(objects, catalog, step, [w for parts in by_item.values() for _, w in parts])
    out = {}
    for name, fqn in wanted.items():
        item = description["dcp"]["items"][fqn]
        size = item["size"]
        # What the layer indexes record (bounded by the packs) must cover the declared size
        # before a tensor of that size is allocated.
        stored = sum(fetcher.stored_numel(where) for _, where in by_item.get(fqn, []))
        if stored != math.prod(size):
            raise CorruptError(f"step {step}: the chunks of {fqn} hold {stored} elements, its size {size}")
        full = torch.empty(size, dtype=DTYPES[item["dtype"]])
        for offsets, where in by_item[fqn]:
            box = full
            for dim, (offset, length) in enumerate(zip(offsets, where.sizes, strict=True)):
                box = box.narrow(dim, offset, length)
            box.copy_(fetcher.fetch(where))
        out[name] = full.to(dtype) if dtype is not None and full.is_floating_point() else full
    return out
