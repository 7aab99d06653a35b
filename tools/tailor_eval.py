"""Layer-wise tailoring, evaluated: bytes, commit time and training quality per selection strategy.

    python tools/tailor_eval.py [--steps 240] [--every 20] [--fail-at 175] [--workdir DIR] [--json FILE]
                                [--layers 8] [--eval-batches 16]

Trains a small Llama (8 blocks, hidden 128, byte-level vocabulary; DeepSpeed ZeRO-2, bf16, CPU)
on the source text of Python's own standard library, committing every ``--every`` steps into
one store per strategy: full, parity, filter (first/last 2 blocks every commit, the rest every
4th), update-magnitude (layers whose fp32 masters moved by more than 15% since their last save,
none left unsaved for 3 commits; 15% is about the median move of a block between commits in
this run: a small model trained from scratch moves all its layers alike). A failure is simulated at ``--fail-at``: each strategy materializes its
newest step at or before it (a composite step for all but full), resumes on a fresh engine and
trains to the end on the same batches. The uninterrupted run is the reference. Prints a
markdown table (docs/tailoring.md's) with bytes stored, commit time, and final train and eval loss
against the uninterrupted run and against full checkpoints.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import build_engine, destroy_engine, finalize_distributed, setup_single_process_env  # noqa: E402

# Real text that ships with Python: the sources of standard-library modules (held-out ones for eval).
TRAIN_MODULES = ["argparse", "textwrap", "difflib", "inspect", "pathlib", "dataclasses", "enum", "functools",
                 "shutil", "subprocess", "tarfile", "zipfile", "logging", "collections"]  # fmt: skip
EVAL_MODULES = ["pydoc", "doctest", "email.message", "http.client"]
SEQ, BATCH, EVAL_BATCHES = 64, 8, 16
MODEL = {"num_layers": 8, "hidden": 128, "vocab": 256}


def corpus(modules: list[str]):
    import torch

    text = b"".join(Path(importlib.util.find_spec(m).origin).read_bytes() for m in modules)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def batch(tokens, index: int, seed: int):
    """Batch ``index``: BATCH random windows of SEQ bytes, the same whatever ran before."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    starts = torch.randint(0, tokens.numel() - SEQ, (BATCH,), generator=g)
    return torch.stack([tokens[s : s + SEQ] for s in starts.tolist()])


def train_step(engine, ids) -> float:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return float(loss.detach().float())


def evaluate(engine, tokens, batches: int = EVAL_BATCHES) -> float:
    import torch

    engine.eval()
    with torch.no_grad():
        losses = [float(engine(input_ids=b, labels=b).loss.float()) for b in (batch(tokens, i, 7) for i in range(batches))]  # fmt: skip
    engine.train()
    return statistics.fmean(losses)


def new_engine(seed: int, model: dict = MODEL):
    return build_engine("llama", zero_stage=2, dtype="bf16", seed=seed, lr=3e-3,
                        train_micro_batch_size_per_gpu=BATCH, **model)  # fmt: skip


def strategies() -> dict:
    from ckptstore.strategies import Filter, Parity, UpdateMagnitude

    return {
        "full": None,
        "parity": Parity(),
        "filter": Filter(first=2, last=2, every=4),
        "update-magnitude": UpdateMagnitude(threshold=0.15, max_age=3),
    }


def run(args) -> dict:
    import ckptstore

    train_tokens, eval_tokens = corpus(TRAIN_MODULES), corpus(EVAL_MODULES)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptstore-tailor-"))
    work.mkdir(parents=True, exist_ok=True)
    config = work / "config.json"
    model = {**MODEL, "num_layers": args.layers}
    config.write_text(json.dumps({"model": "llama", **model, "seq": SEQ}))
    chosen = strategies()
    stores = {name: ckptstore.open(work / name) for name in chosen}
    commit_seconds = dict.fromkeys(chosen, 0.0)
    saved_layers = {name: [] for name in chosen}

    engine = new_engine(seed=0, model=model)
    reference = []
    for step in range(1, args.steps + 1):
        reference.append(train_step(engine, batch(train_tokens, step, 1)))
        if step % args.every == 0:
            for name, strategy in chosen.items():
                started = time.perf_counter()
                report = stores[name].commit(
                    engine, step, layers=strategy, files=[config] if step == args.every else None
                )
                commit_seconds[name] += time.perf_counter() - started
                saved_layers[name].append(len(report.layers_saved))
    results = {"uninterrupted": {"final_loss": statistics.fmean(reference[-10:]),
                                 "eval_loss": evaluate(engine, eval_tokens, args.eval_batches)}}  # fmt: skip
    destroy_engine(engine)

    for name in chosen:
        store = stores[name]
        resume = max(s for s in store.steps() if s <= args.fail_at)
        out = store.materialize(resume, work / f"{name}-checkpoint")
        sources = store.sources(resume)
        engine = new_engine(seed=1, model=model)
        engine.load_checkpoint(str(out))
        assert engine.global_steps == resume, (name, engine.global_steps)
        losses = reference[:resume] + [
            train_step(engine, batch(train_tokens, step, 1)) for step in range(resume + 1, args.steps + 1)
        ]
        results[name] = {
            "bytes": sum(row.bytes_added for row in store.log()),
            "commit_seconds": commit_seconds[name],
            "commits": len(store.steps()),
            "mean_layers_saved": statistics.fmean(saved_layers[name]),
            "layers": len(sources),
            "resumed_from": resume,
            "oldest_layer": min(sources.values()),
            "final_loss": statistics.fmean(losses[-10:]),
            "eval_loss": evaluate(engine, eval_tokens, args.eval_batches),
        }
        destroy_engine(engine)
        store.close()
    return results


def table(results: dict) -> str:
    full, ref = results["full"], results["uninterrupted"]
    lines = [
        "| strategy | layers saved per commit | bytes stored | vs full | commit time | vs full "
        "| resumed from (oldest layer) | final train loss | Δ vs uninterrupted | Δ vs full | eval loss "
        "| Δ vs uninterrupted | Δ vs full |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        f"| uninterrupted | | | | | | | {ref['final_loss']:.4f} | | | {ref['eval_loss']:.4f} | | |",
    ]
    for name, r in results.items():
        if name == "uninterrupted":
            continue
        lines.append(
            f"| {name} | {r['mean_layers_saved']:.1f} of {r['layers']} | {r['bytes'] / 2**20:.1f} MiB "
            f"| {r['bytes'] / full['bytes']:.2f}x | {r['commit_seconds']:.1f} s "
            f"| {r['commit_seconds'] / full['commit_seconds']:.2f}x | {r['resumed_from']} ({r['oldest_layer']}) "
            f"| {r['final_loss']:.4f} | {r['final_loss'] - ref['final_loss']:+.4f} "
            f"| {r['final_loss'] - full['final_loss']:+.4f} | {r['eval_loss']:.4f} "
            f"| {r['eval_loss'] - ref['eval_loss']:+.4f} | {r['eval_loss'] - full['eval_loss']:+.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the evaluation with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240, help="training steps in all")
    parser.add_argument("--every", type=int, default=20, help="commit every N steps")
    parser.add_argument("--fail-at", type=int, default=175, help="the step at which the run fails")
    parser.add_argument("--workdir", help="where the stores go (default: a temporary directory)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--layers", type=int, default=MODEL["num_layers"], help="decoder blocks of the model")
    parser.add_argument(
        "--eval-batches", type=int, default=EVAL_BATCHES, help="held-out batches the eval loss averages"
    )
    args = parser.parse_args(argv)
    if not args.every <= args.fail_at < args.steps:
        parser.error("need --every <= --fail-at < --steps")
    setup_single_process_env()
    import logging

    from deepspeed.utils import logger as ds_logger

    ds_logger.setLevel(logging.WARNING)
    started = time.perf_counter()
    results = run(args)
    print(table(results))
    print(f"\n{args.steps} steps, commit every {args.every}, failure at step {args.fail_at}; "
          f"{time.perf_counter() - started:.0f} s in all")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    finalize_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
