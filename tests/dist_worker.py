"""Multi-rank scenarios, run by tests/test_many_ranks.py under ``torch.distributed.run``.

    python -m torch.distributed.run --nproc_per_node 2 tests/dist_worker.py MODE ROOT RESULT

Each rank writes what it observed to ``RESULT.<rank>.json``; the pytest side asserts on it.
MODE may name several modes, comma-separated: one job (one interpreter start per rank) runs
them one after another, each in ``ROOT/<mode>``, each rank writing ``RESULT.<mode>.<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import batches, build_engine, setup_single_process_env, train  # noqa: E402

CONFIGS = [(stage, dtype) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]
DATA = batches(6)


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def matches_store(engine, store, step, client_state=None) -> list[str]:
    """(name, kind, start) pieces of this rank's engine state that differ from the store's
    tensors (``client_state`` as the commit had it: a Megatron client's says how it is split)."""
    import json as _json

    from ckptstore.deepspeed.extract import extract
    from ckptstore.materialize.directory import step_reader

    tensors = step_reader(store.objects, store.catalog, step, _json.loads(store.catalog.description(step)))
    wrong = []
    for piece in extract(engine, client_state).pieces:
        full = tensors(piece.name, piece.kind)
        if full is None and piece.kind == "weight":
            full = tensors(piece.name, "fp32").to(piece.tensor.dtype)  # derived module weight
        expected = full.reshape(-1)[piece.start : piece.start + piece.tensor.numel()]
        if not expected.equal(piece.tensor.reshape(-1).cpu()):
            wrong.append(f"{piece.name} {piece.kind} {piece.start}")
    return wrong


def resume(root: Path) -> dict:
    import ckptstore

    results = {}
    for stage, dtype in CONFIGS:
        name = f"zero{stage}-{dtype}"
        store = ckptstore.open(root / name)
        engine = build_engine("llama", zero_stage=stage, dtype=dtype, seed=0, num_layers=3)
        train(engine, DATA[:3])
        store.commit(engine, step=3)
        reference = train(engine, DATA[3:])
        if rank() == 0:
            store.materialize(3, root / f"{name}-out")
        barrier()
        resumed = build_engine("llama", zero_stage=stage, dtype=dtype, seed=99, num_layers=3)
        resumed.load_checkpoint(str(root / f"{name}-out"))
        loaded_step = resumed.global_steps
        results[name] = {
            "reference": reference,
            "resumed": train(resumed, DATA[3:]),
            "loaded_step": loaded_step,
        }
    return results


def non_blocking(root: Path) -> dict:
    """Non-blocking commits at every step on 2 ranks (ZeRO 2 and 3, bf16), then resume from the last."""
    import ckptstore

    results = {}
    for stage in (2, 3):
        store = ckptstore.open(root / f"zero{stage}")
        engine = build_engine("llama", zero_stage=stage, dtype="bf16", seed=0, num_layers=3)
        handles = []
        for step in range(1, 4):
            train(engine, DATA[step - 1 : step])
            handles.append(store.commit(engine, step=step, blocking=False))
        reference = train(engine, DATA[3:])  # runs while the last commit is still in flight
        steps = [handle.result().step for handle in handles]
        if rank() == 0:
            store.materialize(3, root / f"zero{stage}-out")
        barrier()
        resumed = build_engine("llama", zero_stage=stage, dtype="bf16", seed=99, num_layers=3)
        resumed.load_checkpoint(str(root / f"zero{stage}-out"))
        results[f"zero{stage}"] = {
            "steps": steps,
            "reference": reference,
            "resumed": train(resumed, DATA[3:]),
        }
        store.close()
    return results


def commit_every_step(store, engine, deepspeed: Path) -> dict:
    """Train steps 1 to 4, committing each behind training as it ends: under
    ``when_busy="latest"``, step 4 under ``"skip"``; DeepSpeed's own save of step 3 goes to
    ``deepspeed``. Returns each step's handle."""
    handles = {}
    for step in range(1, 5):
        train(engine, DATA[step - 1 : step])
        handles[step] = store.commit(
            engine, step=step, blocking=False, when_busy="skip" if step == 4 else "latest"
        )
        if step == 3:
            engine.save_checkpoint(str(deepspeed))
    return handles


def latest(root: Path) -> dict:
    """A commit every step under ``when_busy="latest"`` (step 4: ``"skip"``) while rank 0 holds
    the store's lock as a gc does, so that step 1's commit stays in flight on both ranks:
    both must decide alike, commit the same steps, and step 3 must be the state at step 3."""
    import fcntl

    import ckptstore
    from tests.model_parallel_worker import differences

    store = ckptstore.open(root / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2, scheduler=False)
    lock = open(root / "store" / "lock", "a")  # noqa: SIM115 - closed below
    if rank() == 0:
        fcntl.flock(lock, fcntl.LOCK_EX)
    barrier()
    handles = commit_every_step(store, engine, root / "deepspeed")
    outcomes_held = [handles[step].outcome for step in range(1, 5)]
    barrier()
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    store.wait()
    found = {"held": outcomes_held, "outcomes": [handles[step].outcome for step in range(1, 5)]}
    found["steps"] = store.steps()
    if rank() == 0:
        store.materialize(3, root / "materialized")
        found["materialized"] = differences(
            root / "materialized" / "global_step3", root / "deepspeed" / "global_step3"
        )
    store.close()
    return found


def composite(root: Path) -> dict:
    """Parity-style commits on 2 ranks: each layer of the composite step equals its source step."""
    import ckptstore

    results = {}
    for stage in (1, 3):
        name = f"composite-zero{stage}"
        store = ckptstore.open(root / name)
        engine = build_engine("llama", zero_stage=stage, dtype="bf16", seed=0, num_layers=3)
        train(engine, DATA[:2])
        store.commit(engine, step=2)
        train(engine, DATA[2:3])
        store.commit(engine, step=3, layers=["model.layers.1"])
        if rank() == 0:
            store.materialize(3, root / f"{name}-out")
        barrier()
        resumed = build_engine("llama", zero_stage=stage, dtype="bf16", seed=99, num_layers=3)
        resumed.load_checkpoint(str(root / f"{name}-out"))
        results[name] = {"wrong": matches_store(resumed, store, 3), "sources": store.sources(3),
                         "losses": train(resumed, DATA[3:5])}  # fmt: skip
    return results


def tailor(root: Path) -> dict:
    """UpdateMagnitude commits on 2 ranks: what each rank chose and measured, and (rank 0)
    whether the recorded samples equal samples taken from the stored whole tensors."""
    import json as _json

    import ckptstore
    from ckptstore.commit import stats
    from ckptstore.materialize.directory import step_reader
    from ckptstore.model import Piece
    from ckptstore.strategies import UpdateMagnitude

    results = {}
    for stage in (2, 3):
        name = f"tailor-zero{stage}"
        store = ckptstore.open(root / name)
        engine = build_engine("llama", zero_stage=stage, dtype="bf16", seed=0, num_layers=3)
        runs = []
        for step in (1, 2, 3, 4):
            train(engine, DATA[step - 1 : step])
            report = store.commit(engine, step=step, layers=UpdateMagnitude(threshold=0.02, max_age=2))
            runs.append({"saved": report.layers_saved, "updates": report.updates})
        mismatched = []
        if rank() == 0:
            for step in (1, 2, 3, 4):
                description = _json.loads(store.catalog.description(step))
                params = description["params"]
                tensors = step_reader(store.objects, store.catalog, step, description)
                whole = [Piece(n, "fp32", 0, tensors(n, "fp32")) for n in params if params[n]["trainable"]]
                expected = stats.own_samples(whole, params)
                recorded = store.catalog.samples(step, list(params))
                for param, sample in recorded.items():
                    if expected[param] != [(0, sample)]:
                        mismatched.append(f"{step} {param}")
                if step == 1 and len(recorded) != len(whole):
                    mismatched.append(f"step 1 recorded {len(recorded)} of {len(whole)} samples")
        results[name] = {"runs": runs, "mismatched": mismatched}
    return results


# Configs committed by a job of one size and loaded by a job of another.
RESHARD = {
    "zero1": (1, {}),
    "zero2": (2, {}),
    "zero3": (3, {}),
    "zero3-subgroups": (3, {"zero_optimization": {"sub_group_size": 1500}}),
}


def commit_only(root: Path) -> dict:
    """Commit step 3 of each config on this job's ranks (materialized elsewhere for another size)."""
    import ckptstore

    for name, (stage, overrides) in RESHARD.items():
        store = ckptstore.open(root / name)
        engine = build_engine("llama", zero_stage=stage, dtype="bf16", seed=0, num_layers=3, **overrides)
        train(engine, DATA[:3])
        store.commit(engine, step=3)
    return {}


def load_other_size(root: Path) -> dict:
    """Load steps committed by a job of another size, materialized for this job's size."""
    import torch.distributed as dist

    import ckptstore

    results = {}
    size = dist.get_world_size()
    for name, (stage, overrides) in RESHARD.items():
        store = ckptstore.open(root / name)
        if rank() == 0:
            store.materialize(3, root / f"{name}-w{size}", world_size=size)
        barrier()
        engine = build_engine("llama", zero_stage=stage, dtype="bf16", seed=99, num_layers=3, **overrides)
        engine.load_checkpoint(str(root / f"{name}-w{size}"))
        results[name] = {"wrong": matches_store(engine, store, 3), "loaded_step": engine.global_steps,
                                   "losses": train(engine, DATA[3:5])}  # fmt: skip
    return results


def failing_rank(root: Path) -> dict:
    """Rank 1's uploads fail: every rank must raise, and no step may be recorded."""
    import ckptstore
    from ckptstore.errors import StorageError

    store = ckptstore.open(root / "failing")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    train(engine, DATA[:1])
    if rank() == 1:

        def broken_put(name, data):
            raise StorageError("injected: disk on fire")

        store.objects.put_if_absent = broken_put
    try:
        store.commit(engine, step=1)
        outcome = "committed"
    except ckptstore.CkptStoreError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    barrier()
    return {"outcome": outcome, "steps": ckptstore.open(root / "failing").steps()}


def per_rank_files(root: Path) -> dict:
    """Each rank keeps its own files with the step (and one both have); then both give the same
    path different contents, which no rank may commit."""
    import ckptstore

    store = ckptstore.open(root / "files")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    train(engine, DATA[:1])
    mine = root / f"rank{rank()}"
    mine.mkdir()
    import torch

    torch.save(
        {"rank": rank(), "cpu": torch.arange(4, dtype=torch.uint8) + rank()}, mine / f"rng_state_{rank()}.pth"
    )
    (mine / "trainer_state.json").write_text('{"global_step": 1}')
    store.commit(engine, step=1, files=mine)
    (mine / "trainer_state.json").write_text(f'{{"rank": {rank()}}}')
    try:
        store.commit(engine, step=2, files=mine)
        outcome = "committed"
    except ckptstore.CkptStoreError as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    barrier()
    return {"files": [row.path for row in store.files(1)], "outcome": outcome, "steps": store.steps()}


def attached(root: Path) -> dict:
    """save_checkpoint/load_checkpoint through an attached store, against DeepSpeed's own files."""
    import ckptstore
    from ckptstore.integrations.deepspeed import attach

    seen = {}
    for stage in (0, 1, 2, 3):
        store = ckptstore.open(root / f"store{stage}")
        engine = build_engine("llama", zero_stage=stage, dtype="bf16", seed=0, num_layers=2)
        train(engine, DATA[:3])
        engine.save_checkpoint(str(root / f"deepspeed{stage}"))
        attach(engine, store)
        engine.save_checkpoint(str(root / f"run{stage}"))
        reference = build_engine("llama", zero_stage=stage, dtype="bf16", seed=1, num_layers=2)
        reference.load_checkpoint(str(root / f"deepspeed{stage}"))
        resumed = build_engine("llama", zero_stage=stage, dtype="bf16", seed=2, num_layers=2)
        attach(resumed, store)
        resumed.load_checkpoint(str(root / f"run{stage}"))
        seen[f"zero{stage}"] = {
            "steps": store.steps(), "pt_files": len(list((root / f"run{stage}").rglob("*.pt"))),
            "reference": train(reference, DATA[3:]), "resumed": train(resumed, DATA[3:]),
        }  # fmt: skip
    return seen


def trainer(root: Path) -> dict:
    """The Hugging Face Trainer on two ranks with CkptStoreCallback, resumed from a materialized
    step, against the Trainer resuming from its own checkpoint of a run without the callback."""
    import ckptstore
    from ckptstore.integrations.transformers import CkptStoreCallback
    from tests.test_trainer import train as trainer_run

    seen = {}
    for stage in (2, 3):
        trainer_run(root / f"own{stage}", stage)
        reference = trainer_run(
            root / f"own-resumed{stage}", stage, resume=root / f"own{stage}" / "checkpoint-2"
        )
        store_path = root / f"store{stage}"
        trainer_run(root / f"run{stage}", stage, callbacks=[CkptStoreCallback(store_path)])
        if rank() == 0:
            ckptstore.open(store_path).materialize(2, root / f"out{stage}" / "checkpoint-2")
        barrier()
        resumed = trainer_run(root / f"resumed{stage}", stage, resume=root / f"out{stage}" / "checkpoint-2")
        files = [row.path for row in ckptstore.open(store_path).files(2)]
        seen[f"zero{stage}"] = {"files": files, "reference": {k: v for k, v in reference.items() if k > 2},
                                "resumed": {k: v for k, v in resumed.items() if k > 2}}  # fmt: skip
    return seen


def s3_machines(root: Path) -> dict:
    """Each rank on a machine of its own (own catalog cache) commits into the S3 store named by
    $CKPTSTORE_STORE; a third machine materializes the step; both ranks resume from it."""
    import ckptstore

    uri = os.environ["CKPTSTORE_STORE"]
    os.environ["CKPTSTORE_CACHE"] = str(root / f"cache-rank{rank()}")
    store = ckptstore.open(uri)
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=3)
    train(engine, DATA[:3])
    store.commit(engine, step=3)
    reference = train(engine, DATA[3:])
    store.commit(engine, step=6, layers=["model.layers.1"])
    seen = {"steps": store.steps(), "sources": store.sources(6)}
    # Both ranks again, now on one node sharing a fresh cache, importing the steps at once.
    os.environ["CKPTSTORE_CACHE"] = str(root / "cache-node")
    barrier()
    seen["shared_cache_steps"] = ckptstore.open(uri).steps()
    if rank() == 0:
        os.environ["CKPTSTORE_CACHE"] = str(root / "cache-elsewhere")
        ckptstore.open(uri, create=False).materialize(3, root / "out")
    barrier()
    resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=99, num_layers=3)
    resumed.load_checkpoint(str(root / "out"))
    seen.update(loaded_step=resumed.global_steps, reference=reference, resumed=train(resumed, DATA[3:]))
    # Each rank restores step 3 straight from the bucket, from an empty cache of its own,
    # counting every byte it fetches.
    os.environ["CKPTSTORE_CACHE"] = str(root / f"cache-restore-rank{rank()}")
    fresh = ckptstore.open(uri, create=False)
    fetched = [0]

    def counted(read):
        def counting(*args, **kwargs):
            data = read(*args, **kwargs)
            fetched[0] += len(data)
            return data

        return counting

    fresh.objects.get, fresh.objects.get_range = counted(fresh.objects.get), counted(fresh.objects.get_range)
    restored = build_engine("llama", zero_stage=2, dtype="bf16", seed=98, num_layers=3)
    step, _ = fresh.restore(restored, 3)
    seen["restore"] = {"step": step, "fetched": fetched[0], "step_bytes": sum(row.bytes for row in fresh.show(3)),
                       "losses": train(restored, DATA[3:])}  # fmt: skip
    return seen


def tiered_nodes(root: Path) -> dict:
    """Each rank on a node of its own (own catalog cache, own local tier) in front of the S3 store
    named by $CKPTSTORE_STORE: commit step 2, then step 3 (non-blocking), drain, and check the
    bucket from a fresh cache with no tier."""
    import ckptstore
    from ckptstore.catalog.sync import read_manifest
    from ckptstore.format.layout import pack_name

    uri = os.environ["CKPTSTORE_STORE"]
    os.environ["CKPTSTORE_CACHE"] = str(root / f"cache-rank{rank()}")
    store = ckptstore.open(uri, local=root / f"nvme-rank{rank()}")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=3)
    train(engine, DATA[:2])
    store.commit(engine, step=2)
    seen = {"locations_after_commit": store.locations()}  # both nodes list the step
    train(engine, DATA[2:3])
    store.commit(engine, step=3, blocking=False).result()
    store.drain()
    seen["pending"] = [p.step for p in store.pending()]
    record = read_manifest(store.tier.local, 2)
    refs = [ref for index in record.packs.values() for ref in index.packs]
    seen["ranks_of_local_packs"] = sorted({r.rank for r in refs if store.tier.local.exists(pack_name(r.key))})
    store.close()
    barrier()
    os.environ["CKPTSTORE_CACHE"] = str(root / f"cache-fresh-rank{rank()}")
    fresh = ckptstore.open(uri, local="")
    seen.update(bucket_steps=fresh.steps(), wrong=matches_store(engine, fresh, 3))
    return seen


def export(root: Path) -> dict:
    """Commit step 2 of bf16 Llama and GPT-2 engines at ZeRO 2 and 3, and save it with DeepSpeed too."""
    import ckptstore

    for model in ("llama", "gpt2"):
        for stage in (2, 3):
            where = root / f"{model}-zero{stage}"
            engine = build_engine(model, zero_stage=stage, dtype="bf16", num_layers=2)
            train(engine, DATA[:2])
            if rank() == 0:
                engine.module.config.save_pretrained(where / "config")
            barrier()
            with ckptstore.open(where / "store") as store:
                store.commit(engine, 2, files=[where / "config" / "config.json"])
            engine.save_checkpoint(str(where / "deepspeed"))
    return {}


def restore_across_sizes(root: Path) -> dict:
    """Commit step 3 of every config on these 2 ranks, then restore it and a step committed by
    one rank (``<config>/store1``, written beforehand) into fresh engines; each is compared with
    ``load_checkpoint`` of the step materialized for 2 ranks."""
    import torch

    import ckptstore
    from tests.test_restore import optimizer_tensors

    results = {}
    for stage, dtype in CONFIGS:
        name = f"zero{stage}-{dtype}"
        engine = build_engine("llama", zero_stage=stage, dtype=dtype, seed=0, num_layers=2)
        train(engine, DATA[:3])
        ckptstore.open(root / name / "store2").commit(engine, step=3)
        for source in ("store2", "store1"):
            store = ckptstore.open(root / name / source)
            out = root / name / f"{source}-w2"
            if rank() == 0:
                store.materialize(3, out, world_size=2)
            barrier()
            loaded = build_engine("llama", zero_stage=stage, dtype=dtype, seed=1, num_layers=2)
            loaded.load_checkpoint(str(out))
            restored = build_engine("llama", zero_stage=stage, dtype=dtype, seed=2, num_layers=2)
            step, _ = store.restore(restored)
            theirs, ours = optimizer_tensors(loaded), optimizer_tensors(restored)
            results[f"{name} {source}"] = {
                "step": step,
                "optimizer_equal": theirs.keys() == ours.keys()
                and all(torch.equal(ours[k], theirs[k]) for k in theirs),
                "restored": train(restored, DATA[3:]),
                "loaded": train(loaded, DATA[3:]),
            }
    return results


def restore_failing_rank(root: Path) -> dict:
    """Rank 1's reads fail partway through a restore, once while the fp32 masters are read and
    once while the optimizer state is: every rank must raise, saying what the engine holds;
    a restore after that must leave the engine as ``load_checkpoint`` would."""
    import torch

    import ckptstore
    from ckptstore.errors import StorageError
    from ckptstore.materialize.reader import StepReader

    store = ckptstore.open(root / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    train(engine, DATA[:3])
    store.commit(engine, step=3)
    if rank() == 0:
        store.materialize(3, root / "w2", world_size=2)
    barrier()
    loaded = build_engine("llama", zero_stage=2, dtype="bf16", seed=1, num_layers=2)
    loaded.load_checkpoint(str(root / "w2"))
    fresh = build_engine("llama", zero_stage=2, dtype="bf16", seed=5, num_layers=2)
    read_into = StepReader.read_into

    def weights(e) -> list:
        return [p.detach().clone() for p in e.module.parameters()]

    results = {}
    for phase, fails in (
        ("masters", lambda kind, n: kind == "fp32" and n > 1),
        ("state", lambda kind, n: kind != "fp32"),
    ):
        reads = [0]

        def failing_read_into(self, name, kind, start, out, fails=fails, reads=reads):
            reads[0] += 1
            if fails(kind, reads[0]):
                raise StorageError("injected: disk on fire")
            return read_into(self, name, kind, start, out)

        if rank() == 1:
            StepReader.read_into = failing_read_into
        before = weights(fresh)
        try:
            store.restore(fresh, 3)
            outcome = "restored"
        except ckptstore.CkptStoreError as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        StepReader.read_into = read_into
        results[phase] = {
            "outcome": outcome,
            "weights_unchanged": all(torch.equal(a, b) for a, b in zip(before, weights(fresh), strict=True)),
            "weights_the_steps": all(
                torch.equal(a, b) for a, b in zip(weights(loaded), weights(fresh), strict=True)
            ),
            "global_steps": fresh.global_steps,
        }
    store.restore(fresh, 3)
    results["again"] = train(fresh, DATA[3:]) == train(loaded, DATA[3:])
    return results


def run_modes(modes: dict, mode: str, root: Path, result: str) -> None:
    """Run ``mode`` on ``root``, each rank writing what it observed to ``RESULT.<rank>.json``; or
    several modes, comma-separated, one after another in this one job (issue 48: each
    interpreter start costs seconds), each in ``root/<mode>``, into ``RESULT.<mode>.<rank>.json``."""
    several = "," in mode
    for each in mode.split(","):
        here = root / each if several else root
        here.mkdir(parents=True, exist_ok=True)
        observed = modes[each](here)  # (a model-parallel engine is what starts torch.distributed)
        Path(f"{result}.{each}.{rank()}.json" if several else f"{result}.{rank()}.json").write_text(
            json.dumps(observed)
        )
        barrier()


def main() -> None:
    setup_single_process_env()
    import logging

    import deepspeed
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(verbose=False)
    mode, root, result = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    modes = {"resume": resume, "composite": composite, "commit": commit_only, "load": load_other_size,
             "fail": failing_rank, "files": per_rank_files, "attach": attached, "trainer": trainer, "tailor": tailor, "s3": s3_machines, "non_blocking": non_blocking, "export": export, "restore": restore_across_sizes, "restore_fail": restore_failing_rank, "tiered": tiered_nodes, "latest": latest}  # fmt: skip
    run_modes(modes, mode, root, result)
    # Single-host CPU runs can abort in atexit handlers after all work is done (DEEPSPEED_FORMAT.md §6).
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
