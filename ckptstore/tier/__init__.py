"""The local tier: commits durable on node-local disk, uploaded to the remote store behind.

``ckptstore.open(uri, local=PATH)`` puts a ``TieredObjectStore`` in front of the store: commits
write there (``objects.tiered``), ``Tier`` uploads what the remote lacks (``upload``) in step
order and then keeps the local tier small (``prune``). Which remote a directory fronts is
recorded in it (``pairing``), so ``ckptstore drain --local PATH`` finishes a crashed job's uploads.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import CkptStoreError, StorageError
from ..objects import ObjectStore
from .prune import PruneReport, prune
from .upload import StepUpload, local_steps, pending_steps, upload_step, uploaded_steps

__all__ = ["Tier", "DrainReport", "PendingStep"]

# Waits between passes of a drain with a timeout: the first at most 1 s, doubling up to a minute.
_FIRST_WAIT = 1.0
_LONGEST_WAIT = 60.0


@dataclass
class PendingStep:
    """A step the local tier holds that the remote store does not have yet."""

    step: int
    bytes: int  # stored bytes of every object it names (what an upload reads at most)
    error: str | None = None  # why its last upload failed; None if none was tried or it is under way


@dataclass
class DrainReport:
    """What a drain uploaded, and what it then pruned from the local tier."""

    uploaded: list[StepUpload] = field(default_factory=list)
    pruned: PruneReport | None = None

    @property
    def bytes_copied(self) -> int:
        """Bytes sent to the remote store."""
        return sum(step.bytes_copied for step in self.uploaded)


class Tier:
    """A node-local directory in front of a remote store: what is only here, uploading it, pruning.

    ``keep``: once uploaded, the local tier keeps what its ``keep`` newest steps need.
    """

    def __init__(self, local: ObjectStore, remote: ObjectStore, *, keep: int) -> None:
        self.local = local
        self.remote = remote
        self.keep = keep
        self._lock = threading.Lock()  # one upload pass at a time in this process
        self._errors: dict[int, str] = {}

    def locations(self) -> dict[int, str]:
        """Every step this node's tier knows of -> ``"local"`` (not uploaded yet), ``"both"``
        (uploaded, still held here). Steps only the remote holds are not named."""
        done = uploaded_steps(self.local)
        return {step: "both" if step in done else "local" for step in local_steps(self.local)}

    def pending(self) -> list[PendingStep]:
        """The steps not in the remote store yet, oldest first, with their size and last error."""
        from ..catalog.sync import read_manifest
        from .upload import object_names

        found = []
        for step in pending_steps(self.local):
            size = sum(object_names(read_manifest(self.local, step)).values())
            found.append(PendingStep(step, size, self._errors.get(step)))
        return found

    def drain(
        self, timeout: float | None = None, *, progress: Callable[[int], None] | None = None
    ) -> DrainReport:
        """Upload every step the remote lacks, oldest first, then prune the local tier.

        Durable in the remote when it returns. ``timeout`` None: one pass (each request with
        the store's own retries); a number: passes with growing waits between them until every
        step is up or ``timeout`` seconds have passed. Raises, naming every step not uploaded
        and why, the error of the first that failed: StorageError (the remote cannot be
        reached), ConflictError (the remote has another commit of that step), NotFoundError (an
        object it needs is in neither tier). What is not uploaded stays in the local tier.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        report = DrainReport()
        wait = _FIRST_WAIT
        while True:
            failed = self._upload_pass(report, progress)
            if not failed:
                break
            if deadline is None or time.monotonic() + wait > deadline:
                raise _failure(failed, self.remote.uri)
            time.sleep(random.uniform(wait / 2, wait))
            wait = min(wait * 2, _LONGEST_WAIT)
        with self._lock:
            report.pruned = prune(self.local, self.keep)
        return report

    def _upload_pass(
        self, report: DrainReport, progress: Callable[[int], None] | None
    ) -> dict[int, CkptStoreError]:
        """Try every pending step once, oldest first; the steps that failed -> why."""
        failed: dict[int, CkptStoreError] = {}
        with self._lock:
            for step in pending_steps(self.local):
                try:
                    report.uploaded.append(upload_step(self.local, self.remote, step, progress=progress))
                    self._errors.pop(step, None)
                except CkptStoreError as exc:
                    failed[step] = exc
                    self._errors[step] = str(exc)
        return failed


def _failure(failed: dict[int, CkptStoreError], remote: str) -> CkptStoreError:
    """One error naming every step not uploaded, of the class of the first one's."""
    first = min(failed)
    error = failed[first]
    steps = ", ".join(str(step) for step in sorted(failed))
    message = f"step{'s' if len(failed) > 1 else ''} {steps} not uploaded to {remote}: step {first}: {error}"
    if isinstance(error, StorageError):
        return StorageError(message, transient=error.transient)
    return type(error)(message)
