"""Uploading a step from the local tier to the remote store: its objects first, its manifest last.

The remote's manifest is its commit point, so a step becomes visible there only once every
pack, blob and file it names is there: each is freshened if the remote has it (what a direct
commit does for a reused pack, so a gc's grace period protects it), else copied from the local
tier with a create-only write. A step whose upload broke off is simply uploaded again: the
objects already there are found, and the manifest was never written.

The local tier remembers which steps it uploaded (``tier/uploaded/<step>``), so a step a gc
later dropped from the remote is never uploaded a second time; the mark holds how long the
upload took and the bytes it copied (``upload_figures``), which ``ckptstore report`` charts.

In a job of several ranks each rank uploads its own share of a step (the packs and files its
commit wrote, listed in the tier by ``TieredObjectStore.note_share``), so that no pack goes up
twice and a node whose tier lacks the manifest still uploads what it holds; the manifest goes
up from a node that has it once every object it names is in the remote.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import knobs
from ..catalog.sync import read_manifest
from ..errors import ConflictError, CorruptError, NotFoundError
from ..format import layout
from ..model import StepRecord
from ..objects import ObjectStore
from ..objects.tiered import SHARES, UPLOADED, share_name, uploaded_name

__all__ = ["UPLOADED", "uploaded_name"]


def uploaded_steps(local: ObjectStore) -> set[int]:
    """The steps the local tier has uploaded (and marked so)."""
    steps = (layout.parse_number(info.name[len(UPLOADED) :]) for info in local.list(UPLOADED))
    return {step for step in steps if step is not None}


def local_steps(local: ObjectStore) -> list[int]:
    """The steps committed to the local tier whose manifest it still holds, ascending."""
    return sorted(layout.list_manifests(local).generations)


def read_local_manifest(local: ObjectStore, step: int) -> StepRecord:
    """``step``'s record as the local tier holds it: its newest manifest there (a step deleted
    and committed again is a newer generation, ``format.deletions``). NotFoundError if none."""
    generations = layout.generations_of(local, step)
    if not generations:
        raise NotFoundError(f"the local tier {local.uri} holds no manifest of step {step}")
    return read_manifest(local, step, generations[-1])


def pending_steps(local: ObjectStore) -> list[int]:
    """The steps committed to the local tier that are not in the remote store yet, ascending."""
    done = uploaded_steps(local)
    return [step for step in local_steps(local) if step not in done]


def share_lists(local: ObjectStore) -> list[tuple[int, int]]:
    """``(step, rank)`` of every share the local tier lists (uploaded or not), oldest first."""
    return sorted(_shares(local)[0])


def pending_shares(local: ObjectStore) -> list[tuple[int, int]]:
    """``(step, rank)`` of every share the local tier lists and has not uploaded, oldest first."""
    found, done = _shares(local)
    return sorted(found - done)


def share_steps(local: ObjectStore) -> set[int]:
    """The steps the local tier lists a share of (uploaded or not)."""
    return {step for step, _ in _shares(local)[0]}


def _shares(local: ObjectStore) -> tuple[set[tuple[int, int]], set[tuple[int, int]]]:
    """The shares listed, and those marked uploaded, as ``(step, rank)``."""
    found, done = set(), set()
    for info in local.list(SHARES):
        step, _, leaf = info.name[len(SHARES) :].partition("/")
        rank, _, kind = leaf.partition(".")
        step, rank = layout.parse_number(step), layout.parse_number(rank)
        if step is not None and rank is not None and kind in ("json", "done"):
            (found if kind == "json" else done).add((step, rank))
    return found, done


def read_share(local: ObjectStore, step: int, rank: int) -> dict[str, int]:
    """The objects rank ``rank`` stored for ``step`` (name -> size); CorruptError if unreadable."""
    name = share_name(step, rank)
    try:
        names = json.loads(local.get(name))
    except (ValueError, RecursionError):
        raise CorruptError(f"{local.uri}/{name} is not a share list") from None
    if not isinstance(names, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in names.items()
    ):
        raise CorruptError(f"{local.uri}/{name} is not a share list")
    return names


def upload_share(
    local: ObjectStore,
    remote: ObjectStore,
    step: int,
    rank: int,
    *,
    progress: Callable[[int], None] | None = None,
) -> StepUpload:
    """Put every object of rank ``rank``'s share of ``step`` in ``remote`` and mark the share
    uploaded. Raises as ``upload_step``."""
    report = StepUpload(step)
    _copy_all(local, remote, step, read_share(local, step, rank), report, progress)
    local.put_if_absent(share_name(step, rank).removesuffix(".json") + ".done", b"")
    return report


def object_names(record: StepRecord) -> dict[str, int]:
    """Every object ``record`` names (packs, format-1 blobs, auxiliary files) -> its stored size."""
    names = {
        layout.pack_name(ref.key): ref.size for index in record.packs.values() for ref in index.all_packs
    }
    names.update((layout.blob_name(blob.key), blob.size) for blob in record.blobs)
    names.update((layout.file_name(row.key), row.size) for row in record.files)
    return names


@dataclass
class StepUpload:
    """What uploading one step did: objects copied (and their bytes), objects the remote had,
    and the objects of other ranks it waits for (then it published nothing)."""

    step: int
    copied: int = 0
    bytes_copied: int = 0
    found: int = 0
    waiting: list[str] = field(default_factory=list)


def upload_step(
    local: ObjectStore,
    remote: ObjectStore,
    step: int,
    *,
    ranks: set[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> StepUpload:
    """Put ``step`` in ``remote``: every object it names, then its manifest; then mark it uploaded.

    Durable in ``remote`` when it returns with nothing ``waiting``. ``ranks``: copy only these
    ranks' packs (the others' are their own processes' to upload: the step then waits until
    they are there, and ``waiting`` names them); None copies whatever the local tier holds.
    ``progress`` is called with the bytes of each object copied. Raises NotFoundError naming the
    object if neither tier holds one the step needs (a gc on the remote removed it while the
    step waited, or it is on another node's tier), ConflictError if the remote has another
    commit of ``step``, and what the object stores raise (StorageError when the remote cannot
    be reached): nothing is published then, and uploading again later goes on from there.
    """
    started = time.monotonic()
    record = read_local_manifest(local, step)
    generation = layout.generations_of(local, step)[-1]
    report = StepUpload(step)
    names = object_names(record)
    if ranks is not None:
        owner = {
            layout.pack_name(ref.key): ref.rank for index in record.packs.values() for ref in index.all_packs
        }
        others = {name for name in names if name in owner and owner[name] not in ranks}
        report.waiting = sorted(name for name in others if remote.touch(name) is None)
        if report.waiting:
            return report
        names = {name: size for name, size in names.items() if name not in others}
    _copy_all(local, remote, step, names, report, progress)
    name = layout.manifest_name(step, generation)
    data = local.get(name)
    if not remote.put_if_absent(name, data, single_request=True) and remote.get(name) != data:
        raise ConflictError(
            f"step {step} of this node's tier cannot be uploaded: {remote.uri} has another commit of "
            f"step {step}; the local one stays in the tier (materialize it with local=, or delete it there)"
        )
    figures = {"seconds": round(time.monotonic() - started, 6), "bytes": report.bytes_copied}
    local.put_if_absent(uploaded_name(step), json.dumps(figures, sort_keys=True).encode())
    return report


# A mark is a few dozen bytes; one larger is not a mark this code wrote.
_MARK_BYTES = 256


def upload_figures(local: ObjectStore, steps: list[int]) -> dict[int, tuple[float, int]]:
    """The steps of ``steps`` this local tier uploaded with its figures in the mark: step ->
    (seconds the upload took, bytes it copied). Marks written before the figures were kept, or
    that are not what this code writes (damage), are left out: the figures are for a report."""
    done = uploaded_steps(local)
    figures = {}
    for step in steps:
        if step not in done:
            continue
        try:
            data = local.get_range(uploaded_name(step), 0, _MARK_BYTES + 1)
            mark = json.loads(bytes(data)) if 0 < len(data) <= _MARK_BYTES else None
        except (NotFoundError, ValueError, UnicodeDecodeError):
            continue
        seconds, copied = (mark.get("seconds"), mark.get("bytes")) if isinstance(mark, dict) else (None, None)
        if (
            isinstance(seconds, int | float) and not isinstance(seconds, bool) and 0 <= seconds < 1e8
            and isinstance(copied, int) and not isinstance(copied, bool) and copied >= 0
        ):  # fmt: skip
            figures[step] = (float(seconds), copied)
    return figures


def _copy_all(
    local: ObjectStore,
    remote: ObjectStore,
    step: int,
    names: dict[str, int],
    report: StepUpload,
    progress: Callable[[int], None] | None,
) -> None:
    """Freshen each of ``names`` the remote has, copy the others from the local tier."""

    def copy(name: str) -> int | None:
        if remote.touch(name) is not None:
            return None
        try:
            data = local.get_range(name, 0, local.info(name).size)
        except NotFoundError:
            raise NotFoundError(
                f"step {step} needs {name}, which neither this node's tier nor {remote.uri} holds "
                "(on another node's tier, run `ckptstore drain` there; else a gc removed it while "
                "the upload waited: see docs/s3-and-tiers.md on gc and the local tier)"
            ) from None
        remote.put_if_absent(name, data)
        return memoryview(data).nbytes

    with ThreadPoolExecutor(knobs.io_threads()) as pool:
        for copied in pool.map(copy, names):
            if copied is None:
                report.found += 1
            else:
                report.copied += 1
                report.bytes_copied += copied
                if progress is not None:
                    progress(copied)
