"""Benchmark CkptStoreCallback against the Hugging Face Trainer's own DeepSpeed checkpoints.

    python tools/bench_trainer.py [--hidden 768 --layers 8 --vocab 16000 --saves 3]

The Trainer (DeepSpeed ZeRO-2, bf16, CPU, one rank) trains a Llama of about 80M parameters and
saves every 2 steps, once on its own and once with ``CkptStoreCallback`` (blocking commits),
in the same process. Prints, per save (medians), the time the Trainer spends saving
(``Trainer._save_checkpoint``) and the bytes the save puts on disk: the ``checkpoint-N/``
folder, plus for the callback what the commit added to the store. The weights file the
Trainer writes on its own (``model.safetensors``) is reported apart: the callback leaves it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import add_bench_model_options, batches, build_model, setup_single_process_env  # noqa: E402


def dir_bytes(path: Path, weights: bool) -> int:
    """Bytes of the files under ``path``: the model weights files only, or everything else."""
    return sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and (p.suffix == ".safetensors") == weights
    )


def run(work: Path, args, callback) -> dict:
    """One Trainer run; per save: seconds in _save_checkpoint, bytes of checkpoint-N, weights bytes."""
    import transformers

    model = build_model("llama", seed=0, num_layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    deepspeed = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"}  # fmt: skip
    training = transformers.TrainingArguments(
        output_dir=str(work), per_device_train_batch_size=2, max_steps=2 * args.saves, save_steps=2,
        logging_steps=100, deepspeed=deepspeed, bf16=True, use_cpu=True, report_to=[], seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    data = [
        {"input_ids": ids[0], "labels": ids[0]} for ids in batches(4 * args.saves, vocab=args.vocab, batch=1)
    ]
    trainer = transformers.Trainer(
        model=model, args=training, train_dataset=data, callbacks=[callback] if callback else []
    )
    seconds = []
    save = trainer._save_checkpoint

    def timed_save(*a, **k):
        started = time.perf_counter()
        save(*a, **k)
        seconds.append(time.perf_counter() - started)

    trainer._save_checkpoint = timed_save
    # on_save runs right after _save_checkpoint: the callback's commit is part of the save.
    handler = trainer.callback_handler.on_save

    def timed_on_save(*a, **k):
        started = time.perf_counter()
        result = handler(*a, **k)
        seconds[-1] += time.perf_counter() - started
        return result

    trainer.callback_handler.on_save = timed_on_save
    trainer.train()
    folders = [work / f"checkpoint-{2 * (i + 1)}" for i in range(args.saves)]
    return {
        "seconds": seconds,
        "folder_bytes": [dir_bytes(f, weights=False) for f in folders],
        "weights_bytes": [dir_bytes(f, weights=True) for f in folders],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=768, layers=8, vocab=16000, reps=1)
    parser.add_argument("--saves", type=int, default=3)
    args = parser.parse_args(argv)
    setup_single_process_env()
    import ckptstore
    from ckptstore.integrations.transformers import CkptStoreCallback

    with tempfile.TemporaryDirectory(prefix="ckptstore-bench-trainer-") as tmp:
        work = Path(tmp)
        own = run(work / "own", args, None)
        store = ckptstore.open(work / "store")
        ours = run(work / "ours", args, CkptStoreCallback(store))
        added = [row.bytes_added for row in store.log()]
    median = statistics.median
    own_bytes = median(own["folder_bytes"])
    ours_bytes = median(b + a for b, a in zip(ours["folder_bytes"], added, strict=True))
    print(f"Trainer saves, median of {args.saves} (save time includes the callback's commit):")
    print("| save | seconds | time ratio | bytes on disk | bytes ratio |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| Trainer's own (DeepSpeed files) | {median(own['seconds']):.2f} | 1.00x | {own_bytes / 1e6:.1f} MB | 1.000x |"
    )
    print(f"| with CkptStoreCallback (folder + store) | {median(ours['seconds']):.2f} | "
          f"{median(ours['seconds']) / median(own['seconds']):.2f}x | {ours_bytes / 1e6:.1f} MB | {ours_bytes / own_bytes:.3f}x |")  # fmt: skip
    print(f"| ... of which in checkpoint-N/ | | | {median(ours['folder_bytes']) / 1e6:.3f} MB | |")
    print(
        f"weights the Trainer writes on its own (model.safetensors, both runs): {median(own['weights_bytes']) / 1e6:.1f} MB"
    )
    print(f"store bytes added per save: {', '.join(f'{a / 1e6:.1f} MB' for a in added)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
