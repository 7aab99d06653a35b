"""The catalog schema, as ordered SQL migrations (``NNNN_name.sql``) applied by sqlite-utils.

This folder is installed as ``ckptstore.catalog.migrations``. Each file runs in one transaction
together with its record in ``_sqlite_migrations``; a failing migration rolls back and stays
pending. Never edit an applied migration: add a new file.
"""

from __future__ import annotations

import sqlite3
from importlib import resources

from sqlite_utils import Database
from sqlite_utils.migrations import Migrations

MIGRATION_SET = "ckptstore"


def _statements(sql: str) -> list[str]:
    # sqlite3's executescript() commits first, which would break the per-migration
    # transaction, so statements are split here and run one by one.
    statements, current = [], ""
    for line in sql.splitlines(keepends=True):
        current += line
        if sqlite3.complete_statement(current):
            statements.append(current.strip())
            current = ""
    if current.strip() and not all(
        part.strip().startswith("--") or not part.strip() for part in current.splitlines()
    ):
        raise ValueError(f"incomplete SQL statement in migration: {current.strip()[:80]}")
    return statements


def _runner(sql: str):
    def apply(db: Database) -> None:
        for statement in _statements(sql):
            db.execute(statement)

    return apply


def migration_files() -> list[tuple[str, str]]:
    """``(name, sql)`` of every migration shipped with this version, in order."""
    files = sorted(f for f in resources.files(__name__).iterdir() if f.name.endswith(".sql"))
    return [(f.name.removesuffix(".sql"), f.read_text()) for f in files]


def migrations() -> Migrations:
    """The sqlite-utils migration set for the catalog schema."""
    found = Migrations(MIGRATION_SET)
    for name, sql in migration_files():
        found(name=name)(_runner(sql))
    return found
