"""Materialize: a DeepSpeed checkpoint directory for a step, built aside and swapped into place.

The directory is written into a staging directory beside the output (``deepspeed.write``
streams the tensors out of a ``StepReader``), the step's auxiliary files are copied in, and
the staging directory is renamed over the output: ``latest`` never appears in a partial
checkpoint. Where the output may go and what ``force`` may replace: ``outputs``.
"""

from __future__ import annotations

import json
import math
import os
import resource
from collections.abc import Collection
from pathlib import Path

from .. import auxfiles, fused_experts
from ..catalog import Catalog
from ..errors import BadInputError, CorruptError, WeightsOnlyError, require_int
from ..model import FileRow, layers_by_source
from ..objects import ObjectStore
from . import compose, outputs
from .reader import StepReader


def materialize(
    objects: ObjectStore,
    catalog: Catalog,
    step: int | None,
    out: str | os.PathLike | None,
    *,
    spec: compose.Spec | None = None,
    world_size: int | None = None,
    force: bool = False,
    tag: str | None = None,
    allow_pickle: bool = False,
    ep_size: int | None = None,
) -> Path:
    """Write ``step`` (or the step a compose ``spec`` names) as a DeepSpeed directory at ``out``.

    Contract as ``Store.materialize``: returns the absolute output path; nothing is written
    unless every check passes (``outputs.check_out``: ``force`` replaces only a folder
    materialize or export wrote), and ``out`` never holds a partial checkpoint.
    """
    from ..deepspeed import experts
    from ..deepspeed.stepfiles import write_checkpoint

    step, sources = compose.step_or_spec(step, spec, catalog, "materialize")
    if world_size is not None:
        require_int(world_size, "world_size", minimum=1)
    check_resumable(catalog, step, sources)
    description = json.loads(catalog.description(step))
    if world_size is not None:
        check_world_size(world_size, description)
    if ep_size is not None:
        require_int(ep_size, "ep_size", minimum=1)
    description = experts.with_ep_size(description, ep_size, world_size or description["world_size"], step)
    out = outputs.check_out(out, force=force, store_root=getattr(objects, "root", None), verb="materialize")
    tag = f"global_step{step}" if tag is None else tag
    files = catalog.files(step)
    auxfiles.check_rows(files, step)
    check_tag(tag, files)
    tensors = step_reader(objects, catalog, step, description, sources, readahead=True)

    with outputs.building(out, "materialize", step) as staging:
        write_checkpoint(description, tensors, staging, tag, world_size)
        auxfiles.copy_out(objects, files, staging, step, allow_pickle=allow_pickle)
    return out


def check_world_size(world_size: int, description: dict) -> None:
    """BadInputError unless a checkpoint of ``description`` can be written for ``world_size``
    ranks: at most one rank per trainable parameter element, and, since a rank's files are
    written at once, fewer ranks than the files this process may open (``ulimit -n``)."""
    elements = sum(math.prod(p["shape"]) for p in description["params"].values() if p.get("trainable"))
    files, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits = [(max(1, elements), "one rank per trainable parameter element")]
    if files != resource.RLIM_INFINITY:
        limits.append((max(1, files - _SPARE_FILES), f"one open file per rank, ulimit -n is {files}"))
    limit, why = min(limits)
    if world_size > limit:
        raise BadInputError(f"world_size must be at most {limit} ({why}), not {world_size}")


# Files a materialize keeps open besides one per rank (the store's objects, the interpreter's).
_SPARE_FILES = 64


def check_resumable(catalog: Catalog, step: int, sources: dict[str, int] | None = None) -> None:
    """WeightsOnlyError if ``step`` (or a step a compose plan takes layers from) keeps only its weights."""
    steps = {step} | set((sources or {}).values())
    weights_only = sorted(s for s in steps if catalog.is_recorded(s) and catalog.is_weights_only(s))
    if weights_only:
        which = "step" if len(weights_only) == 1 else "steps"
        raise WeightsOnlyError(
            f"{which} {', '.join(map(str, weights_only))} keep{'s' if len(weights_only) == 1 else ''} only "
            "weights (gc --keep-weights-...) and cannot be materialized; export still works "
            "(ckptstore export / store.export)"
        )


def check_tag(tag: str, files: list[FileRow]) -> None:
    """BadInputError unless ``tag`` can name the checkpoint folder beside the step's ``files``."""
    if not isinstance(tag, str) or not tag or tag in (".", "..", "latest") or any(c in tag for c in "/\\\0"):
        raise BadInputError(
            f"the tag {tag!r} cannot name a checkpoint folder (one path component, not 'latest')"
        )
    clash = [row.path for row in files if row.path.split("/")[0] == tag]
    if clash:
        raise BadInputError(
            f"the tag {tag!r} is the name of a file kept with the step ({clash[0]}); choose another"
        )


def step_reader(
    objects: ObjectStore,
    catalog: Catalog,
    step: int,
    description: dict,
    sources: dict[str, int] | None = None,
    only: Collection[tuple[str, str]] | None = None,
    readahead: bool = False,
) -> StepReader | fused_experts.ExpertJoin:
    """A lazy reader of every tensor ``step`` needs (or the layers ``sources`` maps to steps),
    or of the ``(name, kind)`` tensors in ``only``; ``readahead`` for a caller that reads every
    one of them (``StepReader``). A fused expert parameter is served whole from its experts'
    pieces (``fused_experts.ExpertJoin``)."""
    sources = catalog.sources(step) if sources is None else sources
    packs = [
        index
        for source, layers in layers_by_source(sources).items()
        for index in catalog.layer_packs(source, layers)
    ]
    packed = {index.layer for index in packs}
    rows = [
        row
        for source, layers in layers_by_source(sources).items()
        for row in catalog.tensors(source, [layer for layer in layers if layer not in packed])
    ]
    missing_layers = set(sources) - packed - {row.layer for row in rows}
    if missing_layers:
        raise CorruptError(
            f"the catalog has no tensors for layers {', '.join(sorted(missing_layers))} of step {step}"
        )
    sizes = catalog.blob_sizes(row.blob for row in rows)
    params = description["params"]
    joined = fused_experts.fused(params)
    if only is not None and joined:  # a fused expert parameter is read from its experts' pieces
        only = {*only, *((part.name, kind) for name, kind in only for part in joined.get(name, ()))}
    reader = StepReader(
        objects, fused_experts.piece_params(params), rows, sizes, step, packs, only, readahead
    )
    return fused_experts.ExpertJoin(reader, params) if joined else reader
