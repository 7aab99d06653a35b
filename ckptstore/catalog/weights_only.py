"""The catalog's record of weights-only steps and of the manifest generation each step's rows
came from (``ckptstore.thin`` rewrites a weights-only step's record as a new generation).

A mixin of ``index.Catalog``, which supplies the connection (``db``), ``write_transaction``,
the import of listed steps (``load``) and ``_require``.
"""

from __future__ import annotations

import json

from ..format import layerpacks
from ..model import LayerPacks, StepRecord, TensorRow
from . import digests


class WeightsOnlyQueries:
    """Weights-only steps and manifest generations (see the module doc)."""

    def generations(self) -> dict[int, int]:
        """Recorded step -> the manifest generation its rows came from (see ``thin``)."""
        return dict(self.db.execute("SELECT step, generation FROM steps").fetchall())

    def listed_generations(self) -> dict[int, int]:
        """Listed step -> the manifest generation the last listing found for it."""
        return dict(self.db.execute("SELECT step, generation FROM listed_steps").fetchall())

    def listed_generation(self, step: int) -> int:
        """The manifest generation the last listing found for ``step`` (0 if not listed)."""
        row = self.db.execute("SELECT generation FROM listed_steps WHERE step = ?", [step]).fetchone()
        return row[0] if row else 0

    def is_weights_only(self, step: int) -> bool:
        """Whether ``step`` keeps only its weights (NotFoundError for an unknown step)."""
        self._require(step)
        row = self.db.execute("SELECT weights_only FROM steps WHERE step = ?", [step]).fetchone()
        return bool(row[0])

    def weights_only_steps(self) -> set[int]:
        """The committed steps that keep only their weights (gc made them so): export, not resume."""
        self.load()
        return {row[0] for row in self.db.execute("SELECT step FROM steps WHERE weights_only")}

    def record_weights_only(
        self, indexes: list[LayerPacks], removed: list[TensorRow], records: list[StepRecord]
    ) -> None:
        """In one transaction: the thinned layers' new indexes (``indexes``, by their step and
        layer), format-1 tensor rows no longer stored (``removed``), and the steps of
        ``records`` (their rewritten records) marked weights-only with their manifest generation
        advanced by one and the digest of their new rows (``digests``)."""
        steps = [record.step for record in records]
        with self.write_transaction():
            for index in indexes:
                self.db.execute(
                    "UPDATE layer_packs SET size = ?, raw_size = ?, packs = ? WHERE step = ? AND layer = ?",
                    [index.size, index.raw_size, layerpacks.encode(index), index.step, index.layer],
                )
            self.db.conn.executemany(
                "DELETE FROM tensors WHERE step = ? AND layer = ? AND name = ? AND kind = ? AND start = ?",
                [(r.step, r.layer, r.name, r.kind, r.start) for r in removed],
            )
            self.db.execute(
                "UPDATE steps SET weights_only = 1, generation = generation + 1 "
                "WHERE step IN (SELECT value FROM json_each(?))",
                [json.dumps(list(steps))],
            )
            generations = self.generations()
            self.db.conn.executemany(
                "UPDATE steps SET rows_digest = ? WHERE step = ?",
                [
                    (
                        digests.of_parts(
                            digests.record_parts(r), r.step, generations[r.step], self.content_hash
                        ),
                        r.step,
                    )
                    for r in records
                ],
            )
        self._checked.difference_update(steps)
