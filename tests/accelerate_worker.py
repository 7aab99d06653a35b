"""One accelerate "job" per process (accelerate keeps one DeepSpeed state per process), run by
tests/test_trainer.py:

    python tests/accelerate_worker.py save ROOT          # train 3 steps, save_state twice
    python tests/accelerate_worker.py load-own ROOT      # load_state of accelerate's own files
    python tests/accelerate_worker.py load-store ROOT    # load_state through an attached store

Prints one JSON line: the losses of the steps after a load (or the store's steps after save).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import batches, build_model, setup_single_process_env  # noqa: E402


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    setup_single_process_env()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    import ckptstore
    from ckptstore.integrations.deepspeed import attach

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}  # fmt: skip
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    model = build_model("llama", seed=0 if mode == "save" else 1, num_layers=2, hidden=32, vocab=128)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    data = batches(5)

    def steps(batch_list):
        losses = []
        for ids in batch_list:
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    if mode == "save":
        steps(data[:3])
        accelerator.save_state(str(root / "own"))  # accelerate's own files, the reference
        store = ckptstore.open(root / "store")
        attach(model, store)  # accelerate.prepare returns the DeepSpeed engine
        accelerator.save_state(str(root / "state"))
        print(
            json.dumps({"steps": store.steps(), "pt": len(list((root / "state").rglob("*optim_states.pt")))})
        )
    else:
        if mode == "load-store":
            attach(model, ckptstore.open(root / "store"))
        accelerator.load_state(str(root / ("own" if mode == "load-own" else "state")))
        print(json.dumps({"losses": steps(data[3:])}))
    sys.stdout.flush()
    os._exit(0)  # DeepSpeed on CPU may abort in atexit handlers after the work is done


if __name__ == "__main__":
    main()
