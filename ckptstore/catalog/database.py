"""The catalog's SQLite file: opened for many processes at once, at the current schema.

Ranks of one job and a gc beside them open the same file: the connection waits for locks
instead of failing, the journal is WAL, and writes take the lock from their first statement
(``write_transaction``). The schema comes only from ``migrations/`` (shipped as
``ckptstore.catalog.migrations``); a file whose schema is newer than this code is refused.

Storage faults (a full disk, a read-only mount, permissions) are StorageError, never taken
for corruption; a catalog that cannot be written is read from an in-memory copy (``snapshot``).
Damage SQLite meets in the file, wherever a query meets it (a bad page, rows that contradict
each other), is DamagedCatalogError, never a raw ``sqlite3`` exception.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from ..errors import CorruptError, StorageError, UnsupportedError, clip, storage_error

log = logging.getLogger("ckptstore")

# SQLite's primary result codes that say the storage failed, not the file's contents.
_STORAGE_CODES = {
    3: "permission denied",  # SQLITE_PERM
    8: "read-only",  # SQLITE_READONLY
    10: "disk I/O error",  # SQLITE_IOERR
    13: "disk full",  # SQLITE_FULL
    14: "cannot be opened",  # SQLITE_CANTOPEN
}
# SQLite's result codes that say the file's contents are damaged: a bad page or header
# (SQLITE_CORRUPT, SQLITE_NOTADB), or a row that a key forbids beside the rows already there
# (SQLITE_CONSTRAINT_PRIMARYKEY, _UNIQUE): ckptstore writes a step's rows only where none are,
# so such a clash is left-over rows (a lost steps row, a log replayed onto another file).
_DAMAGE_CODES = {11, 26}
_DAMAGE_EXTENDED_CODES = {1555, 2067}


class DamagedCatalogError(CorruptError):
    """The catalog file at ``path`` cannot be used: SQLite found ``reason`` in it. The catalog
    only indexes the manifests, so the message names the repair (``ckptstore catalog rebuild``);
    opening a store rebuilds such a file by itself where the open meets the damage."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(
            f"the catalog {path} is damaged ({clip(reason, 120)}): "
            "`ckptstore catalog rebuild` rebuilds it from the manifests"
        )
        self.path = path
        self.reason = reason


def damage(exc: BaseException) -> bool:
    """Whether a SQLite error says the catalog file's contents are damaged (``_DAMAGE_CODES``)
    rather than that the storage failed or the statement is wrong."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _DAMAGE_CODES or code in _DAMAGE_EXTENDED_CODES
    # Python's sqlite3 raises its own OperationalError, with no SQLite code, for text that is
    # not UTF-8 in a row: bytes a writer put there, damage all the same.
    return any(sign in str(exc) for sign in ("malformed", "not a database", "Could not decode to UTF-8"))


def _raise_if_damage(connection: sqlite3.Connection, exc: sqlite3.DatabaseError) -> None:
    """Raise DamagedCatalogError naming the connection's file if ``exc`` is damage (``damage``)."""
    if damage(exc):
        raise DamagedCatalogError(getattr(connection, "ckptstore_path", "(in memory)"), str(exc)) from None


class _Cursor(sqlite3.Cursor):
    """A cursor that raises DamagedCatalogError where SQLite meets damage: while stepping
    through rows as well as at ``execute`` (a query reads a damaged page when it reaches it)."""

    def execute(self, *args: Any) -> _Cursor:
        try:
            return super().execute(*args)
        except sqlite3.DatabaseError as exc:
            _raise_if_damage(self.connection, exc)
            raise

    def executemany(self, *args: Any) -> _Cursor:
        try:
            return super().executemany(*args)
        except sqlite3.DatabaseError as exc:
            _raise_if_damage(self.connection, exc)
            raise

    def executescript(self, *args: Any) -> _Cursor:
        try:
            return super().executescript(*args)
        except sqlite3.DatabaseError as exc:
            _raise_if_damage(self.connection, exc)
            raise

    def fetchone(self) -> Any:
        try:
            return super().fetchone()
        except sqlite3.DatabaseError as exc:
            _raise_if_damage(self.connection, exc)
            raise

    def fetchmany(self, *args: Any) -> list[Any]:
        try:
            return super().fetchmany(*args)
        except sqlite3.DatabaseError as exc:
            _raise_if_damage(self.connection, exc)
            raise

    def fetchall(self) -> list[Any]:
        try:
            return super().fetchall()
        except sqlite3.DatabaseError as exc:
            _raise_if_damage(self.connection, exc)
            raise

    def __next__(self) -> Any:
        try:
            return super().__next__()
        except sqlite3.DatabaseError as exc:
            _raise_if_damage(self.connection, exc)
            raise


class _Connection(sqlite3.Connection):
    """A connection whose statements run on ``_Cursor``s (sqlite-utils runs every statement
    through ``execute``); ``ckptstore_path`` names the file in errors."""

    ckptstore_path: object = "(in memory)"

    def cursor(self, factory: Any = _Cursor) -> Any:
        return super().cursor(factory)

    def execute(self, *args: Any) -> _Cursor:
        return self.cursor().execute(*args)

    def executemany(self, *args: Any) -> _Cursor:
        return self.cursor().executemany(*args)

    def executescript(self, *args: Any) -> _Cursor:
        return self.cursor().executescript(*args)


def _sqlite_connect(target: object, path: object, **kwargs: Any) -> _Connection:
    """``sqlite3.connect(target)`` as a ``_Connection`` naming ``path`` in its errors."""
    connection = sqlite3.connect(target, factory=_Connection, **kwargs)
    connection.ckptstore_path = path
    return connection


def connect(path: Path) -> Database:
    """The database at ``path``, created or migrated to the current schema.

    Raises UnsupportedError for a newer schema, DamagedCatalogError (a CorruptError) for a file
    SQLite cannot read, StorageError when the file or its folder cannot be opened or written (full disk,
    read-only mount, permissions: ``storage_fault``).
    """
    _check_header(path)
    connection = None
    try:
        # check_same_thread=False: a non-blocking commit records its step from its background
        # thread; the store never runs two commits at once.
        connection = _sqlite_connect(path, path, timeout=60, isolation_level=None, check_same_thread=False)
        db = Database(connection)
        db.execute("PRAGMA busy_timeout=60000")
        _enable_wal(db)
        db.execute("PRAGMA synchronous=FULL")
        db.ckptstore_path = path  # named by write_transaction's errors
        _migrate(db, path)
    except BaseException as exc:
        # Closed now, not when the error is collected: an open catalog keeps its files (and
        # their file system) busy.
        if connection is not None:
            connection.close()
        if not isinstance(exc, sqlite3.DatabaseError):
            raise
        if storage_fault(exc):
            raise StorageError(f"cannot open the catalog {path}: {clip(str(exc))}") from None
        raise DamagedCatalogError(path, str(exc)) from None
    return db


def snapshot(path: Path) -> Database:
    """An in-memory copy of the database at ``path`` at the current schema, for reading a
    catalog that cannot be written (full disk, read-only mount): what is written to it is lost
    at close. A missing or unreadable file gives an empty one (the caller lists the manifests
    into it). Raises UnsupportedError for a newer schema."""
    memory = _sqlite_connect(":memory:", path, isolation_level=None, check_same_thread=False)
    # mode=ro reads the write-ahead log too, but needs its shared-memory file or a folder it may
    # create one in; immutable=1 reads a file on read-only media (SQLite then skips the log).
    for query in ("mode=ro", "immutable=1"):
        try:
            source = sqlite3.connect(f"{path.absolute().as_uri()}?{query}", uri=True)
            try:
                source.backup(memory)
                break
            finally:
                source.close()
        except sqlite3.DatabaseError as exc:
            log.debug("ckptstore: cannot copy the catalog %s with %s: %s", path, query, exc)
    db = Database(memory)
    db.ckptstore_path = path
    try:
        _migrate(db, path)
    except (sqlite3.DatabaseError, DamagedCatalogError):  # a damaged copy: start empty, the manifests fill it
        memory.close()
        db = Database(_sqlite_connect(":memory:", path, isolation_level=None, check_same_thread=False))
        db.ckptstore_path = path
        _migrate(db, path)
    return db


def _migrate(db: Database, path: Path) -> None:
    """Bring ``db`` to the current schema; UnsupportedError if it is newer than this code."""
    from .migrations import migrations

    schema = migrations()
    known = {m.name for m in schema._migrations}
    newer = [m.name for m in schema.applied(db) if m.name not in known]
    if newer:
        raise UnsupportedError(
            f"the catalog {path} has schema migrations this ckptstore does not know "
            f"({clip(', '.join(newer))}); upgrade ckptstore to open it"
        )
    if schema.pending(db):
        # One writer at a time: the others wait here and then find nothing pending.
        with write_transaction(db):
            schema.apply(db)


def storage_fault(exc: BaseException) -> bool:
    """Whether a SQLite error says the storage failed (disk full, I/O error, read-only,
    permission, cannot open) rather than that the file's contents are bad."""
    if not isinstance(exc, sqlite3.OperationalError | sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in _STORAGE_CODES
    text = str(exc)
    return any(words in text for words in ("disk is full", "disk I/O", "readonly", "unable to open"))


def _check_header(path: Path) -> None:
    """DamagedCatalogError if the file's header is not one SQLite wrote for ckptstore, or the file
    is shorter than the header says (a truncated copy).

    SQLite opens such a file and fails only when a query reaches a bad or missing page,
    possibly in the middle of a command; checking here costs one 100-byte read, where
    ``quick_check`` would read the whole file at every open.
    """
    try:
        with open(path, "rb") as handle:
            header = handle.read(100)
            size = os.fstat(handle.fileno()).st_size
    except FileNotFoundError:
        return
    except OSError:
        return  # SQLite itself reports what it cannot open
    if not header:
        return  # empty: SQLite makes it a new database
    if len(header) < 100 or not header.startswith(b"SQLite format 3\0"):
        raise DamagedCatalogError(path, "not a SQLite database")
    # Bytes 20-23: the space reserved at the end of each page, 0 unless an encryption or checksum
    # extension made the file (ckptstore's never are), and the payload fractions, which SQLite
    # fixes at 64, 32, 32. SQLite opens a file with other values and misreads its pages later.
    if header[20:24] != bytes([0, 64, 32, 32]):
        raise DamagedCatalogError(path, "its header is damaged")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # A checkpoint copies pages from the write-ahead log into the file, header first: one that a
    # full disk stopped leaves a file shorter than its header says, whose missing pages are
    # still in the log. SQLite reads them from there, so only a file without a log is short.
    if _has_log(path):
        return
    # The header's page count is valid only while its "version-valid-for" matches the change counter.
    if header[92:96] == header[24:28] and pages * page_size > size:
        raise DamagedCatalogError(path, f"it is truncated ({size} of {pages * page_size} bytes)")


def _has_log(path: Path) -> bool:
    """Whether the write-ahead log beside the catalog file at ``path`` holds any frame (past
    its 32-byte header)."""
    try:
        return os.stat(f"{path}-wal").st_size > 32
    except OSError:
        return False


def _enable_wal(db: Database) -> None:
    # Switching a new database to WAL needs an exclusive lock and SQLite answers "locked"
    # at once, without its busy handler, while another process (another rank) does the same.
    for attempt in range(200):
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 199:
                raise
            time.sleep(0.05)


@contextlib.contextmanager
def write_transaction(db: Database) -> Iterator[None]:
    """One transaction that holds the write lock from its first statement.

    Several processes write one catalog (ranks sharing a cache, gc next to commits). In a
    deferred transaction (sqlite-utils' ``atomic``) a reader that then writes fails at once
    with "database is locked" when another process wrote meanwhile, whatever the busy
    timeout; BEGIN IMMEDIATE waits for the lock instead, then reads the other's rows.
    StorageError, with nothing written, when the disk is full or the file cannot be written.
    """
    if db.conn.in_transaction:  # nested: the outer transaction holds the lock
        yield
        return
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            _rollback(db)
            raise
        try:
            db.execute("COMMIT")
        except (sqlite3.DatabaseError, DamagedCatalogError):
            _rollback(db)
            raise
    except sqlite3.DatabaseError as exc:
        if not storage_fault(exc):
            raise
        path = getattr(db, "ckptstore_path", "(in memory)")
        raise StorageError(f"cannot write the catalog {path}: {clip(str(exc))}") from None


@contextlib.contextmanager
def storage_faults(path: Path, action: str) -> Iterator[None]:
    """Raise what fails inside as StorageError naming ``path`` when it is a storage fault (an
    OSError, or a SQLite error that ``storage_fault`` says is one); anything else unchanged."""
    try:
        yield
    except OSError as exc:
        raise storage_error(action, exc.filename or path, exc) from None
    except sqlite3.DatabaseError as exc:
        if not storage_fault(exc):
            raise
        raise StorageError(f"cannot {action} {path}: {clip(str(exc))}") from None


def _rollback(db: Database) -> None:
    # SQLite may have rolled back already (a full disk ends the transaction): nothing to undo then.
    if db.conn.in_transaction:
        db.execute("ROLLBACK")
