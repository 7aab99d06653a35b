"""Benchmark peer replicas: recovering a lost node from its peer against from S3 over a slow link.

    python tools/bench_replicas.py [--hidden 256 --layers 4 --vocab 4000 --steps 4] [--rate 8MB]
                                   [--endpoint URL]

Two torchrun agents on this machine stand for two nodes (one rank each, ZeRO-1 bf16 Llama,
each node its own local tier in front of one S3 store: moto on 127.0.0.1, or ``--endpoint``,
behind loopback proxies, ``tools/netproxy.py``). It runs:

1. training without replicas: ``--steps`` steps, a non-blocking commit every ``--every``;
2. the same with ``replicas=1``, then every step uploaded; it times each training step
   (a batch, and the commit call where there is one; the first commit's steps are left out)
   and adds up the bytes replication sent against the new pack bytes of the commits;
3. node 1's tier deleted (a replaced node), a restart restores the newest step with
   ``replicas=1``: node 1's share comes from node 0's tier (the S3 link unthrottled: no pack
   is read from it);
4. node 1's tier deleted again, a restart restores without replicas over the link throttled to
   ``--rate``: node 1's share comes from S3, what a restart does without peers.

A restore is timed from the barrier before it to the end of the slower rank's. Prints each
time and the ratios issue 39 states its targets in. Absolute times on a shared box are noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench_s3 import add_endpoint_option, s3_endpoint  # noqa: E402
from tools.engines import add_bench_model_options, batches, build_engine, train, two_node_agents  # noqa: E402
from tools.netproxy import Proxy, parse_rate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=256, layers=4, vocab=4000, reps=1)
    parser.add_argument("--steps", type=int, default=8, help="training steps (default 8)")
    parser.add_argument(
        "--every", type=int, default=2, help="a non-blocking commit every this many steps (default 2)"
    )
    parser.add_argument(
        "--rate", default="8MB", help="the slow link's bytes per second each way (default 8MB)"
    )
    add_endpoint_option(parser)
    args = parser.parse_args(argv)
    env = {
        **os.environ, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1", "CKPTSTORE_PROGRESS": "0", "DS_ACCELERATOR": "cpu",
    }  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="ckptstore-bench-replicas-"))
    try:
        with (
            s3_endpoint(args.endpoint) as endpoint,
            Proxy.for_endpoint(endpoint) as fast,
            Proxy.for_endpoint(endpoint, rate=parse_rate(args.rate)) as slow,
        ):
            import boto3

            bucket = f"bench-{uuid.uuid4().hex[:12]}"
            boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                         aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(Bucket=bucket)  # fmt: skip
            env["CKPTSTORE_STORE"] = f"s3://{bucket}/run"
            options = [f"--hidden={args.hidden}", f"--layers={args.layers}", f"--vocab={args.vocab}",
                       f"--steps={args.steps}", f"--every={args.every}"]  # fmt: skip
            plain = two_nodes(
                work / "plain",
                "train",
                options + ["--replicas=0"],
                {**env, "AWS_ENDPOINT_URL": fast.endpoint},
            )
            replicated = two_nodes(
                work / "job", "train", options + ["--replicas=1"], {**env, "AWS_ENDPOINT_URL": fast.endpoint}
            )
            shutil.rmtree(work / "job" / "nvme-node1")
            fast.reset_counters()
            peer = two_nodes(
                work / "job",
                "restore",
                options + ["--replicas=1"],
                {**env, "AWS_ENDPOINT_URL": fast.endpoint},
            )
            packs_from_s3 = [line for line in fast.requests if line.startswith("GET") and "/packs/" in line]
            shutil.rmtree(work / "job" / "nvme-node1")
            remote = two_nodes(
                work / "job",
                "restore",
                options + ["--replicas=0"],
                {**env, "AWS_ENDPOINT_URL": slow.endpoint},
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = statistics.median
    # The first commit's steps are left out: they are the engine's and the store's warm-up.
    step_plain = med(t for seen in plain for t in seen["step_seconds"][args.every :])
    step_replicated = med(t for seen in replicated for t in seen["step_seconds"][args.every :])
    sent = sum(seen["replica_bytes"] for seen in replicated)
    new = replicated[0]["new_bytes"]
    from_peer, from_s3 = (
        max(seen["restore_seconds"] for seen in peer),
        max(seen["restore_seconds"] for seen in remote),
    )
    print(
        f"model: llama, {replicated[0]['parameters'] / 1e6:.1f}M parameters, bf16, ZeRO-1, 2 nodes x 1 rank, CPU; "
        f"{args.steps} steps, {len(range(args.every, args.steps + 1, args.every))} commits, {new / 1e6:.1f} MB "
        f"of new packs; slow link {args.rate}/s each way"
    )
    print(f"  training step (a non-blocking commit every {args.every}), no replicas  {step_plain:8.2f} s")
    print(f"  training step with replicas=1 (copies behind training)        {step_replicated:8.2f} s")
    print(f"  restore of the newest step after node 1 was lost, from node 0's tier   {from_peer:8.2f} s"
          f"   ({peer[1]['sources']})")  # fmt: skip
    print(f"  the same restore from S3 over the slow link (no replicas)      {from_s3:8.2f} s")
    print(f"  pack GETs at S3 during the peer restore: {len(packs_from_s3)}")
    print("ratios (targets from issue 39):")
    print(f"  recovery from a peer / from S3          {from_peer / from_s3:6.2f}x   (target <= 0.1x)")
    print(
        f"  step time with / without replication    {step_replicated / step_plain:6.2f}x   (target <= 1.05x)"
    )
    print(f"  replica bytes sent / new pack bytes     {sent / new:6.3f}x   (target = 1.0x)")
    return 0


def two_nodes(root: Path, mode: str, options: list[str], env: dict) -> list[dict]:
    """This script's ``--worker mode`` as two nodes of one rank each (``two_node_agents``)."""
    root.mkdir(parents=True, exist_ok=True)
    result = root / f"result-{mode}"
    for code, output in two_node_agents([__file__, "--worker", mode, str(root), str(result), *options], env):
        if code != 0:
            raise SystemExit(f"the {mode} job failed:\n{output[-5000:]}")
    return [json.loads(Path(f"{result}.{rank}.json").read_text()) for rank in (0, 1)]


def worker(mode: str, root: Path, result: str, argv: list[str]) -> None:
    """One rank of a job: ``train`` (commit every step, then upload) or ``restore``."""
    import logging

    import torch.distributed as dist
    from deepspeed.utils import logger as ds_logger

    import ckptstore

    parser = argparse.ArgumentParser()
    add_bench_model_options(parser, hidden=256, layers=4, vocab=4000, reps=1)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--every", type=int)
    parser.add_argument("--replicas", type=int)
    args = parser.parse_args(argv)
    ds_logger.setLevel(logging.WARNING)
    node = os.environ["GROUP_RANK"]
    os.environ["CKPTSTORE_CACHE"] = str(root / f"cache-node{node}")
    store = ckptstore.open(
        os.environ["CKPTSTORE_STORE"] + ("-1" if mode == "restore" else f"-{args.replicas}"),
        local=root / f"nvme-node{node}", local_upload="drain", replicas=args.replicas,
    )  # fmt: skip
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=args.layers,
                          hidden=args.hidden, vocab=args.vocab)  # fmt: skip
    data = batches(args.steps, vocab=args.vocab)
    seen: dict = {"parameters": sum(p.numel() for p in engine.module.parameters())}
    if mode == "train":
        seen["step_seconds"], handles = [], []
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            train(engine, data[step - 1 : step])
            if step % args.every == 0:
                handles.append(store.commit(engine, step, blocking=False))
            seen["step_seconds"].append(time.perf_counter() - start)
        store.wait()
        seen["new_bytes"] = sum(handle.result().bytes_added for handle in handles)
        seen["replica_bytes"] = sum(report.sent_bytes for report in store.tier.replica_reports.values())
        store.drain()
    else:
        dist.barrier()
        start = time.perf_counter()
        store.restore(engine)
        seen["restore_seconds"] = time.perf_counter() - start
        seen["sources"] = store.tier.restored_from.describe() if store.tier.restored_from else "no replicas"
    store.close()
    Path(f"{result}.{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[5:])
        sys.exit(0)
    sys.exit(main())
