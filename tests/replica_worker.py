"""One rank of a job spread over two nodes, each with its own local tier, run by tests/test_replicas.py.

    python -m torch.distributed.run --nnodes 2 --node_rank N --nproc_per_node 1 \\
        --master_addr 127.0.0.1 --master_port P tests/replica_worker.py MODE ROOT RESULT

Two torchrun agents stand for two nodes: each rank's node is its agent's (``GROUP_RANK``);
one agent of two ranks is one node, where there is no peer to copy to. Each rank writes
what it saw to ``RESULT.<rank>.json``. Modes:

* ``replicate``: commit steps 1 (blocking), 2 (the same state again: nothing new to copy) and
  3 (non-blocking) with ``replicas=1`` into each node's tier in front of one store.
* ``commit``: the same in front of the S3 store ``$CKPTSTORE_STORE``: steps 1 and 2, uploaded
  (``drain``), then 3 (non-blocking) and 4, replicated and never uploaded; then two more
  training steps (the run that never stopped); a DCP save of step 7 into a second store
  (``-dcp``, tiers ``dcp-node<N>``), never uploaded; and every rank SIGKILLs itself.
* ``restore``: a restarted job: restore the newest step it can (or ``$RESTORE_STEP``), say
  where the bytes came from, train the same two steps; with ``$DCP``, load the DCP store's
  newest step too.
* ``stuck``: one agent of two ranks that say they are on two nodes (``CKPTSTORE_NODE``); rank 1
  stops (SIGSTOP) where it would copy its replicas, rank 0 commits with a 3-second
  ``CKPTSTORE_PEER_TIMEOUT``, says what it saw, then kills rank 1.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import batches, build_engine, destroy_engine, train  # noqa: E402


def state_digest(engine) -> str:
    """A hash of everything a restore puts back into a ZeRO-1/2 engine: module weights, fp32
    masters and optimizer state, in parameter order."""
    import hashlib

    import torch

    digest = hashlib.sha256()

    def add(tensor) -> None:
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    for name, tensor in sorted(engine.module.state_dict().items()):
        digest.update(name.encode())
        add(tensor)
    optimizer = engine.optimizer
    for master in optimizer.single_partition_of_fp32_groups:
        add(master)
    for group in optimizer.optimizer.param_groups:
        for param in group["params"]:
            for key, value in sorted(optimizer.optimizer.state.get(param, {}).items()):
                digest.update(key.encode())
                add(value if isinstance(value, torch.Tensor) else torch.tensor(value))
    return digest.hexdigest()


def open_node_store(root: Path, uri, tier: str = "nvme"):
    """This node's store: ``uri`` behind its own tier (``<tier>-node<N>``) and catalog cache."""
    import os

    import ckptstore

    node = os.environ["GROUP_RANK"]
    os.environ["CKPTSTORE_CACHE"] = str(root / f"cache-node{node}")
    return ckptstore.open(uri, local=root / f"{tier}-node{node}", local_upload="drain", replicas=1)


def dcp_state(rank: int, fill: float | None = None) -> dict:
    """What the DCP door saves: a tensor of each rank's own (each rank writes packs of its own)."""
    import torch

    return {f"rank{rank}.weight": torch.full((4096,), float(rank) if fill is None else fill)}


def commit(root: Path, result: str) -> None:
    import os
    import signal

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import StoreWriter

    store = open_node_store(root, os.environ["CKPTSTORE_STORE"])
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=2)
    data = batches(6)
    train(engine, data[:1])
    store.commit(engine, 1)
    train(engine, data[1:2])
    store.commit(engine, 2)
    store.drain()
    train(engine, data[2:3])
    store.commit(engine, 3, blocking=False)
    train(engine, data[3:4])
    store.commit(engine, 4)
    store.wait()
    seen = {"replicated": sorted(store.tier.replicated()), "pending": [p.step for p in store.pending()]}
    seen["digest"] = state_digest(engine)
    seen["losses"] = train(engine, data[4:6])
    dcp_store = open_node_store(root, os.environ["CKPTSTORE_STORE"] + "-dcp", tier="dcp")
    dcp.save(dcp_state(dist.get_rank()), storage_writer=StoreWriter(dcp_store, 7))  # never uploaded
    dcp_store.wait()
    seen["dcp_replicated"] = sorted(dcp_store.tier.replicated())
    Path(f"{result}.{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # both nodes die: nothing closes, nothing uploads


def restore(root: Path, result: str) -> None:
    import dataclasses
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import StoreReader
    from ckptstore.tier.upload import read_share

    store = open_node_store(root, os.environ["CKPTSTORE_STORE"])
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=7, num_layers=2)
    step, _ = store.restore(engine, int(os.environ["RESTORE_STEP"]) if "RESTORE_STEP" in os.environ else None)
    rank = dist.get_rank()
    seen = {
        "step": step,
        "digest": state_digest(engine),
        "sources": dataclasses.asdict(store.tier.restored_from),
    }
    seen["losses"] = train(engine, batches(6)[4:6])
    local = store.tier.local
    # A replaced node holds its own share of the steps not uploaded again, so its uploads go on.
    seen["own_shares"] = {
        s: all(local.exists(name) for name in read_share(local, s, rank))
        for s in (3, 4)
        if local.exists(f"tier/shares/{s:012d}/{rank}.json")
    }
    if "DCP" in os.environ:  # the DCP door's step 7, never uploaded, through a reader
        dcp_store = open_node_store(root, os.environ["CKPTSTORE_STORE"] + "-dcp", tier="dcp")
        state = dcp_state(rank, fill=-1.0)
        dcp.load(state, storage_reader=StoreReader(dcp_store))
        seen["dcp_loaded"] = bool(state[f"rank{rank}.weight"].eq(rank).all())
        seen["dcp_sources"] = dataclasses.asdict(dcp_store.tier.restored_from)
        dcp_store.close()
    destroy_engine(engine)
    store.close()
    Path(f"{result}.{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


def stuck(root: Path, result: str) -> None:
    import os
    import signal
    import time

    import torch.distributed as dist

    import ckptstore
    import ckptstore.tier as tier_package

    rank = int(os.environ["RANK"])
    os.environ.update(CKPTSTORE_NODE=f"node{rank}", CKPTSTORE_PEER_TIMEOUT="3")
    os.environ["CKPTSTORE_CACHE"] = str(root / f"cache-node{rank}")
    store = ckptstore.open(root / "store", local=root / f"nvme-node{rank}", local_upload="drain", replicas=1)
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=2)
    pids: list = [None, None]
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:  # a hung peer: it takes part in finding its peers, then stops where it would copy
        tier_package.replicate = lambda *args: os.kill(os.getpid(), signal.SIGSTOP)
    train(engine, batches(1))
    start = time.monotonic()
    store.commit(engine, 1)
    store.wait()  # the replication behind the commit gives up on the peer
    seen = {"waited": time.monotonic() - start, "errors": store.tier.replica_errors}
    seen["pending"] = {p.step: p.replicated for p in store.pending()}
    seen["locations"] = store.locations()
    Path(f"{result}.{rank}.json").write_text(json.dumps(seen))
    os.kill(pids[1], signal.SIGKILL)


def replicate(root: Path, result: str) -> None:
    import os

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from ckptstore.integrations.dcp import StoreWriter
    from ckptstore.tier.replicas import replicas_name
    from ckptstore.tier.upload import read_share

    node = os.environ["GROUP_RANK"]
    store = open_node_store(root, root / "store")
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
    # The DCP door: each rank's own tensor, so that each rank writes packs of its own.
    dcp.save(dcp_state(rank), storage_writer=StoreWriter(store, 10))
    store.wait()
    seen["dcp_replicated"] = 10 in store.tier.replicated()
    seen["moved"] = {
        step: {"sent": report.sent_bytes, "received": report.received_bytes, "objects": report.sent_objects}
        for step, report in store.tier.replica_reports.items()
    }
    seen["own_share"] = {step: read_share(local, step, rank) for step in (1, 2, 3, 10)}
    seen["held_for_peer"] = {}
    for step in (1, 2, 3, 10):
        if local.exists(replicas_name(step, other)):
            held = json.loads(local.get(replicas_name(step, other)))
            seen["held_for_peer"][step] = {name: local.exists(name) for name in held}
    destroy_engine(engine)
    store.close()
    Path(f"{result}.{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    {"replicate": replicate, "commit": commit, "restore": restore, "stuck": stuck}[sys.argv[1]](
        Path(sys.argv[2]), sys.argv[3]
    )
