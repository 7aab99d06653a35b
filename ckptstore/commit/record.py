"""The commit point: a step's record built once, then published as manifest and catalog rows.

Write order: every pack first (``commit.packs``), then the manifest, then the catalog rows.
The manifest, written create-only in one request, is the commit point on every backend; the
catalog only indexes it (``catalog.sync``), so a commit that dies after its manifest is a
committed step, which the next open lists. Of two writers of one step, the second finds the
first's manifest and fails without touching it. A step deleted before is committed at the
generation above its deletion (``format.deletions``): no manifest name is ever written twice.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from datetime import datetime, timezone

from ..catalog import Catalog
from ..errors import BadInputError, ConflictError, StorageError, clip
from ..format import deletions, manifest
from ..format.layout import manifest_name
from ..model import FileRow, LayerPacks, QueueFigures, StepRecord, Updates, layers_by_source
from ..objects import ObjectStore


def check_metrics(metrics: Mapping[str, float] | None) -> dict[str, float | None]:
    """``commit(metrics=...)`` as recorded: name -> float, a value that is not finite (a NaN
    loss) as None. BadInputError for anything but a mapping of non-empty names to real numbers."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise BadInputError(f"metrics= takes a mapping of names to numbers, not {type(metrics).__name__}")
    checked: dict[str, float | None] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise BadInputError(f"metrics=: {name!r} is not a metric name (a non-empty string)")
        if isinstance(value, bool) or not isinstance(value, int | float) and not hasattr(value, "__float__"):
            raise BadInputError(f"metrics=: {name} is {value!r}, not a number")
        try:
            value = float(value)
        except (TypeError, ValueError, OverflowError):  # an int past float's range, a bad __float__
            raise BadInputError(f"metrics=: {name} is {clip(repr(value), 40)}, not a number") from None
        checked[name] = value if math.isfinite(value) else None
    return dict(sorted(checked.items()))


def build_record(
    catalog: Catalog,
    step: int,
    world_size: int,
    description: dict,
    layer_sources: dict[str, int],
    packs: dict[str, LayerPacks],
    updates: Updates,
    files: list[FileRow],
    created: dict[str, int],
    metrics: dict[str, float | None] | None = None,
    seconds: float | None = None,
    queued: QueueFigures | None = None,
) -> StepRecord:
    """The step's record: the pack indexes of the layers it saved (``packs``) plus, from the
    catalog, what every layer it inherits is stored as (pack indexes, or tensor rows and blob
    sizes where a format-1 step saved it), so that the record stands alone. ``created``: the
    packs this commit added to the store (key -> stored size); ``seconds``: how long the commit
    took up to now (kept to the microsecond, as the manifest keeps it); ``queued``: what a
    non-blocking commit's queue measured and decided."""
    packs = dict(packs)
    inherited = []
    for source, layers in layers_by_source(layer_sources).items():
        if source == step:
            continue
        packs.update((index.layer, index) for index in catalog.layer_packs(source, layers))
        inherited += catalog.tensors(source, [layer for layer in layers if layer not in packs])
    return StepRecord(
        step=step,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        world_size=world_size,
        description=json.dumps(description, sort_keys=True, separators=(",", ":")),
        layer_sources=layer_sources,
        tensors=inherited,
        blobs=list(catalog.blob_sizes(row.blob for row in inherited).values()),
        packs={layer: packs[layer] for layer in layer_sources if layer in packs},
        updates=updates,
        files=files,
        added=(len(created), sum(created.values())),
        metrics=metrics or {},
        seconds=None if seconds is None else round(seconds, 6),
        stall=None if queued is None or queued.stall is None else round(queued.stall, 6),
        not_committed=[] if queued is None else list(queued.not_committed),
    )


def publish(
    objects: ObjectStore,
    catalog: Catalog,
    record: StepRecord,
    *,
    samples: dict[str, bytes],
) -> tuple[int, bytes]:
    """Write ``record``'s manifest, the commit point, then its catalog rows; returns the
    manifest's generation (``deletions.next_generation``: the store's deletion record is listed
    again, except through a local tier, which asks the remote nothing) and bytes.

    The step is committed once the manifest is written; if recording the rows fails after
    that, the error is raised but the step stays committed (the next open lists it).
    ``samples``: the update-statistics samples of the layers it saved. Raises ConflictError if
    another writer committed the step first; that writer's manifest is left as it is;
    StorageError saying the step is committed when the catalog cannot record it (disk full).
    """
    generation = deletions.next_generation(
        objects, catalog.deletions, record.step, ask=not hasattr(objects, "private_catalog")
    )
    record.supersedes = generation - 1 if generation else None
    name = manifest_name(record.step, generation)
    data = manifest.encode(record, objects.content_hash, generation)
    # "Already there" is also the answer to a retried write whose first reply was lost.
    if not objects.put_if_absent(name, data, single_request=True) and objects.get(name) != data:
        raise ConflictError(
            f"step {record.step} is already committed: {objects.uri} got its manifest from another "
            "writer after this store was opened"
        )
    # Another process sharing the catalog may have imported the manifest already.
    try:
        catalog.record_step(record, samples=samples, if_absent=True, generation=generation)
    except StorageError as exc:
        raise StorageError(
            f"step {record.step} is committed (its manifest {name} is written) but not recorded: {exc}; "
            "the next open of the store lists it",
            transient=exc.transient,
        ) from None
    return generation, data
