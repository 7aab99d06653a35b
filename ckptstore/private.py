"""The places on this machine a store with a key trusts: only this user may change them.

A store with a key trusts nothing a store writer puts in the store, but it does trust its
catalog, which lives on the node (under ``CKPTSTORE_CACHE``, or in a local tier's directory),
and the local tier's objects and pairing. Whoever can write there could change what this node
restores without the key. So before a store with a key uses such a place, the folder, every
folder above it, and the catalog's files must be this user's (or root's) and not writable by
group or others; a folder above may be world-writable with the sticky bit (``/tmp``), where no
one else can rename or remove what this user made in it. The folder that holds the catalog
itself may not: others could put files in it. What fails is a BadInputError naming the path
and the command that fixes it. Folders made here are made ``0700``.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

from .errors import BadInputError

_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def make_folder(folder: Path) -> None:
    """Create ``folder`` and any missing folder above it, each readable by this user only
    (``0700``). Errors are left for the caller's own creation to report (it names them)."""
    missing = []
    for path in (folder, *folder.parents):
        if path.exists() or path.is_symlink():
            break
        missing.append(path)
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue  # another process made it meanwhile: checked as any other
        except OSError:
            return


def require_private(folder: str | os.PathLike, what: str, files: Iterable[str] = ()) -> None:
    """BadInputError unless ``folder`` (``what`` names it in the message: "the catalog
    folder", "the local tier") and every folder above it are this user's or root's and not
    writable by group or others (above it, world-writable with the sticky bit is allowed), and
    each of ``files`` in it that exists is this user's and not writable by group or others.
    A folder that does not exist yet is not checked (whoever creates it makes it ``0700``)."""
    folder = Path(folder).expanduser().absolute()
    me = os.geteuid()
    for name in files:
        path = folder / name
        st = _stat(path, f"{what} file {path}")
        if st is not None:
            _check(path, st, f"{what} file", owners={me}, sticky_allowed=False)
    for i, path in enumerate((folder, *folder.parents)):
        st = _stat(path, f"the folder {path} of {what}")
        if st is not None:
            _check(
                path, st, what if i == 0 else f"a folder above {what}", owners={me, 0}, sticky_allowed=i > 0
            )


def _stat(path: Path, what: str) -> os.stat_result | None:
    """``path``'s status, None if it does not exist; BadInputError naming ``what`` if it cannot be read."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise BadInputError(f"cannot check {what}: {exc.strerror}") from None


def _check(path: Path, st: os.stat_result, what: str, *, owners: set[int], sticky_allowed: bool) -> None:
    # The path once, the fix first: a long path must not push the fix past the CLI's one line.
    if st.st_uid not in owners:
        raise BadInputError(
            f"{what} {path} belongs to another user (uid {st.st_uid}): use one of your own "
            "(a store with a key trusts what is there)"
        )
    if st.st_mode & _WRITABLE_BY_OTHERS and not (sticky_allowed and st.st_mode & stat.S_ISVTX):
        raise BadInputError(
            f"{what} is writable by its group or others (mode {stat.S_IMODE(st.st_mode):o}): "
            f"run `chmod go-w {path}` (a store with a key trusts what is there)"
        )
