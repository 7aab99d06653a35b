"""What a store saw, step by step, as numbers for a report: the catalog's figures, gathered once.

For each step in the range: every layer's update magnitude measured at that commit (the
statistic layer-wise tailoring selects by, ``commit.stats``) and whether the step saved the
layer or inherited it; the logical bytes of the step (what its tensors take uncompressed,
saved or inherited), the bytes it added to the store and both running totals; and the dedup
ratio (logical over stored); how long each commit took (recorded in its manifest) and, through
a local tier, how long its upload to the store behind took (recorded in the tier's mark of it).
``Figures.as_json`` is what ``ckptstore report --json`` prints
and what the charts draw (``report.charts``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from itertools import accumulate
from typing import Any

from ..arguments import MAX_STEP
from ..errors import BadInputError, CorruptError, NotFoundError, clip


@dataclass(frozen=True)
class Figures:
    """The figures of ``steps`` (ascending), one entry per step in each per-step list.

    ``updates[i][j]``: layer ``layers[j]``'s update measured at ``steps[i]`` (None where none
    could be measured); ``saved[i][j]``: whether ``steps[i]`` saved that layer itself.
    ``commit_seconds[i]``: how long the commit of ``steps[i]`` took, None where its manifest
    predates the figure; ``upload_seconds[i]``: how long this node's local tier took to upload
    it, None without a tier, where it has not (or not here) uploaded it, or where the tier no
    longer holds the step (``local_keep``). ``stall_seconds[i]``: how long a commit behind
    training held it (None for a blocking commit); ``not_committed[i]``: the steps before
    ``steps[i]`` (and after the step before it) that were replaced or skipped, ``[step, how]``.
    """

    steps: list[int]
    layers: list[str]
    updates: list[list[float | None]]
    saved: list[list[bool]]
    logical_bytes: list[int]
    stored_bytes: list[int]
    cumulative_logical_bytes: list[int]
    cumulative_stored_bytes: list[int]
    dedup_ratio: float | None
    commit_seconds: list[float | None]
    upload_seconds: list[float | None]
    stall_seconds: list[float | None]
    not_committed: list[list[tuple[int, str]]]

    def as_json(self) -> dict[str, Any]:
        """The figures as JSON-compatible data."""
        return asdict(self)


def parse_range(text: str | None) -> tuple[int | None, int | None]:
    """``"A..B"``, ``"A.."``, ``"..B"`` or ``"A"`` as inclusive bounds (None: open), each a
    step (0 to ``MAX_STEP``). BadInputError for anything else."""
    if text is None or text == "":
        return None, None
    first, dots, last = text.partition("..")
    try:
        low = int(first) if first else None
        high = (int(last) if last else None) if dots else low
    except ValueError:
        raise BadInputError(f"--steps takes A..B, A.., ..B or one step, not {text!r}") from None
    if any(bound is not None and not 0 <= bound <= MAX_STEP for bound in (low, high)):
        # As every other command: a step is in 0..2^63-1 (``check_step``), never counted from the end.
        raise BadInputError(f"--steps {text}: a step is an integer from 0 to {MAX_STEP}")
    if low is not None and high is not None and low > high:
        raise BadInputError(f"--steps {text}: the first step is after the last")
    return low, high


def gather(store: Any, low: int | None = None, high: int | None = None) -> Figures:
    """The figures of ``store``'s committed steps from ``low`` to ``high`` (inclusive, None:
    open), read from its catalog (no pack is read: ``verify`` checks those). CorruptError
    naming a committed step of the range whose manifest cannot be read (a report without it
    would pass over it in silence); NotFoundError when no committed step lies in the range."""
    rows = [
        row for row in store.log() if (low is None or row.step >= low) and (high is None or row.step <= high)
    ]
    damaged = {
        step: why
        for step, why in store.unreadable_steps().items()
        if (low is None or step >= low) and (high is None or step <= high)
    }
    if damaged:
        step, why = min(damaged.items())
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        raise CorruptError(
            f"step {step} is committed but cannot be read{more} (`ckptstore verify` checks the store; "
            f"--steps around it reports the others): manifest {clip(why)}"
        )
    if not rows:
        where = (
            ""
            if low is None and high is None
            else f" between {low if low is not None else 'the first'} and {high if high is not None else 'the last'}"
        )
        raise NotFoundError(f"no committed step{where}: nothing to report")
    shown = {row.step: {layer.layer: layer for layer in store.show(row.step)} for row in rows}
    layers = sorted({name for by_name in shown.values() for name in by_name}, key=_layer_order)
    updates, saved, logical = [], [], []
    for row in rows:
        by_name = shown[row.step]
        updates.append([by_name[name].update if name in by_name else None for name in layers])
        saved.append([name in by_name and by_name[name].source == row.step for name in layers])
        logical.append(sum(layer.raw_bytes for layer in by_name.values()))
    stored = [row.bytes_added for row in rows]
    uploads = _uploads(store, [row.step for row in rows])
    total_logical, total_stored = list(accumulate(logical)), list(accumulate(stored))
    return Figures(
        steps=[row.step for row in rows],
        layers=layers,
        updates=updates,
        saved=saved,
        logical_bytes=logical,
        stored_bytes=stored,
        cumulative_logical_bytes=total_logical,
        cumulative_stored_bytes=total_stored,
        dedup_ratio=total_logical[-1] / total_stored[-1] if total_stored[-1] else None,
        commit_seconds=[row.commit_seconds for row in rows],
        upload_seconds=[uploads[row.step][0] if row.step in uploads else None for row in rows],
        stall_seconds=[row.stall_seconds for row in rows],
        not_committed=[row.not_committed for row in rows],
    )


def _uploads(store: Any, steps: list[int]) -> dict[int, tuple[float, int]]:
    """The upload figures the store's local tier keeps of ``steps`` (none without a tier)."""
    from ..tier.upload import upload_figures

    tier = getattr(store, "tier", None)
    return upload_figures(tier.local, steps) if tier is not None else {}


def _layer_order(name: str) -> tuple:
    """Layers in model order where names say it: numbered blocks by number, not as text."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))
