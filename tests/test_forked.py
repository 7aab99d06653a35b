"""Forked worker processes (``forked``): every task run once, here or in a worker,
whichever is free next; each finished task counted here; a worker's failure, whatever it is,
raised here once every worker is gone."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptstore import forked
from ckptstore.errors import NotFoundError, StorageError
from ckptstore.forked import run_forked, worth_running

ROOT = Path(__file__).resolve().parents[1]


def test_processes_are_forked_only_where_the_work_pays_for_the_forks(monkeypatch):
    monkeypatch.setattr(forked, "_resident_bytes", lambda: 300 << 20)  # the command line's
    assert worth_running(2 << 30, most=16) == 16  # a 1B model's bf16 weights
    assert worth_running(400 << 20, most=2) == 2  # the 204M bench model's
    assert worth_running(1 << 20, most=16) == 1  # a tiny model: the work is shorter than a fork
    monkeypatch.setattr(forked, "_resident_bytes", lambda: 100 << 30)  # a training job's
    assert 1 < worth_running(14 << 30, most=16) < 16  # a 7B model's: a few, each fork slow
    assert worth_running(2 << 30, most=1) == 1


def test_every_task_runs_once_here_or_in_a_worker_and_is_counted_here(tmp_path):
    ticks = []

    def run(n):
        time.sleep(0.01)  # long enough that every process gets some
        (tmp_path / f"{n}.{os.getpid()}").touch()

    run_forked(list(range(40)), run, lambda: ticks.append(1), processes=4)
    names = [p.name.split(".") for p in tmp_path.iterdir()]
    assert sorted(int(n) for n, _ in names) == list(range(40)) and len(ticks) == 40
    pids = {int(pid) for _, pid in names}
    assert len(pids) == 4 and os.getpid() in pids


def test_a_free_worker_takes_the_next_task_so_one_long_task_holds_up_no_other(tmp_path):
    def run(n):
        time.sleep(1.0 if n == 0 else 0.01)
        (tmp_path / f"{n}.{os.getpid()}").touch()

    run_forked(list(range(21)), run, lambda: None, processes=2)
    by_pid: dict[str, list[int]] = {}
    for p in tmp_path.iterdir():
        n, pid = p.name.split(".")
        by_pid.setdefault(pid, []).append(int(n))
    assert sorted(map(sorted, by_pid.values())) == [[0], list(range(1, 21))]


def test_more_tasks_than_the_queue_holds_are_taken_a_batch_at_a_time(tmp_path):
    seen = []
    run_forked(list(range(20000)), seen.append, lambda: None, processes=1)  # all here: one process
    assert seen == list(range(20000))


def test_a_workers_error_is_raised_here_as_its_class_and_the_others_are_stopped(tmp_path):
    here = os.getpid()

    def run(n):
        if os.getpid() == here:
            time.sleep(0.05)
            return
        try:  # the first worker task fails; the other worker's runs on until it is killed
            os.close(os.open(tmp_path / "failed", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            time.sleep(60)
        raise NotFoundError("object abc is missing from /store")

    started = time.monotonic()
    with pytest.raises(NotFoundError, match="^object abc is missing from /store$"):
        run_forked(list(range(10)), run, lambda: None, processes=3)
    assert time.monotonic() - started < 30


def test_an_os_error_keeps_its_errno_and_file_and_anything_else_is_a_storage_error():
    pid = os.getpid()

    def disk_full(_):
        if os.getpid() != pid:
            raise OSError(errno.ENOSPC, "No space left on device", "/out/model.safetensors")
        time.sleep(0.5)

    with pytest.raises(OSError) as caught:
        run_forked([0, 1], disk_full, lambda: None, processes=2)
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, "/out/model.safetensors")

    def bug(_):
        if os.getpid() != pid:
            raise ValueError("bad")
        time.sleep(0.5)

    with pytest.raises(StorageError, match="worker process failed: ValueError: bad"):
        run_forked([0, 1], bug, lambda: None, processes=2)


def test_a_worker_killed_by_a_signal_is_reported():
    pid = os.getpid()

    def killed(_):
        if os.getpid() != pid:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.5)

    with pytest.raises(StorageError, match="killed by signal 9"):
        run_forked([0, 1], killed, lambda: None, processes=2)


def test_workers_die_with_the_process_that_forked_them(tmp_path):
    script = f"""
import os, time
from ckptstore.forked import run_forked
here = os.getpid()
def run(n):
    if os.getpid() != here:
        open({str(tmp_path)!r} + f"/worker.{{os.getpid()}}", "w").close()
    time.sleep(60)
run_forked([0, 1], run, lambda: None, processes=2)
"""
    exporter = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("worker.*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    (marker,) = tmp_path.glob("worker.*")
    worker = int(marker.name.split(".")[1])
    exporter.kill()  # SIGKILL: no finally runs in it
    exporter.wait()
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return  # gone (reaped by init once killed)
        if _zombie(worker):
            return
        time.sleep(0.05)
    pytest.fail(f"worker {worker} outlived its parent")


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return False
