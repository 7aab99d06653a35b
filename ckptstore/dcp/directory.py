"""A DCP step as a standard DCP checkpoint directory, written by DCP's own ``FileSystemWriter``.

The stored chunks are handed to the writer as one save plan, each chunk as it was saved, so
the directory holds the same boxes DCP planned (``FileSystemReader``, ``dcp.load`` at any
world size and ``format_utils.dcp_to_torch_save`` read it). Bytes items go out as ckptstore
``torch.save``s them from their plain data (``bytesitems``): DCP's reader unpickles them with
``weights_only=False``, and whoever can write the store chose the stored bytes. ``.metadata``, DCP's other pickle, is DCP's ``Metadata`` rebuilt
from the description's JSON (``metadata.from_plain``): DCP's classes holding builtin values,
never bytes from the store. The directory is built beside ``out`` and renamed into place,
with the marker that lets ``--force`` replace it later.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from ..catalog import Catalog
from ..errors import BadInputError, CorruptError
from ..materialize import outputs
from ..objects import ObjectStore
from . import bytesitems, chunks
from . import metadata as plain_metadata


class _StoredChunks:
    """What ``FileSystemWriter.write_data`` asks a planner for: each item's data, fetched from
    the store (and verified) only when the writer gets to it. A bytes item goes out as
    ``bytesitems.give`` says (the writer asks for the bytes items first, so a refused one
    stops it before any tensor is written)."""

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
            stored = tensor.numpy().tobytes()
            fqn, step = item.index.fqn, self.fetcher.step
            return io.BytesIO(bytesitems.give(stored, fqn, step, allow_pickle=self.allow_pickle))
        return tensor


def refused_bytes_items(
    objects: ObjectStore, catalog: Catalog, step: int, description: dict
) -> list[tuple[str, str, str, str]]:
    """``(item, its pack, its layer, problem)`` of each bytes item of DCP step ``step`` that
    ``materialize`` refuses: kept as bytes (``bytesitems.problem``) or malformed plain data
    (``verify`` reports them). Raises CorruptError or NotFoundError for a chunk that cannot be
    read."""
    found = chunks.locations(description, catalog.sources(step), step)
    items = {fqn: where for (fqn, offsets), where in found.items() if offsets is None}
    fetcher = chunks.ChunkFetcher(objects, catalog, step, items.values())
    refused = []
    for fqn, where in items.items():
        stored = fetcher.fetch(where).numpy().tobytes()
        problem = bytesitems.problem(stored)
        if problem is None:
            try:
                bytesitems.give(stored, fqn, step, allow_pickle=False)
            except CorruptError as exc:
                problem = f"is malformed ({exc})"
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
    CorruptError, with nothing written, for a bytes item kept as bytes, not plain data,
    unless ``allow_pickle``."""
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
    and for a bytes item kept as bytes, not plain data, unless ``allow_pickle``."""
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
    with outputs.building(out, "materialize", step) as staging:
        writer = FileSystemWriter(staging, single_file_per_rank=True, sync_files=True)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        plan = writer.prepare_local_plan(SavePlan(items))
        (plan,) = writer.prepare_global_plan([plan])
        results = writer.write_data(plan, _StoredChunks(fetcher, where, allow_pickle)).wait()
        writer.finish(metadata, [results])
    return out
