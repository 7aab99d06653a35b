"""DeepSpeed engines on a GPU into a store and back, run by tests/test_gpu.py in its own process.

    DS_ACCELERATOR=cuda python tests/gpu_worker.py ROOT RESULT.json

For each configuration: train a CUDA engine, commit it (blocking, then non-blocking), check that
every tensor of the engine's state is in the store bit for bit, restore the step into a fresh
engine and one that loaded the materialized directory, and record whether the two agree (state
and the losses of training on). The pytest side asserts on RESULT.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.dist_worker import matches_store  # noqa: E402
from tests.test_restore import optimizer_tensors, own_memory  # noqa: E402
from tools.engines import batches, build_engine, destroy_engine, setup_single_process_env, train  # noqa: E402

# ZeRO 0 in bf16 with torch's Adam is DeepSpeed's FP16_UnfusedOptimizer.
CONFIGS = [(0, "bf16"), (1, "fp32"), (1, "bf16"), (2, "bf16"), (2, "fp16"), (3, "bf16")]
DATA = batches(6)
# FusedAdam would be built by nvcc first (minutes); the state it keeps is the same.
TORCH_ADAM = {"optimizer": {"params": {"torch_adam": True}}}


def engine_for(stage: int, dtype: str, seed: int):
    return build_engine("llama", zero_stage=stage, dtype=dtype, seed=seed, num_layers=2, **TORCH_ADAM)


def check(root: Path, stage: int, dtype: str) -> dict:
    import torch

    import ckptstore

    store = ckptstore.open(root / f"zero{stage}-{dtype}")
    engine = engine_for(stage, dtype, seed=0)
    assert engine.device.type == "cuda", engine.device
    train(engine, DATA[:3])
    store.commit(engine, 3)
    blocking_wrong = matches_store(engine, store, 3)
    train(engine, DATA[3:4])
    store.commit(engine, 4, blocking=False).result()
    background_wrong = matches_store(engine, store, 4)
    destroy_engine(engine)

    loaded = engine_for(stage, dtype, seed=1)
    loaded.load_checkpoint(str(store.materialize(3, root / f"out-{stage}-{dtype}")))
    restored = engine_for(stage, dtype, seed=2)
    train(restored, DATA[5:])  # an engine that holds optimizer state, as after a rollback
    before = own_memory(restored) if stage else None  # ZeRO 0 keeps no partitions to fill
    store.restore(restored, 3)
    in_place = not stage or own_memory(restored) == before
    theirs, ours = optimizer_tensors(loaded), optimizer_tensors(restored)
    state_equal = theirs.keys() == ours.keys() and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    losses = (train(restored, DATA[3:]), train(loaded, DATA[3:]))
    destroy_engine(loaded)
    destroy_engine(restored)
    return {
        "blocking_wrong": blocking_wrong,
        "background_wrong": background_wrong,
        "restored_state_equal": state_equal,
        "restored_in_place": in_place,
        "losses": losses,
    }


def main() -> None:
    root, result = Path(sys.argv[1]), Path(sys.argv[2])
    setup_single_process_env()
    results = {f"zero{stage}-{dtype}": check(root, stage, dtype) for stage, dtype in CONFIGS}
    result.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
