"""Benchmark a commit at every training step against training without commits and DeepSpeed's
``save_checkpoint`` at every step.

    python tools/bench_every_step.py [--hidden 512 --layers 4 --vocab 8000 --steps 50 --lr 1e-5 --pin]
                                     [--warmup 2] [--ways none,latest,wait,whole,deepspeed]

One rank, DeepSpeed ZeRO-2 bf16 on the CPU, a Llama of the options' size, trained ``--steps``
steps (after ``--warmup`` steps, so that Adam's moments settle) these ways in this one
process, each from the same start:

- no checkpoints;
- ``store.commit(engine, step, blocking=False, when_busy="latest")`` after every step: training
  waits for the snapshot copy only; a commit still running has the newest snapshot queued
  behind it, replacing an older one not yet started;
- the same with ``when_busy="wait"`` (each commit waits for the one before), so every step is
  committed, changed tensors as deltas against the step before (the default);
- ``wait`` again with every piece stored whole (``CKPTSTORE_DELTA_CHAIN=1``): a full commit;
- DeepSpeed's ``save_checkpoint`` after every step, synced to disk as a commit is (its tag
  folder removed after the next save).

Prints the median step time of each (training plus what the checkpoint call held it) and its
ratio to no checkpoints, the median training stall the store recorded per commit, the fraction
of steps that became durable, the bytes a commit added (median) against the bytes of one
DeepSpeed save and of a full commit, and the time to materialize the newest step at the end of
its chain of deltas, and to restore it into the engine, against the same step stored whole. ``--pin`` puts training on the first CPU and the store's work on the others
(``CKPTSTORE_BACKGROUND_CPUS``): what a GPU node, whose cores training leaves idle, looks like.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench import dir_bytes, fsync_tree  # noqa: E402
from tools.engines import (  # noqa: E402
    add_bench_model_options,
    batches,
    build_bench_engine,
    destroy_engine,
    setup_single_process_env,
    train,
)

WAYS = ("none", "latest", "wait", "whole", "deepspeed")


def run(args, work: Path, how: str) -> dict:
    """Train ``args.steps`` steps checkpointing ``how`` after each; the per-step seconds and
    what the checkpoints took."""
    import ckptstore

    engine = build_bench_engine(args, lr=args.lr, scheduler=False)
    data = batches(args.warmup + args.steps, vocab=args.vocab, seq=args.seq, batch=args.batch)
    train(engine, data[: args.warmup])
    committing = how in ("latest", "wait", "whole")
    os.environ["CKPTSTORE_DELTA_CHAIN"] = "1" if how == "whole" else ""
    store = ckptstore.open(work / "store") if committing else None
    seconds, saved = [], []
    for step, batch in enumerate(data[args.warmup :], start=1):
        started = time.perf_counter()
        train(engine, [batch])
        if store is not None:
            store.commit(engine, step, blocking=False, when_busy="wait" if how == "whole" else how)
        elif how == "deepspeed":
            engine.save_checkpoint(str(work / "deepspeed"), tag=f"step{step}")
            fsync_tree(work / "deepspeed" / f"step{step}")  # durable, as a commit is
            saved.append(dir_bytes(work / "deepspeed" / f"step{step}"))
            if step > 1:
                shutil.rmtree(work / "deepspeed" / f"step{step - 1}")
        seconds.append(time.perf_counter() - started)
    found = {"seconds": seconds, "saved": saved}
    if store is not None:
        store.wait()
        rows = store.log()
        found.update(
            committed=len(rows),
            stalls=[row.stall_seconds for row in rows if row.stall_seconds is not None],
            added=[row.bytes_added for row in rows],
        )
        started = time.perf_counter()
        store.materialize(rows[-1].step, work / "materialized")
        found["materialize"] = time.perf_counter() - started
        started = time.perf_counter()
        store.restore(engine, rows[-1].step)
        found["restore"] = time.perf_counter() - started
        store.close()
    os.environ["CKPTSTORE_DELTA_CHAIN"] = ""
    destroy_engine(engine)
    return found


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=512, layers=4, vocab=8000, reps=1)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=2, help="steps trained before the first checkpoint")
    parser.add_argument(
        "--ways", default=",".join(WAYS), help="which of " + ", ".join(WAYS) + " (none and whole always run)"
    )
    parser.add_argument("--lr", type=float, default=1e-5, help="1e-5: fine-tuning; 1e-3: from scratch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--pin", action="store_true", help="training on the first CPU, the store on the others"
    )
    args = parser.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin:
        if len(cpus) < 2:
            print("--pin needs 2 CPUs or more", file=sys.stderr)
            return 2
        os.environ["CKPTSTORE_BACKGROUND_CPUS"] = ",".join(map(str, cpus[1:]))
        os.sched_setaffinity(0, {cpus[0]})  # before torch starts its threads: they inherit it
    setup_single_process_env()
    import torch

    if args.pin:
        torch.set_num_threads(1)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="ckptstore-bench-every-step-") as tmp:
        ways = {"none", "whole", *args.ways.split(",")}
        for how in [way for way in WAYS if way in ways]:
            runs[how] = run(args, Path(tmp) / how, how)
    median = statistics.median
    base = median(runs["none"]["seconds"])
    deepspeed_bytes = median(runs["deepspeed"]["saved"]) if "deepspeed" in runs else None
    where = (
        f"training on CPU {cpus[0]}, the store on {','.join(map(str, cpus[1:]))}" if args.pin else "unpinned"
    )
    print(
        f"A checkpoint every step, {args.steps} steps at lr {args.lr:g} after {args.warmup} ({where}), medians:"
    )
    print(
        "| every step | step s | vs no checkpoints | stall s | steps durable | bytes per commit "
        "vs DeepSpeed's save | vs a full commit |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    print(f"| no checkpoints | {base:.3f} | 1.00x | | | | |")
    full = median(runs["whole"]["added"][1:] or runs["whole"]["added"])
    names = {"latest": "when_busy=latest", "wait": "when_busy=wait", "whole": "when_busy=wait, no deltas"}
    for how in [way for way in ("latest", "wait", "whole") if way in runs]:
        found = runs[how]
        step = median(found["seconds"])
        stall = f"{median(found['stalls']):.3f}" if found["stalls"] else "-"
        added = median(found["added"][1:] or found["added"])  # past the first, which is whole
        against = f"{added / deepspeed_bytes:.3f}x" if deepspeed_bytes else "-"
        print(f"| ckptstore commit, {names[how]} | {step:.3f} | {step / base:.2f}x | {stall} | "
              f"{found['committed']}/{args.steps} | {against} | {added / full:.3f}x |")  # fmt: skip
    if "deepspeed" in runs:
        step = median(runs["deepspeed"]["seconds"])
        print(
            f"| DeepSpeed save_checkpoint | {step:.3f} | {step / base:.2f}x | | {args.steps}/{args.steps} | 1.000x | |"
        )
    chained = runs["wait"] if "wait" in runs else runs.get("latest")
    if chained is not None:
        for what in ("materialize", "restore"):
            ours, whole = chained[what], runs["whole"][what]
            print(f"{what} of the newest step: {ours:.2f} s at the end of its chain of deltas, "
                  f"{whole:.2f} s stored whole ({ours / whole:.2f}x)")  # fmt: skip
    if deepspeed_bytes:
        print(
            f"DeepSpeed's save: {deepspeed_bytes / 1e6:.1f} MB; ckptstore's full commit: {full / 1e6:.1f} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
