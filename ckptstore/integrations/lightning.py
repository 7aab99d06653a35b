"""Lightning's ModelParallelStrategy (FSDP2, tensor parallelism) checkpointing into a store.

    strategy = StoreModelParallelStrategy(ckptstore.open("s3://ckpts/run7"), data_parallel_size=2)
    trainer = L.Trainer(strategy=strategy, ...)
    trainer.fit(module)
    trainer.save_checkpoint("anything")        # step trainer.global_step of the store
    trainer.fit(module, ckpt_path="store:400")  # or "store:latest"

Lightning's strategy saves through ``dcp.save(state, checkpoint_id=path)`` itself, with no hook
for a storage writer, so this subclass overrides its ``save_checkpoint``/``load_checkpoint``
with the same state through ``StoreWriter``/``StoreReader``: the module's and each optimizer's
sharded state dicts (layers named as the LightningModule names its parameters:
``model.model.layers.1`` for a Llama in ``self.model``), and the
rest of Lightning's checkpoint (loops, callbacks, hyperparameters, what its ``meta.pt`` holds)
as one DCP bytes item, which DCP serializes on save and deserializes on load as it does any
user object. The store step is the trainer's global step; the path Lightning passes is not used.

After each save, rank 0 sends the commit's figures (``integrations.figures``: bytes stored,
layers saved, seconds the save held training) to the trainer's loggers with ``log_metrics`` at
the saved step, so TensorBoard, CSV or W&B show them beside the loss. Not with ``self.log``:
a save runs outside the LightningModule hooks where that is allowed (``trainer.save_checkpoint``
after ``fit``, or ``ModelCheckpoint`` from its callback hooks).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ..errors import BadInputError
from .dcp import StoreReader, StoreWriter
from .figures import scalars

PREFIX = "store:"
_META = "lightning"  # the key of the rest of Lightning's checkpoint in the saved state


def store_step(path: str | os.PathLike) -> int | None:
    """The step a ``ckpt_path`` names: ``store:<step>``, or None for ``store:latest``."""
    text = os.fspath(path)
    if not text.startswith(PREFIX):
        raise BadInputError(f"a store checkpoint is named store:<step> or store:latest, not {text!r}")
    step = text[len(PREFIX) :]
    if step == "latest":
        return None
    if not step.isdigit():
        raise BadInputError(f"{text!r}: the step after store: is a number or latest")
    return int(step)


class StoreModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` whose checkpoints are steps of ``store`` (see the module doc).
    Other arguments are ModelParallelStrategy's."""

    def __init__(self, store: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.store = store

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as step ``checkpoint["global_step"]`` (every rank calls it)."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options")
        checkpoint = dict(checkpoint)
        state: dict[str, Any] = {"state_dict": checkpoint.pop("state_dict")}
        for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
            state[f"optimizer_{index}"] = optimizer_state
        # A tuple is one leaf to DCP: the rest stays one item, whatever its nesting.
        state[_META] = (checkpoint,)
        step = int(checkpoint["global_step"])
        started = time.perf_counter()
        dcp.save(state, storage_writer=StoreWriter(self.store, step=step))
        self._log_figures(step, time.perf_counter() - started)

    def _log_figures(self, step: int, waited: float) -> None:
        """Send the figures of the commit of ``step`` to the trainer's loggers (rank 0)."""
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None)  # module.trainer raises while detached
        if trainer is None or not trainer.loggers or self.global_rank != 0:
            return
        row = next((row for row in self.store.log() if row.step == step), None)
        if row is None:
            return
        figures = scalars(step, row.bytes_added, row.layers_saved, waited)
        for logger in trainer.loggers:
            logger.log_metrics(figures, step=step)
            logger.save()  # a save after fit() comes after the loggers' last write

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load ``store:<step>`` (or ``store:latest``) into the module and optimizers, as
        Lightning's own load does; returns the rest of the checkpoint for the trainer."""
        step = store_step(checkpoint_path)
        reader = StoreReader(self.store, step)  # one for every load below: it parses the step once
        module = self.model
        module_state = {"state_dict": get_model_state_dict(module)}
        dcp.load(module_state, storage_reader=reader)
        module.load_state_dict(module_state["state_dict"], strict=self.lightning_module.strict_loading)
        options = StateDictOptions(cpu_offload=True)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(module, optimizer)}
            dcp.load(optimizer_state, storage_reader=reader)
            set_optimizer_state_dict(
                module, optimizer, optim_state_dict=optimizer_state[key], options=options
            )
        rest: dict[str, Any] = {_META: (None,)}
        dcp.load(rest, storage_reader=reader)
        return rest[_META][0]
