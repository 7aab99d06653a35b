"""Benchmark ``ckptstore export`` against DeepSpeed's zero_to_fp32 conversion to safetensors.

    python tools/bench_export.py [--hidden 768 --layers 8 --vocab 16000 --reps 5]
                                 [--dtypes float32,bfloat16]

Builds the bench model (a Llama of about 80M parameters, bf16, ZeRO-2, one rank, CPU), commits
it into a store and saves it with ``save_checkpoint``, then times, in fresh processes taking
turns, what a user runs to get a Hugging Face weights folder:
- DeepSpeed: ``convert_zero_checkpoint_to_state_dict(dir, out, dtype=..., safe_serialization=True)``
  (what ``zero_to_fp32.py --safe_serialization`` does) from DeepSpeed's own directory;
- ckptstore: ``store.export(step, out, dtype=...)`` from the store;
each for float32 and bfloat16 output (``--dtypes``). Reported: median seconds, CPU seconds
(every thread's and forked worker's, user and system) and peak extra resident memory (above the process's level
once its imports are done, plus each forked worker's own pages, its USS, sampled every 5 ms), and our ratios. Absolute times on a shared box are noise; the
ratios, measured side by side, are the result (and CPU seconds are the steadier measure where
other jobs share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import (  # noqa: E402
    add_bench_model_options,
    batches,
    build_bench_engine,
    param_count,
    setup_single_process_env,
    train,
)

# Run in a fresh process per measurement, so neither tool inherits the other's heap.
_CHILD = r"""
import json, resource, sys, threading, time
import psutil, torch
import ckptstore
from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_state_dict
tool, source, out, dtype = sys.argv[1:5]
process = psutil.Process()
base = process.memory_info().rss
peak = [base]
done = threading.Event()
workers = {}  # a forked worker's pid -> its own pages (USS), last read
def resident(tick=0):
    # With its forked workers (export's, materialize's): each worker's pages of its own (USS:
    # not those it still shares with this process since the fork), read every 50 ms only, as
    # reading them costs more than a worker's memory changes.
    if tick % 10 == 0:
        workers.clear()
        for child in process.children():
            try:
                workers[child.pid] = child.memory_full_info().uss
            except psutil.Error:  # gone
                pass
    return process.memory_info().rss + sum(workers.values())
def sample():
    tick = 0
    while not done.wait(0.005):
        tick += 1
        peak[0] = max(peak[0], resident(tick))
threading.Thread(target=sample, daemon=True).start()
def cpu():  # the workers' too, once reaped
    return sum(u.ru_utime + u.ru_stime for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))
cpu_started, started = cpu(), time.perf_counter()
if tool == "deepspeed":
    convert_zero_checkpoint_to_state_dict(source, out, dtype=getattr(torch, dtype), safe_serialization=True)
else:
    with ckptstore.open(source) as store:
        store.export(store.steps()[-1], out, dtype=dtype)
seconds, cpu_seconds = time.perf_counter() - started, cpu() - cpu_started
done.set()
peak[0] = max(peak[0], resident())
print(json.dumps({"seconds": seconds, "cpu": cpu_seconds, "peak": peak[0] - base}))
"""


def measure(tool: str, source: Path, out: Path, dtype: str) -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, tool, str(source), str(out), dtype],
        capture_output=True,
        text=True,
        env=env,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} export failed:\n{proc.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=768, layers=8, vocab=16000, reps=5)
    parser.add_argument("--workdir", help="scratch directory (default: a temp dir)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="output dtypes, comma-separated")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    setup_single_process_env()
    import logging

    from deepspeed.utils import logger as ds_logger

    import ckptstore

    ds_logger.setLevel(logging.WARNING)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptstore-bench-export-"))
    engine = build_bench_engine(args)
    train(engine, batches(1, vocab=args.vocab))
    params = param_count(engine.module)
    print(f"model: llama, {params / 1e6:.1f}M parameters, bf16, ZeRO-2, 1 rank, CPU")
    with ckptstore.open(work / "store") as store:
        store.commit(engine, 1)
    engine.save_checkpoint(str(work / "deepspeed"))

    results: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.reps):
        for dtype in dtypes:
            for tool, source in (("deepspeed", work / "deepspeed"), ("ckptstore", work / "store")):
                results.setdefault((tool, dtype), []).append(measure(tool, source, work / "out", dtype))

    print(
        f"\n| export to safetensors ({args.reps} runs each) | seconds | CPU seconds | peak extra RSS "
        "| time ratio | CPU ratio | memory ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for dtype in dtypes:
        ds_time = statistics.median(r["seconds"] for r in results[("deepspeed", dtype)])
        ds_peak = statistics.median(r["peak"] for r in results[("deepspeed", dtype)])
        ds_cpu = statistics.median(r["cpu"] for r in results[("deepspeed", dtype)])
        for tool, label in (("deepspeed", "DeepSpeed zero_to_fp32"), ("ckptstore", "ckptstore export")):
            seconds = statistics.median(r["seconds"] for r in results[(tool, dtype)])
            peak = statistics.median(r["peak"] for r in results[(tool, dtype)])
            cpu = statistics.median(r["cpu"] for r in results[(tool, dtype)])
            print(f"| {label}, {dtype} | {seconds:.2f} | {cpu:.2f} | {peak / 1e6:.0f} MB | "
                  f"{seconds / ds_time:.2f}x | {cpu / ds_cpu:.2f}x | {peak / ds_peak:.2f}x |")  # fmt: skip
    print(
        f"\nratios against DeepSpeed's conversion of the same dtype; the fp32 model is {params * 4 / 1e6:.0f} MB"
    )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
