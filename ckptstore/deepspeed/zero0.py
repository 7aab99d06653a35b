"""The optimizer state of a ZeRO-0 checkpoint, laid out for the flavour that saved it: torch's
own (fp32), ``FP16_UnfusedOptimizer``'s (an fp32 master per parameter) or ``FP16_Optimizer``'s
(one flat fp32 master per group). It goes inside the one model-states file, from placeholders
``write.Writer`` fills with the stored tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..model import FP32
from .layout import BASIC, FP16_OPTIMIZER, FP16_UNFUSED

# A placeholder for a stored tensor: (name, kind) -> it in its own shape, or names -> their flat concatenation.
Stored = Callable[[str, str], torch.Tensor]
Flat = Callable[[list[str], str], torch.Tensor]


def optimizer_state(flavour: str, description: dict, stored: Stored, flat: Flat) -> dict:
    """The ``optimizer`` entry of a ZeRO-0 step's model states (``description``: the step's)."""
    if flavour == BASIC:
        return _torch_optimizer(description, stored)
    if flavour == FP16_UNFUSED:
        optimizer = dict(description["optimizer_state"])
        optimizer["optimizer_state_dict"] = _torch_optimizer(description, stored)
        optimizer["fp32_groups"] = [
            [stored(name, FP32) for name in group["params"]] for group in description["groups"]
        ]
        return optimizer
    if flavour == FP16_OPTIMIZER:
        return _fp16_optimizer(description, flat)
    raise ValueError(f"{flavour} is not a ZeRO-0 flavour")


def _torch_optimizer(description: dict, stored: Stored) -> dict:
    state, param_groups, index = {}, [], 0
    for group in description["groups"]:
        ids = []
        for name in group["params"]:
            ids.append(index)
            if name in group["param_state"]:
                entry = group["param_state"][name]
                state[index] = {**entry["scalars"], **{k: stored(name, k) for k in entry["kinds"]}}
            index += 1
        param_groups.append({**group["hyper"], "params": ids})
    return {"state": state, "param_groups": param_groups}


def _fp16_optimizer(description: dict, flat: Flat) -> dict:
    state, param_groups, flats = {}, [], []
    for g, group in enumerate(description["groups"]):
        names = group["params"]
        flats.append(flat(names, FP32))
        state[g] = {**group["scalars"], **{k: flat(names, k) for k in group["state_kinds"]}}
        param_groups.append({**group["hyper"], "params": [g]})
    optimizer = dict(description["optimizer_state"])
    optimizer["optimizer_state_dict"] = {"state": state, "param_groups": param_groups}
    optimizer["fp32_groups_flat"] = flats
    return optimizer
