"""Benchmark S3 stores against plain boto3 transfers of the DeepSpeed directory, in the same run.

    python tools/bench_s3.py [--hidden 512 --layers 4 --vocab 8000 --reps 2] [--endpoint URL]

Saves a DeepSpeed checkpoint (Llama, bf16, ZeRO-2, one rank, CPU), then, against one S3 endpoint
(by default a moto server started here in its own process on 127.0.0.1), times:

* upload: ``client.upload_file`` of every file of the DeepSpeed directory (boto3's transfer
  manager with its defaults) vs ``store.commit`` into an empty store (extract, hash, compress
  and upload every blob, then the manifest);
* download: ``client.download_file`` of every file vs ``store.materialize`` from an empty
  catalog cache (sync the index from the manifests, fetch and verify every blob, write the
  DeepSpeed directory);
* and, to tell the backend apart from the savings of storing fewer bytes, the DeepSpeed files
  themselves through ``S3ObjectStore.put_if_absent`` / ``get`` (whole files in memory).

Each measurement uses a fresh bucket, emptied afterwards. Prints medians as seconds, MB/s of the DeepSpeed directory's size,
and the ratio ckptstore / boto3 (below 1 is faster). Loopback moto is slow and shares the CPU
with the client: compare ratios, not absolute speeds.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.engines import (  # noqa: E402
    add_bench_model_options,
    batches,
    build_bench_engine,
    free_port,
    param_count,
    setup_single_process_env,
    train,
)


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto server in its own process, so it does not share this process's GIL."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit("the moto server did not start")


@contextlib.contextmanager
def s3_endpoint(given: str | None) -> Iterator[str]:
    """The S3 endpoint a bench runs against: ``given`` (its ``--endpoint``), else a moto server
    started here (``start_moto``) for the block and stopped after it."""
    if given:
        yield given
        return
    server, endpoint = start_moto()
    try:
        yield endpoint
    finally:
        server.terminate()
        server.wait()


def add_endpoint_option(parser: argparse.ArgumentParser) -> None:
    """A bench's ``--endpoint`` (``s3_endpoint``)."""
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of a local moto server")


def materialize(uri: str, out: Path) -> None:
    import ckptstore

    with ckptstore.open(uri, create=False) as store:
        store.materialize(1, out)


def timed(fn, *args, **kwargs) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=512, layers=4, vocab=8000, reps=2)
    add_endpoint_option(parser)
    args = parser.parse_args(argv)

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ.setdefault("CKPTSTORE_PROGRESS", "0")
    work = Path(tempfile.mkdtemp(prefix="ckptstore-bench-s3-"))
    try:
        with s3_endpoint(args.endpoint) as endpoint:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            return run(args, endpoint, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, endpoint: str, work: Path) -> int:
    setup_single_process_env()
    import logging

    import boto3
    from deepspeed.utils import logger as ds_logger

    import ckptstore

    ds_logger.setLevel(logging.WARNING)
    engine = build_bench_engine(args)
    train(engine, batches(1, vocab=args.vocab))
    ds_dir = work / "ds"
    engine.save_checkpoint(str(ds_dir))
    files = sorted(p for p in ds_dir.rglob("*") if p.is_file())
    ds_bytes = sum(p.stat().st_size for p in files)
    print(
        f"model: llama, {param_count(engine.module) / 1e6:.1f}M parameters, bf16, ZeRO-2, 1 rank, CPU; "
        f"DeepSpeed directory {ds_bytes / 1e6:.1f} MB in {len(files)} files; endpoint {endpoint}"
    )
    client = boto3.client("s3", endpoint_url=endpoint)

    def new_bucket() -> str:
        name = f"bench-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=name)
        return name

    def empty(bucket: str) -> None:
        # moto keeps objects in memory: drop them so later reps do not run short of it.
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
        client.delete_bucket(Bucket=bucket)

    def boto3_upload(bucket: str) -> None:
        for path in files:
            client.upload_file(str(path), bucket, path.relative_to(ds_dir).as_posix())

    def boto3_download(bucket: str, into: Path) -> None:
        for path in files:
            key = path.relative_to(ds_dir).as_posix()
            (into / key).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(into / key))

    def backend_put(uri: str) -> None:
        from ckptstore.objects import open_objects

        objects = open_objects(uri)
        for path in files:
            objects.put_if_absent(path.relative_to(ds_dir).as_posix(), path.read_bytes())

    def backend_get(uri: str, into: Path) -> None:
        from ckptstore.objects import open_objects

        objects = open_objects(uri, create=False)
        for path in files:
            key = path.relative_to(ds_dir).as_posix()
            (into / key).parent.mkdir(parents=True, exist_ok=True)
            (into / key).write_bytes(objects.get(key))

    up_boto, up_ckpt, down_boto, down_ckpt, stored, up_raw, down_raw = ([] for _ in range(7))
    for rep in range(args.reps):
        bucket = new_bucket()
        up_boto.append(timed(boto3_upload, bucket))
        down_boto.append(timed(boto3_download, bucket, work / f"down{rep}"))
        shutil.rmtree(work / f"down{rep}")
        empty(bucket)

        bucket = new_bucket()
        up_raw.append(timed(backend_put, f"s3://{bucket}/files"))
        down_raw.append(timed(backend_get, f"s3://{bucket}/files", work / f"raw{rep}"))
        shutil.rmtree(work / f"raw{rep}")
        empty(bucket)

        bucket = new_bucket()
        os.environ["CKPTSTORE_CACHE"] = str(work / f"cache-commit{rep}")
        store = ckptstore.open(f"s3://{bucket}/run")
        start = time.perf_counter()
        report = store.commit(engine, step=1)
        up_ckpt.append(time.perf_counter() - start)
        stored.append(report.bytes_added)
        store.close()
        os.environ["CKPTSTORE_CACHE"] = str(work / f"cache-materialize{rep}")  # another machine

        down_ckpt.append(timed(materialize, f"s3://{bucket}/run", work / f"out{rep}"))
        shutil.rmtree(work / f"out{rep}")
        empty(bucket)

    med = statistics.median
    rows = [
        ("upload: boto3 upload_file of the DeepSpeed dir", med(up_boto), None),
        ("upload: ckptstore commit into S3", med(up_ckpt), med(up_ckpt) / med(up_boto)),
        (
            "upload: the same files through S3ObjectStore.put_if_absent",
            med(up_raw),
            med(up_raw) / med(up_boto),
        ),
        ("download: boto3 download_file of the DeepSpeed dir", med(down_boto), None),
        ("download: ckptstore materialize from S3", med(down_ckpt), med(down_ckpt) / med(down_boto)),
        ("download: the same files through S3ObjectStore.get", med(down_raw), med(down_raw) / med(down_boto)),
    ]
    print(f"\n| operation | seconds (median of {args.reps}) | MB/s of the DeepSpeed dir | time vs boto3 |")
    print("|---|---:|---:|---:|")
    for name, seconds, ratio in rows:
        print(
            f"| {name} | {seconds:.2f} | {ds_bytes / 1e6 / seconds:.1f} | {'' if ratio is None else f'{ratio:.2f}x'} |"
        )
    print(
        f"\nbytes sent by the commit: {med(stored) / 1e6:.1f} MB ({med(stored) / ds_bytes:.3f}x the DeepSpeed dir)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
