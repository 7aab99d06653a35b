"""One rank of a job spread over two nodes, each with its own local tier, run by tests/test_replicas.py.

    python -m torch.distributed.run --nnodes 2 --node_rank N --nproc_per_node 1 \\
        --master_addr 127.0.0.1 --master_port P tests/replica_worker.py ROOT RESULT

Two torchrun agents stand for two nodes: each rank's node is its agent's (``GROUP_RANK``);
one agent of two ranks is one node, where there is no peer to copy to.
Every rank commits steps 1 (blocking), 2 (the same state again: nothing new to copy) and 3
(non-blocking) with ``replicas=1`` into its node's tier in front of one store, then writes
what its tier holds and what replication moved to ``RESULT.<rank>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import batches, build_engine, destroy_engine, train  # noqa: E402


def main(root: Path, result: str) -> None:
    import os

    import torch.distributed as dist

    import ckptstore
    from ckptstore.tier.replicas import replicas_name
    from ckptstore.tier.upload import read_share

    node = os.environ["GROUP_RANK"]
    os.environ["CKPTSTORE_CACHE"] = str(root / f"cache-node{node}")
    store = ckptstore.open(root / "store", local=root / f"nvme-node{node}", local_upload="drain", replicas=1)
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=2)
    rank, other = dist.get_rank(), 1 - dist.get_rank()
    data = batches(3)
    train(engine, data[:1])
    store.commit(engine, 1)
    store.commit(engine, 2)  # unchanged: every pack is one the peer already holds
    train(engine, data[1:2])
    store.commit(engine, 3, blocking=False)
    store.wait()
    local = store.tier.local
    seen = {"node": node, "replicated": sorted(store.tier.replicated()), "errors": store.tier.replica_errors}
    seen["pending"] = {p.step: p.replicated for p in store.pending()}
    seen["locations"] = store.locations()
    seen["moved"] = {
        step: {"sent": report.sent_bytes, "received": report.received_bytes, "objects": report.sent_objects}
        for step, report in store.tier.replica_reports.items()
    }
    seen["own_share"] = {step: read_share(local, step, rank) for step in (1, 2, 3)}
    seen["held_for_peer"] = {}
    for step in (1, 2, 3):
        if local.exists(replicas_name(step, other)):
            held = json.loads(local.get(replicas_name(step, other)))
            seen["held_for_peer"][step] = {name: local.exists(name) for name in held}
    destroy_engine(engine)
    store.close()
    Path(f"{result}.{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
