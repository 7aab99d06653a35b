"""Model parallelism: a step of an engine whose model is split across ranks (pipeline stages).

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
"""

from __future__ import annotations

from typing import Any

from ..errors import BadInputError, CorruptError, UnsupportedError

# What a part describes of its model-parallel rank alone; the rest is the same on every rank.
_OWN_KEYS = ("module_keys", "aliases", "groups", "model_state", "optimizer_state", "model_parallel")
_SHARED_KEYS = ("flavour", "zero_stage", "world_size", "bf16")


def is_pipeline(engine: Any) -> bool:
    """Whether ``engine`` is DeepSpeed's ``PipelineEngine`` (its model a ``PipelineModule``)."""
    return type(engine).__name__ == "PipelineEngine" or type(getattr(engine, "module", None)).__name__ == (
        "PipelineModule"
    )


def check_supported(engine: Any) -> None:
    """UnsupportedError for model parallelism a step cannot yet describe: tensor-parallel
    slices (AutoTP, a Megatron ``mpu``), and a pipeline that is tensor parallel too."""
    mp_world_size = getattr(engine, "mp_world_size", 1)
    if not is_pipeline(engine) and mp_world_size != 1:
        raise UnsupportedError(
            f"tensor parallelism (mp_world_size={mp_world_size}) is not supported yet; "
            "ckptstore handles data-parallel ZeRO jobs and DeepSpeed pipelines"
        )
    if is_pipeline(engine) and engine.grid.get_slice_parallel_world_size() != 1:
        raise UnsupportedError("a pipeline that is also tensor parallel is not supported yet")


def pipeline_part(engine: Any, module_keys: list[str]) -> tuple[dict, set[str]]:
    """This pipeline stage's part of the description (``model_parallel``: its rank among the
    model-parallel ranks, their number, its layer files) and the state-dict keys it leaves to
    another stage (the tied weights a lower stage stores)."""
    module = engine.module
    full_names = {id(tensor): key for key, tensor in module.state_dict(keep_vars=True).items()}
    rank_repr = module._grid._topo.get_rank_repr(rank=module.global_rank)
    layer_files = []
    for local_index, layer in enumerate(module.forward_funcs):
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


def combine(parts: list[dict]) -> dict:
    """The step's description from the parts of every model-parallel rank (one each, any order).

    Shared settings come from the first part; parameters, module keys and aliases are the union
    over the parts (a tied weight once); ``model_parallel.ranks`` keeps each part's own keys,
    in model-parallel rank order. CorruptError if the parts do not make a whole."""
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
            params.setdefault(name, info)
        for key, role in part["module_keys"]:
            module_keys.setdefault(key, [key, role])
        aliases.update(part["aliases"])
    ranks = []
    for part in parts:
        own = {key: part[key] for key in _OWN_KEYS}
        own["params"] = list(part["params"])
        ranks.append(own)
    description = {key: parts[0][key] for key in _SHARED_KEYS}
    description.update(params=params, module_keys=list(module_keys.values()), aliases=aliases)
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


def same_split(description: dict, engine: Any, what: str) -> bool:
    """Whether ``engine`` splits its model as the step's engine did (the same number of
    model-parallel ranks); False for a pipeline of another number of stages, which a restore
    reshards. BadInputError where one is a pipeline and the other not: their modules differ."""
    was, now = size(description), int(getattr(engine, "mp_world_size", 1))
    was_pipeline = description.get("model_parallel", {}).get("pipeline", False)
    if was_pipeline != is_pipeline(engine):
        kind = {True: "a pipeline engine", False: "an engine without a pipeline"}
        raise BadInputError(
            f"{what} was committed by {kind[was_pipeline]}, this is {kind[is_pipeline(engine)]}: their "
            "modules name their parameters differently; export the weights (ckptstore export) to move them"
        )
    return was == now
