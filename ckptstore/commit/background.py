"""Non-blocking commits: snapshot the engine's tensors, persist them on a background thread.

Every tensor a commit stores is copied into host buffers (pinned when the source is on a GPU,
so the copy is a DMA on a side stream), and the buffers are reused by the next commit with the
same shapes, so memory stays bounded by one snapshot. The copy itself runs in the background
too, overlapping the next forward and backward passes, which only read the optimizer's
tensors: a ``SnapshotGate`` hooks the engine's optimizer so that its next ``step`` waits until
the copy is done (the DataStates-LLM idea). Hashing, compression, uploads and recording then
run on a background thread (``queue.CommitQueue``: one commit at a time, and what a commit does
when the previous one is still running).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from dataclasses import replace
from typing import Any

import torch

from .. import knobs
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


class CopyHold:
    """One snapshot copy the gate waits for; ``held``: the seconds optimizer steps waited on it."""

    def __init__(self) -> None:
        self.held = 0.0


class SnapshotGate:
    """Holds an engine's optimizer step while snapshots of its tensors are being copied.

    Forward and backward passes only read the fp32 masters, optimizer states and module
    weights; the optimizer step is the first thing that changes them. A step pre-hook on the
    engine's torch optimizer (DeepSpeed's wrappers all step one) waits until every copy
    ``close()`` began has had its ``open()``; each copy counts the seconds it held a step.
    """

    def __init__(self) -> None:
        self._copies: set[CopyHold] = set()
        self._changed = threading.Condition()
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
        with self._changed:
            waited_on = set(self._copies)
            if waited_on:
                started = time.monotonic()
                self._changed.wait_for(lambda: not self._copies)
                for copy in waited_on:
                    copy.held += time.monotonic() - started

    def close(self) -> CopyHold:
        """Steps wait from now until this copy's ``open()``."""
        copy = CopyHold()
        with self._changed:
            self._copies.add(copy)
        return copy

    def open(self, copy: CopyHold) -> None:
        """The ``copy`` has landed: steps go on once every copy has."""
        with self._changed:
            self._copies.discard(copy)
            self._changed.notify_all()

    def release(self) -> None:
        """Open the gate and unhook every optimizer."""
        with self._changed:
            self._copies.clear()
            self._changed.notify_all()
        for handle in list(self._hooks.values()):
            handle.remove()
        self._hooks.clear()


def lower_thread_priority(base: int | None = None) -> None:
    """Make the calling thread yield the CPU to the training loop (Linux: a per-thread nice),
    on the CPUs ``CKPTSTORE_BACKGROUND_CPUS`` names, if any.

    A non-blocking commit hashes and compresses on the host while training runs; on a busy
    host it should use idle cores, not slow the training step. ``base``: the training
    thread's niceness (``thread_niceness``), for a thread started by an already lowered one,
    which inherits its niceness and must not be lowered twice. Best effort: where threads
    cannot be reniced or pinned, nothing changes.
    """
    try:
        thread = threading.get_native_id()
        nice = (os.getpriority(os.PRIO_PROCESS, thread) if base is None else base) + knobs.background_nice()
        os.setpriority(os.PRIO_PROCESS, thread, min(nice, 19))
    except (AttributeError, OSError):
        pass
    confine_to_background_cpus()


def confine_to_background_cpus() -> None:
    """Run the calling thread on the CPUs ``CKPTSTORE_BACKGROUND_CPUS`` names (none named:
    nothing changes). Best effort, as ``lower_thread_priority``."""
    cpus = knobs.background_cpus()
    if cpus is not None:
        try:
            os.sched_setaffinity(0, cpus)  # pid 0 on Linux: the calling thread alone
        except OSError:
            pass


def thread_niceness() -> int | None:
    """The calling thread's niceness; None where threads have none of their own."""
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (AttributeError, OSError):
        return None
