"""Model parallelism: a step of an engine whose model is split across ranks (pipeline stages,
tensor-parallel slices).

DeepSpeed numbers the model-parallel ranks pipeline-major (``mp_rank``) and writes one set of
files per model-parallel rank: ``mp_rank_XX_model_states.pt``, its optimizer partitions
``zero_pp_rank_D_mp_rank_XX_optim_states.pt`` and, for a pipeline, one
``layer_XX-model_states.pt`` per layer of its stage holding the layer's own state dict
(DEEPSPEED_FORMAT.md). Each model-parallel rank describes its own part of the step (its
parameters, optimizer groups and layer files, ``extract``); the parts join into the step's one
description (``combine``), whose parameters are those of the whole model under the names the
model gives them, so layers, dedup, composites and exports see one model however it was split.
A tied weight (``TiedLayerSpec``) lives on several stages, each with its own copy of the same
values; the first stage stores it and every stage's files are written from that one copy.

A tensor-parallel rank (AutoTP, a Megatron-style ``mpu``) holds a slice of some parameters and
all of the others. Its pieces are pieces of the logical parameters (``tensorsplit``: each
slice is a range of the parameter's flat stored order), so the step describes the model once
at its logical shapes whatever the degree; a replicated parameter is stored by the first
slice alone, an averaged one (``parameter_to_average_patterns``) by every slice, its logical
tensor their mean. How each parameter is split comes from what DeepSpeed and the client provide for
DeepSpeed's own universal checkpoint: AutoTP's per-parameter metadata, else the
``universal_checkpoint_info`` patterns a Megatron client passes in its client state or sets on
its module. In Megatron-DeepSpeed's 3D setting the two meet: each pipeline stage is cut into
tensor-parallel slices (its grid's ``model`` axis), and a model-parallel rank's part is its
stage's layer files holding its slice.
"""

from __future__ import annotations

from typing import Any

from .. import tensorsplit
from ..errors import BadInputError, CorruptError, UnsupportedError
from ..format import plainstate
from ..model import Piece
from . import universal_info as info_keys

# What a part describes of its model-parallel rank alone; the rest is the same on every rank.
_OWN_KEYS = ("module_keys", "aliases", "groups", "model_state", "optimizer_state", "model_parallel")
_SHARED_KEYS = ("flavour", "zero_stage", "world_size", "bf16")


def is_pipeline(engine: Any) -> bool:
    """Whether ``engine`` is DeepSpeed's ``PipelineEngine`` (its model a ``PipelineModule``)."""
    return type(engine).__name__ == "PipelineEngine" or type(getattr(engine, "module", None)).__name__ == (
        "PipelineModule"
    )


def tensor_degree(engine: Any) -> int:
    """How many tensor-parallel slices the engine's model is cut into: a pipeline's stages are
    cut by its grid's ``model`` axis (Megatron's TP inside stages), any other engine's model by
    its ``mpu`` (1: none)."""
    if is_pipeline(engine):
        return int(engine.grid.get_slice_parallel_world_size())
    return int(getattr(engine, "mp_world_size", 1))


def tensor_rank(engine: Any) -> int:
    """Which tensor-parallel slice this rank holds (its coordinate on a pipeline grid's
    ``model`` axis; else its model-parallel rank)."""
    if is_pipeline(engine):
        return int(engine.grid.get_slice_parallel_rank())
    return int(engine.checkpoint_mp_rank)


def is_tensor_parallel(engine: Any) -> bool:
    """Whether ``engine`` holds tensor-parallel slices (on its own or inside pipeline stages)."""
    return tensor_degree(engine) > 1


def check_supported(engine: Any) -> None:
    """UnsupportedError for model parallelism a step cannot yet describe: tensor parallelism
    with ZeRO 3."""
    if is_tensor_parallel(engine) and engine.zero_optimization_stage() == 3:
        raise UnsupportedError("tensor parallelism with ZeRO stage 3 is not supported; ZeRO 0, 1 and 2 are")


def pipeline_part(engine: Any, module_keys: list[str]) -> tuple[dict, set[str]]:
    """This pipeline stage's part of the description (``model_parallel``: its rank among the
    model-parallel ranks, their number, its layer files) and the state-dict keys it leaves to
    another stage (the tied weights a lower stage stores)."""
    module = engine.module
    full_names = {id(tensor): key for key, tensor in module.state_dict(keep_vars=True).items()}
    rank_repr = module._grid._topo.get_rank_repr(rank=module.global_rank)
    layer_files = []
    for local_index, layer in enumerate(module.forward_funcs):
        if getattr(engine, "has_moe_layers", False):
            break  # DeepSpeed's MoE save puts a stage's module in its model-states file instead
        if not hasattr(layer, "state_dict"):
            continue  # a function, or a tied layer's forward_fn: DeepSpeed writes no file
        name = f"layer_{local_index + module._local_start:02d}" + (f"-{rank_repr}" if rank_repr else "")
        keys = [[key, full_names[id(tensor)]] for key, tensor in layer.state_dict(keep_vars=True).items()]
        layer_files.append([f"{name}-model_states.pt", keys])
    others = set()
    for key, comm in getattr(module, "tied_comms", {}).items():
        if comm["ranks"][0] != module.global_rank:
            prefix = f"tied_modules.{key}."
            others.update(name for name in module_keys if name.startswith(prefix))
    part = {
        "rank": int(engine.checkpoint_mp_rank), "size": int(engine.mp_world_size), "pipeline": True,
        "layer_files": layer_files,
    }  # fmt: skip
    return part, others


def tensor_splits(engine: Any, params: dict[str, dict], info: dict | None) -> dict[str, dict | None]:
    """How each of ``params`` (name -> this rank's description entry, its slice's shape) is
    split over the engine's tensor-parallel ranks: ``{"dim", "sizes"}`` (and ``"sub"`` for a
    fused parameter, ``tensorsplit``), or None where every
    rank holds all of it. UnsupportedError for a parameter whose split cannot be known."""
    named = dict(engine.module.named_parameters())
    if any(getattr(param, info_keys.AUTOTP_META, None) for param in named.values()):
        return {
            name: _autotp_split(name, getattr(named.get(name), info_keys.AUTOTP_META, None))
            for name in params
        }
    if info is None:
        raise UnsupportedError(
            f"tensor parallelism (degree {tensor_degree(engine)}) without AutoTP: pass how each "
            "parameter is split as DeepSpeed's universal checkpoint needs it, client_state="
            '{"universal_checkpoint_info": {...}} (Megatron-DeepSpeed sets it on its model)'
        )
    degree = tensor_degree(engine)
    fused = [pattern for entry in info.get(info_keys.SUB_PARAMS, ()) for pattern in _sub_patterns(entry)]
    splits: dict[str, dict | None] = {}
    # The kinds are tried in the order ds_to_universal's merge_tp_slices tries them, so each
    # parameter's logical tensor is the one it would write.
    for name, entry in params.items():
        if info_keys.matches(info.get(info_keys.UNSUPPORTED), name):
            raise UnsupportedError(f"tensor-parallel parameter {name} is one DeepSpeed cannot convert")
        if info_keys.matches(info.get(info_keys.REPLICATED), name):
            splits[name] = None  # equal on every rank (ds_to_universal asserts it): stored once
            continue
        if info_keys.matches(info.get(info_keys.AVERAGED), name):
            # Its copies are equal unless training let them drift (BLOOM's bf16 norms did):
            # every rank's is kept, one after another along dimension 0, so each rank gets its
            # own back, and the logical tensor is their mean (tensorsplit).
            if not entry["shape"]:
                raise UnsupportedError(
                    f"averaged tensor-parallel parameter {name} is a scalar, not supported"
                )
            rows = int(entry["shape"][0])
            splits[name] = {"dim": 0, "sizes": [rows] * degree, "average": True}
            continue
        local = int(entry["shape"][0]) if entry["shape"] else 0
        if info_keys.matches(info.get(info_keys.TWO_SUB_PARAMS), name):
            if local % 2:
                raise UnsupportedError(f"{name} of shape {entry['shape']} is no two equal sub-parameters")
            # SwiGLU's dense_h_to_4h: each rank's slice is its part of the gate, then its part of
            # the up projection; the logical tensor is the gate whole, then the up projection.
            half = [local // 2] * degree
            splits[name] = {"dim": 0, "sizes": [local] * degree, "sub": [half, list(half)]}
            continue
        if info_keys.matches(fused, name):
            raise UnsupportedError(
                f"tensor-parallel parameter {name} matches {info_keys.SUB_PARAMS}, not supported yet"
            )
        # A vocabulary parameter is split by rows like any column-parallel one; it is stored at
        # its padded size (padded_vocab_size), the rows the ranks hold.
        dim = (
            1 if info_keys.matches(info.get(info_keys.ROW_PARALLEL), name) else 0
        )  # as ds_to_universal reads them
        if dim >= len(entry["shape"]):
            raise UnsupportedError(
                f"tensor-parallel parameter {name} of shape {entry['shape']} has no dimension {dim}"
            )
        splits[name] = {"dim": dim, "sizes": [int(entry["shape"][dim])] * degree}
    return splits


def _autotp_split(name: str, meta: dict | None) -> dict | None:
    """The split AutoTP recorded for a parameter; None for one it left whole (the same on every
    rank, as DeepSpeed's universal checkpoint takes it)."""
    if not meta or meta.get("replicated"):
        return None
    conversion = meta.get("conversion") or {}
    reason = conversion.get("unsupported_reason")
    widths = meta.get("sub_param_shard_widths")
    if reason or ((meta.get("sub_param_sizes") or meta.get("sub_param_shape")) and not widths):
        raise UnsupportedError(
            f"tensor-parallel parameter {name} cannot be stored yet: {reason or 'fused sub-parameters'}"
        )
    if meta.get("is_bias") and meta.get("partition_type") == "row":
        raise UnsupportedError(
            f"{name} is a row-parallel bias, which AutoTP divides across ranks: not supported yet"
        )
    dim = int(meta["partition_dim"])
    if not widths:
        return {"dim": dim, "sizes": [int(size) for size in meta["partition_sizes"]]}
    # A fused parameter (AutoTP's qkv_proj, gate_up_proj): each rank holds its piece of every
    # sub-parameter, one after another, at the widths DeepSpeed's universal checkpoint joins
    # them by (sub_param_shard_widths).
    sub = [[int(width) for width in per_rank] for per_rank in widths]
    sizes = [sum(on_rank) for on_rank in zip(*sub, strict=True)]
    sub_sizes = meta.get("sub_param_sizes")
    if sub_sizes is not None and [sum(per_rank) for per_rank in sub] != [int(size) for size in sub_sizes]:
        raise CorruptError(f"{name}: AutoTP's widths {widths} do not tile its sub-parameters {sub_sizes}")
    return {"dim": dim, "sizes": sizes, "sub": sub} if len(sub) > 1 else {"dim": dim, "sizes": sizes}


def _sub_patterns(entry) -> list[str]:
    return entry.get("patterns", []) if isinstance(entry, dict) else [entry]


def tensor_part(
    engine: Any, description: dict, pieces: list[Piece], info: dict | None
) -> tuple[dict, list[Piece]]:
    """This tensor-parallel rank's part of the description, its parameters at their logical
    shapes with their ``split``, and its pieces placed in their parameters' flat stored order
    (``tensorsplit``); a parameter or buffer every rank holds whole is kept by slice 0 alone."""
    index = tensor_rank(engine)
    splits = tensor_splits(engine, description["params"], info)
    for name, split in splits.items():
        entry = description["params"][name]
        if split is None:
            continue
        if split["sizes"][index] != entry["shape"][split["dim"]]:
            raise CorruptError(f"{name}: this rank holds {entry['shape']}, its split says {split}")
        entry["shape"][split["dim"]] = sum(split["sizes"])
        entry["split"] = split
    placed = []
    for piece in pieces:
        entry = description["params"].get(piece.name)
        if entry is None or "split" not in entry:
            if index == 0:
                placed.append(piece)
            continue
        offset = tensorsplit.slice_offset(entry, index)
        equal_to = piece.unless_equal_to
        placed.append(Piece(
            piece.name, piece.kind, offset + piece.start, piece.tensor.reshape(-1),
            unless_equal_to=None if equal_to is None else equal_to.reshape(-1),
        ))  # fmt: skip
    part = {
        "rank": int(engine.checkpoint_mp_rank), "size": int(engine.mp_world_size),
        "pipeline": is_pipeline(engine), "slice": index,
    }  # fmt: skip
    return part, placed


def mark_vocabulary(params: dict[str, dict], info: dict | None) -> None:
    """Give each vocabulary parameter of ``params`` (``vocabulary_parameter_patterns``) the
    ``original_vocab_size`` of ``info``. It stays stored at its padded rows (what the ranks
    hold, what a materialize writes back); the rows past ``original_vocab_size`` are padding,
    which ``ds_to_universal`` leaves out and so do ``state_dict`` and ``export``. BadInputError
    where ``info`` gives more rows than the parameter has."""
    rows = info.get(info_keys.ORIGINAL_VOCAB) if isinstance(info, dict) else None
    if type(rows) is not int:
        return
    for name, entry in params.items():
        if info_keys.matches(info.get(info_keys.VOCABULARY), name) and entry["shape"]:
            if not 0 < rows <= entry["shape"][0]:
                raise BadInputError(
                    f"universal_checkpoint_info's original_vocab_size is {rows}, {name} has {entry['shape'][0]} rows"
                )
            entry[info_keys.ORIGINAL_VOCAB] = rows


def combine(parts: list[dict]) -> dict:
    """The step's description from the parts of every model-parallel rank (one each, any order).

    Shared settings come from the first part; parameters, module keys, aliases and MoE layers
    are the union over the parts (a tied weight once); ``model_parallel.ranks`` keeps each
    part's own keys (and its own MoE layers: a stage numbers its expert files), in
    model-parallel rank order. CorruptError if the parts do not make a whole."""
    parts = sorted(parts, key=lambda part: part["model_parallel"]["rank"])
    size = parts[0]["model_parallel"]["size"]
    if [part["model_parallel"]["rank"] for part in parts] != list(range(size)):
        raise CorruptError(f"the model-parallel ranks sent {len(parts)} parts of a model split {size} ways")
    for part in parts[1:]:
        differs = [key for key in _SHARED_KEYS if part[key] != parts[0][key]]
        if differs:
            raise CorruptError(f"model-parallel ranks differ in {', '.join(differs)}")
    params: dict[str, dict] = {}
    module_keys: dict[str, list] = {}
    aliases: dict[str, str] = {}
    for part in parts:
        for name, info in part["params"].items():
            if params.setdefault(name, info) != info:
                raise UnsupportedError(
                    f"model-parallel ranks describe {name} differently ({params[name]} and {info}): "
                    "an uneven tensor-parallel split this ckptstore cannot tell"
                )
        for key, role in part["module_keys"]:
            module_keys.setdefault(key, [key, role])
        aliases.update(part["aliases"])
    ranks = []
    for part in parts:
        own = {key: part[key] for key in (*_OWN_KEYS, "experts") if key in part}
        own["params"] = list(part["params"])
        ranks.append(own)
    description = {key: parts[0][key] for key in _SHARED_KEYS}
    description.update(params=params, module_keys=list(module_keys.values()), aliases=aliases)
    if "experts" in parts[0]:  # each stage's MoE layers are its own; the step has them all
        layers = [layer for part in parts for layer in part["experts"]["layers"]]
        description["experts"] = {**parts[0]["experts"], "layers": layers}
    pipeline = parts[0]["model_parallel"]["pipeline"]
    description["model_parallel"] = {"size": size, "pipeline": pipeline, "ranks": ranks}
    return description


def size(description: dict) -> int:
    """How many model-parallel ranks wrote the step (1: none)."""
    return description.get("model_parallel", {}).get("size", 1)


def rank_description(description: dict, mp_rank: int) -> dict:
    """The description of one model-parallel rank's part, in the shape a step of an engine
    without model parallelism has (its own parameters, groups, module keys and state)."""
    if "ranks" not in description.get("model_parallel", {}):
        return description  # no model parallelism, or one rank's part already
    own = dict(description["model_parallel"]["ranks"][mp_rank])
    own["params"] = {name: description["params"][name] for name in own["params"]}
    own.update((key, description[key]) for key in _SHARED_KEYS)
    return own


def stored_universal_info(description: dict) -> dict | None:
    """The step's ``universal_checkpoint_info`` as its first model-parallel rank saved it (its
    tuples as tuples), None where it has none. CorruptError where it is malformed: read from the
    store, it is not trusted."""
    model_state = rank_description(description, 0).get("model_state", {})
    info = plainstate.from_plain(model_state.get(info_keys.UNIVERSAL_INFO))
    info_keys.check_universal_info(info, CorruptError)
    return info if isinstance(info, dict) else None


def layer_file_names(description: dict, slices: int = 1) -> dict[str, list[str]]:
    """A pipeline step's layer files by layer (``layer_XX``), each layer's in the order
    DeepSpeed's glob sorts them (by tensor-parallel rank); empty for a step of no pipeline.
    For one rank's part (a step re-cut for an engine, ``reshard.recut``), its own layer files
    and those of the other ``slices`` - 1 tensor-parallel ranks of its stage, named as
    DeepSpeed names them (``layer_XX-model_YY``, the grid's ``model`` coordinate)."""
    parallel = description.get("model_parallel", {})
    names: dict[str, set[str]] = {}
    if "ranks" not in parallel:
        own = f"-model_{parallel.get('slice', 0):02d}-"
        for name, _ in parallel.get("layer_files", []):
            siblings = (
                [name.replace(own, f"-model_{t:02d}-") for t in range(slices)] if own in name else [name]
            )
            names.setdefault(name.split("-", 1)[0], set()).update(siblings)
    for part in parallel.get("ranks", []):
        for name, _ in part["model_parallel"].get("layer_files", []):
            names.setdefault(name.split("-", 1)[0], set()).add(name)
    return {layer: sorted(files) for layer, files in names.items()}


def tensor_size(description: dict) -> int:
    """How many tensor-parallel slices the step's model was cut into (1: none)."""
    ranks = description.get("model_parallel", {}).get("ranks", [])
    return 1 + max((own["model_parallel"].get("slice", 0) for own in ranks), default=0)


def same_split(description: dict, engine: Any, what: str) -> bool:
    """Whether ``engine`` splits its model as the step's engine did (as many pipeline stages
    and tensor-parallel slices); False for another number of stages, another degree of tensor
    parallelism or both (Megatron's 3D into another P x T), which a restore reshards.
    BadInputError where one is a pipeline and the other not: their modules differ."""
    was, now = size(description), int(getattr(engine, "mp_world_size", 1))
    was_pipeline = description.get("model_parallel", {}).get("pipeline", False)
    if was_pipeline != is_pipeline(engine):
        kind = {True: "a pipeline engine", False: "an engine without a pipeline"}
        raise BadInputError(
            f"{what} was committed by {kind[was_pipeline]}, this is {kind[is_pipeline(engine)]}: their "
            "modules name their parameters differently; export the weights (ckptstore export) to move them"
        )
    return (was, tensor_size(description)) == (now, tensor_degree(engine))
