"""Names from a store that become paths: the one rule they pass, and files made only where it allows.

Whoever can write a store chooses every name a step holds: parameter and module names, layer
file names, auxiliary files' paths. A name becomes a path component only as a canonical
relative POSIX name (``refusal``), joined under a folder ckptstore made itself (``join``), and
what it names is created exclusively (``new_file``, ``new_folder``): a name that would climb
out of the output, or two names that land on one path, are refused before anything is
written there, never followed (DESIGN.md invariant 8).
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import CorruptError, clip, storage_error


def refusal(name: object) -> str | None:
    """Why ``name`` may not become a relative path, or None if it may: it is a non-empty string
    of parts joined by ``/``, none empty, ``.`` or ``..``, with no backslash or NUL."""
    if not isinstance(name, str) or not name:
        return "is not a path"
    if "\\" in name or "\0" in name:
        return "holds a backslash or NUL"
    if name.startswith("/"):
        return "is absolute"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "is not a canonical relative path (empty, '.' or '..' parts)"
    return None


def join(
    folder: Path, name: object, what: str, error: type[Exception] = CorruptError, *, flat: bool = False
) -> Path:
    """``folder/name`` for a ``name`` that ``refusal`` allows (and, ``flat``, that is one part: a
    file of a folder, no folder of its own); else ``error`` saying ``"<what> <name> <why>"``.
    ``what`` names whose name it is (``"step 3's parameter"``)."""
    reason = refusal(name)
    if reason is None and flat and "/" in name:  # type: ignore[operator]
        reason = "holds a '/'"
    if reason is not None:
        raise error(f"{what} {clip(repr(name), 120)} {reason}: it cannot name a file or folder")
    assert isinstance(name, str)
    return folder.joinpath(*name.split("/"))


def new_folder(path: Path, what: str, error: type[Exception] = CorruptError) -> Path:
    """Create the folder ``path`` (a ``join`` result) and the folders above it that are missing;
    ``error`` if ``path`` exists already: another name of the same step landed there."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir()
    except (FileExistsError, NotADirectoryError):
        raise error(f"{what} names {path}, which another of its names made already") from None
    return path


def new_file(path: Path, what: str, error: type[Exception] = CorruptError) -> Path:
    """Create ``path`` as an empty file that did not exist (``O_EXCL``, never through a symbolic
    link: ``O_NOFOLLOW``), for a writer that opens it by name next (``torch.save`` names a
    file's archive after its path, so it is handed the path, not the handle). ``error`` if it
    exists: another name of the same step landed there."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        raise error(f"{what} names {path}, which another of its names wrote already") from None
    except OSError as exc:
        raise storage_error("create", path, exc) from None
    os.close(fd)
    return path
