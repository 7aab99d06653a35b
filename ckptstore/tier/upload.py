"""Uploading a step from the local tier to the remote store: its objects first, its manifest last.

The remote's manifest is its commit point, so a step becomes visible there only once every
pack, blob and file it names is there: each is freshened if the remote has it (what a direct
commit does for a reused pack, so a gc's grace period protects it), else copied from the local
tier with a create-only write. A step whose upload broke off is simply uploaded again: the
objects already there are found, and the manifest was never written.

The local tier remembers which steps it uploaded (``tier/uploaded/<step>``), so a step a gc
later dropped from the remote is never uploaded a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .. import knobs
from ..catalog.sync import read_manifest
from ..errors import ConflictError, NotFoundError
from ..format import layout
from ..model import StepRecord
from ..objects import ObjectStore

UPLOADED = "tier/uploaded/"


def uploaded_name(step: int) -> str:
    """The local tier's mark that ``step`` is in the remote store."""
    return f"{UPLOADED}{step:012d}"


def uploaded_steps(local: ObjectStore) -> set[int]:
    """The steps the local tier has uploaded (and marked so)."""
    return {
        int(info.name[len(UPLOADED) :])
        for info in local.list(UPLOADED)
        if info.name[len(UPLOADED) :].isdigit()
    }


def local_steps(local: ObjectStore) -> list[int]:
    """The steps committed to the local tier whose manifest it still holds, ascending."""
    return sorted(
        step for step, generations in layout.list_manifests(local).generations.items() if 0 in generations
    )


def pending_steps(local: ObjectStore) -> list[int]:
    """The steps committed to the local tier that are not in the remote store yet, ascending."""
    done = uploaded_steps(local)
    return [step for step in local_steps(local) if step not in done]


def object_names(record: StepRecord) -> dict[str, int]:
    """Every object ``record`` names (packs, format-1 blobs, auxiliary files) -> its stored size."""
    names = {layout.pack_name(ref.key): ref.size for index in record.packs.values() for ref in index.packs}
    names.update((layout.blob_name(blob.key), blob.size) for blob in record.blobs)
    names.update((layout.file_name(row.key), row.size) for row in record.files)
    return names


@dataclass
class StepUpload:
    """What uploading one step did: objects copied (and their bytes), objects the remote had."""

    step: int
    copied: int = 0
    bytes_copied: int = 0
    found: int = 0


def upload_step(
    local: ObjectStore,
    remote: ObjectStore,
    step: int,
    *,
    progress: Callable[[int], None] | None = None,
) -> StepUpload:
    """Put ``step`` in ``remote``: every object it names, then its manifest; then mark it uploaded.

    Durable in ``remote`` when it returns. ``progress`` is called with the bytes of each object
    copied. Raises NotFoundError naming the object if neither tier holds one the step needs (a
    gc on the remote removed it while the step waited), ConflictError if the remote has another
    commit of ``step``, and what the object stores raise (StorageError when the remote cannot
    be reached): nothing is published then, and uploading again later goes on from there.
    """
    record = read_manifest(local, step)
    report = StepUpload(step)

    def copy(item: tuple[str, int]) -> int | None:
        name, _ = item
        if remote.touch(name) is not None:
            return None
        try:
            data = local.get_range(name, 0, local.info(name).size)
        except NotFoundError:
            raise NotFoundError(
                f"step {step} needs {name}, which neither this node's tier nor {remote.uri} holds "
                "(did a gc remove it while the upload waited? see the README on gc and the local tier)"
            ) from None
        remote.put_if_absent(name, data)
        return memoryview(data).nbytes

    with ThreadPoolExecutor(knobs.io_threads()) as pool:
        for copied in pool.map(copy, object_names(record).items()):
            if copied is None:
                report.found += 1
            else:
                report.copied += 1
                report.bytes_copied += copied
                if progress is not None:
                    progress(copied)
    name = layout.manifest_name(step)
    data = local.get(name)
    if not remote.put_if_absent(name, data, single_request=True) and remote.get(name) != data:
        raise ConflictError(
            f"step {step} of this node's tier cannot be uploaded: {remote.uri} has another commit of "
            f"step {step}; the local one stays in the tier (materialize it with local=, or delete it there)"
        )
    local.put_if_absent(uploaded_name(step), b"")
    return report
