"""The SQLite catalog: which steps exist, which blob every layer's tensors map to, step state.

The file, its schema and its transactions are ``database``'s. A step becomes visible by ``record_step``, one transaction that writes every row of the step.

The index of an S3 store may also *list* steps it has not imported yet (``set_listed``): its
``loader`` imports them the first time a query needs their rows, so every query answers as if
every listed step had been imported.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import ConflictError, CorruptError, NotFoundError, StorageError
from ..format import layerpacks
from ..hashing import PLAIN, ContentHash
from ..layers import layer_of
from ..model import StepRecord, group_by_source
from . import database, digests
from .metrics import MetricQueries
from .packs import LayerPackQueries
from .references import ReferenceQueries
from .rowcheck import RowChecks
from .steps import StepQueries
from .weights_only import WeightsOnlyQueries


class Catalog(StepQueries, LayerPackQueries, ReferenceQueries, MetricQueries, WeightsOnlyQueries, RowChecks):
    """Access to one catalog database file (created with the current schema when missing).

    A step's own rows are read in ``steps.StepQueries``, the queries of format-2 pack indexes
    are in ``packs.LayerPackQueries``, the check of rows against their manifest's digest in
    ``rowcheck.RowChecks``."""

    def __init__(self, path: str | Path, *, read_only: str | None = None) -> None:
        """Open the catalog at ``path`` (``database.connect``: UnsupportedError, CorruptError,
        StorageError). ``read_only``, why the file cannot be written: read an in-memory copy of
        it instead (``database.snapshot``), which writers refuse (``require_writable``)."""
        self.path = Path(path)
        #: Why this catalog is an in-memory copy of a file that cannot be written; None: it is not.
        self.read_only = read_only
        # Imports listed steps that are not recorded yet (catalog.sync); None: nothing is listed.
        self.loader: Callable[[list[int]], None] | None = None
        # Steps whose manifest is listed but could not be read, met by this process -> why:
        # such a step is committed and damaged, not absent (``_require``, ``log``).
        self.unreadable: dict[int, str] = {}
        #: Whether a listed manifest counts as a step before it is read. Not in a store with a
        #: key: a store writer without the key can add a manifest, and only reading it tells
        #: whether it is authentic, so every listed step is imported before steps are answered.
        self.trusts_listing = True
        #: What the store's deletion record said at the last sync (``format.deletions``): the
        #: generation a new commit of a deleted step is written above. None: not synced.
        self.deletions = None
        #: The store's content hash: with a key, the digests kept with each step's rows are tags
        #: under it (``digests``).
        self.content_hash: ContentHash = PLAIN
        #: Step, generation -> the parts of the rows its manifest gives (``digests.record_parts``):
        #: how the rows of a step recorded before digests were kept are checked, once.
        self.manifest_parts: Callable[[int, int], digests.Parts] | None = None
        self._checked: set[int] = set()  # steps whose rows matched their digest in this process
        self._checked_units: set[tuple[int, str]] = set()  # (source, layer) indexes those steps use
        self.db = database.snapshot(self.path) if read_only else database.connect(self.path)

    def require_writable(self, verb: str) -> None:
        """StorageError if this catalog is a read-only copy (``read_only``): ``verb`` would write it."""
        if self.read_only:
            raise StorageError(f"{verb} needs to write the catalog, and {self.read_only}")

    def write_transaction(self) -> contextlib.AbstractContextManager:
        """One transaction holding the write lock from its first statement (``database``)."""
        return database.write_transaction(self.db)

    def close(self) -> None:
        """Close the database connection."""
        self.db.close()

    # -- reading ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps in ascending order, listed ones included (imported first, unless
        ``trusts_listing``)."""
        if not self.trusts_listing:
            self.load()
        return self.known_steps()

    def known_steps(self) -> list[int]:
        """The steps recorded or listed, ascending, without importing any (what a sync saw)."""
        sql = "SELECT step FROM steps UNION SELECT step FROM listed_steps ORDER BY step"
        return [row[0] for row in self.db.execute(sql)]

    def has_step(self, step: int) -> bool:
        """Whether ``step`` is committed (recorded or listed; imported first, unless ``trusts_listing``)."""
        if not self.trusts_listing:
            self.load([step])
        sql = "SELECT 1 FROM steps WHERE step = ? UNION SELECT 1 FROM listed_steps WHERE step = ?"
        return self.db.execute(sql, [step, step]).fetchone() is not None

    def recorded_steps(self) -> list[int]:
        """The steps whose rows this catalog holds (listed ones not imported yet left out)."""
        return [row[0] for row in self.db.execute("SELECT step FROM steps ORDER BY step")]

    def is_recorded(self, step: int) -> bool:
        """Whether this catalog holds ``step``'s rows (not only lists it)."""
        return self.db.execute("SELECT 1 FROM steps WHERE step = ?", [step]).fetchone() is not None

    def load(self, steps: Iterable[int] | None = None) -> None:
        """Import the listed steps not recorded yet: all of them, or those among ``steps``.
        Where the file cannot take them (StorageError: a full disk), the catalog goes on as
        an in-memory copy (``read_only``) that holds them."""
        if self.loader is None:
            return
        pending = self.pending_steps()
        if steps is not None:
            wanted = set(steps)
            pending = [step for step in pending if step in wanted]
        if not pending:
            return
        try:
            self.loader(pending)
        except StorageError as exc:
            # The disk filled (or became read-only) since the open: read on from a copy.
            if self.read_only or self.db.conn.in_transaction:
                raise
            self.db.close()
            self.db = database.snapshot(self.path)
            self.read_only = str(exc)
            self.loader(pending)

    def pending_steps(self) -> list[int]:
        """The listed steps not imported yet, ascending."""
        sql = "SELECT step FROM listed_steps WHERE step NOT IN (SELECT step FROM steps) ORDER BY step"
        return [row[0] for row in self.db.execute(sql)]

    def set_listed(self, steps: dict[int, int]) -> None:
        """Make ``steps`` (step -> manifest generation) the listed steps: the manifests a
        listing of the store found."""
        with self.write_transaction():
            self.db.execute("DELETE FROM listed_steps")
            self.db["listed_steps"].insert_all(
                ({"step": step, "generation": generation} for step, generation in steps.items()), ignore=True
            )

    def unlist(self, steps: Iterable[int]) -> None:
        """Forget listed steps that cannot be imported (their manifest is gone or unreadable)."""
        with self.write_transaction():
            self.db.execute(
                "DELETE FROM listed_steps WHERE step IN (SELECT value FROM json_each(?))",
                [json.dumps(list(steps))],
            )

    def inheritor_of(self, step: int) -> int | None:
        """A committed step that uses layers ``step`` saved, if any (``step`` itself excluded)."""
        self.load(s for s in self.steps() if s > step)  # only later steps can inherit from it
        row = self.db.execute(
            "SELECT min(step) FROM layers WHERE source_step = ? AND step != ?", [step, step]
        ).fetchone()
        return row[0]

    def latest_step(self, before: int | None = None) -> int | None:
        """The newest committed step (strictly below ``before`` when given), or None."""
        steps = [s for s in self.steps() if before is None or s < before]
        return steps[-1] if steps else None

    def _require(self, step: int) -> None:
        """Import ``step`` if it is only listed and check its rows (``check_rows``) before a
        read uses them; NotFoundError if there is no such step, CorruptError if its manifest
        cannot be read or its rows are not its manifest's."""
        self.load([step])
        if not self.is_recorded(step):
            if step in self.unreadable:
                raise CorruptError(f"step {step} cannot be read: manifest {self.unreadable[step]}")
            known = self.steps()
            hint = f"; committed steps: {_summary(known)}" if known else "; the store has no steps yet"
            raise NotFoundError(f"step {step} does not exist{hint}")
        self.check_rows([step])

    def consistency_problems(self) -> list[str]:
        """Layers of committed steps whose source step has no tensor rows for them."""
        self.load()
        sql = """
            SELECT l.step, l.layer, l.source_step FROM layers l
            WHERE NOT EXISTS (SELECT 1 FROM tensors t WHERE t.step = l.source_step AND t.layer = l.layer)
              AND NOT EXISTS (SELECT 1 FROM layer_packs p WHERE p.step = l.source_step AND p.layer = l.layer)
            ORDER BY l.step, l.position
        """
        return [
            f"step {step} layer {layer} points at step {source}, which holds no tensors for it"
            for step, layer, source in self.db.execute(sql)
        ]

    # -- writing ---------------------------------------------------------------------------

    def record_step(
        self,
        record: StepRecord,
        *,
        samples: dict[str, bytes] | None = None,
        if_absent: bool = False,
        generation: int = 0,
    ) -> bool:
        """Write every row of ``record`` in one transaction: all of it becomes visible, or none.

        Tensor rows of inherited layers belong to their source step and are added only where
        the catalog lacks them (their step was dropped, or is not imported yet); rows of the
        step's own layers that an inheritor's import already added are left as they are. The
        same holds for the pack indexes of format-2 layers (``record.packs``). What
        the step added is ``record.added``, or, for records without it, the record's blobs
        this catalog did not know yet. ``samples``: parameter name -> update-statistics sample (commit.stats), kept
        only on the committing machine. Returns True; an existing step raises ConflictError,
        or returns False with ``if_absent`` (another process sharing the catalog recorded it).
        ``generation``: that of the manifest the record was read from (0: the commit's).
        """
        step = record.step
        with self.write_transaction():
            if self.is_recorded(step):
                if if_absent:
                    return False
                raise ConflictError(f"step {step} is already committed")
            # Rows of the step beside no steps row are left over (a lost steps row, a log replayed
            # onto another file): the record is what they index, so they make way for its rows.
            for table in ("layers", "files", "metrics"):
                self.db.execute(f"DELETE FROM {table} WHERE step = ?", [step])
            rows = []
            for source, source_rows in group_by_source(record.tensors).items():
                present = (
                    set()
                    if source == step
                    else {
                        layer
                        for (layer,) in self.db.execute(
                            "SELECT DISTINCT layer FROM tensors WHERE step = ?", [source]
                        )
                    }
                )
                rows.extend(row for row in source_rows if row.layer not in present)
            present_packs = {
                (source, layer)
                for source in {index.step for index in record.packs.values()}
                for (layer,) in self.db.execute("SELECT layer FROM layer_packs WHERE step = ?", [source])
            }
            new_packs = [i for i in record.packs.values() if (i.step, i.layer) not in present_packs]
            # Whether every row the step uses is written here, from the record: none to check then.
            written_here = (
                len(rows) == len(record.tensors)
                and len(new_packs) == len(record.packs)
                and self.db.execute("SELECT 1 FROM tensors WHERE step = ? LIMIT 1", [step]).fetchone() is None
            )
            if record.added is not None:
                blobs_added, bytes_added = record.added
            else:
                known = self.blob_sizes(b.key for b in record.blobs)
                new = [b for b in record.blobs if b.key not in known]
                blobs_added, bytes_added = len(new), sum(b.size for b in new)
            self.db["steps"].insert(
                {
                    "step": step,
                    "created_at": record.created_at,
                    "world_size": record.world_size,
                    "description": record.description,
                    "layers_saved": len(record.layers_saved),
                    "bytes_added": bytes_added,
                    "blobs_added": blobs_added,
                    "weights_only": record.weights_only,
                    "commit_seconds": record.seconds,
                    "stall_seconds": record.stall,
                    "not_committed": json.dumps(record.not_committed) if record.not_committed else None,
                    "generation": generation,
                    "rows_digest": digests.of_parts(
                        digests.record_parts(record), step, generation, self.content_hash
                    ),
                }
            )
            unmeasured = (None, None)
            self.db["layers"].insert_all(
                {"step": step, "layer": layer, "position": i, "source_step": source,
                 "update_since": record.updates.get(layer, unmeasured)[0],
                 "update_size": record.updates.get(layer, unmeasured)[1]}
                for i, (layer, source) in enumerate(record.layer_sources.items())
            )  # fmt: skip
            self.db["tensors"].insert_all(
                ({"step": t.step, "layer": t.layer, "name": t.name, "kind": t.kind,
                  "start": t.start, "numel": t.numel, "blob": t.blob}
                 for t in rows),
                ignore=True,
            )  # fmt: skip
            self.db["blobs"].insert_all(
                (
                    {"key": b.key, "size": b.size, "raw_size": b.raw_size, "first_step": step}
                    for b in record.blobs
                ),
                ignore=True,
            )
            self.db["layer_packs"].insert_all(
                {"step": i.step, "layer": i.layer, "size": i.size, "raw_size": i.raw_size,
                 "packs": getattr(i, "encoded", None) or layerpacks.encode(i)}
                for i in new_packs
            )  # fmt: skip
            self.db["samples"].insert_all(
                {"step": step, "layer": layer_of(name), "name": name, "sample": sample}
                for name, sample in (samples or {}).items()
            )
            self.db["files"].insert_all(
                {"step": step, "path": f.path, "key": f.key, "size": f.size} for f in record.files
            )
            self.db["metrics"].insert_all(
                {"step": step, "name": name, "value": value} for name, value in record.metrics.items()
            )
        if written_here:
            self._checked.add(step)
            self._checked_units.update((source, layer) for layer, source in record.layer_sources.items())
        return True

    def drop_steps(self, steps: Iterable[int]) -> None:
        """Remove step records in one transaction, keeping tensor rows that kept steps inherit."""
        steps = list(steps)
        self._checked.difference_update(steps)
        steps_json = json.dumps(steps)
        with self.write_transaction():
            self.db.execute("DELETE FROM steps WHERE step IN (SELECT value FROM json_each(?))", [steps_json])
            self.db.execute("DELETE FROM layers WHERE step IN (SELECT value FROM json_each(?))", [steps_json])
            # Tensor rows and the samples describing them stay while a kept step inherits the layer.
            for table in ("tensors", "layer_packs", "samples"):
                self.db.execute(
                    f"""
                    DELETE FROM {table}
                    WHERE step IN (SELECT value FROM json_each(?))
                      AND NOT EXISTS (
                          SELECT 1 FROM layers l WHERE l.source_step = {table}.step AND l.layer = {table}.layer
                      )
                    """,
                    [steps_json],
                )
            self.db.execute("DELETE FROM files WHERE step IN (SELECT value FROM json_each(?))", [steps_json])
            self.db.execute(
                "DELETE FROM metrics WHERE step IN (SELECT value FROM json_each(?))", [steps_json]
            )
            self.db.execute(
                "DELETE FROM listed_steps WHERE step IN (SELECT value FROM json_each(?))", [steps_json]
            )

    def forget_blobs(self, keys: Iterable[str]) -> None:
        """Drop the size records of blobs that were deleted from the store."""
        with self.write_transaction():
            self.db.execute(
                "DELETE FROM blobs WHERE key IN (SELECT value FROM json_each(?))", [json.dumps(list(keys))]
            )


def _summary(steps: list[int]) -> str:
    if len(steps) <= 8:
        return ", ".join(map(str, steps))
    return f"{', '.join(map(str, steps[:3]))}, ... {', '.join(map(str, steps[-3:]))} ({len(steps)} in all)"
