"""Progress bars for long operations: shown on a terminal, silent under cron and in pipes."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

from . import knobs

T = TypeVar("T")


def progress_bar(
    items: Iterable[T], *, total: int | None = None, desc: str = "", unit: str = "it"
) -> Iterator[T]:
    """Iterate ``items`` with a tqdm bar on stderr when it is a terminal (``CKPTSTORE_PROGRESS=0`` hides it)."""
    return iter(tqdm(items, total=total, desc=desc, unit=unit, disable=not shown(), leave=False))


def shown() -> bool:
    """Whether progress bars are shown: on a terminal, unless ``CKPTSTORE_PROGRESS=0``."""
    return sys.stderr.isatty() and knobs.progress()
