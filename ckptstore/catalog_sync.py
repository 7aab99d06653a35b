"""The catalog as an index of the store's manifests: S3 stores, and catalog rebuilds.

A store without a local directory (S3) keeps its truth in the bucket: a step exists iff its
manifest ``manifests/<step>.json`` exists. The manifest is written create-only after every blob
it names, so it is the commit point. The SQLite catalog is then a local index under
``CKPTSTORE_CACHE`` (one folder per store and endpoint), brought up to date whenever the store
is opened: manifests it lacks are imported, steps whose manifest is gone (dropped by a gc on
another machine) are dropped. Deleting the cache loses nothing.

``rebuild`` builds a fresh catalog from the manifests alone, for any store: the repair for a
lost or corrupt catalog (the local store's ``catalog.db`` included).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import uuid
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import knobs
from .catalog import Catalog, TensorRow
from .errors import ConflictError, CorruptError
from .manifest import Manifest, manifest_name
from .objects import ObjectStore

log = logging.getLogger("ckptstore")

_MANIFEST = re.compile(r"^manifests/(\d+)\.json$")
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


def manifest_steps(objects: ObjectStore) -> dict[int, str]:
    """Every step that has a manifest in the store -> the manifest's object name."""
    found = {}
    for info in objects.list("manifests/"):
        match = _MANIFEST.match(info.name)
        if match:
            found[int(match.group(1))] = info.name
    return found


def read_manifest(objects: ObjectStore, name: str, step: int) -> Manifest:
    """Fetch and parse one manifest; CorruptError if it is malformed or names another step."""
    manifest = Manifest.decode(objects.get(name))
    if manifest.step != step:
        raise CorruptError(f"manifest {name} describes step {manifest.step}")
    return manifest


def import_manifest(
    catalog: Catalog,
    manifest: Manifest,
    *,
    blobs_added: int | None = None,
    bytes_added: int | None = None,
    samples: dict[str, bytes] | None = None,
) -> bool:
    """Record the manifest's step in ``catalog``; False if the catalog already had it.

    Tensor rows of layers the step inherits belong to their source step; they are added only
    where the catalog lacks them (their own step was dropped, or its manifest is older than
    self-contained manifests). ``blobs_added`` / ``bytes_added`` default to the blobs the
    catalog did not know yet, which is what the committing machine counted.
    """
    step = manifest.step
    own: list[TensorRow] = []
    inherited: dict[int, list[TensorRow]] = defaultdict(list)
    for row in manifest.tensors:
        source = manifest.layer_sources.get(row.layer, step)
        if source == step:
            own.append(dataclasses.replace(row, step=step))
        else:
            inherited[source].append(dataclasses.replace(row, step=source))
    with catalog.write_transaction():
        if catalog.has_step(step):
            return False  # another process sharing this index imported it first
        for source, rows in inherited.items():
            present = {r.layer for r in catalog.tensors(source, {r.layer for r in rows})}
            own.extend(row for row in rows if row.layer not in present)
        if blobs_added is None or bytes_added is None:
            known = catalog.blob_sizes(b.key for b in manifest.blobs)
            new = [b for b in manifest.blobs if b.key not in known]
            blobs_added, bytes_added = len(new), sum(b.size for b in new)
        catalog.record_step(
            step=step,
            created_at=manifest.created_at,
            world_size=manifest.world_size,
            description=manifest.description,
            layer_sources=manifest.layer_sources,
            tensors=own,
            blobs=manifest.blobs,
            blobs_added=blobs_added,
            bytes_added=bytes_added,
            updates=manifest.updates,
            samples=samples,  # update-statistics samples stay on the committing machine
            files=manifest.files,
        )
    return True


def publish(objects: ObjectStore, manifest: Manifest) -> None:
    """Write the manifest create-only: the commit point of a step in an S3 store.

    Raises ConflictError if another writer committed the step first.
    """
    name = manifest_name(manifest.step)
    data = manifest.encode()
    if objects.put_if_absent(name, data):
        return
    # "Already there" is also the answer to a retried write whose first reply was lost.
    if objects.get(name) != data:
        raise ConflictError(
            f"step {manifest.step} is already committed: {objects.uri} got its manifest from another "
            "writer after this store was opened"
        )


def _fetch_all(objects: ObjectStore, wanted: dict[int, str], report: SyncReport) -> Iterable[Manifest]:
    """The manifests of ``wanted`` in ascending step order (composite steps after their sources)."""
    steps = sorted(wanted)

    def fetch(step: int) -> Manifest | None:
        try:
            return read_manifest(objects, wanted[step], step)
        except CorruptError as exc:
            report.corrupt.append(f"{wanted[step]}: {exc}")
            return None

    with ThreadPoolExecutor(knobs.io_threads()) as pool:
        for i in range(0, len(steps), _BATCH):
            for manifest in pool.map(fetch, steps[i : i + _BATCH]):
                if manifest is not None:
                    yield manifest


def sync(catalog: Catalog, objects: ObjectStore) -> SyncReport:
    """Make ``catalog`` list exactly the steps whose manifests are in ``objects``."""
    report = SyncReport()
    remote = manifest_steps(objects)
    local = set(catalog.steps())
    report.dropped = sorted(local - set(remote))
    if report.dropped:
        catalog.drop_steps(report.dropped)
    wanted = {step: name for step, name in remote.items() if step not in local}
    for manifest in _fetch_all(objects, wanted, report):
        if import_manifest(catalog, manifest):
            report.imported.append(manifest.step)
    for problem in report.corrupt:
        log.warning("ckptstore: skipped corrupt manifest %s", problem)
    report.steps = catalog.steps()
    return report


def import_step(catalog: Catalog, objects: ObjectStore, step: int) -> None:
    """Import one step another process just committed, if this catalog does not have it yet."""
    if not catalog.has_step(step):
        import_manifest(catalog, read_manifest(objects, manifest_name(step), step))


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
    return catalog


def rebuild(path: Path, objects: ObjectStore) -> SyncReport:
    """Replace the catalog file at ``path`` by one built from the manifests in ``objects`` alone.

    Every step whose manifest is readable and whose blobs are all present comes back; the
    others are reported (``corrupt``, ``incomplete``) and left out. The new catalog is built
    beside the old one and renamed over it, so a failure leaves the old one as it was. Run it
    while no other process has the catalog open.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = path.with_name(f"{path.name}.rebuild-{uuid.uuid4().hex[:8]}{knobs.tmp_suffix()}")
    report = SyncReport()
    stored = {info.name.rsplit("/", 1)[-1] for info in objects.list("blobs/")}
    catalog = Catalog(fresh)
    try:
        for manifest in _fetch_all(objects, manifest_steps(objects), report):
            # A local commit that died between its manifest and its catalog row left a
            # manifest whose blobs a later gc may have swept: such a step is not restored.
            if any(b.key not in stored for b in manifest.blobs):
                report.incomplete.append(manifest.step)
            elif import_manifest(catalog, manifest):
                report.imported.append(manifest.step)
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
