"""DeepSpeed's Mixture-of-Experts layer (``deepspeed.moe.layer.MoE``): its experts in a step.

DeepSpeed keeps each expert of a MoE layer in a file of its own,
``layer_{L}_expert_{G}_mp_rank_{MP}_model_states.pt`` (L counts MoE layers in module order, G is
the expert's *global* index), drops experts from the model-states file's module, records the
number of experts per layer (``num_experts``) there, and at ZeRO 0 writes each expert-parallel
rank's optimizer state as ``expp_rank_{R}_mp_rank_{MP}_optim_states.pt`` (docs/moe.md).

A live engine names an expert by its *local* index on its expert-parallel rank; the store names
every expert tensor by its global index (the name in its expert file), so a step means the same
whatever the expert-parallel degree that committed it. This module finds the experts of an
engine at commit (``describe``) and answers, from the step's description, which keys are experts
and what the files are called.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..errors import BadInputError, CorruptError, UnsupportedError, clip

# Where a native MoE layer keeps its experts, below the MoE module (DeepSpeed's own pattern).
EXPERTS_PATH = ".deepspeed_moe.experts.deepspeed_experts."
# DeepSpeed leaves the gate in the model-states file: its key holds "expert" in no other way.
_GATE = "moe.gate.wg.weight"


def expert_file_name(layer: int, expert: int, mp_rank: int = 0) -> str:
    """DeepSpeed's file of one expert of the ``layer``-th MoE layer, by global expert index."""
    return f"layer_{layer}_expert_{expert}_mp_rank_{mp_rank:02d}_model_states.pt"


def optimizer_file_name(ep_rank: int, mp_rank: int = 0) -> str:
    """DeepSpeed's ZeRO-0 optimizer file of one expert-parallel rank (no ``bf16_`` prefix)."""
    return f"expp_rank_{ep_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def _moe_class() -> type | None:
    try:
        from deepspeed.moe.layer import MoE
    except ImportError:
        return None
    return MoE


def _autoep_layer(engine: Any) -> str | None:
    for name, module in engine.module.named_modules():
        if type(module).__name__ == "AutoEPMoELayer":
            return name or "(the model itself)"
    return None


@dataclass
class ExpertRanks:
    """Where the calling rank stands among the experts: its expert-parallel rank among
    ``ep_size``, its rank in its expert-data-parallel group (0 writes its experts), and the
    global name of each of its experts' keys (live, local name -> global name)."""

    ep_size: int
    ep_rank: int
    edp_rank: int
    renames: dict[str, str]

    def global_name(self, key: str) -> str:
        return self.renames.get(key, key)


def describe(engine: Any, module_keys: list[str]) -> tuple[dict, ExpertRanks] | None:
    """The experts of ``engine``'s MoE layers as the calling rank sees them, for the step's
    description, and the rank's place among them; None for an engine without any. The
    description is ``{"layers": [{"module", "num_experts", "experts"}], "ep_size", "ep_rank"}``,
    where ``experts[G]`` lists the state-dict keys of global expert G in the module's order,
    named as its expert file names them: this rank's experts only, until ``combine`` joins the
    expert-parallel ranks' parts. ``module_keys`` are the keys of the module state dict.

    Raises UnsupportedError for layouts this version cannot store faithfully, naming the layer:
    AutoEP layers, MoE layers of different expert-parallel degrees, and keys DeepSpeed would
    sweep into an expert file without an expert index."""
    if not getattr(engine, "has_moe_layers", False):
        return None
    autoep = _autoep_layer(engine)
    if autoep is not None:
        raise UnsupportedError(
            f"the model's AutoEP layer {clip(autoep, 120)} (DeepSpeed expert_parallel) is not supported; "
            "DeepSpeed's MoE layer (deepspeed.moe.layer.MoE) is"
        )
    from deepspeed.utils import groups

    moe_class = _moe_class()
    layers, renames = [], {}
    ranks: set[tuple[int, int, int]] = set()
    for name, module in engine.module.named_modules():
        if moe_class is None or not isinstance(module, moe_class):
            continue
        where = clip(name or "(the model itself)", 120)
        ep_rank = groups._get_expert_parallel_rank(module.expert_group_name)
        ranks.add((module.ep_size, ep_rank, groups._get_expert_data_parallel_rank(module.expert_group_name)))
        if len(ranks) > 1:
            raise UnsupportedError(
                f"the MoE layer {where} has expert parallelism {module.ep_size}, another layer another: "
                "this version stores MoE layers of one expert-parallel degree"
            )
        local_experts = module.num_local_experts
        experts_path = f"{name}{EXPERTS_PATH}" if name else EXPERTS_PATH[1:]
        experts: list[list[str]] = [[] for _ in range(module.num_experts)]
        for key in module_keys:
            if not key.startswith(f"{name}." if name else "") or "expert" not in key or _GATE in key:
                continue
            found = re.match(rf"{re.escape(experts_path)}([0-9]+)\.", key)
            local = int(found.group(1)) if found else -1
            if not 0 <= local < local_experts:
                raise UnsupportedError(
                    f"the MoE layer {where} holds {clip(key, 160)}, which DeepSpeed would save with its experts "
                    "but which is no expert's"
                )
            expert = ep_rank * local_experts + local
            renames[key] = global_key = f"{experts_path}{expert}.{key[len(found.group(0)) :]}"
            experts[expert].append(global_key)
        layers.append({"module": name, "num_experts": int(module.num_experts), "experts": experts})
    ep_size, ep_rank, edp_rank = ranks.pop()
    return (
        {"layers": layers, "ep_size": ep_size, "ep_rank": ep_rank},
        ExpertRanks(ep_size, ep_rank, edp_rank, renames),
    )


def live_to_global(engine: Any) -> dict[str, str]:
    """The global name of each expert parameter of ``engine`` (live name -> global name)."""
    names = [name for name, _ in engine.module.named_parameters()]
    found = describe(engine, names)
    return found[1].renames if found is not None else {}


def combine(parts: list[dict]) -> dict:
    """The step's description from the parts of every expert-parallel rank (one each, any
    order): each part's experts and their optimizer entries joined, experts by global index."""
    parts = sorted(parts, key=lambda part: part["experts"]["ep_rank"])
    ep_size = parts[0]["experts"]["ep_size"]
    if [part["experts"]["ep_rank"] for part in parts] != list(range(ep_size)):
        raise CorruptError(
            f"the expert-parallel ranks sent {len(parts)} parts of experts split {ep_size} ways"
        )
    description = {key: value for key, value in parts[0].items()}
    layers = [dict(layer) for layer in parts[0]["experts"]["layers"]]
    for index, layer in enumerate(layers):
        layer["experts"] = [
            next(
                (
                    part["experts"]["layers"][index]["experts"][e]
                    for part in parts
                    if part["experts"]["layers"][index]["experts"][e]
                ),
                [],
            )
            for e in range(layer["num_experts"])
        ]
    description["experts"] = {"layers": layers, "ep_size": ep_size}
    position = {
        key: (index, expert)
        for index, layer in enumerate(layers)
        for expert, keys in enumerate(layer["experts"])
        for key in keys
    }
    params: dict[str, dict] = {}
    for part in parts:
        params.update(part["params"])
    description["params"] = params
    # every expert key where rank 0 lists its first one: layer by layer, by global index
    module_keys, placed = [], set()
    by_layer = {
        index: [
            [key, role]
            for part in parts
            for key, role in part["module_keys"]
            if position.get(key, (None,))[0] == index
        ]
        for index in range(len(layers))
    }
    for key, role in parts[0]["module_keys"]:
        if key not in position:
            module_keys.append([key, role])
        elif position[key][0] not in placed:
            placed.add(position[key][0])
            module_keys.extend(sorted(by_layer[position[key][0]], key=lambda entry: position[entry[0]][1]))
    description["module_keys"] = module_keys
    description["groups"] = [
        _combine_group(index, [part["groups"][index] for part in parts], position)
        for index in range(len(parts[0]["groups"]))
    ]
    return description


def _combine_group(index: int, groups: list[dict], position: dict) -> dict:
    group = dict(groups[0])
    names = [name for part in groups for name in part["params"]]
    order = {name: i for i, name in enumerate(names)}
    group["params"] = sorted(
        dict.fromkeys(names), key=lambda name: (*position.get(name, (-1, -1)), order[name])
    )
    if "param_state" in group:
        group["param_state"] = {name: state for part in groups for name, state in part["param_state"].items()}
    return group


def expert_keys(description: dict) -> set[str]:
    """Every key of the step's module state that lives in an expert file."""
    found = description.get("experts") or {"layers": []}
    return {key for layer in found["layers"] for keys in layer["experts"] for key in keys}


def _experts_path(module: str) -> str:
    return f"{module}{EXPERTS_PATH}" if module else EXPERTS_PATH[1:]


def with_ep_size(description: dict, ep_size: int | None, world_size: int, step: int) -> dict:
    """``description`` of ``step`` laid out for ``ep_size`` expert-parallel ranks of
    ``world_size`` (None: as committed); the experts of a step are the same whatever the
    degree, only who holds which changes. BadInputError for an ``ep_size`` of a step without
    experts, or a degree that does not divide the ranks and every layer's experts."""
    if "experts" not in description:
        if ep_size is None:
            return description
        raise BadInputError(
            f"step {step} has no Mixture-of-Experts layer: an expert-parallel size does not apply"
        )
    laid_out = description
    committed = description["experts"].get("ep_size")
    if ep_size is not None and ep_size != committed and "ranks" in description.get("model_parallel", {}):
        raise BadInputError(
            f"step {step} holds MoE layers inside a pipeline, laid out at the expert-parallel size it "
            f"was committed at ({committed}) only, not {ep_size}"
        )
    if ep_size is not None:
        laid_out = {**description, "experts": {**description["experts"], "ep_size": ep_size}}
    try:
        ExpertLayout(laid_out, world_size)
    except UnsupportedError as error:
        raise BadInputError(f"step {step}: {error}") from None
    return laid_out


def hand_optimizer_file_as_asked(files: dict[str, object | None], engine: Any, mp_rank: int) -> None:
    """Put this rank's ZeRO-0 optimizer file of ``files`` (a restore's, name -> object) also
    under the name DeepSpeed's load will ask for: it names the ``expp_rank`` file by the rank in
    the process's largest expert group of any engine built so far, not by ``engine``'s own."""
    if ep_size_of(engine) is None:
        return
    from deepspeed.utils import groups

    moe_class = _moe_class()
    module = next(m for m in engine.module.modules() if isinstance(m, moe_class))
    own = groups._get_expert_parallel_rank(module.expert_group_name)
    asked = groups._get_expert_parallel_rank(groups._get_max_expert_size_name())
    if asked != own and files.get(optimizer_file_name(own, mp_rank)) is not None:
        files[optimizer_file_name(asked, mp_rank)] = files[optimizer_file_name(own, mp_rank)]


def ep_size_of(engine: Any) -> int | None:
    """The expert-parallel degree of ``engine``'s MoE layers; None without any."""
    moe_class = _moe_class()
    if moe_class is None or not getattr(engine, "has_moe_layers", False):
        return None
    return next((m.ep_size for m in engine.module.modules() if isinstance(m, moe_class)), None)


def group_options(options: dict, ep_size: int) -> dict:
    """An expert param group's options for ``ep_size``: DeepSpeed finds the group's process
    groups by its name, ``ep_size_{E}``, which a load takes from the checkpoint."""
    name = options.get("name")
    if isinstance(name, str) and re.fullmatch(r"ep_size_[0-9]+", name):
        return {**options, "name": f"ep_size_{ep_size}"}
    return options


class ExpertLayout:
    """Which experts each data-parallel rank of ``world_size`` holds when a step's experts are
    spread over its ``ep_size`` expert-parallel ranks (DeepSpeed's groups: consecutive ranks
    form an expert-parallel group, so rank r holds the experts of expert-parallel rank
    r mod ep_size, with the ranks that share them, its expert-data-parallel group, strided).
    Without experts, every rank holds everything, as in one expert-parallel rank."""

    def __init__(self, description: dict, world_size: int) -> None:
        found = description.get("experts") or {"layers": [], "ep_size": 1}
        self.ep_size = ep_size = int(found["ep_size"])
        self.world_size = world_size
        if ep_size < 1 or world_size % ep_size:
            raise UnsupportedError(f"expert parallelism {ep_size} does not divide the {world_size} ranks")
        # global key -> (its expert-parallel rank, the key under its local index there)
        self._owners: dict[str, tuple[int, str]] = {}
        for layer in found["layers"]:
            count = layer.get("num_experts")
            if not isinstance(count, int) or count < 1 or len(layer.get("experts") or ()) != count:
                raise CorruptError(
                    f"the step describes the MoE layer {clip(str(layer.get('module')), 120)} wrongly"
                )
            if layer["num_experts"] % ep_size:
                raise UnsupportedError(
                    f"the {layer['num_experts']} experts of the MoE layer {clip(layer['module'], 120)} "
                    f"cannot be split over {ep_size} expert-parallel ranks"
                )
            local_experts = layer["num_experts"] // ep_size
            path = _experts_path(layer["module"])
            for expert, keys in enumerate(layer["experts"]):
                owner, local = divmod(expert, local_experts)
                for key in keys:
                    rest = key[len(f"{path}{expert}") :]
                    self._owners[key] = (owner, f"{path}{local}{rest}")

    def ep_rank(self, rank: int) -> int:
        """The expert-parallel rank of data-parallel rank ``rank``."""
        return rank % self.ep_size

    def sharing(self, ep_rank: int) -> list[int]:
        """The data-parallel ranks that hold the experts of ``ep_rank`` (its expert-data-parallel
        group), in their order there."""
        return list(range(ep_rank, self.world_size, self.ep_size))

    def held(self, names: list[str], ep_rank: int) -> list[str]:
        """Of ``names``, those the ranks of ``ep_rank`` hold: every key but other ranks' experts."""
        return [name for name in names if self._owners.get(name, (ep_rank,))[0] == ep_rank]

    def has_experts(self, names: list[str]) -> bool:
        return any(name in self._owners for name in names)

    def local_name(self, name: str) -> str:
        """``name`` as its holder's engine calls it (an expert by its local index)."""
        return self._owners[name][1] if name in self._owners else name

    def readers(self, key: str) -> tuple[int, ...] | None:
        """The data-parallel ranks that read the expert file holding ``key`` (None: every one)."""
        return self.readers_of(self._owners[key][0])

    def readers_of(self, ep_rank: int) -> tuple[int, ...] | None:
        """The data-parallel ranks that read a file of ``ep_rank``'s experts (None: every one)."""
        return tuple(self.sharing(ep_rank)) if self.ep_size > 1 else None

    def holding(self, description: dict, ep_rank: int) -> dict:
        """``description`` with its optimizer groups cut to what ``ep_rank``'s ranks hold."""
        groups = [{**group, "params": self.held(group["params"], ep_rank)} for group in description["groups"]]
        return {**description, "groups": groups}
