"""Benchmark keeping every policy version of an RL-style run: the bf16 weights after each step,
saved with ``dcp.save`` into the store (changed tensors as deltas) against DCP's own writer.

    python tools/bench_policy_versions.py [--hidden 512 --layers 4 --vocab 8000 --warmup 20 --steps 20 --lr 1e-5]

One rank, DeepSpeed ZeRO-2 bf16 on the CPU, a Llama of the options' size, trained ``--warmup``
steps, then ``--steps`` more; after each of those its module's bf16 weights (what a rollout
worker loads) are saved three ways in this one process: ``dcp.save`` with ``StoreWriter`` into a
store (deltas, the default), the same into a store with every piece whole
(``CKPTSTORE_DELTA_CHAIN=1``), and DCP's ``FileSystemWriter`` into a folder per version. Prints
the bytes stored per version (median past the first) against DCP's folder and against a whole
version, the save seconds (median), and the seconds to load the newest version back with
``dcp.load`` from each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench import dir_bytes  # noqa: E402
from tools.engines import (  # noqa: E402
    add_bench_model_options,
    batches,
    build_bench_engine,
    destroy_engine,
    setup_single_process_env,
    train,
)

WAYS = ("store", "whole", "dcp")


def policy(engine) -> dict:
    """The engine's module weights, as a rollout worker would load them."""
    return {"model": {name: tensor.detach().clone() for name, tensor in engine.module.state_dict().items()}}


def save(how: str, state: dict, step: int, where: Path, store) -> float:
    """Save ``state`` as version ``step`` ``how``; the seconds it took."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import StoreWriter

    started = time.perf_counter()
    if how == "dcp":
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(where / f"v{step}")))
    else:
        dcp.save(state, storage_writer=StoreWriter(store, step=step))
    return time.perf_counter() - started


def load(how: str, state: dict, step: int, where: Path, store) -> float:
    """Load version ``step`` into ``state`` (in place); the seconds it took."""
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import StoreReader

    started = time.perf_counter()
    reader = dcp.FileSystemReader(str(where / f"v{step}")) if how == "dcp" else StoreReader(store, step=step)
    dcp.load(state, storage_reader=reader)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=512, layers=4, vocab=8000, reps=1)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args(argv)
    setup_single_process_env()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    import ckptstore

    engine = build_bench_engine(args, lr=args.lr, scheduler=False)
    data = batches(args.warmup + args.steps, vocab=args.vocab, seq=args.seq, batch=args.batch)
    train(engine, data[: args.warmup])
    seconds = {how: [] for how in WAYS}
    with tempfile.TemporaryDirectory(prefix="ckptstore-bench-policy-") as tmp:
        root = Path(tmp)
        stores = {how: ckptstore.open(root / how) for how in ("store", "whole")}
        for step, batch in enumerate(data[args.warmup :], start=1):
            train(engine, [batch])
            state = policy(engine)
            for how in WAYS:
                os.environ["CKPTSTORE_DELTA_CHAIN"] = "1" if how == "whole" else ""
                seconds[how].append(save(how, state, step, root / "dcp", stores.get(how)))
        os.environ["CKPTSTORE_DELTA_CHAIN"] = ""
        added = {how: [row.bytes_added for row in stores[how].log()] for how in stores}
        folders = [dir_bytes(root / "dcp" / f"v{step}") for step in range(1, args.steps + 1)]
        loads = {how: load(how, policy(engine), args.steps, root / "dcp", stores.get(how)) for how in WAYS}
        for opened in stores.values():
            opened.close()
    destroy_engine(engine)
    median = statistics.median
    per_version = {
        "store": median(added["store"][1:] or added["store"]),
        "whole": median(added["whole"][1:] or added["whole"]),
        "dcp": median(folders),
    }
    print(f"Every policy version (bf16 weights), {args.steps} steps at lr {args.lr:g} after {args.warmup}:")
    print(
        "| saved with | bytes per version | vs DCP's folder | vs a whole version | save s | load newest s |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    names = {"store": "dcp.save into the store (deltas)", "whole": "dcp.save into the store, whole",
             "dcp": "dcp.save, FileSystemWriter"}  # fmt: skip
    for how in WAYS:
        size = per_version[how]
        print(f"| {names[how]} | {size / 1e6:.2f} MB | {size / per_version['dcp']:.3f}x | "
              f"{size / per_version['whole']:.3f}x | {median(seconds[how]):.3f} | {loads[how]:.3f} |")  # fmt: skip
    print(
        f"ratios against DCP's FileSystemWriter; the first version stored whole: {added['store'][0] / 1e6:.2f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
