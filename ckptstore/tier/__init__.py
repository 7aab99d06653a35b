"""The local tier: commits durable on node-local disk, uploaded to the remote store behind.

``ckptstore.open(uri, local=PATH)`` puts a ``TieredObjectStore`` in front of the store: commits
write there (``objects.tiered``), ``Tier`` uploads what the remote lacks (``upload``) in step
order, behind training (``uploader``) or when drained, and then keeps the local tier small
(``prune``). Which remote a directory fronts is recorded in it (``pairing``), so ``ckptstore
drain --local PATH`` finishes a crashed job's uploads.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import knobs, remote_knobs
from ..arguments import check_seconds
from ..errors import CkptStoreError, NotFoundError, StorageError
from ..format.config import ensure_config
from ..objects import ObjectStore
from . import p2p
from .prune import PruneReport, prune
from .recover import Recovery, Sources
from .replicas import Peers, ReplicaReport, node_name, replicate, replicated_steps
from .upload import (
    StepUpload,
    local_steps,
    pending_shares,
    pending_steps,
    read_share,
    share_lists,
    upload_share,
    upload_step,
    uploaded_steps,
)
from .uploader import BackgroundUploader

log = logging.getLogger("ckptstore")

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
    replicated: bool = False  # every share this node committed of it is in its peers' tiers too


@dataclass
class DrainReport:
    """What a drain uploaded, and what it then pruned from the local tier."""

    uploaded: list[StepUpload] = field(default_factory=list)
    # ranks' shares of steps whose manifest another node's tier holds (rank -> what went up)
    shares: list[tuple[int, StepUpload]] = field(default_factory=list)
    pruned: PruneReport | None = None

    @property
    def bytes_copied(self) -> int:
        """Bytes sent to the remote store."""
        return sum(step.bytes_copied for step in [*self.uploaded, *(share for _, share in self.shares)])


class Tier:
    """A node-local directory in front of a remote store: what is only here, uploading it, pruning.

    ``keep``: once uploaded, the local tier keeps what its ``keep`` newest steps need.
    ``max_bytes``: past this many bytes of steps not uploaded yet, a commit waits (0: never).
    """

    def __init__(
        self,
        local: ObjectStore,
        remote: ObjectStore,
        *,
        keep: int,
        max_bytes: int = 0,
        remote_checked: bool = True,
        replicas: int = 0,
    ) -> None:
        self.local = local
        #: How many other nodes' tiers each commit is copied into (``replicas``).
        self.replicas = replicas
        self._peers: Peers | None = None
        #: What each replication of this process moved, and why one failed, by step.
        self.replica_reports: dict[int, ReplicaReport] = {}
        self.replica_errors: dict[int, str] = {}
        #: Where this rank's last restore found the bytes it read (with ``replicas``).
        self.restored_from: Sources | None = None
        self.remote = remote
        # False when the store was opened while it could not be reached: its config is checked
        # (and, for a new store, written) before the first upload.
        self._remote_checked = remote_checked
        self.keep = keep
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # one upload pass at a time in this process
        self._errors: dict[int, str] = {}
        self._uploader: BackgroundUploader | None = None
        self._said_full = False

    def upload_behind(self) -> None:
        """Upload from now on in a background thread, as steps land (steps a killed process
        left in the tier first). ``close`` stops it."""
        if self._uploader is None:
            self._uploader = BackgroundUploader(self._background_pass, self.remote.uri)

    def committed(self) -> None:
        """A commit just landed in the tier: the background uploader, if any, starts on it."""
        if self._uploader is not None:
            self._uploader.wake()

    def replicate(self, step: int) -> ReplicaReport | None:
        """Copy this rank's share of ``step`` into its peers' tiers and keep theirs
        (``replicas``); what moved, or None without replicas. Collective over the commit
        process group: every rank calls it after the same commits, in the same order. A
        failure (a peer that does not answer within ``CKPTSTORE_PEER_TIMEOUT``, say) is logged
        and kept in ``replica_errors``, never raised: the step is durable here and goes up to
        the remote store as any other; this rank then copies no more replicas."""
        if self.replicas == 0:
            return None
        from ..commit import ranks

        rank, size = ranks.world()
        if size == 1:
            return None
        try:
            group = ranks.commit_group()
            if self._peers is None:
                self._peers = Peers.of(p2p.gather_names(node_name(), group, size), rank, self.replicas)
                if not self._peers.send_to:
                    log.warning(
                        "ckptstore: replicas=%d, but no other node of the job has a rank %d's peer: "
                        "its commits are copied nowhere", self.replicas, rank,
                    )  # fmt: skip
            if not self._peers.send_to:
                return None  # one node: nothing is marked replicated that has no copy
            report = replicate(self.local, step, rank, read_share(self.local, step, rank), self._peers, group)
        except Exception as exc:  # the step is committed; only its copies are missing
            self.replica_errors[step] = str(exc)
            # Messages with the peers may be out of step now: none is exchanged again.
            self._peers = Peers([], [])
            log.warning(
                "ckptstore: step %d was not replicated to other nodes (%s); this rank copies no "
                "more replicas until the job restarts", step, exc,
            )  # fmt: skip
            return None
        self.replica_reports[step] = report
        return report

    def recovery(self, objects: ObjectStore, catalog) -> Recovery | None:
        """What a restore through this tier reads from the job's other tiers first
        (``recover``), or None without replicas or other ranks. Collective: every rank calls it."""
        from ..commit import ranks

        if self.replicas == 0 or ranks.world()[1] == 1:
            return None
        return Recovery(self.local, objects, catalog)

    def replicated(self) -> set[int]:
        """The steps whose every share this node committed its peers hold (``replicas``)."""
        return replicated_steps(self.local, share_lists(self.local))

    def wait_for_room(self) -> None:
        """Return once the steps not uploaded yet take at most ``max_bytes`` (at once when
        there is no limit); says so once on stderr the first time it has to wait."""
        while self.max_bytes and (backlog := sum(p.bytes for p in self.pending())) > self.max_bytes:
            if not self._said_full:
                self._said_full = True
                print(
                    f"ckptstore: {backlog} bytes of steps wait to be uploaded to {self.remote.uri}, more than "
                    f"local_max_bytes={self.max_bytes}: the commit waits for the uploads",
                    file=sys.stderr,
                )
            if self._uploader is None:
                self.drain(timeout=None)
            else:
                self._uploader.wake()
                time.sleep(remote_knobs.local_poll_seconds() / 4)

    def close(self) -> None:
        """Stop the background uploader after the step it is on, then try once more to upload
        what is pending; what still is not uploaded is named in a warning (nothing is lost: it
        stays in the tier for the next open or ``ckptstore drain``)."""
        if self._uploader is None:
            return
        self._uploader.stop()
        self._uploader = None
        if not pending_steps(self.local) and not pending_shares(self.local):
            return
        try:
            self.drain(timeout=None)
        except CkptStoreError as exc:
            log.warning(
                "ckptstore: %s; they stay in %s: run `ckptstore drain --local %s`",
                exc, self.local.uri, self.local.uri,
            )  # fmt: skip

    def _background_pass(self) -> dict[int, CkptStoreError]:
        """One background pass: upload what is pending, then prune if anything went up; the
        steps that failed. Steps waiting for other ranks are simply tried on the next pass."""
        report = DrainReport()
        failed, _ = self._upload_pass(report, None)
        if report.uploaded:
            with self._lock:
                prune(self.local, self.keep)
        return failed

    def locations(self) -> dict[int, str]:
        """Every step this node's tier knows of -> ``"local"`` (not uploaded yet), ``"local+peer"``
        (not uploaded yet, copied into the peers' tiers: ``replicas``), ``"both"`` (uploaded,
        still held here). Steps only the remote holds are not named."""
        done, copied = uploaded_steps(self.local), self.replicated()
        return {
            step: "both" if step in done else "local+peer" if step in copied else "local"
            for step in local_steps(self.local)
        }

    def pending(self) -> list[PendingStep]:
        """The steps not in the remote store yet, oldest first, with their size and last error."""
        from .upload import object_names, read_local_manifest

        sizes: dict[int, int] = {}
        for step in pending_steps(self.local):
            sizes[step] = sum(object_names(read_local_manifest(self.local, step)).values())
        for step, rank in pending_shares(self.local):  # a node whose tier lacks the manifest
            if step not in sizes:
                sizes[step] = sum(read_share(self.local, step, rank).values())
        copied = self.replicated()
        return [
            PendingStep(step, size, self._errors.get(step), step in copied)
            for step, size in sorted(sizes.items())
        ]

    def drain(
        self, timeout: float | None = None, *, progress: Callable[[int], None] | None = None
    ) -> DrainReport:
        """Upload every step the remote lacks, oldest first, then prune the local tier.

        Durable in the remote when it returns. ``timeout`` None: one pass (each request with
        the store's own retries; in a job of several ranks, waiting up to
        ``CKPTSTORE_LOCAL_WAIT_RANKS`` seconds for the other ranks' uploads); a number: passes
        with growing waits between them until every step is up or ``timeout`` seconds have
        passed. Raises, naming every step not uploaded and why, the error of the first that
        failed: StorageError (the remote cannot be reached), ConflictError (the remote has
        another commit of that step), NotFoundError (an object it needs is in neither tier, or
        other ranks' objects never arrived). What is not uploaded stays in the local tier.
        """
        timeout = check_seconds(timeout, "the drain's timeout", maximum=7 * knobs.DAY)
        start = time.monotonic()
        report = DrainReport()
        wait = _FIRST_WAIT
        while True:
            failed, waiting = self._upload_pass(report, progress)
            if not failed and not waiting:
                break
            # Other ranks' objects are on their way (their processes upload them): worth waiting
            # for even without a timeout, up to CKPTSTORE_LOCAL_WAIT_RANKS seconds.
            budget = timeout if timeout is not None else (0.0 if failed else remote_knobs.local_wait_ranks())
            if time.monotonic() + wait > start + budget:
                raise (
                    _failure(failed, self.remote.uri) if failed else _still_waiting(waiting, self.remote.uri)
                )
            time.sleep(random.uniform(wait / 2, wait))
            wait = min(wait * 2, _LONGEST_WAIT)
        with self._lock:
            report.pruned = prune(self.local, self.keep)
        return report

    def _upload_pass(
        self, report: DrainReport, progress: Callable[[int], None] | None
    ) -> tuple[dict[int, CkptStoreError], dict[int, list[str]]]:
        """Try every pending share and step once, oldest first; returns the steps that failed
        (-> why) and those waiting for other ranks' objects (-> which)."""
        failed: dict[int, CkptStoreError] = {}
        waiting: dict[int, list[str]] = {}
        own = _own_ranks()
        with self._lock:
            if not self._remote_checked:
                try:
                    ensure_config(self.remote, create=True)
                    self._remote_checked = True
                except CkptStoreError as exc:
                    failed = {step: exc for step in pending_steps(self.local)} or {-1: exc}
                    self._errors = {step: str(exc) for step in failed}
                    return failed, waiting
            for step, rank in pending_shares(self.local):
                if own is None or rank in own:
                    try:
                        report.shares.append(
                            (rank, upload_share(self.local, self.remote, step, rank, progress=progress))
                        )
                    except CkptStoreError as exc:
                        failed[step] = exc
            for step in pending_steps(self.local):
                if step in failed:
                    continue
                try:
                    upload = upload_step(self.local, self.remote, step, ranks=own, progress=progress)
                except CkptStoreError as exc:
                    failed[step] = exc
                    continue
                if upload.waiting:
                    waiting[step] = upload.waiting
                else:
                    report.uploaded.append(upload)
            self._errors = {step: str(exc) for step, exc in failed.items()}
        return failed, waiting


def _own_ranks() -> set[int] | None:
    """The ranks whose share this process uploads: its own in a job of several ranks (each
    rank uploads its own), None (whatever the tier holds) in a single process or the CLI."""
    from ..commit import ranks

    rank, size = ranks.world()
    return {rank} if size > 1 else None


def _still_waiting(waiting: dict[int, list[str]], remote: str) -> NotFoundError:
    first = min(waiting)
    return NotFoundError(
        f"step{'s' if len(waiting) > 1 else ''} {', '.join(map(str, sorted(waiting)))} not uploaded to {remote}: "
        f"step {first} waits for {len(waiting[first])} objects of other ranks ({waiting[first][0]}, ...) that "
        "their processes have not uploaded; if they stopped, run `ckptstore drain --local` on their nodes"
    )


def _failure(failed: dict[int, CkptStoreError], remote: str) -> CkptStoreError:
    """One error naming every step not uploaded, of the class of the first one's."""
    first = min(failed)
    error = failed[first]
    steps = ", ".join(str(step) for step in sorted(failed))
    message = f"step{'s' if len(failed) > 1 else ''} {steps} not uploaded to {remote}: step {first}: {error}"
    if isinstance(error, StorageError):
        return StorageError(message, transient=error.transient)
    return type(error)(message)
