"""A DCP step's model weights as full tensors under the model's own names.

The model's items are those of the state dict's ``model`` entry (``model.*`` kinds), or for a
flat state dict every item that is a parameter's own (kind ``*``); optimizer state and bytes
items are left out. Each full tensor is assembled from its chunks (boxes) as stored.
``DcpStepWeights`` offers what ``export.folder`` reads a step's weights through.
"""

from __future__ import annotations

import math

import torch

from ..catalog import Catalog
from ..errors import CorruptError
from ..format.cast import cast
from ..format.codec import DTYPES
from ..model import WEIGHT, Weight
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


class DcpStepWeights:
    """The model weights of one DCP step, read from the store on demand.

    ``description``: the step's description, parsed (``dcp_description``). ``entries`` lists
    them (``export.weights.Weight``) in the state dict's order; ``training_dtype`` is the dtype
    most of them were saved in. Raises NotFoundError for an unknown step.
    """

    def __init__(self, objects: ObjectStore, catalog: Catalog, step: int, description: dict) -> None:
        self.step = step
        self._items = description["dcp"]["items"]
        self._fqns = dict(model_items(description))
        self._parts: dict[str, list[tuple[list[int], chunks.ChunkLocation]]] = {}
        for (fqn, offsets), where in chunks.locations(description, catalog.sources(step), step).items():
            if offsets is not None:
                self._parts.setdefault(fqn, []).append((offsets, where))
        wanted = [where for fqn in self._fqns.values() for _, where in self._parts.get(fqn, [])]
        self._fetcher = chunks.ChunkFetcher(objects, catalog, step, wanted)
        self.entries = [
            Weight(name, WEIGHT, tuple(self._items[fqn]["size"])) for name, fqn in self._fqns.items()
        ]
        dtypes = [self._items[fqn]["dtype"] for fqn in self._fqns.values()]
        self.training_dtype = DTYPES[max(set(dtypes), key=dtypes.count)] if dtypes else torch.float32

    def read(self, weight: Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The full tensor of ``weight``, floating point cast to ``dtype`` (None: as saved).
        CorruptError if its stored chunks do not cover it."""
        fqn = self._fqns[weight.name]
        item, parts = self._items[fqn], self._parts.get(fqn, [])
        # What the layer indexes record (bounded by the packs) must cover the declared size
        # before a tensor of that size is allocated.
        stored = sum(self._fetcher.stored_numel(where) for _, where in parts)
        if stored != math.prod(item["size"]):
            raise CorruptError(
                f"step {self.step}: the chunks of {fqn} hold {stored} elements, its size {item['size']}"
            )
        full = torch.empty(item["size"], dtype=DTYPES[item["dtype"]])
        for offsets, where in parts:
            box = full
            for dim, (offset, length) in enumerate(zip(offsets, where.sizes, strict=True)):
                box = box.narrow(dim, offset, length)
            box.copy_(self._fetcher.fetch(where))
        return cast(full, dtype) if dtype is not None and full.is_floating_point() else full


def state_dict(
    objects: ObjectStore,
    catalog: Catalog,
    step: int,
    description: dict,
    dtype: torch.dtype | None = torch.float32,
) -> dict[str, torch.Tensor]:
    """Every model tensor of DCP step ``step`` (``description``: its description, parsed),
    whole, floating ones cast to ``dtype`` (None: as saved). CorruptError if the stored chunks
    do not tile a tensor."""
    weights = DcpStepWeights(objects, catalog, step, description)
    return {weight.name: weights.read(weight, dtype) for weight in weights.entries}
