"""A step's files across its model-parallel ranks, and its checkpoint directory.

``write.Writer`` lays out the files of one model-parallel rank (a pipeline stage); a step of
an engine without model parallelism has one. ``StepWriter`` runs one per rank over shared
placeholders, for a materialize (``write_checkpoint``: every file, filled on disk) or a
restore (``load.RankShare``: one rank's files, filled in memory).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .. import pathnames
from . import parallel
from .fill import Filler, Placeholders, TensorSource
from .torchfile import save_skeleton
from .write import Writer


class StepWriter:
    """Builds the files of a step for one data-parallel world size: a ``Writer`` for each
    model-parallel rank in ``mp_ranks`` (default: every one), sharing their placeholders."""

    def __init__(
        self,
        description: dict,
        tensors: TensorSource,
        world_size: int,
        into: dict[tuple, torch.Tensor] | None = None,
        mp_ranks: list[int] | None = None,
    ) -> None:
        self.mp_size = parallel.size(description)
        self.holes = Placeholders()
        self._tensors = tensors
        self.writers = [
            Writer(parallel.rank_description(description, m), tensors, world_size, into, self.holes)
            for m in (range(self.mp_size) if mp_ranks is None else mp_ranks)
        ]
        self.params = {name: info for writer in self.writers for name, info in writer.params.items()}
        self.stage = self.writers[0].stage

    def files(self) -> list[tuple[str, object, tuple[int, int | None]]]:
        """Every file: its name, its object and who reads it, ``(model-parallel rank,
        data-parallel rank)`` (None: every data-parallel rank of that model-parallel rank)."""
        return [(name, obj, (w.mp_rank, reader)) for w in self.writers for name, obj, reader in w.files()]

    def write(self, tag_dir: Path) -> list[Path]:
        files = [
            (pathnames.join(tag_dir, name, "a file of the step", flat=True), obj)
            for name, obj, _ in self.files()
        ]
        tag_dir.mkdir(parents=True, exist_ok=True)
        for path, _ in files:
            pathnames.new_file(path, "a file of the step")
        filler = Filler(self.holes, self._tensors, self.params)
        filler.fill([(path, save_skeleton(obj, path)) for path, obj in files])
        return [path for path, _ in files]


def write_checkpoint(
    description: dict, tensors: TensorSource, out_dir: Path, tag: str, world_size: int | None = None
) -> list[Path]:
    """Write ``out_dir/<tag>/`` files and ``out_dir/latest`` for one step; returns the files written.

    ``tensors`` supplies stored tensors (see ``TensorSource``), each read once, from several
    threads, or, read from local files, forked worker processes where that pays
    (``Filler.fill``). ``world_size`` defaults to the committed one. ``latest`` is written
    last, so a directory without it is never a usable checkpoint. Raises CorruptError if a needed tensor
    is missing and UnsupportedError for layouts this version cannot write.
    """
    writer = StepWriter(description, tensors, world_size or description["world_size"])
    written = writer.write(out_dir / tag)
    if writer.stage > 0:
        _copy_recovery_scripts(out_dir)
    (out_dir / "latest").write_text(tag)
    return written


def _copy_recovery_scripts(out_dir: Path) -> None:
    # DeepSpeed puts its offline converters next to ZeRO checkpoints; users expect them there.
    try:
        import deepspeed.utils as ds_utils
    except ImportError:
        return
    for script in ("zero_to_fp32.py", "zero_to_torch.py"):
        source = Path(ds_utils.__file__).with_name(script)
        if source.exists():
            shutil.copyfile(source, out_dir / script)
