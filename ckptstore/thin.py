"""Weights-only steps: a step keeps what exporting its weights needs, not what resuming needs.

gc's ``keep_weights_every``/``keep_weights_last`` keep the steps they pick, and no other rule
keeps whole, as *weights-only*: their fp32 masters, frozen weights and buffers stay (``export``
and ``state_dict`` read nothing else), their optimizer state goes. Layers are thinned as
*units*, a layer as saved at its source step, because a composite step shares them: a unit
that any whole-kept (resumable) step uses stays whole.

A packed unit is thinned by copying the entries it keeps, byte for byte and verified, into
new packs (keyed by their contents, so thinning a unit again, or from another step, makes the
same packs); a format-1 unit just loses its other tensor rows. Each changed step's record is
then written as a new manifest generation (create-only, ``manifests/<step>.<generation>.json``;
other machines' indexes re-import it, ``catalog.sync``), the catalog takes the change in one
transaction, and older generations are deleted. The old packs are then unreferenced and go in
gc's sweep. A crash at any point leaves every step readable: until the catalog transaction
the old packs are referenced, and a rerun finishes the job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .catalog import Catalog
from .catalog.sync import read_manifest
from .errors import ConflictError
from .format import codec, layout, manifest, pack
from .format.layout import manifest_name, pack_name
from .materialize.bases import DeltaBases
from .materialize.fetch import fetch_pack_index
from .model import BUFFER, FP32, PACK, TENSOR, WEIGHT, LayerPacks, PackRef, StepRecord, TensorRow
from .objects import ObjectStore
from .progress import progress_bar

Unit = tuple[int, str]  # (source step, layer)


def is_weight(name: str, kind: str, masters: set[str]) -> bool:
    """Whether the stored ``kind`` of ``name`` is part of the weights: fp32 masters, buffers,
    and module weights of parameters without a master (frozen ones); ``masters`` names those
    with one."""
    return kind in (FP32, BUFFER) or (kind == WEIGHT and name not in masters)


def weights_to_keep(candidates: list[int], *, every: int | None, last: int | None) -> list[int]:
    """Of ``candidates`` (steps no other rule keeps whole, ascending), those the weights rules keep."""
    kept = set(candidates[-last:]) if last else set()
    if every:
        kept.update(step for step in candidates if step % every == 0)
    return sorted(kept)


@dataclass
class ThinReport:
    """What thinning changed: the steps made weights-only, the units rewritten, bytes saved."""

    steps: list[int] = field(default_factory=list)  # newly weights-only
    units: int = 0
    bytes_before: int = 0  # stored bytes of the rewritten packed units
    bytes_after: int = 0


def thin(
    objects: ObjectStore,
    catalog: Catalog,
    weights_only: list[int],
    whole: list[int],
    *,
    dry_run: bool = False,
) -> ThinReport:
    """Make ``weights_only`` steps keep only their weights, never touching what ``whole`` steps use.

    Call under the store's exclusive gc lock. With ``dry_run`` nothing is written; the report
    says what would change (its ``bytes_after`` from the packs' indexes).
    """
    already = catalog.weights_only_steps()
    report = ThinReport(steps=[s for s in weights_only if s not in already])
    needed = {(source, layer) for step in whole for layer, source in catalog.sources(step).items()}
    units: dict[Unit, list[int]] = {}
    for step in weights_only:
        for layer, source in catalog.sources(step).items():
            if (source, layer) not in needed:
                units.setdefault((source, layer), []).append(step)
    packed = {(i.step, i.layer): i for source in {s for s, _ in units} for i in catalog.layer_packs(source)}
    thinned: dict[Unit, LayerPacks] = {}
    dropped_rows: dict[Unit, list[TensorRow]] = {}
    for unit in progress_bar(sorted(units), total=len(units), desc="thin", unit="layer"):
        if unit in packed:
            index = thin_layer(objects, packed[unit], dry_run=dry_run)
            if index is not None:
                thinned[unit] = index
                report.bytes_before += packed[unit].size
                report.bytes_after += index.size
        else:
            rows = catalog.tensors(unit[0], [unit[1]])
            masters = {row.name for row in rows if row.kind == FP32}
            dropped = [row for row in rows if not is_weight(row.name, row.kind, masters)]
            if dropped:
                dropped_rows[unit] = dropped
    report.units = len(thinned) + len(dropped_rows)
    changed = sorted(set(report.steps) | {s for unit in [*thinned, *dropped_rows] for s in units[unit]})
    if dry_run or not changed:
        return report
    generations = catalog.generations()
    gone = {
        (row.step, row.layer, row.name, row.kind, row.start) for rows in dropped_rows.values() for row in rows
    }
    older: list[str] = []
    records = []
    for step in changed:
        record = read_manifest(objects, step, generations[step])
        _rewrite(record, thinned, gone)
        records.append(record)
        # Above every generation stored, not only the one read: in a store with a key a newer
        # one may be a forgery the catalog passed over, and must not stay the newest.
        stored = layout.generations_of(objects, step)
        generation = max([generations[step], *stored]) + 1
        older += [manifest_name(step, g) for g in stored if g <= generations[step]]
        if not objects.put_if_absent(
            manifest_name(step, generation),
            manifest.encode(record, objects.content_hash, generation),
            single_request=True,
        ):
            raise ConflictError(f"step {step} got a new manifest generation {generation} while gc rewrote it")
    catalog.record_weights_only(
        list(thinned.values()), [row for rows in dropped_rows.values() for row in rows], records
    )
    objects.delete_many(older)  # the names listed, not every number below: generations may be far apart
    return report


def _rewrite(record: StepRecord, thinned: dict[Unit, LayerPacks], gone: set[tuple]) -> None:
    """``record`` as a weights-only step: thinned units' indexes, dropped rows left out."""
    record.weights_only = True
    for layer, index in list(record.packs.items()):
        record.packs[layer] = thinned.get((index.step, layer), index)
    record.tensors = [t for t in record.tensors if (t.step, t.layer, t.name, t.kind, t.start) not in gone]
    used = {t.blob for t in record.tensors}
    record.blobs = [b for b in record.blobs if b.key in used]


def thin_layer(objects: ObjectStore, index: LayerPacks, *, dry_run: bool = False) -> LayerPacks | None:
    """``index`` with only its weights: each pack's weight entries copied (verified) into a new
    pack, written unless ``dry_run`` (then sized from the index alone). None if nothing is dropped."""
    masters = {name for name, kind, _ in index.tensors if kind == FP32}
    keep = [t for t, (name, kind, _) in enumerate(index.tensors) if is_weight(name, kind, masters)]
    if len(keep) == len(index.tensors):
        return None
    packs, renumber = [], np.full(len(index.packs), -1, dtype=np.int64)
    bases = DeltaBases(objects, index.bases)
    for p, ref in enumerate(index.packs):
        new = _thin_pack(objects, ref, masters, dry_run, bases)
        if new is not None:
            renumber[p] = len(packs)
            packs.append(new)
    tensor_renumber = np.full(len(index.tensors), -1, dtype=np.int64)
    tensor_renumber[keep] = np.arange(len(keep))
    fragments = index.fragments[np.isin(index.fragments[:, TENSOR], keep)].copy()
    fragments[:, TENSOR] = tensor_renumber[fragments[:, TENSOR]]
    fragments[:, PACK] = renumber[fragments[:, PACK]]
    # Kept deltas are stored whole again (``_thin_pack``): the thinned layer needs no bases.
    return LayerPacks(index.step, index.layer, packs, [index.tensors[t] for t in keep], fragments)


def _thin_pack(
    objects: ObjectStore, ref: PackRef, masters: set[str], dry_run: bool, bases: DeltaBases
) -> PackRef | None:
    """The pack of ``ref``'s weight entries (None if it holds none); ``bases``: its layer's."""
    if dry_run:
        entries = list(fetch_pack_index(objects, ref).values())
        kept = [e for e in entries if is_weight(e.name, e.kind, masters)]
        if not kept:
            return None
        share = sum(e.length for e in kept) / max(1, sum(e.length for e in entries))
        return PackRef(ref.key, ref.rank, int(ref.size * share), int(ref.raw_size * share))
    data = memoryview(objects.get(pack_name(ref.key)))
    kept = [
        e
        # Its entries' headers held to the layer index's size before any is decoded.
        for e in pack.whole_index(data, ref.key, ref.raw_size, objects.content_hash)
        if is_weight(e.name, e.kind, masters)
    ]
    if not kept:
        return None
    tensors = [
        pack.decode_entry(data[e.offset :], e, None, objects.content_hash, bases.of(e)) for e in kept
    ]  # verified before copying
    # A whole entry is copied byte for byte; a delta is stored whole, so that the weights-only
    # step needs none of the old packs (optimizer state and all) its chain went through.
    key, parts, _ = pack.assemble(
        [
            (e.name, e.kind, e.start, e.key, [data[e.offset : e.offset + e.length]])
            if e.base is None
            else (e.name, e.kind, e.start, e.key, codec.encode_parts(tensor, e.key)[1])
            for e, tensor in zip(kept, tensors, strict=True)
        ],
        objects.content_hash,
    )
    objects.put_if_absent(pack_name(key), parts)
    size = sum(memoryview(part).nbytes for part in parts)
    return PackRef(key, ref.rank, size, sum(t.numel() * t.element_size() for t in tensors))
