"""Benchmark ckptstore on Megatron-DeepSpeed's 3D shape against DeepSpeed's own tools, in one run.

    python tools/bench_megatron3d.py [--into 1x1x4] [--hidden 512 --heads 8 --ffn 1408 --vocab 7999 --layers 8 --reps 3]

Relaunches itself on 4 ranks under ``torch.distributed.run`` (gloo on CPU) and trains
``tools/megatron_gpt``'s ``GPTModelPipe`` (tied and padded vocabulary, fused QKV, SwiGLU) as
PP 2 x TP 2, bf16 and ZeRO-1. Prints, as ratios measured side by side (absolute times on a
shared machine are noise):

- a full commit until durable against ``save_checkpoint`` followed by an fsync of its files
  (ckptstore's commits are fsynced, DeepSpeed's are not), and the bytes each adds;
- restoring that step into an engine of another layout (``--into PxTxD``; ``restore`` reshards
  at read time) against DeepSpeed's way: ``ds_to_universal`` of its directory, then
  ``load_checkpoint`` with ``load_universal``;
- ``materialize --universal`` from the store against ``ds_to_universal`` of the DeepSpeed
  directory already on disk (the second needs that directory; the first needs only the store).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench import barrier_timed, dir_bytes, fsync_tree, relaunch, shared_scratch  # noqa: E402
from tools.bench_model_parallel import print_commit_rows, to_universal  # noqa: E402
from tools.engines import destroy_engine  # noqa: E402
from tools.megatron_gpt import Dims, batches, build_engine, train  # noqa: E402

RANKS = 4


def layout(text: str) -> tuple[int, int, int]:
    """``PxTxD`` (pipeline stages, tensor-parallel degree, data-parallel copies) of 4 ranks."""
    try:
        pp, tp, dp = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not PxTxD, such as 1x1x4") from None
    if pp * tp * dp != RANKS:
        raise argparse.ArgumentTypeError(f"{text}: P x T x D must be {RANKS}, the job's ranks")
    return pp, tp, dp


def on_rank_zero(fn, *args, **kwargs) -> None:
    """``fn(*args, **kwargs)`` on rank 0 only (a conversion one process does), the others wait."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        fn(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--into", type=layout, default=(1, 1, 4), help="the layout to reshard into (default 1x1x4)"
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=7999, help="padded to a multiple of 2 x TP")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        return relaunch(RANKS, sys.argv[1:] if argv is None else argv, __file__)
    import deepspeed
    import torch.distributed as dist

    import ckptstore

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    dims = Dims(hidden=args.hidden, heads=args.heads, ffn=args.ffn, vocab=args.vocab)
    model = {"num_layers": args.layers, "dims": dims}
    data = batches(8, vocab=args.vocab)  # 4 optimizer steps of 2 micro-batches
    rank0 = dist.get_rank() == 0
    with shared_scratch(args.dir) as work:
        engine = build_engine(2, 2, 1, **model)
        train(engine, data)
        params = sum(p.numel() for p in engine.module.parameters())
        ds_times, commit_times = [], []
        for rep in range(args.reps):
            folder = work / f"ds{rep}"
            seconds, _ = barrier_timed(engine.save_checkpoint, str(folder), tag="t")
            ds_times.append(seconds + barrier_timed(fsync_tree, folder)[0])
            store = ckptstore.open(work / f"store{rep}", create=True)
            commit_times.append(barrier_timed(store.commit, engine, 4)[0])
        ds_bytes, store_bytes = dir_bytes(work / "ds0"), dir_bytes(work / "store0")
        destroy_engine(engine)

        # materialize --universal against ds_to_universal of the directory on disk (rank 0 each)
        convert_times, universal_times = [], []
        for rep in range(args.reps):
            out, made = work / f"universal{rep}", work / f"made{rep}"
            convert_times.append(barrier_timed(on_rank_zero, to_universal, work / "ds0" / "t", out)[0])
            store = ckptstore.open(work / "store0")
            universal_times.append(barrier_timed(on_rank_zero, store.materialize, 4, made, universal=True)[0])
            if rep and rank0:  # the first of each is kept: load_universal reads it below
                shutil.rmtree(out)
                shutil.rmtree(made)

        pp, tp, dp = args.into
        engine = build_engine(pp, tp, dp, checkpoint={"load_universal": True}, **model)
        seconds_load = barrier_timed(engine.load_checkpoint, str(work / "universal0"), tag="t")[0]
        destroy_engine(engine)
        engine = build_engine(pp, tp, dp, **model)
        seconds_restore = barrier_timed(ckptstore.open(work / "store0").restore, engine, 4)[0]
        destroy_engine(engine)

        if rank0:
            ds, commit = statistics.median(ds_times), statistics.median(commit_times)
            convert, universal = statistics.median(convert_times), statistics.median(universal_times)
            uc = convert + seconds_load
            print(f"\nGPTModelPipe PP2 x TP2, 4 ranks, bf16 ZeRO-1, {params / 1e6:.1f}M parameters on rank 0, "
                  f"median of {args.reps}; resharded into PP{pp} x TP{tp} x DP{dp}")  # fmt: skip
            print_commit_rows(ds, commit, ds_bytes, store_bytes)
            print(
                f"| ds_to_universal {convert:.2f} s + load_universal {seconds_load:.2f} s | {uc:.2f} | 1.00x |"
            )
            print(
                f"| restore, resharded at read time (no copy) | {seconds_restore:.2f} | {seconds_restore / uc:.2f}x |"
            )
            print(f"| ds_to_universal of the DeepSpeed directory on disk | {convert:.2f} | 1.00x |")
            print(
                f"| materialize --universal from the store | {universal:.2f} | {universal / convert:.2f}x |"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
