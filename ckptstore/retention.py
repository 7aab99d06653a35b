"""Retention rules: which committed steps gc keeps whole (keep-last, keep-every, explicit
steps, keep-best by a recorded metric) and how long unreferenced objects are spared (the
grace period). Pure decisions over step numbers and the catalog's metrics; ``gc`` acts on them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

from . import knobs
from .catalog import Catalog
from .errors import BadInputError, clip


@dataclass(frozen=True)
class KeepBest:
    """A retention rule: keep the ``count`` best steps by metric ``name`` (the lowest values
    for ``mode`` "min", the highest for "max"), as recorded by ``commit(metrics=...)``."""

    name: str
    mode: str
    count: int = 1

    @classmethod
    def parse(cls, rule: str | KeepBest | tuple) -> KeepBest:
        """A rule from ``"NAME:min|max[:COUNT]"`` (``eval_loss:min``, ``accuracy:max:3``), a
        tuple of the same, or a KeepBest. BadInputError for anything else."""
        if isinstance(rule, KeepBest):
            return rule
        parts = list(rule) if isinstance(rule, tuple | list) else str(rule).rsplit(":", 2)
        if isinstance(rule, str) and len(parts) == 3 and parts[1] not in ("min", "max"):
            parts = rule.rsplit(":", 1)  # the name itself holds a colon
        try:
            name, mode, *count = parts
            count = int(count[0]) if count else 1
        except (ValueError, TypeError):
            name, mode, count = "", "", 0
        if not isinstance(name, str) or not name or mode not in ("min", "max") or count < 1 or len(parts) > 3:
            raise BadInputError(f"keep-best rule {rule!r} is not NAME:min|max[:COUNT] (e.g. eval_loss:min)")
        return cls(name, mode, count)


def steps_to_keep(
    steps: list[int],
    *,
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_steps: Iterable[int] = (),
    best: Iterable[int] | None = None,
    other_rules: bool = False,
) -> list[int]:
    """The steps the retention rules keep whole; with no rule at all, every step is kept.

    ``best``: the steps keep-best rules chose (None: no such rule). ``other_rules``: rules
    that keep steps otherwise (weights-only) were given, so no rule here keeps nothing."""
    keep_steps = set(keep_steps)
    if keep_last is not None and keep_last < 0:
        raise BadInputError(f"--keep-last must be >= 0, not {keep_last}")
    if keep_every is not None and keep_every <= 0:
        raise BadInputError(f"--keep-every must be > 0, not {keep_every}")
    unknown = sorted(keep_steps - set(steps))
    if unknown:
        raise BadInputError(f"--keep-step names steps that do not exist: {', '.join(map(str, unknown))}")
    if keep_last is None and keep_every is None and not keep_steps and best is None and not other_rules:
        return list(steps)
    kept = set(keep_steps) | set(best or ())
    if keep_last:
        kept.update(steps[-keep_last:])
    if keep_every:
        kept.update(s for s in steps if s % keep_every == 0)
    return sorted(kept)


def grace_seconds(grace: timedelta | float | None) -> float:
    """The grace period in seconds: ``CKPTSTORE_GC_GRACE`` when None. BadInputError unless it
    is a duration from 0 to ten years (``knobs.MAX_GRACE``): NaN compares false with every
    age, so it would switch the grace period off; infinity, or centuries, would never sweep."""
    seconds = knobs.gc_grace_seconds() if grace is None else grace
    try:
        seconds = seconds.total_seconds() if isinstance(seconds, timedelta) else float(seconds)
    except (TypeError, ValueError, OverflowError):
        raise BadInputError(
            f"the grace period must be a duration in seconds, not {clip(repr(grace), 40)}"
        ) from None
    if isinstance(grace, bool) or not 0 <= seconds <= knobs.MAX_GRACE:
        raise BadInputError(
            f"the grace period must be a duration from 0 to ten years, not {clip(repr(grace), 40)}"
        )
    return seconds


def best_steps(catalog: Catalog, rules: list[KeepBest]) -> list[int] | None:
    """The steps keep-best ``rules`` keep (None with no rule)."""
    if not rules:
        return None
    known = catalog.metric_names()
    best = []
    for rule in rules:
        if rule.name not in known:
            hint = (
                f"recorded: {', '.join(known)}"
                if known
                else "no step has recorded metrics (commit(metrics=...))"
            )
            raise BadInputError(f"--keep-best {rule.name}: no step recorded a metric of that name; {hint}")
        best += catalog.best_steps(rule.name, rule.mode, rule.count)
    return best
