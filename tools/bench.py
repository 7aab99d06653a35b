"""Benchmark ckptstore against DeepSpeed's own save_checkpoint, in the same process.

    python tools/bench.py [--hidden 768 --layers 8 --vocab 16000 --reps 3]

Builds a Llama of about 80M parameters (bf16, ZeRO-2, one rank, CPU), then reports medians
of several repetitions as ratios against ``engine.save_checkpoint`` (absolute times on a
shared machine are noise; ratios measured side by side are not):
commit time and bytes added for a full commit, a re-commit of unchanged state and a commit
of 2 of 8 layers; materialize time against ``cp -r`` of the DeepSpeed directory.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import (  # noqa: E402
    batches,
    build_engine,
    finalize_distributed,
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


def median_time(fn, reps: int) -> float:
    return statistics.median(timed(fn)[0] for _ in range(reps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workdir", help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    setup_single_process_env()
    import logging

    from deepspeed.utils import logger as ds_logger

    import ckptstore

    ds_logger.setLevel(logging.WARNING)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptstore-bench-"))
    engine = build_engine(
        "llama",
        zero_stage=2,
        dtype="bf16",
        seed=0,
        num_layers=args.layers,
        hidden=args.hidden,
        vocab=args.vocab,
    )
    data = batches(2 + 2 * args.reps, vocab=args.vocab)
    train(engine, data[:1])
    print(f"model: llama, {param_count(engine.module) / 1e6:.1f}M parameters, bf16, ZeRO-2, 1 rank, CPU")

    # DeepSpeed's own checkpoint, the yardstick.
    ds_times = []
    for rep in range(args.reps):
        target = work / f"ds{rep}"
        ds_times.append(timed(lambda t=target: engine.save_checkpoint(str(t)))[0])
    ds_time = statistics.median(ds_times)
    ds_dir = work / "ds0"
    ds_bytes = dir_bytes(ds_dir)
    cp_time = median_time(lambda: subprocess.run(["cp", "-r", str(ds_dir), str(work / "cp")], check=True)
                          or shutil.rmtree(work / "cp"), args.reps)  # fmt: skip

    full_times, full_bytes, re_times, re_bytes, part_times, part_bytes, half_times, mat_times = (
        [] for _ in range(8)
    )
    blocks = [f"model.layers.{i}" for i in range(args.layers)]
    two_of_n = blocks[:: max(1, args.layers // 2)][:2]
    step = 0
    for rep in range(args.reps):
        store = ckptstore.open(work / f"store{rep}")
        step += 1
        t, report = timed(store.commit, engine, step)
        full_times.append(t), full_bytes.append(report.bytes_added)
        step += 1
        t, report = timed(store.commit, engine, step)
        re_times.append(t), re_bytes.append(report.bytes_added)
        train(engine, data[1 + rep : 2 + rep])
        step += 1
        t, report = timed(store.commit, engine, step, layers=two_of_n)
        part_times.append(t), part_bytes.append(report.bytes_added)
        train(engine, data[1 + rep : 2 + rep])
        step += 1
        t, _ = timed(store.commit, engine, step, layers=blocks[rep % 2 :: 2])
        half_times.append(t)
        mat_times.append(timed(store.materialize, step, work / "mat", force=True)[0])
        store.close()

    med = statistics.median
    rows = [
        ("DeepSpeed save_checkpoint", ds_time, 1.0, ds_bytes, 1.0),
        ("full commit", med(full_times), med(full_times) / ds_time, med(full_bytes), med(full_bytes) / ds_bytes),
        ("re-commit, unchanged", med(re_times), med(re_times) / ds_time, med(re_bytes), med(re_bytes) / ds_bytes),
        (f"commit 2 of {args.layers} layers", med(part_times), med(part_times) / ds_time, med(part_bytes),
         med(part_bytes) / ds_bytes),
        (f"commit {args.layers // 2} of {args.layers} layers", med(half_times), med(half_times) / ds_time, None, None),
        ("cp -r of the DeepSpeed dir", cp_time, cp_time / ds_time, None, None),
        ("materialize (vs cp -r)", med(mat_times), med(mat_times) / cp_time, None, None),
    ]  # fmt: skip
    print(f"\n| operation | seconds (median of {args.reps}) | time ratio | bytes | bytes ratio |")
    print("|---|---:|---:|---:|---:|")
    for name, seconds, ratio, nbytes, bratio in rows:
        nb = "" if nbytes is None else f"{nbytes / 1e6:.1f} MB"
        br = "" if bratio is None else f"{bratio:.3f}x"
        print(f"| {name} | {seconds:.2f} | {ratio:.2f}x | {nb} | {br} |")
    print("\ntime ratios are against save_checkpoint, except materialize (against cp -r)")
    shutil.rmtree(work, ignore_errors=True)
    finalize_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
