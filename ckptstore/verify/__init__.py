"""``verify``: is every step's manifest readable and in agreement with the catalog, and does
every pack, blob and auxiliary file a committed step references exist, intact?

Read-only: problems are reported, never repaired. What no step references (orphan blobs,
stray objects under a known prefix) is information.

A gc (or a commit) may run beside it: a problem seen on the way is checked again at the end
(``recheck``) against a fresh listing of the manifests, and reported only if it still holds
for a step that still exists. A step a gc dropped meanwhile, or a pack it swept with it, is
no problem; neither is a manifest the catalog could not import because it was just deleted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .. import auxfiles, knobs
from ..catalog import Catalog, sync
from ..dcp import dcp_description
from ..dcp.directory import refused_bytes_items
from ..errors import CorruptError, NotFoundError, UnsupportedError
from ..format import deletions, layout
from ..materialize.bases import BaseCorrupt, BaseMissing, DeltaBases
from ..materialize.fetch import fetch_blob, fetch_pack
from ..objects import ObjectStore
from ..progress import progress_bar
from ..quarantine import move_aside
from .manifests import index_problems, verify_manifests
from .recheck import recheck
from .report import BlobProblem, FileProblem, VerifyReport

__all__ = ["BlobProblem", "FileProblem", "VerifyReport", "verify"]


def verify(
    objects: ObjectStore,
    catalog: Catalog,
    *,
    deep: bool = True,
    quarantine: bool = False,
    between: Callable[[str], None] | None = None,
) -> VerifyReport:
    """Check every pack, blob and auxiliary file the committed steps reference, and the catalog.

    Contract as ``Store.verify``. Listing each namespace once, it checks that every referenced
    pack and blob exists with its recorded size; ``deep`` also fetches, decodes and re-hashes
    each, and reports each auxiliary file kept as plain data that does not rebuild and each DCP
    bytes item materialize would refuse (kept as bytes, or malformed plain data); a file
    materialize leaves out is no problem (nothing is corrupt). What it finds is checked
    again at the end (``recheck``), so a gc running beside it makes no problem.
    ``between(phase)`` is called between its phases ("listed": the manifests listed;
    "manifest": one manifest read, before it is compared with the catalog; "indexed": the
    objects listed and the catalog's references taken, before they are checked; "checked"):
    tests run a gc there. ``quarantine`` then moves the unreadable manifests aside
    (``quarantine.move_aside``).
    """
    pause = between or (lambda phase: None)
    report = VerifyReport(deep=deep)
    manifests = deletions.list_manifests(objects)
    report.buried_manifests = manifests.buried
    staying = _staying_buried(objects, manifests, report)
    report.unreadable_manifests.extend(manifests.unreadable)
    report.manifest_problems.extend(manifests.problems)
    pause("listed")
    by_step = verify_manifests(objects, catalog, manifests, report, pause)
    users = catalog.referenced_blobs()
    recorded = catalog.blob_sizes(users)
    sizes = {key: size.size for key, size in recorded.items()}
    catalog_rows = index_problems(catalog, manifests, users, sizes)
    report.catalog_problems.extend(catalog_rows)
    blobs = layout.list_blobs(objects)
    packs = layout.list_packs(objects)
    pack_users = catalog.referenced_packs(report.catalog_problems)
    stored = {key: info.size for key, info in blobs.found.items()}
    stored.update((key, info.size) for key, info in packs.found.items())
    sizes.update((key, ref.size) for key, (ref, _) in pack_users.items())
    users.update((key, found) for key, (_, found) in pack_users.items())
    cpu = threading.BoundedSemaphore(knobs.cpu_threads())
    bases = DeltaBases(objects, [ref for ref, _ in pack_users.values()])  # a delta is checked whole
    pause("indexed")

    def check(key: str, stored: dict[str, int] = stored) -> tuple[str, str | None, int]:
        if key not in stored:
            return key, "is missing", 0
        if key in sizes and stored[key] != sizes[key]:
            return key, f"has {stored[key]} bytes, the catalog recorded {sizes[key]}", stored[key]
        if deep:
            try:
                # Sizes the catalog records bound what a decode may allocate (tests/test_bombs.py).
                if key in pack_users:
                    fetch_pack(objects, key, cpu, pack_users[key][0].raw_size, bases.of)
                else:
                    fetch_blob(objects, key, cpu, recorded[key].raw_size if key in recorded else None)
            except (BaseMissing, BaseCorrupt):
                pass  # a broken base is reported as itself, with every step whose deltas need it
            except NotFoundError:
                return key, "is missing", 0
            except CorruptError as exc:
                return key, f"is corrupt ({exc})", stored[key]
            except UnsupportedError as exc:  # a damaged version byte reads as a newer format
                return key, f"cannot be read ({exc})", stored[key]
        return key, None, stored[key]

    with ThreadPoolExecutor(knobs.io_threads()) as pool:
        checks = pool.map(check, users) if deep else map(check, users)
        for key, problem, size in progress_bar(checks, total=len(users), desc="verify", unit="object"):
            report.blobs_checked += 1
            report.bytes_checked += size
            if problem:
                report.problems.append(BlobProblem(key, problem, users[key]))
    needed = set(users) | staying.blobs | staying.packs  # what gc keeps
    report.orphans = sorted([*blobs.unreferenced(needed), *packs.unreferenced(needed)])
    files = layout.list_files(objects)
    _verify_files(objects, catalog, files, report)
    report.stray_objects = sorted(manifests.stray + blobs.stray + packs.stray + files.stray)
    _count_temporary(objects, report)
    pause("checked")
    if by_step or catalog_rows or report.problems or report.file_problems:
        recheck(objects, catalog, manifests, report, by_step, catalog_rows, check)
    if deep:  # after the re-check, which checks a pack's bytes, not what DCP would unpickle
        _verify_bytes_items(objects, catalog, report)
    if quarantine:
        report.quarantined = move_aside(objects, report.unreadable_manifests)
    return report


def _staying_buried(
    objects: ObjectStore, manifests: layout.ManifestListing, report: VerifyReport
) -> sync.Needs:
    """What the buried manifests gc keeps need (without a key, every one: ``deletions.kept_buried``),
    which are then no orphans; one that cannot be read is a problem, as gc refuses to run then."""
    names = deletions.kept_buried(manifests, objects.content_hash)
    report.buried_kept = bool(names)
    needs = sync.needs_of(objects, names)
    for name, why in {**needs.unreadable, **needs.newer}.items():
        report.manifest_problems.append(
            f"manifest {name}, which a deletion record buries, cannot be read: {why}"
        )
    report.unreadable_manifests.extend(needs.unreadable)
    return needs


def _count_temporary(objects: ObjectStore, report: VerifyReport) -> None:
    """Unfinished writes are information: in flight, or left by a killed writer for gc."""
    temporary = list(objects.list_temporary())
    report.temporary, report.temporary_bytes = len(temporary), sum(info.size for info in temporary)


def _verify_files(
    objects: ObjectStore, catalog: Catalog, files: layout.Listing[str], report: VerifyReport
) -> None:
    """Check the auxiliary files committed steps carry: there, of the recorded size, and (deep) intact."""
    for key, users in catalog.referenced_files().items():
        report.files_checked += 1
        report.catalog_problems.extend(
            f"step {step} keeps an auxiliary file at {path!r}, which {auxfiles.refusal(path)}"
            for step, path, _ in users
            if auxfiles.refusal(path)
        )
        size = users[0][2]
        stored = files.found.get(key)
        if stored is None:
            problem = "is missing"
        elif stored.size != size:
            problem = f"has {stored.size} bytes, the catalog recorded {size}"
        elif report.deep:
            data = objects.get(layout.file_name(key))
            if auxfiles.file_key(data, objects.content_hash) != key:
                problem = "is corrupt (its content does not hash to its key)"
            elif not (problem := auxfiles.plain_data_problem(data)):  # what materialize refuses
                continue
        else:
            continue
        report.file_problems.append(FileProblem(key, problem, users))


def _verify_bytes_items(objects: ObjectStore, catalog: Catalog, report: VerifyReport) -> None:
    """Deep: every bytes item of a DCP step is plain data that rebuilds, as materialize
    requires (``dcp.bytesitems``); one that is not is a problem of its pack, needed by each
    step that reads it. A pack that cannot be read is reported by the pack check."""
    found: dict[tuple[str, str], BlobProblem] = {}
    for step in catalog.steps():
        try:
            description = dcp_description(catalog, step)
            refused = [] if description is None else refused_bytes_items(objects, catalog, step, description)
        except (CorruptError, NotFoundError, UnsupportedError):
            continue
        for fqn, pack, layer, problem in refused:
            text = f"holds the DCP bytes item {fqn}, which {problem.removeprefix('holds ')}"
            found.setdefault((pack, fqn), BlobProblem(pack, text, [])).users.append(
                (step, layer, fqn, "pack")
            )
    report.problems.extend(found.values())
