"""A checkpoint held in memory: built for one rank, loaded by DeepSpeed's own ``load_checkpoint``.

DeepSpeed decides what to read by file name (``latest``, globs of the tag folder) and reads
each file through ``engine.checkpoint_engine.load``. So a private folder of empty files with
the checkpoint's names, and a checkpoint engine that answers ``load`` from memory, let
``load_checkpoint`` run unchanged, every option included, without a byte of tensor data on
disk. A rank is handed only the files it reads (its own ZeRO partition and the model states);
with the optimizer state loaded, the module weights that are the fp32 masters cast down need
not be read at all: ``update_lp_params`` derives them from the masters and all-gathers them,
as the optimizer does after every step.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import pathnames
from ..errors import CorruptError
from ..model import FP32, WEIGHT
from . import experts, parallel
from .fill import MODULE, Filler, TensorSource
from .layout import BF16_OPTIMIZER, ZERO3, ZERO12
from .stepfiles import StepWriter
from .write import model_states_name


@functools.cache
def _memory_engine_class() -> type:
    # Made once, at module level in effect: a class made per call would sit in a reference
    # cycle holding its files (a rank's whole share) until the next garbage collection.
    from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine

    class MemoryCheckpointEngine(CheckpointEngine):
        """Answers ``load(path)`` with the object of the file of that name."""

        def __init__(self, files: dict[str, object | None]) -> None:
            super().__init__()
            self.name = "ckptstore-restore"
            self.files = files

        def create(self, info) -> None:
            raise RuntimeError("a restore in progress cannot save")

        def save(self, state_dict, path: str) -> None:
            raise RuntimeError("a restore in progress cannot save")

        def load(self, path: str, map_location=None) -> Any:
            obj = self.files.get(Path(path).name)
            if obj is None:
                raise CorruptError(
                    f"restore: DeepSpeed asked for {Path(path).name}, which this rank does not read"
                )
            return obj

        def commit(self, info) -> bool:
            return True

    return MemoryCheckpointEngine


class RankShare:
    """The checkpoint files one rank of a job reads, built in memory: ``files`` maps each file
    name to its object (``write.Writer``'s, placeholders where stored tensors go), or to None
    for the files other ranks read. ``rank`` is its data-parallel rank, ``mp_rank`` its
    model-parallel one (a pipeline stage), ``slices`` its stage's tensor-parallel degree (whose
    layer files a re-cut description, one rank's part, lists by name). ``fill`` then reads
    into the placeholders only the elements of stored tensors this rank's files hold.

    ``skip_module_weights`` (kept as an attribute) leaves the module weights that are fp32
    masters cast down unread, for the caller to derive after the load; ``into``
    (``engine_tensors``) are the engine's own tensors, filled or handed over in place of
    copies of them, so the load copies each onto itself."""

    def __init__(
        self,
        description: dict,
        tensors: TensorSource,
        world_size: int,
        rank: int,
        *,
        skip_module_weights: bool,
        into: dict[tuple, torch.Tensor] | None = None,
        mp_rank: int = 0,
        slices: int = 1,
    ) -> None:
        writer = StepWriter(description, tensors, world_size, into, mp_ranks=[mp_rank])
        self.files: dict[str, object | None] = {
            name: obj if _reads(reader, rank) else None for name, obj, (_, reader) in writer.files()
        }
        _bf16_zero0_optimizer(description, self.files, rank, mp_rank)
        own = set(self.files)
        # DeepSpeed lists every model-parallel rank's model-states file and opens the first on
        # every rank, only to check their number against the mp_world_size saved in it.
        for other in range(writer.mp_size):
            if other != mp_rank:
                self.files[model_states_name(other)] = (
                    {"mp_world_size": writer.mp_size} if other == 0 else None
                )
        # A stage's PipelineModule lists each layer's files of every tensor-parallel rank
        # (layer_XX-*model_states.pt) and opens the first only to look for an mp_world_size in
        # it (SDLoaderBase.check_ckpt_list); listed fewer than its TP degree, it would split
        # this rank's file among them.
        for names in parallel.layer_file_names(description, slices).values():
            for name in names:
                self.files.setdefault(name, None)
            if self.files[names[0]] is None and any(name in own for name in names):
                self.files[names[0]] = {}
        self._tensors = tensors
        self._filler = Filler(writer.holes, tensors, writer.params)
        self._targets = self._filler.in_memory([obj for obj in self.files.values() if obj is not None])
        self.skip_module_weights = skip_module_weights
        # Whether a fill writes into the engine's own tensors.
        self.in_place = writer.holes.reused > 0
        # Whether the module weights may be derived from the masters while the rest is read:
        # when they are left unread and every one is the engine's own parameter, not a
        # placeholder that the load would copy over the derived weights.
        self.overlaps = skip_module_weights and not any(
            segment.kind == MODULE for _, segments in writer.holes.segments.values() for segment in segments
        )

    def fill(self, kinds: Callable[[str], bool] = lambda kind: True, desc: str = "restore") -> None:
        """Fill the placeholders of the segments of the stored kinds ``kinds`` accepts."""
        skip_module = self.skip_module_weights

        def skip(segment) -> bool:
            return not kinds(segment.kind) or (skip_module and segment.kind == MODULE)

        plan = getattr(self._tensors, "plan", None)
        if plan is not None:
            plan(self._spans(skip))
        self._filler.fill_in_memory(self._targets, skip, desc=desc)

    def objects(self) -> dict[str, int]:
        """The stored objects (name -> stored size) a fill of every kind reads, without reading any."""
        skip_module = self.skip_module_weights
        return self._tensors.objects(self._spans(lambda segment: skip_module and segment.kind == MODULE))

    def _spans(self, skip: Callable) -> list[tuple[str, str, int, int]]:
        """``(name, kind, lo, hi)``: the stored elements a fill reads, each kind of a parameter
        as one span from its first segment's start to its last one's end (``Filler``'s reads);
        a module weight is read as its fp32 master and whatever weight is stored apart."""
        spans: dict[tuple[str, str], tuple[int, int]] = {}

        def add(name: str, kind: str, lo: int, hi: int) -> None:
            known = spans.get((name, kind))
            spans[(name, kind)] = (lo, hi) if known is None else (min(known[0], lo), max(known[1], hi))

        for _, segments, _ in self._targets:
            for segment in segments:
                if skip(segment):
                    continue
                end = segment.source_start + segment.length
                if segment.kind == MODULE:
                    add(segment.name, FP32, segment.source_start, end)
                    add(segment.name, WEIGHT, 0, end)
                else:
                    add(segment.name, segment.kind, segment.source_start, end)
        return [(name, kind, lo, hi) for (name, kind), (lo, hi) in spans.items()]


def _reads(reader: int | tuple[int, ...] | None, rank: int) -> bool:
    return reader is None or reader == rank or (isinstance(reader, tuple) and rank in reader)


def _bf16_zero0_optimizer(
    description: dict, files: dict[str, object | None], rank: int, mp_rank: int
) -> None:
    """BF16_Optimizer at ZeRO 0 (a pipeline's): DeepSpeed's load hands the model-states file's
    ``optimizer`` (data-parallel rank 0's state, as saved) to ``BF16_Optimizer.load_state_dict``,
    which indexes it by data-parallel rank as if it were ZeRO's list of files (DeepSpeed 0.19
    fails so on its own save): this rank's own state goes there, under its rank."""
    if description["flavour"] != BF16_OPTIMIZER or description["zero_stage"] != 0:
        return
    states = files[model_states_name(mp_rank)]
    own = [obj for name, obj in files.items() if name.endswith("_optim_states.pt") and obj is not None]
    if isinstance(states, dict) and len(own) == 1:
        states["optimizer"] = {rank: own[0]["optimizer_state_dict"]}


def load_from_memory(
    engine: Any,
    load_checkpoint,
    files: dict[str, object | None],
    tag: str,
    **options: Any,
) -> tuple[str | None, dict | None]:
    """``load_checkpoint`` (the engine's own, unwrapped) of a checkpoint whose files are
    ``files`` (name -> object, None for another rank's file), with ``options`` as
    ``load_checkpoint`` takes them; returns what it returns."""
    with tempfile.TemporaryDirectory(prefix="ckptstore-restore-") as scratch:
        folder = Path(scratch) / tag
        folder.mkdir()
        for name in files:
            pathnames.new_file(
                pathnames.join(folder, name, "a file of the step", flat=True), "a file of the step"
            )
        (Path(scratch) / "latest").write_text(tag)
        own_engine = engine.checkpoint_engine
        engine.checkpoint_engine = _memory_engine_class()(files)
        try:
            path, client_state = load_checkpoint(scratch, tag=tag, **options)
        finally:
            engine.checkpoint_engine = own_engine
    if path is None:
        raise CorruptError("DeepSpeed found no checkpoint in what restore handed it")
    return path, client_state


def derives_module_weights(engine: Any, flavour: str, options: dict) -> bool:
    """Whether a load with ``options`` sets the module weights from the fp32 masters it loads
    (ZeRO 1 and 2 loading optimizer state from fp32 weights), so they need not be read."""
    return (
        flavour in (ZERO12, BF16_OPTIMIZER)
        and options.get("load_optimizer_states", True)
        and not options.get("load_module_only", False)
        and engine.zero_load_from_fp32_weights()
        and hasattr(engine.optimizer, "update_lp_params")
    )


def loads_partitions(engine: Any, flavour: str, options: dict) -> bool:
    """Whether a load with ``options`` copies the checkpoint's fp32 master partitions and
    optimizer state over the engine's own (ZeRO 1 to 3), so a restore may decode them there."""
    if flavour == ZERO3:
        return (
            options.get("load_optimizer_states", True)
            and not options.get("load_module_only", False)
            and not engine.zero_nvme_offload_optimizer()
        )
    return derives_module_weights(engine, flavour, options)


def engine_tensors(
    engine: Any, flavour: str, rank: int, *, module_weights: bool
) -> dict[tuple, torch.Tensor]:
    """The engine's own tensors a restore writes into instead of new memory, as
    ``write.Writer`` takes them: ``(kind, group, rank)`` -> this rank's partition of the fp32
    masters (``FP32``) or of an optimizer state (``exp_avg``...) of a group (ZeRO 1/2) or
    sub-group (ZeRO 3), which the load would copy over anyway; with ``module_weights``,
    ``(MODULE, name)`` -> each parameter, which the load then "copies" onto itself (it derives
    them from the masters afterwards). Empty for other flavours."""
    if flavour == ZERO12:
        partitions = engine.optimizer.single_partition_of_fp32_groups
    elif flavour == BF16_OPTIMIZER:
        partitions = engine.optimizer.fp32_groups_flat_partition
    elif flavour == ZERO3:
        partitions = engine.optimizer.fp32_partitioned_groups_flat
    else:
        return {}
    state = engine.optimizer.optimizer.state
    into: dict[tuple, torch.Tensor] = {}
    for group, partition in enumerate(partitions):
        into[(FP32, group, rank)] = partition
        for kind, value in state.get(partition, {}).items():
            if isinstance(value, torch.Tensor) and value.shape == partition.shape:
                into[(kind, group, rank)] = value
    if module_weights:
        global_names = experts.live_to_global(engine)  # the store names experts by global index
        into.update(
            ((MODULE, global_names.get(name, name)), param)
            for name, param in engine.module.named_parameters()
        )
    return into


# Where each flavour keeps what ``update_lp_params`` reads and writes: the bit16 partitions
# per group and rank, the fp32 master partition per group, and the flat bit16 group buffers.
_LOW_PRECISION_GROUPS = {
    ZERO12: ("parallel_partitioned_bit16_groups", "single_partition_of_fp32_groups", "bit16_groups_flat"),
    BF16_OPTIMIZER: ("bf16_partitioned_groups", "fp32_groups_flat_partition", "bf16_groups_flat"),
}


def start_module_weights(engine: Any, flavour: str) -> Callable[[], None]:
    """Begin setting the engine's module weights from its fp32 masters, as the optimizer's
    ``update_lp_params`` does after every step (cast this rank's partition down, then
    all-gather the partitions), but with the all-gathers in flight while the caller goes on;
    returns the function that waits for them, which the caller calls before anything else reads
    or writes the module weights (``load_checkpoint`` does: gloo fills them on its own thread).
    Collective: every rank of the data-parallel group calls both. Where this DeepSpeed keeps its
    groups elsewhere, the wait runs ``update_lp_params`` itself instead."""
    from deepspeed import comm

    optimizer = engine.optimizer
    names = _LOW_PRECISION_GROUPS.get(flavour, ())
    known = all(hasattr(optimizer, n) for n in (*names, "real_dp_process_group"))
    if not names or not known or not comm.has_all_gather_into_tensor():
        return optimizer.update_lp_params
    partitions, masters, flats = (getattr(optimizer, n) for n in names)
    handles = []
    for group, (parts, master) in enumerate(zip(partitions, masters, strict=True)):
        process_group = optimizer.real_dp_process_group[group]
        own = parts[comm.get_rank(group=process_group)]
        own.data.copy_(master.data)
        if comm.get_world_size(group=process_group) > 1:
            # .data: gloo's all-gather copies into views of the flat buffer on its own thread,
            # where autograd refuses that for a buffer that requires grad (BF16_Optimizer's at ZeRO 0)
            handles.append(
                comm.all_gather_into_tensor(flats[group].data, own.data, group=process_group, async_op=True)
            )

    def wait() -> None:
        for handle in handles:
            handle.wait()

    return wait
