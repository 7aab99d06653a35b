"""The catalog's SQLite file: opened for many processes at once, at the current schema.

Ranks of one job and a gc beside them open the same file: the connection waits for locks
instead of failing, the journal is WAL, and writes take the lock from their first statement
(``write_transaction``). The schema comes only from ``migrations/`` (shipped as
``ckptstore.catalog.migrations``); a file whose schema is newer than this code is refused.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from sqlite_utils import Database

from ..errors import CorruptError, UnsupportedError


def connect(path: Path) -> Database:
    """The database at ``path``, created or migrated to the current schema.

    Raises UnsupportedError for a newer schema, CorruptError for a file SQLite cannot read.
    """
    from .migrations import migrations

    _check_length(path)
    try:
        # check_same_thread=False: a non-blocking commit records its step from its background
        # thread; the store never runs two commits at once.
        db = Database(sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False))
        db.execute("PRAGMA busy_timeout=60000")
        _enable_wal(db)
        db.execute("PRAGMA synchronous=FULL")
        schema = migrations()
        known = {m.name for m in schema._migrations}
        newer = [m.name for m in schema.applied(db) if m.name not in known]
        if newer:
            raise UnsupportedError(
                f"the catalog {path} has schema migrations this ckptstore does not know "
                f"({', '.join(newer)}); upgrade ckptstore to open it"
            )
        if schema.pending(db):
            # One writer at a time: the others wait here and then find nothing pending.
            with write_transaction(db):
                schema.apply(db)
    except sqlite3.DatabaseError as exc:
        raise CorruptError(f"catalog {path} cannot be opened: {exc}") from None
    return db


def _check_length(path: Path) -> None:
    """CorruptError if the file is shorter than its own header says (a truncated copy).

    SQLite opens such a file and fails only when a query reaches a missing page, possibly in
    the middle of a command; checking here costs one 100-byte read, where ``quick_check``
    would read the whole file at every open.
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
        raise CorruptError(f"catalog {path} cannot be opened: not a SQLite database")
    page_size = int.from_bytes(header[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    pages = int.from_bytes(header[28:32], "big")
    # The header's page count is valid only while its "version-valid-for" matches the change counter.
    if header[92:96] == header[24:28] and pages * page_size > size:
        raise CorruptError(
            f"catalog {path} cannot be opened: it is truncated ({size} of {pages * page_size} bytes)"
        )


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
    """
    if db.conn.in_transaction:  # nested: the outer transaction holds the lock
        yield
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
