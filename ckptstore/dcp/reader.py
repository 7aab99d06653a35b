"""DCP's ``StorageReader`` on a store: ``dcp.load`` reads a store step (``StoreReader``).

``read_metadata`` rebuilds DCP's metadata from the step's description; ``read_data`` fetches
only the chunks this rank's read plan names (the pack's index, then each entry by a ranged
read), verifies each against its content key and lets DCP copy and reshard it. A bytes item
is handed to DCP as ckptstore ``torch.save``s it from its plain data (``bytesitems``).
"""

from __future__ import annotations

import io
import json
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .. import knobs
from ..catalog import sync
from ..errors import BadInputError, CorruptError, NotFoundError, require_int
from ..format.layout import pack_name
from ..model import PackRef
from . import StoreParts, bytesitems, chunks, is_dcp_step
from . import metadata as plain_metadata

__all__ = ["StoreReader"]


class StoreReader(StorageReader):
    """DCP's ``StorageReader`` that loads step ``step`` of ``store`` (None: the newest step)
    into ``dcp.load``'s state, at any world size and sharding (DCP reshards). Through a tier
    with ``replicas``, what this node's tier lacks comes from the job's other tiers first, and
    the newest step is the newest the job can assemble (every rank makes its reader). Raises
    NotFoundError for a step that does not exist, BadInputError for one a DeepSpeed engine
    committed, CorruptError (through DCP) for a chunk that does not verify, and for a bytes item
    kept as its bytes rather than plain data unless ``allow_pickle`` (everyone who can write
    the store is trusted: DCP unpickles it with ``weights_only=False``)."""

    def __init__(self, store: StoreParts, step: int | None = None, *, allow_pickle: bool = False) -> None:
        super().__init__()
        self.store = store
        self.allow_pickle = allow_pickle is True
        self.step = None if step is None else require_int(step, "step", minimum=0)
        self._where: dict[MetadataIndex, chunks.ChunkLocation] = {}
        self._read_step: int | None = None
        # (step, its DCP metadata as plain data, its chunks' locations): see ``_described``.
        self._described_step: tuple[int, dict, dict] | None = None
        tier = getattr(store, "tier", None)
        # With replicas a load reads what this node's tier lacks from the job's other tiers
        # (``tier.recover``), collectively, as a restore does; set up here, on every rank.
        self._recovery = tier.recovery(store.objects, store.catalog) if tier is not None else None

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new load: the step is looked up again."""
        self._where = {}
        self._described_step = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """A store step is named by ``StoreReader(store, step)``, never by a checkpoint id."""
        return False

    def _resolve_step(self) -> int:
        catalog, objects = self.store.catalog, self.store.objects
        if self.step is None:
            sync.sync(catalog, objects)  # a step the coordinator of another process just committed
            step = catalog.latest_step()
            if step is None:
                raise NotFoundError(f"{objects.uri} has no steps yet")
            return step
        if not catalog.has_step(self.step):
            try:
                sync.import_step(catalog, objects, self.step)
            except NotFoundError:
                pass  # named below, with the steps there are
        return self.step

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata of the step, from its description (no pickle), with where each
        chunk is stored as its ``storage_data``."""
        step = self._resolve_step() if self._recovery is None else self._recover_step()
        plain, found = self._described(step)
        metadata = plain_metadata.from_plain(plain)  # DCP's own, new for every load
        metadata.storage_data = {
            MetadataIndex(fqn, None if offsets is None else torch.Size(offsets)): where
            for (fqn, offsets), where in found.items()
        }
        metadata.storage_meta = StorageMeta(checkpoint_id=f"{self.store.objects.uri}@{step}")
        self._read_step = step
        return metadata

    def _recover_step(self) -> int:
        """``_resolve_step`` across the job's tiers: every manifest any node holds is in this
        node's catalog first, and the newest step is the newest the job can assemble."""
        self._recovery.share_manifests("dcp.load")
        if self.step is None:
            return self._recovery.newest("dcp.load")
        return self._resolve_step()

    def _described(self, step: int) -> tuple[dict, dict]:
        """Step ``step``'s DCP metadata as plain data and its chunks' locations, from its
        description: parsed once per reader and step, as every rank calls ``read_metadata`` on
        every ``dcp.load``, and a Lightning resume loads several times through one reader."""
        if self._described_step is None or self._described_step[0] != step:
            description = json.loads(self.store.catalog.description(step))
            if not is_dcp_step(description):
                raise BadInputError(
                    f"step {step} was committed from a DeepSpeed engine, not through DCP: resume it with "
                    "store.restore(engine, step) or `ckptstore materialize`"
                )
            found = chunks.locations(description, self.store.catalog.sources(step), step)
            self._described_step = (step, description["dcp"], found)
        return self._described_step[1], self._described_step[2]

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Take the chunk locations ``read_metadata`` put in the metadata (they may come from
        another rank's reader)."""
        self._where = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Nothing to change: every rank reads for itself."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Nothing to change: every rank reads for itself."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Fetch, verify and hand DCP every chunk this rank's plan names."""
        step = self._read_step if self._read_step is not None else self._resolve_step()
        wanted: dict[chunks.ChunkLocation, list] = defaultdict(list)
        for request in plan.items:
            where = self._where.get(request.storage_index)
            if where is None:
                raise CorruptError(f"step {step} has no stored chunk for {request.storage_index.fqn}")
            wanted[where].append(request)
        fetcher = chunks.ChunkFetcher(self.store.objects, self.store.catalog, step, wanted)
        by_pack: dict[str, tuple[PackRef, list[chunks.ChunkLocation]]] = {}
        for where in wanted:
            ref = fetcher.pack_of(where)
            by_pack.setdefault(ref.key, (ref, []))[1].append(where)
        if self._recovery is not None:  # what this node's tier lacks, from the job's other tiers
            self._recovery.fetch(step, {pack_name(ref.key): ref.size for ref, _ in by_pack.values()})
            self.store.tier.restored_from = self._recovery.sources
        # A few packs in flight on I/O threads; DCP gets each chunk on this thread, as it is
        # fetched, so memory holds a few packs' chunks, not the rank's whole share.
        window = knobs.io_threads()
        jobs = list(by_pack.values())
        with ThreadPoolExecutor(window) as pool:
            pending = [pool.submit(fetcher.fetch_pack, ref, wheres) for ref, wheres in jobs[:window]]
            for i in range(len(jobs)):
                for where, tensor in pending[i].result():
                    for request in wanted[where]:
                        _deliver(planner, request, tensor, step, self.allow_pickle)
                pending[i] = None
                if i + window < len(jobs):
                    pending.append(pool.submit(fetcher.fetch_pack, *jobs[i + window]))
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _deliver(planner: LoadPlanner, request: Any, tensor: torch.Tensor, step: int, allow_pickle: bool) -> None:
    """Hand one read request its part of a fetched chunk."""
    if request.type == LoadItemType.BYTE_IO:
        stored = tensor.numpy().tobytes()
        raw = bytesitems.give(stored, request.storage_index.fqn, step, allow_pickle=allow_pickle)
        planner.load_bytes(request, io.BytesIO(raw))
        return
    part = narrow_tensor_by_index(tensor, request.storage_offsets, request.lengths)
    target = planner.resolve_tensor(request).detach()
    if target.size() != part.size():
        raise CorruptError(
            f"the stored chunk of {request.storage_index.fqn} gives {tuple(part.size())}, "
            f"DCP wants {tuple(target.size())}"
        )
    target.copy_(part)
    planner.commit_tensor(request, target)
