"""The registry of ``CKPTSTORE_*`` settings and the parsing of their values.

A setting is a reader function registered under its name with ``setting``; the readers and
their ranges are ``knobs``'. The parsers here turn a variable's text into an integer, a
number, a flag or a directory within a range, or raise BadInputError naming the variable. An
API argument with an environment form (``open(s3_timeout=...)``, ``CKPTSTORE_S3_TIMEOUT``) is
checked by the same reader, given as ``given``: one rule for both, the error naming the argument.
``warn_unknown`` names the ``CKPTSTORE_*`` variables no setting reads (a misspelt setting
would otherwise be silently unused).
"""

from __future__ import annotations

import difflib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import BadInputError, clip

PREFIX = "CKPTSTORE_"
# The ranges every group of settings shares (``knobs``, ``remote_knobs``).
MAX_BYTES = 1 << 50  # 1 PiB: past any checkpoint, far below where sizes overflow a C integer
DAY = 86400.0

log = logging.getLogger("ckptstore")


@dataclass(frozen=True)
class Setting:
    """A registered setting: ``read()`` returns its value or raises BadInputError naming it;
    ``kind`` is what it takes (integer, number, flag, choice, directory, store, key file)."""

    name: str
    kind: str
    read: Callable[[], object]
    tests_only: bool = False


#: Every setting, by its full name (``CKPTSTORE_IO_THREADS``).
SETTINGS: dict[str, Setting] = {}

_warned: set[str] = set()


def setting(name: str, kind: str, *, tests_only: bool = False):
    """Register the decorated reader as ``CKPTSTORE_<name>``."""

    def register(read):
        SETTINGS[PREFIX + name] = Setting(PREFIX + name, kind, read, tests_only)
        return read

    return register


def warn_unknown() -> None:
    """Log one warning line for each ``CKPTSTORE_*`` variable that is no registered setting,
    naming the closest setting; each unknown name is warned about once per process."""
    for name in sorted(os.environ):
        if name.startswith(PREFIX) and name not in SETTINGS and name not in _warned:
            _warned.add(name)
            close = difflib.get_close_matches(name, list(SETTINGS), n=1, cutoff=0.7)
            hint = f" (did you mean {close[0]}?)" if close else ""
            log.warning("ckptstore: %s is not a ckptstore setting; it is ignored%s", name, hint)


def read_raw(name: str) -> str | None:
    return os.environ.get(PREFIX + name)


def read_int(name: str, default: int, minimum: int, maximum: int, given: object = None) -> int:
    """``CKPTSTORE_<name>`` as an integer in ``minimum..maximum`` (``default`` when unset or
    empty); BadInputError naming it when it is not one. ``given`` (not None): the API argument
    ``name.lower()`` instead, held to the same range (a bool is no integer)."""
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int) or not minimum <= given <= maximum:
            raise bad_argument(name, given, f"an integer from {minimum} to {maximum}")
        return given
    value = read_raw(name)
    if value is None or not value.strip():
        return default
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not minimum <= number <= maximum:
        raise bad_value(name, value, f"an integer from {minimum} to {maximum}")
    return number


def read_float(
    name: str,
    default: float,
    maximum: float,
    *,
    positive: bool = False,
    limit: str = "",
    given: object = None,
) -> float:
    """``CKPTSTORE_<name>`` as a number from 0 (above 0 when ``positive``) to ``maximum``
    (``default`` when unset or empty; ``limit`` says the maximum in words); BadInputError naming
    it when it is not one. NaN is never one: it compares false with everything, and so would
    switch off what it bounds. ``given`` (not None): the API argument ``name.lower()`` instead,
    held to the same range (an int or float; a bool or a string is none)."""
    low = "above 0, at most" if positive else "from 0 to"
    kind = f"a number {low} {maximum:.15g}{f' ({limit})' if limit else ''}"
    if given is not None:
        number = math.nan if isinstance(given, bool) or not isinstance(given, int | float) else given
    else:
        value = read_raw(name)
        if value is None or not value.strip():
            return default
        try:
            number = float(value)
        except ValueError:
            number = math.nan
    if not (0 < number if positive else 0 <= number) or not number <= maximum:
        raise bad_argument(name, given, kind) if given is not None else bad_value(name, value, kind)
    return float(number)


def read_flag(name: str, default: bool) -> bool:
    """``CKPTSTORE_<name>`` as a yes/no: 1/true/yes/on or 0/false/no/off (any case)."""
    value = read_raw(name)
    if value is None or not value.strip():
        return default
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise bad_value(name, value, "1 or 0 (true/false, yes/no, on/off)")


def read_directory(name: str, given: str | None = None) -> str:
    """``CKPTSTORE_<name>`` as a directory path ("" when unset) that is, or can become, a
    directory: neither it nor the nearest of its parents that exists is anything else.
    ``given`` (not None): the API argument ``name.lower()`` (a path string) instead."""
    value = (read_raw(name) or "") if given is None else given
    if value:
        path = Path(value).expanduser().absolute()
        nearest = next((p for p in (path, *path.parents) if p.exists()), None)
        if nearest is not None and not nearest.is_dir():
            what = "is" if nearest == path else f"lies under {nearest}, which is"
            kind = f"a directory (it {what} not a directory)"
            if given is not None:
                raise BadInputError(f"{name.lower()}={clip(value, 120)}: must be {kind}")
            raise bad_value(name, value, kind, plain=True)
    return value


def bad_argument(name: str, value: object, kind: str) -> Exception:
    """BadInputError: the API argument of setting ``name`` (``name.lower()``) is not ``kind``."""
    return BadInputError(f"{name.lower()} must be {kind}, not {clip(repr(value), 40)}")


def bad_value(name: str, value: str, kind: str, *, plain: bool = False) -> Exception:
    if plain:
        return BadInputError(f"{PREFIX}{name}={clip(value, 120)}: must be {kind}")
    return BadInputError(f"{PREFIX}{name} must be {kind}, not {clip(repr(value), 40)}")
