"""The catalog's queries of one step's rows: its description, layer sources, tensor rows,
layer sizes, samples and files, and the log of every step.

A mixin of ``index.Catalog``, which supplies the connection (``db``), the import of listed
steps (``load``) and ``_require`` (NotFoundError, or CorruptError for an unreadable manifest).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from ..model import FileRow, LayerRow, StepRow, TensorRow


class StepQueries:
    """Reading a step's rows (see the module doc)."""

    def description(self, step: int) -> str:
        """The step description JSON text recorded for ``step``."""
        self._require(step)
        return self.db.execute("SELECT description FROM steps WHERE step = ?", [step]).fetchone()[0]

    def sources(self, step: int) -> dict[str, int]:
        """Every layer of ``step`` (in model order) -> the step that saved its tensors."""
        self._require(step)
        rows = self.db.execute(
            "SELECT layer, source_step FROM layers WHERE step = ? ORDER BY position", [step]
        ).fetchall()
        return dict(rows)

    def tensors(self, step: int, layers: Iterable[str] | None = None) -> list[TensorRow]:
        """Tensor rows that ``step`` itself saved (optionally only for ``layers``), once the
        steps that use them are checked (CorruptError: ``check_rows``)."""
        layers = None if layers is None else list(layers)
        self._check_units(step, layers)
        sql = "SELECT step, layer, name, kind, start, numel, blob FROM tensors WHERE step = ?"
        rows = self.db.execute(sql, [step]).fetchall()
        wanted = None if layers is None else set(layers)
        return [TensorRow(*row) for row in rows if wanted is None or row[1] in wanted]

    def added(self, step: int) -> tuple[int, int] | None:
        """(blobs, bytes) the catalog records ``step`` as having added; None if not recorded."""
        row = self.db.execute("SELECT blobs_added, bytes_added FROM steps WHERE step = ?", [step]).fetchone()
        return None if row is None else (row[0], row[1])

    def log(self) -> list[StepRow]:
        """One summary row per committed step, oldest first."""
        self.load()
        sql = """
            SELECT s.step, s.created_at, s.world_size, s.layers_saved,
                   (SELECT count(*) FROM layers l WHERE l.step = s.step), s.bytes_added, s.blobs_added,
                   NOT s.weights_only, s.commit_seconds, s.stall_seconds, s.not_committed
            FROM steps s ORDER BY s.step
        """
        metrics: dict[int, dict[str, float | None]] = {}
        for step, name, value in self.db.execute("SELECT step, name, value FROM metrics ORDER BY step, name"):
            metrics.setdefault(step, {})[name] = value
        return [
            StepRow(
                *row[:7],
                resumable=bool(row[7]),
                metrics=metrics.get(row[0], {}),
                commit_seconds=row[8],
                stall_seconds=row[9],
                not_committed=[tuple(pair) for pair in json.loads(row[10] or "[]")],
            )  # fmt: skip
            for row in self.db.execute(sql)
        ]

    def layer_rows(self, step: int) -> list[LayerRow]:
        """Every layer of ``step`` in model order: source step, stored bytes, update statistics."""
        self._require(step)
        layers = self.db.execute(
            "SELECT layer, source_step, update_size, update_since FROM layers WHERE step = ? ORDER BY position",
            [step],
        ).fetchall()
        sizes_sql = """
            SELECT d.step, d.layer, coalesce(sum(b.size), 0), coalesce(sum(b.raw_size), 0)
            FROM (SELECT DISTINCT step, layer, blob FROM tensors
                  WHERE step IN (SELECT value FROM json_each(?))) d
            LEFT JOIN blobs b ON b.key = d.blob
            GROUP BY d.step, d.layer
        """
        sources = json.dumps(sorted({source for _, source, _, _ in layers}))
        found = self.db.execute(sizes_sql, [sources]).fetchall()
        found += self.db.execute(
            "SELECT step, layer, size, raw_size FROM layer_packs WHERE step IN (SELECT value FROM json_each(?))",
            [sources],
        ).fetchall()
        sizes = {(s, layer): (size, raw) for s, layer, size, raw in found}
        return [
            LayerRow(layer, source, *sizes.get((source, layer), (0, 0)), update, since)
            for layer, source, update, since in layers
        ]

    def samples(self, step: int, names: Iterable[str]) -> dict[str, bytes]:
        """The update-statistics samples recorded at ``step`` for ``names`` (missing ones left out)."""
        names = list(names)
        sql = "SELECT name, sample FROM samples WHERE step = ? AND name IN (SELECT value FROM json_each(?))"
        return dict(self.db.execute(sql, [step, json.dumps(names)]).fetchall())

    def files(self, step: int) -> list[FileRow]:
        """The auxiliary files recorded with ``step``, by path."""
        self._require(step)
        sql = "SELECT path, key, size FROM files WHERE step = ? ORDER BY path"
        return [FileRow(*row) for row in self.db.execute(sql, [step])]
