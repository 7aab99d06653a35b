"""Demo: train a tiny Llama under DeepSpeed (CPU), commit to a store, materialize, resume.

    python tools/demo.py [--workdir DIR]

Prints the losses of the uninterrupted run, of the run resumed from the materialized
checkpoint and of one restored straight from the store; exits non-zero unless they are
bit-identical. Then exports the step's weights as a Hugging Face safetensors folder.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import batches, build_engine, finalize_distributed, setup_single_process_env, train  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="where to put the store and the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    setup_single_process_env()
    import logging

    from deepspeed.utils import logger as ds_logger

    import ckptstore

    ds_logger.setLevel(logging.WARNING)  # keep the demo's own lines readable

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="ckptstore-demo-"))
    data = batches(8)
    store = ckptstore.open(workdir / "store")

    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=4)
    train(engine, data[:2])
    full = store.commit(engine, step=2)
    train(engine, data[2:4])
    parity = store.commit(engine, step=4, layers=["model.layers.1", "model.layers.3"])
    train(engine, data[4:6])
    last = store.commit(engine, step=6)
    uninterrupted = train(engine, data[6:])
    print(f"store: {workdir / 'store'}")
    for report in (full, parity, last):
        print(
            f"  step {report.step}: saved {len(report.layers_saved)} layers, added {report.bytes_added} bytes"
        )
    print(f"  step 4 takes its layers from {store.sources(4)}")

    out = store.materialize(6, workdir / "checkpoint")
    resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=1234, num_layers=4)
    resumed.load_checkpoint(str(out))
    loaded_step = resumed.global_steps
    again = train(resumed, data[6:])
    restored = build_engine("llama", zero_stage=2, dtype="bf16", seed=4321, num_layers=4)
    restored_step, _ = store.restore(restored)  # the newest step, no directory in between
    again_restored = train(restored, data[6:])
    print(f"materialized step 6 at {out}")
    print(f"  uninterrupted losses: {uninterrupted}")
    print(f"  resumed losses:       {again}")
    print(f"  restored losses:      {again_restored} (store.restore, step {restored_step})")
    exported = store.export(6, workdir / "hf-model")
    print(f"exported step 6's weights ({exported.dtype}, {exported.tensors} tensors) to {exported.path}")
    ok = (
        loaded_step == 6 and again == uninterrupted and restored_step == 6 and again_restored == uninterrupted
    )
    print("losses match bit for bit" if ok else "MISMATCH: resumed training differs")
    finalize_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
