"""A checkpoint held in memory: built for one rank, loaded by DeepSpeed's own ``load_checkpoint``.

DeepSpeed decides what to read by file name (``latest``, globs of the tag folder) and reads
each file through ``engine.checkpoint_engine.load``. So a private folder of empty files with
the checkpoint's names, and a checkpoint engine that answers ``load`` from memory, let
``load_checkpoint`` run unchanged, every option included, without a byte of tensor data on
disk. A rank is handed only the files it reads (its own ZeRO partition and the model states);
with the optimizer state loaded, the module weights that are the fp32 masters cast down need
not be read at all: ``update_lp_params`` derives them from the masters and all-gathers them,
as the optimizer does after every step.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptError
from .fill import MODULE, Filler, TensorSource
from .write import Writer


@functools.cache
def _memory_engine_class() -> type:
    # Made once, at module level in effect: a class made per call would sit in a reference
    # cycle holding its files (a rank's whole share) until the next garbage collection.
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class MemoryCheckpointEngine(CheckpointEngine):
        """Answers ``load(path)`` with the object of the file of that name."""

        def __init__(self, files: dict[str, object | None]) -> None:
            super().__init__()
            self.name = "ckptstore-restore"
            self.files = files

        def create(self, info) -> None:
            raise RuntimeError("a restore in progress cannot save")

        def save(self, state_dict, path: str) -> None:
            raise RuntimeError("a restore in progress cannot save")

        def load(self, path: str, map_location=None) -> Any:
            obj = self.files.get(Path(path).name)
            if obj is None:
                raise CorruptError(
                    f"restore: DeepSpeed asked for {Path(path).name}, which this rank does not read"
                )
            return obj

        def commit(self, info) -> bool:
            return True

    return MemoryCheckpointEngine


def rank_files(
    description: dict,
    tensors: TensorSource,
    world_size: int,
    rank: int,
    *,
    skip_module_weights: bool,
    fp32_into: list[torch.Tensor] | None = None,
) -> dict[str, object | None]:
    """The checkpoint files ``rank`` of a job of ``world_size`` ranks reads, built in memory:
    file name -> its object with the stored tensors in it (``write.Writer``'s objects, filled
    in place), None for the files other ranks read. Only the elements of stored tensors those
    files hold are read from ``tensors``. ``skip_module_weights`` leaves the module weights
    that are fp32 masters cast down unread; ``fp32_into`` (the engine's fp32 partition per
    group, ZeRO 1/2) are filled in place of copies of them, so the load copies each onto itself."""
    into = {(g, rank): t for g, t in enumerate(fp32_into or [])}
    writer = Writer(description, tensors, world_size, into)
    files = writer.files()
    own = [obj for _, obj, reader in files if reader in (None, rank)]
    skip = (lambda segment: segment.kind == MODULE) if skip_module_weights else (lambda segment: False)
    Filler(writer.holes, tensors, writer.params).fill_in_memory(own, skip)
    return {name: obj if reader in (None, rank) else None for name, obj, reader in files}


def load_from_memory(
    engine: Any,
    load_checkpoint,
    files: dict[str, object | None],
    tag: str,
    *,
    derive_module_weights: bool,
    **options: Any,
) -> tuple[str | None, dict | None]:
    """``load_checkpoint`` (the engine's own, unwrapped) of a checkpoint whose files are
    ``files`` (name -> object, None for another rank's file), with ``options`` as
    ``load_checkpoint`` takes them; returns what it returns. ``derive_module_weights``: the
    module weights were left unread and are derived from the loaded fp32 masters."""
    with tempfile.TemporaryDirectory(prefix="ckptstore-restore-") as scratch:
        folder = Path(scratch) / tag
        folder.mkdir()
        for name in files:
            (folder / name).touch()
        (Path(scratch) / "latest").write_text(tag)
        own_engine = engine.checkpoint_engine
        engine.checkpoint_engine = _memory_engine_class()(files)
        try:
            path, client_state = load_checkpoint(scratch, tag=tag, **options)
        finally:
            engine.checkpoint_engine = own_engine
    if path is None:
        raise CorruptError("DeepSpeed found no checkpoint in what restore handed it")
    if derive_module_weights:
        engine.optimizer.update_lp_params()
    return path, client_state


def derives_module_weights(engine: Any, flavour: str, options: dict) -> bool:
    """Whether a load with ``options`` sets the module weights from the fp32 masters it loads
    (ZeRO 1 and 2 loading optimizer state from fp32 weights), so they need not be read."""
    from .layout import BF16_OPTIMIZER, ZERO12

    return (
        flavour in (ZERO12, BF16_OPTIMIZER)
        and options.get("load_optimizer_states", True)
        and not options.get("load_module_only", False)
        and engine.zero_load_from_fp32_weights()
        and hasattr(engine.optimizer, "update_lp_params")
    )


def fp32_partitions(engine: Any, flavour: str) -> list | None:
    """The engine's own fp32 partition of each group at ZeRO 1/2 (what a load copies the
    checkpoint's into), or None for other flavours."""
    from .layout import BF16_OPTIMIZER, ZERO12

    if flavour == ZERO12:
        return list(engine.optimizer.single_partition_of_fp32_groups)
    if flavour == BF16_OPTIMIZER:
        return list(engine.optimizer.fp32_groups_flat_partition)
    return None
