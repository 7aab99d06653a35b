"""Objects as files under a local directory.

Writes go to a uniquely named ``.tmp`` file in the target directory, are fsynced, and are
moved into place with ``link`` (create-only: an existing name is never replaced) before the
directory itself is fsynced, so a crash leaves either the whole object or none of it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

from .. import knobs
from ..errors import BadInputError, CorruptError, NotFoundError, StorageError, storage_error
from . import Data, FileRange, ObjectInfo, ObjectStore, check_name

# A range of at least ``knobs.map_bytes()`` is mapped rather than read: the decoder then reads
# the page cache in place instead of a copy of it in fresh memory (for a restore on two cores,
# ~a quarter of the decode time). Objects are created whole by a rename and never changed in
# place, so a mapped range stays valid, even after gc unlinks the file. But a mapped page that a
# truncation took away kills the reader with SIGBUS, so only a file no one else can truncate is
# mapped (``may_map``); any other is read, and one that shrinks during the read is corrupt.


def may_map(st: os.stat_result) -> bool:
    """Whether the open file ``st`` describes may be mapped: a regular file of this process's
    user that neither its group nor others may write, so that no one else (root aside) can
    truncate it under the mapping. Another user's copy, put in place by someone who can write
    the store's folders, is read instead."""
    return (
        stat.S_ISREG(st.st_mode)
        and st.st_uid == os.geteuid()
        and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def _mapped(fd: int, start: int, end: int) -> memoryview:
    """Bytes ``[start, end)`` of the open file ``fd`` (which holds them), mapped read-only; the
    mapping lasts while the view or a slice of it does."""
    base = start - start % mmap.ALLOCATIONGRANULARITY
    mapping = mmap.mmap(fd, end - base, offset=base, access=mmap.ACCESS_READ)
    return memoryview(mapping)[start - base : end - base]


def _write_all(fd: int, parts: list) -> None:
    # One writev for a blob's header and planes; a short write goes on where it stopped. A file
    # range is copied by the kernel, never through this process's memory.
    views: list[memoryview] = []
    for part in parts:
        if isinstance(part, FileRange):
            _writev_all(fd, views)
            views = []
            _copy_range(part, fd)
        elif memoryview(part).nbytes:
            views.append(memoryview(part).cast("B"))
    _writev_all(fd, views)


def _writev_all(fd: int, views: list[memoryview]) -> None:
    while views:
        written = os.writev(fd, views[: os.sysconf("SC_IOV_MAX")])
        if written <= 0:
            raise OSError(errno.EIO, "write made no progress")
        while views and written >= views[0].nbytes:
            written -= views.pop(0).nbytes
        if written:
            views[0] = views[0][written:]


def _copy_range(part: FileRange, fd: int) -> None:
    offset, left = part.offset, part.length
    while left:
        try:
            copied = os.copy_file_range(part.fd, fd, left, offset)
        except OSError as exc:
            # Filesystems and kernels without it (EXDEV across filesystems before Linux 5.3,
            # ENOSYS, EINVAL on some network filesystems): copy through a bounded buffer.
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            copied = _copy_chunk(part.fd, fd, min(left, 1 << 22), offset)
        if copied <= 0:
            raise OSError(errno.EIO, f"file range ends {left} bytes early")
        offset += copied
        left -= copied


def _copy_chunk(source: int, fd: int, count: int, offset: int) -> int:
    chunk = os.pread(source, count, offset)
    _writev_all(fd, [memoryview(chunk)])
    return len(chunk)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalObjectStore(ObjectStore):
    """An ObjectStore over a directory; created on first use when ``create`` is true."""

    reads_are_local = True

    def __init__(self, root: str | os.PathLike, *, create: bool = True) -> None:
        self.root = Path(root).expanduser().absolute()
        self.uri = str(self.root)
        self.spill_directory = str(self.root)
        if self.root.exists() and not self.root.is_dir():
            raise BadInputError(f"store path {self.root} exists and is not a directory")
        if not self.root.exists():
            if not create:
                raise NotFoundError(f"no store at {self.root}")
            try:
                self.root.mkdir(parents=True, exist_ok=True)  # other ranks may create it at the same moment
            except OSError as exc:
                raise storage_error("create the store directory", self.root, exc) from None

    def _error(self, action: str, name: str, exc: OSError) -> StorageError:
        return storage_error(action, self.root / name, exc)

    def _path(self, name: str) -> Path:
        return self.root.joinpath(*check_name(name).split("/"))

    def put_if_absent(self, name: str, data: Data, *, single_request: bool = False) -> bool:
        # One rename publishes the whole file: every local write is a single request.
        path = self._path(name)
        if path.exists():
            self._freshen(path)
            return False
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex}{knobs.tmp_suffix()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, data if isinstance(data, list) else [data])
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
                created = True
            except FileExistsError:
                created = False  # another writer finished the same content first
            _fsync_dir(path.parent)
        except OSError as exc:
            raise self._error("write", name, exc) from None
        finally:
            tmp.unlink(missing_ok=True)
        if not created:
            self._freshen(path)
        return created

    @staticmethod
    def _freshen(path: Path) -> bool:
        # A writer that dedups against an existing object marks it as young, so a gc whose
        # grace period protects new objects also protects this reuse (git does the same).
        try:
            os.utime(path)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise storage_error("freshen", path, exc) from None
        return True

    def touch(self, name: str) -> int | None:
        path = self._path(name)
        if not self._freshen(path):
            return None
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return None  # deleted (by gc) since: the caller writes it again

    @contextlib.contextmanager
    def lock(self, *, exclusive: bool) -> Iterator[None]:
        # flock is released by the kernel when the process dies, so a killed commit or gc
        # never leaves the store locked.
        try:
            handle = open(self.root / "lock", "a")  # noqa: SIM115 - closed below
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise self._error("open the lock file", "lock", exc) from None
            # flock needs no write access: a store on a read-only mount still takes its lock.
            try:
                handle = open(self.root / "lock")  # noqa: SIM115 - closed below
            except OSError:
                raise self._error("open the lock file", "lock", exc) from None
        with handle:
            fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def get(self, name: str) -> bytes:
        path = self._path(name)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise NotFoundError(f"object {name} is missing from {self.uri}") from None
        except OSError as exc:
            raise self._error("read", name, exc) from None

    def get_range(self, name: str, start: int, length: int) -> bytes | memoryview:
        path = self._path(name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFoundError(f"object {name} is missing from {self.uri}") from None
        except OSError as exc:
            raise self._error("read", name, exc) from None
        try:
            st = os.fstat(fd)
            # The size now bounds the range: what a mapping covers, or what a read must get.
            end = min(start + length, st.st_size)
            if 0 < knobs.map_bytes() <= end - start and may_map(st):
                return _mapped(fd, start, end)
            chunks, done = [], 0
            while start + done < end:  # pread may return less than asked before the end
                chunk = os.pread(fd, end - start - done, start + done)
                if not chunk:
                    raise CorruptError(
                        f"object {name} in {self.uri} shrank while it was read "
                        f"(it had {st.st_size} bytes, then ended at {start + done}): it was truncated"
                    )
                chunks.append(chunk)
                done += len(chunk)
            return b"".join(chunks)
        except OSError as exc:
            raise self._error("read", name, exc) from None
        finally:
            os.close(fd)

    def info(self, name: str) -> ObjectInfo:
        try:
            st = self._path(name).stat()
        except FileNotFoundError:
            raise NotFoundError(f"object {name} is missing from {self.uri}") from None
        return ObjectInfo(name, st.st_size, st.st_mtime)

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink(missing_ok=True)
        except OSError as exc:
            raise self._error("delete", name, exc) from None

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        suffix = knobs.tmp_suffix()
        # Walk only the folder the prefix names, not the whole store.
        start = self.root.joinpath(*prefix.split("/")[:-1]) if "/" in prefix else self.root
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            for filename in sorted(filenames):
                if filename.endswith(suffix):
                    continue
                name = filename if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{filename}"
                if not name.startswith(prefix):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, filename))
                except FileNotFoundError:
                    continue
                yield ObjectInfo(name, st.st_size, st.st_mtime)

    def list_temporary(self) -> Iterator[ObjectInfo]:
        # put_if_absent's ``<name>.<uuid>.tmp`` files, and what a killed ``catalog rebuild`` left
        # (``catalog.db.rebuild-<hex>.tmp`` with SQLite's -wal/-shm/-journal files beside it).
        suffix = knobs.tmp_suffix()
        endings = (suffix, f"{suffix}-wal", f"{suffix}-shm", f"{suffix}-journal")
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, self.root)
            for filename in sorted(f for f in filenames if f.endswith(endings)):
                try:
                    st = os.stat(os.path.join(dirpath, filename))
                except FileNotFoundError:
                    continue
                name = filename if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{filename}"
                yield ObjectInfo(name, st.st_size, st.st_mtime)

    def delete_temporary(self, names: list[str]) -> None:
        suffix = knobs.tmp_suffix()
        for name in names:
            parts = name.split("/")
            # Only ever an unfinished write's name: never a finished object, never outside the store.
            if any(p in ("", ".", "..") for p in parts) or suffix not in parts[-1]:
                raise BadInputError(f"{name!r} is not the name of an unfinished write")
            try:
                self.root.joinpath(*parts).unlink(missing_ok=True)
            except OSError as exc:
                raise self._error("delete", name, exc) from None
