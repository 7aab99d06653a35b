"""Benchmark ckptstore on model-parallel DeepSpeed engines against DeepSpeed's own tools, in one run.

    python tools/bench_model_parallel.py [--split pipeline|autotp] [--hidden H --layers L --vocab V --reps 3]

Relaunches itself on 2 ranks under ``torch.distributed.run`` (gloo on CPU), bf16 and ZeRO-1:
``pipeline`` is a language model of ``--layers`` MLP blocks and a tied embedding as a 2-stage
``PipelineEngine``; ``autotp`` a Llama of ``--layers`` layers split over 2 tensor-parallel
ranks by AutoTP. Prints, as ratios measured side by side (absolute times on a shared machine
are noise):

- a full commit until durable against ``save_checkpoint`` followed by an fsync of its files
  (ckptstore's commits are fsynced, DeepSpeed's are not), and the bytes each adds;
- restoring that 2-way step into a 1-way engine (``restore`` reshards at read time) against
  DeepSpeed's way: ``ds_to_universal`` of its directory, then ``load_checkpoint`` with
  ``load_universal``, with the second copy that conversion writes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench import barrier_timed, dir_bytes, fsync_tree, relaunch, shared_scratch  # noqa: E402
from tools.engines import (  # noqa: E402
    batches,
    build_autotp_engine,
    build_pipeline_engine,
    destroy_engine,
    train,
    train_pipeline,
)

# Per kind of split: how an engine of 1 or 2 ways is built and trained, what its client passes
# for ds_to_universal (AutoTP writes its own), and the default model size.
SPLITS = {
    "pipeline": {
        "build": lambda ways, **options: build_pipeline_engine(stages=ways, **options),
        "train": train_pipeline,
        "client_state": {
            "universal_checkpoint_info": {
                "pipeline_replicated_parameter_patterns": [r"tied_modules\.embed\.weight"]
            }
        },
        "model": {"hidden": 2048, "num_layers": 8, "vocab": 4096},
        "what": "2-stage pipeline",
    },
    "autotp": {
        "build": lambda ways, **options: build_autotp_engine(tp=ways, **options),
        "train": train,
        "client_state": {},
        "model": {"hidden": 1024, "num_layers": 4, "vocab": 8192},
        "what": "AutoTP-2 Llama",
    },
}


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's ``ds_to_universal`` of one tag folder (one worker per phase per rank, as the box has)."""
    from deepspeed.checkpoint import ds_to_universal

    argv, sys.argv = sys.argv, ["ds_to_universal", "--input_folder", str(checkpoint),
                                "--output_folder", str(out / checkpoint.name)]  # fmt: skip
    try:
        ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = argv
    (out / "latest").write_text(checkpoint.name)


def print_commit_rows(ds: float, commit: float, ds_bytes: int, store_bytes: int) -> None:
    """The table's head and its commit rows: seconds to durable and bytes, against DeepSpeed's save."""
    print("| operation | seconds | ratio |")
    print("|---|---:|---:|")
    print(f"| save_checkpoint, then fsync (durable) | {ds:.2f} | 1.00x |")
    print(f"| commit (durable) | {commit:.2f} | {commit / ds:.2f}x |")
    print(f"| bytes: save_checkpoint {ds_bytes / 2**20:.0f} MiB, store {store_bytes / 2**20:.0f} MiB "
          f"| | {store_bytes / ds_bytes:.3f}x |")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=sorted(SPLITS), default="pipeline")
    parser.add_argument("--hidden", type=int, default=None, help="default: per split")
    parser.add_argument("--layers", type=int, default=None, help="default: per split")
    parser.add_argument("--vocab", type=int, default=None, help="default: per split")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        return relaunch(2, sys.argv[1:] if argv is None else argv, __file__)
    import deepspeed
    import torch.distributed as dist

    import ckptstore

    deepspeed.init_distributed(dist_backend=None, verbose=False)

    split = SPLITS[args.split]
    build, train_some, client_state = split["build"], split["train"], split["client_state"]
    given = {"hidden": args.hidden, "num_layers": args.layers, "vocab": args.vocab}
    model = {**split["model"], **{k: v for k, v in given.items() if v is not None}, "dtype": "bf16"}
    # 4 optimizer steps past the first (lr 0 in WarmupLR); a pipeline takes 2 micro-batches a step
    data = batches(8 if args.split == "pipeline" else 4, vocab=model["vocab"])
    with shared_scratch(args.dir) as work:
        engine = build(2, **model)
        train_some(engine, data)
        params = sum(p.numel() for p in engine.module.parameters())
        ds_times, commit_times = [], []
        for rep in range(args.reps):
            folder = work / f"ds{rep}"
            seconds, _ = barrier_timed(
                engine.save_checkpoint, str(folder), tag="t", client_state=client_state
            )
            ds_times.append(seconds + barrier_timed(fsync_tree, folder)[0])
            store = ckptstore.open(work / f"store{rep}", create=True)
            commit_times.append(barrier_timed(store.commit, engine, 2, client_state=client_state)[0])
        destroy_engine(engine)

        universal = work / "universal"
        seconds_convert = barrier_timed(
            lambda: dist.get_rank() or to_universal(work / "ds0" / "t", universal)
        )[0]
        engine = build(1, checkpoint={"load_universal": True}, **model)
        seconds_load = barrier_timed(engine.load_checkpoint, str(universal), tag="t")[0]
        destroy_engine(engine)
        engine = build(1, **model)
        seconds_restore = barrier_timed(ckptstore.open(work / "store0").restore, engine, 2)[0]
        destroy_engine(engine)

        if dist.get_rank() == 0:  # only rank 0 reads the folders: it removes them at the end
            ds_bytes, store_bytes = dir_bytes(work / "ds0"), dir_bytes(work / "store0")
            universal_bytes = dir_bytes(universal)
            ds, commit = statistics.median(ds_times), statistics.median(commit_times)
            uc = seconds_convert + seconds_load
            print(
                f"\n{split['what']}, 2 ranks, bf16 ZeRO-1, {params / 1e6:.0f}M parameters on rank 0, median of {args.reps}"
            )
            print_commit_rows(ds, commit, ds_bytes, store_bytes)
            print(f"| ds_to_universal {seconds_convert:.2f} s + load_universal {seconds_load:.2f} s "
                  f"(second copy: {universal_bytes / 2**20:.0f} MiB) | {uc:.2f} | 1.00x |")  # fmt: skip
            print(f"| restore into 1 way (resharded at read time, no copy) | {seconds_restore:.2f} "
                  f"| {seconds_restore / uc:.2f}x |")  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
