"""What the ``Store``'s verbs accept, checked before any work: steps, ``layers=``, an open store."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping
from typing import Any

from . import errors, strategies
from .errors import BadInputError, require_int
from .model import WAIT, WHEN_BUSY

#: The largest step: the catalog keeps steps as SQLite's signed 64-bit integers.
MAX_STEP = 2**63 - 1


def check_step(step: Any) -> int:
    """``step`` if it is an integer in 0..MAX_STEP; BadInputError naming it otherwise."""
    return require_int(step, "a step", minimum=0, maximum=MAX_STEP)


def check_path(path: Any, what: str) -> str:
    """``path`` (a string or os.PathLike naming a string) as a string; BadInputError naming
    ``what`` otherwise."""
    if not isinstance(path, str | os.PathLike) or not isinstance(os.fspath(path), str):
        raise BadInputError(f"{what} must be a path (a string or os.PathLike), not {type(path).__name__}")
    return os.fspath(path)


def check_count(value: Any, what: str, *, minimum: int) -> int | None:
    """``value`` if None or an integer from ``minimum`` to MAX_STEP (a count or period of
    steps); BadInputError naming ``what`` otherwise."""
    return None if value is None else require_int(value, what, minimum=minimum, maximum=MAX_STEP)


def check_seconds(value: Any, what: str, *, maximum: float) -> float | None:
    """``value`` as seconds if None or a number from 0 to ``maximum``; BadInputError naming
    ``what`` otherwise (NaN compares false with every time, so it would wait forever or never)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= maximum:
        raise BadInputError(
            f"{what} must be a number of seconds from 0 to {maximum:.15g}, not {errors.clip(repr(value), 40)}"
        )
    return float(value)


def check_steps(steps: Any, what: str) -> list[int]:
    """``steps`` (an iterable of steps) as a list, each checked by ``check_step``; BadInputError
    naming ``what`` for anything else."""
    if isinstance(steps, str | bytes) or not isinstance(steps, Iterable):
        raise BadInputError(f"{what} takes a list of steps, not {errors.clip(repr(steps), 60)}")
    return [require_int(step, f"{what}'s step", minimum=0, maximum=MAX_STEP) for step in steps]


def check_retention(
    *,
    keep_last: Any,
    keep_every: Any,
    keep_steps: Any,
    keep_best: Any,
    keep_weights_every: Any,
    keep_weights_last: Any,
) -> tuple[list[int], list[Any]]:
    """gc's retention rules checked before any work: the counts and periods are integers in
    range, ``keep_steps`` steps; returns ``keep_steps`` and ``keep_best`` as lists (a single
    ``"eval_loss:min"`` string is one rule). BadInputError naming the option otherwise."""
    check_count(keep_last, "--keep-last (keep_last)", minimum=0)
    for what, value in (
        ("--keep-every (keep_every)", keep_every),
        ("--keep-weights-every (keep_weights_every)", keep_weights_every),
        ("--keep-weights-last (keep_weights_last)", keep_weights_last),
    ):
        check_count(value, what, minimum=1)
    if isinstance(keep_best, str):
        keep_best = [keep_best]
    if not isinstance(keep_best, Iterable):
        raise BadInputError(f"keep_best takes a list of rules, not {errors.clip(repr(keep_best), 60)}")
    return check_steps(keep_steps, "--keep-step (keep_steps)"), list(keep_best)


def check_engine(engine: Any) -> None:
    """BadInputError unless ``engine`` is a DeepSpeed engine (``check_is_engine``) with a
    data-parallel size of at least 1: what ``restore`` loads into."""
    from .deepspeed.extract import check_is_engine

    check_is_engine(engine)
    require_int(getattr(engine, "dp_world_size", None), "the engine's data-parallel size", minimum=1)


def check_commit(engine: Any, client_state: Any) -> None:
    """BadInputError unless ``engine`` is a DeepSpeed engine (``check_is_engine``) and
    ``client_state`` None or a mapping (kept like ``save_checkpoint(client_state=...)``)."""
    from .deepspeed.extract import check_is_engine

    check_is_engine(engine)
    if client_state is not None and not isinstance(client_state, Mapping):
        raise BadInputError(f"client_state= takes a dict, not {type(client_state).__name__}")


def check_when_busy(when_busy: Any, blocking: bool) -> None:
    """BadInputError unless ``commit(when_busy=...)`` is one of ``wait``, ``latest`` and
    ``skip``, and ``wait`` for a blocking commit (which always waits for the one before)."""
    if when_busy not in WHEN_BUSY:
        raise BadInputError(
            f"when_busy= takes one of {', '.join(WHEN_BUSY)}, not {errors.clip(repr(when_busy), 40)}"
        )
    if blocking and when_busy != WAIT:
        raise BadInputError(f"when_busy={when_busy!r} is for non-blocking commits (blocking=False)")


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
    for anything else (a string, names that are not strings, an empty list: a step that saves
    no layer would record the engine's counters over tensors it never saved)."""
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
    if not names:
        raise BadInputError("layers=[] saves no layer: name at least one, or pass None to save every layer")
    wrong = [name for name in names if not isinstance(name, str)]
    if wrong:
        raise BadInputError(f"layers= takes layer names (strings), not {errors.clip(repr(wrong[0]), 60)}")
    return names
