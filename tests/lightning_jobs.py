"""A Lightning job on CPU: ModelParallelStrategy (FSDP2) over a tiny Llama, 2 torchrun ranks, gloo.

    python -m torch.distributed.run --nproc_per_node 2 --master_port P tests/lightning_jobs.py \\
        --steps 4 --save store:/tmp/store --result /tmp/r.json
    ... --steps 6 --resume store:/tmp/store:4 --result /tmp/r.json

``--save store:<uri>`` checkpoints through ``StoreModelParallelStrategy`` at the end of training
(step = global step); ``--save dir:<path>`` through Lightning's own ModelParallelStrategy.
``--resume store:<uri>:<step>`` / ``dir:<path>`` resumes from one. ``--csv DIR`` logs
through Lightning's CSVLogger into ``DIR/metrics.csv``. Rank 0 writes the losses of the
optimizer steps this job ran (its own rank's) to ``--result``. Several runs, their arguments
separated by ``+``, run one after another in the one job: each interpreter start costs seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


def main(argv: list[str]) -> None:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    parser.add_argument("--result")
    parser.add_argument("--csv", help="log through a CSVLogger into this folder")
    args = parser.parse_args(argv)
    torch.use_deterministic_algorithms(True)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            config = LlamaConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4,
            )  # fmt: skip
            config._attn_implementation = "eager"
            self.model = LlamaForCausalLM(config)
            self.losses: list[float] = []

        def configure_model(self) -> None:
            mesh = self.device_mesh["data_parallel"]
            for block in self.model.model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)

        def training_step(self, batch, index):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    spec = args.save or args.resume
    if spec.startswith("store:"):
        import ckptstore
        from ckptstore.integrations.lightning import StoreModelParallelStrategy

        uri = spec[len("store:") :]
        uri, _, step = uri.rpartition(":") if args.resume else (uri, "", "")
        strategy = StoreModelParallelStrategy(
            ckptstore.open(uri), data_parallel_size=2, tensor_parallel_size=1
        )
        ckpt_path = f"store:{step}" if args.resume else None
    else:
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
        ckpt_path = spec[len("dir:") :] if args.resume else None
    batches = [torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(i)) for i in range(64)]
    data = torch.utils.data.DataLoader(batches, batch_size=2, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=args.steps,
        logger=CSVLogger(args.csv, name="", version="") if args.csv else False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = Module()
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if args.save:
        trainer.save_checkpoint(spec[len("dir:") :] if spec.startswith("dir:") else "unused")
    if trainer.global_rank == 0 and args.result:
        Path(args.result).write_text(
            json.dumps({"losses": module.losses, "global_step": trainer.global_step})
        )


if __name__ == "__main__":
    run: list[str] = []
    for arg in [*sys.argv[1:], "+"]:
        if arg != "+":
            run.append(arg)
        elif run:
            main(run)
            run = []
