"""What a ``Store`` answers about its steps without reading tensors: the queries of the facade
(``Store`` inherits them), each one catalog call, and ``report``, which draws their figures.
"""

from __future__ import annotations

import os

from . import report as report_
from .arguments import check_step, while_open
from .catalog import Catalog
from .model import FileRow, LayerRow, StepRow


class StoreQueries:
    """The query methods of ``Store``, which provides these two."""

    catalog: Catalog
    _closed: bool

    @while_open
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self.catalog.steps()

    @while_open
    def sources(self, step: int) -> dict[str, int]:
        """Every layer of ``step`` -> the step whose tensors it uses. Raises NotFoundError."""
        return self.catalog.sources(check_step(step))

    @while_open
    def log(self) -> list[StepRow]:
        """Summary of every committed step (time, layers saved, bytes added), oldest first.
        A step whose manifest cannot be read is left out and named in ``unreadable_steps``."""
        return self.catalog.log()

    @while_open
    def unreadable_steps(self) -> dict[int, str]:
        """Steps whose manifest exists but could not be read so far (step -> why): committed
        and damaged, not absent. ``log`` lists the others; reading one raises CorruptError."""
        return dict(self.catalog.unreadable)

    @while_open
    def show(self, step: int) -> list[LayerRow]:
        """Every layer of ``step``: the step it comes from, its stored bytes, and its update
        (relative change of its fp32 masters since its last save, measured at ``step``).
        Raises NotFoundError."""
        return self.catalog.layer_rows(check_step(step))

    @while_open
    def resumable(self, step: int) -> bool:
        """Whether ``step`` resumes (materialize, restore); False for a weights-only step, which
        gc kept with its weights only (it still exports). Raises NotFoundError."""
        return not self.catalog.is_weights_only(check_step(step))

    @while_open
    def files(self, step: int) -> list[FileRow]:
        """The auxiliary files kept with ``step``. Raises NotFoundError."""
        return self.catalog.files(check_step(step))

    @while_open
    def report(
        self, out: str | os.PathLike | None = None, *, steps: str | None = None, force: bool = False
    ) -> report_.Figures:
        """What the store saw at each step of ``steps`` (``"A..B"``, ``"A.."``, ``"..B"``, one
        step; None: all): each layer's update and whether the step saved it, logical and stored
        bytes per step and cumulative, the dedup ratio. With ``out``, also writes the report
        there (PNG charts, ``index.html``, ``figures.json``; matplotlib needed, UnsupportedError
        without it), checked and replaced as ``materialize`` treats its output. Raises
        BadInputError for a malformed range, NotFoundError when no step lies in it."""
        figures = report_.gather(self, *report_.parse_range(steps))
        if out is not None:
            report_.write(self, out, figures, force=force)
        return figures
