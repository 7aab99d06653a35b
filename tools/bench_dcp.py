"""Benchmark the store's DCP writer and reader against DCP's own and AWS s3torchconnector's.

    python tools/bench_dcp.py [--hidden 512 --layers 6 --vocab 16000 --reps 3] [--endpoint URL]

Starts a moto S3 server on 127.0.0.1 in its own process (or uses ``--endpoint``), then runs
itself under ``torch.distributed.run`` with 2 ranks (gloo, CPU): FSDP2 (``fully_shard`` per
decoder block and the root) over a Llama of about 35M parameters, fp32, AdamW, one training
step. The same sharded state (``get_state_dict``) is saved and loaded, in the same run, by:

* ``fs``: DCP's ``FileSystemWriter``/``FileSystemReader``
* ``fs+zstd``: the same with its ZStandard stream extension
* ``s3tc``: s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` (on the S3 endpoint)
* ``store``: ``StoreWriter``/``StoreReader`` on a local store; ``store-s3`` on the S3 endpoint

Each save writes a new checkpoint (a new step), after a training step changed every tensor,
so nothing is deduplicated against the last one. Prints medians of ``--reps`` per backend,
the ratios the targets are stated in (below 1: the store is faster or smaller), the bytes of
a step and of a step that saves half the blocks. ``s3tc`` needs ``pip install -e ".[bench]"``
(s3torchconnector, tenacity); without it that backend and its ratios are left out, said so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.bench_s3 import add_endpoint_option, s3_endpoint  # noqa: E402
from tools.engines import add_bench_model_options, free_port  # noqa: E402

BUCKET = "bench-dcp"
REGION = "us-east-1"


def launch(args) -> int:
    """The launcher: an S3 endpoint and a bucket, then this script on 2 ranks."""
    import boto3

    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION=REGION,
        CKPTSTORE_PROGRESS="0", OMP_NUM_THREADS="1",
    )  # fmt: skip
    with s3_endpoint(args.endpoint) as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        boto3.client("s3", endpoint_url=endpoint, region_name=REGION).create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory(prefix="bench-dcp-") as work:
            command = [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), __file__, "--worker", work,
                "--hidden", str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab),
                "--reps", str(args.reps),
            ]  # fmt: skip
            return subprocess.run(command, check=False).returncode


def worker(args) -> None:
    """One rank: train, then save and load the same state through every backend."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import ckptstore
    from ckptstore.integrations.dcp import StoreReader, StoreWriter
    from tools.engines import build_model, param_count

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = Path(args.worker)
    torch.manual_seed(0)
    model = build_model("llama", seed=0, num_layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)

    def train_step() -> None:
        ids = torch.randint(0, args.vocab, (2, 64), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()

    def state() -> dict:
        model_sd, optim_sd = get_state_dict(model, optim)
        return {"model": model_sd, "optim": optim_sd}

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    endpoint = os.environ["AWS_ENDPOINT_URL"]

    def s3tc(kind, path):
        from s3torchconnector import S3ClientConfig
        from s3torchconnector._s3client import S3Client
        from s3torchconnector.dcp import S3FileSystem, S3StorageReader, S3StorageWriter

        config = S3ClientConfig(force_path_style=True)
        made = (S3StorageWriter if kind == "writer" else S3StorageReader)(
            REGION, path, s3client_config=config
        )
        made.fs = S3FileSystem(REGION, s3_client=S3Client(REGION, endpoint=endpoint, s3client_config=config))
        made.path = made.fs.init_path(path)
        return made

    local_store = ckptstore.open(work / "store")
    s3_store = ckptstore.open(f"s3://{BUCKET}/store")

    def dir_bytes(path: Path) -> int:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())

    backends = {
        "fs": (
            lambda i: dcp.FileSystemWriter(work / f"fs{i}"),
            lambda i: dcp.FileSystemReader(work / f"fs{i}"),
            lambda i: dir_bytes(work / f"fs{i}"),
        ),
        "fs+zstd": (
            lambda i: dcp.FileSystemWriter(work / f"zstd{i}", _extensions=[ZStandard()]),
            lambda i: dcp.FileSystemReader(work / f"zstd{i}"),
            lambda i: dir_bytes(work / f"zstd{i}"),
        ),
        "s3tc": (
            lambda i: s3tc("writer", f"s3://{BUCKET}/s3tc{i}"),
            lambda i: s3tc("reader", f"s3://{BUCKET}/s3tc{i}"),
            lambda i: None,
        ),
        "store": (
            lambda i: StoreWriter(local_store, step=i),
            lambda i: StoreReader(local_store, step=i),
            lambda i: local_store.log()[-1].bytes_added,
        ),
        "store-s3": (
            lambda i: StoreWriter(s3_store, step=i),
            lambda i: StoreReader(s3_store, step=i),
            lambda i: s3_store.log()[-1].bytes_added,
        ),
    }
    if importlib.util.find_spec("s3torchconnector") is None:
        del backends["s3tc"]  # an optional peer (the bench extra): the store's own figures still stand
    results: dict[str, dict[str, list]] = {name: {"save": [], "load": [], "bytes": []} for name in backends}
    train_step()
    for rep in range(args.reps):
        train_step()  # every tensor changes: each save is a new checkpoint
        current = state()
        for name, (writer, reader, size) in backends.items():
            save = lambda w=writer, s=current, i=rep: dcp.save(s, storage_writer=w(i))  # noqa: E731
            load = lambda r=reader, s=current, i=rep: dcp.load(s, storage_reader=r(i))  # noqa: E731
            results[name]["save"].append(timed(save))
            results[name]["bytes"].append(size(rep) if rank == 0 else None)
            results[name]["load"].append(timed(load))
    # A step that saves half the blocks, after a training step, against a full one after another.
    blocks = [layer for layer in local_store.sources(0) if ".layers." in layer]
    train_step()
    dcp.save(state(), storage_writer=StoreWriter(local_store, step=1000))
    full = local_store.log()[-1].bytes_added
    train_step()
    dcp.save(state(), storage_writer=StoreWriter(local_store, step=1001, layers=blocks[::2]))
    half = local_store.log()[-1].bytes_added
    if rank == 0:
        report(args, results, full, half, param_count(model))
    dist.barrier()
    dist.destroy_process_group()


def report(args, results: dict, full: int, half: int, params: int) -> None:
    """The table and the ratios, on rank 0."""
    med = {
        name: {k: statistics.median(v) for k, v in r.items() if None not in v} for name, r in results.items()
    }
    print(f"FSDP2, 2 ranks, Llama of {params / 1e6:.1f}M parameters (fp32, AdamW), medians of {args.reps}")
    print(f"{'backend':<10} {'save s':>8} {'load s':>8} {'MB':>9}")
    for name, m in med.items():
        size = f"{m['bytes'] / 1e6:9.1f}" if "bytes" in m else f"{'-':>9}"
        print(f"{name:<10} {m['save']:8.2f} {m['load']:8.2f} {size}")
    ratios = {
        "local save, store / fs+zstd": med["store"]["save"] / med["fs+zstd"]["save"],
        "local load, store / fs+zstd": med["store"]["load"] / med["fs+zstd"]["load"],
    }
    if "s3tc" in med:
        ratios["S3 save, store / s3torchconnector"] = med["store-s3"]["save"] / med["s3tc"]["save"]
        ratios["S3 load, store / s3torchconnector"] = med["store-s3"]["load"] / med["s3tc"]["load"]
    else:
        print('s3tc: s3torchconnector is not installed (pip install -e ".[bench]"): its ratios are left out')
    ratios["a step's bytes / plain DCP directory"] = med["store"]["bytes"] / med["fs"]["bytes"]
    ratios["half the blocks / a full step (bytes)"] = half / full
    for what, ratio in ratios.items():
        print(f"{what:<40} {ratio:6.2f}x")
    print(json.dumps({"ratios": ratios, "medians": med, "full_step_bytes": full, "half_step_bytes": half}))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_model_options(parser, hidden=512, layers=6, vocab=16000, reps=3)
    add_endpoint_option(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set by the launcher
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
