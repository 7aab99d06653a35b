"""Measure how small a lossless delta against the previous step would make a commit every step.

    python tools/bench_deltas.py [--hidden 256 --layers 4 --vocab 4000 --warmup 300 --lr 1e-5 1e-3]

One rank, DeepSpeed ZeRO-2 bf16 on the CPU. For each learning rate, a Llama of the options' size
trains ``--warmup`` steps (Adam's moments settle: the second moment's relative change per step
falls as 1 / step), then one more. Every tensor a commit stores at the last two steps is encoded
as a commit encodes it (byte planes, zstd) and, for the last, also as the XOR of its bits with
its previous version's, encoded the same way: the lossless delta issue 56 plans. Prints, per
kind of tensor (fp32 masters, Adam's two moments, and the bf16 weights the masters cast down to,
which an RL-style run commits alone), the delta's bytes against a full commit's.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from tools.engines import (  # noqa: E402
    add_bench_model_options,
    batches,
    build_bench_engine,
    destroy_engine,
    setup_single_process_env,
    train,
)

WEIGHTS = "bf16 weights (the masters cast down)"


def encoded(raw: np.ndarray, itemsize: int) -> int:
    """Bytes a commit stores for ``raw`` (elements of ``itemsize`` bytes): byte planes and zstd,
    or the raw bytes where that is smaller."""
    from ckptstore.format import planes

    return min(len(raw), sum(len(part) for part in planes.encode_planes(planes.split_planes(raw, itemsize))))


def state(engine) -> dict[tuple[str, str, int], np.ndarray]:
    """Every tensor a commit of ``engine`` stores, as raw bytes, with each master's bf16 cast."""
    import torch

    from ckptstore.deepspeed.extract import extract
    from ckptstore.format import codec

    found = {}
    for piece in extract(engine).pieces:
        if piece.redundant():
            continue
        found[(piece.name, piece.kind, piece.start)] = codec.raw_bytes(
            piece.tensor.detach().contiguous()
        ).copy()
        if piece.kind == "fp32":
            weights = piece.tensor.detach().to(torch.bfloat16).contiguous()
            found[(piece.name, WEIGHTS, piece.start)] = codec.raw_bytes(weights).copy()
    return found


def measure(args, lr: float) -> dict[str, tuple[int, int]]:
    """kind -> (bytes of a full commit of it, bytes of its delta against the step before)."""
    engine = build_bench_engine(args, lr=lr, scheduler=False)
    data = batches(args.warmup + 1, vocab=args.vocab, seq=args.seq, batch=args.batch)
    train(engine, data[: args.warmup])
    before = state(engine)
    train(engine, data[args.warmup :])
    after = state(engine)
    destroy_engine(engine)
    sizes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for key, raw in after.items():
        itemsize = 4 if key[1] != WEIGHTS else 2
        full = encoded(raw, itemsize)
        previous = before.get(key)
        same = previous is not None and len(previous) == len(raw)
        delta = encoded(np.bitwise_xor(raw, previous), itemsize) if same else full
        sizes[key[1]][0] += full
        sizes[key[1]][1] += min(delta, full)
    return {kind: (full, delta) for kind, (full, delta) in sizes.items()}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=256, layers=4, vocab=4000, reps=1)
    parser.add_argument("--warmup", type=int, default=300, help="steps before the two measured")
    parser.add_argument("--lr", type=float, nargs="+", default=[1e-5, 1e-3])
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    setup_single_process_env()
    print(f"A lossless delta (XOR with the step before, byte planes, zstd) after {args.warmup} steps:")
    print("| lr | tensors | full commit MB | delta MB | delta / full |")
    print("|---:|---|---:|---:|---:|")
    for lr in args.lr:
        sizes = measure(args, lr)
        state_kinds = [kind for kind in sizes if kind != WEIGHTS]
        for kind in [*state_kinds, WEIGHTS]:
            full, delta = sizes[kind]
            print(f"| {lr:g} | {kind} | {full / 1e6:.2f} | {delta / 1e6:.2f} | {delta / full:.3f}x |")
        full, delta = (sum(sizes[kind][i] for kind in state_kinds) for i in (0, 1))
        print(f"| {lr:g} | **a commit (masters and moments)** | {full / 1e6:.2f} | {delta / 1e6:.2f} | **{delta / full:.3f}x** |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
