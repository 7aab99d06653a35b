"""Benchmark a local tier in front of S3 on a slow link, against a local store and a direct S3 commit.

    python tools/bench_tiered.py [--hidden 256 --layers 4 --vocab 4000 --reps 2] [--rate 8MB]
                                 [--endpoint URL]

A moto server runs in its own process on 127.0.0.1 (or ``--endpoint`` names an S3 endpoint),
reached through a loopback proxy (``tools/netproxy.py``) that throttles the link to ``--rate``
bytes per second each way. With the bench model (Llama, bf16, ZeRO-2, one rank, CPU) trained a
batch before each commit, it times:

* a blocking commit into a local store (the floor: the same work, no network);
* a blocking commit with a local tier in front of the S3 store: it returns once the step is on
  local disk, the upload runs behind; then the upload lag, from the commit's start until the
  step is in S3;
* a blocking commit straight into the S3 store over the same link (what ``local=`` replaces);
* restore on the committing node after the upload (read from the tier) against a restore from
  the local store.

Every commit goes into a fresh store (every pack is new). Prints medians and the ratios the issue
states its targets in. Absolute times on a shared box are noise; the ratios are the result.
"""

from __future__ import annotations

import argparse
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
from tools.engines import (  # noqa: E402
    add_bench_model_options,
    batches,
    build_bench_engine,
    param_count,
    setup_single_process_env,
    train,
)
from tools.netproxy import Proxy, parse_rate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=256, layers=4, vocab=4000, reps=2)
    parser.add_argument("--rate", default="8MB", help="the link's bytes per second each way (default 8MB)")
    add_endpoint_option(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("CKPTSTORE_PROGRESS", "0")
    work = Path(tempfile.mkdtemp(prefix="ckptstore-bench-tiered-"))
    try:
        with (
            s3_endpoint(args.endpoint) as endpoint,
            Proxy.for_endpoint(endpoint, rate=parse_rate(args.rate)) as link,
        ):
            os.environ["AWS_ENDPOINT_URL"] = link.endpoint
            return run(args, link, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, link: Proxy, work: Path) -> int:
    setup_single_process_env()
    import logging

    import boto3
    from deepspeed.utils import logger as ds_logger

    import ckptstore

    ds_logger.setLevel(logging.WARNING)
    engine = build_bench_engine(args)
    data = batches(3 * args.reps + 1, vocab=args.vocab)
    client = boto3.client("s3", endpoint_url=link.endpoint)

    def new_bucket() -> str:
        name = f"bench-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=name)
        return f"s3://{name}/run"

    def commit(store, step: int) -> tuple[float, int]:
        train(engine, data[step : step + 1])  # every tensor changes
        start = time.perf_counter()
        report = store.commit(engine, step=step)
        return time.perf_counter() - start, report.bytes_added

    local_commit, tier_commit, lag, s3_commit, local_restore, tier_restore, sizes = ([] for _ in range(7))
    step = 0
    for rep in range(args.reps):
        os.environ["CKPTSTORE_CACHE"] = str(work / f"cache-{rep}")
        step += 1
        with ckptstore.open(work / f"local-{rep}") as store:
            seconds, size = commit(store, step)
            local_commit.append(seconds)
            sizes.append(size)
            local_restore.append(_timed(store.restore, engine, step))

        step += 1
        with ckptstore.open(new_bucket(), local=work / f"nvme-{rep}") as store:
            start = time.perf_counter()
            seconds, _ = commit(store, step)
            tier_commit.append(seconds)
            while store.pending():  # the upload runs behind; its lag is until S3 has the step
                time.sleep(0.05)
            lag.append(time.perf_counter() - start)
            tier_restore.append(_timed(store.restore, engine, step))

        step += 1
        with ckptstore.open(new_bucket(), local="") as store:
            link.reset_counters()
            seconds, _ = commit(store, step)
            s3_commit.append(seconds)
            sent = link.bytes_up

    med = statistics.median
    print(
        f"model: llama, {param_count(engine.module) / 1e6:.1f}M parameters, bf16, ZeRO-2, 1 rank, CPU; "
        f"a step stores {med(sizes) / 1e6:.1f} MB; link {args.rate}/s each way through a loopback proxy "
        f"({sent / 1e6:.1f} MB sent by a direct S3 commit); {args.reps} reps, medians"
    )
    rows = [
        ("commit into a local store (no network)", med(local_commit), None),
        ("commit with a local tier (returns on local disk)", med(tier_commit), None),
        ("commit straight into S3 over the link", med(s3_commit), None),
        ("upload lag with the tier (commit start -> step in S3)", med(lag), None),
        ("restore from a local store", med(local_restore), None),
        ("restore on the committing node from the tier", med(tier_restore), None),
    ]
    for name, seconds, _ in rows:
        print(f"  {name:<58} {seconds:8.2f} s")
    print("ratios (targets from issue 25):")
    print(
        f"  tier commit / local-store commit        {med(tier_commit) / med(local_commit):6.2f}x   (target <= 1.1x)"
    )
    print(
        f"  tier commit / direct S3 commit          {med(tier_commit) / med(s3_commit):6.2f}x   (target <= 0.3x)"
    )
    print(f"  upload lag / direct S3 commit           {med(lag) / med(s3_commit):6.2f}x")
    print(
        f"  tier restore / local-store restore      {med(tier_restore) / med(local_restore):6.2f}x   (target <= 1.0x)"
    )
    return 0


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
