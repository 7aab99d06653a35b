"""Writes tests/data/v1-store: a small store in format version 1, as ckptstore wrote it then.

Run once, by the code of the format it pins (it was run at the commit that added it); never
re-run it with a newer format, or the fixture stops testing what older ckptstores wrote:

    DS_ACCELERATOR=cpu python tests/data/make_v1_store.py

Steps: 10 (ZeRO-2 bf16, every layer, with a config.json), 20 (only model.layers.1: a composite
that inherits the rest from 10), 30 (the same model at ZeRO-3 fp32, every layer). Also writes
v1-store.expected.json: the sha256 of every file ``materialize`` writes for each step (and for
step 10 at world size 2), which ``test_format_v1.py`` checks bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import ckptstore  # noqa: E402
from tools.engines import batches, build_engine, train  # noqa: E402

# DeepSpeed's offline converters are copied from the installed DeepSpeed: not ckptstore's bytes.
SCRIPTS = {"zero_to_fp32.py", "zero_to_torch.py"}
MATERIALIZED = {"10": {}, "20": {}, "30": {}, "10@2": {"world_size": 2}}


def file_digests(directory: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file ``materialize`` wrote (DeepSpeed's scripts and the
    marker saying materialize wrote the folder, which later versions add, left out)."""
    return {
        path.relative_to(directory).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name not in SCRIPTS and path.name != ".ckptstore-output"
    }


def materialized_digests(store) -> dict[str, dict[str, str]]:
    """Every entry of MATERIALIZED -> the digests of its materialized directory."""
    found = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name, options in MATERIALIZED.items():
            step = int(name.split("@")[0])
            found[name] = file_digests(store.materialize(step, Path(scratch) / name, **options))
    return found


def main() -> None:
    target = HERE / "v1-store"
    if target.exists():
        shutil.rmtree(target)
    data = batches(4)
    with tempfile.TemporaryDirectory() as scratch:
        config = Path(scratch) / "config.json"
        config.write_text('{"model_type": "llama", "num_hidden_layers": 2}')
        store = ckptstore.open(target)
        engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
        train(engine, data[:2])
        store.commit(engine, step=10, files=[config])
        train(engine, data[2:3])
        store.commit(engine, step=20, layers=["model.layers.1"])
        zero3 = build_engine("llama", zero_stage=3, dtype="fp32", seed=0, num_layers=2)
        train(zero3, data[:1])
        store.commit(zero3, step=30, files=[config])
        expected = materialized_digests(store)
        store.close()
    (target / "lock").unlink(missing_ok=True)
    (HERE / "v1-store.expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
