"""A step read into an engine split otherwise than the one that committed it (resharding).

A step's tensors are stored per logical parameter, under the model's own names, whatever the
split, so an engine of another split (another number of pipeline stages) is filled from them
by name. The files that engine reads hold its own layout (its optimizer groups, its layer
files, its model-parallel rank) with the step's tensors, counters, hyperparameters and
non-tensor state: ``recut`` makes that description from the step's and the engine's own
(``extract``). It is what DeepSpeed's universal checkpoint (``ds_to_universal``, then
``load_universal``) gives, without the offline second copy: another number of pipeline
stages, another tensor-parallel degree, or both (Megatron-DeepSpeed's 3D).

A tensor-parallel parameter split along another dimension than its first, or fused from
sub-parameters each split on its own, is stored in an order that depends on its split
(``tensorsplit``); where the engine splits it otherwise, ``Relayout`` serves the step's
tensors in the engine's order. A vocabulary padded for the step's degree
(``original_vocab_size`` rows, then padding) is served padded for the engine's, as
``load_universal`` pads it: zeros past ``original_vocab_size``.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import tensorsplit
from ..errors import BadInputError, UnsupportedError
from ..format.codec import DTYPES
from ..model import FP32, WEIGHT
from . import parallel, universal_info
from .fill import TensorSource

# Model-state keys that say how the engine reading the files is split: the reader's own.
_SPLIT_KEYS = ("mp_world_size", "checkpoint_parallel_dimensions")


def split_info(stored: dict) -> dict:
    """The client state that tells ``extract`` how an engine's parameters are split, from the
    step's own (a Megatron client's ``universal_checkpoint_info`` names its parameters by
    pattern, whatever the degree); empty where the step has none."""
    info = parallel.stored_universal_info(stored)
    return {} if info is None else {universal_info.UNIVERSAL_INFO: info}


def recut(stored: dict, target: dict, what: str) -> dict:
    """``stored`` (a step's description) re-cut for the engine ``target`` describes (its own
    rank's part, as ``extract`` gives it): ``target``'s layout and split, the step's state.

    BadInputError, naming ``what``, if the engine holds a parameter the step does not, or one
    of another shape than a vocabulary padded otherwise (the caller has checked that both use
    the same optimizer); UnsupportedError, naming the parameter, for a vocabulary padded
    otherwise whose padding the step does not say."""
    missing = [name for name in target["params"] if name not in stored["params"]]
    if missing:
        raise BadInputError(f"{what} has no parameter {missing[0]} of this engine ({len(missing)} missing)")
    for name, info in target["params"].items():
        _check_shape(name, stored["params"][name], info, what)
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


def _check_shape(name: str, stored: dict, target: dict, what: str) -> None:
    """BadInputError unless the engine's ``name`` (``target``) has the step's shape, or is the
    same vocabulary padded for another tensor-parallel degree (both with the same
    ``original_vocab_size``); UnsupportedError for a padded vocabulary whose rows that are no
    padding the step does not say."""
    was, now = (
        tensorsplit.logical_shape(stored),
        tensorsplit.logical_shape(target),
    )  # an averaged one's: a copy's
    if now == was:
        return
    rows = stored.get(universal_info.ORIGINAL_VOCAB)
    if now[1:] == was[1:] and universal_info.ORIGINAL_VOCAB in target:
        if rows is None:
            raise UnsupportedError(
                f"{what} holds {name} with {was[0]} rows, this engine {now[0]}: "
                "the step does not say which rows are padding (universal_checkpoint_info's original_vocab_size)"
            )
        if rows == target[universal_info.ORIGINAL_VOCAB] <= now[0]:
            return  # repadded as load_universal pads it: zeros past original_vocab_size
    raise BadInputError(f"{what} holds {name} of shape {was}, this engine {now}")


def repadded(stored: dict, target: dict) -> bool:
    """Whether a parameter (``stored``, ``target``: its description entries) is a vocabulary
    with padding in the step or in the engine. In another layout its padding rows are zeros,
    even at the same padded size: ``ds_to_universal`` drops the rows the step's training moved
    (their moments above all), and ``load_universal`` pads with zeros."""
    rows = stored.get(universal_info.ORIGINAL_VOCAB)
    return rows is not None and max(stored["shape"][0], target["shape"][0]) > rows


def repad(logical: torch.Tensor, stored: dict, target: dict) -> torch.Tensor:
    """The step's logical vocabulary tensor at the engine's padded rows: its first
    ``original_vocab_size`` rows, then zeros, as DeepSpeed's ``load_universal`` pads the
    padding-free tensor ``ds_to_universal`` wrote (every kind: weights, masters, moments)."""
    rows = stored[universal_info.ORIGINAL_VOCAB]
    out = logical.new_zeros(target["shape"])
    out[:rows] = logical[:rows]
    return out


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


class Relayout:
    """The step's tensors (``source``, in the flat order of the step's split, ``stored``'s
    parameters) in the order of another split (``target``'s parameters, a vocabulary at its
    padded rows): a ``TensorSource`` that reads each parameter it reorders or repads whole,
    and passes every other one through."""

    def __init__(self, source: TensorSource, stored: dict[str, dict], target: dict[str, dict]) -> None:
        self._source = source
        self._stored, self._target = stored, target
        self.reordered = {
            name for name, info in target.items()
            if name in stored and (
                not tensorsplit.same_order(stored[name], info) or repadded(stored[name], info)
                # an averaged one's copies: their mean on every rank in any other layout, as
                # ds_to_universal + load_universal give it
                or tensorsplit.averaged(stored[name])
            )
        }  # fmt: skip

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._source, attribute)  # read_into, pieces, ...: for the others

    def _whole(self, name: str, kind: str) -> torch.Tensor | None:
        stored = self._source(name, kind)
        return None if stored is None else self._relaid(name, stored)

    def _relaid(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        """A whole tensor of ``name`` in the step's flat order, in the engine's (its
        vocabulary repadded where the two pad it otherwise)."""
        stored_info, target_info = self._stored[name], self._target[name]
        logical = tensorsplit.to_logical(stored, stored_info)
        if repadded(stored_info, target_info):
            logical = repad(logical, stored_info, target_info)
        return tensorsplit.from_logical(logical, target_info)

    def __call__(self, name: str, kind: str) -> torch.Tensor | None:
        if name not in self.reordered:
            return self._source(name, kind)
        whole = self._whole(name, kind)
        return None if whole is None else whole.view(self._target[name]["shape"])

    def span(self, name: str, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        if name not in self.reordered:
            return self._source.span(name, kind, lo, hi)
        whole = self._whole(name, kind)
        return None if whole is None else whole[lo:hi]

    def fragments(self, name: str, kind: str) -> list[tuple[int, torch.Tensor]]:
        if name not in self.reordered:
            return self._source.fragments(name, kind)
        fragments = self._source.fragments(name, kind)
        if not fragments:
            return []
        if kind != WEIGHT:
            return [(0, self._whole(name, kind))]
        dtype = DTYPES[self._stored[name]["dtype"]]
        if tensorsplit.averaged(self._stored[name]):
            # the copies' fp32 mean cast down, as load_universal sets a weight from its master
            return [(0, self._relaid(name, self._source(name, FP32)).to(dtype))]
        # Module weights are stored only where they are not the fp32 master cast down: the
        # whole weight is that cast, overlaid with them, before it is reordered.
        weight = self._source(name, FP32).reshape(-1).to(dtype)
        for start, fragment in fragments:
            weight[start : start + fragment.numel()] = fragment.reshape(-1)
        return [(0, self._relaid(name, weight))]

    def read_into(self, name: str, kind: str, start: int, out: torch.Tensor) -> bool:
        if name in self.reordered:
            return False
        read_into = getattr(self._source, "read_into", None)
        return read_into is not None and read_into(name, kind, start, out)

    def objects(self, spans: list[tuple[str, str, int, int]]) -> dict[str, int]:
        """``StepReader.objects``: a parameter it reorders is read whole."""
        return self._source.objects(
            [(name, kind, 0, 1 << 62) if name in self.reordered else (name, kind, lo, hi)
             for name, kind, lo, hi in spans]
        )  # fmt: skip

    def plan(self, spans: list[tuple[str, str, int, int]]) -> None:
        plan = getattr(self._source, "plan", None)
        if plan is not None:
            plan([span for span in spans if span[0] not in self.reordered])
