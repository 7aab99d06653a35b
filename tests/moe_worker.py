"""Expert-parallel scenarios, run by tests/test_moe.py under ``torch.distributed.run`` (2 ranks).

    python -m torch.distributed.run --nproc_per_node 2 tests/moe_worker.py MODE ROOT RESULT

Each rank writes what it observed to ``RESULT.<rank>.json``; the pytest side asserts on it.
MODE may name several modes, comma-separated (tests/dist_worker.py's ``run_modes``).
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.dist_worker import run_modes  # noqa: E402
from tests.model_parallel_worker import barrier, differences, rank  # noqa: E402
from tools.engines import batches, destroy_engine, train, train_pipeline  # noqa: E402
from tools.moe_engines import (  # noqa: E402
    VOCAB,
    build_mixtral_engine,
    build_moe_engine,
    build_moe_pipeline_engine,
)

DATA = batches(6, vocab=VOCAB)
# (ZeRO stage, dtype) of the steps each layout commits; the reshards take some of them.
SAME_LAYOUT = {2: [(0, "fp32"), (0, "bf16"), (1, "fp32"), (1, "bf16"), (2, "fp32"), (2, "bf16")],
               1: [(0, "bf16"), (1, "fp32"), (2, "bf16")]}  # fmt: skip
RESHARDED = [(0, "bf16"), (2, "bf16")]
# A Hugging Face model with fused experts under plain ZeRO: each rank's partition cuts experts.
FUSED = [(2, "bf16"), (3, "bf16")]
# MoE layers inside a pipeline of 2 stages (ep 1): the configurations docs/moe.md measured.
PIPELINE = [(1, "bf16"), (0, "fp32")]


def train_seeded(engine, data, fit=train) -> list[float]:
    # The top-2 gate draws Gumbel noise, and a checkpoint holds no RNG state: every resume
    # trains from the same RNG state, or no two would agree.
    torch.manual_seed(5 + rank())
    return fit(engine, data)


def logical_state(engine) -> dict[str, torch.Tensor]:
    """Every fp32 master, optimizer state and module weight of the job's engine, whole, experts
    by global index ("name|kind"), gathered from every rank: what must survive a reshard."""
    import torch.distributed as dist

    from ckptstore.deepspeed import experts
    from ckptstore.deepspeed.extract import extract
    from ckptstore.model import WEIGHT

    fragments: dict[str, list] = {}
    for piece in extract(engine).pieces:
        if piece.kind != WEIGHT:  # stored only where it is not the master cast down
            fragments.setdefault(f"{piece.name}|{piece.kind}", []).append((piece.start, piece.tensor.clone()))
    renames = experts.live_to_global(engine)
    for name, param in engine.module.named_parameters():
        fragments[f"{renames.get(name, name)}|module"] = [(0, param.detach().clone())]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, fragments)
    whole: dict[str, torch.Tensor] = {}
    for key in sorted({key for part in every for key in part}):
        # a replica (dense weights, ZeRO 0) comes from every rank that holds it: once
        by_start = {start: tensor for part in reversed(every) for start, tensor in part.get(key, [])}
        whole[key] = torch.cat([by_start[start].reshape(-1) for start in sorted(by_start)])
    return whole


def leaves(obj, at: str = "", found: dict | None = None) -> dict[str, object]:
    """Every entry of a checkpoint file by its path of keys: a tensor's dtype and shape, the
    repr of anything else (partition counts, paddings, fragment addresses, names)."""
    found = {} if found is None else found
    if isinstance(obj, torch.Tensor):
        found[at] = (str(obj.dtype), tuple(obj.shape))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            leaves(value, f"{at}/{key}", found)
    elif isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        for i, value in enumerate(obj):
            leaves(value, f"{at}/{i}", found)
    else:
        found[at] = repr(obj)
    return found


def layout_differences(ours: Path, theirs: Path) -> list[str]:
    """The entries that differ between two checkpoint directories' files, tensors aside."""
    wrong = []
    for path in sorted(theirs.iterdir()):
        mine = leaves(torch.load(ours / path.name, weights_only=False))
        reference = leaves(torch.load(path, weights_only=False))
        wrong += [
            f"{path.name}{key}"
            for key in sorted(set(mine) | set(reference))
            if mine.get(key) != reference.get(key)
        ]
    return wrong


def unlike(ours: dict, theirs: dict) -> list[str]:
    if set(ours) != set(theirs):
        return [f"keys {sorted(set(ours) ^ set(theirs))[:6]}"]
    return [
        k
        for k in ours
        if ours[k].dtype != theirs[k].dtype or not torch.equal(ours[k].reshape(-1), theirs[k].reshape(-1))
    ]


def resume_three_ways(
    store, build, root: Path, own: Path, rollback=DATA[3:], fit=train, after=DATA[3:]
) -> dict:
    """Step 3 resumed by engines ``build(seed=)`` builds from DeepSpeed's own save
    (``root/deepspeed``), from the materialized directory (``root/materialized``) and by
    ``restore`` into an engine that trained (``fit``) on ``rollback`` first; each saved again
    at once and compared with DeepSpeed's save ``own`` (``{how}_resaved``: the differences),
    then trained on ``after`` (``{how}_losses``)."""
    run = {}
    for seed, how in enumerate(("deepspeed", "materialized", "restored"), start=41):
        resumed = build(seed=seed)
        if how == "restored":
            fit(resumed, rollback)
            run["restored_step"] = store.restore(resumed, 3)[0]
        else:
            resumed.load_checkpoint(str(root / how))
        run[f"{how}_step"] = resumed.global_steps
        resumed.save_checkpoint(str(root / f"{how}-resaved"))
        barrier()
        run[f"{how}_resaved"] = differences(root / f"{how}-resaved" / "global_step3", own)
        run[f"{how}_losses"] = train_seeded(resumed, after, fit)
        destroy_engine(resumed)
    return run


def same_layout(here: Path, configs: list[tuple[int, str]], build, fit=train, data=DATA) -> dict:
    """At each of ``configs`` (ZeRO stage, dtype), with engines ``build(stage, dtype, seed=)``
    builds, trained by ``fit`` (3 steps: ``data[:3]``, or ``data[:6]`` for a pipeline's two
    micro-batches a step): commit step 3 (and DeepSpeed's own save of it), materialize it,
    and resume from DeepSpeed's save, the materialized directory and ``restore``; each resume
    saved again is compared with DeepSpeed's save, file by file, then trained on."""
    per_step = 2 if fit is train_pipeline else 1
    import ckptstore

    results = {}
    for stage, dtype in configs:
        config = here / f"zero{stage}-{dtype}"
        store = ckptstore.open(config / "store", create=True)
        engine = build(stage, dtype)
        fit(engine, data[: 3 * per_step])
        store.commit(engine, step=3, blocking=stage != 1)
        store.wait()
        engine.save_checkpoint(str(config / "deepspeed"))
        committed = logical_state(engine)
        if rank() == 0:
            torch.save(committed, config / "logical.pt")
            store.materialize(3, config / "materialized")
        destroy_engine(engine)
        barrier()
        own = config / "deepspeed" / "global_step3"
        run = {"files": sorted(p.name for p in own.iterdir()),
               "materialized": differences(config / "materialized" / "global_step3", own),
               "materialized_layout": layout_differences(config / "materialized" / "global_step3", own)}  # fmt: skip
        build_one = partial(build, stage, dtype)
        rollback, after = data[3 * per_step : 4 * per_step], data[3 * per_step :]
        run.update(resume_three_ways(store, build_one, config, own, rollback, fit, after))
        results[f"zero{stage}-{dtype}"] = run
    return results


def reshard(here: Path, committed_ep: int, into_ep: int) -> dict:
    """Steps committed at ``committed_ep`` (by ``same_layout``'s run in ``here``) restored into
    an engine at ``into_ep`` and materialized for it, then loaded by DeepSpeed's own load:
    every expert's weights, masters and moments equal the committed step's, by global index,
    and the engine trains on."""
    import ckptstore

    results = {}
    for stage, dtype in RESHARDED:
        config = here / f"zero{stage}-{dtype}"
        committed = torch.load(config / "logical.pt")
        store = ckptstore.open(config / "store")
        run = {}
        engine = build_moe_engine(stage, dtype, seed=7, ep_size=into_ep)
        run["restored_step"] = store.restore(engine, 3)[0]
        run["restored"] = unlike(logical_state(engine), committed)
        # DeepSpeed finds an expert group's process groups by its name, which a load restores
        run["group_names"] = [group.get("name") for group in engine.optimizer.param_groups]
        run["restored_trains"] = all(loss == loss for loss in train_seeded(engine, DATA[3:4]))
        destroy_engine(engine)
        out = config / f"materialized-ep{into_ep}"
        if rank() == 0:
            store.materialize(3, out, ep_size=into_ep)
        barrier()
        run["files"] = sorted(p.name for p in (out / "global_step3").iterdir())
        if stage == 0 and into_ep < committed_ep:
            # DeepSpeed's ZeRO-0 load picks the expp_rank file by the rank in the largest
            # expert group any engine of the process made (here ep 2's, in "ep2"): it would
            # ask rank 1 for expp_rank_1 of this ep-1 directory. A job of one degree does not;
            # the single-process test loads such a directory (restore above hands the file).
            results[f"zero{stage}-{dtype}"] = run
            continue
        engine = build_moe_engine(stage, dtype, seed=8, ep_size=into_ep)
        engine.load_checkpoint(str(out))
        run["materialized"] = unlike(logical_state(engine), committed)
        destroy_engine(engine)
        results[f"zero{stage}-{dtype}"] = run
    return results


def pipeline_layout(here: Path) -> dict:
    """``same_layout`` of MoE layers inside a pipeline of 2 stages. DeepSpeed keeps expert
    groups by name for the life of the process (``ep_size_1``: here both ranks, from the modes
    before): a pipeline engine would take them as its own and partition each stage's experts
    over the other stage's rank as well. They are forgotten first, as in a job of its own."""
    from deepspeed.utils import groups

    for made in (groups._EXPERT_PARALLEL_GROUP, groups._EXPERT_PARALLEL_GROUP_RANKS,
                 groups._EXPERT_DATA_PARALLEL_GROUP, groups._EXPERT_DATA_PARALLEL_GROUP_RANKS):  # fmt: skip
        made.clear()
    return same_layout(here, PIPELINE, build_moe_pipeline_engine, train_pipeline, batches(12, vocab=VOCAB))


MODES = {
    "ep2": lambda here: same_layout(here, SAME_LAYOUT[2], partial(build_moe_engine, ep_size=2)),
    "ep1": lambda here: same_layout(here, SAME_LAYOUT[1], partial(build_moe_engine, ep_size=1)),
    "fused": lambda here: same_layout(here, FUSED, build_mixtral_engine),
    "pipeline": pipeline_layout,
    "ep2_into_ep1": lambda here: reshard(here.parent / "ep2", 2, 1),
    "ep1_into_ep2": lambda here: reshard(here.parent / "ep1", 1, 2),
}


def main() -> None:
    from tools.engines import setup_single_process_env

    setup_single_process_env()
    import logging

    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(verbose=False)
    mode, root, result = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    run_modes(MODES, mode, root, result)
    import os

    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
