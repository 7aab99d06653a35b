"""What committed steps reference: the blobs and auxiliary files they need, and who uses each
(gc's mark phase and verify read these; a pack's references are ``packs``').

A mixin of ``Catalog``: it reads ``self.db`` after ``self.load`` has imported the steps asked for.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from ..model import BlobRow


class ReferenceQueries:
    """Reading the ``tensors``, ``blobs`` and ``files`` tables by reference (see the module doc)."""

    def blob_sizes(self, keys: Iterable[str]) -> dict[str, BlobRow]:
        """Recorded sizes of the given blobs (unknown keys are left out)."""
        found = {}
        keys = list(dict.fromkeys(keys))
        for i in range(0, len(keys), 500):
            chunk = keys[i : i + 500]
            sql = f"SELECT key, size, raw_size FROM blobs WHERE key IN ({','.join('?' * len(chunk))})"
            for row in self.db.execute(sql, chunk):
                found[row[0]] = BlobRow(*row)
        return found

    def referenced_blobs(self) -> dict[str, list[tuple[int, str, str, str]]]:
        """Every blob referenced by a committed step's layers -> (step, layer, name, kind) users."""
        self.load()
        sql = """
            SELECT l.step, t.layer, t.name, t.kind, t.blob
            FROM layers l JOIN tensors t ON t.step = l.source_step AND t.layer = l.layer
            ORDER BY t.blob, l.step
        """
        users: dict[str, list[tuple[int, str, str, str]]] = {}
        for step, layer, name, kind, blob in self.db.execute(sql):
            users.setdefault(blob, []).append((step, layer, name, kind))
        return users

    def blobs_of_steps(self, steps: Iterable[int]) -> set[str]:
        """Every blob the given steps need, inherited layers included."""
        steps = list(steps)
        self.load(steps)
        sql = """
            SELECT DISTINCT t.blob
            FROM layers l JOIN tensors t ON t.step = l.source_step AND t.layer = l.layer
            WHERE l.step IN (SELECT value FROM json_each(?))
        """
        return {row[0] for row in self.db.execute(sql, [json.dumps(list(steps))])}

    def files_of_steps(self, steps: Iterable[int]) -> set[str]:
        """Keys of every auxiliary file the given steps carry."""
        steps = list(steps)
        self.load(steps)
        sql = "SELECT DISTINCT key FROM files WHERE step IN (SELECT value FROM json_each(?))"
        return {row[0] for row in self.db.execute(sql, [json.dumps(list(steps))])}

    def referenced_files(self) -> dict[str, list[tuple[int, str, int]]]:
        """Every stored auxiliary file of a committed step -> its (step, path, size) users."""
        self.load()
        sql = "SELECT f.key, f.step, f.path, f.size FROM files f JOIN steps s ON s.step = f.step ORDER BY f.key, f.step"
        users: dict[str, list[tuple[int, str, int]]] = {}
        for key, step, path, size in self.db.execute(sql):
            users.setdefault(key, []).append((step, path, size))
        return users
