"""Hugging Face Trainer jobs with CkptStoreCallback that end through a normal interpreter exit, run
by tests/test_trainer.py (issue 37 item 19: an abort at exit, "terminate called without an
active exception", seen beside another CPU-heavy job):

    python tests/exit_worker.py ROOT MODE[,MODE...]   # one job per MODE: blocking or background

Imports once, then forks one child per job (ZeRO-2, bf16, one rank, three saves into a store),
with a child spinning on the CPU beside each; every job child leaves through ``sys.exit(0)``:
interpreter finalization and the C++ exit handlers run as at the end of a training script.
Forking after the imports (no OpenMP used yet, so the children's thread pools start fresh)
saves an interpreter start per job. Prints one JSON line: each job's exit code (-6 is the abort)
and the steps its store holds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import transformers  # noqa: E402

from ckptstore.integrations.transformers import CkptStoreCallback  # noqa: E402
from tools.engines import batches, build_model, free_port  # noqa: E402


def job(root: Path, blocking: bool) -> None:
    """The Trainer saving every 2 of 6 steps into the store at ``root/store``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")  # fmt: skip
    deepspeed = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                 "zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"}  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(root / "run"), per_device_train_batch_size=2, max_steps=6, save_steps=2,
        logging_steps=100, deepspeed=deepspeed, bf16=True, use_cpu=True, report_to=[], seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )  # fmt: skip
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in batches(12, batch=1)]
    callback = CkptStoreCallback(str(root / "store"), blocking=blocking)
    model = build_model("llama", seed=0, num_layers=2, hidden=32, vocab=128)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    globals()["_trainer"] = trainer  # alive until finalization, as a script's module global is


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def forked(run) -> int:
    """Run ``run()`` in a child whose output goes to /dev/null; returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        run()
        sys.exit(0)  # the normal way out: finalization and exit handlers run
    return pid


def main() -> None:
    root, modes = Path(sys.argv[1]), sys.argv[2].split(",")
    codes, steps = [], []
    for i, mode in enumerate(modes):
        work = root / f"job{i}"
        work.mkdir(parents=True)
        spinner = forked(lambda: spin(120))
        pid = forked(lambda work=work, blocking=mode == "blocking": job(work, blocking))
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        os.kill(spinner, 9)
        os.waitpid(spinner, 0)
    import ckptstore  # opened only now: the parent starts no thread before a fork

    for i in range(len(modes)):
        with ckptstore.open(root / f"job{i}" / "store", create=False) as store:
            steps.append(store.steps())
    print(json.dumps({"codes": codes, "steps": steps}))


if __name__ == "__main__":
    main()
