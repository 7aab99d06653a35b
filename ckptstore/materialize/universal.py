"""Materialize ``--universal``: what DeepSpeed's ``ds_to_universal`` writes for a step, from the store.

DeepSpeed's universal checkpoint (``deepspeed/checkpoint/ds_to_universal.py``) holds, under
``OUT/global_step<N>_universal/``, ``zero/<param name>/{fp32,exp_avg,exp_avg_sq}.pt`` (each
``{"param": the logical tensor, "cat_dim": 0}`` for a parameter no pattern of
``universal_checkpoint_info`` names), ``zero/<param name>/step.pt`` (its group's ``step``, as
the base optimizer keeps it), ``zero/optimizer_state.pt`` (the ZeRO optimizer's state without
its partitions, with the base optimizer's ``param_groups``) and a copy of the
``mp_rank_XX_model_states.pt`` files; ``OUT/latest_universal`` names the folder, which is what
``load_checkpoint`` with ``{"checkpoint": {"load_universal": true}}`` reads. The store keeps the
logical tensors already, so they are written straight from it, and the model-states file as
materialize writes it: no DeepSpeed directory is built on the way.

Reached so far: a ZeRO-1/2 step of one model-parallel rank (any data-parallel size) whose
``universal_checkpoint_info`` names no parameter pattern. Everything else is refused
(``UnsupportedError`` naming it) before anything is written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..catalog import Catalog
from ..deepspeed import parallel
from ..deepspeed.fill import Filler, TensorSource, stored_tensor
from ..deepspeed.layout import ZERO12
from ..deepspeed.stepfiles import StepWriter
from ..deepspeed.torchfile import save_skeleton
from ..errors import UnsupportedError
from ..model import FP32
from ..objects import ObjectStore
from . import outputs
from .directory import check_resumable, step_reader

LATEST = "latest_universal"
# The optimizer states ds_to_universal writes per parameter (besides ``step``), in its order.
STATES = (FP32, "exp_avg", "exp_avg_sq")
# What ds_to_universal leaves out of zero/optimizer_state.pt: the partitions themselves.
_SHARDED = ("base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups")


def tag_of(step: int) -> str:
    """The universal checkpoint folder of ``step``."""
    return f"global_step{step}_universal"


def materialize_universal(
    objects: ObjectStore, catalog: Catalog, step: int, out: str | os.PathLike | None, *, force: bool
) -> Path:
    """``Store.materialize(step, out, universal=True)``: ``out/latest_universal`` and
    ``out/global_step<step>_universal/``, built beside ``out`` and renamed into place.

    Raises UnsupportedError naming what this version cannot write as a universal checkpoint
    (nothing is written), and what ``Store.materialize`` raises otherwise.
    """
    check_resumable(catalog, step)
    description = json.loads(catalog.description(step))
    check_reachable(description, step)
    out = outputs.check_out(out, force=force, store_root=getattr(objects, "root", None), verb="materialize")
    tensors = step_reader(objects, catalog, step, description)
    with outputs.building(out, "materialize", step) as staging:
        write_universal(description, tensors, staging / tag_of(step))
        (staging / LATEST).write_text(tag_of(step))
    return out


def check_reachable(description: dict, step: int) -> None:
    """UnsupportedError unless a universal checkpoint of the step can be written here."""
    what = f"materialize --universal of step {step}"
    if description.get("flavour") != ZERO12 or description.get("zero_stage") not in (1, 2):
        raise UnsupportedError(
            f"{what}: only ZeRO-1/2 steps are written as universal checkpoints yet, not ZeRO "
            f"{description.get('zero_stage')} ({description.get('flavour')}); use ds_to_universal on "
            "its materialize"
        )
    if parallel.size(description) > 1 or description.get("model_parallel"):
        raise UnsupportedError(
            f"{what}: a step of a model-parallel engine (pipeline or tensor parallel) is not written "
            "as a universal checkpoint yet; use ds_to_universal on its materialize"
        )
    info = description.get("model_state", {}).get("universal_checkpoint_info") or {}
    patterns = sorted(key for key, value in info.items() if key.endswith("patterns") and value)
    if patterns:
        raise UnsupportedError(
            f"{what}: universal_checkpoint_info's {', '.join(patterns)} are not applied yet; use "
            "ds_to_universal on its materialize"
        )
    trainable = {name for group in description["groups"] for name in group["params"]}
    other = sorted(set(description["params"]) - trainable)
    if other or description.get("aliases"):
        raise UnsupportedError(
            f"{what}: frozen or tied parameters ({', '.join(other or sorted(description['aliases']))}) "
            "are not written as universal checkpoints yet"
        )


def write_universal(description: dict, tensors: TensorSource, folder: Path) -> None:
    """Write the universal checkpoint folder of a step ``check_reachable`` accepts."""
    writer = StepWriter(description, tensors, description["world_size"])
    rank = writer.writers[0]
    files = writer.files()
    osd = next(obj for name, obj, (_, dp) in files if name.endswith("_optim_states.pt") and dp == 0)
    osd = osd["optimizer_state_dict"]
    zero = folder / "zero"
    for g, group in enumerate(rank.d["groups"]):
        state = osd["base_optimizer_state"]["state"][g]
        for name in group["params"]:
            target = zero / name
            target.mkdir(parents=True)
            if "step" in state:
                torch.save(state["step"], target / "step.pt")
            for kind in STATES:
                # A clone: torch.save writes a view's whole storage, which may hold other tensors.
                param = stored_tensor(tensors, name, kind).reshape(rank.shape(name)).clone()
                torch.save({"cat_dim": 0, "param": param}, target / f"{kind}.pt")
    common = {key: value for key, value in osd.items() if key not in _SHARDED}
    common["param_groups"] = osd["base_optimizer_state"]["param_groups"]
    torch.save(common, zero / "optimizer_state.pt")
    # The model-states files, as ds_to_universal copies them: materialize's, filled on disk.
    models = [(folder / name, obj) for name, obj, _ in files if name.startswith("mp_rank_")]
    Filler(writer.holes, tensors, writer.params).fill(
        [(path, save_skeleton(obj, path)) for path, obj in models]
    )
