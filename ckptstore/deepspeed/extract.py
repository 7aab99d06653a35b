"""Live DeepSpeed engine -> pieces and a step description, for the calling rank.

Extraction reads the same state dicts ``engine.save_checkpoint`` would write (the model-states
dict and the optimizer's ``state_dict()``), in memory, and cuts their flat partitions into
per-parameter pieces using the layout metadata DeepSpeed records (``param_shapes``,
``group_paddings``, ``partition_count``). Tensors are returned as views of live engine state:
the caller must store or copy them before the next optimizer step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from .. import fused_experts
from ..errors import BadInputError, UnsupportedError
from ..format import plainstate
from ..format.codec import dtype_name
from ..model import BUFFER, FP32, WEIGHT, Piece, Snapshot
from . import experts, optimizer_pieces, parallel, universal_info
from .layout import (
    BASIC,
    BF16_OPTIMIZER,
    FP16_OPTIMIZER,
    FP16_UNFUSED,
    ZERO3,
    ZERO12,
    zero3_bounds,
)

# Model-states keys rebuilt by the writer from pieces and layout; everything else is kept as is.
_LAYOUT_MODEL_KEYS = {
    "module", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "buffer_names", "dp_world_size",
}  # fmt: skip
# Optimizer-states keys that depend on the world size or hold partitioned tensors.
_LAYOUT_OPTIM_KEYS = {
    "base_optimizer_state", "single_partition_of_fp32_groups", "group_paddings", "partition_count",
    "param_slice_mappings", "param_alignment_paddings", "optimizer_state_dict", "fp32_flat_groups",
    "fp32_groups_flat", "fp32_groups",
}  # fmt: skip


def check_is_engine(engine: Any) -> None:
    """BadInputError unless ``engine`` looks like a DeepSpeed engine (what ``deepspeed.initialize``
    returns): a model alone, or None, has no optimizer or ZeRO state to commit."""
    needed = ("module", "optimizer", "zero_optimization_stage", "module_state_dict")
    if engine is None or not all(hasattr(engine, attribute) for attribute in needed):
        raise BadInputError(
            f"engine must be a DeepSpeed engine (what deepspeed.initialize returns), not {type(engine).__name__}"
        )


def optimizer_flavour(engine: Any) -> str:
    """Which optimizer state layout the engine uses; raises UnsupportedError for others."""
    optimizer = engine.optimizer
    if optimizer is None:
        raise UnsupportedError("the engine has no optimizer; ckptstore commits training state")
    name = type(optimizer).__name__
    if name in (ZERO12, BF16_OPTIMIZER, ZERO3, FP16_OPTIMIZER, FP16_UNFUSED):
        return name
    if isinstance(optimizer, torch.optim.Optimizer) and engine.zero_optimization_stage() == 0:
        return BASIC
    raise UnsupportedError(
        f"optimizer wrapper {name} is not supported (ZeRO 0-3 with DeepSpeed's own wrappers are)"
    )


def check_engine(engine: Any, flavour: str) -> None:
    """UnsupportedError for engines ckptstore cannot store or restore faithfully (tensor
    parallelism, elastic checkpoints, parameter-alignment padding)."""
    parallel.check_supported(engine)
    if flavour == ZERO12 and getattr(engine.optimizer, "elastic_checkpoint", False):
        raise UnsupportedError("zero_optimization.elastic_checkpoint is not supported; turn it off")
    if flavour == ZERO12 and any(any(p) for p in engine.optimizer.round_robin_bit16_padding):
        raise UnsupportedError("zero_optimization.parameter_alignment padding is not supported")


def dp_rank(engine: Any) -> int:
    """The engine's rank in its data-parallel group (0 without torch.distributed)."""
    # A torch optimizer (ZeRO 0) has no group of its own; the engine's is the data-parallel one.
    group = getattr(engine.optimizer, "dp_process_group", None) or getattr(
        engine, "data_parallel_group", None
    )
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=group)
    return 0


def _aliases(engine: Any) -> dict[str, str]:
    owners: dict[int, str] = {}
    aliases = {}
    for name, param in engine.module.named_parameters(remove_duplicate=False):
        if id(param) in owners:
            aliases[name] = owners[id(param)]
        else:
            owners[id(param)] = name
    return aliases


def extract(engine: Any, client_state: dict | None = None) -> Snapshot:
    """Pieces and description of the calling rank's share of ``engine``'s checkpoint state.

    Raises UnsupportedError for engines or optimizers ckptstore cannot store faithfully.
    """
    flavour = optimizer_flavour(engine)
    check_engine(engine, flavour)
    zero = flavour in (ZERO12, BF16_OPTIMIZER, ZERO3)
    stage = engine.zero_optimization_stage()
    save_frozen = engine.zero_optimization_partition_gradients()
    pipeline = parallel.is_pipeline(engine)
    # A pipeline engine's own module_state_dict writes the layer files instead (DeepSpeed's
    # save_checkpoint calls it for that); the module's state is the base engine's answer.
    module = _base_engine_class().module_state_dict(engine) if pipeline else engine.module_state_dict()
    model_state = engine._common_checkpoint_state(module, zero, save_frozen)
    found_experts = experts.describe(engine, list(module))
    expert_part, expert_ranks = found_experts if found_experts is not None else (None, None)
    rename: Callable[[str], str] = lambda name: name  # noqa: E731
    if expert_ranks is not None:
        if parallel.is_tensor_parallel(engine) or (pipeline and expert_ranks.ep_size > 1):
            raise UnsupportedError(
                "MoE layers with tensor parallelism, or inside a pipeline at an expert-parallel size "
                f"above 1 (here {expert_ranks.ep_size}), are not supported yet"
            )
        # what DeepSpeed's MoE save adds, where it adds them (before the client state)
        model_state["num_experts"] = list(engine.num_experts)
        model_state["ds_autoep_layers"] = None
        # every expert by its global index, as its expert file names it
        rename = expert_ranks.global_name
        module = OrderedDict((rename(key), value) for key, value in module.items())
    param_names = {param: rename(name) for param, name in engine.param_names.items()}
    autotp_info = getattr(engine.module, universal_info.UNIVERSAL_INFO, None)
    if autotp_info is not None:  # what AutoTP's save writes for ds_to_universal
        model_state[universal_info.UNIVERSAL_INFO] = autotp_info
    model_state.update(client_state or {})
    info = model_state.get(universal_info.UNIVERSAL_INFO)
    universal_info.check_universal_info(info)
    names = [name for name, _ in engine.module.named_parameters()] + list(module)
    universal_info.check_patterns(info, names, universal_info.UNIVERSAL_INFO, BadInputError)
    osd = engine.optimizer.state_dict() if zero else model_state["optimizer"]
    rank = dp_rank(engine)
    world_size = model_state["dp_world_size"]

    pieces: list[Piece] = []
    if flavour in (ZERO12, BF16_OPTIMIZER):
        ranks = optimizer_pieces.partition_ranks(engine, len(model_state["param_shapes"]), rank)
        groups = optimizer_pieces.zero12_groups(osd, model_state["param_shapes"], ranks, rename, pieces)
    elif flavour == ZERO3:
        groups = optimizer_pieces.zero3_groups(engine, osd, model_state["param_shapes"], rank, pieces)
    elif flavour == BASIC:
        params = [group["params"] for group in engine.optimizer.param_groups]
        masters = [[module[param_names[p]] for p in group] for group in params]
        groups = optimizer_pieces.basic_groups(param_names, osd, params, masters, pieces)
    elif flavour == FP16_UNFUSED:
        groups = optimizer_pieces.basic_groups(
            param_names, osd["optimizer_state_dict"], engine.optimizer.fp16_groups, osd["fp32_groups"], pieces
        )
    else:
        groups = optimizer_pieces.fp16_optimizer_groups(engine, param_names, osd, pieces)
    # What ZeRO 0 replicates, and every rank holds of what ZeRO 1/2 do not partition, the
    # first rank stores once: of each expert, the first rank of its expert-data-parallel group.
    own_experts = set(expert_ranks.renames.values()) if expert_ranks is not None else set()

    def stores_replica(name: str) -> bool:
        return expert_ranks.edp_rank == 0 if name in own_experts else rank == 0

    if not zero:
        pieces = [piece for piece in pieces if stores_replica(piece.name)]
    part, elsewhere = parallel.pipeline_part(engine, list(module)) if pipeline else (None, set())

    aliases = {rename(alias): rename(owner) for alias, owner in _aliases(engine).items()}
    trainable = {name for group in groups for name in group["params"]}
    buffer_names = {rename(name) for name in engine._get_buffer_names()}
    frozen_fragments = model_state.get("frozen_param_fragments") or {}
    params: dict[str, dict] = {}
    module_keys: list[list[str]] = []
    fp32_by_name: dict[str, list[Piece]] = {}
    for piece in pieces:
        if piece.kind == FP32:
            fp32_by_name.setdefault(piece.name, []).append(piece)
    for key, tensor in module.items():
        if key in aliases:
            module_keys.append([key, "alias"])
            continue
        if key in buffer_names:
            module_keys.append([key, BUFFER])
            if stores_replica(key):
                pieces.append(Piece(key, BUFFER, 0, tensor))
            continue
        module_keys.append([key, "param"])
        # ZeRO-3 module entries are empty placeholders; the real shape is in the layout metadata.
        shape = list(_zero3_shape(model_state, key) if stage == 3 else tensor.shape)
        params[key] = {"shape": shape, "dtype": dtype_name(tensor.dtype), "trainable": key in trainable}
        if stage == 3:
            if key not in trainable and key in frozen_fragments:
                _add_zero3_frozen(key, shape, frozen_fragments[key], rank, world_size, pieces)
            continue
        if key not in trainable:
            if stores_replica(key):
                pieces.append(Piece(key, WEIGHT, 0, tensor))
            continue
        # Module weights at ZeRO 0-2 are the fp32 masters cast down; storing them again would
        # add 2 bytes per parameter for nothing. Each rank stores the weight only over the
        # range of its own master fragment, and only where the two differ.
        flat = tensor.reshape(-1)
        for master in fp32_by_name.get(key, []):
            weight = flat[master.start : master.start + master.tensor.numel()]
            pieces.append(
                Piece.cut(key, WEIGHT, master.start, weight, tensor.shape, unless_equal_to=master.tensor)
            )

    extra_model = {k: v for k, v in model_state.items() if k not in _LAYOUT_MODEL_KEYS}
    extra_optim = {k: v for k, v in osd.items() if k not in _LAYOUT_OPTIM_KEYS} if flavour != BASIC else {}
    description = {
        "flavour": flavour,
        "zero_stage": stage,
        "world_size": world_size,
        "bf16": bool(engine.bfloat16_enabled()),
        "params": params,
        "module_keys": module_keys,
        "aliases": aliases,
        "groups": groups,
        "model_state": extra_model,
        "optimizer_state": extra_optim,
    }
    if not pipeline and not parallel.is_tensor_parallel(engine):
        # A Hugging Face model's fused experts: a piece per expert (fused_experts)
        fused = fused_experts.find(engine.module, params)
        if fused:
            fused_experts.mark(params, fused)
            pieces = fused_experts.cut(pieces, params)
    if expert_ranks is not None and expert_ranks.ep_size > 1:
        # Each expert-parallel rank describes its own experts: the first of each sends its part.
        description["experts"] = expert_part
        return Snapshot(
            plainstate.to_plain(description), pieces, rank, world_size,
            combine=experts.combine, sends_part=expert_ranks.edp_rank == 0,
        )  # fmt: skip
    if expert_ranks is not None:
        description["experts"] = {key: value for key, value in expert_part.items() if key != "ep_rank"}
    if parallel.is_tensor_parallel(engine):
        # Inside a pipeline stage (Megatron's 3D) the slice joins the stage's part: its layer
        # files hold this slice of the stage's layers.
        stage = part
        part, pieces = parallel.tensor_part(
            engine, description, pieces, model_state.get(universal_info.UNIVERSAL_INFO)
        )
        if stage is not None:
            part = {**stage, "slice": part["slice"]}
    parallel.mark_vocabulary(description["params"], model_state.get(universal_info.UNIVERSAL_INFO))
    if part is None:
        return Snapshot(plainstate.to_plain(description), pieces, rank, world_size)
    description["model_parallel"] = part
    pieces = [piece for piece in pieces if piece.name not in elsewhere]
    return Snapshot(plainstate.to_plain(description), pieces, rank, world_size, combine=parallel.combine)


def _base_engine_class() -> type:
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def _zero3_shape(model_state: dict, name: str) -> torch.Size:
    for shapes in model_state["param_shapes"]:
        if name in shapes:
            return shapes[name]
    return (model_state.get("frozen_param_shapes") or {})[name]


def _add_zero3_frozen(name: str, shape, fragment: torch.Tensor, rank: int, world_size: int, pieces) -> None:
    first, count = zero3_bounds(int(torch.Size(shape).numel()), world_size, rank)
    if count:
        pieces.append(Piece.cut(name, WEIGHT, first, fragment[:count], shape))
