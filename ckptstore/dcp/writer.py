"""DCP's ``StorageWriter`` on a store: ``dcp.save`` writes a store step (``StoreWriter``).

Each rank stores the chunks DCP's planner gives it (a chunk is a box of a tensor: offsets and
sizes per dimension) in packs, one per rank and layer, as a DeepSpeed commit does:
content-keyed, so an unchanged layer is hashed and not written again. A chunk is a pack entry
of its parameter (``naming``) starting at the flat index of its first element; the box
itself is in DCP's metadata, which the coordinator's ``finish`` records with the step, as JSON,
in the manifest: the commit point, after every rank's packs are durable. A failure on any rank
reaches every rank through DCP and records nothing.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..commit import ranks
from ..commit.packs import Entry, store_pieces
from ..commit.plan import check_new_step
from ..commit.record import build_record, check_metrics, publish
from ..errors import BadInputError, require_int
from ..format import codec, config, layerpacks
from ..model import PackRef, Piece
from . import DCP_FORMAT, StoreParts, bytesitems, chunks, is_dcp_step
from . import metadata as plain_metadata
from .naming import STATE_LAYER, ItemName, name_items

__all__ = ["StoreWriter"]


@dataclass(frozen=True)
class _Saved:
    """What the coordinator decided for every rank (a plan's ``storage_data``): the layers
    this step saves; the others it inherits."""

    layers: frozenset[str]


@dataclass(frozen=True)
class _Stored:
    """Where one item went (a write result's ``storage_data``), for the coordinator's record."""

    layer: str
    pack: PackRef
    entry: Entry
    created: bool
    bases: tuple[PackRef, ...] = ()  # what this rank's deltas in the layer need


class StoreWriter(StorageWriter):
    """DCP's ``StorageWriter`` that saves ``dcp.save``'s state as step ``step`` of ``store``.

    ``layers``: the layers to save (names as ``store.sources`` lists them); the others are
    inherited from the newest earlier step, which must be a DCP step of the same state (None:
    save everything). Everything that is not a parameter's tensor is saved every time.
    ``metrics``: numbers recorded with the step (for ``gc --keep-best``). With a tier and
    ``replicas``, each rank's packs are copied into its peers' tiers behind the save, as a
    commit's are (``Store.replicate_behind``). Every rank passes the same arguments. Raises (through DCP, on every rank) ConflictError if the step exists,
    BadInputError for layers that cannot be saved alone.
    """

    def __init__(
        self,
        store: StoreParts,
        step: int,
        layers: Iterable[str] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        super().__init__()
        self.store = store
        self.step = require_int(step, "step", minimum=0)
        if isinstance(layers, str):
            raise BadInputError("layers= takes a list of layer names, not a single string")
        self.layers = None if layers is None else list(dict.fromkeys(layers))
        self.metrics = check_metrics(metrics)
        self.is_coordinator = False
        self.rank = 0
        self._paths: dict[str, tuple] = {}
        self._save_id = uuid.uuid4().hex
        self._started = time.monotonic()
        tier = getattr(store, "tier", None)
        if tier is not None and tier.replicas:
            ranks.use_commit_group()  # here, on every rank's main thread: async_save writes on another

    # -- DCP's set-up ------------------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new save: nothing carries over from the last one but the arguments."""
        self._paths = {}
        self._save_id = uuid.uuid4().hex

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A store step is named by ``StoreWriter(store, step)``, never by a checkpoint id."""
        return False

    def storage_meta(self) -> StorageMeta | None:
        """The step this save writes, as DCP records its checkpoint id."""
        return StorageMeta(checkpoint_id=f"{self.store.objects.uri}@{self.step}", save_id=self._save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Check that the step can be committed, on every rank before anything is written."""
        self.is_coordinator = is_coordinator
        self._started = time.monotonic()  # the save's duration, recorded with the step
        self.rank = kwargs.get("rank") if kwargs.get("rank") is not None else ranks.world()[0]
        with self.store.objects.local_only():  # through a local tier: never the store behind it
            check_new_step(self.store.catalog, self.step)
        if is_coordinator:
            config.upgrade(self.store.objects)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Keep the planner's key paths: they name the items (``dcp.naming``)."""
        self._paths = dict(plan.planner_data) if isinstance(plan.planner_data, dict) else {}
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Decide, once, the layers this step saves, and tell every rank."""
        paths: dict[str, tuple] = {}
        fqns: list[str] = []
        for plan in plans:
            if isinstance(plan.planner_data, dict):
                paths.update(plan.planner_data)
            fqns.extend(item.index.fqn for item in plan.items)
        names = name_items(list(dict.fromkeys([*paths, *fqns])), paths)
        layers = list(dict.fromkeys(n.layer for n in names.values() if n.layer != STATE_LAYER))
        saved = frozenset(self._saved_layers(layers)) | {STATE_LAYER}
        return [dataclasses.replace(plan, storage_data=_Saved(saved)) for plan in plans]

    def _saved_layers(self, layers: list[str]) -> list[str]:
        if self.layers is None:
            return layers
        unknown = [layer for layer in self.layers if layer not in layers]
        if unknown:
            raise BadInputError(
                f"unknown layers {', '.join(unknown)}; the state's layers are {', '.join(layers)}"
            )
        if len(self.layers) < len(layers):
            self._inheritable(layers)  # raises why not
        return self.layers

    def _inheritable(self, layers: list[str]) -> int:
        """The step this one inherits from; BadInputError if there is none it may inherit from."""
        catalog = self.store.catalog
        previous = catalog.latest_step(before=self.step)
        if previous is None:
            raise BadInputError(
                f"step {self.step} would be the store's first step, so it must save every layer (layers=None)"
            )
        description = json.loads(catalog.description(previous))
        if not is_dcp_step(description):
            raise BadInputError(
                f"step {previous} was committed from a DeepSpeed engine; a DCP step cannot inherit its "
                "layers: save every layer (layers=None)"
            )
        if catalog.is_weights_only(previous):
            raise BadInputError(
                f"step {previous} keeps only its weights (gc made it weights-only), so layers cannot be "
                "inherited from it; save every layer (layers=None)"
            )
        theirs = [layer for layer in catalog.sources(previous) if layer != STATE_LAYER]
        if theirs != layers:
            raise BadInputError(
                f"the state's layers changed since step {previous}, so layers cannot be inherited from it; "
                "save every layer (layers=None)"
            )
        return previous

    # -- writing -----------------------------------------------------------------------------

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Store this rank's items of the saved layers in packs; durable when the future is done."""
        saved = plan.storage_data.layers
        names = name_items(
            list(dict.fromkeys([*self._paths, *(i.index.fqn for i in plan.items)])), self._paths
        )
        pieces, items, layer_of_piece = [], {}, {}
        for item in plan.items:
            named = names[item.index.fqn]
            if named.layer not in saved:
                continue
            piece = _piece(item, named, planner.resolve_data(item))
            pieces.append(piece)
            key = (piece.name, piece.kind, piece.start)
            items[key] = item
            layer_of_piece[key] = named.layer
        versions = getattr(self.store, "delta_versions", lambda: None)()
        with self.store.objects.lock(exclusive=False):
            stored = store_pieces(
                self.store.objects,
                self.rank,
                pieces,
                layer=lambda piece: layer_of_piece[(piece.name, piece.kind, piece.start)],
                versions=versions,
            )
            self.store.objects.note_share(self.step, self.rank, stored.object_names())
        results = []
        for layer, packs in stored.layers.items():
            for ref, entries in packs:
                for entry in entries:
                    item = items[(entry[0], entry[1], entry[3])]
                    nbytes = entry[4] * codec.DTYPES[entry[2]].itemsize
                    where = _Stored(
                        layer, ref, entry, ref.key in stored.created, tuple(stored.bases.get(layer, ()))
                    )
                    results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=where))
        replicate = getattr(self.store, "replicate_behind", None)
        if replicate is not None:  # the packs are durable: copies go to the peers behind the save
            replicate(self.step)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """On the coordinator: record the step (the manifest, then the catalog), its packs and
        DCP's metadata; ConflictError if another writer committed the step meanwhile."""
        catalog, objects = self.store.catalog, self.store.objects
        with objects.lock(exclusive=False), objects.local_only():
            check_new_step(catalog, self.step)
            wrote = [result.storage_data for rank_results in results for result in rank_results]
            names = name_items(list(metadata.state_dict_metadata), metadata.planner_data)
            model = list(dict.fromkeys(n.layer for n in names.values() if n.layer != STATE_LAYER))
            # A state of tensors alone (policy weights) has no state layer: one with nothing in it
            # would be a layer its step holds no tensors for.
            layers = model + [STATE_LAYER] * any(n.layer == STATE_LAYER for n in names.values())
            saved = set(layers) if self.layers is None else set(self.layers) | {STATE_LAYER}
            previous = self._inheritable(model) if set(layers) - saved else None
            sources = {layer: self.step if layer in saved else None for layer in layers}
            plain = plain_metadata.to_plain(metadata)
            if previous is not None:
                before = json.loads(catalog.description(previous))
                theirs = catalog.sources(previous)
                for layer in layers:
                    if sources[layer] is None:
                        sources[layer] = theirs[layer]
                # An inherited item is stored as its source saved it: its chunks are those.
                for fqn, named in names.items():
                    if named.layer not in saved and fqn in before["dcp"]["items"]:
                        plain["items"][fqn] = before["dcp"]["items"][fqn]
            description = _description(plain, names, ranks.world()[1])
            packs = _layer_indexes(self.step, wrote)
            created = {w.pack.key: w.pack.size for w in wrote if w.created}
            record = build_record(
                catalog,
                self.step,
                ranks.world()[1],
                description,
                sources,
                packs,
                {},
                [],
                created,
                self.metrics,
                time.monotonic() - self._started,
            )
            publish(objects, catalog, record, samples={})


def _piece(item: WriteItem, named: ItemName, data: Any) -> Piece:
    """The piece that stores ``item``'s data: a bytes item as bytes, a chunk as its box."""
    if item.type == WriteItemType.BYTE_IO:
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        stored = bytesitems.keep(raw, item.index.fqn)  # plain data: what goes out is ckptstore's own
        return Piece(named.name, named.kind, 0, torch.frombuffer(bytearray(stored), dtype=torch.uint8))
    # A GPU tensor stays there: it is hashed and encoded a chunk at a time (format/devicecopy.py),
    # never copied to the host whole, and never all of them at once.
    tensor = data.detach()
    chunk = item.tensor_data.chunk
    return Piece(
        named.name, named.kind, chunks.chunk_start(chunk.offsets, item.tensor_data.size), tensor.contiguous()
    )


def _layer_indexes(step: int, wrote: list[_Stored]) -> dict[str, layerpacks.LayerPacks]:
    """The fragment index of every layer the ranks wrote, packs in rank order."""
    by_layer: dict[str, dict[str, tuple[PackRef, list[Entry]]]] = defaultdict(dict)
    bases: dict[str, list[PackRef]] = defaultdict(list)
    for where in wrote:
        ref, entries = by_layer[where.layer].setdefault(where.pack.key, (where.pack, []))
        entries.append(where.entry)
        bases[where.layer].extend(where.bases)
    return {
        layer: layerpacks.build(
            step, layer, sorted(packs.values(), key=lambda p: (p[0].rank, p[0].key)), bases[layer]
        )
        for layer, packs in by_layer.items()
    }


def _description(plain: dict, names: dict[str, ItemName], world_size: int) -> dict:
    """A DCP step's description: DCP's metadata, how its items are named, and the shape that
    bounds each stored name (``layerpacks.decode``): the largest of its tensors."""
    params: dict[str, dict] = {}
    for fqn, item in plain["items"].items():
        named = names[fqn]
        if item.get("bytes"):
            continue  # a bytes item's length is bounded by its referrer (the pack's raw size)
        if named.name not in params or math.prod(item["size"]) > math.prod(params[named.name]["shape"]):
            params[named.name] = {"shape": item["size"]}
    return {
        "format": DCP_FORMAT,
        "world_size": world_size,
        "dcp": plain,
        # A list, in the state dict's order (the description's keys are sorted).
        "names": [[fqn, n.name, n.kind, n.layer] for fqn, n in names.items()],
        "params": params,
    }
