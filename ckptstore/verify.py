"""``verify``: is every step's manifest readable and in agreement with the catalog, and does
every pack, blob and auxiliary file a committed step references exist, intact?

Read-only: problems are reported, never repaired. What no step references (orphan blobs,
stray objects under a known prefix) is information.

A gc (or a commit) may run beside it: a problem seen on the way is checked again at the end
(``_recheck``) against a fresh listing of the manifests, and reported only if it still holds
for a step that still exists. A step a gc dropped meanwhile, or a pack it swept with it, is
no problem; neither is a manifest the catalog could not import because it was just deleted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from . import auxfiles, knobs
from .catalog import Catalog, digests, sync
from .catalog.sync import read_authentic_manifest
from .dcp import dcp_description
from .dcp.directory import refused_bytes_items
from .errors import CorruptError, NotFoundError, UnsupportedError
from .format import deletions, layout
from .materialize.fetch import fetch_blob, fetch_pack
from .model import StepRecord
from .objects import ObjectStore
from .progress import progress_bar
from .quarantine import move_aside


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
    # manifests and deletion records that cannot be read or are not authentic (what
    # ``verify --quarantine`` moves aside); one a newer ckptstore wrote is not among them
    unreadable_manifests: list[str] = field(default_factory=list)
    # manifests of deleted steps (``format.deletions``): not steps; gc deletes them
    buried_manifests: list[str] = field(default_factory=list)
    # what ``verify --quarantine`` moved: name -> where it is now
    quarantined: dict[str, str] = field(default_factory=dict)
    # unfinished writes (``.tmp``): in flight, or left by killed writers (gc removes old ones)
    temporary: int = 0
    temporary_bytes: int = 0
    # problems seen on the way that were gone when checked again at the end (a gc ran beside)
    passed_on_recheck: int = 0

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
            "unreadable_manifests": self.unreadable_manifests,
            "buried_manifests": self.buried_manifests,
            "quarantined": self.quarantined,
            "temporary": self.temporary,
            "temporary_bytes": self.temporary_bytes,
            "passed_on_recheck": self.passed_on_recheck,
        }  # fmt: skip


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
    each, and reports each auxiliary file and DCP bytes item materialize would refuse as a
    pickle that needs more than ``torch.load(weights_only=True)``. What it finds is checked
    again at the end (``_recheck``), so a gc running beside it makes no problem.
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
    report.unreadable_manifests.extend(manifests.unreadable)
    report.manifest_problems.extend(manifests.problems)
    pause("listed")
    by_step = _verify_manifests(objects, catalog, manifests, report, pause)
    users = catalog.referenced_blobs()
    recorded = catalog.blob_sizes(users)
    sizes = {key: size.size for key, size in recorded.items()}
    index_problems = _index_problems(catalog, manifests, users, sizes)
    report.catalog_problems.extend(index_problems)
    blobs = layout.list_blobs(objects)
    packs = layout.list_packs(objects)
    pack_users = catalog.referenced_packs(report.catalog_problems)
    stored = {key: info.size for key, info in blobs.found.items()}
    stored.update((key, info.size) for key, info in packs.found.items())
    sizes.update((key, ref.size) for key, (ref, _) in pack_users.items())
    users.update((key, found) for key, (_, found) in pack_users.items())
    cpu = threading.BoundedSemaphore(knobs.cpu_threads())
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
    pause("checked")
    if by_step or index_problems or report.problems or report.file_problems:
        _recheck(objects, catalog, manifests, report, by_step, index_problems, check)
    if deep:  # after the re-check, which checks a pack's bytes, not what DCP would unpickle
        _verify_bytes_items(objects, catalog, report)
    if quarantine:
        report.quarantined = move_aside(objects, report.unreadable_manifests)
    return report


def _index_problems(
    catalog: Catalog, manifests: layout.ManifestListing, users: dict, sizes: dict[str, int]
) -> list[str]:
    """What is wrong with the catalog's rows themselves, given the manifests listed."""
    problems = catalog.consistency_problems()
    problems += [f"blob {blob} is referenced but has no size record" for blob in users if blob not in sizes]
    problems += [
        f"step {step} has no manifest in the store (a catalog rebuild would lose it)"
        for step in manifests.missing(catalog.steps())
    ]
    return problems


def _recheck(
    objects: ObjectStore,
    catalog: Catalog,
    listed: layout.ManifestListing,
    report: VerifyReport,
    by_step: dict[int, list[str]],
    index_problems: list[str],
    check: Callable[..., tuple[str, str | None, int]],
) -> None:
    """Keep of the problems found only those that still hold now, against a fresh listing of
    the manifests (and the catalog synced with it): a problem of steps that are gone, or whose
    record no longer names what was missing, was a gc running beside verify, not damage."""
    now = deletions.list_manifests(objects)
    sync.sync(catalog, objects)  # a step dropped elsewhere leaves a cache; a rewritten one is re-listed
    before = len(report.problems) + len(report.file_problems) + len(index_problems)
    before += sum(len(problems) for problems in by_step.values())

    def still_needed(key: str, steps: set[int], files: bool = False) -> bool:
        for step in sorted(steps & set(now.found)):
            if step in listed.found and listed.generation(step) == now.generation(step):
                return True  # the record verify checked against still stands
            try:
                record, _, _ = read_authentic_manifest(
                    objects, step, now.generation(step), now.deleted.get(step, -1)
                )
            except NotFoundError:
                continue
            except (CorruptError, UnsupportedError):
                return True
            named = {row.key for row in record.files} if files else _named(record)
            if key in named:
                return True
        return False

    problems = []
    for problem in report.problems:
        if still_needed(problem.blob, {user[0] for user in problem.users}):
            name = layout.pack_name(problem.blob) if problem.users[0][3] == "pack" else None
            name = name or layout.blob_name(problem.blob)
            try:
                size = objects.info(name).size
            except NotFoundError:
                problems.append(problem)  # still missing
                continue
            _, again, _ = check(problem.blob, {problem.blob: size})
            if again:
                problems.append(BlobProblem(problem.blob, again, problem.users))
    report.problems = problems
    report.file_problems = [
        problem
        for problem in report.file_problems
        if still_needed(problem.key, {user[0] for user in problem.users}, files=True)
        and (problem.problem != "is missing" or not objects.exists(layout.file_name(problem.key)))
    ]
    again: list[str] = []
    recorded = catalog.generations()
    for step in sorted(set(by_step) & set(now.found)):
        generation = now.generation(step)
        try:
            record, generation, rejected = read_authentic_manifest(
                objects, step, generation, now.deleted.get(step, -1)
            )
        except NotFoundError:
            continue
        except (CorruptError, UnsupportedError) as exc:
            record, rejected = f"cannot be read ({exc})", []
        again += _manifest_problems(catalog, step, generation, record, rejected, now, recorded)
    users = catalog.referenced_blobs()
    sizes = {key: row.size for key, row in catalog.blob_sizes(users).items()}
    fresh = set(_index_problems(catalog, now, users, sizes))
    report.catalog_problems = [p for p in report.catalog_problems if p not in index_problems]
    report.catalog_problems += [p for p in index_problems if p in fresh]
    report.manifest_problems = [p for p in report.manifest_problems if p not in _flat(by_step)] + again
    after = len(report.problems) + len(report.file_problems) + len(again)
    after += len([p for p in index_problems if p in fresh])
    report.passed_on_recheck = max(0, before - after)


def _named(record: StepRecord) -> set[str]:
    """Every pack and blob ``record`` names."""
    return {p.key for index in record.packs.values() for p in index.packs} | {t.blob for t in record.tensors}


def _flat(by_step: dict[int, list[str]]) -> list[str]:
    return [problem for problems in by_step.values() for problem in problems]


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
            elif not (problem := auxfiles.pickle_problem(data)):  # what materialize refuses
                continue
        else:
            continue
        report.file_problems.append(FileProblem(key, problem, users))


def _verify_bytes_items(objects: ObjectStore, catalog: Catalog, report: VerifyReport) -> None:
    """Deep: every bytes item of a DCP step loads with ``torch.load(weights_only=True)``, as
    materialize requires (DCP's reader unpickles it); one that does not is a problem of its
    pack, needed by each step that reads it. A pack that cannot be read is reported by the
    pack check."""
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


def _verify_manifests(
    objects: ObjectStore,
    catalog: Catalog,
    manifests: layout.ManifestListing,
    report: VerifyReport,
    pause: Callable[[str], None],
) -> dict[int, list[str]]:
    """Read every step's manifest (its newest generation; with a key, its newest authentic one,
    reporting each newer one that is not), layer indexes included, and compare what it
    references with the catalog's rows of the step: a catalog row a store writer added (a
    pack, a blob, an auxiliary file) shows here. A step committed again after a deletion must
    find that deletion in the record, and no step a generation older than the catalog read.
    The manifests that cannot be read or authenticated are named in ``unreadable_manifests``.
    Returns the problems found by step."""
    recorded = catalog.generations()

    def read(step: int) -> tuple[int, int, StepRecord | str | None, list[str]]:
        generation = manifests.generation(step)
        try:
            record, generation, rejected = read_authentic_manifest(
                objects, step, generation, manifests.deleted.get(step, -1)
            )
            return step, generation, record, rejected
        except NotFoundError:
            return step, generation, None, []  # dropped by a gc since the listing
        except UnsupportedError as exc:  # a newer ckptstore's: not to be moved aside
            return step, generation, f"cannot be read ({exc})", []
        except CorruptError as exc:
            return step, generation, f"cannot be read ({exc})", [""]

    by_step: dict[int, list[str]] = {}
    with ThreadPoolExecutor(knobs.io_threads()) as pool:
        for step, generation, record, rejected in pool.map(read, sorted(manifests.found)):
            report.manifests_checked += 1
            pause("manifest")
            if rejected:  # every generation above the one read was passed over; all, if none was read
                floor = generation if not isinstance(record, str) else -1
                report.unreadable_manifests.extend(
                    layout.manifest_name(step, g) for g in manifests.generations[step] if g > floor
                )
            problems = _manifest_problems(catalog, step, generation, record, rejected, manifests, recorded)
            if problems:
                by_step[step] = problems
                report.manifest_problems += problems
    return by_step


def _manifest_problems(
    catalog: Catalog,
    step: int,
    generation: int,
    record: StepRecord | str | None,
    rejected: list[str],
    listing: layout.ManifestListing,
    recorded: dict[int, int],
) -> list[str]:
    """What is wrong with ``step``'s manifest of ``generation`` as read (``record``: a
    problem's text, or None if it was gone) and with the newer generations passed over
    (``rejected``; "" for one only moved aside), against the deletions in ``listing`` and the
    generations this node read before (``recorded``)."""
    name = layout.manifest_name(step, generation)
    problems = [f"step {step}: {problem} (ignored: the step reads {name})" for problem in rejected if problem]
    if isinstance(record, str):
        problem = record
    else:  # a rollback first: the catalog's rows then differ from the old manifest too
        problem = _rolled_back(step, generation, record, recorded, listing.deleted)
        problem = problem or _disagreement(catalog, step, record)
    if problem:
        problems.append(f"step {step}: manifest {name} {problem}")
    return problems


def _rolled_back(
    step: int, generation: int, record: StepRecord | None, recorded: dict[int, int], deleted: dict[int, int]
) -> str | None:
    """Whether ``record`` (read at ``generation``) is older than what the store said before."""
    if record is not None and record.supersedes is not None and deleted.get(step, -1) < record.supersedes:
        return (
            f"was committed after generation {record.supersedes} was deleted, but the store's deletion "
            "record lacks that deletion (a store writer removed or replaced the record)"
        )
    if record is not None and recorded.get(step, -1) > generation:
        return (
            f"is generation {generation}, older than generation {recorded[step]} this node read before "
            "(a store writer put an old manifest back or removed the newer one)"
        )
    return None


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
