"""Export: a Hugging Face model folder (safetensors weights and config files) for a step.

Laid out as ``save_pretrained`` writes it: ``model.safetensors``, or past ``max_shard_size``
shards ``model-0000k-of-0000n.safetensors`` plus ``model.safetensors.index.json``, split by
huggingface_hub's own splitter; tied weights stored once under the name transformers keeps;
file metadata ``{"format": "pt"}``. The weights stream (``writer``): each tensor is read, cast
and written at its offset by one of a few threads, so memory holds a few tensors, never a shard. The
folder is built beside ``out`` and renamed into place, like a materialized checkpoint.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import split_state_dict_into_shards_factory

from .. import auxfiles, forked, knobs
from ..catalog import Catalog
from ..dcp import dcp_description
from ..dcp.weights import DcpStepWeights
from ..errors import BadInputError, clip, require_int
from ..materialize import compose, outputs
from ..model import BUFFER
from ..objects import ObjectStore
from ..progress import progress_bar
from .safetensors_file import tensor_bytes
from .weights import StepWeights, parse_dtype
from .writer import write_files

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "50GB"  # save_pretrained's default in transformers 5

# Files kept with a step that belong in a model folder (the Trainer keeps them in checkpoint-N/).
MODEL_FOLDER_FILES = (
    "config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json", "added_tokens.json",
    "vocab.*", "merges.txt", "spiece.model", "chat_template.*", "preprocessor_config.json", "processor_config.json",
)  # fmt: skip


@dataclass
class ExportReport:
    """What ``export`` wrote: the folder, its weight files, the files copied from the step."""

    path: Path
    step: int
    dtype: str
    tensors: int
    bytes: int
    weight_files: list[str]
    copied_files: list[str] = field(default_factory=list)

    @property
    def has_config(self) -> bool:
        """Whether the folder got a ``config.json`` (``from_pretrained`` needs one)."""
        return "config.json" in self.copied_files


def export(
    objects: ObjectStore,
    catalog: Catalog,
    step: int | None,
    out: str | os.PathLike,
    *,
    spec: compose.Spec | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
) -> ExportReport:
    """Write ``step``'s weights (or a compose ``spec``'s) as a model folder at ``out``.

    Contract as ``Store.export``; nothing appears at ``out`` unless everything was written.
    """
    max_shard_size = shard_size(max_shard_size)
    description = (
        None if spec is not None else dcp_description(catalog, require_int(step, "a step", minimum=0))
    )
    if description is not None:
        weights = DcpStepWeights(objects, catalog, step, description)
    else:
        weights = StepWeights(objects, catalog, step, spec)
    dtype = parse_dtype(dtype) or weights.training_dtype
    out = outputs.check_out(out, force=force, store_root=getattr(objects, "root", None), verb="export")
    files = catalog.files(weights.step)
    auxfiles.check_rows(files, weights.step)  # all of them: a refused row means a tampered store
    files = [row for row in files if _belongs_in_model_folder(row.path)]

    # Buffers are small and their shapes are known only once read: read them first.
    buffers = {w.name: weights.read(w, dtype) for w in weights.entries if w.kind == BUFFER}
    layout = {
        w.name: (tuple(buffers[w.name].shape), buffers[w.name].dtype)
        if w.kind == BUFFER
        else (w.shape, dtype)
        for w in weights.entries
    }
    split = _split(layout, max_shard_size)
    by_name = {w.name: w for w in weights.entries}

    with outputs.building(out, "export", weights.step) as staging:
        staging.mkdir()
        bar = progress_bar(range(len(weights.entries)), desc="export", unit="tensor")
        shards = {
            staging / filename: {n: layout[n] for n in names}
            for filename, names in split.filename_to_tensors.items()
        }
        # Reads from a local store are mapped: CPU work, like decoding. More threads than the
        # cores and one fetching ahead would only wait for a core and switch (the bench model's
        # bf16 export: 0.21 s of CPU with 8 threads, 0.18 s with 3); knobs.export_threads caps it.
        # Where the platform forks, a process per core instead, as many as pay for their fork:
        # threads of one process hand the GIL to each other between their short decoding calls.
        threads, processes = knobs.io_threads(), 1
        if objects.reads_are_local:
            threads = min(threads, knobs.cpu_threads() + 1, knobs.export_threads())
            most = min(knobs.cpu_threads(), knobs.export_threads())
            processes = forked.worth_running(split.metadata["total_size"], most)
        write_files(shards, {"format": "pt"}, by_name, weights, dtype, buffers, bar, threads, processes)
        if split.is_sharded:
            params = sum(math.prod(w.shape) for w in weights.entries if w.kind != BUFFER)
            index = {
                "metadata": {"total_parameters": params, **split.metadata},
                "weight_map": split.tensor_to_filename,
            }
            (staging / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        auxfiles.copy_out(objects, files, staging, weights.step)
    return ExportReport(
        path=out, step=weights.step, dtype=str(dtype).removeprefix("torch."), tensors=len(layout),
        bytes=split.metadata["total_size"], weight_files=list(split.filename_to_tensors),
        copied_files=sorted(row.path for row in files),
    )  # fmt: skip


# huggingface_hub's units (``parse_size_to_int``): decimal, as save_pretrained reads them.
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}


def shard_size(size: object) -> int:
    """``max_shard_size`` in bytes: an integer, or a size ``save_pretrained`` takes (``"2GB"``,
    ``"500MB"``: decimal KB, MB, GB, TB), from 1 byte to 1 PiB; BadInputError otherwise (a
    negative size would write a file per tensor, an infinite one overflow)."""
    wrong = BadInputError(
        f"max shard size {clip(repr(size), 40)} is not a size like 2GB or 500MB (1 byte to 1 PiB)"
    )
    if isinstance(size, str):
        text = size.strip()
        unit = _SIZE_UNITS.get(text[-2:].upper())
        try:
            number = float(text[:-2]) if unit else math.nan
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or not 0 < number * unit <= knobs.MAX_BYTES:
            raise wrong
        size = int(number * unit)
    if isinstance(size, bool) or not isinstance(size, int) or not 0 < size <= knobs.MAX_BYTES:
        raise wrong
    return size


def _split(layout: dict, max_shard_size: int):
    """Which tensors go in which file, as ``save_pretrained`` splits them."""
    return split_state_dict_into_shards_factory(
        layout,
        get_storage_size=lambda spec: tensor_bytes(*spec),
        filename_pattern=WEIGHTS_NAME.replace(".safetensors", "{suffix}.safetensors"),
        max_shard_size=max_shard_size,
    )


def _belongs_in_model_folder(path: str) -> bool:
    return "/" not in path and any(fnmatch.fnmatch(path, pattern) for pattern in MODEL_FOLDER_FILES)
