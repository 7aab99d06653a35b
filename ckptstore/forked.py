"""Tasks run in forked worker processes, one thread each, for work that threads cannot scale.

An export or a materialize decodes every tensor: zstd, six numpy passes joining each chunk's
byte planes, the hash, the cast and the write, each a call without the GIL but most only
13-30 us long, about a thread's wake-up. Two threads of one process then keep handing the GIL
to each other: on two cores an export took 0.65x-0.74x of one thread's time, where two
processes, each with a GIL of its own, exported twice the weights in the time one took
(``tools/bench_cores.py``'s ceiling, 0.46x-0.54x). So from a local store they fork workers,
as many as pay for their fork (``worth_running``). A worker only reads the store's files,
decodes and ``pwrite``s at offsets in output files the parent opened; it touches nothing the
parent's other threads may hold (``planes`` renews its lock in a child), and runs torch on one
thread (an OpenMP pool does not survive a fork). It takes tasks from a queue pipe as it gets
free, and reports each finished one, or its error, through a pipe of its own; it dies with
the process that forked it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import math
import os
import select
import signal
import struct
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from . import errors

T = TypeVar("T")

_DONE = b"."  # a worker finished a task
_FAILED = b"!"  # what follows describes a worker's error; then it exits
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_NUMBER = struct.Struct("<I")  # a batch of tasks' number in the queue pipe


# Measured on the 2-core bench box: a fork took ~17 ms per GiB this process had resident (its
# page tables are copied: 3 ms at 0.2 GiB, 27 ms at 1.2, 73 ms at 4.2), and one process
# decoded and wrote ~0.75 GB a second of a bf16 export (materialize: ~0.4 GB/s).
_FORK_SECONDS_PER_RESIDENT_BYTE = 17e-3 / (1 << 30)
_WRITTEN_BYTES_PER_SECOND = 0.75e9


def can_fork() -> bool:
    """Whether this platform's ``fork`` copies a process safely enough for the workers (Linux)."""
    return sys.platform == "linux" and hasattr(os, "fork")


def worth_running(written_bytes: int, most: int) -> int:
    """How many processes (this one and forked workers) should share work that writes
    ``written_bytes``, at most ``most``; 1: fork none. With k of them the work takes 1/k of
    its time, and the forks, one after another, hold back each worker by k/2 forks on
    average, so k = sqrt(2 x work / one fork): a process holding much memory (a training
    job's) forks slowly and forks fewer, or none for a small export."""
    if most <= 1 or not can_fork():
        return 1
    fork = 1e-3 + _FORK_SECONDS_PER_RESIDENT_BYTE * _resident_bytes()
    work = written_bytes / _WRITTEN_BYTES_PER_SECOND
    return max(1, min(most, int(math.sqrt(2 * work / fork))))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_forked(
    tasks: Sequence[T], run: Callable[[T], None], done: Callable[[], None], processes: int
) -> None:
    """Run every one of ``tasks`` by ``run``, here and in ``processes - 1`` forked processes,
    each taking the next task in the given order whenever it is free (so give them largest
    first), and call ``done`` here as each finishes. Raises the first error: this process's
    own as raised, a worker's as its ckptstore error class, an OSError with its errno and
    file, anything else as ``StorageError`` naming it. Every worker is stopped (killed, if
    still running) and reaped before this returns or raises."""
    parent = os.getpid()
    queue_read, queue_write = os.pipe()
    workers: dict[int, int] = {}  # read end of a worker's report pipe -> its pid, 0 once reaped
    try:
        per = _fill_queue(queue_write, len(tasks))
        os.close(queue_write)
        queue_write = -1
        for _ in range(processes - 1):
            report_read, report_write = os.pipe()
            pid = os.fork()
            if pid == 0:  # a worker: never returns
                os.close(report_read)
                _work(tasks, per, queue_read, run, report_write, parent)
            os.close(report_write)
            workers[report_read] = pid
        # This process takes tasks too, counting the workers' between its own.
        while (batch := _next_batch(tasks, per, queue_read)) is not None:
            for task in batch:
                run(task)
                done()
            if (failure := _collect(workers, done, wait=False)) is not None:
                raise failure
        if (failure := _collect(workers, done, wait=True)) is not None:
            raise failure
    finally:
        for fd, pid in workers.items():
            if pid > 0:  # not reaped: stopped by another's failure, or by an error here
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            os.close(fd)
        os.close(queue_read)
        if queue_write >= 0:
            os.close(queue_write)


def _fill_queue(fd: int, count: int) -> int:
    """Put the numbers of ``count`` tasks' batches in the queue pipe ``fd``, as many as it
    holds without blocking (a pipe holds 64 KiB, or one page once its user has many: a
    number per task for 16384 tasks); return the tasks in each batch."""
    numbers = max(1, fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) // _NUMBER.size)
    per = max(1, -(-count // numbers))
    _write_all(fd, b"".join(_NUMBER.pack(i) for i in range(-(-count // per))))
    return per


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a pipe may take less than asked
        view = view[os.write(fd, view) :]


def _next_batch(tasks: Sequence[T], per: int, fd: int) -> Sequence[T] | None:
    """The tasks of the next number in the queue, or None once it is empty. A read of a pipe
    of at most PIPE_BUF bytes is atomic, so no two processes get the same number."""
    data = os.read(fd, _NUMBER.size)
    if not data:
        return None
    (number,) = _NUMBER.unpack(data)
    return tasks[number * per : (number + 1) * per]


def _work(tasks: Sequence[T], per: int, queue: int, run: Callable[[T], None], fd: int, parent: int) -> None:
    code = 1
    try:
        _die_with(parent)
        torch.set_num_threads(1)
        while (batch := _next_batch(tasks, per, queue)) is not None:
            for task in batch:
                run(task)
                os.write(fd, _DONE)
        code = 0
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        _write_all(fd, _FAILED + json.dumps(_described(exc)).encode())
    finally:
        os._exit(code)  # no exit handlers, no flushing of the parent's buffers, no destructors


def _die_with(parent: int) -> None:
    """Have the kernel kill this worker if the process that forked it dies (``kill -9``, a
    scheduler's stop), so that no worker writes on into an output no one will finish."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before that took hold
        os._exit(1)


def _collect(workers: dict[int, int], done: Callable[[], None], wait: bool) -> BaseException | None:
    """Read the workers' report pipes, calling ``done`` for each task they finished and
    reaping each whose pipe closed: until all have (``wait``) or what is there now. The first
    failure, or None."""
    while live := [fd for fd, pid in workers.items() if pid > 0]:
        ready, _, _ = select.select(live, [], [], None if wait else 0)
        if not ready:
            return None
        for fd in ready:
            data = os.read(fd, 65536)
            if _FAILED in data or not data:
                data += _read_to_end(fd) if data else b""
                _, status = os.waitpid(workers[fd], 0)
                workers[fd] = 0
                for _ in range(data.partition(_FAILED)[0].count(_DONE)):
                    done()
                if (failure := _failure(data, status)) is not None:
                    return failure
                continue
            for _ in range(data.count(_DONE)):
                done()
    return None


def _read_to_end(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _described(exc: BaseException) -> dict:
    """What the parent needs to raise ``exc`` again: its class name and message, and an
    OSError's errno, text and file (so that it is reported as the parent's own writes are)."""
    described = {"kind": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, OSError) and exc.errno is not None:
        described.update(errno=exc.errno, strerror=exc.strerror, filename=str(exc.filename or ""))
    return described


def _failure(report: bytes, status: int) -> BaseException | None:
    """What a worker that sent ``report`` and ended with wait ``status`` failed with, or None."""
    _, failed, detail = report.partition(_FAILED)
    if failed:
        try:
            described = json.loads(detail)
            kind, message = str(described["kind"]), str(described["message"])
        except (ValueError, TypeError, KeyError):
            described, kind, message = {}, "", detail.decode(errors="replace")
        if "errno" in described:
            return OSError(described["errno"], described["strerror"], described["filename"] or None)
        error = getattr(errors, kind, None)
        if isinstance(error, type) and issubclass(error, errors.CkptStoreError):
            return error(message)
        return errors.StorageError(f"a worker process failed: {kind}: {message}")
    if os.WIFSIGNALED(status):
        return errors.StorageError(
            f"a worker process was killed by signal {os.WTERMSIG(status)} (out of memory?)"
        )
    if os.WEXITSTATUS(status) != 0:
        return errors.StorageError(f"a worker process exited with status {os.WEXITSTATUS(status)}")
    return None
