"""A tensor-parallel parameter as a step keeps it: its slices one after another.

A parameter that tensor-parallel ranks hold in slices along one dimension is described at its
logical shape with its ``split``: ``{"dim": d, "sizes": [s0, s1, ...]}``, slice ``t`` holding
``sizes[t]`` of dimension ``d``. Its pieces are addressed in one flat space of the logical
numel: slice 0 flattened, then slice 1, and so on, so each rank's ZeRO fragments are
contiguous ranges of it and a slice is a piece of its logical parameter like any other. Split
along dimension 0 that order is the logical tensor's own; along another dimension it is a
permutation of it, which ``to_logical`` and ``from_logical`` undo and redo.

A parameter fused from sub-parameters that are each cut across the ranks (AutoTP's fused
``qkv_proj`` of grouped-query attention: q, k and v of unequal sizes, each split on head
boundaries, DeepSpeed's ``sub_param_shard_widths``) adds ``"sub"``: one list per sub-parameter
of its width on each slice, ``{"dim": 0, "sizes": [64, 32], "sub": [[32, 16], [16, 8], [16, 8]]}``.
Slice ``t`` is then this rank's piece of every sub-parameter one after another along ``dim``
(so ``sizes[t]`` is the sum of the sub-parameters' widths on it), and the logical tensor is
the sub-parameters whole, one after another: what ``ds_to_universal`` writes for it.

A parameter every rank holds whole but whose copies may differ (``parameter_to_average_patterns``:
norms that bf16 let drift apart on each rank, BLOOM's) keeps every rank's copy:
``{"dim": 0, "sizes": [n, n, ...], "average": true}``, its ``shape`` the copies one after
another along dimension 0 (as a split of ``len(sizes)`` slices, so each rank's files get its
own copy back). Its logical tensor (``logical_shape``: one copy's) is their mean, computed as
``ds_to_universal``'s ``merge_tp_slices`` computes it (``sum(copies) / len(copies)``), and a
layout of another degree gets that mean on every rank.
"""

from __future__ import annotations

import math

import torch


def split_of(info: dict) -> dict | None:
    """The parameter's tensor-parallel split (``info`` is its description entry), or None."""
    return info.get("split")


def averaged(info: dict) -> bool:
    """Whether the parameter keeps every rank's copy and is logically their mean."""
    split = split_of(info)
    return split is not None and split.get("average") is True


def logical_shape(info: dict) -> list[int]:
    """The parameter's logical shape: its ``shape``, one copy's for an averaged parameter."""
    shape = list(info["shape"])
    if averaged(info):
        shape[0] = info["split"]["sizes"][0]
    return shape


def sub_widths(split: dict) -> list[list[int]]:
    """Each sub-parameter's width on each slice (one sub-parameter, the whole slice, where the
    split names none)."""
    return split.get("sub") or [split["sizes"]]


def in_logical_order(info: dict) -> bool:
    """Whether the parameter's flat stored order is its logical tensor's (unsplit, in one
    slice, or split along dimension 0 without sub-parameters)."""
    split = split_of(info)
    if split is not None and averaged(info):
        return False
    return split is None or len(split["sizes"]) == 1 or (split["dim"] == 0 and len(sub_widths(split)) == 1)


def slice_shape(info: dict, index: int) -> list[int]:
    """The shape of slice ``index`` (the whole shape for an unsplit parameter)."""
    shape = list(info["shape"])
    split = split_of(info)
    if split is not None:
        shape[split["dim"]] = split["sizes"][index]
    return shape


def slice_offset(info: dict, index: int) -> int:
    """Where slice ``index`` starts in the flat stored order (0 for an unsplit parameter)."""
    split = split_of(info)
    if split is None:
        return 0
    return sum(math.prod(slice_shape(info, t)) for t in range(index))


def to_logical(flat: torch.Tensor, info: dict) -> torch.Tensor:
    """The logical tensor (in ``logical_shape(info)``) of a flat tensor in stored order."""
    flat = flat.reshape(-1)
    if in_logical_order(info):
        return flat.view(info["shape"])
    split = split_of(info)
    if averaged(info):
        copies = flat.view(info["shape"]).split(split["sizes"][0], dim=0)
        return sum(copies) / len(copies)  # merge_tp_slices' mean, bit for bit
    dim, widths = split["dim"], sub_widths(split)
    slices, start = [], 0
    for index in range(len(split["sizes"])):
        shape = slice_shape(info, index)
        piece = flat[start : start + math.prod(shape)].view(shape)
        slices.append(piece.split([sub[index] for sub in widths], dim=dim))
        start += math.prod(shape)
    subs = [torch.cat([pieces[j] for pieces in slices], dim=dim) for j in range(len(widths))]
    return torch.cat(subs, dim=dim)


def from_logical(tensor: torch.Tensor, info: dict) -> torch.Tensor:
    """The flat stored order of the logical ``tensor`` for the split ``info`` describes."""
    if in_logical_order(info):
        return tensor.reshape(-1)
    split = split_of(info)
    if averaged(info):  # the mean, as every rank's copy (what load_universal gives each)
        return tensor.reshape(-1).repeat(len(split["sizes"]))
    dim, widths = split["dim"], sub_widths(split)
    subs = tensor.view(info["shape"]).split([sum(sub) for sub in widths], dim=dim)
    cut = [whole.split(sub, dim=dim) for whole, sub in zip(subs, widths, strict=True)]
    slices = [torch.cat([pieces[index] for pieces in cut], dim=dim) for index in range(len(split["sizes"]))]
    return torch.cat([piece.reshape(-1) for piece in slices])


def same_order(one: dict, other: dict) -> bool:
    """Whether two descriptions of one parameter store its elements in the same flat order."""
    if in_logical_order(one) and in_logical_order(other):
        return True
    return split_of(one) == split_of(other)


def description_problem(description: object) -> str | None:
    """What is wrong with the model parallelism a step's ``description`` (plain JSON data)
    gives the code that lays it out, or None: every parameter's ``original_vocab_size`` (a
    vocabulary's rows that are no padding: at most its rows), its ``split`` (an ``int`` dim
    within its shape, sizes of at least one slice, non-negative, adding up to that dim; its
    ``sub``, where it has one, a list per sub-parameter of a width per slice, the widths on
    each slice adding up to its size), its ``experts`` (``fused_experts``: a split of an
    unsplit parameter's rows into slices of at least one) and ``model_parallel`` (its degree, each rank's part numbered in order with a slice that
    every split parameter it holds has, layer files that are plain file names). Checked as a
    manifest is decoded, so a bad value is a corrupt step rather than an error deep in a read."""
    if not isinstance(description, dict):
        return None  # not this check's to say (the manifest's own parse refuses it)
    params = description.get("params")
    params = params if isinstance(params, dict) else {}
    slices: dict[str, int] = {}  # split parameter -> its number of slices
    for name, info in params.items():
        rows = info.get("original_vocab_size") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if rows is not None and not (_count(rows) and isinstance(shape, list) and shape and rows <= shape[0]):
            return f"parameter {name!r} has an original_vocab_size {rows!r:.20} beyond its rows"
        if isinstance(info, dict) and "experts" in info and (problem := _experts_problem(info)) is not None:
            return f"parameter {name!r} {problem}"
        split = info.get("split") if isinstance(info, dict) else None
        if split is None:
            continue
        shape = info.get("shape")
        if not isinstance(shape, list) or not all(_count(d) for d in shape):
            return f"parameter {name!r} has a split but no valid shape"
        dim = split.get("dim") if isinstance(split, dict) else None
        if not _count(dim) or dim >= len(shape):
            return f"parameter {name!r} of shape {shape} is split along no dimension of it ({split!r:.80})"
        sizes = split.get("sizes")
        if not isinstance(sizes, list) or not sizes or not all(_count(s) for s in sizes):
            return f"parameter {name!r} has a split without valid slice sizes ({split!r:.80})"
        if sum(sizes) != shape[dim]:
            return (
                f"parameter {name!r}: its slices add up to {sum(sizes)}, not its dimension {dim} of {shape}"
            )
        if "average" in split and (
            split["average"] is not True or dim != 0 or "sub" in split or len(set(sizes)) != 1
        ):
            return f"parameter {name!r} is averaged over copies that are no equal slices along dimension 0 ({split!r:.80})"
        if (problem := _sub_problem(split.get("sub"), sizes)) is not None:
            return f"parameter {name!r} has sub-parameters {problem} ({split!r:.80})"
        slices[name] = len(sizes)
    parallel = description.get("model_parallel")
    if parallel is None:
        return None
    degree = parallel.get("size") if isinstance(parallel, dict) else None
    if not _count(degree) or degree < 1:
        return f"its model-parallel degree is not a positive integer ({parallel!r:.80})"
    if "ranks" not in parallel:
        return _part_problem(parallel, degree, None, list(params), slices)
    ranks = parallel["ranks"]
    if not isinstance(ranks, list) or len(ranks) != degree:
        return f"it describes other than {degree} model-parallel ranks"
    for index, own in enumerate(ranks):
        part = own.get("model_parallel") if isinstance(own, dict) else None
        held = own.get("params") if isinstance(own, dict) else None
        if not isinstance(held, list) or not all(isinstance(n, str) and n in params for n in held):
            return f"model-parallel rank {index} holds parameters the step does not describe"
        if (problem := _part_problem(part, degree, index, held, slices)) is not None:
            return problem
    return None


def _experts_problem(info: dict) -> str | None:
    """What is wrong with a fused expert parameter's ``experts`` (``fused_experts``): a split
    along dimension 0 of an unsplit parameter into slices of at least one row."""
    experts, shape = info["experts"], info.get("shape")
    if not isinstance(shape, list) or not shape or not all(_count(d) for d in shape) or "split" in info:
        return "has experts but no valid shape, or a tensor-parallel split as well"
    sizes = experts.get("sizes") if isinstance(experts, dict) else None
    if (
        not isinstance(experts, dict) or set(experts) != {"dim", "sizes"} or experts["dim"] != 0
        or type(experts["dim"]) is not int or not isinstance(sizes, list) or not sizes
        or not all(_count(s) and s > 0 for s in sizes) or sum(sizes) != shape[0]
    ):  # fmt: skip
        return f"of shape {shape} has experts that are no slices of its rows ({experts!r:.80})"
    return None


def _sub_problem(sub: object, sizes: list[int]) -> str | None:
    """What is wrong with a split's ``sub`` (absent: nothing), given its slices' ``sizes``."""
    if sub is None:
        return None
    if not isinstance(sub, list) or not sub:
        return "that are no list of widths"
    if not all(isinstance(w, list) and len(w) == len(sizes) and all(_count(n) for n in w) for w in sub):
        return f"without a non-negative width on each of its {len(sizes)} slices"
    if [sum(widths) for widths in zip(*sub, strict=True)] != sizes:
        return "whose widths on a slice do not add up to its size"
    return None


def _part_problem(
    part: object, degree: int, index: int | None, held: list, slices: dict[str, int]
) -> str | None:
    """``description_problem`` of one model-parallel rank's ``model_parallel`` part."""
    if not isinstance(part, dict):
        return f"model-parallel rank {index} has no part"
    rank = part.get("rank")
    if (
        not _count(rank)
        or rank >= degree
        or (index is not None and rank != index)
        or part.get("size") != degree
    ):
        return f"model-parallel rank {index} is numbered {rank!r} of {part.get('size')!r}, not of {degree}"
    where = part.get("slice", 0)
    if not _count(where) or any(where >= slices[name] for name in held if name in slices):
        return f"model-parallel rank {rank} holds slice {where!r}, which a parameter it holds has not"
    files = part.get("layer_files", [])
    if not isinstance(files, list) or not all(
        isinstance(entry, list) and len(entry) == 2 and _file_name(entry[0]) and isinstance(entry[1], list)
        and all(isinstance(k, list) and len(k) == 2 and all(isinstance(s, str) for s in k) for k in entry[1])
        for entry in files
    ):  # fmt: skip
        return f"model-parallel rank {rank} names layer files that are no plain file names"
    return None


def _count(value: object) -> bool:
    """A non-negative ``int`` (JSON's ``true`` is no number here)."""
    return type(value) is int and value >= 0


def _file_name(name: object) -> bool:
    """A name that stays in the checkpoint folder it is written to."""
    return (
        isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
        and "\0" not in name
    )  # fmt: skip
