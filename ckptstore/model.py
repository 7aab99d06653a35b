"""The vocabulary every part shares: pieces of engine state, catalog rows, and the step record.

A *piece* is one stored tensor: the ``kind`` of data (``fp32`` master, module ``weight``,
``buffer``, or an optimizer state name such as ``exp_avg``) of one named parameter or buffer,
either whole (in its own shape) or as a 1-D fragment starting at element ``start`` of the
flattened tensor (what one data-parallel rank owns). Pieces never depend on how an engine
flattened and padded its groups, so they can be cut again for any world size.

A ``StepRecord`` is everything the store keeps about one committed step. A commit builds it
once; the manifest format encodes it, the catalog records it, and the commit point publishes it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

# What a non-blocking commit does while the previous one still runs (``commit.queue``), and
# what became of a step it did not commit.
WAIT, LATEST, SKIP = "wait", "latest", "skip"
WHEN_BUSY = (WAIT, LATEST, SKIP)
REPLACED, SKIPPED = "replaced", "skipped"

# Kinds of stored tensors besides optimizer state names such as ``exp_avg``.
FP32 = "fp32"
WEIGHT = "weight"
BUFFER = "buffer"


@dataclass
class Piece:
    """One tensor to store: ``kind`` of ``name``, whole (start 0, full shape) or a 1-D fragment.

    A module weight that may just be its fp32 master cast down carries that master as
    ``unless_equal_to``: it is stored only if ``unless_equal_to.to(tensor.dtype)`` differs
    from it (``redundant``). The comparison is left to the commit so it can run after the
    snapshot, off the training loop.
    """

    name: str
    kind: str
    start: int
    tensor: torch.Tensor
    unless_equal_to: torch.Tensor | None = None

    @classmethod
    def cut(cls, name: str, kind: str, start: int, chunk: torch.Tensor, shape, **extra) -> Piece:
        """The piece of ``chunk`` (1-D, elements ``start``.. of ``name``'s flattened tensor of
        ``shape``): whole in its own shape when it covers the tensor, else a fragment."""
        if start == 0 and chunk.numel() == torch.Size(shape).numel():
            return cls(name, kind, 0, chunk.view(shape), **extra)
        return cls(name, kind, start, chunk, **extra)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data."""
        return self.tensor.numel() * self.tensor.element_size()

    def redundant(self) -> bool:
        """Whether this piece can be rebuilt from ``unless_equal_to`` and need not be stored."""
        if self.unless_equal_to is None:
            return False
        return torch.equal(self.unless_equal_to.reshape(-1).to(self.tensor.dtype), self.tensor.reshape(-1))


@dataclass
class Snapshot:
    """What one rank extracted from an engine: the step description and its pieces.

    The *description* (a plain JSON-compatible dict) says everything else a writer needs: the
    optimizer flavour, the groups and their parameter order, hyperparameters and step counters,
    module key order, aliases, and the non-tensor state (scheduler, counters, client state).
    """

    description: dict
    pieces: list[Piece]
    rank: int
    world_size: int
    # Where each model-parallel rank (a pipeline stage, a tensor slice) describes only its own
    # part: joins the parts of every model-parallel rank into the step's one description.
    combine: Callable[[list[dict]], dict] | None = None
    # Whether this rank sends its part to ``combine`` (None: data-parallel rank 0 does, the
    # first rank of each model-parallel part); the ranks of different parts must all send.
    sends_part: bool | None = None


@dataclass(frozen=True)
class QueueFigures:
    """What the queue of a non-blocking commit measured and decided, for its record: the
    seconds it held training (its call, and the optimizer step's wait for its snapshot copy),
    and the steps since the previous commit it did not commit (step, REPLACED or SKIPPED)."""

    stall: float | None
    not_committed: tuple[tuple[int, str], ...] = ()


@dataclass(frozen=True)
class Weight:
    """One state-dict entry: its name, the stored kind it is read from, and its shape
    (None for a buffer, whose shape is known once read)."""

    name: str
    kind: str
    shape: tuple[int, ...] | None


@dataclass(frozen=True)
class TensorRow:
    """One stored tensor (or fragment) of a layer saved at ``step``."""

    step: int
    layer: str
    name: str
    kind: str
    start: int
    numel: int
    blob: str


@dataclass(frozen=True)
class BlobRow:
    """A blob's key with its stored and uncompressed sizes."""

    key: str
    size: int
    raw_size: int


@dataclass(frozen=True)
class FileRow:
    """An auxiliary file of a step: its path in the checkpoint directory, content key and size."""

    path: str
    key: str
    size: int


@dataclass(frozen=True)
class LayerRow:
    """One layer of a step, as ``ckptstore show`` shows it.

    ``bytes``/``raw_bytes``: stored and uncompressed size of the layer's distinct blobs at
    ``source``; ``update``: its relative change since ``update_since`` measured at this step.
    """

    layer: str
    source: int
    bytes: int
    raw_bytes: int
    update: float | None
    update_since: int | None


@dataclass(frozen=True)
class StepRow:
    """Summary of a committed step, as ``ckptstore log`` shows it."""

    step: int
    created_at: str
    world_size: int
    layers_saved: int
    layers_total: int
    bytes_added: int
    blobs_added: int
    # False for a weights-only step (gc kept its weights only): it exports, it does not resume
    resumable: bool = True
    # name -> value recorded with the step (commit(metrics=...)); None where it was not finite
    metrics: dict[str, float | None] = field(default_factory=dict)
    # seconds the commit took (its manifest's ``seconds``); None for steps recorded before that
    commit_seconds: float | None = None
    # seconds training was held for it (a non-blocking commit's ``stall``); None where not recorded
    stall_seconds: float | None = None
    # the steps since the committed one before that were not committed: (step, "replaced" or
    # "skipped"), as ``commit(when_busy=...)`` decided
    not_committed: list[tuple[int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class PackRef:
    """One pack of a layer: the tensors one rank saved of it (or a part of them, past a size)."""

    key: str
    rank: int
    size: int  # stored bytes
    raw_size: int  # bytes of the tensors it holds


# Columns of ``LayerPacks.fragments``.
TENSOR, PACK, START, NUMEL = range(4)


@dataclass(eq=False)
class LayerPacks:
    """Where every tensor of one layer saved at ``step`` is stored: the format-2 fragment index.

    ``tensors`` lists the layer's stored ``(name, kind, dtype)``; ``fragments`` has one row per
    stored piece, ``[tensor, pack, start, numel]`` (indexes into ``tensors`` and ``packs``),
    sorted by tensor and start. Arrays rather than rows: a ZeRO-3 layer on 512 ranks is
    thousands of fragments, and a step's index is read whole before anything is fetched.
    ``bases`` are the packs that its packs' delta entries need (``format.pack``), their
    bases' bases included: kept, fetched and checked with the layer, though no fragment
    is read from them directly.
    """

    step: int
    layer: str
    packs: list[PackRef]
    tensors: list[tuple[str, str, str]]
    fragments: np.ndarray  # int64, shape (n, 4)
    # Its bytes (format.layerpacks.encode), once decoded from or encoded to them: an index is
    # never changed once built, and compressing one again costs tens of milliseconds.
    encoded: bytes | None = field(default=None, repr=False)
    bases: list[PackRef] = field(default_factory=list)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LayerPacks):
            return NotImplemented
        return (self.step, self.layer, self.packs, self.tensors, self.bases) == (
            other.step, other.layer, other.packs, other.tensors, other.bases,
        ) and np.array_equal(self.fragments, other.fragments)  # fmt: skip

    @property
    def all_packs(self) -> list[PackRef]:
        """Every pack the layer needs: its own, then its bases."""
        return [*self.packs, *self.bases]

    @property
    def size(self) -> int:
        """Stored bytes of the layer's packs."""
        return sum(p.size for p in self.packs)

    @property
    def raw_size(self) -> int:
        """Bytes of the layer's tensors."""
        return sum(p.raw_size for p in self.packs)

    def by_tensor(self) -> dict[tuple[str, str], tuple[str, np.ndarray]]:
        """``(name, kind)`` -> (dtype, its fragment rows in start order)."""
        column = self.fragments[:, TENSOR]
        bounds = np.searchsorted(column, np.arange(len(self.tensors) + 1))
        return {
            (name, kind): (dtype, self.fragments[bounds[t] : bounds[t + 1]])
            for t, (name, kind, dtype) in enumerate(self.tensors)
        }


# layer -> (step compared with, relative update of its fp32 masters since then)
Updates = dict[str, tuple[int | None, float | None]]


#: The front doors a step comes in through: an engine commit (DeepSpeed), or DCP's ``dcp.save``
#: through ``StoreWriter``, whose descriptions say ``"format": "dcp"`` (DeepSpeed's have none).
DEEPSPEED_DOOR, DCP_DOOR = "deepspeed", "dcp"


def front_door(description: str | dict) -> str:
    """Which front door wrote a step, from its description (canonical JSON text, or parsed):
    ``DCP_DOOR`` or ``DEEPSPEED_DOOR``. What reads or extends a step routes on this, never on
    a door's own package."""
    if isinstance(description, str):
        description = json.loads(description)
    is_dcp = isinstance(description, dict) and description.get("format") == DCP_DOOR
    return DCP_DOOR if is_dcp else DEEPSPEED_DOOR


@dataclass
class StepRecord:
    """Everything the store keeps about one step, self-contained.

    Besides the tensors the step saved, ``tensors`` lists those its inherited layers use, each
    row carrying its source step, so the record alone rebuilds the step on another machine and
    dropping an older step never strands a composite one. ``blobs`` has the size of every blob
    ``tensors`` name. ``description`` is canonical JSON text (sorted keys, no whitespace).
    """

    step: int
    created_at: str
    world_size: int
    description: str
    layer_sources: dict[str, int]
    tensors: list[TensorRow]
    blobs: list[BlobRow]
    updates: Updates = field(default_factory=dict)
    files: list[FileRow] = field(default_factory=list)
    # Format 2: the fragment index of every layer stored in packs (own and inherited ones),
    # by layer; ``tensors`` and ``blobs`` then hold only layers inherited from format-1 steps.
    packs: dict[str, LayerPacks] = field(default_factory=dict)
    # (blobs, bytes) the commit added to the store, as the committing machine counted them;
    # None in manifests written before it was recorded.
    added: tuple[int, int] | None = None
    # name -> value (commit(metrics=...)); None for a value that was not finite
    metrics: dict[str, float | None] = field(default_factory=dict)
    # gc kept only what exporting the weights needs (``ckptstore.thin``): no longer resumable
    weights_only: bool = False
    # A step committed again after a deletion: the generation deleted (``format.deletions``)
    supersedes: int | None = None
    # Seconds from sampling the engine to the record (snapshot, encode, hash, writing the
    # packs), as the committing machine measured them; None in manifests written before.
    seconds: float | None = None
    # Seconds a non-blocking commit held training: its call, and the optimizer step's wait for
    # its snapshot copy (None for a blocking commit: all of ``seconds``).
    stall: float | None = None
    # Steps since the previous committed one that were not committed: (step, REPLACED or
    # SKIPPED), as ``commit(when_busy=...)`` decided on every rank.
    not_committed: list[tuple[int, str]] = field(default_factory=list)

    @property
    def front_door(self) -> str:
        """Which front door wrote this step (``front_door``)."""
        return front_door(self.description)

    @property
    def layers_saved(self) -> list[str]:
        """The layers this step saved itself (the others it inherits)."""
        return [layer for layer, source in self.layer_sources.items() if source == self.step]

    def tensors_by_source(self) -> dict[int, list[TensorRow]]:
        """The tensor rows grouped by the step that saved them."""
        return group_by_source(self.tensors)


def group_by_source(rows: list[TensorRow]) -> dict[int, list[TensorRow]]:
    """``rows`` grouped by the step that saved them, in first-appearance order."""
    grouped: dict[int, list[TensorRow]] = defaultdict(list)
    for row in rows:
        grouped[row.step].append(row)
    return dict(grouped)


def layers_by_source(layer_sources: dict[str, int]) -> dict[int, list[str]]:
    """Source step -> the layers that come from it, in model order."""
    grouped: dict[int, list[str]] = defaultdict(list)
    for layer, source in layer_sources.items():
        grouped[source].append(layer)
    return dict(grouped)
