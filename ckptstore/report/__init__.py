"""``ckptstore report``: what the store saw, shown as pictures with the numbers behind them.

``figures`` gathers the catalog's figures of a range of steps; ``charts`` draws them (PNG,
matplotlib as an optional extra) with an ``index.html``. ``write`` puts both in an output
folder the way materialize and export do (built beside it, renamed into place).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..materialize import outputs
from . import charts
from .figures import Figures, gather, parse_range

__all__ = ["Figures", "gather", "parse_range", "write"]


def write(store: Any, out: str | os.PathLike, figures: Figures, *, force: bool = False) -> Path:
    """Write ``figures`` of ``store`` as a report folder at ``out``: the charts, ``index.html``
    and ``figures.json``. ``out`` is checked as materialize checks its output (``force``
    replaces only a folder ckptstore wrote); it appears only complete. UnsupportedError
    without matplotlib, StorageError when ``out`` cannot be written."""
    path = outputs.check_out(out, force=force, store_root=getattr(store.objects, "root", None), verb="report")
    with outputs.writing(path, "report"), outputs.building(path, "report", figures.steps[-1]) as staging:
        staging.mkdir()
        charts.draw(figures, staging)
    return path
