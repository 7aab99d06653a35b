"""What ties a step's catalog rows to its manifest: a digest of the rows its reads use.

The catalog is an index of the manifests, never a second truth. When a step is recorded, from
its manifest (an import) or from the record its commit writes as the manifest, the digest of
that record's *parts* is kept with the step (``steps.rows_digest``); before a read uses the
step's rows, the same parts are taken from the rows and their digest compared
(``index.Catalog.check_rows``). The parts are everything a read takes: the description, creation
time, world size, weights-only mark, the layers in order with their source steps and update
statistics, the auxiliary files, the metrics, and each layer's stored index as its source step
saved it (a pack index's bytes, or a format-1 layer's tensor rows). A flipped byte in any of
them no longer matches.

In a store with a key the digest is a tag under the store's key (``ContentHash.tag``), bound
to the step and the manifest generation the rows came from: someone who can write the catalog
but holds no key cannot make rows that match, so the rows used are those of an authentic
manifest. Without a key it is a plain BLAKE3 digest: it catches accidents, not a writer.

Each layer's index is hashed on its own first (a 32-byte digest), so that checking many steps
that share layers hashes each shared index once (``memo``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable

import blake3

from ..format import layerpacks
from ..hashing import ContentHash
from ..model import StepRecord

Parts = dict[str, bytes]


def of_parts(parts: Parts, step: int, generation: int, content_hash: ContentHash) -> bytes:
    """The digest of ``parts`` (``record_parts`` or ``row_parts``) of ``step``'s rows from its
    manifest of ``generation``: keyed with the store's key when it has one."""
    hasher = blake3.blake3()
    _feed(hasher, *(chunk for name, data in parts.items() for chunk in (name.encode(), data)))
    name = f"catalog-rows/{step}.{generation}"
    if content_hash.authenticated:
        return content_hash.tag(name, hasher.digest())
    bound = blake3.blake3()
    _feed(bound, name.encode(), hasher.digest())
    return bound.digest()


def record_parts(record: StepRecord) -> Parts:
    """The parts of the rows ``record`` gives its step (``Catalog.record_step``)."""
    tensors: dict[tuple[int, str], list[list]] = {}
    for t in record.tensors:
        tensors.setdefault((t.step, t.layer), []).append([t.name, t.kind, t.start, t.numel, t.blob])
    units = {}
    for layer, source in record.layer_sources.items():
        index = record.packs.get(layer)
        pack = (
            None
            if index is None or index.step != source
            else (index.size, index.raw_size, layerpacks.encode(index))
        )
        units[layer] = (pack, tensors.get((source, layer), []))
    return _parts(
        [
            record.created_at,
            record.world_size,
            record.description,
            int(record.weights_only),
            record.seconds,
            record.stall,
            [list(pair) for pair in record.not_committed],
        ],  # fmt: skip
        [
            [layer, source, *record.updates.get(layer, (None, None))]
            for layer, source in record.layer_sources.items()
        ],
        [[f.path, f.key, f.size] for f in record.files],
        list(record.metrics.items()),
        units,
    )


def row_parts(db, step: int, memo: dict[tuple[int, str], bytes] | None = None) -> Parts | None:
    """The parts of the rows the catalog ``db`` holds for ``step`` (None if it holds no step
    row). ``memo`` keeps each layer index's digest by (source step, layer) across calls."""
    row = db.execute(
        "SELECT created_at, world_size, description, weights_only, commit_seconds, stall_seconds, not_committed "
        "FROM steps WHERE step = ?",
        [step],
    ).fetchone()
    if row is None:
        return None
    layers = db.execute(
        "SELECT layer, source_step, update_since, update_size FROM layers WHERE step = ? ORDER BY position",
        [step],
    ).fetchall()
    memo = {} if memo is None else memo
    wanted = json.dumps(sorted({(source, layer) for layer, source, _, _ in layers} - set(memo)))
    packs, tensors = {}, {}
    if wanted != "[]":
        pairs = "SELECT json_extract(value, '$[0]') AS step, json_extract(value, '$[1]') AS layer FROM json_each(?)"
        for source, layer, size, raw_size, data in db.execute(
            f"SELECT p.step, p.layer, p.size, p.raw_size, p.packs FROM layer_packs p JOIN ({pairs}) w "
            "ON p.step = w.step AND p.layer = w.layer",
            [wanted],
        ):
            packs[(source, layer)] = (size, raw_size, bytes(data))
        for source, layer, *rest in db.execute(
            f"SELECT t.step, t.layer, t.name, t.kind, t.start, t.numel, t.blob FROM tensors t JOIN ({pairs}) w "
            "ON t.step = w.step AND t.layer = w.layer",
            [wanted],
        ):
            tensors.setdefault((source, layer), []).append(rest)
        for unit in json.loads(wanted):
            unit = tuple(unit)
            memo[unit] = _unit_digest(packs.get(unit), tensors.get(unit, []))
    return _parts(
        [*row[:3], int(row[3]), row[4], row[5], json.loads(row[6] or "[]")],
        [list(layer) for layer in layers],
        db.execute("SELECT path, key, size FROM files WHERE step = ?", [step]).fetchall(),
        db.execute("SELECT name, value FROM metrics WHERE step = ?", [step]).fetchall(),
        {layer: memo[(source, layer)] for layer, source, _, _ in layers},
        hashed=True,
    )


def differences(expected: Parts, found: Parts) -> list[str]:
    """What differs between two sets of parts, by name ("the description", "layer X's stored
    index"), for ``verify``."""
    return [name for name in dict.fromkeys([*expected, *found]) if expected.get(name) != found.get(name)]


def _parts(
    step: list, layers: Iterable, files: Iterable, metrics: Iterable, units: dict, *, hashed: bool = False
) -> Parts:
    created_at, world_size, description, weights_only, seconds, stall, not_committed = step
    parts = {
        "the description": description.encode(),
        "the creation time": _json(created_at),
        "the world size": _json(world_size),
        "the weights-only mark": _json(weights_only),
        "the layers and their source steps": _json([[layer, source] for layer, source, *_ in layers]),
        "the update statistics": _json([[since, _number(size)] for _, _, since, size in layers]),
        "the auxiliary files": _json(sorted([list(f) for f in files])),
        "the metrics": _json(sorted([name, _number(value)] for name, value in metrics)),
    }
    if seconds is not None:  # a part only where recorded: older steps' digests stay as they were
        parts["the commit duration"] = _json(_number(seconds))
    if stall is not None:
        parts["the training stall"] = _json(_number(stall))
    if not_committed:
        parts["the steps not committed"] = _json(not_committed)
    for layer, unit in units.items():
        parts[f"layer {layer}'s stored index"] = unit if hashed else _unit_digest(*unit)
    return parts


def _unit_digest(pack: tuple | None, tensors: list) -> bytes:
    """The digest of one layer's stored index: its pack index (sizes and bytes) or tensor rows."""
    hasher = blake3.blake3()
    if pack is not None:
        size, raw_size, data = pack
        _feed(hasher, b"packs", _json([size, raw_size]), data)
    _feed(hasher, b"tensors", _json(sorted(list(t) for t in tensors)))
    return hasher.digest()


def _number(value):
    # SQLite keeps a NaN as NULL (a metric that was not finite).
    return None if isinstance(value, float) and math.isnan(value) else value


def _json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def _feed(hasher, *chunks: bytes) -> None:
    # Each chunk after its length, so that no two sequences of chunks feed the same bytes; one
    # update (a call per chunk costs more than hashing the bytes of a step's small ones).
    hasher.update(b"".join(part for chunk in chunks for part in (len(chunk).to_bytes(8, "little"), chunk)))
