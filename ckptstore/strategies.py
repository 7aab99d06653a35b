"""Which layers a commit saves: strategies over the store's history and the update statistics.

``store.commit(engine, step, layers=...)`` takes ``None`` (every layer), a list of layer names,
a ``Strategy``, or a callable ``(layer, context) -> bool``. A strategy sees a ``CommitContext``:
the model's layers, the committed steps before this one, the step that last saved each layer,
and each layer's update since then (``ckptstore.stats``). Everything in it comes from the
catalog and from samples gathered from every rank, so every rank of a job makes the same
choice. The first commit of a store (or the first after the model or world size changed)
always saves every layer, whatever the strategy says.

    Parity()                                # odd blocks, then even blocks, alternating; aux layers every time
    Filter(first=2, last=2, every=4)        # the edge blocks (and aux layers) every time, the rest every 4th commit
    UpdateMagnitude(threshold=1e-3, max_age=5)  # layers that moved, and none left unsaved for 5 commits
"""

from __future__ import annotations

import abc
import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from .errors import BadInputError, require_int
from .layers import block_index, is_block


@dataclass(frozen=True)
class CommitContext:
    """What a strategy knows when a commit chooses its layers.

    ``sources`` maps every layer to the step that last saved it (empty when nothing can be
    inherited: the commit saves everything). ``updates`` maps every layer to its relative
    change since then, or None where it cannot be measured.
    """

    step: int
    layers: tuple[str, ...]
    steps: tuple[int, ...]
    sources: Mapping[str, int]
    updates: Mapping[str, float | None]

    @property
    def first(self) -> bool:
        """Whether this commit must save every layer (nothing to inherit from)."""
        return not self.sources

    @property
    def blocks(self) -> tuple[str, ...]:
        """The numbered blocks (``model.layers.7``) and the experts in them, in model order."""
        return tuple(layer for layer in self.layers if is_block(layer))

    @property
    def aux(self) -> tuple[str, ...]:
        """The auxiliary layers (embeddings, final norm, head), in model order."""
        return tuple(layer for layer in self.layers if not is_block(layer))

    def age(self, layer: str) -> int:
        """Commits since ``layer`` was last saved, this one included (1: saved by the previous commit)."""
        if layer not in self.sources:
            return len(self.steps) + 1
        return len(self.steps) - bisect.bisect_right(self.steps, self.sources[layer]) + 1


class Strategy(abc.ABC):
    """Chooses the layers one commit saves; the others are inherited from earlier steps."""

    @abc.abstractmethod
    def select(self, context: CommitContext) -> Iterable[str]:
        """The layers to save now (names from ``context.layers``)."""


@dataclass(frozen=True)
class Parity(Strategy):
    """Odd-numbered blocks at one commit, even-numbered at the next; auxiliary layers every time.

    The half saved is the one saved longer ago (odd first after a full commit), so the choice
    follows the store's history rather than a counter, and any two commits in a row together
    hold every block.
    """

    def select(self, context: CommitContext) -> list[str]:
        odd = [layer for layer in context.blocks if block_index(layer) % 2 == 1]
        even = [layer for layer in context.blocks if block_index(layer) % 2 == 0]

        def oldest(half: list[str]) -> float:
            return min((context.sources[layer] for layer in half), default=float("inf"))

        half = odd if oldest(odd) <= oldest(even) else even
        return [layer for layer in context.layers if layer in half or not is_block(layer)]


@dataclass(frozen=True)
class Filter(Strategy):
    """The ``first`` and ``last`` blocks and the auxiliary layers at every commit; the others
    once every ``every`` commits (when their last save is ``every`` commits old)."""

    first: int = 2
    last: int = 2
    every: int = 4

    def __post_init__(self) -> None:
        for name in ("first", "last", "every"):
            require_int(getattr(self, name), f"Filter({name}=...)", minimum=1 if name == "every" else 0)

    def select(self, context: CommitContext) -> list[str]:
        numbers = list(
            dict.fromkeys(block_index(layer) for layer in context.blocks)
        )  # experts with their block
        edge_numbers = set(numbers[: self.first]) | set(
            numbers[len(numbers) - self.last :] if self.last else ()
        )
        edges = {layer for layer in context.blocks if block_index(layer) in edge_numbers}
        return [
            layer
            for layer in context.layers
            if not is_block(layer) or layer in edges or context.age(layer) >= self.every
        ]


@dataclass(frozen=True)
class UpdateMagnitude(Strategy):
    """Layers whose relative update since their last save exceeds ``threshold``, plus any
    whose update cannot be measured, plus (with ``max_age``) any whose last save is
    ``max_age`` commits old: no layer goes unsaved for ``max_age`` commits in a row."""

    threshold: float = 1e-3
    max_age: int | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.threshold, bool)
            or not isinstance(self.threshold, (int, float))
            or self.threshold < 0
        ):
            raise BadInputError(f"UpdateMagnitude(threshold=...) takes a number >= 0, not {self.threshold!r}")
        if self.max_age is not None:
            require_int(self.max_age, "UpdateMagnitude(max_age=...)", minimum=1)

    def select(self, context: CommitContext) -> list[str]:
        chosen = []
        for layer in context.layers:
            update = context.updates.get(layer)
            stale = self.max_age is not None and context.age(layer) >= self.max_age
            if update is None or update > self.threshold or stale:
                chosen.append(layer)
        return chosen


Selection = Iterable[str] | Strategy | Callable[[str, CommitContext], bool] | None


def resolve(selection: Selection, context: CommitContext) -> Iterable[str] | None:
    """The layer names (None: every layer) that ``selection`` picks for this commit.

    Lists are returned as they are, for the caller to validate; strategies and callables are
    asked only when there is something to inherit.
    """
    if isinstance(selection, Strategy):
        return None if context.first else list(selection.select(context))
    if callable(selection):
        return None if context.first else [layer for layer in context.layers if selection(layer, context)]
    return selection
