"""``verify``'s reading of the manifests: each one readable, authentic, not rolled back, and
in agreement with the catalog's rows of its step; and the catalog's rows themselves."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .. import knobs
from ..catalog import Catalog, digests
from ..catalog.sync import read_authentic_manifest
from ..errors import CorruptError, NotFoundError, UnsupportedError
from ..format import layout
from ..model import StepRecord
from ..objects import ObjectStore
from .report import VerifyReport


def verify_manifests(
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
            problems = manifest_problems(catalog, step, generation, record, rejected, manifests, recorded)
            if problems:
                by_step[step] = problems
                report.manifest_problems += problems
    return by_step


def manifest_problems(
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


def index_problems(
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
