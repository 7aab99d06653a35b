"""DeepSpeed's Mixture-of-Experts layer (``deepspeed.moe.layer.MoE``): its experts in a step.

DeepSpeed keeps each expert of a MoE layer in a file of its own,
``layer_{L}_expert_{G}_mp_rank_{MP}_model_states.pt`` (L counts MoE layers in module order, G is
the expert's *global* index), drops experts from the model-states file's module, records the
number of experts per layer (``num_experts``) there, and at ZeRO 0 writes each expert-parallel
rank's optimizer state as ``expp_rank_{R}_mp_rank_{MP}_optim_states.pt`` (docs/moe.md).

A live engine names an expert by its *local* index on its expert-parallel rank; the store names
every expert tensor by its global index (the name in its expert file), so a step means the same
whatever the expert-parallel degree that committed it. This module finds the experts of an
engine at commit (``describe``) and answers, from the step's description, which keys are experts
and what the files are called.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import UnsupportedError, clip

# Where a native MoE layer keeps its experts, below the MoE module (DeepSpeed's own pattern).
EXPERTS_PATH = ".deepspeed_moe.experts.deepspeed_experts."
# DeepSpeed leaves the gate in the model-states file: its key holds "expert" in no other way.
_GATE = "moe.gate.wg.weight"


def expert_file_name(layer: int, expert: int, mp_rank: int = 0) -> str:
    """DeepSpeed's file of one expert of the ``layer``-th MoE layer, by global expert index."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def optimizer_file_name(ep_rank: int, mp_rank: int = 0) -> str:
    """DeepSpeed's ZeRO-0 optimizer file of one expert-parallel rank (no ``bf16_`` prefix)."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def _moe_class() -> type | None:
    try:
        from deepspeed.moe.layer import MoE
    except ImportError:
        return None
    return MoE


def _autoep_layer(engine: Any) -> str | None:
    for name, module in engine.module.named_modules():
        if type(module).__name__ == "AutoEPMoELayer":
            return name or "(the model itself)"
    return None


def describe(engine: Any, module_keys: list[str]) -> dict | None:
    """The experts of ``engine``'s MoE layers, for the step's description, or None for an engine
    without any: ``{"layers": [{"module", "num_experts", "experts"}], "ep_size"}``, where
    ``experts[G]`` lists the state-dict keys of global expert G in the module's order, named as
    its expert file names them. ``module_keys`` are the keys of the engine's module state dict.

    Raises UnsupportedError for layouts this version cannot store faithfully, naming the layer:
    AutoEP layers, expert parallelism above 1, and keys DeepSpeed would sweep into an expert
    file without an expert index."""
    if not getattr(engine, "has_moe_layers", False):
        return None
    autoep = _autoep_layer(engine)
    if autoep is not None:
        raise UnsupportedError(
            f"the model's AutoEP layer {clip(autoep, 120)} (DeepSpeed expert_parallel) is not supported; "
            "DeepSpeed's MoE layer (deepspeed.moe.layer.MoE) is"
        )
    moe_class = _moe_class()
    layers = []
    for name, module in engine.module.named_modules():
        if moe_class is None or not isinstance(module, moe_class):
            continue
        where = clip(name or "(the model itself)", 120)
        if module.ep_size != 1:
            raise UnsupportedError(
                f"the MoE layer {where} has expert parallelism {module.ep_size}; this version stores ep_size 1"
            )
        prefix = f"{name}." if name else ""
        experts: list[list[str]] = [[] for _ in range(module.num_experts)]
        for key in module_keys:
            if not key.startswith(prefix) or "expert" not in key or _GATE in key:
                continue
            found = re.match(rf"{re.escape(prefix.rstrip('.') + EXPERTS_PATH)}([0-9]+)\.", key)
            local = int(found.group(1)) if found else -1
            if not 0 <= local < module.num_local_experts:
                raise UnsupportedError(
                    f"the MoE layer {where} holds {clip(key, 160)}, which DeepSpeed would save with its experts "
                    "but which is no expert's"
                )
            experts[local].append(key)
        layers.append({"module": name, "num_experts": int(module.num_experts), "experts": experts})
    return {"layers": layers, "ep_size": 1}


def expert_keys(description: dict) -> set[str]:
    """Every key of the step's module state that lives in an expert file."""
    found = description.get("experts") or {"layers": []}
    return {key for layer in found["layers"] for keys in layer["experts"] for key in keys}
