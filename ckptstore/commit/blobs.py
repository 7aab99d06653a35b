"""A rank's pieces into blobs: hashed, encoded and stored in parallel, each at most once.

More threads than cores run at once, so that fsyncs and uploads overlap compression, while a
semaphore of CPU slots keeps the hashing and compressing threads to one per core. Every rank
on this machine commits at the same time, so each takes its share of the slots.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import knobs
from ..format import codec
from ..format.layout import blob_name
from ..layers import layer_of
from ..model import BlobRow, Piece, TensorRow
from ..objects import ObjectStore, data_size
from .background import lower_thread_priority


@dataclass
class StoredPieces:
    """What storing pieces gave: a row per stored tensor, each distinct blob's sizes, and
    the blobs this call created (key -> stored size; the others already existed)."""

    rows: list[TensorRow] = field(default_factory=list)
    blobs: dict[str, BlobRow] = field(default_factory=dict)
    created: dict[str, int] = field(default_factory=dict)


def store_pieces(
    objects: ObjectStore, step: int, pieces: list[Piece], *, background: bool = False
) -> StoredPieces:
    """Store every piece that is not ``redundant``; durable when it returns.

    ``background`` (a non-blocking commit) runs the work at a lower CPU priority. Rows keep the
    order of ``pieces``. Raises what the object store raises (nothing is recorded anyway).
    """
    cpu = threading.BoundedSemaphore(max(1, knobs.cpu_threads() // knobs.ranks_on_this_machine()))

    def store(piece: Piece) -> tuple[TensorRow, BlobRow, bool] | None:
        with cpu:
            if piece.redundant():
                return None  # a module weight that is its fp32 master cast down
            key = codec.tensor_key(piece.tensor)
        name = blob_name(key)
        created = False
        # Hashing is cheap, compressing is not: an existing blob is only freshened.
        size = objects.touch(name)
        if size is None:
            with cpu:
                key, parts = codec.encode_parts(piece.tensor, key)
            created = objects.put_if_absent(name, parts)
            size = data_size(parts)
        row = TensorRow(
            step, layer_of(piece.name), piece.name, piece.kind, piece.start, piece.tensor.numel(), key
        )
        return row, BlobRow(key, size, piece.nbytes), created

    with ThreadPoolExecutor(
        knobs.io_threads(), initializer=lower_thread_priority if background else None
    ) as pool:
        # Largest first, so that no big tensor starts last while the other threads sit idle.
        tasks = {id(p): pool.submit(store, p) for p in sorted(pieces, key=lambda p: p.nbytes, reverse=True)}
        stored = StoredPieces()
        for piece in pieces:
            result = tasks[id(piece)].result()
            if result is not None:
                row, blob, created = result
                stored.rows.append(row)
                stored.blobs[blob.key] = blob
                if created:
                    stored.created[blob.key] = blob.size
    return stored
