"""Output folders of materialize and export: where they may go, what ``force`` may replace, staging.

Both build the folder in a staging directory beside OUT (``.{OUT name}.ckptstore-<hex>.tmp``)
and rename it into place. ``force`` replaces only a folder one of them wrote, which they mark
with ``MARKER``: never a folder a person made, the store, a folder holding the store or inside
it, or the working directory. While it builds, the command holds an ``flock`` on a lock file
beside the staging directory (``.{OUT name}.ckptstore-<hex>.lock``), which the kernel releases
however the process ends. A command killed half-way leaves its staging directory and lock file
(or the ``.ckptstore-old-*`` folder a replacement moves aside); the next materialize, export or
report into the same OUT removes a staging directory whose lock no process holds at once, and
one without a lock file, or a set-aside folder, once older than the gc grace period
(``CKPTSTORE_GC_GRACE``); a concurrent one's, whose lock is held, is never touched.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import os
import shutil
import socket
import stat
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
    """A fresh staging directory's path beside ``out`` (``.{out name}.ckptstore-<hex>.tmp``)."""
    return out.parent / f".{out.name}.ckptstore-{uuid.uuid4().hex[:8]}.tmp"


def lock_of(staging: Path) -> Path:
    """The lock file beside ``staging``: held by the process building it for as long as it runs."""
    return staging.with_suffix(".lock")


@contextlib.contextmanager
def building(out: Path, verb: str, step: int) -> Iterator[Path]:
    """A staging directory's path for ``out`` (not yet created), its lock held (``_owning``):
    when the block ends without an error it is marked (``mark``) and renamed into place
    (``swap_into_place``); it is removed whatever happens, so ``out`` only ever appears
    complete. Leftovers of killed commands into ``out`` go first (``remove_stale``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)
    with _owning(out) as staging:
        try:
            yield staging
            mark(staging, verb, step)
            swap_into_place(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


@contextlib.contextmanager
def _owning(out: Path) -> Iterator[Path]:
    """A fresh staging path for ``out`` whose lock file (``lock_of``) this process holds, with
    ``flock``, until the block ends; the lock file then goes. The kernel releases the lock when
    the process dies however it dies, so a staging folder whose lock can be taken is a killed
    command's (``remove_stale``). Where the file system takes no lock, no lock file is left and
    the staging folder is one the age rule keeps."""
    staging, fd = _take(out)
    try:
        if fd is not None:
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())  # for a person who looks
        yield staging
    finally:
        if fd is not None:
            lock_of(staging).unlink(missing_ok=True)  # still held: no one takes it for a killed one's
            os.close(fd)


def _take(out: Path) -> tuple[Path, int | None]:
    """A fresh staging path for ``out`` and the descriptor of its lock file, locked; None for
    the descriptor where the file system takes no lock (and no lock file is left)."""
    while True:
        staging = staging_dir(out)
        lock = lock_of(staging)
        fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Between the open and the flock another's remove_stale may have taken the new file
            # for an orphan and unlinked it: the lock counts only if still at that name.
            if os.fstat(fd).st_ino == os.stat(lock, follow_symlinks=False).st_ino:
                return staging, fd
        except BlockingIOError:  # another's remove_stale holds it for that reason: it goes
            pass
        except FileNotFoundError:  # it went
            pass
        except OSError:  # no locks here (some network file systems): no lock file, the age rule
            os.close(fd)
            lock.unlink(missing_ok=True)
            return staging, None
        os.close(fd)


def mark(folder: Path, verb: str, step: int) -> None:
    """Write ``MARKER`` into ``folder`` (the staging directory, before it is renamed into place)."""
    (folder / MARKER).write_text(json.dumps({"written_by": f"ckptstore {verb}", "step": step}) + "\n")


def remove_stale(out: Path, now: float | None = None) -> list[Path]:
    """Remove what killed commands into ``out`` left beside it; returns the folders removed.

    A staging folder with a lock file no process holds (``_owning``) goes at once, with the
    lock; one whose lock is held is a command running now, and stays. A staging folder
    without a lock file (an older ckptstore's, or one on a file system without locks) and a
    set-aside ``.ckptstore-old-*`` folder (which may hold the only copy of the output a
    killed replacement moved aside) go once older than the gc grace period."""
    cutoff = (time.time() if now is None else now) - knobs.gc_grace_seconds()
    name = glob.escape(out.name)
    removed = []
    for lock in out.parent.glob(f".{name}.ckptstore-*.lock"):
        staging = lock.with_suffix(".tmp")
        if _remove_if_unheld(lock, staging):
            removed.append(staging)
    for pattern in (f".{name}.ckptstore-*.tmp", f".{name}.ckptstore-old-*"):
        for leftover in out.parent.glob(pattern):
            try:
                locked = leftover.suffix == ".tmp" and os.path.lexists(lock_of(leftover))
                if locked or leftover.is_symlink() or leftover.lstat().st_mtime > cutoff:
                    continue
            except FileNotFoundError:
                continue
            shutil.rmtree(leftover, ignore_errors=True)
            removed.append(leftover)
    return removed


def _remove_if_unheld(lock: Path, staging: Path) -> bool:
    """Remove ``staging`` (if a real folder) and its ``lock`` if no process holds the lock;
    whether a staging folder went. Held, or not a plain file, or not lockable: both stay."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(lock)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held (BlockingIOError): a command writing now; not a file; no locks here
        os.close(fd)
        return False
    try:
        folder = os.path.lexists(staging) and staging.is_dir() and not staging.is_symlink()
        if folder:
            shutil.rmtree(staging, ignore_errors=True)
        lock.unlink(missing_ok=True)  # before its lock is released: no owner can come back to it
        return folder
    finally:
        os.close(fd)


def swap_into_place(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``, replacing what ``out`` held (removed afterwards)."""
    if out.exists():
        trash = out.parent / f".{out.name}.ckptstore-old-{uuid.uuid4().hex[:8]}"
        out.rename(trash)
        staging.rename(out)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        staging.rename(out)
