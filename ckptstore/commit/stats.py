"""Update statistics: how far each layer's fp32 master weights moved since the step that saved it.

Every commit takes a small deterministic sample of every parameter: at most
``knobs.sample_size()`` elements (256) at fixed *global* flat positions, one in each of that
many equal strata of the flattened tensor, at a pseudo-random offset inside its stratum (a
plain stride would hit one column of a matrix whose row length divides it). Each rank samples
the positions its own fragments hold, so ranks contribute disjoint runs of one sample and need
nothing but the commit's gather. The sample of the fp32 master is taken (or of the stored
weight for parameters without one, such as frozen ones).

A layer's *update* at a commit is the relative change of its parameters since the step that
last saved it, estimated from the samples::

    sqrt(sum_p (n_p / k_p) * sum_i (w_pi - v_pi)^2) / sqrt(sum_p (n_p / k_p) * sum_i v_pi^2)

(``w`` now, ``v`` at that step, ``n_p`` elements of which ``k_p`` are sampled): the estimate of
``||w - v|| / ||v||`` over the whole layer. It costs ``k_p`` gathered elements per parameter, no
pass over the tensors and no read of old blobs: the samples of the steps that saved a layer
live in the catalog. None means "not measurable" (no earlier save, a changed shape, or an
all-zero layer).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Protocol

import numpy as np
import torch

from .. import knobs
from ..layers import layer_of
from ..model import FP32, WEIGHT, Piece

# A rank's share of the samples: parameter name -> [(index of its first sample, float32 bytes)].
RankSamples = dict[str, list[tuple[int, bytes]]]

_SPREAD = 2654435761  # Knuth's multiplicative hash constant: offsets inside strata look random


class SampleSource(Protocol):
    """Where the samples of earlier steps are read from (the catalog)."""

    def samples(self, step: int, names: Iterable[str]) -> dict[str, bytes]:
        """Recorded float32 sample bytes of ``names`` at ``step`` (names without one are left out)."""


def sample_positions(numel: int, count: int | None = None) -> torch.Tensor:
    """Ascending global flat positions sampled from a tensor of ``numel`` elements."""
    count = min(knobs.sample_size() if count is None else count, numel)
    index = torch.arange(count, dtype=torch.int64)
    low = index * numel // count
    width = (index + 1) * numel // count - low  # >= 1: strata tile [0, numel)
    return low + (index * _SPREAD) % width


def own_samples(pieces: Iterable[Piece], params: Mapping[str, dict]) -> RankSamples:
    """The calling rank's part of every parameter's sample, from its extracted pieces."""
    pieces = [p for p in pieces if p.name in params and p.kind in (FP32, WEIGHT)]
    with_master = {p.name for p in pieces if p.kind == FP32}
    found: RankSamples = defaultdict(list)
    for piece in pieces:
        if piece.kind == WEIGHT and piece.name in with_master:
            continue  # the module weight is the master cast down: sample the master
        positions = sample_positions(math.prod(params[piece.name]["shape"]))
        start, numel = piece.start, piece.tensor.numel()
        first = int(torch.searchsorted(positions, start))
        end = int(torch.searchsorted(positions, start + numel))
        if first == end:
            continue
        flat = piece.tensor.detach().reshape(-1)
        values = flat[(positions[first:end] - start).to(flat.device)].to(torch.float32).cpu()
        found[piece.name].append((first, values.numpy().tobytes()))
    return dict(found)


def merge(shares: Iterable[RankSamples], params: Mapping[str, dict]) -> dict[str, bytes]:
    """Every rank's parts joined into one float32 sample per parameter (incomplete ones dropped)."""
    parts: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    for share in shares:
        for name, runs in share.items():
            parts[name].extend(runs)
    merged = {}
    for name, runs in parts.items():
        expected = min(knobs.sample_size(), math.prod(params[name]["shape"]))
        runs.sort()
        covered, chunks = 0, []
        for first, data in runs:
            if first != covered:
                break
            chunks.append(data)
            covered += len(data) // 4
        if covered == expected:
            merged[name] = b"".join(chunks)
    return merged


def relative_change(
    names: Iterable[str], now: Mapping[str, bytes], before: Mapping[str, bytes], params: Mapping[str, dict]
) -> float | None:
    """Estimated ``||w - v|| / ||v||`` over the parameters ``names`` (see the module docstring)."""
    moved = size = 0.0
    names = list(names)
    if not names:
        return None
    for name in names:
        if name not in now or name not in before or len(now[name]) != len(before[name]):
            return None
        current = np.frombuffer(now[name], dtype=np.float32).astype(np.float64)
        previous = np.frombuffer(before[name], dtype=np.float32).astype(np.float64)
        weight = math.prod(params[name]["shape"]) / len(current)
        moved += weight * float(np.square(current - previous).sum())
        size += weight * float(np.square(previous).sum())
    if size == 0.0:
        return 0.0 if moved == 0.0 else None
    if not math.isfinite(moved) or not math.isfinite(size):
        return None
    return math.sqrt(moved / size)


def layer_updates(
    layers: Iterable[str],
    previous_sources: Mapping[str, int],
    params: Mapping[str, dict],
    samples: Mapping[str, bytes],
    recorded: SampleSource,
) -> dict[str, tuple[int | None, float | None]]:
    """Every layer -> (the step it is compared with, its update), from this commit's samples.

    ``previous_sources`` maps each layer to the step that last saved it (empty for a first
    commit); the samples recorded at those steps come from ``recorded``.
    """
    by_layer: dict[str, list[str]] = defaultdict(list)
    for name in params:
        by_layer[layer_of(name)].append(name)
    wanted: dict[int, list[str]] = defaultdict(list)
    for layer in layers:
        if layer in previous_sources:
            wanted[previous_sources[layer]].extend(by_layer[layer])
    before = {source: recorded.samples(source, names) for source, names in wanted.items()}
    updates: dict[str, tuple[int | None, float | None]] = {}
    for layer in layers:
        since = previous_sources.get(layer)
        if since is None:
            updates[layer] = (None, None)
        else:
            updates[layer] = (since, relative_change(by_layer[layer], samples, before[since], params))
    return updates
