"""How long gc takes on a big catalog: 10,000 steps x 40 layers of synthetic rows, small blobs.

    python tools/bench_gc.py [--steps 10000 --layers 40 --keep-last 5]

Step 0 saves every layer; each later step saves one layer (a composite step) and inherits
the rest, so the catalog holds steps x layers layer rows and about one blob per step.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build_synthetic_store(path: Path, steps: int = 10_000, layers: int = 40):
    """A local store with ``steps`` committed steps over ``layers`` layers (rows written in bulk)."""
    import torch

    import ckptstore
    from ckptstore.format import manifest
    from ckptstore.format.codec import encode
    from ckptstore.format.layout import blob_name, manifest_name
    from ckptstore.model import BlobRow, StepRecord, TensorRow

    store = ckptstore.open(path)
    root = Path(store.objects.root)
    content_hash = store.objects.content_hash  # a store opened with a key names content by it

    def write(name: str, data: bytes) -> None:
        # Straight to disk, without the per-object fsync of a real commit: this only builds a fixture.
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    names = [f"model.layers.{i}" for i in range(layers)]
    sources = dict.fromkeys(names, 0)
    step_rows, layer_rows, tensor_rows, blob_rows = [], [], [], {}
    newest: dict = {}  # layer -> the tensor row of its last save: a manifest names every layer's
    for step in range(steps):
        saved = names if step == 0 else [names[step % layers]]
        rows = []
        for layer in saved:
            key, data = encode(torch.tensor([float(step), float(len(layer))]), content_hash=content_hash)
            write(blob_name(key), data)
            blob_rows[key] = BlobRow(key, len(data), 8)
            rows.append(TensorRow(step, layer, f"{layer}.weight", "fp32", 0, 2, key))
            newest[layer] = rows[-1]
            sources[layer] = step
        tensor_rows += rows
        step_rows.append({"step": step, "created_at": "2026-01-01T00:00:00+00:00", "world_size": 1,
                          "description": "{}", "layers_saved": len(saved), "bytes_added": 0, "blobs_added": len(saved)})  # fmt: skip
        layer_rows += [{"step": step, "layer": layer, "position": i, "source_step": sources[layer]}
                       for i, layer in enumerate(names)]  # fmt: skip
        record = StepRecord(step, "2026-01-01T00:00:00+00:00", 1, "{}", dict(sources), list(newest.values()),
                            [blob_rows[r.blob] for r in newest.values()])  # fmt: skip
        write(manifest_name(step), manifest.encode(record, content_hash))
    db = store.catalog.db
    with db.atomic():
        db["steps"].insert_all(step_rows, batch_size=5000)
        db["layers"].insert_all(layer_rows, batch_size=5000)
        db["tensors"].insert_all(
            ({"step": t.step, "layer": t.layer, "name": t.name, "kind": t.kind, "start": t.start, "numel": t.numel,
              "blob": t.blob} for t in tensor_rows), batch_size=5000,
        )  # fmt: skip
        db["blobs"].insert_all(
            (
                {"key": b.key, "size": b.size, "raw_size": b.raw_size, "first_step": 0}
                for b in blob_rows.values()
            ),
            batch_size=5000,
        )
    return store


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark with ``argv`` (default: the command line's); the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--keep-last", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        store = build_synthetic_store(Path(tmp) / "store", args.steps, args.layers)
        built = time.perf_counter() - started
        started = time.perf_counter()
        store.gc(keep_last=args.keep_last, grace=0, dry_run=True)
        dry_time = time.perf_counter() - started
        started = time.perf_counter()
        report = store.gc(keep_last=args.keep_last, grace=0)
        gc_time = time.perf_counter() - started
    print(f"synthetic store: {args.steps} steps x {args.layers} layers, built in {built:.1f} s")
    print(f"gc --dry-run: {dry_time:.2f} s; gc: {gc_time:.2f} s "
          f"(dropped {len(report.steps_dropped)} steps, freed {report.blobs_freed} blobs)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
