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

# Without an engine: export, zero_to_fp32, materialize and cp -r, in that order.
_FILES_CHILD = r"""
import json, shutil, subprocess, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
import ckptstore
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
work, ds_dir = sys.argv[1:3]
times = {}
def timed(name, fn, runs=1):
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times[name] = min(times.get(name, float("inf")), time.perf_counter() - started)
        shutil.rmtree(work + "/out", ignore_errors=True)
with ckptstore.open(work + "/store") as store:
    step = store.steps()[-1]
    # Export and zero_to_fp32 take well under a second here: each is timed twice and the faster
    # kept, so that the first call's imports and page faults do not stand in for its scaling.
    timed("export", lambda: store.export(step, work + "/out", dtype="bfloat16"), runs=2)
    timed("zero_to_fp32", lambda: convert_zero_checkpoint_to_state_dict(
        ds_dir, work + "/out", dtype=torch.bfloat16, safe_serialization=True), runs=2)
    timed("materialize", lambda: store.materialize(step, work + "/out"))
    timed("cp -r", lambda: subprocess.run(["cp", "-r", ds_dir, work + "/out"], check=True))
print(json.dumps(times))
"""

# With an engine: restore against load_checkpoint, commit against save_checkpoint.
_ENGINE_CHILD = r"""
import argparse, json, logging, shutil, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
sys.path.append(sys.argv[4])  # after --code's ckptstore (PYTHONPATH)
from tools.engines import build_bench_engine, setup_single_process_env
setup_single_process_env()
from deepspeed.utils import logger
logger.setLevel(logging.WARNING)
import ckptstore
work, ds_dir = sys.argv[1:3]
args = argparse.Namespace(**json.loads(sys.argv[5]))
engine = build_bench_engine(args)
times = {}
def timed(name, fn):
    started = time.perf_counter()
    fn()
    times[name] = time.perf_counter() - started
with ckptstore.open(work + "/store") as store:
    step = store.steps()[-1]
    timed("load_checkpoint", lambda: engine.load_checkpoint(ds_dir))
    timed("restore", lambda: store.restore(engine, step))
timed("save_checkpoint", lambda: engine.save_checkpoint(work + "/save"))
shutil.rmtree(work + "/save")
with ckptstore.open(work + "/commit") as store:
    timed("commit", lambda: store.commit(engine, 1))
shutil.rmtree(work + "/commit")
print(json.dumps(times))
"""

# (operation, its DeepSpeed counterpart)
PAIRS = (
    ("export", "zero_to_fp32"),
    ("materialize", "cp -r"),
    ("restore", "load_checkpoint"),
    ("commit", "save_checkpoint"),
)


def run_child(script: str, argv: list[str], cores: list[int], code: Path, work: Path) -> dict:
    n = len(cores)
    drop = ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        PYTHONPATH=str(code), CKPTSTORE_CPU_THREADS=str(n), CKPTSTORE_EXPORT_THREADS=str(n),
        OMP_NUM_THREADS=str(n), CKPTSTORE_PROGRESS="0",
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", script, *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,  # so that ``-c``'s first path entry finds no ckptstore but --code's
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
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
    args = parser.parse_args()
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
    best: dict[tuple[Path, int, str], float] = {}
    for round_ in range(args.reps):
        for code in codes:
            for n in counts:
                times = {}
                if args.ops in ("all", "files"):
                    times |= run_child(_FILES_CHILD, [str(work), ds_dir, str(n)], cores[:n], code, work)
                if args.ops in ("all", "engine"):
                    engine_argv = [str(work), ds_dir, str(n), str(repo), model]
                    times |= run_child(_ENGINE_CHILD, engine_argv, cores[:n], code, work)
                for name, seconds in times.items():
                    best[(code, n, name)] = min(best.get((code, n, name), float("inf")), seconds)
                print(f"round {round_ + 1}, {code}, {n} threads: " + ", ".join(
                    f"{k} {v:.2f} s" for k, v in times.items()), flush=True)  # fmt: skip
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    for code in codes:
        print(f"\ncode: {code}")
        _table({(n, name): t for (c, n, name), t in best.items() if c == code}, counts, args.reps)
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def _table(best: dict[tuple[int, str], float], counts: list[int], reps: int) -> None:
    first = counts[0]
    header = " | ".join(f"{n} threads" for n in counts)
    print(f"| operation (min of {reps}) | {header} | " + " | ".join(
        f"{n} / {first} threads" for n in counts[1:]) + " |")  # fmt: skip
    print("|---|" + "---:|" * (2 * len(counts) - 1))
    for op, base in PAIRS:
        if (first, op) not in best:
            continue
        for name in (op, base):
            cells = [f"{best[(n, name)]:.2f} s" + ("" if name == base else f" ({best[(n, name)] / best[(n, base)]:.2f}x)")
                     for n in counts]  # fmt: skip
            scale = [f"{best[(n, name)] / best[(first, name)]:.2f}x" for n in counts[1:]]
            print(f"| {name} | " + " | ".join(cells + scale) + " |")
    print("(x): against the DeepSpeed counterpart below it at the same thread count")


if __name__ == "__main__":
    sys.exit(main())
