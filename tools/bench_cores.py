"""Benchmark how export, materialize, restore and commit scale with the cores they may use.

    python tools/bench_cores.py [--hidden 1024 --layers 11 --vocab 32000 --reps 3 --threads 1,2]
                                [--code DIR[,DIR...]] [--ops all|files|engine]

Builds a Llama of about 200M parameters (bf16, ZeRO-2, one rank, CPU), trains a step, commits
it into a store and saves it with ``save_checkpoint``. Then, for each thread count N, fresh
processes pinned to N of this process's cores (``os.sched_setaffinity``) with every thread
setting at N (``CKPTSTORE_CPU_THREADS``, ``CKPTSTORE_EXPORT_THREADS``, ``OMP_NUM_THREADS`` and
torch's threads) time, taking turns round by round:
- ``store.export(step, out, dtype=bfloat16)`` against DeepSpeed's ``zero_to_fp32`` conversion
  to bfloat16 safetensors of its own directory;
- ``store.materialize(step, out)`` against ``cp -r`` of DeepSpeed's directory;
- in a process holding an engine: ``store.restore(engine, step)`` against
  ``engine.load_checkpoint`` of DeepSpeed's directory, and a blocking ``store.commit`` into an
  empty store against ``engine.save_checkpoint``.
Export and ``zero_to_fp32`` run twice in each process, the faster kept (each takes well under a
second, and a process's first call pays its imports). Printed: the minimum over the rounds of
each (min, since other jobs share the box), the ratio
of N threads to the first N, and each operation's ratio to its DeepSpeed counterpart at the
same N. ``--code DIR,DIR`` runs the measured processes with each checkout's ckptstore in turn
(the before and after of a change, in the same rounds), the store having been written by this one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import (  # noqa: E402
    add_bench_model_options,
    batches,
    build_bench_engine,
    destroy_engine,
    param_count,
    setup_single_process_env,
    train,
)

# What every measured process runs first: ``in_step(name)`` returns once each of the processes
# run at once (``BENCH_AT_ONCE``, their files in ``BENCH_STEPS``) has reached ``name``, so that
# the ceiling's processes time each operation side by side; alone, it returns at once.
_IN_STEP = r"""
import glob as _glob, os as _os, time as _time
def in_step(name):
    at_once, folder = int(_os.environ.get("BENCH_AT_ONCE", "1")), _os.environ.get("BENCH_STEPS")
    if at_once > 1:
        open(f"{folder}/{name}.{_os.getpid()}", "w").close()
        while len(_glob.glob(f"{folder}/{name}.*")) < at_once:
            _time.sleep(0.001)
"""

# Without an engine: export, zero_to_fp32, materialize and cp -r, in that order.
_FILES_CHILD = (
    _IN_STEP
    + r"""
import json, os, shutil, subprocess, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
import ckptstore
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
work, ds_dir = sys.argv[1:3]
out = f"{work}/out-{os.getpid()}"
times = {}
def timed(name, fn, runs=1):
    for run in range(runs):
        os.sync()  # no other run's 3 GB still being written back, throttling this one's writes
        in_step(f"{name}-{run}")
        started = time.perf_counter()
        fn()
        times[name] = min(times.get(name, float("inf")), time.perf_counter() - started)
        shutil.rmtree(out, ignore_errors=True)
with ckptstore.open(work + "/store") as store:
    step = store.steps()[-1]
    # Export and zero_to_fp32 take well under a second here: each is timed twice and the faster
    # kept, so that the first call's imports and page faults do not stand in for its scaling.
    timed("export", lambda: store.export(step, out, dtype="bfloat16"), runs=2)
    timed("zero_to_fp32", lambda: convert_zero_checkpoint_to_state_dict(
        ds_dir, out, dtype=torch.bfloat16, safe_serialization=True), runs=2)
    timed("materialize", lambda: store.materialize(step, out))
    timed("cp -r", lambda: subprocess.run(["cp", "-r", ds_dir, out], check=True))
print(json.dumps(times))
"""
)

# With an engine: restore against load_checkpoint, commit against save_checkpoint.
_ENGINE_CHILD = (
    _IN_STEP
    + r"""
import argparse, json, logging, os, shutil, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
sys.path.append(sys.argv[4])  # after --code's ckptstore (PYTHONPATH)
from tools.engines import build_bench_engine, setup_single_process_env
setup_single_process_env()
from deepspeed.utils import logger
logger.setLevel(logging.WARNING)
import ckptstore
work, ds_dir = sys.argv[1:3]
mine = f"{work}/{os.getpid()}"
args = argparse.Namespace(**json.loads(sys.argv[5]))
engine = build_bench_engine(args)
times = {}
def timed(name, fn):
    in_step(name)
    started = time.perf_counter()
    fn()
    times[name] = time.perf_counter() - started
with ckptstore.open(work + "/store") as store:
    step = store.steps()[-1]
    timed("load_checkpoint", lambda: engine.load_checkpoint(ds_dir))
    timed("restore", lambda: store.restore(engine, step))
timed("save_checkpoint", lambda: engine.save_checkpoint(mine + "-save"))
shutil.rmtree(mine + "-save")
with ckptstore.open(mine + "-commit") as store:
    timed("commit", lambda: store.commit(engine, 1))
shutil.rmtree(mine + "-commit")
print(json.dumps(times))
"""
)

# (operation, its DeepSpeed counterpart)
PAIRS = (
    ("export", "zero_to_fp32"),
    ("materialize", "cp -r"),
    ("restore", "load_checkpoint"),
    ("commit", "save_checkpoint"),
)


def run_children(script: str, argv: list[str], cores: list[list[int]], code: Path, work: Path) -> dict:
    """Run ``script`` in one process per entry of ``cores``, all at once, each pinned to its
    cores with every thread setting at their count; each operation's time, the slowest's."""
    drop = ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    steps = tempfile.mkdtemp(dir=work, prefix="steps-")
    procs = []
    for mine in cores:
        n = len(mine)
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env.update(
            PYTHONPATH=str(code), CKPTSTORE_CPU_THREADS=str(n), CKPTSTORE_EXPORT_THREADS=str(n),
            OMP_NUM_THREADS=str(n), CKPTSTORE_PROGRESS="0", BENCH_AT_ONCE=str(len(cores)), BENCH_STEPS=steps,
        )  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-c", script, *argv[:2], str(n), *argv[2:]],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            cwd=work,  # so that ``-c``'s first path entry finds no ckptstore but --code's
            preexec_fn=lambda mine=mine: os.sched_setaffinity(0, mine),
        ))  # fmt: skip
    times: dict[str, float] = {}
    for proc in procs:
        stdout, stderr = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"child failed:\n{stderr[-3000:]}")
        for name, seconds in json.loads(stdout.strip().splitlines()[-1]).items():
            times[name] = max(times.get(name, 0.0), seconds)
    shutil.rmtree(steps)
    return times


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=1024, layers=11, vocab=32000, reps=3)
    parser.add_argument("--threads", default="1,2", help="thread counts, comma-separated")
    parser.add_argument(
        "--code", help="checkouts whose ckptstore the measured processes run, comma-separated"
    )
    parser.add_argument(
        "--ops", choices=("all", "files", "engine"), default="all",
        help="files: export, materialize and their baselines; engine: restore and commit and theirs",
    )  # fmt: skip
    parser.add_argument("--workdir", help="scratch directory, kept and reused (default: a temp dir)")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[1]
    codes = [Path(c).resolve() for c in args.code.split(",")] if args.code else [repo]
    cores = sorted(os.sched_getaffinity(0))
    counts = [int(n) for n in args.threads.split(",")]
    if max(counts) > len(cores):
        parser.error(f"this process may use {len(cores)} cores, not {max(counts)}")
    setup_single_process_env()
    import logging

    from deepspeed.utils import logger as ds_logger

    import ckptstore

    ds_logger.setLevel(logging.WARNING)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptstore-bench-cores-"))
    made = work / "params.json"  # a --workdir a run made is reused
    if not made.exists():
        engine = build_bench_engine(args)
        train(engine, batches(1, vocab=args.vocab))
        with ckptstore.open(work / "store") as store:
            store.commit(engine, 1)
        engine.save_checkpoint(str(work / "deepspeed"))
        made.write_text(json.dumps(param_count(engine.module)))
        destroy_engine(engine)
        del engine
    params = json.loads(made.read_text())
    print(f"model: llama, {params / 1e6:.1f}M parameters, bf16, ZeRO-2, 1 rank, CPU")
    print(f"load average at start: {os.getloadavg()[0]:.1f}")

    model = json.dumps({k: getattr(args, k) for k in ("hidden", "layers", "vocab", "dtype")})
    ds_dir = str(work / "deepspeed")
    best: dict[tuple[Path, int | str, str], float] = {}
    # Each thread count N, and for N > 1 the ceiling: N one-thread processes at once, a core each.
    runs = [(n, [cores[:n]]) for n in counts] + [
        (f"{n}x1", [[c] for c in cores[:n]]) for n in counts if n > 1
    ]
    for round_ in range(args.reps):
        for code in codes:
            for label, pinned in runs:
                times = {}
                if args.ops in ("all", "files"):
                    times |= run_children(_FILES_CHILD, [str(work), ds_dir], pinned, code, work)
                if args.ops in ("all", "engine"):
                    times |= run_children(
                        _ENGINE_CHILD, [str(work), ds_dir, str(repo), model], pinned, code, work
                    )
                for name, seconds in times.items():
                    best[(code, label, name)] = min(best.get((code, label, name), float("inf")), seconds)
                what = (
                    f"{label[:-2]} one-thread processes at once"
                    if isinstance(label, str)
                    else f"{label} threads"
                )
                print(f"round {round_ + 1}, {code}, {what}: " + ", ".join(
                    f"{k} {v:.2f} s" for k, v in times.items()), flush=True)  # fmt: skip
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    for code in codes:
        print(f"\ncode: {code}")
        _table({(n, name): t for (c, n, name), t in best.items() if c == code}, counts, args.reps)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _table(best: dict[tuple[int | str, str], float], counts: list[int], reps: int) -> None:
    first = counts[0]
    more = counts[1:]
    header = " | ".join(f"{n} threads" for n in counts)
    print(f"| operation (min of {reps}) | {header} | " + " | ".join(
        f"{n} / {first} threads | ceiling {n} / 1" for n in more) + " |")  # fmt: skip
    print("|---|" + "---:|" * (len(counts) + 2 * len(more)))
    for op, base in PAIRS:
        if (first, op) not in best:
            continue
        for name in (op, base):
            cells = [f"{best[(n, name)]:.2f} s" + ("" if name == base else f" ({best[(n, name)] / best[(n, base)]:.2f}x)")
                     for n in counts]  # fmt: skip
            for n in more:
                cells.append(f"{best[(n, name)] / best[(first, name)]:.2f}x")
                # N processes did N times the work at once: the best N threads could do is 1/N of that.
                cells.append(f"{best[(f'{n}x1', name)] / (n * best[(1, name)]):.2f}x" if first == 1 else "")
            print(f"| {name} | " + " | ".join(cells) + " |")
    print("(x): against the DeepSpeed counterpart below it at the same thread count")
    print("ceiling N / 1: N one-thread processes at once, a core each, each doing the whole operation,")
    print("took T; T / (N x the 1-thread time) is the N / 1 that perfect threads would reach on this box")


if __name__ == "__main__":
    sys.exit(main())
