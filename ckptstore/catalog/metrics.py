"""The catalog's queries of step metrics (``metrics`` rows): which steps are best by a metric.

A mixin of ``index.Catalog``, which supplies the connection (``db``) and the import of listed
steps (``load``); ``Catalog.record_step`` writes the rows.
"""

from __future__ import annotations


class MetricQueries:
    """Reading the ``metrics`` table (see the module doc)."""

    def metric_names(self) -> list[str]:
        """Every metric name some step recorded, sorted."""
        self.load()
        return [row[0] for row in self.db.execute("SELECT DISTINCT name FROM metrics ORDER BY name")]

    def best_steps(self, name: str, mode: str, count: int) -> list[int]:
        """The ``count`` steps with the lowest (``mode`` "min") or highest ("max") value of
        metric ``name``, best first; ties go to the earlier step. Steps without a finite value
        of it are never among them."""
        self.load()
        order = {"min": "ASC", "max": "DESC"}[mode]
        sql = f"SELECT step FROM metrics WHERE name = ? AND value IS NOT NULL ORDER BY value {order}, step LIMIT ?"
        return [row[0] for row in self.db.execute(sql, [name, count])]
