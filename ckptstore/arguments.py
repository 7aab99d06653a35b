"""What the ``Store``'s verbs accept, checked before any work: steps, ``layers=``, an open store."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

from . import errors, strategies
from .errors import BadInputError, require_int

#: The largest step: the catalog keeps steps as SQLite's signed 64-bit integers.
MAX_STEP = 2**63 - 1


def check_step(step: Any) -> int:
    """``step`` if it is an integer in 0..MAX_STEP; BadInputError naming it otherwise."""
    return require_int(step, "a step", minimum=0, maximum=MAX_STEP)


def while_open(method):
    """``method``, raising BadInputError once the store is closed (its catalog is released)."""

    @functools.wraps(method)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise BadInputError(f"the store {self.objects.uri} was closed; open it again")
        return method(self, *args, **kwargs)

    return checked


def check_layers(layers: Any) -> strategies.Selection:
    """``commit(layers=...)`` as a list of names, a strategy, a callable or None; BadInputError
    for anything else (a string, names that are not strings)."""
    if layers is None or isinstance(layers, strategies.Strategy) or callable(layers):
        return layers
    if isinstance(layers, str | bytes):
        raise BadInputError("layers= takes a list of layer names, not a single string")
    if not isinstance(layers, Iterable):
        raise BadInputError(
            "layers= takes a list of layer names, a strategy or a callable, not "
            f"{errors.clip(repr(layers), 60)}"
        )
    names = list(layers)
    wrong = [name for name in names if not isinstance(name, str)]
    if wrong:
        raise BadInputError(f"layers= takes layer names (strings), not {errors.clip(repr(wrong[0]), 60)}")
    return names
