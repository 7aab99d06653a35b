"""Compose specs: a YAML file saying which committed step each layer of a checkpoint comes from.

In the spirit of mergekit's ``slices``/``layer_range``::

    state: 400              # the step giving the non-tensor state (scheduler, counters,
                            # optimizer step, client state) and the auxiliary files
    slices:                 # numbered blocks: half-open ranges [start, end) covering every block once
      - layer_range: [0, 2]
        step: 300
      - layer_range: [2, 4]
        step: 400
    aux:                    # auxiliary layers (optional; those not named come from the state step)
      model.embed_tokens: 300

A step named here may itself be composite: a layer is taken from the step that saved it.
Materializing a spec reads exactly the blobs a plain step of the same layers would.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..catalog import Catalog
from ..errors import BadInputError, NotFoundError, require_int
from ..layers import block_index, block_of, is_block
from ..model import DCP_DOOR, front_door

Spec = str | os.PathLike | Mapping[str, Any]
_KEYS = ("state", "slices", "aux")


@dataclass(frozen=True)
class ComposePlan:
    """A checked spec: the state step, and every layer -> the step whose tensors it uses."""

    state: int
    sources: dict[str, int]


def step_or_spec(
    step: Any, spec: Spec | None, catalog: Catalog, verb: str
) -> tuple[int, dict[str, int] | None]:
    """What a reader was asked for: ``(step, None)``, or a spec's ``(state step, layer sources)``.

    BadInputError if both or neither are given, the step is not an integer >= 0, or it was
    saved through DCP (this reader is DeepSpeed's; NotFoundError if it does not exist)."""
    if spec is None:
        step = require_int(step, "a step", minimum=0)
        refuse_dcp_step(catalog, step, verb)
        return step, None
    if step is not None:
        raise BadInputError(f"{verb} takes a step or a compose spec, not both")
    plan_ = plan(spec, catalog)
    refuse_dcp_step(catalog, plan_.state, verb)
    return plan_.state, plan_.sources


def refuse_dcp_step(catalog: Catalog, step: int, verb: str) -> None:
    """BadInputError if ``step`` was saved through DCP, saying what reads it instead."""
    if front_door(catalog.description(step)) == DCP_DOOR:
        raise BadInputError(
            f"step {step} was saved through PyTorch DCP (StoreWriter), not from a DeepSpeed engine, so "
            f"{verb} cannot read it: load it with dcp.load(state, storage_reader=StoreReader(store, step={step}))"
        )


def load(spec: Spec) -> Mapping[str, Any]:
    """The spec as a mapping: given as one, or read from a YAML file. Raises BadInputError."""
    if isinstance(spec, Mapping):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise BadInputError(f"a compose spec is a YAML file or a mapping, not {type(spec).__name__}")
    path = Path(spec)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInputError(
            f"cannot read compose spec {path}: {getattr(exc, 'strerror', None) or exc}"
        ) from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise BadInputError(f"compose spec {path} is not valid YAML: {problem}{where}") from None
    if not isinstance(loaded, Mapping):
        raise BadInputError(f"compose spec {path} must be a mapping with keys {', '.join(_KEYS)}")
    return loaded


def _known_step(catalog: Catalog, value: Any, where: str) -> int:
    step = require_int(value, f"compose spec: {where}")
    try:
        catalog.description(step)
    except NotFoundError as exc:
        raise BadInputError(f"compose spec: {where}: {exc}") from None
    return step


def plan(spec: Spec, catalog: Catalog) -> ComposePlan:
    """Check ``spec`` against the catalog and resolve every layer to the step that saved it.

    Raises BadInputError, naming the offending entry, for unknown keys or steps, block ranges
    that overlap, leave blocks out or reach past the model, unknown auxiliary layers, and
    steps whose model differs from the state step's.
    """
    spec = load(spec)
    unknown = [str(key) for key in spec if key not in _KEYS]
    if unknown:
        raise BadInputError(f"compose spec: unknown key {', '.join(unknown)} (expected {', '.join(_KEYS)})")
    if "state" not in spec:
        raise BadInputError("compose spec: 'state' (the step giving the non-tensor state) is missing")
    state = _known_step(catalog, spec["state"], "state")
    layers = catalog.sources(state)
    # a block with Mixture-of-Experts layers is several layers: the block's and its experts'
    blocks: dict[int, list[str]] = {}
    for layer in layers:
        if is_block(layer):
            blocks.setdefault(block_index(layer), []).append(layer)
    if len({block_of(layer).rsplit(".", 1)[0] for members in blocks.values() for layer in members}) > 1:
        raise BadInputError(
            "compose spec: the model has more than one family of numbered blocks, so layer_range is ambiguous"
        )
    chosen: dict[str, int] = {}
    owner: dict[int, int] = {}
    slices = spec.get("slices")
    if not isinstance(slices, list) or not slices:
        raise BadInputError("compose spec: 'slices' must be a list of {layer_range: [start, end], step: N}")
    for i, entry in enumerate(slices):
        where = f"slices[{i}]"
        if not isinstance(entry, Mapping) or set(entry) != {"layer_range", "step"}:
            raise BadInputError(f"compose spec: {where} must have exactly the keys layer_range and step")
        bounds = entry["layer_range"]
        if not isinstance(bounds, list) or len(bounds) != 2:
            raise BadInputError(f"compose spec: {where}.layer_range must be [start, end], not {bounds!r}")
        start, end = (require_int(b, f"compose spec: {where}.layer_range") for b in bounds)
        step = _known_step(catalog, entry["step"], f"{where}.step")
        if not 0 <= start < end:
            raise BadInputError(f"compose spec: {where}.layer_range [{start}, {end}] is empty or negative")
        if end > max(blocks, default=-1) + 1 or any(b not in blocks for b in range(start, end)):
            raise BadInputError(
                f"compose spec: {where}.layer_range [{start}, {end}] is out of range: "
                f"the model has blocks {_ranges(sorted(blocks))} (ranges are half-open)"
            )
        for b in range(start, end):
            if b in owner:
                raise BadInputError(
                    f"compose spec: {where}.layer_range [{start}, {end}] overlaps slices[{owner[b]}] at block {b}"
                )
            owner[b] = i
            chosen.update((layer, step) for layer in blocks[b])
    missing = sorted(set(blocks) - set(owner))
    if missing:
        raise BadInputError(
            f"compose spec: block{'s' if len(missing) > 1 else ''} {_ranges(missing)} in no slice"
        )
    aux = spec.get("aux") or {}
    if not isinstance(aux, Mapping):
        raise BadInputError("compose spec: 'aux' must map auxiliary layer names to steps")
    aux_layers = [layer for layer in layers if not is_block(layer)]
    for layer, step in aux.items():
        if layer not in aux_layers:
            raise BadInputError(
                f"compose spec: aux: {layer} is not an auxiliary layer of the model "
                f"(its auxiliary layers are {', '.join(aux_layers)})"
            )
        chosen[layer] = _known_step(catalog, step, f"aux.{layer}")
    for layer in aux_layers:
        chosen.setdefault(layer, state)
    return ComposePlan(state, _resolve(catalog, state, layers, chosen))


def _resolve(
    catalog: Catalog, state: int, layers: Mapping[str, int], chosen: dict[str, int]
) -> dict[str, int]:
    params = json.loads(catalog.description(state))["params"]
    sources: dict[int, dict[str, int]] = {}
    for step in sorted(set(chosen.values()) - {state}):
        theirs = catalog.sources(step)
        if list(theirs) != list(layers) or json.loads(catalog.description(step))["params"] != params:
            raise BadInputError(
                f"compose spec: step {step} holds a different model than the state step {state} "
                "(other layers or parameter shapes); their layers cannot be combined"
            )
        sources[step] = theirs
    sources[state] = dict(layers)
    return {layer: sources[chosen[layer]][layer] for layer in layers}


def _ranges(numbers: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2, 5``."""
    parts, start = [], None
    for i, n in enumerate(numbers):
        if start is None:
            start = n
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            parts.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(parts)
