"""Which parameter, kind and layer a DCP state-dict item belongs to.

DCP flattens the state dict it saves: ``{"model": {"model.layers.1.mlp.up_proj.weight": w},
"optim": {"state": {"model.layers.1.mlp.up_proj.weight": {"exp_avg": m}}}}`` becomes the items
``model.model.layers.1.mlp.up_proj.weight`` and ``optim.state.model.layers.1.mlp.up_proj.weight.exp_avg``,
and its planner keeps each item's path of keys. From that path an item is named as the store
names a DeepSpeed tensor: the parameter (``model.layers.1.mlp.up_proj.weight``) and a kind
saying which of its tensors it is (``model.*``, ``optim.state.*.exp_avg``: the item's name with
the parameter's replaced by ``*``). Its layer is then the store's one rule (``layers.layer_of``).

Everything that is not a parameter's tensor (optimizer param groups, counters, a scheduler,
dataloader state, DCP's bytes items) belongs to the step's own ``STATE_LAYER``, which every
step saves and none inherits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..layers import layer_of

# The layer of everything that is not a parameter's tensor: saved by every step.
STATE_LAYER = "(state)"


@dataclass(frozen=True)
class ItemName:
    """Where one DCP item is stored: parameter (or item) name, kind, layer."""

    name: str
    kind: str
    layer: str


def parameter_of(path: Sequence[str | int]) -> str | None:
    """The parameter an item's key path belongs to, or None for anything else.

    ``(top, name)`` and ``(name,)`` are a model's parameters (or buffers); ``(top, "state",
    name, state)`` is an optimizer's state of one (torch's ``get_state_dict`` keys it by the
    parameter's name). A name is a module path: it has a dot.
    """
    keys = [str(key) for key in path]
    if len(keys) == 4 and keys[1] == "state":
        name = keys[2]
    elif len(keys) in (1, 2):
        name = keys[-1]
    else:
        return None
    return name if "." in name else None


def name_items(fqns: Sequence[str], paths: Mapping[str, Sequence[str | int]] | None) -> dict[str, ItemName]:
    """Every item (DCP's flattened name) -> where it is stored.

    ``paths``: the planner's item -> key path (``Metadata.planner_data``); without one an item
    is its own path. An optimizer state counts as a parameter's only if the state dict also
    holds that parameter, so a stray ``state`` key elsewhere is state, not a layer.
    """
    paths = paths or {}
    # Every item the planner knows of, not only these: whether a name is a parameter's is a
    # property of the whole state dict.
    candidates = {fqn: parameter_of(paths.get(fqn, (fqn,))) for fqn in dict.fromkeys([*fqns, *paths])}
    weights = {
        name for fqn, name in candidates.items() if name is not None and len(paths.get(fqn, (fqn,))) <= 2
    }
    named = {}
    for fqn in fqns:
        name = candidates[fqn]
        if name is not None and name in weights and name in fqn:
            named[fqn] = ItemName(name, fqn.replace(name, "*", 1), layer_of(name))
        else:
            named[fqn] = ItemName(fqn, "state", STATE_LAYER)
    return named
