"""A DCP step as a standard DCP checkpoint directory, written by DCP's own ``FileSystemWriter``.

The stored chunks are handed to the writer as one save plan, each chunk as it was saved, so
the directory holds the same boxes DCP planned (``FileSystemReader``, ``dcp.load`` at any
world size and ``format_utils.dcp_to_torch_save`` read it). Bytes items are passed on as the
bytes the user's job gave DCP, once they load with ``torch.load(weights_only=True)``
(``format.pickled``): DCP's reader unpickles them with ``weights_only=False``, and whoever can
write the store chose them. ``.metadata``, DCP's other pickle, is DCP's ``Metadata`` rebuilt
from the description's JSON (``metadata.from_plain``): DCP's classes holding builtin values,
never bytes from the store. The directory is built beside ``out`` and renamed into place,
with the marker that lets ``--force`` replace it later.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ..catalog import Catalog
from ..errors import BadInputError, CorruptError
from ..format import pickled
from ..materialize import outputs
from ..objects import ObjectStore
from . import chunks
from . import metadata as plain_metadata


class _StoredChunks:
    """What ``FileSystemWriter.write_data`` asks a planner for: each item's data, fetched from
    the store (and verified) only when the writer gets to it. A bytes item with a
    ``bytes_item_problem`` is a CorruptError unless ``allow_pickle`` (the writer asks for the
    bytes items first, so no tensor is written before)."""

    def __init__(
        self,
        fetcher: chunks.ChunkFetcher,
        where: dict[MetadataIndex, chunks.ChunkLocation],
        allow_pickle: bool,
    ) -> None:
        self.fetcher, self.where, self.allow_pickle = fetcher, where, allow_pickle

    def resolve_data(self, item: WriteItem) -> torch.Tensor | io.BytesIO:
        tensor = self.fetcher.fetch(self.where[item.index])
        if item.type == WriteItemType.BYTE_IO:
            raw = tensor.numpy().tobytes()
            problem = None if self.allow_pickle else bytes_item_problem(raw)
            if problem:
                raise CorruptError(
                    f"step {self.fetcher.step}'s DCP bytes item {item.index.fqn} {problem}: DCP's "
                    "FileSystemReader would run code from it (if everyone who can write the store is "
                    "trusted: materialize --allow-pickle)"
                )
            return io.BytesIO(raw)
        return tensor


def bytes_item_problem(raw: bytes) -> str | None:
    """What is wrong with a DCP bytes item's bytes, or None: DCP loads them with ``torch.load``,
    so they must load with ``weights_only=True`` (``format.pickled.torch_refusal``)."""
    reason = pickled.torch_refusal(raw)
    return reason and f"holds a pickle that needs more than torch.load(weights_only=True) ({reason})"


def refused_bytes_items(
    objects: ObjectStore, catalog: Catalog, step: int, description: dict
) -> list[tuple[str, str, str, str]]:
    """``(item, its pack, its layer, problem)`` of each bytes item of DCP step ``step`` with a
    ``bytes_item_problem``: what ``materialize`` refuses (``verify`` reports them). Raises
    CorruptError or NotFoundError for a chunk that cannot be read."""
    found = chunks.locations(description, catalog.sources(step), step)
    items = {fqn: where for (fqn, offsets), where in found.items() if offsets is None}
    fetcher = chunks.ChunkFetcher(objects, catalog, step, items.values())
    refused = []
    for fqn, where in items.items():
        problem = bytes_item_problem(fetcher.fetch(where).numpy().tobytes())
        if problem:
            refused.append((fqn, fetcher.pack_of(where).key, where.layer, problem))
    return refused


def materialize_dcp(
    objects: ObjectStore,
    catalog: Catalog,
    step: int,
    description: dict,
    out: Any,
    *,
    force: bool,
    world_size: Any,
    tag: Any,
    allow_pickle: bool = False,
) -> Path:
    """``Store.materialize`` of a step saved through DCP: ``out`` checked as any output
    (``outputs.check_out``), then written as a DCP checkpoint directory. BadInputError for a
    ``world_size`` or ``tag``, which a DCP directory has no use for (DCP reshards at load);
    CorruptError, with nothing written, for a bytes item that needs more than
    ``torch.load(weights_only=True)``, unless ``allow_pickle``."""
    if world_size is not None or tag is not None:
        raise BadInputError(
            f"step {step} was saved through DCP: its directory loads at any world size (DCP reshards) "
            "and has no tag; leave out world_size and tag"
        )
    store_root = getattr(objects, "root", None)
    path = outputs.check_out(out, force=force, store_root=store_root, verb="materialize")
    return write_directory(objects, catalog, step, description, path, allow_pickle=allow_pickle)


def write_directory(
    objects: ObjectStore,
    catalog: Catalog,
    step: int,
    description: dict,
    out: Path,
    *,
    allow_pickle: bool = False,
) -> Path:
    """Write DCP step ``step`` (``description``: its description, parsed, as
    ``dcp_description`` gives it) as a DCP checkpoint directory at ``out`` (checked by the
    caller with ``outputs.check_out``). Raises CorruptError for a chunk that does not verify,
    and for a bytes item with a ``bytes_item_problem`` unless ``allow_pickle``."""
    metadata = plain_metadata.from_plain(description["dcp"])
    found = chunks.locations(description, catalog.sources(step), step)
    items, where = [], {}
    for (fqn, offsets), location in found.items():
        entry = metadata.state_dict_metadata[fqn]
        if offsets is None:
            index = MetadataIndex(fqn)
            items.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
        else:
            index = MetadataIndex(fqn, torch.Size(offsets))
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(location.sizes))
            data = TensorWriteData(chunk=chunk, properties=entry.properties, size=entry.size)
            items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        where[index] = location
    fetcher = chunks.ChunkFetcher(objects, catalog, step, where.values())
    staging = outputs.staging_dir(out)
    try:
        writer = FileSystemWriter(staging, single_file_per_rank=True, sync_files=True)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        plan = writer.prepare_local_plan(SavePlan(items))
        (plan,) = writer.prepare_global_plan([plan])
        results = writer.write_data(plan, _StoredChunks(fetcher, where, allow_pickle)).wait()
        writer.finish(metadata, [results])
        outputs.mark(staging, "materialize", step)
        outputs.swap_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
