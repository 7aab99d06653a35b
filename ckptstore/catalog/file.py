"""The catalog file of a store: opened (synced with the manifests), and rebuilt from them.

``open_catalog`` gives the catalog of a store synced with its manifests (``sync``): created
where missing, rebuilt where SQLite cannot read it, an in-memory copy where it cannot be
written. ``rebuild`` builds a fresh catalog from the manifests alone, for any store: the repair
for a corrupt catalog (the local store's ``catalog.db`` included).
"""

from __future__ import annotations

import errno
import os
import sqlite3
import time
import uuid
from pathlib import Path

from .. import knobs, private
from ..errors import BadInputError, CorruptError, StorageError, storage_error
from ..format import deletions, layout
from ..objects import ObjectStore
from . import digests
from .database import DamagedCatalogError, storage_faults
from .index import Catalog
from .sync import (
    SyncReport,
    catalog_is_shared,
    catalog_path,
    fetch_records,
    import_record,
    load_steps,
    log,
    read_manifest,
    sync,
)


def open_catalog(objects: ObjectStore) -> Catalog:
    """The catalog of ``objects``, synced with its manifests (``sync``).

    A catalog SQLite cannot read (DamagedCatalogError: a bad header or page, rows that clash,
    met while opening and syncing it) is rebuilt from the manifests, under the store's exclusive
    lock so that the processes of one job do it once; a shared catalog's damaged file is kept
    beside it (``catalog.db.damaged-<time>``) for inspection. Damage met later, by a query of
    the command, is a DamagedCatalogError naming ``ckptstore catalog rebuild``.

    A catalog that cannot be written (a full disk, a read-only mount or cache folder) is read
    from an in-memory copy synced the same way (``Catalog(read_only=...)``): every query
    answers, and verbs that write the catalog raise StorageError. BadInputError for a
    ``CKPTSTORE_CACHE`` that cannot hold a folder (a file in the way).
    """
    path = catalog_path(objects)
    _require_private(path, objects)
    try:
        catalog = _open_writable(path, objects)
    except StorageError as exc:
        # Reading needs no write: a full or read-only store still answers log, verify, materialize.
        log.info("ckptstore: reading an in-memory copy of the catalog (%s)", exc)
        catalog = Catalog(path, read_only=str(exc))
        try:
            sync(catalog, objects)
        except BaseException:
            catalog.close()
            raise
    catalog.loader = lambda steps: load_steps(catalog, objects, steps)
    catalog.trusts_listing = not objects.content_hash.authenticated
    catalog.content_hash = objects.content_hash
    catalog.manifest_parts = lambda step, generation: digests.record_parts(
        read_manifest(objects, step, generation)
    )
    return catalog


def _require_private(path: Path, objects: ObjectStore) -> None:
    """With a key, the catalog at ``path`` is in a folder only this user can change (``private``):
    its rows decide what a read uses. BadInputError naming the fix otherwise."""
    if objects.content_hash.authenticated:
        private.make_folder(path.parent)
        private.require_private(
            path.parent, "the catalog folder", files=[path.name, f"{path.name}-wal", f"{path.name}-shm"]
        )


def _open_writable(path: Path, objects: ObjectStore) -> Catalog:
    """The catalog file at ``path``, created, rebuilt if damaged, and synced; StorageError if
    it cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.EEXIST) and not catalog_is_shared(objects):
            raise BadInputError(
                f"CKPTSTORE_CACHE={knobs.cache_dir()} cannot hold the catalog {path}: a file is in the way"
            ) from None
        raise storage_error("create the catalog folder", path.parent, exc) from None
    try:
        return _open_synced(path, objects)
    except DamagedCatalogError as exc:
        with objects.lock(exclusive=True):
            try:  # another process may have rebuilt it while this one waited for the lock
                return _open_synced(path, objects)
            except DamagedCatalogError:
                log.warning(
                    "ckptstore: the catalog %s is damaged (%s): rebuilding it from the manifests",
                    path,
                    exc.reason,
                )
                rebuild(path, objects, keep_damaged=catalog_is_shared(objects))
        return _open_synced(path, objects)


def _open_synced(path: Path, objects: ObjectStore) -> Catalog:
    """The catalog file at ``path`` synced with the manifests. DamagedCatalogError where the
    open or the sync meets damage in the file (the sync reads and writes its step lists)."""
    catalog = Catalog(path)
    try:
        sync(catalog, objects)
    except BaseException:
        catalog.close()
        raise
    return catalog


def rebuild(path: Path, objects: ObjectStore, *, keep_damaged: bool = True) -> SyncReport:
    """Replace the catalog file at ``path`` by one built from the manifests in ``objects`` alone.

    Every step whose manifest is readable and whose blobs are all present comes back; the
    others are reported (``corrupt``, ``incomplete``) and left out, and so are (``lost``) steps
    the previous catalog held whose manifest is gone. When the previous file could not be read
    (and ``keep_damaged``), or it held a step the rebuild loses, it is kept beside the new one
    (``kept_aside``) rather than deleted. A manifest written by a newer ckptstore raises
    UnsupportedError and changes nothing. The new catalog is built beside the old one and
    renamed over it, so a failure leaves the old one as it was. Run it while no other process
    has the catalog open. StorageError (nothing replaced) when it cannot be written.
    """
    path = Path(path)
    _require_private(path, objects)
    with storage_faults(path, "rebuild the catalog"):
        return _rebuild(path, objects, keep_damaged)


def _rebuild(path: Path, objects: ObjectStore, keep_damaged: bool) -> SyncReport:
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f"{path.name}.rebuild-{uuid.uuid4().hex[:8]}{knobs.tmp_suffix()}")
    report = SyncReport()
    previous = _previous_steps(path)
    stored = {**layout.list_blobs(objects).found, **layout.list_packs(objects).found}
    listing = deletions.list_manifests(objects)
    catalog = None
    try:
        # Inside the try: on a full disk the new file is made and then fails to take its schema.
        catalog = Catalog(fresh)
        catalog.content_hash = objects.content_hash
        for record, generation in (
            found
            for batch in fetch_records(
                objects, {s: listing.generation(s) for s in listing.found}, report, listing.deleted
            )
            for found in batch
        ):
            # A step whose packs a gc swept after its manifest was damaged cannot come back.
            needed = [b.key for b in record.blobs] + [
                p.key for i in record.packs.values() for p in i.all_packs
            ]
            if any(key not in stored for key in needed):
                report.incomplete.append(record.step)
            elif import_record(catalog, record, generation):
                report.imported.append(record.step)
        report.steps = catalog.known_steps()
        # Fold the write-ahead log into the file, so the file alone is the whole catalog.
        catalog.db.execute("PRAGMA journal_mode=DELETE")
    except BaseException:
        if catalog is not None:
            catalog.close()
        for leftover in (fresh, Path(f"{fresh}-wal"), Path(f"{fresh}-shm"), Path(f"{fresh}-journal")):
            leftover.unlink(missing_ok=True)
        raise
    catalog.close()
    left_out = set(previous or ()) - set(report.steps)
    report.lost = sorted(left_out - set(listing.found))
    # The old file's log goes first: SQLite would replay a log left beside the name onto
    # whatever file has it next (a kill between these renames would leave exactly that).
    for stale in (Path(f"{path}-wal"), Path(f"{path}-shm")):
        stale.unlink(missing_ok=True)
    if path.exists() and (left_out or (previous is None and keep_damaged and path.stat().st_size)):
        stamp = time.strftime("%Y%m%dT%H%M%S")
        aside = path.with_name(
            f"{path.name}.{'before-rebuild' if previous is not None else 'damaged'}-{stamp}"
        )
        os.replace(path, aside)
        report.kept_aside = str(aside)
    os.replace(fresh, path)
    return report


def _previous_steps(path: Path) -> list[int] | None:
    """The steps the catalog file at ``path`` holds; [] when there is none, None if unreadable."""
    if not path.exists():
        return []
    try:
        catalog = Catalog(path)
    except CorruptError:
        return None
    try:
        return catalog.steps()
    except (sqlite3.DatabaseError, CorruptError):
        return None
    finally:
        catalog.close()
