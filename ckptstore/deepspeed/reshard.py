"""A step read into an engine split otherwise than the one that committed it (resharding).

A step's tensors are stored per logical parameter, under the model's own names, whatever the
split, so an engine of another split (another number of pipeline stages) is filled from them
by name. The files that engine reads hold its own layout (its optimizer groups, its layer
files, its model-parallel rank) with the step's tensors, counters, hyperparameters and
non-tensor state: ``recut`` makes that description from the step's and the engine's own
(``extract``). It is what DeepSpeed's universal checkpoint (``ds_to_universal``, then
``load_universal``) gives, without the offline second copy.
"""

from __future__ import annotations

from ..errors import BadInputError
from . import parallel

# Model-state keys that say how the engine reading the files is split: the reader's own.
_SPLIT_KEYS = ("mp_world_size", "checkpoint_parallel_dimensions")


def recut(stored: dict, target: dict, what: str) -> dict:
    """``stored`` (a step's description) re-cut for the engine ``target`` describes (its own
    rank's part, as ``extract`` gives it): ``target``'s layout and split, the step's state.

    BadInputError, naming ``what``, if the engine holds a parameter the step does not, or one
    of another shape (the caller has checked that both use the same optimizer)."""
    missing = [name for name in target["params"] if name not in stored["params"]]
    if missing:
        raise BadInputError(f"{what} has no parameter {missing[0]} of this engine ({len(missing)} missing)")
    for name, info in target["params"].items():
        if info["shape"] != stored["params"][name]["shape"]:
            raise BadInputError(
                f"{what} holds {name} of shape {stored['params'][name]['shape']}, this engine {info['shape']}"
            )
    parts = [parallel.rank_description(stored, m) for m in range(parallel.size(stored))]
    groups = {name: group for part in parts for group in part["groups"] for name in group["params"]}
    recut = dict(target)
    recut["groups"] = [_group(group, groups) for group in target["groups"]]
    recut["model_state"] = dict(parts[0]["model_state"])
    recut["model_state"].update(
        (key, target["model_state"][key]) for key in _SPLIT_KEYS if key in target["model_state"]
    )
    recut["optimizer_state"] = parts[0]["optimizer_state"]
    return recut


def _group(group: dict, stored_groups: dict[str, dict]) -> dict:
    """An optimizer group of the engine with the step's hyperparameters and counters (those of
    the step's group that held its first parameter; every group steps together)."""
    if not group["params"]:
        return group
    source = stored_groups[group["params"][0]]
    recut = dict(group, hyper=source["hyper"])
    for key in ("scalars", "state_kinds"):  # a new engine may not have stepped yet
        if key in group:
            recut[key] = source[key]
    if "param_state" in group:  # ZeRO 0: per parameter, as torch keeps it
        recut["param_state"] = {
            name: stored_groups[name]["param_state"][name]
            for name in group["params"]
            if name in stored_groups[name]["param_state"]
        }
    return recut
