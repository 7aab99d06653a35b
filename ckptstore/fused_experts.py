"""Experts fused into one tensor, stored as a piece per expert.

Hugging Face MoE models (transformers 5: Mixtral, Qwen3-MoE, gpt-oss, ...) keep all experts of a
layer in fused parameters of an ``experts`` module, ``model.layers.3.mlp.experts.gate_up_proj``
of shape [experts, 2 x intermediate, hidden], expert ``e`` the slice ``[e]`` along dimension 0.
Stored as one tensor, no expert could be saved, inherited, deduplicated or measured on its own.
So a step describes such a parameter at its fused shape, with its experts as a split along
dimension 0 in ``tensorsplit``'s vocabulary (``"experts": {"dim": 0, "sizes": [1, 1, ...]}``),
and stores expert ``e``'s slice under its own name, ``model.layers.3.mlp.experts.5.gate_up_proj``
(its shape the slice's, its elements numbered from the slice's start). Each expert is then a
layer (``layers.layer_of``: ``model.layers.3.mlp.experts.5``), like DeepSpeed's own experts.

Writers and engines see the fused parameter whole: ``ExpertJoin`` serves it from its experts'
pieces to every read, as a ``TensorSource``. The split's flat order is the fused tensor's own
(``tensorsplit.in_logical_order``), so a fragment ``[lo, hi)`` of the fused tensor is the
experts' pieces it overlaps, one after another.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .errors import CorruptError
from .model import Piece

# A parameter description's key for its experts' split along dimension 0.
EXPERTS = "experts"
# The name of the module that holds fused experts (``MixtralExperts`` at ``...mlp.experts``); its
# ``num_experts`` says how many. Its sibling the router (``mlp.gate``) has as many rows but is
# one tensor every expert shares.
_MODULE = "experts"


@dataclass(frozen=True)
class ExpertSlice:
    """Expert ``index``'s slice of a fused parameter: stored as ``name``, elements
    ``[offset, offset + numel)`` of the fused tensor, of ``shape``."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


def expert_name(fused: str, index: int) -> str:
    """The name expert ``index``'s piece of the fused parameter ``fused`` is stored under."""
    module, _, leaf = fused.rpartition(".")
    return f"{module}.{index}.{leaf}"


def find(module: torch.nn.Module, params: dict[str, dict]) -> dict[str, int]:
    """The fused expert parameters of ``module`` among ``params`` (a step description's, by
    state-dict name): name -> number of experts. A parameter is one when it belongs directly to
    a module named ``experts`` with an integer ``num_experts`` of at least 2, and its (described:
    ZeRO 3 leaves live ones empty) first dimension is that number."""
    found = {}
    for path, owner in module.named_modules():
        count = getattr(owner, "num_experts", None)
        if path.rpartition(".")[2] != _MODULE or type(count) is not int or count < 2:
            continue
        for leaf, _ in owner.named_parameters(recurse=False):
            name = f"{path}.{leaf}"
            shape = params.get(name, {}).get("shape")
            if shape and shape[0] == count and "split" not in params[name]:
                found[name] = count
    return found


def mark(params: dict[str, dict], found: dict[str, int]) -> None:
    """Describe each of ``found``'s parameters (name -> experts) as split into its experts."""
    for name, count in found.items():
        params[name][EXPERTS] = {"dim": 0, "sizes": [1] * count}


def slices(name: str, info: dict) -> list[ExpertSlice]:
    """Every expert's slice of the fused parameter ``name`` (``info``: its description entry)."""
    shape = list(info["shape"])
    row = math.prod(shape[1:])
    out, offset = [], 0
    for index, rows in enumerate(info[EXPERTS]["sizes"]):
        out.append(ExpertSlice(expert_name(name, index), offset, rows * row, (rows, *shape[1:])))
        offset += rows * row
    return out


def fused(params: dict[str, dict]) -> dict[str, list[ExpertSlice]]:
    """The fused expert parameters of a description's ``params``, each with its experts' slices."""
    return {name: slices(name, info) for name, info in params.items() if EXPERTS in info}


def piece_params(params: dict[str, dict]) -> dict[str, dict]:
    """``params`` as pieces name them: each fused parameter replaced by its experts' slices (at
    the slice's shape, its dtype and trainability), in its place."""
    out: dict[str, dict] = {}
    for name, info in params.items():
        if EXPERTS not in info:
            out[name] = info
            continue
        for part in slices(name, info):
            out[part.name] = {
                "shape": list(part.shape),
                "dtype": info["dtype"],
                "trainable": info["trainable"],
            }
    return out


def piece_keys(description: dict) -> Iterator[str]:
    """The module's state-dict keys (aliases left out) as pieces name them: the layers of a
    step are these keys' layers."""
    params = description["params"]
    for key, role in description["module_keys"]:
        if role == "alias":
            continue
        if EXPERTS in params.get(key, {}):
            yield from (part.name for part in slices(key, params[key]))
        else:
            yield key


def _overlapping(parts: list[ExpertSlice], lo: int, hi: int) -> Iterator[tuple[ExpertSlice, int, int]]:
    """Each slice that elements ``[lo, hi)`` of the fused tensor overlap, with the overlap in
    the slice's own numbering."""
    first = bisect.bisect_right(parts, lo, key=lambda part: part.offset) - 1
    for part in parts[max(first, 0) :]:
        if part.offset >= hi:
            break
        a, b = max(lo, part.offset), min(hi, part.offset + part.numel)
        if b > a:
            yield part, a - part.offset, b - part.offset


def cut(pieces: Iterable[Piece], params: dict[str, dict]) -> list[Piece]:
    """``pieces`` with those of fused expert parameters cut at expert boundaries and renamed
    (``expert_name``), each numbered from its expert's start; the others as they are."""
    by_name = fused(params)
    out = []
    for piece in pieces:
        parts = by_name.get(piece.name)
        if parts is None:
            out.append(piece)
            continue
        flat = piece.tensor.reshape(-1)
        master = None if piece.unless_equal_to is None else piece.unless_equal_to.reshape(-1)
        for part, a, b in _overlapping(parts, piece.start, piece.start + flat.numel()):
            at = part.offset + a - piece.start  # where the overlap starts in the piece
            extra = {} if master is None else {"unless_equal_to": master[at : at + b - a]}
            out.append(Piece.cut(part.name, piece.kind, a, flat[at : at + b - a], part.shape, **extra))
    return out


class ExpertJoin:
    """A ``TensorSource`` (``source``: a step's reader, ``params``: its description's) that
    serves each fused expert parameter from its experts' pieces, whole or in any range, and
    passes every other name through."""

    def __init__(self, source: Any, params: dict[str, dict]) -> None:
        self._source = source
        self._fused = fused(params)
        self._shapes = {name: params[name]["shape"] for name in self._fused}

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._source, attribute)

    def _joined(self, name: str, kind: str, parts: list[tuple[ExpertSlice, Any]]) -> list[Any] | None:
        """The parts' reads, None where none of them is stored; CorruptError where only some are
        (every expert of a fused parameter is stored with it)."""
        missing = [part.name for part, read in parts if read is None]
        if len(missing) == len(parts):
            return None
        if missing:
            raise CorruptError(
                f"step {getattr(self._source, 'step', '?')}: {kind} of {missing[0]} is not stored, "
                f"though other experts' of {name} are"
            )
        return [read for _, read in parts]

    def _spans(self, spans: Iterable[tuple[str, str, int, int]]) -> Iterator[tuple[str, str, int, int]]:
        for name, kind, lo, hi in spans:
            if name not in self._fused:
                yield name, kind, lo, hi
                continue
            for part, a, b in _overlapping(self._fused[name], lo, hi):
                yield part.name, kind, a, b

    def plan(self, spans: Iterable[tuple[str, str, int, int]]) -> None:
        plan = getattr(self._source, "plan", None)
        if plan is not None:
            plan(list(self._spans(spans)))

    def objects(self, spans: Iterable[tuple[str, str, int, int]]) -> dict[str, int]:
        return self._source.objects(list(self._spans(spans)))

    def dtype(self, name: str, kind: str) -> torch.dtype | None:
        if name not in self._fused:
            return self._source.dtype(name, kind)
        dtypes = (self._source.dtype(part.name, kind) for part in self._fused[name])
        return next((dtype for dtype in dtypes if dtype is not None), None)

    def __call__(self, name: str, kind: str) -> torch.Tensor | None:
        if name not in self._fused:
            return self._source(name, kind)
        reads = self._joined(
            name, kind, [(part, self._source(part.name, kind)) for part in self._fused[name]]
        )
        if reads is None:
            return None
        return torch.cat([read.reshape(-1) for read in reads]).view(self._shapes[name])

    def span(self, name: str, kind: str, lo: int, hi: int) -> torch.Tensor | None:
        if name not in self._fused:
            return self._source.span(name, kind, lo, hi)
        if hi <= lo:
            return torch.empty(0, dtype=self.dtype(name, kind))
        overlaps = _overlapping(self._fused[name], lo, hi)
        parts = [(part, self._source.span(part.name, kind, a, b)) for part, a, b in overlaps]
        reads = self._joined(name, kind, parts)
        if reads is None:
            return None
        return reads[0] if len(reads) == 1 else torch.cat([read.reshape(-1) for read in reads])

    def fragments(self, name: str, kind: str) -> list[tuple[int, torch.Tensor]]:
        if name not in self._fused:
            return self._source.fragments(name, kind)
        return [
            (part.offset + start, tensor)
            for part in self._fused[name]
            for start, tensor in self._source.fragments(part.name, kind)
        ]

    def pieces(self, name: str, kind: str) -> list[tuple[int, int]] | None:
        if name not in self._fused:
            return self._source.pieces(name, kind)
        found = [(part, self._source.pieces(part.name, kind)) for part in self._fused[name]]
        if any(pieces is None for _, pieces in found):
            return None
        return [(part.offset + start, numel) for part, pieces in found for start, numel in pieces]

    def _within(self, name: str, start: int, numel: int) -> ExpertSlice | None:
        """The one expert's slice that holds elements ``[start, start + numel)`` of ``name``."""
        parts = list(_overlapping(self._fused[name], start, start + numel))
        return parts[0][0] if len(parts) == 1 and parts[0][2] - parts[0][1] == numel else None

    def read_into(self, name: str, kind: str, start: int, out: torch.Tensor) -> bool:
        if name not in self._fused:
            read_into = getattr(self._source, "read_into", None)
            return read_into is not None and read_into(name, kind, start, out)
        part = self._within(name, start, out.numel())
        read_into = getattr(self._source, "read_into", None)
        return (
            part is not None
            and read_into is not None
            and read_into(part.name, kind, start - part.offset, out)
        )

    def read_pieces(
        self, name: str, kind: str, start: int, numel: int, dtype: torch.dtype
    ) -> Iterator[tuple[int, torch.Tensor]]:
        if name not in self._fused:
            yield from self._source.read_pieces(name, kind, start, numel, dtype)
            return
        part = self._within(name, start, numel)
        if part is None:
            raise CorruptError(
                f"{name} {kind} has no one stored fragment of elements {start} to {start + numel}"
            )
        for first, piece in self._source.read_pieces(part.name, kind, start - part.offset, numel, dtype):
            yield part.offset + first, piece
