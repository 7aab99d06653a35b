"""``verify``: is every step's manifest readable and in agreement with the catalog, and does
every pack, blob and auxiliary file a committed step references exist, intact?

Read-only: problems are reported, never repaired. What no step references (orphan blobs,
stray objects under a known prefix) is information.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import auxfiles, knobs
from .catalog import Catalog, digests
from .catalog.sync import read_authentic_manifest
from .errors import CorruptError, NotFoundError, UnsupportedError
from .format import layout
from .materialize.fetch import fetch_blob, fetch_pack
from .model import StepRecord
from .objects import ObjectStore
from .progress import progress_bar


@dataclass
class BlobProblem:
    """A referenced pack or blob that is missing or corrupt, with every (step, layer, name, kind)
    needing it (for a pack, name says whose tensors it holds and kind is ``pack``)."""

    blob: str
    problem: str
    users: list[tuple[int, str, str, str]]

    def describe(self) -> str:
        layer, name, kind = self.users[0][1:]
        if kind == "pack":
            return f"pack {self.blob} ({layer}: {name}) {self.problem}; {_needed_by(self.users)}"
        return f"blob {self.blob} ({layer}: {name} {kind}) {self.problem}; {_needed_by(self.users)}"


@dataclass
class FileProblem:
    """A stored auxiliary file that is missing or corrupt, with every (step, path, size) needing it."""

    key: str
    problem: str
    users: list[tuple[int, str, int]]

    def describe(self) -> str:
        return f"auxiliary file {self.users[0][1]} (stored as {self.key}) {self.problem}; {_needed_by(self.users)}"


def _needed_by(users: list[tuple]) -> str:
    steps = sorted({user[0] for user in users})
    return f"needed by step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


@dataclass
class VerifyReport:
    """Outcome of ``verify``: problems make it fail; orphans and strays are information only."""

    blobs_checked: int = 0
    bytes_checked: int = 0
    deep: bool = True
    problems: list[BlobProblem] = field(default_factory=list)
    files_checked: int = 0
    file_problems: list[FileProblem] = field(default_factory=list)
    catalog_problems: list[str] = field(default_factory=list)
    manifests_checked: int = 0
    # steps whose manifest cannot be read, or says other than the catalog
    manifest_problems: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    # objects under blobs/, files/ or manifests/ whose names are not names the store writes
    stray_objects: list[str] = field(default_factory=list)
    # unfinished writes (``.tmp``): in flight, or left by killed writers (gc removes old ones)
    temporary: int = 0
    temporary_bytes: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing a committed step needs is missing or damaged."""
        return not (self.problems or self.file_problems or self.catalog_problems or self.manifest_problems)

    def as_dict(self) -> dict:
        """Plain dict for ``--json``."""
        return {
            "ok": self.ok,
            "deep": self.deep,
            "blobs_checked": self.blobs_checked,
            "bytes_checked": self.bytes_checked,
            "problems": [
                {"blob": p.blob, "problem": p.problem, "steps": sorted({u[0] for u in p.users}),
                 "layers": sorted({u[1] for u in p.users})}
                for p in self.problems
            ],
            "files_checked": self.files_checked,
            "file_problems": [
                {"file": p.key, "path": p.users[0][1], "problem": p.problem, "steps": sorted({u[0] for u in p.users})}
                for p in self.file_problems
            ],
            "catalog_problems": self.catalog_problems,
            "manifests_checked": self.manifests_checked,
            "manifest_problems": self.manifest_problems,
            "orphans": self.orphans,
            "stray_objects": self.stray_objects,
            "temporary": self.temporary,
            "temporary_bytes": self.temporary_bytes,
        }  # fmt: skip


def verify(objects: ObjectStore, catalog: Catalog, *, deep: bool = True) -> VerifyReport:
    """Check every pack, blob and auxiliary file the committed steps reference, and the catalog.

    Contract as ``Store.verify``. Listing each namespace once, it checks that every referenced
    pack and blob exists with its recorded size; ``deep`` also fetches, decodes and re-hashes each.
    """
    report = VerifyReport(deep=deep)
    manifests = layout.list_manifests(objects)
    _verify_manifests(objects, catalog, manifests, report)
    users = catalog.referenced_blobs()
    recorded = catalog.blob_sizes(users)
    sizes = {key: size.size for key, size in recorded.items()}
    report.catalog_problems.extend(catalog.consistency_problems())
    report.catalog_problems.extend(
        f"blob {blob} is referenced but has no size record" for blob in users if blob not in sizes
    )
    report.catalog_problems.extend(
        f"step {step} has no manifest in the store (a catalog rebuild would lose it)"
        for step in manifests.missing(catalog.steps())
    )
    blobs = layout.list_blobs(objects)
    packs = layout.list_packs(objects)
    pack_users = catalog.referenced_packs(report.catalog_problems)
    stored = {key: info.size for key, info in blobs.found.items()}
    stored.update((key, info.size) for key, info in packs.found.items())
    sizes.update((key, ref.size) for key, (ref, _) in pack_users.items())
    users.update((key, found) for key, (_, found) in pack_users.items())
    cpu = threading.BoundedSemaphore(knobs.cpu_threads())

    def check(key: str) -> tuple[str, str | None, int]:
        if key not in stored:
            return key, "is missing", 0
        if key in sizes and stored[key] != sizes[key]:
            return key, f"has {stored[key]} bytes, the catalog recorded {sizes[key]}", stored[key]
        if deep:
            try:
                # Sizes the catalog records bound what a decode may allocate (tests/test_bombs.py).
                if key in pack_users:
                    fetch_pack(objects, key, cpu, pack_users[key][0].raw_size)
                else:
                    fetch_blob(objects, key, cpu, recorded[key].raw_size if key in recorded else None)
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
    report.orphans = sorted([*blobs.unreferenced(users), *packs.unreferenced(users)])
    files = layout.list_files(objects)
    _verify_files(objects, catalog, files, report)
    report.stray_objects = sorted(manifests.stray + blobs.stray + packs.stray + files.stray)
    _count_temporary(objects, report)
    return report


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
        elif (
            report.deep and auxfiles.file_key(objects.get(layout.file_name(key)), objects.content_hash) != key
        ):
            problem = "is corrupt (its content does not hash to its key)"
        else:
            continue
        report.file_problems.append(FileProblem(key, problem, users))


def _verify_manifests(
    objects: ObjectStore, catalog: Catalog, manifests: layout.ManifestListing, report: VerifyReport
) -> None:
    """Read every step's manifest (its newest generation; with a key, its newest authentic one,
    reporting each newer one that is not), layer indexes included, and compare what it
    references with the catalog's rows of the step: a catalog row a store writer added (a
    pack, a blob, an auxiliary file) shows here."""

    def read(step: int) -> tuple[int, str, StepRecord | str | None, list[str]]:
        generation = manifests.generation(step)
        try:
            record, generation, rejected = read_authentic_manifest(objects, step, generation)
            return step, layout.manifest_name(step, generation), record, rejected
        except NotFoundError:
            return step, layout.manifest_name(step, generation), None, []  # dropped by a gc since the listing
        except (CorruptError, UnsupportedError) as exc:
            return step, layout.manifest_name(step, generation), f"cannot be read ({exc})", []

    with ThreadPoolExecutor(knobs.io_threads()) as pool:
        for step, name, record, rejected in pool.map(read, sorted(manifests.found)):
            report.manifests_checked += 1
            for problem in rejected:
                report.manifest_problems.append(f"step {step}: {problem} (ignored: the step reads {name})")
            problem = record if isinstance(record, str) else _disagreement(catalog, step, record)
            if problem:
                report.manifest_problems.append(f"step {step}: manifest {name} {problem}")


def _disagreement(catalog: Catalog, step: int, record: StepRecord | None) -> str | None:
    """How the catalog's rows of ``step`` differ from its manifest's ``record``, field by field
    (``digests``: description, layers, files, metrics, each layer's index; the sizes of its
    format-1 blobs and what it added), if they do."""
    if record is None:
        return None
    catalog.load([step])
    if not catalog.is_recorded(step):
        return "is readable, but the catalog could not import it"
    differing = digests.differences(digests.record_parts(record), catalog.row_parts(step))
    blobs = catalog.blob_sizes(b.key for b in record.blobs)
    differing += [f"the sizes of blob {b.key}" for b in record.blobs if blobs.get(b.key, b) != b]
    if record.added is not None and catalog.added(step) != record.added:
        differing.append("what the step added")
    if not differing:
        return None
    more = f" (and {len(differing) - 3} more)" if len(differing) > 3 else ""
    return (
        f"says other than the catalog about {', '.join(differing[:3])}{more} "
        "(run `ckptstore catalog rebuild`)"
    )
