"""The optimizer state of a ZeRO-3 checkpoint for any world size: the sub-groups DeepSpeed cuts at
that size and each rank's padded slice of every parameter, from placeholders ``write.Writer``
fills with the stored tensors (``writer``: that ``Writer``)."""

from __future__ import annotations

from typing import Any

from ..model import FP32
from .layout import zero3_bounds, zero3_slice


def resplit_subgroups(writer: Any) -> None:
    """Cut the step's ZeRO-3 param groups into the sub-groups DeepSpeed makes at the writer's
    world size (its ``groups`` are changed in place)."""
    # ZeRO-3 closes a sub-group once its per-rank partition numel reaches sub_group_size
    # (DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups), so the cut depends on W.
    config = writer.d["model_state"].get("ds_config")
    zero_config = config.get("zero_optimization", {}) if isinstance(config, dict) else {}
    sub_group_size = int(zero_config.get("sub_group_size", 1_000_000_000))
    for group in writer.d["groups"]:
        names = group["params"]
        sizes = [zero3_slice(writer.shape(n).numel(), writer.world_size) for n in names]
        if sub_group_size >= sum(sizes):
            subgroups = [names] if names else []
        else:
            subgroups, current, filled = [], [], 0
            for name, size in zip(names, sizes, strict=True):
                current.append(name)
                filled += size
                if filled >= sub_group_size or name == names[-1]:
                    subgroups.append(current)
                    current, filled = [], 0
        # All sub-groups of a param group step together; any one's counters stand for all.
        scalars = group["subgroup_scalars"][0] if group["subgroup_scalars"] else {}
        kinds = group["subgroup_kinds"][0] if group["subgroup_kinds"] else []
        group["subgroups"] = subgroups
        group["subgroup_scalars"] = [scalars] * len(subgroups)
        group["subgroup_kinds"] = [kinds] * len(subgroups)


def optimizer_files(writer: Any) -> list[dict]:
    """Each rank's ZeRO-3 optimizer state: every parameter's slice of each sub-group, padded,
    from the writer's placeholders (an engine's own buffer where ``into`` has one)."""
    W = writer.world_size
    per_rank: list[dict] = [{"state": {}, "param_groups": [], "fp32": []} for _ in range(W)]
    index = 0
    for group in writer.d["groups"]:
        indices = []
        for names, scalars, kinds in zip(
            group["subgroups"], group["subgroup_scalars"], group["subgroup_kinds"], strict=True
        ):
            numels = [writer.shape(name).numel() for name in names]
            parts = [zero3_slice(numel, W) for numel in numels]
            for r, out in enumerate(per_rank):
                # rank r holds slice r of every parameter, each padded to ceil(numel / W)
                flat = {}
                for kind in [FP32, *kinds]:
                    flat[kind] = writer.holes.new(
                        sum(parts), writer.group_dtype(names, kind), reuse=writer.into.get((kind, index, r))
                    )
                    offset = 0
                    for name, numel, part in zip(names, numels, parts, strict=True):
                        writer.place(flat[kind], name, kind, *zero3_bounds(numel, W, r), offset)
                        offset += part
                out["fp32"].append(flat[FP32])
                out["state"][index] = {**scalars, **{kind: flat[kind] for kind in kinds}}
            indices.append(index)
            index += 1
        for out in per_rank:
            out["param_groups"].append({**group["hyper"], "params": indices})
    files = []
    for out in per_rank:
        osd = dict(writer.d["optimizer_state"])
        osd["partition_count"] = W
        osd["optimizer_state_dict"] = {"state": out["state"], "param_groups": out["param_groups"]}
        osd["fp32_flat_groups"] = out["fp32"]
        files.append(osd)
    return files
