"""The background worker that runs a store's non-blocking commits, one at a time, and what a
commit does when the previous one is still running (``when_busy``):

- ``wait`` (the default): the training thread waits for it, then the new commit starts;
- ``latest``: the new snapshot is copied at once (the engine's next optimizer step waits for
  the copy, as always) and waits its turn; a newer commit replaces one still waiting, so at
  most one runs and one waits, and training never waits for an encode;
- ``skip``: the step is not committed.

A step replaced or skipped is not committed: its handle says so (``CommitHandle.outcome``) and
``result()`` is None. Every rank of a job decides alike (``ranks.agree_busy``), so all commit
the same steps. A commit's error surfaces once: from ``CommitHandle.result()`` (as often as it
is asked), else from the first of ``Store.wait()``, the next commit or ``Store.close()``.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import CkptStoreError
from ..model import REPLACED, SKIP, SKIPPED, WAIT, QueueFigures, Snapshot
from .background import SnapshotBuffers, SnapshotGate, confine_to_background_cpus, device_ready

__all__ = ["WAIT", "Admission", "CommitHandle", "CommitQueue", "skipped"]
COMMITTED, FAILED = "committed", "failed"
# A commit's work: its snapshot copy, and its queue's figures once it records them.
Committer = Callable[[Snapshot, Callable[[], QueueFigures]], Any]
_SKIPPED = object()  # what a skipped commit's handle holds


class CommitHandle:
    """A commit running in the background; ``result()`` waits and returns its report or raises."""

    def __init__(self, step: int, future: Future) -> None:
        self.step = step
        self._future = future
        self._error_delivered = False  # result() raised the commit's error to its caller
        self._replaced = False  # a newer commit took its place before it started

    def done(self) -> bool:
        """Whether the commit has finished (committed, failed, replaced or skipped)."""
        return self._replaced or self._future.done()

    def replace(self) -> None:
        """Mark the commit replaced: it will not run (its queue's job returns at once)."""
        self._replaced = True

    @property
    def outcome(self) -> str | None:
        """``committed``, ``failed``, ``replaced`` (a newer commit took its place before it
        started), ``skipped`` (the previous commit was still running), or None while it runs."""
        if self._replaced:
            return REPLACED
        if not self._future.done():
            return None
        if self._future.exception() is not None:
            return FAILED
        result = self._future.result()
        return SKIPPED if result is _SKIPPED else COMMITTED

    def result(self, timeout: float | None = None) -> Any:
        """Wait until the step is durable and return its CommitReport (None for a step replaced
        or skipped); re-raises its error (every time it is asked: ``Store.wait``, the next
        commit and ``close`` then no longer do)."""
        if self._replaced:
            return None
        try:
            result = self._future.result(timeout)
        except BaseException:
            if self._future.done():  # the commit's own error, not a wait that timed out
                self._error_delivered = True
            raise
        return None if result is _SKIPPED else result

    def outcome_once(self) -> Any:
        """Wait for the commit; its report, or its error unless ``result()`` raised it already
        (then None): an error reaches the training loop once, wherever it was asked first."""
        if self._error_delivered:
            return None
        return self.result()


def skipped(step: int) -> CommitHandle:
    """The handle of a step that was not committed because the previous commit still ran."""
    future: Future = Future()
    future.set_result(_SKIPPED)
    return CommitHandle(step, future)


@dataclass
class _Job:
    """A queued commit: its snapshot's buffers (which of the two sets) and its progress."""

    buffers: int
    started: bool = False
    handle: CommitHandle | None = None

    @property
    def replaced(self) -> bool:
        return self.handle is not None and self.handle.outcome == REPLACED


@dataclass(frozen=True)
class Admission:
    """How a commit under ``latest`` or ``skip`` goes: ``skip``, or queued into ``buffers``."""

    skip: bool
    buffers: int = 0


class CommitQueue:
    """One background worker per store: commits run one at a time, in the order given."""

    def __init__(self) -> None:
        # The worker and the snapshot copies run on the CPUs set aside for commits, if any (the
        # copies at training's priority: an optimizer step may be waiting for them).
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ckptstore-commit", initializer=confine_to_background_cpus
        )
        self._copier: ThreadPoolExecutor | None = None  # snapshot copies beside a running commit
        self._handles: list[CommitHandle] = []  # not yet waited for, oldest first
        self._waiting: _Job | None = None  # queued, not started
        self._running: _Job | None = None
        # steps replaced or skipped since the last commit started, which it records
        self._not_committed: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        # A snapshot's buffers are reused by later ones: two sets, so that one can wait while
        # the other's commit runs.
        self._buffers = [SnapshotBuffers(), SnapshotBuffers()]
        self.gate = SnapshotGate()
        _live_queues.add(self)

    def submit(self, step: int, fn) -> CommitHandle:
        """Run ``fn`` in the background (after waiting for the previous commit)."""
        self.wait()
        with self._lock:
            return self._track(CommitHandle(step, self._pool.submit(fn)))

    def _track(self, handle: CommitHandle) -> CommitHandle:
        """Keep ``handle`` until it is waited for (the caller holds the lock); of those done,
        only failed ones are kept, until their error is raised."""
        self._handles = [h for h in self._handles if not h.done() or h.outcome == FAILED] + [handle]
        return handle

    def skip(self, step: int) -> CommitHandle:
        """The handle of ``step``, skipped: the next commit records it as not committed."""
        with self._lock:
            self._not_committed.append((step, SKIPPED))
        return skipped(step)

    def admit(self, when_busy: str, agree: Callable[[bool, bool], tuple[bool, bool, bool]]) -> Admission:
        """Decide how a commit under ``when_busy`` (``latest`` or ``skip``) goes, every rank
        alike (``agree``: ``ranks.agree_busy``); a commit it replaces is marked so here, before
        the worker could start it. Raises an earlier commit's error, once (nothing is queued)."""
        with self._lock:  # held through the agreement: the worker starts nothing meanwhile
            self._raise_failed()
            busy = any(not handle.done() for handle in self._handles)
            unstarted = self._waiting is not None
            busy, all_unstarted, any_unstarted = agree(busy, unstarted)
            if not busy:
                return Admission(skip=False, buffers=self._free_buffers())
            if when_busy == SKIP or (any_unstarted and not all_unstarted):
                return Admission(skip=True)  # (ranks that started their queued commit cannot replace it)
            if all_unstarted:
                self._waiting.handle.replace()
                self._not_committed.append((self._waiting.handle.step, REPLACED))
                return Admission(skip=False, buffers=self._waiting.buffers)
            return Admission(skip=False, buffers=self._free_buffers())

    def _free_buffers(self) -> int:
        """The buffer set no queued or running commit holds."""
        held = {job.buffers for job in (self._running, self._waiting) if job is not None and not job.replaced}
        return next(index for index in range(len(self._buffers)) if index not in held)

    def _raise_failed(self) -> None:
        """Raise the first error of a finished commit not yet delivered, and forget it."""
        for handle in list(self._handles):
            if handle.done() and handle.outcome == FAILED:
                self._handles.remove(handle)
                handle.outcome_once()

    def submit_queued(
        self,
        step: int,
        engine: Any,
        snapshot: Snapshot,
        commit: Committer,
        admission: Admission,
        called: float,
    ) -> CommitHandle:
        """Queue ``commit(copy, figures)`` of ``snapshot`` (views of ``engine``'s live tensors)
        behind the running commit without waiting for it (under ``wait`` the caller has waited
        for it): the copy into ``admission.buffers`` starts at once on a thread of its own, the
        engine's next optimizer step waiting for it (taken here where the engine has no torch
        optimizer to hold). ``called``: when the commit was called. ``figures`` (``QueueFigures``): how long it held training,
        from ``called``, and the steps not committed since the last commit."""
        buffers = self._buffers[admission.buffers]
        hold = self.gate.close() if self.gate.guard(engine) else None
        if hold is None:
            copied: Future = Future()
            copied.set_result(buffers.copy(snapshot))
        else:
            ready = device_ready(snapshot)
            if self._copier is None:
                self._copier = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="ckptstore-copy", initializer=confine_to_background_cpus
                )

            def copy_snapshot() -> Snapshot:
                try:
                    return buffers.copy(snapshot, ready)
                finally:
                    self.gate.open(hold)

            copied = self._copier.submit(copy_snapshot)
        job = _Job(admission.buffers)
        call_seconds: Future = Future()  # how long this call held training, once it returns

        def figures(not_committed: tuple) -> QueueFigures:
            held = hold.held if hold is not None else 0.0
            return QueueFigures(call_seconds.result() + held, not_committed)

        def run() -> Any:
            with self._lock:
                if job.replaced:
                    return None  # (its handle says so already)
                job.started, self._running = True, job
                if self._waiting is job:
                    self._waiting = None
                not_committed = tuple(entry for entry in self._not_committed if entry[0] < step)
                self._not_committed = [entry for entry in self._not_committed if entry[0] >= step]
            try:
                return commit(copied.result(), lambda: figures(not_committed))
            except BaseException:
                with self._lock:  # the next commit records them
                    self._not_committed = sorted({*not_committed, *self._not_committed})
                raise
            finally:
                with self._lock:
                    if self._running is job:
                        self._running = None

        try:
            with self._lock:
                job.handle = self._track(CommitHandle(step, self._pool.submit(run)))
                if not job.started:
                    self._waiting = job
        except BaseException:
            if hold is not None:
                self.gate.open(hold)
            raise
        call_seconds.set_result(time.monotonic() - called)
        return job.handle

    def wait(self) -> Any:
        """Wait for every queued commit, oldest first; returns the newest one's report; raises
        the first error once: not when its handle's ``result()`` raised it already
        (``CommitHandle.outcome_once``)."""
        with self._lock:
            handles, self._handles = self._handles, []
        report, error = None, None
        for handle in handles:
            try:
                outcome = handle.outcome_once()
            except BaseException as exc:  # the others still finish before it is raised
                error = error or exc
                continue
            report = outcome if outcome is not None else report
        if error is not None:
            raise error
        return report

    def close(self) -> None:
        """Flush the commits queued and stop the workers; raises a commit's error."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._copier is not None:
                self._copier.shutdown(wait=True)
            self.gate.release()
            _live_queues.discard(self)


_live_queues: weakref.WeakSet[CommitQueue] = weakref.WeakSet()


def _flush_at_exit() -> None:
    # A background commit must not be lost silently when the training script just ends.
    for queue in list(_live_queues):
        try:
            queue.close()
        except CkptStoreError as exc:
            print(f"ckptstore: a background commit failed: {exc}", file=sys.stderr)
        except Exception as exc:  # still say so: exit is the last chance
            print(f"ckptstore: a background commit failed: {type(exc).__name__}: {exc}", file=sys.stderr)


# Registered with threading rather than atexit: at interpreter exit, concurrent.futures
# refuses new work once its own threading-exit hook has run, and a commit still in flight
# needs its thread pools. threading runs these hooks last-registered first, so ours, added
# after concurrent.futures was imported, flushes while pools still work.
threading._register_atexit(_flush_at_exit)
