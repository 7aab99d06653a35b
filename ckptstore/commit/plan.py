"""Which layers a commit saves: may the step be committed, what can it inherit, what is chosen.

Everything a commit reads from the catalog before storing anything is read here: whether the
step number is free, the previous step (its layers, model and world size, which decide
whether layers may be inherited from it), the store's history and the recorded samples the
update statistics compare with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from .. import fused_experts, strategies
from ..catalog import Catalog
from ..errors import BadInputError, ConflictError
from ..layers import ordered_layers
from ..model import DCP_DOOR, Updates, front_door
from . import stats


@dataclass
class CommitPlan:
    """What a commit of ``step`` saves and where each of its layers comes from."""

    step: int
    layers: list[str]  # every layer of the model, in model order
    layer_sources: dict[str, int]  # layer -> this step (saved) or the step it inherits from
    updates: Updates  # every layer's update since its last save
    previous: int | None  # the newest step before this one

    @property
    def saved(self) -> list[str]:
        """The layers this commit stores, in model order."""
        return [layer for layer, source in self.layer_sources.items() if source == self.step]


def check_new_step(catalog: Catalog, step: int) -> None:
    """ConflictError unless ``step`` can be committed: not committed, and not a dropped step
    whose tensors a later step still uses."""
    if catalog.has_step(step):
        raise ConflictError(f"step {step} is already committed")
    user = catalog.inheritor_of(step)
    if user is not None:
        # The dropped step's tensors still serve step `user`; a new step under the same
        # number would have to replace them.
        raise ConflictError(
            f"step {step} was dropped, but step {user} still uses layers it saved; commit under another step number"
        )


def plan_commit(
    catalog: Catalog, step: int, description: dict, samples: dict[str, bytes], selection: strategies.Selection
) -> CommitPlan:
    """Measure every layer's update, let ``selection`` choose the layers to save, and plan the rest.

    ``selection`` = None saves every layer; a list saves those layers; a Strategy or callable
    chooses from the store's history and the update statistics. Layers not saved are inherited
    from the previous step. A store's first commit, and the first after the model or world
    size changed, must save every layer (BadInputError otherwise, as for unknown layers); so
    must a commit through a local tier whose previous step this node has not read (only the
    store behind the tier has it, and a commit does not ask it: ``CommitPlan.previous`` None).
    """
    layers = ordered_layers(fused_experts.piece_keys(description))
    previous = catalog.latest_step(before=step)
    if previous is not None and _out_of_reach(catalog, previous):
        return _plan_full(catalog, step, layers, description, samples, selection, previous)
    sources = catalog.sources(previous) if previous is not None else {}
    same_layers = list(sources) == layers
    if not same_layers:
        sources = {}  # another model: nothing to compare with, nothing to inherit
    params = fused_experts.piece_params(description["params"])  # as samples name them
    updates = stats.layer_updates(layers, sources, params, samples, catalog)
    refusal = _inheritance_refusal(catalog, step, previous, same_layers, description)
    if refusal is not None:
        sources = {}
    context = strategies.CommitContext(
        step=step,
        layers=tuple(layers),
        steps=tuple(s for s in catalog.steps() if s < step),
        sources=sources,
        updates={layer: update for layer, (_, update) in updates.items()},
    )
    saved = select_layers(layers, strategies.resolve(selection, context), refusal)
    layer_sources = {layer: step if layer in saved else sources[layer] for layer in layers}
    return CommitPlan(step, layers, layer_sources, updates, previous)


def _out_of_reach(catalog: Catalog, step: int) -> bool:
    """Whether ``step`` is listed but cannot be imported here now: its manifest is only in the
    store behind a local tier (``ObjectStore.local_only``). A step gone or unreadable is not."""
    catalog.load([step])
    return not catalog.is_recorded(step) and step not in catalog.unreadable and catalog.has_step(step)


def _plan_full(
    catalog: Catalog,
    step: int,
    layers: list[str],
    description: dict,
    samples: dict[str, bytes],
    selection: strategies.Selection,
    previous: int,
) -> CommitPlan:
    """The plan of a commit that saves every layer because ``previous`` is out of reach."""
    refusal = (
        f"step {previous}, the one before step {step}, is not in this node's local tier or catalog, "
        "and a commit through a local tier does not ask the store behind it, so layers cannot be "
        f"inherited from it: commit every layer (layers=None), or let this node read step {previous} "
        "first while the store can be reached (restore from it, or call sources(step) on the store)"
    )
    params = fused_experts.piece_params(description["params"])  # as samples name them
    updates = stats.layer_updates(layers, {}, params, samples, catalog)
    context = strategies.CommitContext(
        step=step,
        layers=tuple(layers),
        steps=tuple(s for s in catalog.steps() if s < step),
        sources={},
        updates={layer: update for layer, (_, update) in updates.items()},
    )
    select_layers(layers, strategies.resolve(selection, context), refusal)
    return CommitPlan(step, layers, dict.fromkeys(layers, step), updates, None)


def select_layers(layers: list[str], wanted: Iterable[str] | None, refusal: str | None) -> set[str]:
    """The layers to save: every one for None, else ``wanted`` after checking its names.

    ``refusal`` says why this commit must save every layer (None when it may inherit)."""
    if wanted is None:
        return set(layers)
    if isinstance(wanted, str):
        raise BadInputError("layers= takes a list of layer names, not a single string")
    wanted = list(dict.fromkeys(wanted))
    unknown = [layer for layer in wanted if layer not in layers]
    if unknown:
        raise BadInputError(
            f"unknown layer{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"the model's layers are {', '.join(layers)}"
        )
    if len(wanted) < len(layers) and refusal is not None:
        raise BadInputError(refusal)
    return set(wanted)


def _inheritance_refusal(
    catalog: Catalog, step: int, previous: int | None, same_layers: bool, description: dict
) -> str | None:
    """Why ``step`` cannot inherit layers from ``previous`` (None when it can)."""
    if previous is None:
        return f"step {step} would be the store's first step, so it must save every layer (layers=None)"
    if catalog.is_weights_only(previous):
        return (
            f"step {previous} keeps only its weights (gc made it weights-only), so layers cannot be "
            "inherited from it; commit every layer (layers=None)"
        )
    before = json.loads(catalog.description(previous))
    if front_door(before) == DCP_DOOR:
        return (
            f"step {previous} was saved through PyTorch DCP; a DeepSpeed step cannot inherit its layers: "
            "commit every layer (layers=None)"
        )
    same_params = before["params"] == description["params"]
    if not (same_layers and same_params and before["world_size"] == description["world_size"]):
        return (
            f"the model or world size changed since step {previous}, so layers cannot be "
            "inherited from it; commit every layer (layers=None)"
        )
    return None
