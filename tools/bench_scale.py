"""Simulate the metadata and object traffic of a big job's checkpoints, without training.

    python tools/bench_scale.py [--configs 8b-64-zero3,70b-512-zero3,70b-512-zero2] [--s3-steps 1000]
                                [--format 2] [--endpoint URL]

For each configuration (a Llama-3 shape, a data-parallel world size, a ZeRO stage; fp32 master
and two Adam moments per parameter, module weights not stored apart, as at ZeRO 0-3 in bf16),
the pieces every rank would store are cut with the same partition math the extractor and the
writer use (``ckptstore.deepspeed.layout``), then one full step is recorded through the real
code: its ``StepRecord``, the manifest encoding, a fresh SQLite catalog, and the plan a
materialize makes before fetching anything (``step_reader``). No tensor is allocated: keys are
synthetic and sizes are what real tensors of those lengths would take.

``--format 2`` (what ckptstore writes) groups each rank's pieces of a layer into packs the way
the writer does (``commit.packs.cut_points``), sized with the real pack index encoding;
``--format 1`` records one blob per piece, as ckptstore did before packs.

For the first configuration, ``--s3-steps`` full steps are also written to a moto S3 server in
its own process, or to the S3 endpoint ``--endpoint`` (manifests and blobs of a few bytes each;
each step re-commits the same tensors, so blobs dedup and only metadata grows), then timed: ``open`` + ``steps()`` on a
machine with an empty cache, and ``gc --keep-last 5`` there.

Prints one JSON object per configuration: ``config``, ``objects_per_step``,
``smallest_object_bytes``, ``manifest_bytes``, ``catalog_bytes_per_step``, ``plan_seconds``,
and for the first configuration ``s3_steps``, ``fresh_open_seconds``, ``gc_seconds``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptstore import knobs  # noqa: E402
from ckptstore.catalog import Catalog  # noqa: E402
from ckptstore.commit.packs import cut_points  # noqa: E402
from ckptstore.deepspeed.layout import flat_fragments, flat_partition_size, zero3_bounds  # noqa: E402
from ckptstore.format import layerpacks, manifest, pack  # noqa: E402
from ckptstore.layers import layer_of, ordered_layers  # noqa: E402
from ckptstore.materialize.directory import step_reader  # noqa: E402
from ckptstore.model import BlobRow, PackRef, StepRecord, TensorRow  # noqa: E402
from ckptstore.objects.local import LocalObjectStore  # noqa: E402

# Llama-3 shapes (grouped-query attention: 8 key/value heads of 128).
MODELS = {
    "8b": {"hidden": 4096, "intermediate": 14336, "layers": 32, "vocab": 128256, "kv": 1024},
    "70b": {"hidden": 8192, "intermediate": 28672, "layers": 80, "vocab": 128256, "kv": 1024},
}
KINDS = ("fp32", "exp_avg", "exp_avg_sq")
HEADER_BYTES = 40  # a blob header of a 1-D float32 tensor (codec.py)


def llama_params(model: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter, in the module's order."""
    h, i, kv = model["hidden"], model["intermediate"], model["kv"]
    params = [("model.embed_tokens.weight", (model["vocab"], h))]
    for n in range(model["layers"]):
        block = f"model.layers.{n}"
        params += [
            (f"{block}.self_attn.q_proj.weight", (h, h)), (f"{block}.self_attn.k_proj.weight", (kv, h)),
            (f"{block}.self_attn.v_proj.weight", (kv, h)), (f"{block}.self_attn.o_proj.weight", (h, h)),
            (f"{block}.mlp.gate_proj.weight", (i, h)), (f"{block}.mlp.up_proj.weight", (i, h)),
            (f"{block}.mlp.down_proj.weight", (h, i)),
            (f"{block}.input_layernorm.weight", (h,)), (f"{block}.post_attention_layernorm.weight", (h,)),
        ]  # fmt: skip
    return params + [("model.norm.weight", (h,)), ("lm_head.weight", (model["vocab"], h))]


def rank_fragments(params, world_size: int, stage: int):
    """Every (rank, name, start, count) a job of ``world_size`` ranks at ``stage`` stores."""
    if stage == 3:
        for rank in range(world_size):
            for name, shape in params:
                start, count = zero3_bounds(math.prod(shape), world_size, rank)
                if count:
                    yield rank, name, start, count
        return
    # ZeRO-1/2: two flat groups (weight decay, none for norms), each partitioned evenly.
    groups = [[p for p in params if "norm" not in p[0]], [p for p in params if "norm" in p[0]]]
    for group in groups:
        numels = [math.prod(shape) for _, shape in group]
        size = flat_partition_size(sum(numels), world_size)
        for rank in range(world_size):
            for index, start, count, _ in flat_fragments(numels, rank * size, (rank + 1) * size):
                yield rank, group[index][0], start, count


def step_record(params, world_size: int, stage: int, step: int, salt: int, fmt: int = 2) -> StepRecord:
    """A full step: format 2 packs every rank's pieces of a layer, format 1 stores a blob per piece."""
    return (packed_record if fmt == 2 else blob_record)(params, world_size, stage, step, salt)


def _synthetic_key(*parts) -> str:
    return xxhash.xxh3_128("|".join(map(str, parts)).encode()).hexdigest()


def packed_record(params, world_size: int, stage: int, step: int, salt: int) -> StepRecord:
    """Format 2: per rank and layer, its pieces in the writer's order, cut into packs as it cuts them."""
    by_rank_layer: dict[tuple[int, str], list] = {}
    for rank, name, start, count in rank_fragments(params, world_size, stage):
        for kind in KINDS:
            by_rank_layer.setdefault((rank, layer_of(name)), []).append((name, start, kind, count))
    packs: dict[str, list] = {}
    for (rank, layer), pieces in sorted(by_rank_layer.items()):
        pieces.sort()
        for part in cut_points([4 * count for *_, count in pieces], knobs.pack_bytes()):
            members = pieces[part]
            offset, entries = 0, []
            for name, start, kind, count in members:
                key = _synthetic_key(salt, name, kind, start, rank)
                entries.append(pack.Entry(name, kind, start, key, offset, HEADER_BYTES + 4 * count))
                offset += HEADER_BYTES + 4 * count
            head = pack.PREAMBLE.size + len(pack.index_bytes(entries))
            ref = PackRef(_synthetic_key(salt, rank, layer, part.start), rank, head + offset,
                          sum(4 * count for *_, count in members))  # fmt: skip
            packs.setdefault(layer, []).append(
                (ref, [(name, kind, "float32", start, count) for name, start, kind, count in members])
            )
    layers = ordered_layers(name for name, _ in params)
    return StepRecord(
        step=step, created_at="2026-01-01T00:00:00+00:00", world_size=world_size,
        description=json.dumps({"params": description_params(params)}, sort_keys=True, separators=(",", ":")),
        layer_sources=dict.fromkeys(layers, step), tensors=[], blobs=[],
        packs={layer: layerpacks.build(step, layer, packs[layer]) for layer in layers},
    )  # fmt: skip


def object_sizes(record: StepRecord) -> dict[str, int]:
    """Every object a step's record references -> its stored size."""
    sizes = {blob.key: blob.size for blob in record.blobs}
    sizes.update((ref.key, ref.size) for index in record.packs.values() for ref in index.packs)
    return sizes


def small_parts(record: StepRecord) -> int:
    """Objects under 64 KiB that hold only part of what one rank saved of a layer: cut packs, or
    (format 1) any blob, one of at least three tensors (fp32 and two moments) of that share."""
    count = sum(blob.size < 64 * 1024 for blob in record.blobs)
    for index in record.packs.values():
        per_rank = Counter(ref.rank for ref in index.packs)
        count += sum(ref.size < 64 * 1024 and per_rank[ref.rank] > 1 for ref in index.packs)
    return count


def blob_record(params, world_size: int, stage: int, step: int, salt: int) -> StepRecord:
    """Format 1: one blob per (rank's fragment, kind)."""
    rows, blobs = [], {}
    for rank, name, start, count in rank_fragments(params, world_size, stage):
        for kind in KINDS:
            key = xxhash.xxh3_128(f"{salt}|{name}|{kind}|{start}|{rank}".encode()).hexdigest()
            rows.append(TensorRow(step, layer_of(name), name, kind, start, count, key))
            blobs[key] = BlobRow(key, HEADER_BYTES + 4 * count, 4 * count)
    layers = ordered_layers(name for name, _ in params)
    return StepRecord(
        step=step, created_at="2026-01-01T00:00:00+00:00", world_size=world_size,
        description=json.dumps({"params": description_params(params)}, sort_keys=True, separators=(",", ":")),
        layer_sources=dict.fromkeys(layers, step), tensors=rows, blobs=list(blobs.values()),
    )  # fmt: skip


def description_params(params) -> dict:
    return {name: {"shape": list(shape), "dtype": "bfloat16", "trainable": True} for name, shape in params}


def catalog_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(f"{path.name}*"))


def measure(config: str, work: Path, fmt: int) -> dict:
    """The per-step figures of one configuration."""
    model, ranks, stage = config.split("-")
    params = llama_params(MODELS[model])
    world_size, stage = int(ranks), int(stage.removeprefix("zero"))
    record = step_record(params, world_size, stage, step=1, salt=1, fmt=fmt)
    sizes = object_sizes(record)
    result = {
        "config": config,
        "format": fmt,
        "objects_per_step": len(sizes),
        "smallest_object_bytes": min(sizes.values()),
        "objects_under_64KiB": sum(size < 64 * 1024 for size in sizes.values()),
        # a small object is fine only where it is all that rank saved of a layer
        "objects_under_64KiB_besides_whole_shares": small_parts(record),
        "manifest_bytes": len((manifest.encode if fmt == 2 else manifest.encode_v1)(record)),
    }
    path = work / f"{config}.db"
    catalog = Catalog(path)
    catalog.record_step(step_record(params, world_size, stage, step=0, salt=0, fmt=fmt))
    catalog.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    before = catalog_size(path)
    catalog.record_step(record)
    catalog.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    result["catalog_bytes_per_step"] = catalog_size(path) - before
    # The reader asks its object store whether reads are local; an empty local store is what a
    # materialize from a local store plans against (no readahead), and planning reads no object.
    objects = LocalObjectStore(work / f"{config}-objects")
    started = time.perf_counter()
    step_reader(objects, catalog, 1, json.loads(record.description))
    result["plan_seconds"] = round(time.perf_counter() - started, 3)
    catalog.close()
    return result


def measure_s3(config: str, steps: int, work: Path, fmt: int, endpoint: str | None = None) -> dict:
    """Fresh-cache open and gc of ``steps`` full steps of ``config`` in a moto S3 store (one started
    here, or at ``endpoint``)."""
    import ckptstore
    from ckptstore.format.layout import blob_name, manifest_name, pack_name
    from tools.bench_s3 import s3_endpoint

    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    os.environ["CKPTSTORE_PROGRESS"] = "0"
    with s3_endpoint(endpoint) as endpoint:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        model, ranks, stage = config.split("-")
        params = llama_params(MODELS[model])
        import boto3

        bucket = f"scale-{uuid.uuid4().hex[:12]}"  # an endpoint given may hold others' buckets
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
        uri = f"s3://{bucket}/run"
        os.environ["CKPTSTORE_CACHE"] = str(work / "cache-writer")
        objects = ckptstore.open(uri).objects
        first = step_record(params, int(ranks), int(stage.removeprefix("zero")), step=0, salt=0, fmt=fmt)
        names = [blob_name(b.key) for b in first.blobs]
        names += [pack_name(ref.key) for index in first.packs.values() for ref in index.packs]
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda name: objects.put_if_absent(name, b"x"), names))
        encode = manifest.encode if fmt == 2 else manifest.encode_v1
        for step in range(steps):
            # Each step re-commits the same state: every layer saved again, deduplicated.
            record = dataclasses.replace(
                first, step=step, layer_sources=dict.fromkeys(first.layer_sources, step),
                tensors=[dataclasses.replace(row, step=step) for row in first.tensors],
                packs={layer: dataclasses.replace(index, step=step) for layer, index in first.packs.items()},
            )  # fmt: skip
            objects.put_if_absent(manifest_name(step), encode(record), single_request=True)
        os.environ["CKPTSTORE_CACHE"] = str(work / "cache-reader")
        started = time.perf_counter()
        store = ckptstore.open(uri)
        store.steps()
        fresh_open = time.perf_counter() - started
        store.close()
        os.environ["CKPTSTORE_CACHE"] = str(work / "cache-gc")
        started = time.perf_counter()
        with ckptstore.open(uri) as store:
            store.gc(keep_last=5, grace=0)
        gc_seconds = time.perf_counter() - started
    return {"s3_steps": steps, "fresh_open_seconds": round(fresh_open, 2), "gc_seconds": round(gc_seconds, 2)}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="8b-64-zero3,70b-512-zero3,70b-512-zero2")
    parser.add_argument("--s3-steps", type=int, default=1000, help="steps for the S3 figures (0: skip them)")
    parser.add_argument("--format", type=int, choices=(1, 2), default=2, help="store format to simulate")
    from tools.bench_s3 import add_endpoint_option

    add_endpoint_option(parser)
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        for i, config in enumerate(configs):
            result = measure(config, Path(tmp), args.format)
            if i == 0 and args.s3_steps:
                result.update(measure_s3(config, args.s3_steps, Path(tmp), args.format, args.endpoint))
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
