"""The catalog as an index of the store's manifests: S3 stores, and catalog rebuilds.

A store without a local directory (S3) keeps its truth in the bucket: a step exists iff its
manifest (``format.layout``) exists. The manifest is written create-only after every blob
it names, so it is the commit point. The SQLite catalog is then a local index under
``CKPTSTORE_CACHE`` (one folder per store and endpoint), brought up to date whenever the store
is opened, from one listing of the manifests: steps whose manifest is gone (dropped by a gc on
another machine) are dropped, and the others are *listed*. A listed step's manifest is
downloaded and imported the first time a query needs its rows (materialize of that step, gc
of the steps it keeps, verify of all), so opening a store on a new machine costs one listing,
not one download per step. Deleting the cache loses nothing.

``rebuild`` builds a fresh catalog from the manifests alone, for any store: the repair for a
lost or corrupt catalog (the local store's ``catalog.db`` included).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .. import auxfiles, knobs
from ..errors import CorruptError, NotFoundError, UnsupportedError
from ..format import layout, manifest
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
    incomplete: list[int] = field(default_factory=list)  # rebuild only: steps missing blobs
    steps: list[int] = field(default_factory=list)  # the catalog's steps afterwards


def cache_path(objects: ObjectStore) -> Path:
    """Where the catalog index of ``objects`` lives under CKPTSTORE_CACHE."""
    endpoint = getattr(objects, "endpoint", "") or ""
    # Readable, plus a digest of endpoint and URI: the same bucket name on two servers
    # (AWS and a local MinIO) is two stores.
    digest = hashlib.sha256(f"{endpoint}\n{objects.uri}".encode()).hexdigest()[:16]
    readable = re.sub(r"[^A-Za-z0-9._-]+", "-", objects.uri.split("://", 1)[-1]).strip("-.")[:80]
    return Path(knobs.cache_dir()).expanduser() / f"{readable}-{digest}" / "catalog.db"


def read_manifest(objects: ObjectStore, step: int, generation: int = 0) -> StepRecord:
    """Fetch and parse ``step``'s manifest of that generation. Raises NotFoundError, CorruptError
    if it is malformed or names another step, UnsupportedError if a newer ckptstore wrote it."""
    name = layout.manifest_name(step, generation)
    try:
        record = manifest.decode(objects.get(name))
    except UnsupportedError as exc:
        raise UnsupportedError(f"{name}: {exc}") from None
    if record.step != step:
        raise CorruptError(f"manifest {name} describes step {record.step}")
    auxfiles.check_record(record)  # a file where DeepSpeed would read it: never imported
    return record


def import_record(catalog: Catalog, record: StepRecord, generation: int = 0) -> bool:
    """Record a step committed elsewhere in ``catalog``; False if the catalog already had it."""
    return catalog.record_step(record, if_absent=True, generation=generation)


def _fetch_all(
    objects: ObjectStore, steps: dict[int, int], report: SyncReport
) -> Iterable[tuple[StepRecord, int]]:
    """The manifests of ``steps`` (step -> generation) in ascending step order (composite steps
    after their sources), each with its generation."""
    ordered = sorted(steps)

    def fetch(step: int) -> tuple[StepRecord, int] | None:
        try:
            return read_manifest(objects, step, steps[step]), steps[step]
        except NotFoundError:
            return None  # deleted since it was listed (a gc elsewhere)
        except CorruptError as exc:
            report.corrupt.append(f"{layout.manifest_name(step, steps[step])}: {exc}")
            return None

    with ThreadPoolExecutor(knobs.io_threads()) as pool:
        for i in range(0, len(ordered), _BATCH):
            for found in pool.map(fetch, ordered[i : i + _BATCH]):
                if found is not None:
                    yield found


def sync(catalog: Catalog, objects: ObjectStore) -> SyncReport:
    """Make ``catalog`` list exactly the steps whose manifests are in ``objects``, from one listing.

    Steps whose manifest is gone (dropped by a gc elsewhere) are dropped; the others are listed
    and imported only when a query first needs them (``load_steps``). A step whose record a gc
    elsewhere rewrote (a newer manifest generation: it became weights-only) is dropped and
    listed again, so it is imported afresh.
    """
    report = SyncReport()
    listing = layout.list_manifests(objects)
    remote = {step: listing.generation(step) for step in listing.found}
    with catalog.write_transaction():
        recorded = catalog.generations()
        report.dropped = sorted(
            step for step, generation in recorded.items() if remote.get(step) != generation
        )
        if report.dropped:
            catalog.drop_steps(report.dropped)
        catalog.set_listed(remote)
    report.steps = catalog.steps()
    return report


def load_steps(catalog: Catalog, objects: ObjectStore, steps: list[int]) -> SyncReport:
    """Import the manifests of listed ``steps``; those gone or unreadable are unlisted.

    Raises UnsupportedError if a manifest was written by a newer ckptstore."""
    report = SyncReport()
    for record, generation in _fetch_all(objects, {s: catalog.listed_generation(s) for s in steps}, report):
        if import_record(catalog, record, generation):
            report.imported.append(record.step)
    for problem in report.corrupt:
        log.warning("ckptstore: skipped corrupt manifest %s", problem)
    recorded = set(catalog.recorded_steps())
    report.dropped = [step for step in steps if step not in recorded]
    if report.dropped:
        catalog.unlist(report.dropped)
    report.steps = catalog.steps()
    return report


def import_step(catalog: Catalog, objects: ObjectStore, step: int) -> None:
    """Import one step another process just committed, if this catalog does not have it yet."""
    if not catalog.is_recorded(step):
        import_record(catalog, read_manifest(objects, step))


def open_index(objects: ObjectStore) -> Catalog:
    """The local catalog index of ``objects``, synced; a corrupt index is rebuilt (it is a cache)."""
    path = cache_path(objects)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        catalog = Catalog(path)
    except CorruptError as exc:
        log.warning("ckptstore: rebuilding the catalog index %s from the manifests (%s)", path, exc)
        rebuild(path, objects)
        catalog = Catalog(path)
    try:
        sync(catalog, objects)
    except BaseException:
        catalog.close()
        raise
    catalog.loader = lambda steps: load_steps(catalog, objects, steps)
    return catalog


def rebuild(path: Path, objects: ObjectStore) -> SyncReport:
    """Replace the catalog file at ``path`` by one built from the manifests in ``objects`` alone.

    Every step whose manifest is readable and whose blobs are all present comes back; the
    others are reported (``corrupt``, ``incomplete``) and left out. A manifest written by a
    newer ckptstore raises UnsupportedError and changes nothing. The new catalog is built
    beside the old one and renamed over it, so a failure leaves the old one as it was. Run it
    while no other process has the catalog open.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f"{path.name}.rebuild-{uuid.uuid4().hex[:8]}{knobs.tmp_suffix()}")
    report = SyncReport()
    stored = {**layout.list_blobs(objects).found, **layout.list_packs(objects).found}
    listing = layout.list_manifests(objects)
    catalog = Catalog(fresh)
    try:
        for record, generation in _fetch_all(
            objects, {s: listing.generation(s) for s in listing.found}, report
        ):
            # A local commit that died between its manifest and its catalog row left a
            # manifest whose blobs a later gc may have swept: such a step is not restored.
            needed = [b.key for b in record.blobs] + [p.key for i in record.packs.values() for p in i.packs]
            if any(key not in stored for key in needed):
                report.incomplete.append(record.step)
            elif import_record(catalog, record, generation):
                report.imported.append(record.step)
        report.steps = catalog.steps()
        # Fold the write-ahead log into the file, so the file alone is the whole catalog.
        catalog.db.execute("PRAGMA journal_mode=DELETE")
    except BaseException:
        catalog.close()
        for leftover in (fresh, Path(f"{fresh}-wal"), Path(f"{fresh}-shm")):
            leftover.unlink(missing_ok=True)
        raise
    catalog.close()
    for stale in (Path(f"{path}-wal"), Path(f"{path}-shm")):
        stale.unlink(missing_ok=True)
    os.replace(fresh, path)
    return report
