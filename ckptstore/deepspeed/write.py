"""Step description + stored per-parameter tensors -> DeepSpeed checkpoint files.

The files follow DeepSpeed's own layout (see shared/DEEPSPEED_FORMAT.md §7) for the flavour the
engine used, flattened, padded and partitioned for the requested data-parallel world size.
DeepSpeed objects (loss scalers, ``ZeroStageEnum``, ``fragment_address``) are rebuilt here from
plain data, so DeepSpeed must be importable when materializing.

The writer streams: it builds each file's object with placeholder tensors, recording which
*segments* of which stored tensors fill each placeholder (a ZeRO partition is the parameters
laid end to end, padded with zeros), saves that skeleton (``torchfile``), and leaves the bytes
to ``fill``, parameter by parameter. Memory holds a few parameters' tensors, not the model.
``stepfiles`` runs a writer per model-parallel rank and writes the directory.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .. import tensorsplit
from ..errors import CorruptError
from ..format import plainstate
from ..format.codec import DTYPES
from ..model import BUFFER, FP32, WEIGHT
from . import experts, zero0, zero3
from .fill import MODULE, Placeholders, Segment, TensorSource, stored_tensor
from .layout import (
    BASIC,
    BF16_OPTIMIZER,
    FP16_OPTIMIZER,
    FP16_UNFUSED,
    ZERO3,
    ZERO12,
    flat_fragments,
    flat_partition_size,
    zero3_bounds,
    zero3_slice,
)


def _fragment_address(numel: int, start: int):
    from deepspeed.utils.tensor_fragment import fragment_address

    return fragment_address(numel=numel, start=start)


def model_states_name(mp_rank: int) -> str:
    """The model-states file of a model-parallel rank at ZeRO 0-2."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


class Writer:
    """Builds the files of one model-parallel rank of a step for one data-parallel world size
    (the whole step's, without model parallelism): its description is that rank's
    (``parallel.rank_description``); ``holes`` may be shared with the other ranks' writers."""

    def __init__(
        self,
        description: dict,
        tensors: TensorSource,
        world_size: int,
        into: dict[tuple, torch.Tensor] | None = None,
        holes: Placeholders | None = None,
    ) -> None:
        self.d = plainstate.from_plain(description)
        self.model_parallel = self.d.get("model_parallel")
        self.mp_rank = self.model_parallel["rank"] if self.model_parallel else 0
        # Which tensor-parallel slice of a split parameter this rank's files hold.
        self.slice = self.model_parallel.get("slice", 0) if self.model_parallel else 0
        self._tensors = tensors
        self.flavour = self.d["flavour"]
        if self.flavour not in (ZERO12, BF16_OPTIMIZER, ZERO3, FP16_OPTIMIZER, FP16_UNFUSED, BASIC):
            raise CorruptError(f"the step's optimizer flavour {self.flavour!r} is unknown to this ckptstore")
        self.stage = self.d["zero_stage"]
        self.world_size = world_size
        self.params = self.d["params"]
        self.holes = holes if holes is not None else Placeholders()
        self.experts = experts.ExpertLayout(self.d, world_size)
        for group in self.d["groups"]:
            if self.experts.has_experts(group["params"]):
                group["hyper"] = experts.group_options(group["hyper"], self.experts.ep_size)
        # An engine's own tensors standing in for placeholders: ``(kind, group, rank)`` -> the
        # buffer to fill in place of that rank's partition of ``kind`` (ZeRO 1/2), and
        # ``(MODULE, name)`` -> the parameter itself, put in the module state dict unread.
        self.into = into or {}
        if self.flavour == ZERO3 and world_size != self.d["world_size"]:
            zero3.resplit_subgroups(self)

    def dtype(self, name: str, kind: str) -> torch.dtype:
        dtype = self._tensors.dtype(name, kind)
        if dtype is None:
            raise CorruptError(f"the store holds no {kind} tensor for {name}")
        return dtype

    def stored(self, name: str, kind: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A placeholder for the whole ``kind`` of ``name`` in its own shape."""
        shape = self.shape(name)
        placeholder = self.holes.new(shape.numel(), dtype or self.dtype(name, kind))
        self.place(placeholder, name, kind, 0, shape.numel(), 0)
        return placeholder.view(shape)

    def shape(self, name: str) -> torch.Size:
        """The shape of ``name`` in this rank's files: its slice of a tensor-parallel parameter."""
        return torch.Size(tensorsplit.slice_shape(self.params[name], self.slice))

    def place(
        self, placeholder: torch.Tensor, name: str, kind: str, start: int, length: int, at: int
    ) -> None:
        """Elements ``[start, start + length)`` of this rank's slice of ``kind`` of ``name`` fill
        ``placeholder`` from element ``at``."""
        start += tensorsplit.slice_offset(self.params[name], self.slice)
        self.holes.place(placeholder, Segment(name, kind, start, length, at))

    # -- module and model-states files -------------------------------------------------------

    def module(self) -> OrderedDict:
        module: OrderedDict[str, torch.Tensor] = OrderedDict()
        for key, role in self.d["module_keys"]:
            if role == "alias":
                module[key] = None  # filled below, once the owner is there
            elif role == BUFFER:
                # buffers are small and their shapes are not in the description: read now
                module[key] = stored_tensor(self._tensors, key, BUFFER)
            elif self.stage == 3:
                # ZeRO-3 module entries are empty placeholders; the loader refills params from fp32.
                module[key] = torch.empty(0, dtype=DTYPES[self.params[key]["dtype"]])
            else:
                module[key] = self.weight(key)
        for alias, owner in self.d["aliases"].items():
            if alias in module:
                module[alias] = module[owner]
        return module

    def weight(self, name: str) -> torch.Tensor:
        """The module weight: the fp32 master cast down, overlaid with any weight stored apart
        (or the engine's own parameter, where ``into`` has one of its shape and dtype)."""
        if not self.params[name]["trainable"]:
            return self.stored(name, WEIGHT)
        dtype = DTYPES[self.params[name]["dtype"]]
        own = self.into.get((MODULE, name))
        if own is not None and own.shape == self.shape(name) and own.dtype == dtype:
            return own
        return self.stored(name, MODULE, dtype)

    def frozen_names(self) -> list[str]:
        return [name for name, info in self.params.items() if not info["trainable"]]

    def model_state(self, rank: int, module: OrderedDict, optimizer) -> dict:
        # DeepSpeed keys these on ZeRO being on: BF16_Optimizer at ZeRO 0 (a pipeline's) has none
        zero = self.flavour in (ZERO12, BF16_OPTIMIZER, ZERO3) and self.stage > 0
        frozen = self.frozen_names()
        save_frozen = self.stage >= 2
        state = {
            "module": module,
            "buffer_names": [key for key, role in self.d["module_keys"] if role == BUFFER],
            "optimizer": optimizer,
            "param_shapes": self.param_shapes() if zero else None,
            "frozen_param_shapes": OrderedDict((n, self.shape(n)) for n in frozen) if save_frozen else None,
            "shared_params": (dict(self.d["aliases"]) if rank == 0 else {}) if zero else None,
            "frozen_param_fragments": (
                OrderedDict((n, self.frozen_fragment(n, rank)) for n in frozen) if save_frozen else None
            ),
        }
        extra = dict(self.d["model_state"])
        state.update(extra)
        state["dp_world_size"] = self.world_size
        return state

    def frozen_fragment(self, name: str, rank: int) -> torch.Tensor:
        if self.stage < 3:
            return self.stored(name, WEIGHT)
        numel = self.shape(name).numel()
        fragment = self.holes.new(zero3_slice(numel, self.world_size), self.dtype(name, WEIGHT))
        self.place(fragment, name, WEIGHT, *zero3_bounds(numel, self.world_size, rank), 0)
        return fragment

    def param_shapes(self) -> list[OrderedDict]:
        if self.flavour == ZERO3:
            flat_groups = [sub for group in self.d["groups"] for sub in group["subgroups"]]
        else:  # of the experts, rank 0's own, under their local names (DeepSpeed's)
            flat_groups = [self.experts.held(group["params"], 0) for group in self.d["groups"]]
        return [
            OrderedDict((self.experts.local_name(n), self.shape(n)) for n in names) for names in flat_groups
        ]

    # -- optimizer state ---------------------------------------------------------------------

    def group_dtype(self, names: list[str], kind: str) -> torch.dtype:
        return self.dtype(names[0], kind) if names else torch.float32

    def flat(self, names: list[str], kind: str) -> torch.Tensor:
        """A placeholder for ``kind`` of ``names`` laid end to end."""
        sizes = [self.shape(n).numel() for n in names]
        flat = self.holes.new(sum(sizes), self.group_dtype(names, kind))
        offset = 0
        for name, numel in zip(names, sizes, strict=True):
            self.place(flat, name, kind, 0, numel, offset)
            offset += numel
        return flat

    def partitioned(
        self, names: list[str], kind: str, size: int, group: int | None = None, ranks: list[int] | None = None
    ) -> list[torch.Tensor]:
        """Placeholders for ``kind`` of ``names`` laid end to end, zero-padded, one per rank of
        ``ranks`` (default: every rank), in that order (an engine buffer where ``into`` has one
        that fits)."""
        ranks = list(range(self.world_size)) if ranks is None else ranks
        dtype = self.group_dtype(names, kind)
        buffers = [self.holes.new(size, dtype, reuse=self.into.get((kind, group, r))) for r in ranks]
        offset = 0
        for name in names:
            end = offset + self.shape(name).numel()
            for r in range(offset // size, min(len(ranks), -(-end // size))):
                lo, hi = max(offset, r * size), min(end, (r + 1) * size)
                self.place(buffers[r], name, kind, lo - offset, hi - lo, lo - r * size)
            offset = end
        return buffers

    def partition_sets(self, names: list[str]) -> list[tuple[list[int], list[str]]]:
        """The ranks a ZeRO-1/2 group of ``names`` is partitioned over, each with the names laid
        out there: every rank over all of them, or for an expert group each expert-parallel
        rank's own experts over its expert-data-parallel group (DeepSpeed's moe groups)."""
        if not self.experts.has_experts(names):
            return [(list(range(self.world_size)), names)]
        return [(self.experts.sharing(e), self.experts.held(names, e)) for e in range(self.experts.ep_size)]

    def zero12_files(self) -> list[dict]:
        W = self.world_size
        groups = self.d["groups"]
        per_rank: list[dict] = [
            {"state": {}, "param_groups": [], "fp32": [], "paddings": [], "mappings": [], "counts": [],
             "alignment": []}
            for _ in range(W)
        ]  # fmt: skip
        for g, group in enumerate(groups):
            for ranks, names in self.partition_sets(group["params"]):
                used = sum(self.shape(n).numel() for n in names)
                size = flat_partition_size(used, len(ranks))
                # Each rank's partition gets its own zero-filled buffer (the tail padding), and every
                # parameter is copied straight into the ranks it overlaps: one copy per element.
                partitions = {
                    kind: self.partitioned(names, kind, size, g, ranks)
                    for kind in [FP32, *group["state_kinds"]]
                }
                for k, r in enumerate(ranks):
                    out = per_rank[r]
                    lo, hi = k * size, (k + 1) * size
                    padding = size if used <= lo else (hi - used if used < hi else 0)
                    fp32 = partitions[FP32][k]
                    # ZeRO 1/2 save the fp32 partition without its padding (a view, as DeepSpeed does).
                    out["fp32"].append(fp32[: size - padding] if self.flavour == ZERO12 else fp32)
                    out["paddings"].append(padding)
                    entry = dict(group["scalars"])
                    entry.update({kind: partitions[kind][k] for kind in group["state_kinds"]})
                    out["state"][g] = entry
                    out["param_groups"].append({**group["hyper"], "params": [g]})
                    out["mappings"].append(self.slice_mappings(names, lo, hi))
                    out["counts"].append(len(ranks))
                    out["alignment"].append([0] * len(names))
        files = []
        for out in per_rank:
            osd = dict(self.d["optimizer_state"])
            osd["base_optimizer_state"] = {"state": out["state"], "param_groups": out["param_groups"]}
            osd["single_partition_of_fp32_groups"] = out["fp32"]
            osd["group_paddings"] = out["paddings"]
            if self.flavour == ZERO12:
                osd["param_alignment_paddings"] = out["alignment"]
            osd["partition_count"] = out["counts"]
            osd["param_slice_mappings"] = out["mappings"]
            files.append(osd)
        return files

    def slice_mappings(self, names: list[str], lo: int, hi: int) -> OrderedDict:
        numels = [self.shape(name).numel() for name in names]
        return OrderedDict(
            (self.experts.local_name(names[i]), _fragment_address(count, position - lo))
            for i, _, count, position in flat_fragments(numels, lo, hi)
        )

    # -- files -----------------------------------------------------------------------------

    def expert_files(self, module: OrderedDict) -> list[tuple[str, object, int | tuple[int, ...] | None]]:
        """The file of every expert of every MoE layer, under its global index."""
        found = self.d.get("experts") or {"layers": []}
        return [
            (
                experts.expert_file_name(layer, expert, self.mp_rank),
                OrderedDict((k, module[k]) for k in keys),
                self.experts.readers(keys[0]) if keys else None,
            )
            for layer, described in enumerate(found["layers"])
            for expert, keys in enumerate(described["experts"])
        ]

    def files(self) -> list[tuple[str, object, int | tuple[int, ...] | None]]:
        """Every file of this model-parallel rank: its name, its object (placeholders where
        stored tensors go) and the data-parallel rank or ranks that read it (None: every rank)."""
        files: list[tuple[str, object, int | tuple[int, ...] | None]] = []
        module = self.module()
        mp = f"mp_rank_{self.mp_rank:02d}"
        layer_files = self.model_parallel.get("layer_files") if self.model_parallel else None
        # A pipeline's module state is in its layer files; its model-states file has none, and
        # a MoE model's experts are in their own files.
        in_expert_files = experts.expert_keys(self.d)
        states_module = (
            None
            if layer_files
            else OrderedDict((key, value) for key, value in module.items() if key not in in_expert_files)
        )
        ds_config = self.d["model_state"].get("ds_config")
        ds_version = self.d["model_state"].get("ds_version")
        prefix = "bf16_" if self.d["bf16"] else ""
        if self.flavour in (ZERO12, BF16_OPTIMIZER, ZERO3):
            optim_files = zero3.optimizer_files(self) if self.flavour == ZERO3 else self.zero12_files()
            for r, osd in enumerate(optim_files):
                files.append((
                    f"{prefix}zero_pp_rank_{r}_{mp}_optim_states.pt",
                    {"optimizer_state_dict": osd, "ds_config": ds_config, "ds_version": ds_version},
                    r,
                ))  # fmt: skip
            if self.flavour == ZERO3:
                for r in range(self.world_size):
                    files.append(
                        (
                            f"zero_pp_rank_{r}_{mp}_model_states.pt",
                            self.model_state(r, states_module, None),
                            r,
                        )
                    )
            else:
                # BF16_Optimizer at ZeRO 0 (a pipeline's): DeepSpeed also saves the state of data
                # parallel rank 0 (its own state_dict) in the model-states file
                optimizer = optim_files[0] if self.flavour == BF16_OPTIMIZER and self.stage == 0 else None
                files.append(
                    (model_states_name(self.mp_rank), self.model_state(0, states_module, optimizer), None)
                )
        else:
            # Each expert-parallel rank's optimizer holds its own experts; the model states
            # keep rank 0's, which an MoE load never reads (it reads the expp_rank files).
            optimizers = [
                zero0.optimizer_state(self.flavour, self.experts.holding(self.d, e), self.stored, self.flat)
                for e in range(self.experts.ep_size)
            ]
            files.append(
                (model_states_name(self.mp_rank), self.model_state(0, states_module, optimizers[0]), None)
            )
            if "experts" in self.d:
                files.extend(
                    (
                        experts.optimizer_file_name(e, self.mp_rank),
                        {"optimizer": optimizer},
                        self.experts.readers_of(e),
                    )
                    for e, optimizer in enumerate(optimizers)
                )
        files.extend(self.expert_files(module))
        for name, keys in layer_files or ():
            files.append((name, OrderedDict((key, module[full_name]) for key, full_name in keys), None))
        return files
