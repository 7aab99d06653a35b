"""Benchmark ckptstore on a DeepSpeed Mixture-of-Experts engine at expert parallelism 2, against
DeepSpeed's own save and load, in one run.

    python tools/bench_moe.py [--hidden 512 --experts 8 --saves 4 --reps 3]

Relaunches itself on 2 ranks under ``torch.distributed.run`` (gloo on CPU): a language model of
4 blocks, 2 of them with DeepSpeed's MoE layer (``--experts`` experts, top-2, ``ep_size`` 2),
bf16 and ZeRO 2. Between saves it trains a few steps, so every expert moves, some more than
others (the top-2 gate sends tokens unevenly). Prints, as ratios measured side by side (absolute
times on a shared machine are noise):

- per save, ``save_checkpoint`` followed by an fsync of its files against a full commit until
  durable, and the bytes each wrote over all saves;
- the same with ``UpdateMagnitude``, which saves only the experts and blocks that moved past its
  threshold and inherits the others;
- the bytes of a commit when a quarter of the experts are frozen (upcycling, expert-frozen
  fine-tuning), against DeepSpeed's directory of the same step;
- ``restore`` into an engine of the same layout against ``load_checkpoint``, and ``restore``
  into 2 ranks at ``ep_size`` 1 (resharded at read time), which DeepSpeed's own load cannot do
  (docs/moe.md, section 9).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench import barrier_timed, dir_bytes, fsync_tree, relaunch, shared_scratch  # noqa: E402
from tools.engines import batches, destroy_engine, train  # noqa: E402
from tools.moe_engines import VOCAB, build_moe_engine  # noqa: E402

STEPS_BETWEEN_SAVES = 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer (even)")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each restore and load")
    parser.add_argument("--threshold", type=float, default=0.05, help="UpdateMagnitude's threshold")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        return relaunch(2, sys.argv[1:] if argv is None else argv, __file__)
    import deepspeed
    import torch.distributed as dist

    import ckptstore
    from ckptstore.strategies import UpdateMagnitude

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    model = {"hidden": args.hidden, "experts": args.experts, "ep_size": 2}
    rank0 = dist.get_rank() == 0
    data = batches(STEPS_BETWEEN_SAVES * args.saves, vocab=VOCAB, seq=32)
    with shared_scratch(args.dir) as work:
        # Every save: DeepSpeed's directory, a full commit, and a commit of what moved.
        engine = build_moe_engine(2, "bf16", **model)
        params = sum(p.numel() for p in engine.module.parameters())
        full, moved = ckptstore.open(work / "full", create=True), ckptstore.open(work / "moved", create=True)
        ds_times, full_times, moved_times, saved_experts = [], [], [], []
        for save in range(args.saves):
            train(engine, data[save * STEPS_BETWEEN_SAVES : (save + 1) * STEPS_BETWEEN_SAVES])
            step = engine.global_steps
            seconds, _ = barrier_timed(engine.save_checkpoint, str(work / "deepspeed"))
            ds_times.append(seconds + barrier_timed(fsync_tree, work / "deepspeed" / f"global_step{step}")[0])
            full_times.append(barrier_timed(full.commit, engine, step)[0])
            seconds, report = barrier_timed(
                moved.commit, engine, step, layers=UpdateMagnitude(args.threshold)
            )
            moved_times.append(seconds)
            saved_experts.append(sum(".deepspeed_experts." in layer for layer in report.layers_saved))
        last = engine.global_steps
        destroy_engine(engine)

        # A quarter of the experts frozen: what a commit of a later step adds.
        engine = build_moe_engine(2, "bf16", frozen_experts=args.experts // 8, **model)
        frozen = ckptstore.open(work / "frozen", create=True)
        train(engine, data[:STEPS_BETWEEN_SAVES])
        frozen.commit(engine, engine.global_steps)
        train(engine, data[STEPS_BETWEEN_SAVES : 2 * STEPS_BETWEEN_SAVES])
        added = frozen.commit(engine, engine.global_steps).bytes_added
        engine.save_checkpoint(str(work / "frozen-deepspeed"))
        frozen_step = engine.global_steps
        destroy_engine(engine)

        # Reading the last step back: into the same layout, and into ep_size 1.
        load_times, restore_times, reshard_times = [], [], []
        for _ in range(args.reps):
            engine = build_moe_engine(2, "bf16", seed=1, **model)
            load_times.append(barrier_timed(engine.load_checkpoint, str(work / "deepspeed"))[0])
            restore_times.append(barrier_timed(full.restore, engine, last)[0])
            destroy_engine(engine)
            engine = build_moe_engine(2, "bf16", seed=1, **{**model, "ep_size": 1})
            reshard_times.append(barrier_timed(full.restore, engine, last)[0])
            destroy_engine(engine)

        if rank0:
            ds_bytes = dir_bytes(work / "deepspeed")
            full_bytes, moved_bytes = dir_bytes(work / "full"), dir_bytes(work / "moved")
            frozen_ds = dir_bytes(work / "frozen-deepspeed" / f"global_step{frozen_step}")
            # what DeepSpeed's save spends on what moved: all but the frozen experts' files
            local, frozen_count = args.experts // 2, args.experts // 8
            frozen_files = [work / "frozen-deepspeed" / f"global_step{frozen_step}" / f"layer_{layer}_expert_{rank * local + j}_mp_rank_00_model_states.pt"
                            for layer in (0, 1) for rank in (0, 1) for j in range(frozen_count)]  # fmt: skip
            moved_ds = frozen_ds - sum(path.stat().st_size for path in frozen_files)
            ds, commit, strategy = (statistics.median(t) for t in (ds_times, full_times, moved_times))
            load, restore, reshard = (
                statistics.median(t) for t in (load_times, restore_times, reshard_times)
            )
            print(f"\n{args.experts} experts x 2 MoE layers, top-2, ep_size 2 on 2 ranks, bf16 ZeRO-2, "
                  f"{params / 1e6:.1f}M parameters per rank, {args.saves} saves {STEPS_BETWEEN_SAVES} steps apart")  # fmt: skip
            print("| operation | seconds | ratio |")
            print("|---|---:|---:|")
            print(f"| save_checkpoint, then fsync (durable), per save | {ds:.2f} | 1.00x |")
            print(f"| commit (durable), per save | {commit:.2f} | {commit / ds:.2f}x |")
            print(
                f"| commit with UpdateMagnitude({args.threshold}), per save | {strategy:.2f} | {strategy / ds:.2f}x |"
            )
            print(f"| bytes of {args.saves} saves: save_checkpoint {ds_bytes / 2**20:.1f} MiB, "
                  f"store {full_bytes / 2**20:.1f} MiB | | {full_bytes / ds_bytes:.3f}x |")  # fmt: skip
            print(f"| bytes with UpdateMagnitude: {moved_bytes / 2**20:.1f} MiB (experts saved per save: "
                  f"{', '.join(map(str, saved_experts))} of {2 * args.experts}) | | {moved_bytes / ds_bytes:.3f}x |")  # fmt: skip
            print(f"| bytes a commit adds with a quarter of the experts frozen: {added / 2**20:.2f} MiB, "
                  f"against DeepSpeed's {frozen_ds / 2**20:.2f} MiB ({moved_ds / 2**20:.2f} MiB of it for what moved) "
                  f"| | {added / frozen_ds:.3f}x |")  # fmt: skip
            print(f"| load_checkpoint (same layout) | {load:.2f} | 1.00x |")
            print(f"| restore (same layout) | {restore:.2f} | {restore / load:.2f}x |")
            print(f"| restore into ep_size 1 (resharded; DeepSpeed's load cannot) | {reshard:.2f} "
                  f"| {reshard / load:.2f}x |")  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
