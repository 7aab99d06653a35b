"""The catalog as an index of the store's manifests, on every backend.

A step exists iff its manifest (``format.layout``) exists. The manifest is written create-only
after every pack it names, so it is the commit point; the SQLite catalog only indexes the
manifests. It is brought up to date whenever the store is opened, from one listing of the
manifests: every step found is *listed*, and a listed step's manifest is read and imported
the first time a query needs its rows (materialize of that step, gc of the steps it keeps,
verify of all), so opening a store costs one listing, not one read per step. A lost, emptied
or unreadable catalog therefore loses nothing: the next open lists every step again.

Where the catalog lives differs. An S3 store's is a cache on each machine under
``CKPTSTORE_CACHE`` (one folder per store and endpoint): a recorded step whose manifest is gone
was dropped by a gc on another machine, and is dropped here too. A local store's
``catalog.db`` is shared by every process using the store, and gc drops a step's rows before
its manifest: a recorded step whose manifest is gone there is damage, kept and reported by
``verify`` rather than silently forgotten.

Opening the catalog file and rebuilding it from the manifests are ``file``'s.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .. import auxfiles, knobs
from ..errors import CorruptError, NotFoundError, UnsupportedError
from ..format import deletions, layout, manifest
from ..model import StepRecord
from ..objects import ObjectStore
from .index import Catalog

log = logging.getLogger("ckptstore")

_BATCH = 64  # manifests fetched per round: bounds memory while importing thousands of steps


@dataclass
class SyncReport:
    """What a sync or rebuild changed in the catalog."""

    imported: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)  # manifests that could not be read
    unreadable: dict[int, str] = field(default_factory=dict)  # their steps -> why
    incomplete: list[int] = field(default_factory=list)  # rebuild only: steps missing blobs
    # rebuild only: steps the previous catalog held that the manifests do not give back
    lost: list[int] = field(default_factory=list)
    kept_aside: str | None = None  # rebuild only: where the previous catalog was kept
    steps: list[int] = field(default_factory=list)  # the catalog's steps afterwards
    listing: layout.ManifestListing | None = None  # sync only: the listing it synced with


def cache_path(objects: ObjectStore) -> Path:
    """Where the catalog index of ``objects`` lives under CKPTSTORE_CACHE."""
    endpoint = getattr(objects, "endpoint", "") or ""
    # Readable, plus a digest of endpoint and URI: the same bucket name on two servers
    # (AWS and a local MinIO) is two stores.
    digest = hashlib.sha256(f"{endpoint}\n{objects.uri}".encode()).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", objects.uri.split("://", 1)[-1]).strip("-.")[:80]
    return Path(knobs.cache_dir()).expanduser() / f"{readable}-{digest}" / "catalog.db"


def read_manifest(objects: ObjectStore, step: int, generation: int = 0, *, lazy: bool = False) -> StepRecord:
    """Fetch and parse ``step``'s manifest of that generation. Raises NotFoundError, CorruptError
    if it is malformed or names another step, UnsupportedError if a newer ckptstore wrote it.
    ``lazy``: for an import, its pack indexes are decoded when first used (``manifest.decode``)."""
    name = layout.manifest_name(step, generation)
    try:
        record = manifest.decode(objects.get(name), objects.content_hash, name, lazy=lazy)
    except UnsupportedError as exc:
        raise UnsupportedError(f"{name}: {exc}") from None
    if record.step != step:
        raise CorruptError(f"manifest {name} describes step {record.step}")
    auxfiles.check_record(record)  # a file where DeepSpeed would read it: never imported
    return record


def read_authentic_manifest(
    objects: ObjectStore, step: int, generation: int, above: int = -1, *, lazy: bool = False
) -> tuple[StepRecord, int, list[str]]:
    """``step``'s record from its newest manifest at or below ``generation`` that a store with
    a key can trust: ``(record, its generation, why each newer one was passed over)``. Never
    one at or below ``above``: the generation a deletion buried (``format.deletions``).

    Without a key this is ``read_manifest`` of ``generation``. With one, a newer generation
    that is not authentic (someone who can write the store but holds no key put it there) is
    passed over for the newest authentic one below it, so it can neither change nor hide the
    step. Raises NotFoundError if the step is gone, CorruptError (the newest generation's
    problem) if no generation of it is authentic. ``lazy`` as ``read_manifest``.
    """
    try:
        return read_manifest(objects, step, generation, lazy=lazy), generation, []
    except CorruptError as exc:
        if not objects.content_hash.authenticated:
            raise
        first = exc
    rejected = [str(first)]
    older_ones = (g for g in layout.generations_of(objects, step) if above < g < generation)
    for older in sorted(older_ones, reverse=True):
        try:
            return read_manifest(objects, step, older, lazy=lazy), older, rejected
        except NotFoundError:
            continue
        except CorruptError as exc:
            rejected.append(str(exc))
    raise first


def import_record(catalog: Catalog, record: StepRecord, generation: int = 0) -> bool:
    """Record a step committed elsewhere in ``catalog``; False if the catalog already had it."""
    return catalog.record_step(record, if_absent=True, generation=generation)


def fetch_records(
    objects: ObjectStore,
    steps: dict[int, int],
    report: SyncReport,
    deleted: dict[int, int],
    *,
    lazy: bool = False,
) -> Iterable[list[tuple[StepRecord, int]]]:
    """The manifests of ``steps`` (step -> generation) in ascending step order (composite steps
    after their sources), each with its generation, in batches read on ``CKPTSTORE_IO_THREADS``
    threads; ``deleted``: the deletion record's (nothing at or below a deleted generation is
    read). ``lazy`` as ``read_manifest``."""
    ordered = sorted(steps)

    def fetch(step: int) -> tuple[StepRecord, int] | None:
        try:
            record, generation, rejected = read_authentic_manifest(
                objects, step, steps[step], deleted.get(step, -1), lazy=lazy
            )
            for problem in rejected:
                log.warning("ckptstore: ignored %s", problem)
            return record, generation
        except NotFoundError:
            return None  # deleted since it was listed (a gc elsewhere)
        except CorruptError as exc:
            report.corrupt.append(f"{layout.manifest_name(step, steps[step])}: {exc}")
            report.unreadable[step] = report.corrupt[-1]
            return None

    with ThreadPoolExecutor(knobs.io_threads()) as pool:
        for i in range(0, len(ordered), _BATCH):
            yield [found for found in pool.map(fetch, ordered[i : i + _BATCH]) if found is not None]


def _catalog_in_cache(objects: ObjectStore) -> bool:
    """Whether the catalog of ``objects`` lives under ``CKPTSTORE_CACHE``: an S3 store's, and a
    local store's with a key. Whoever can write a store can write a ``catalog.db`` beside its
    objects, so a store with a key is indexed in this machine's own cache, from authentic
    manifests only. A local tier is this node's own and keeps its catalog."""
    is_tier = hasattr(objects, "private_catalog")
    return getattr(objects, "root", None) is None or (objects.content_hash.authenticated and not is_tier)


def catalog_is_shared(objects: ObjectStore) -> bool:
    """Whether every process using ``objects`` shares one catalog (a local store's ``catalog.db``)
    rather than keeping a cache of its own (S3, a store with a key, or a local tier's:
    ``private_catalog``)."""
    return not _catalog_in_cache(objects) and not getattr(objects, "private_catalog", False)


def catalog_path(objects: ObjectStore) -> Path:
    """The catalog file of ``objects``: ``catalog.db`` in a local store (or local tier), else the cache's."""
    return cache_path(objects) if _catalog_in_cache(objects) else Path(objects.root) / "catalog.db"


def sync(catalog: Catalog, objects: ObjectStore) -> SyncReport:
    """Make ``catalog`` list every step whose manifest is in ``objects``, from one listing.

    The steps are listed and imported only when a query first needs them (``load_steps``). A
    step whose record was rewritten (a newer manifest generation: gc made it weights-only) is
    dropped and listed again, so it is imported afresh (generations only grow: a step deleted
    and committed again is a newer one, ``format.deletions``). A recorded step whose manifest
    is gone is dropped from a cache (a gc elsewhere dropped it), and from a shared catalog only
    if the deletion record says so: there anything else is damage (``verify`` reports it). A
    listed generation older than the one recorded is not taken: someone put an old manifest
    back, and the rows read from the newer one stay (``verify`` reports the difference).
    """
    listing = deletions.list_manifests(objects)
    report = SyncReport(listing=listing)
    catalog.deletions = deletions.Deletions(
        listing.deleted, max(listing.deletion_records, default=-1), listing.problems, listing.unreadable
    )
    remote = {step: listing.generation(step) for step in listing.found}
    keep_missing = catalog_is_shared(objects)
    with catalog.write_transaction():
        recorded = catalog.generations()
        older = {step: g for step, g in recorded.items() if step in remote and remote[step] < g}
        for step, generation in older.items():
            log.warning(
                "ckptstore: step %s lists manifest generation %s, older than the generation %s this "
                "catalog read: kept the newer (a store writer put an old manifest back?)",
                step, remote[step], generation,
            )  # fmt: skip
            remote[step] = generation
        report.dropped = sorted(
            step
            for step, generation in recorded.items()
            if remote.get(step) != generation
            and not (keep_missing and step not in remote and step not in listing.deleted)
        )
        if report.dropped:
            catalog.drop_steps(report.dropped)
        catalog.set_listed(remote)
    report.steps = catalog.known_steps()
    return report


def load_steps(catalog: Catalog, objects: ObjectStore, steps: list[int]) -> SyncReport:
    """Import the manifests of listed ``steps``; those gone or unreadable are unlisted (and
    reported in ``corrupt``; the next open lists them again, and gc refuses to run while one
    is unreadable). Raises UnsupportedError if a manifest was written by a newer ckptstore."""
    report = SyncReport()
    listed = {s: catalog.listed_generation(s) for s in steps}
    # A commit through a local tier reads no manifest the tier lacks: those stay listed.
    listed = {s: g for s, g in listed.items() if objects.at_hand(layout.manifest_name(s, g))}
    steps = list(listed)
    deleted = catalog.deletions.deleted if catalog.deletions is not None else {}
    for batch in fetch_records(objects, listed, report, deleted, lazy=True):
        with catalog.write_transaction():  # one commit (and sync to disk) a batch, not a step
            report.imported += [record.step for record, g in batch if import_record(catalog, record, g)]
    for problem in report.corrupt:
        log.warning("ckptstore: skipped corrupt manifest %s", problem)
    catalog.unreadable.update(report.unreadable)
    recorded = set(catalog.recorded_steps())
    report.dropped = [step for step in steps if step not in recorded]
    if report.dropped:
        catalog.unlist(report.dropped)
    report.steps = catalog.known_steps()
    return report


def import_step(catalog: Catalog, objects: ObjectStore, step: int, generation: int | None = None) -> None:
    """Import one step another process just committed (at ``generation``; None: its newest
    listed above its deletion), if this catalog does not have it yet. NotFoundError if it has
    no such manifest."""
    if catalog.is_recorded(step):
        return
    last = catalog.deletions.deleted.get(step, -1) if catalog.deletions is not None else -1
    if generation is None:
        live = [g for g in layout.generations_of(objects, step) if g > last]
        if not live:
            raise NotFoundError(f"step {step} has no manifest in {objects.uri}")
        generation = live[-1]
    record, generation, _ = read_authentic_manifest(objects, step, generation, last)
    import_record(catalog, record, generation)


@dataclass
class Needs:
    """What some manifests reference, by key, and which of them could not be read."""

    packs: set[str] = field(default_factory=set)
    blobs: set[str] = field(default_factory=set)
    files: set[str] = field(default_factory=set)
    unreadable: dict[str, str] = field(default_factory=dict)  # name -> why (damaged or unauthentic)
    newer: dict[str, str] = field(default_factory=dict)  # name -> why (a newer ckptstore wrote it)


def needs_of(objects: ObjectStore, names: Iterable[str]) -> Needs:
    """The packs, blobs and auxiliary files the manifests ``names`` reference (own and
    inherited layers), each read whole and imported nowhere: what gc spares for manifests that
    are no steps but stay (``deletions.kept_buried``). One gone since the listing needs
    nothing; one that cannot be read is named in ``unreadable`` or ``newer``."""
    needs = Needs()
    for name in names:
        parsed = layout.parse_manifest_name(name)
        if parsed is None:
            continue  # not a manifest name: a stray, which references nothing
        try:
            record = read_manifest(objects, *parsed)
        except NotFoundError:
            continue
        except CorruptError as exc:
            needs.unreadable[name] = str(exc)
            continue
        except UnsupportedError as exc:
            needs.newer[name] = str(exc)
            continue
        needs.packs.update(ref.key for index in record.packs.values() for ref in index.all_packs)
        needs.blobs.update(row.key for row in record.blobs)
        needs.files.update(row.key for row in record.files)
    return needs


def load_for_gc(catalog: Catalog, objects: ObjectStore, steps: Iterable[int] | None) -> None:
    """Import ``steps`` (None: every listed step) where the catalog only lists them, and check
    their rows; given ``steps`` (the ones gc keeps), read again the manifests of those the
    catalog already held (``_reread``). CorruptError naming the manifests among them that
    cannot be read or are gone. What gc needs of the steps it keeps before it decides what to
    sweep: a kept step it does not know would lose its packs, and gc runs only on a store
    ``verify`` passes for them. Steps it drops are never read: their manifests go whatever
    they hold.
    """
    pending = catalog.pending_steps()
    if steps is not None:
        wanted = set(steps)
        pending = [step for step in pending if step in wanted]
    report = load_steps(catalog, objects, pending) if pending else SyncReport()
    recorded = catalog.recorded_steps()
    # gc decides from the rows: they must be the manifests'
    catalog.check_rows(recorded if steps is None else sorted(set(steps) & set(recorded)))
    if steps is not None:
        _reread(catalog, objects, sorted(set(steps) & set(recorded) - set(report.imported)), report)
    if report.corrupt:
        more = f" (and {len(report.corrupt) - 1} more)" if len(report.corrupt) > 1 else ""
        raise CorruptError(
            "gc will not run while a step it keeps has a manifest it cannot read (`ckptstore verify` "
            "names them; `verify --quarantine` moves unreadable ones aside, `ckptstore delete --step N` "
            f"drops a step): manifest {report.corrupt[0]}{more}"
        )


def _reread(catalog: Catalog, objects: ObjectStore, steps: list[int], report: SyncReport) -> None:
    """Read the manifests of ``steps``, which the catalog recorded before, as an import would,
    adding each one that cannot be read, or is gone, to ``report.corrupt``. gc keeps such a
    step by its catalog rows, but verify reads every manifest: a manifest damaged or removed
    since it was imported fails verify, so it stops gc too (their word is the same). A step
    whose manifest is gone is left in a shared catalog (``sync``), and only ``delete`` (or a
    ``catalog rebuild``) drops it: this is where gc says so. Costs one read of each kept
    step's manifest, as a gc from an empty cache makes."""
    generations = catalog.generations()
    listed = catalog.listed_generations()
    present = {step: generations[step] for step in steps if listed.get(step) == generations[step]}
    deleted = catalog.deletions.deleted if catalog.deletions is not None else {}
    found: set[int] = set()
    for batch in fetch_records(objects, present, report, deleted):
        found.update(record.step for record, _ in batch)
    report.corrupt += [
        f"{layout.manifest_name(step, generations[step])}: it is gone, yet the catalog records "
        f"step {step} by it"
        for step in steps
        if step not in found and step not in report.unreadable
    ]
