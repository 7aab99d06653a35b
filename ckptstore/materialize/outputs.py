"""Output folders of materialize and export: where they may go, what ``force`` may replace, staging.

Both build the folder in a staging directory beside OUT (``.{OUT name}.ckptstore-<hex>.tmp``)
and rename it into place. ``force`` replaces only a folder one of them wrote, which they mark
with ``MARKER``: never a folder a person made, the store, a folder holding the store or inside
it, or the working directory. A command killed half-way leaves its staging directory (or the
``.ckptstore-old-*`` folder a replacement moves aside); the next materialize or export into the
same parent removes those of its own OUT name older than the gc grace period
(``CKPTSTORE_GC_GRACE``), so a concurrent one's is never touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from .. import auxfiles, knobs
from ..errors import BadInputError, ConflictError, StorageError, clip, storage_error

# In every folder materialize or export writes; neither DeepSpeed's load_checkpoint (which reads
# ``latest`` and the tag folder) nor from_pretrained (which reads named files) looks at it.
MARKER = auxfiles.OUTPUT_MARKER


def check_out(out: str | os.PathLike | None, *, force: bool, store_root: Path | None, verb: str) -> Path:
    """The absolute output path ``out``, once it is one ``verb`` may write; nothing is changed.

    BadInputError for an empty path or one that is, holds or lies inside the store
    (``store_root``; None for a store with no local folder) or holds the working directory.
    ConflictError for an existing non-empty ``out`` without ``force``, or with ``force`` when
    ``out`` lacks ``MARKER`` (materialize or export did not write it).
    """
    if out is None or not isinstance(out, str | os.PathLike) or not isinstance(os.fspath(out), str):
        shown = "none" if out is None else type(out).__name__
        raise BadInputError(
            f"{verb} needs an output directory (a path: a string or os.PathLike), not {shown}"
        )
    if not os.fspath(out):
        raise BadInputError(f"{verb} needs an output directory (an empty path names none)")
    path = Path(out).absolute()
    _check_folder_path(path, verb)
    real = Path(os.path.realpath(path))
    if store_root is not None:
        root = Path(os.path.realpath(store_root))
        if real == root or root.is_relative_to(real) or real.is_relative_to(root):
            raise BadInputError(f"{verb}: the output {path} is the store {root}, holds it or lies inside it")
    if Path(os.path.realpath(Path.cwd())).is_relative_to(real):
        raise BadInputError(f"{verb}: the output {path} is the working directory or holds it")
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return path
    if not force:
        raise ConflictError(f"output directory {path} exists and is not empty (use --force to replace it)")
    if not path.is_dir() or path.is_symlink() or not (path / MARKER).is_file():
        raise ConflictError(
            f"--force replaces only a folder materialize or export wrote (it holds {MARKER}); {path} is not "
            "one: remove it yourself or choose another output"
        )
    return path


def _check_folder_path(path: Path, verb: str) -> None:
    """BadInputError if ``path`` cannot become a folder: it is a dangling symbolic link, or its
    nearest existing ancestor is not a folder (a file, a dangling link)."""
    if path.is_symlink() and not path.exists():
        raise BadInputError(f"{verb}: the output {path} is a symbolic link to nothing ({os.readlink(path)})")
    ancestor = path.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise BadInputError(f"{verb}: cannot create the output {path}: {ancestor} is not a folder")


@contextlib.contextmanager
def writing(out: str | os.PathLike | None, verb: str) -> Iterator[None]:
    """Raise what fails while writing output ``out`` as StorageError naming it: an OSError
    (full disk, read-only file system, permissions, ``ulimit -f``), or the RuntimeError torch's
    checkpoint writer raises for a failed write ("unexpected pos", "file write failed")."""
    try:
        yield
    except OSError as exc:
        where = f"{out} ({exc.filename})" if exc.filename else out
        raise storage_error(f"{verb} into", where, exc) from None
    except RuntimeError as exc:
        text = str(exc)
        if "inline_container" not in text and "file write failed" not in text:
            raise
        raise StorageError(
            f"cannot {verb} into {out}: a file could not be written (no space left, a file size limit "
            f"or an I/O error: {clip(text.splitlines()[0], 80)})"
        ) from None


def staging_dir(out: Path) -> Path:
    """A fresh staging directory's path beside ``out``; stale ones of the same name go first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    return out.parent / f".{out.name}.ckptstore-{uuid.uuid4().hex[:8]}.tmp"


@contextlib.contextmanager
def building(out: Path, verb: str, step: int) -> Iterator[Path]:
    """A staging directory's path for ``out`` (not yet created): when the block ends without
    an error it is marked (``mark``) and renamed into place (``swap_into_place``); it is
    removed whatever happens, so ``out`` only ever appears complete."""
    staging = staging_dir(out)
    try:
        yield staging
        mark(staging, verb, step)
        swap_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def mark(folder: Path, verb: str, step: int) -> None:
    """Write ``MARKER`` into ``folder`` (the staging directory, before it is renamed into place)."""
    (folder / MARKER).write_text(json.dumps({"written_by": f"ckptstore {verb}", "step": step}) + "\n")


def remove_stale(out: Path, now: float | None = None) -> list[Path]:
    """Remove staging and set-aside folders of ``out`` older than the gc grace period; returns them."""
    cutoff = (time.time() if now is None else now) - knobs.gc_grace_seconds()
    removed = []
    for pattern in (f".{out.name}.ckptstore-*.tmp", f".{out.name}.ckptstore-old-*"):
        for leftover in out.parent.glob(pattern):
            try:
                if leftover.is_symlink() or leftover.lstat().st_mtime > cutoff:
                    continue
            except FileNotFoundError:
                continue
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def swap_into_place(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``, replacing what ``out`` held (removed afterwards)."""
    if out.exists():
        trash = out.parent / f".{out.name}.ckptstore-old-{uuid.uuid4().hex[:8]}"
        out.rename(trash)
        staging.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(out)
