"""A training process with a local tier that S3 cannot be reached from, killed by tests/test_tier.py.

    python tests/tier_worker.py STORE_URI LOCAL_DIR DUMP

Opens the store with the local tier, then cuts itself off from S3 (every request of its own
boto3 client fails with a dropped connection), trains a batch, commits step 1, saves the
engine's state to DUMP, prints "committed" and waits to be killed.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import batches, build_engine, setup_single_process_env, train  # noqa: E402


def main(uri: str, local: str, dump: str) -> None:
    setup_single_process_env()
    import torch

    import ckptstore
    from tests.moto_s3 import inject_faults

    store = ckptstore.open(uri, local=local)
    inject_faults(store.objects.remote.client, "*", "connection", times=None)
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0)
    train(engine, batches(1))
    store.commit(engine, 1)
    torch.save({n: p.detach().float().clone() for n, p in engine.module.named_parameters()}, dump)
    print("committed", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main(*sys.argv[1:])
