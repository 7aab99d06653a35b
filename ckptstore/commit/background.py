"""Non-blocking commits: snapshot the engine's tensors, persist them on a background thread.

Every tensor a commit stores is copied into host buffers (pinned when the source is on a GPU,
so the copy is a DMA on a side stream), and the buffers are reused by the next commit with the
same shapes, so memory stays bounded by one snapshot. The copy itself runs in the background
too, overlapping the next forward and backward passes, which only read the optimizer's
tensors: a ``SnapshotGate`` hooks the engine's optimizer so that its next ``step`` waits until
the copy is done (the DataStates-LLM idea). Hashing, compression, uploads and recording then
run on the same background thread; a commit waits for the previous one, and its error surfaces
once: from ``CommitHandle.result()`` (as often as it is asked), else from the first of
``Store.wait()``, the next commit or ``Store.close()``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from .. import knobs
from ..errors import CkptStoreError
from ..model import Piece, Snapshot


class SnapshotBuffers:
    """Host buffers a snapshot is copied into, kept for the next snapshot of the same shapes."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}

    def _buffer(self, slot: tuple, like: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.shape != like.shape or buffer.dtype != like.dtype:
            pin = like.device.type == "cuda"
            buffer = torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)
            self._buffers[slot] = buffer
        return buffer

    def copy(self, snapshot: Snapshot, ready: tuple[torch.device, Any] | None = None) -> Snapshot:
        """A copy of ``snapshot`` whose tensors live in these buffers; returns once it has landed.

        ``ready`` (``device_ready``: a CUDA device and an event the training thread recorded)
        makes device copies wait for the work that produced the tensors; they then run on a
        side stream of their own.
        """
        copies: dict[int, torch.Tensor] = {}  # the same tensor is copied once
        stream = None
        if ready is not None:
            device, event = ready
            stream = torch.cuda.Stream(device=device)
            stream.wait_event(event)

        def copied(slot: tuple, tensor: torch.Tensor) -> torch.Tensor:
            key = id(tensor)
            if key not in copies:
                buffer = self._buffer(slot, tensor)
                buffer.copy_(tensor.detach(), non_blocking=tensor.device.type == "cuda")
                copies[key] = buffer
            return copies[key]

        pieces: list[Piece] = []
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for piece in snapshot.pieces:
                slot = (piece.name, piece.kind, piece.start)
                master = None
                if piece.unless_equal_to is not None:
                    master = copied((piece.name, "fp32", piece.start), piece.unless_equal_to)
                pieces.append(replace(piece, tensor=copied(slot, piece.tensor), unless_equal_to=master))
        if stream is not None:
            stream.synchronize()  # the device-to-host copies must land before the engine steps
        elif any(piece.tensor.device.type == "cuda" for piece in snapshot.pieces):
            torch.cuda.synchronize()
        return replace(snapshot, pieces=pieces)


def device_ready(snapshot: Snapshot) -> tuple[torch.device, Any] | None:
    """(device, CUDA event) marking when the snapshot's device tensors are final; None on the CPU."""
    for piece in snapshot.pieces:
        if piece.tensor.device.type == "cuda":
            device = piece.tensor.device
            with torch.cuda.device(device):
                event = torch.cuda.Event()
                event.record()  # on the training thread's current stream
            return device, event
    return None


class SnapshotGate:
    """Holds an engine's optimizer step while a snapshot of its tensors is being copied.

    Forward and backward passes only read the fp32 masters, optimizer states and module
    weights; the optimizer step is the first thing that changes them. A step pre-hook on the
    engine's torch optimizer (DeepSpeed's wrappers all step one) waits for ``open()``.
    """

    def __init__(self) -> None:
        self._copied = threading.Event()
        self._copied.set()
        self._hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def guard(self, engine: Any) -> bool:
        """Make ``engine``'s optimizer steps wait at this gate; False if it has no torch optimizer."""
        optimizer = engine.optimizer
        if not isinstance(optimizer, torch.optim.Optimizer):
            optimizer = getattr(optimizer, "optimizer", None)  # DeepSpeed's ZeRO and fp16/bf16 wrappers
        if not isinstance(optimizer, torch.optim.Optimizer):
            return False
        if optimizer not in self._hooks:
            self._hooks[optimizer] = optimizer.register_step_pre_hook(self._hold)
        return True

    def _hold(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._copied.wait()

    def close(self) -> None:
        """Steps wait from now until ``open()``."""
        self._copied.clear()

    def open(self) -> None:
        """Let steps go on."""
        self._copied.set()

    def release(self) -> None:
        """Open the gate and unhook every optimizer."""
        self.open()
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()


def lower_thread_priority(base: int | None = None) -> None:
    """Make the calling thread yield the CPU to the training loop (Linux: a per-thread nice).

    A non-blocking commit hashes and compresses on the host while training runs; on a busy
    host it should use idle cores, not slow the training step. ``base``: the training
    thread's niceness (``thread_niceness``), for a thread started by an already lowered one,
    which inherits its niceness and must not be lowered twice. Best effort: where threads
    cannot be reniced, nothing changes.
    """
    try:
        thread = threading.get_native_id()
        nice = (os.getpriority(os.PRIO_PROCESS, thread) if base is None else base) + knobs.background_nice()
        os.setpriority(os.PRIO_PROCESS, thread, min(nice, 19))
    except (AttributeError, OSError):
        pass


def thread_niceness() -> int | None:
    """The calling thread's niceness; None where threads have none of their own."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None


class CommitHandle:
    """A commit running in the background; ``result()`` waits and returns its report or raises."""

    def __init__(self, step: int, future: Future) -> None:
        self.step = step
        self._future = future
        self._error_delivered = False  # result() raised the commit's error to its caller

    def done(self) -> bool:
        """Whether the commit has finished (successfully or not)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        """Wait until the step is durable and return its CommitReport; re-raises its error
        (every time it is asked: ``Store.wait``, the next commit and ``close`` then no longer do)."""
        try:
            return self._future.result(timeout)
        except BaseException:
            if self._future.done():  # the commit's own error, not a wait that timed out
                self._error_delivered = True
            raise

    def outcome_once(self) -> Any:
        """Wait for the commit; its report, or its error unless ``result()`` raised it already
        (then None): an error reaches the training loop once, wherever it was asked first."""
        if self._error_delivered:
            return None
        return self.result()


class CommitQueue:
    """One background worker per store; at most one commit in flight."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptstore-commit")
        self._pending: CommitHandle | None = None
        self._lock = threading.Lock()
        self.buffers = SnapshotBuffers()
        self.gate = SnapshotGate()
        _live_queues.add(self)

    def submit(self, step: int, fn) -> CommitHandle:
        """Run ``fn`` in the background (after waiting for the previous commit)."""
        with self._lock:
            self.wait()
            handle = CommitHandle(step, self._pool.submit(fn))
            self._pending = handle
            return handle

    def submit_snapshot(
        self, step: int, engine: Any, snapshot: Snapshot, commit: Callable[[Snapshot], Any]
    ) -> CommitHandle:
        """Copy ``snapshot`` (views of ``engine``'s live tensors) into host buffers in the
        background, then run ``commit(copy)`` there too. Training goes on meanwhile; the
        engine's next optimizer step waits until the copy has landed. Without a torch
        optimizer to hold, the copy is taken here before returning."""
        if not self.gate.guard(engine):
            copy = self.buffers.copy(snapshot)
            return self.submit(step, lambda: commit(copy))
        ready = device_ready(snapshot)

        def copy_then_commit() -> Any:
            try:
                copy = self.buffers.copy(snapshot, ready)
            finally:
                self.gate.open()  # the engine's next optimizer step may run
            return commit(copy)

        self.gate.close()
        try:
            return self.submit(step, copy_then_commit)
        except BaseException:
            self.gate.open()
            raise

    def wait(self) -> Any:
        """Wait for the commit in flight, if any; raises its error once: not when its handle's
        ``result()`` raised it already (``CommitHandle.outcome_once``)."""
        handle, self._pending = self._pending, None
        return None if handle is None else handle.outcome_once()

    def close(self) -> None:
        """Flush the commit in flight and stop the worker; raises the commit's error."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
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
