"""Retention rules and mark-and-sweep garbage collection of blobs and auxiliary files.

Order of a collection, each phase safe to interrupt:
1. List the manifests. Every step found counts, recorded in the catalog or not (a commit that
   died after its manifest, a lost or fresh catalog).
2. Decide which steps to keep (keep-last, keep-every, explicit keeps) from the listing, and
   import the kept steps the catalog lacks (keep-best imports every step: it ranks them by
   their metrics); refuse to run while a kept step's manifest cannot be read, since the packs
   it needs are unknown, or is gone (those the catalog already holds are read again: gc runs
   only where ``verify`` finds every kept step's manifest). A dropped step's manifest is never read: it goes whatever it holds,
   so a gc of a fresh cache reads a handful of manifests, not thousands. Refuse to drop every
   step unless asked, and refuse to run at all if a kept step already misses a blob.
3. Drop the other steps: add them to the store's deletion record (``format.deletions``: their
   manifests are buried from then on, and their names never written again), drop their catalog
   rows in one transaction (tensor rows that a kept composite step still inherits stay), then
   delete their manifests, and any buried ones. Interrupted in between, the next gc deletes
   what is left. Without a key a deletion record is anyone's word (``PutObject`` alone writes
   one), so gc deletes only the buried manifests of the steps it drops itself; any other stays,
   and so does everything it needs (``deletions.kept_buried``): a record alone frees nothing.
4. Sweep: delete every pack, blob and stored auxiliary file (``files=``) no kept step (nor
   staying buried manifest) references and older than the grace period, and the unfinished
   writes (``.tmp``) killed writers left that are older than it too.

Concurrency. A commit holds the store's gc lock shared from choosing its layers to recording
its step; gc holds it exclusive from step 2 to the end. So a gc runs wholly before a commit
(the commit then finds deleted blobs missing and writes them again) or wholly after it (the
new step's blobs are referenced). That fences the one dangerous case: a commit that dedups
against an old orphan blob which the gc has already marked. The grace period is the second
line of defence, for writers that cannot take the lock (other machines, object stores
without one): blobs younger than it are never swept, and writers freshen the time of the
blobs they reuse. Two gc runs at once simply take turns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from .arguments import check_retention, check_seconds
from .catalog import Catalog, sync
from .errors import BadInputError, CorruptError, NotFoundError
from .format import deletions, layout
from .objects import ObjectInfo, ObjectStore
from .progress import progress_bar
from .retention import KeepBest, best_steps, steps_to_keep
from .thin import thin, weights_to_keep

log = logging.getLogger("ckptstore")


@dataclass
class GcReport:
    """What a gc run dropped and freed (or, with ``dry_run``, would drop and free)."""

    dry_run: bool
    steps_kept: list[int] = field(default_factory=list)
    steps_dropped: list[int] = field(default_factory=list)
    blobs_freed: int = 0
    bytes_freed: int = 0
    blobs_spared: int = 0  # unreferenced, but younger than the grace period
    bytes_spared: int = 0  # of blobs and auxiliary files
    files_freed: int = 0  # auxiliary files (files=); their bytes count in bytes_freed
    files_spared: int = 0
    steps_weights_only: list[int] = field(default_factory=list)  # kept, their weights only
    steps_thinned: list[int] = field(default_factory=list)  # of those, made weights-only by this run
    layers_thinned: int = 0  # layer units rewritten without their optimizer state
    # unfinished writes (``.tmp``) killed writers left, older than the grace period
    temporary_freed: int = 0
    temporary_bytes_freed: int = 0

    def as_dict(self) -> dict:
        """Plain dict for ``--json``."""
        return {
            "dry_run": self.dry_run,
            "steps_kept": self.steps_kept,
            "steps_dropped": self.steps_dropped,
            "blobs_freed": self.blobs_freed,
            "bytes_freed": self.bytes_freed,
            "blobs_spared": self.blobs_spared,
            "bytes_spared": self.bytes_spared,
            "files_freed": self.files_freed,
            "files_spared": self.files_spared,
            "steps_weights_only": self.steps_weights_only,
            "steps_thinned": self.steps_thinned,
            "layers_thinned": self.layers_thinned,
            "temporary_freed": self.temporary_freed,
            "temporary_bytes_freed": self.temporary_bytes_freed,
        }


def collect(
    objects: ObjectStore,
    catalog: Catalog,
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_steps: Iterable[int] = (),
    keep_best: Iterable[KeepBest | str] = (),
    keep_weights_every: int | None = None,
    keep_weights_last: int | None = None,
    drop_steps: Iterable[int] = (),
    grace: float = 3600.0,
    dry_run: bool = False,
    allow_empty: bool = False,
    now: float | None = None,
    verb: str = "gc",
) -> GcReport:
    """Apply retention, then sweep unreferenced blobs older than ``grace`` seconds.

    ``keep_best`` rules (``KeepBest`` or ``"eval_loss:min"``) keep the best steps by a metric;
    naming a metric no step recorded is a BadInputError (a typo would otherwise keep nothing).
    ``keep_weights_every``/``keep_weights_last`` keep, of the steps no other rule keeps, those
    divisible by K / the N newest as weights-only steps (``thin``).
    ``drop_steps`` drops those steps in addition to what retention drops. ``now`` replaces
    the clock (tests); ``verb`` names the command in errors. Raises BadInputError if every step would go without ``allow_empty``,
    CorruptError if a kept step already misses a blob or a step's manifest cannot be read
    (nothing is changed then), StorageError (before any work) when the catalog is a read-only
    copy and ``dry_run`` is false.
    """
    keep_steps, keep_best = check_retention(
        keep_last=keep_last, keep_every=keep_every, keep_steps=keep_steps, keep_best=keep_best,
        keep_weights_every=keep_weights_every, keep_weights_last=keep_weights_last,
    )  # fmt: skip
    if not dry_run:
        catalog.require_writable(verb)
    rules = [KeepBest.parse(rule) for rule in keep_best]
    now = check_seconds(now, "now", maximum=1e11)  # a time, in seconds since 1970
    weights_rules = keep_weights_every is not None or keep_weights_last is not None
    with objects.lock(exclusive=True):
        listing = sync.sync(catalog, objects).listing
        if catalog.deletions is not None and catalog.deletions.problems:
            raise CorruptError(
                f"{catalog.deletions.problems[0]}; gc will not run past a deletion record it cannot "
                "read (the steps it deleted could come back): run `ckptstore verify --quarantine`"
            )
        if rules:  # keep-best ranks every step by its metrics
            sync.load_for_gc(catalog, objects, None)
        steps = catalog.known_steps()
        kept = steps_to_keep(
            steps, keep_last=keep_last, keep_every=keep_every, keep_steps=keep_steps,
            best=best_steps(catalog, rules), other_rules=weights_rules,
        )  # fmt: skip
        drop_steps = set(drop_steps)  # once: an iterator would be spent by the first look
        # a step whose manifests are all buried is no step, but delete may remove them
        missing = sorted(drop_steps - set(steps) - deletions.buried_steps(listing))
        if missing:
            raise BadInputError(f"cannot drop steps that do not exist: {', '.join(map(str, missing))}")
        kept = [s for s in kept if s not in drop_steps]
        decided = set(kept) | drop_steps  # kept whole, or dropped by request
        weights = weights_to_keep(
            [s for s in steps if s not in decided],
            every=keep_weights_every, last=keep_weights_last,
        )  # fmt: skip
        # Only the steps gc keeps are read: the ones it drops go whatever their manifests say.
        sync.load_for_gc(catalog, objects, kept + weights)
        present = set(catalog.known_steps())  # a kept step deleted since the listing is gone
        kept, weights = [s for s in kept if s in present], [s for s in weights if s in present]
        staying = set(kept) | set(weights)
        dropped = [s for s in steps if s in present and s not in staying]
        already = catalog.weights_only_steps() if weights_rules else set()
        none_resumable = weights_rules and not [s for s in kept if s not in already]
        if steps and (not kept and not weights or none_resumable) and not allow_empty:
            what = "drop every step" if not kept and not weights else "leave no resumable step"
            raise BadInputError(
                f"these rules would {what} ({len(steps)}); pass --allow-empty (allow_empty=True) to mean it"
            )
        report = GcReport(dry_run=dry_run, steps_kept=sorted(kept + weights), steps_dropped=dropped)
        if weights:
            thinned = thin(objects, catalog, weights, kept, dry_run=dry_run)
            report.steps_weights_only = sorted(set(weights) | (already & set(kept)))
            report.steps_thinned, report.layers_thinned = thinned.steps, thinned.units
        kept = kept + weights
        staying = _staying_buried(objects, listing, set(dropped) | drop_steps)

        cutoff = (time.time() if now is None else now) - grace
        doomed = _unreferenced(
            layout.list_blobs(objects), catalog.blobs_of_steps(kept), cutoff, "blob", staying.blobs
        )
        doomed_packs = _unreferenced(
            layout.list_packs(objects), catalog.packs_of_steps(kept), cutoff, "pack", staying.packs
        )
        doomed.gone += doomed_packs.gone
        doomed.spared += doomed_packs.spared
        doomed_files = _unreferenced(
            layout.list_files(objects), catalog.files_of_steps(kept), cutoff, "auxiliary file", staying.files
        )
        report.blobs_spared, report.files_spared = len(doomed.spared), len(doomed_files.spared)
        report.bytes_spared = sum(info.size for info in doomed.spared + doomed_files.spared)
        report.blobs_freed, report.files_freed = len(doomed.gone), len(doomed_files.gone)
        report.bytes_freed = sum(info.size for info in doomed.gone + doomed_files.gone)
        _sweep_temporary(objects, cutoff, report)
        if dry_run:
            return report

        if weights:  # thinning wrote new generations since the listing
            listing = deletions.list_manifests(objects)
        recorded = catalog.generations()
        last = {s: max([*listing.generations.get(s, []), recorded.get(s, 0)]) for s in dropped}
        deletions.record(objects, last)  # from here on the steps are gone, whatever happens next
        catalog.drop_steps(dropped)
        staying_names = set(deletions.kept_buried(listing, objects.content_hash, set(dropped) | drop_steps))
        _delete(
            objects,
            [layout.manifest_name(s, g) for s in dropped for g in listing.generations.get(s, [])]
            + [name for name in listing.buried if name not in staying_names],
            "manifest",
        )
        _delete(objects, [info.name for info in doomed.gone + doomed_files.gone], "object")
        catalog.forget_blobs(doomed.gone_keys)
        return report


def delete_step(objects: ObjectStore, catalog: Catalog, step: int, *, dry_run: bool) -> GcReport:
    """Drop ``step``'s record (``Store.delete``); its blobs go at a later gc unless other steps
    need them. A step a deletion record buries but whose manifests stay (without a key: an
    interrupted delete, or a record someone planted) has them removed. NotFoundError (naming
    the known steps) for an unknown step, StorageError when the catalog is a read-only copy
    and ``dry_run`` is false."""
    try:
        catalog.description(step)
    except NotFoundError:
        if step not in deletions.buried_steps(deletions.list_manifests(objects)):
            raise
    return collect(
        objects,
        catalog,
        drop_steps=[step],
        grace=float("inf"),
        dry_run=dry_run,
        allow_empty=True,
        verb="delete",
    )


def _staying_buried(objects: ObjectStore, listing: layout.ManifestListing, going: set[int]) -> sync.Needs:
    """What the buried manifests that stay need (``deletions.kept_buried``: without a key, those
    of steps not in ``going``); CorruptError if one cannot be read, as for a kept step."""
    names = deletions.kept_buried(listing, objects.content_hash, going)
    if not names:
        return sync.Needs()
    needs = sync.needs_of(objects, names)
    unreadable = {**needs.unreadable, **needs.newer}
    if unreadable:
        name, why = next(iter(unreadable.items()))
        raise CorruptError(
            "gc will not run while a manifest a deletion record buries cannot be read: without a key "
            "gc keeps such a manifest and what it needs, and cannot tell what that is; "
            f"`ckptstore verify --quarantine` moves it aside; manifest {name}: {why}"
        )
    log.warning(
        "ckptstore: kept %d manifest(s) a deletion record buries, and what they need: %s (without a "
        "key a record alone deletes nothing; `ckptstore delete --step N` removes them)",
        len(names), ", ".join(names[:5]) + (", ..." if len(names) > 5 else ""),
    )  # fmt: skip
    return needs


def _sweep_temporary(objects: ObjectStore, cutoff: float, report: GcReport) -> None:
    """Delete (unless ``report.dry_run``) the unfinished writes older than ``cutoff``: what a
    killed commit or ``catalog rebuild`` left. Younger ones may be in flight and stay."""
    stale = [info for info in objects.list_temporary() if info.mtime <= cutoff]
    report.temporary_freed = len(stale)
    report.temporary_bytes_freed = sum(info.size for info in stale)
    if stale and not report.dry_run:
        objects.delete_temporary([info.name for info in stale])


def _delete(objects: ObjectStore, names: list[str], unit: str) -> None:
    """Delete ``names`` in the backend's batches (one request per 1000 on S3), with progress."""
    size = max(1, objects.delete_batch)
    batches = [names[i : i + size] for i in range(0, len(names), size)]
    for batch in progress_bar(batches, total=len(batches), desc=f"gc ({size} {unit}s a batch)", unit="batch"):
        objects.delete_many(batch)


@dataclass
class _Sweep:
    gone: list[ObjectInfo] = field(default_factory=list)  # unreferenced and older than the grace period
    spared: list[ObjectInfo] = field(default_factory=list)  # unreferenced but younger
    gone_keys: list[str] = field(default_factory=list)


def _unreferenced(
    stored: layout.Listing[str], referenced: set[str], cutoff: float, what: str, spared: set[str]
) -> _Sweep:
    """The stored objects no kept step references, nor ``spared`` names (what staying buried
    manifests need: kept if there, but no step misses them); CorruptError if a referenced one
    is missing.

    Stray names (not names the store writes) are never deleted: they are not ckptstore's."""
    absent = stored.missing(referenced)
    if absent:
        raise CorruptError(
            f"{len(absent)} {what}(s) that kept steps need are missing (e.g. {absent[0]}); gc will not run "
            "on a damaged store: run `ckptstore verify` to see which steps are affected"
        )
    sweep = _Sweep()
    for key, info in stored.unreferenced(referenced | spared).items():
        if info.mtime > cutoff:
            sweep.spared.append(info)
        else:
            sweep.gone.append(info)
            sweep.gone_keys.append(key)
    return sweep
