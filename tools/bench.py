"""Benchmark ckptstore against DeepSpeed's own save_checkpoint, in the same process.

    python tools/bench.py [--ranks 2] [--hidden 768 --layers 8 --vocab 16000 --reps 3]

Builds a Llama of about 80M parameters (bf16, ZeRO-2, one rank, CPU; ``--dtype fp16``, and
``DS_ACCELERATOR=cuda`` on a GPU machine), then reports medians
of several repetitions as ratios against ``engine.save_checkpoint`` (absolute times on a
shared machine are noise; ratios measured side by side are not):
commit time and bytes added for a full commit, a re-commit of unchanged state and a commit
of 2 of 8 layers; for a non-blocking commit the time ``commit`` takes, the time the next
training step loses, and the time until durable, also against ``save_checkpoint`` followed
by an fsync of its files (ckptstore's commits are fsynced, DeepSpeed's are not); materialize
time against ``cp -r`` of the DeepSpeed directory; ``restore`` time against ``load_checkpoint``
of DeepSpeed's own directory and against ``materialize`` + ``load_checkpoint``; peak extra RSS
of commit, materialize, load_checkpoint and restore.
``--ranks 2`` relaunches itself under ``torch.distributed.run`` (gloo on CPU); it also times
the all-gather a whole-tensor design would need before hashing (ckptstore stores each rank's
own fragments instead).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import (  # noqa: E402
    add_bench_model_options,
    batches,
    build_bench_engine,
    finalize_distributed,
    free_port,
    param_count,
    setup_single_process_env,
    train,
)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(fn, *args, **kwargs) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return time.perf_counter() - start, result


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path``: what makes a checkpoint directory durable."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def median_time(fn, reps: int) -> float:
    return statistics.median(timed(fn)[0] for _ in range(reps))


def barrier_timed(fn, *args, **kwargs) -> tuple[float, object]:
    """Wall time of a collective operation: from every rank ready to every rank done."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - start, result


def gather_cost(engine) -> float:
    """Time to all-gather every rank's fp32 and Adam partitions (what whole tensors would need)."""
    import torch
    import torch.distributed as dist

    osd = engine.optimizer.state_dict()
    parts = list(osd["single_partition_of_fp32_groups"])
    for state in osd["base_optimizer_state"]["state"].values():
        parts += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]

    def gather() -> None:
        for part in parts:
            out = [torch.empty_like(part) for _ in range(dist.get_world_size())]
            dist.all_gather(out, part.contiguous())

    return barrier_timed(gather)[0]


class PeakRss:
    """Peak resident memory above the level at the start of a phase, sampled every 10 ms."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def measure(self, phase: str):
        import threading

        import psutil

        process = psutil.Process()
        base = process.memory_info().rss
        peak = [base]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.01):
                peak[0] = max(peak[0], process.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            yield
        finally:
            done.set()
            sampler.join()
            self.peaks[phase] = max(self.peaks.get(phase, 0), peak[0] - base)


def relaunch(ranks: int, argv: list[str], script: str = __file__) -> int:
    """Run ``script`` (default: this bench) with ``argv`` on ``ranks`` ranks under
    ``torch.distributed.run`` on a free port; its exit status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
               str(free_port()), script, *argv]  # fmt: skip
    return subprocess.run(command).returncode


@contextlib.contextmanager
def shared_scratch(folder: Path | None):
    """A temporary folder (under ``folder``) that rank 0 makes and every rank of the job works
    in; rank 0 removes it once every rank has left the block."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        shared = [Path(scratch) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(shared, src=0)
        yield shared[0]
        dist.barrier()  # no rank may still read the folder when rank 0 removes it


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ranks", type=int, default=1, help="data-parallel ranks (relaunches under torchrun)"
    )
    add_bench_model_options(parser, hidden=768, layers=8, vocab=16000, reps=3)
    parser.add_argument("--workdir", help="scratch directory (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.ranks > 1 and "LOCAL_RANK" not in os.environ:
        return relaunch(args.ranks, sys.argv[1:] if argv is None else argv)
    setup_single_process_env()
    import logging

    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    import ckptstore

    ds_logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    shared = [args.workdir or tempfile.mkdtemp(prefix="ckptstore-bench-")]
    dist.broadcast_object_list(shared, src=0)  # every rank writes into one place
    work = Path(shared[0])
    engine = build_bench_engine(args)
    data = batches(2 + 2 * args.reps, vocab=args.vocab)
    train(engine, data[:1])
    say = print if rank == 0 else (lambda *a, **k: None)
    from deepspeed.accelerator import get_accelerator

    device = get_accelerator().device_name()
    if device != "cpu":
        device = f"{device} ({torch.cuda.get_device_name()})"
    say(
        f"model: llama, {param_count(engine.module) / 1e6:.1f}M parameters, {args.dtype}, ZeRO-2, {world} rank(s), "
        f"{device}"
    )

    # DeepSpeed's own checkpoint, the yardstick. save_checkpoint returns with its files in the
    # page cache; ckptstore's commit returns once its blobs are fsynced, so the durable
    # DeepSpeed time (save, then fsync its files) is the fair match for "until durable".
    ds_times, ds_durable_times = [], []
    for rep in range(args.reps):
        os.sync()  # start each repetition with nothing else waiting for the disk
        seconds = barrier_timed(engine.save_checkpoint, str(work / f"ds{rep}"))[0]
        ds_times.append(seconds)
        ds_durable_times.append(seconds + barrier_timed(fsync_tree, work / f"ds{rep}")[0])
    ds_time, ds_durable = statistics.median(ds_times), statistics.median(ds_durable_times)
    ds_dir = work / "ds0"
    ds_bytes = dir_bytes(ds_dir)
    dist.barrier()
    if rank == 0:  # only ds0 is read again: the others would fill a small disk at a few hundred M parameters
        for rep in range(1, args.reps):
            shutil.rmtree(work / f"ds{rep}")
    # Both copies go to a new directory, removed outside the timing.
    cp_times = []
    for _ in range(args.reps):
        cp_times.append(
            timed(subprocess.run, ["cp", "-r", str(ds_dir), str(work / f"cp{rank}")], check=True)[0]
        )
        shutil.rmtree(work / f"cp{rank}")
    cp_time = statistics.median(cp_times)

    full_times, full_bytes, re_times, re_bytes, part_times, part_bytes, half_times, mat_times = (
        [] for _ in range(8)
    )
    stall_times, durable_times, parity_bytes, lost_times = [], [], [], []
    rss = PeakRss()
    blocks = [f"model.layers.{i}" for i in range(args.layers)]
    two_of_n = blocks[:: max(1, args.layers // 2)][:2]
    step = 0
    for rep in range(args.reps):
        store = ckptstore.open(work / f"store{rep}")
        step += 1
        os.sync()  # no earlier writes competing for the disk, as for save_checkpoint above
        with rss.measure("commit"):
            t, report = barrier_timed(store.commit, engine, step)
        full_times.append(t), full_bytes.append(report.bytes_added)
        step += 1
        t, report = barrier_timed(store.commit, engine, step)
        re_times.append(t), re_bytes.append(report.bytes_added)
        # Non-blocking: the training loop waits for the snapshot only; durable once result() returns.
        # Two in a row: a training run commits again and again, and from the second commit on
        # the snapshot buffers are reused; the second one is measured.
        for warm in (False, True):
            train(engine, data[1 + rep : 2 + rep])
            step += 1
            os.sync()
            started = time.perf_counter()
            handle = store.commit(engine, step, blocking=False)
            stall = time.perf_counter() - started
            handle.result()
            if warm:
                stall_times.append(stall)
                durable_times.append(time.perf_counter() - started)
        # What the training loop really loses: the snapshot copy overlaps the next forward and
        # backward, and on a CPU the background work competes with them for the cores.
        plain_step = timed(train, engine, data[1 + rep : 2 + rep])[0]
        step += 1
        started = time.perf_counter()
        handle = store.commit(engine, step, blocking=False)
        train(engine, data[1 + rep : 2 + rep])
        lost_times.append(time.perf_counter() - started - plain_step)
        handle.result()
        train(engine, data[1 + rep : 2 + rep])
        step += 1
        parity = blocks[(rep + 1) % 2 :: 2]
        parity_bytes.append(store.commit(engine, step, layers=parity).bytes_added)
        train(engine, data[1 + rep : 2 + rep])
        step += 1
        t, report = barrier_timed(store.commit, engine, step, layers=two_of_n)
        part_times.append(t), part_bytes.append(report.bytes_added)
        train(engine, data[1 + rep : 2 + rep])
        step += 1
        t, _ = barrier_timed(store.commit, engine, step, layers=blocks[rep % 2 :: 2])
        half_times.append(t)
        if rank == 0:
            with rss.measure("materialize"):
                mat_times.append(timed(store.materialize, step, work / "mat", world_size=world)[0])
            shutil.rmtree(work / "mat")
        store.close()
        dist.barrier()
        if rank == 0 and rep > 0:  # store0 is the one resumed from below
            shutil.rmtree(work / f"store{rep}")
    gather_time = statistics.median(gather_cost(engine) for _ in range(args.reps)) if world > 1 else None

    # A store with a key (keyed BLAKE3 content keys, tagged manifests) against one without:
    # a full commit into a new store of each kind, then a materialize of it, taking turns.
    shared_key = [os.urandom(32)]
    dist.broadcast_object_list(shared_key, src=0)  # every rank opens the store with one key
    auth = {False: ([], []), True: ([], [])}
    for rep in range(args.reps):
        for keyed in (False, True) if rep % 2 == 0 else (True, False):
            store = ckptstore.open(work / f"auth{int(keyed)}-{rep}", key=shared_key[0] if keyed else None)
            os.sync()
            auth[keyed][0].append(barrier_timed(store.commit, engine, 1)[0])
            if rank == 0:
                auth[keyed][1].append(timed(store.materialize, 1, work / "auth-mat", world_size=world)[0])
                shutil.rmtree(work / "auth-mat")
            store.close()
            dist.barrier()
            if rank == 0:
                shutil.rmtree(work / f"auth{int(keyed)}-{rep}")

    # Resuming: DeepSpeed's load_checkpoint of its own directory; restore straight from the
    # store; materialize (rank 0, for this world size) then load_checkpoint. Taking turns.
    load_times, restore_times, mat_load_times = [], [], []
    store = ckptstore.open(work / "store0")
    last = store.steps()[-1]
    for rep in range(args.reps):
        with rss.measure("load_checkpoint"):
            load_times.append(barrier_timed(engine.load_checkpoint, str(ds_dir))[0])
        with rss.measure("restore"):
            restore_times.append(barrier_timed(store.restore, engine, last)[0])

        def materialize_and_load(rep=rep) -> None:
            out = work / f"resume{rep}"
            if rank == 0:
                store.materialize(last, out, world_size=world)
            dist.barrier()
            engine.load_checkpoint(str(out))

        mat_load_times.append(barrier_timed(materialize_and_load)[0])
        dist.barrier()
        if rank == 0:
            shutil.rmtree(work / f"resume{rep}")
    store.close()

    if rank == 0:
        med = statistics.median
        rows = [
            ("DeepSpeed save_checkpoint", ds_time, 1.0, ds_bytes, 1.0),
            ("DeepSpeed save_checkpoint, then fsync (durable)", ds_durable, ds_durable / ds_time, None, None),
            ("full commit", med(full_times), med(full_times) / ds_time, med(full_bytes), med(full_bytes) / ds_bytes),
            ("non-blocking commit: training stall", med(stall_times), med(stall_times) / ds_time, None, None),
            ("non-blocking commit: time the next training step lost", med(lost_times), med(lost_times) / ds_time,
             None, None),
            ("non-blocking commit: until durable", med(durable_times), med(durable_times) / ds_time, None, None),
            ("non-blocking commit: until durable, vs durable save", med(durable_times), med(durable_times) / ds_durable,
             None, None),
            ("parity commit (half the blocks)", None, None, med(parity_bytes), med(parity_bytes) / ds_bytes),
            ("re-commit, unchanged", med(re_times), med(re_times) / ds_time, med(re_bytes), med(re_bytes) / ds_bytes),
            (f"commit 2 of {args.layers} layers", med(part_times), med(part_times) / ds_time, med(part_bytes),
             med(part_bytes) / ds_bytes),
            (f"commit {args.layers // 2} of {args.layers} layers", med(half_times), med(half_times) / ds_time, None,
             None),
            ("cp -r of the DeepSpeed dir", cp_time, cp_time / ds_time, None, None),
            ("materialize (vs cp -r)", med(mat_times), med(mat_times) / cp_time, None, None),
            ("DeepSpeed load_checkpoint of its own directory", med(load_times), 1.0, None, None),
            ("restore (vs load_checkpoint)", med(restore_times), med(restore_times) / med(load_times), None, None),
            ("materialize + load_checkpoint (vs load_checkpoint)", med(mat_load_times),
             med(mat_load_times) / med(load_times), None, None),
            ("restore (vs materialize + load_checkpoint)", med(restore_times),
             med(restore_times) / med(mat_load_times), None, None),
            ("full commit, store with a key (vs without)", med(auth[True][0]),
             med(auth[True][0]) / med(auth[False][0]), None, None),
            ("materialize, store with a key (vs without)", med(auth[True][1]),
             med(auth[True][1]) / med(auth[False][1]), None, None),
        ]  # fmt: skip
        if gather_time is not None:
            rows.append(
                ("all-gather of fp32+Adam partitions", gather_time, gather_time / ds_time, None, None)
            )
        print(
            f"\n| operation ({world} rank(s)) | seconds (median of {args.reps}) | time ratio | bytes | bytes ratio |"
        )
        print("|---|---:|---:|---:|---:|")
        for name, seconds, ratio, nbytes, bratio in rows:
            nb = "" if nbytes is None else f"{nbytes / 1e6:.1f} MB"
            br = "" if bratio is None else f"{bratio:.3f}x"
            sec = "" if seconds is None else f"{seconds:.2f}"
            rat = "" if ratio is None else f"{ratio:.2f}x"
            print(f"| {name} | {sec} | {rat} | {nb} | {br} |")
        print("\ntime ratios are against save_checkpoint, except materialize (against cp -r), the resume "
              "rows and the key rows (as named)")  # fmt: skip
        model_bytes = param_count(engine.module) * 2
        for phase, peak in rss.peaks.items():
            print(f"peak extra RSS during {phase}: {peak / 1e6:.0f} MB ({peak / ds_bytes:.2f}x the DeepSpeed directory, "
                  f"{peak / model_bytes:.1f}x the bf16 model)")  # fmt: skip
    dist.barrier()
    if rank == 0 and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    finalize_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
