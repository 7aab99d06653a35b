"""``verify``'s second look: what it found, checked again against a fresh listing at the end,
so that a gc running beside it (a step dropped, a pack swept with it) is no problem."""

from __future__ import annotations

from collections.abc import Callable

from ..catalog import Catalog, sync
from ..catalog.sync import read_authentic_manifest
from ..errors import CorruptError, NotFoundError, UnsupportedError
from ..format import deletions, layout
from ..model import StepRecord
from ..objects import ObjectStore
from .manifests import index_problems, manifest_problems
from .report import BlobProblem, VerifyReport


def recheck(
    objects: ObjectStore,
    catalog: Catalog,
    listed: layout.ManifestListing,
    report: VerifyReport,
    by_step: dict[int, list[str]],
    catalog_rows: list[str],
    check: Callable[..., tuple[str, str | None, int]],
) -> None:
    """Keep of the problems found only those that still hold now, against a fresh listing of
    the manifests (and the catalog synced with it): a problem of steps that are gone, or whose
    record no longer names what was missing, was a gc running beside verify, not damage."""
    now = deletions.list_manifests(objects)
    sync.sync(catalog, objects)  # a step dropped elsewhere leaves a cache; a rewritten one is re-listed
    before = len(report.problems) + len(report.file_problems) + len(catalog_rows)
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
        again += manifest_problems(catalog, step, generation, record, rejected, now, recorded)
    users = catalog.referenced_blobs()
    sizes = {key: row.size for key, row in catalog.blob_sizes(users).items()}
    fresh = set(index_problems(catalog, now, users, sizes))
    report.catalog_problems = [p for p in report.catalog_problems if p not in catalog_rows]
    report.catalog_problems += [p for p in catalog_rows if p in fresh]
    report.manifest_problems = [p for p in report.manifest_problems if p not in _flat(by_step)] + again
    after = len(report.problems) + len(report.file_problems) + len(again)
    after += len([p for p in catalog_rows if p in fresh])
    report.passed_on_recheck = max(0, before - after)


def _named(record: StepRecord) -> set[str]:
    """Every pack and blob ``record`` names."""
    return {p.key for index in record.packs.values() for p in index.all_packs} | {
        t.blob for t in record.tensors
    }


def _flat(by_step: dict[int, list[str]]) -> list[str]:
    return [problem for problems in by_step.values() for problem in problems]
