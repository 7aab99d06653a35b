"""The check that a step's catalog rows are the ones its manifest gave, before a read uses them.

Each step's rows are kept with a digest of what its manifest gave them (``digests``: a tag
under the store's key when it has one, bound to step and generation). ``check_rows`` hashes
the rows again and compares, once per step and process; a step recorded before digests were
kept is compared with its manifest once and its digest stored.

A mixin of ``index.Catalog``, which supplies the connection (``db``), ``write_transaction``,
``path``, the store's ``content_hash``, ``manifest_parts`` (how a manifest's parts are read)
and the sets of steps (``_checked``) and layer indexes (``_checked_units``) checked so far.
"""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import Iterable

from ..errors import CorruptError, NotFoundError, StorageError
from . import digests


class RowChecks:
    """Rows compared with their digest (see the module doc)."""

    def check_rows(self, steps: Iterable[int]) -> None:
        """CorruptError naming the first of ``steps`` whose rows (description, layers, files,
        metrics, every layer index it uses) are not those its manifest gave: their digest
        differs from the one recorded with them (``digests``). Each step is checked once per
        catalog; steps not recorded are passed over. A step recorded before digests were kept
        is compared with its manifest (``manifest_parts``) and its digest kept."""
        memo: dict[tuple[int, str], bytes] = {}
        for step in steps:
            if step in self._checked:
                continue
            # No transaction around the reads (a background commit may hold this connection's):
            # rows another process replaced meanwhile are read again once before they count.
            for attempt in (0, 1):
                found = self._rows_digest(step, memo if attempt == 0 else {})
                if found is None:
                    break
                generation, digest, recorded = found
                if recorded is None:
                    recorded = self._digest_from_manifest(step, generation)
                if recorded is None or hmac.compare_digest(digest, bytes(recorded)):
                    break
                if attempt:
                    raise CorruptError(
                        f"the catalog's rows of step {step} are not what its manifest says (the catalog "
                        f"{self.path} was changed or damaged): run `ckptstore catalog rebuild`"
                    )
            if found is not None:
                self._checked.add(step)
                sql = "SELECT source_step, layer FROM layers WHERE step = ?"
                self._checked_units.update(self.db.execute(sql, [step]).fetchall())

    def _rows_digest(
        self, step: int, memo: dict[tuple[int, str], bytes]
    ) -> tuple[int, bytes, bytes | None] | None:
        """(generation, digest of the rows now, digest recorded with them) of ``step``; None if
        it is not recorded."""
        row = self.db.execute("SELECT generation, rows_digest FROM steps WHERE step = ?", [step]).fetchone()
        parts = digests.row_parts(self.db, step, memo)
        if row is None or parts is None:
            return None
        return row[0], digests.of_parts(parts, step, row[0], self.content_hash), row[1]

    def _check_units(self, source: int, layers: list[str] | None) -> None:
        """Check (``check_rows``) a step that uses each index ``source`` saved of ``layers``
        (all: None) that no step checked already covers."""
        if layers is not None and all((source, layer) in self._checked_units for layer in layers):
            return
        wanted = None if layers is None else set(layers)
        users: dict[str, int] = {}
        for step, layer in self.db.execute("SELECT step, layer FROM layers WHERE source_step = ?", [source]):
            if (wanted is None or layer in wanted) and (source, layer) not in self._checked_units:
                users[layer] = min(step, users.get(layer, step))
        self.check_rows(sorted(set(users.values())))

    def _digest_from_manifest(self, step: int, generation: int) -> bytes | None:
        """The digest of ``step``'s rows as its manifest of ``generation`` gives them, kept with
        them from now on; None where this catalog cannot read manifests (opened on its own)."""
        if self.manifest_parts is None:
            return None
        try:
            parts = self.manifest_parts(step, generation)
        except NotFoundError as exc:
            raise CorruptError(f"the catalog's rows of step {step} cannot be checked: {exc}") from None
        digest = digests.of_parts(parts, step, generation, self.content_hash)
        with contextlib.suppress(StorageError):  # a catalog that cannot be written compares again next time
            with self.write_transaction():
                self.db.execute(
                    "UPDATE steps SET rows_digest = ? WHERE step = ? AND generation = ? AND rows_digest IS NULL",
                    [digest, step, generation],
                )
        return digest

    def row_parts(self, step: int) -> digests.Parts | None:
        """The parts of ``step``'s rows (``digests.row_parts``), unchecked: what ``verify``
        compares with the manifest, field by field. None if the step is not recorded."""
        return digests.row_parts(self.db, step)
