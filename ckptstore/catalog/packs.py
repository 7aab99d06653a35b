"""The catalog's queries of format-2 pack indexes (``layer_packs`` rows): what a step needs.

A mixin of ``index.Catalog``, which supplies the connection (``db``) and the import of listed
steps (``load``); ``Catalog.record_step`` writes the rows.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from ..errors import CorruptError
from ..format import layerpacks
from ..model import LayerPacks, PackRef


class LayerPackQueries:
    """Reading the ``layer_packs`` table (see the module doc)."""

    def layer_packs(self, step: int, layers: Iterable[str] | None = None) -> list[LayerPacks]:
        """The pack indexes of layers that ``step`` itself saved in format 2 (optionally only
        ``layers``), in no particular order, once the steps that use them are checked
        (CorruptError: ``check_rows``)."""
        layers = None if layers is None else list(layers)
        self._check_units(step, layers)
        rows = self.db.execute("SELECT layer, packs FROM layer_packs WHERE step = ?", [step]).fetchall()
        wanted = None if layers is None else set(layers)
        if not rows:
            return []
        numels = self._source_numels(step)
        return [
            layerpacks.decode(data, step, layer, numels)
            for layer, data in rows
            if wanted is None or layer in wanted
        ]

    def _used_layer_packs(
        self, steps: Iterable[int] | None, problems: list[str] | None = None
    ) -> Iterable[tuple[int, LayerPacks]]:
        """(using step, pack index) for every format-2 layer the given steps (all: None) use.
        An index that cannot be decoded raises CorruptError, or with ``problems`` is described
        there and left out."""
        self.load(None if steps is None else list(steps))
        sql = """
            SELECT l.step, p.step, p.layer, p.packs
            FROM layers l JOIN layer_packs p ON p.step = l.source_step AND p.layer = l.layer
        """
        params = []
        if steps is not None:
            sql += " WHERE l.step IN (SELECT value FROM json_each(?))"
            params.append(json.dumps(list(steps)))
        decoded: dict[tuple[int, str], LayerPacks | None] = {}
        numels: dict[int, dict[str, int]] = {}  # source step -> what bounds its indexes
        for step, source, layer, data in self.db.execute(sql + " ORDER BY l.step", params):
            if (source, layer) not in decoded:
                try:
                    if source not in numels:
                        numels[source] = self._source_numels(source)
                    decoded[(source, layer)] = layerpacks.decode(data, source, layer, numels[source])
                except CorruptError as exc:
                    if problems is None:
                        raise
                    problems.append(f"step {step} layer {layer}: {exc}")
                    decoded[(source, layer)] = None
            if decoded[(source, layer)] is not None:
                yield step, decoded[(source, layer)]

    def _source_numels(self, source: int) -> dict[str, int]:
        """Elements of each parameter, what bounds the pack indexes ``source`` saved
        (``layerpacks.decode``): from its own description, or once gc has dropped it while a
        composite still inherits its layers, from that of a step that does."""
        row = self.db.execute(
            """
            SELECT description FROM steps WHERE step = ?
            UNION ALL
            SELECT s.description FROM steps s JOIN layers l ON l.step = s.step WHERE l.source_step = ?
            LIMIT 1
            """,
            [source, source],
        ).fetchone()
        if row is None:
            raise CorruptError(f"no recorded step describes the layers step {source} saved")
        return layerpacks.numels(row[0])

    def packs_of_steps(self, steps: Iterable[int]) -> set[str]:
        """Every pack the given steps need, inherited layers included."""
        return {ref.key for _, index in self._used_layer_packs(list(steps)) for ref in index.all_packs}

    def referenced_packs(
        self, problems: list[str] | None = None
    ) -> dict[str, tuple[PackRef, list[tuple[int, str, str, str]]]]:
        """Every pack a committed step uses -> (its record, every (step, layer, name, kind) user),
        where ``name`` says whose pack it is and ``kind`` is ``pack``. A layer index that cannot
        be decoded raises CorruptError, or with ``problems`` is described there (verify)."""
        users: dict[str, tuple[PackRef, list[tuple[int, str, str, str]]]] = {}
        for step, index in self._used_layer_packs(None, problems):
            for ref in index.packs:
                entry = users.setdefault(ref.key, (ref, []))
                entry[1].append((step, index.layer, f"rank {ref.rank}'s tensors", "pack"))
            for ref in index.bases:
                entry = users.setdefault(ref.key, (ref, []))
                entry[1].append((step, index.layer, f"a base of rank {ref.rank}'s deltas", "pack"))
        return users
