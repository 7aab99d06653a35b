"""Lightning's ModelParallelStrategy (FSDP2) checkpoints into the store through
``StoreModelParallelStrategy`` and resumes from it as from its own checkpoint directory
(2 torchrun ranks, gloo, CPU; the job is tests/lightning_jobs.py)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

import ckptstore
from ckptstore.errors import BadInputError
from tests.dcp_runs import job_env
from tools.engines import free_port

pytest.importorskip("lightning")

JOB = Path(__file__).with_name("lightning_jobs.py")


def lightning_jobs(tmp_path: Path, runs: dict[str, list]) -> dict[str, dict]:
    """The runs (name: arguments) one after another in one 2-rank job; each run's result."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        str(JOB),
    ]  # fmt: skip
    for name, args in runs.items():
        command += [*map(str, args), "--result", str(tmp_path / f"{name}.json"), "+"]
    done = subprocess.run(
        command, cwd=JOB.parents[1], env=job_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-5000:]
    return {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in runs}


def test_a_lightning_job_resumes_from_the_store_as_from_its_own_checkpoint(tmp_path):
    store = tmp_path / "store"
    runs = lightning_jobs(  # one job: save into the store and into Lightning's own, then resume each
        tmp_path,
        {
            "store-save": ["--steps", 3, "--save", f"store:{store}", "--csv", tmp_path / "csv"],
            "own-save": ["--steps", 3, "--save", f"dir:{tmp_path / 'own'}"],
            "store-resume": ["--steps", 6, "--resume", f"store:{store}:3"],
            "own-resume": ["--steps", 6, "--resume", f"dir:{tmp_path / 'own'}"],
        },
    )
    saved, own = runs["store-save"], runs["own-save"]
    assert saved["losses"] == own["losses"]
    with ckptstore.open(store, create=False) as opened:
        assert opened.steps() == [3]
        assert "model.model.layers.1" in opened.sources(3)  # the LightningModule's own names
        assert opened.verify().ok
        [row] = opened.log()
    # The commit's figures reach the trainer's logger at the saved step.
    with open(tmp_path / "csv" / "metrics.csv") as lines:
        [logged] = [line for line in csv.DictReader(lines) if line.get("ckptstore/step")]
    assert int(logged["step"]) == int(float(logged["ckptstore/step"])) == 3
    assert int(float(logged["ckptstore/bytes_stored"])) == row.bytes_added > 0
    assert int(float(logged["ckptstore/layers_saved"])) == row.layers_saved
    assert float(logged["ckptstore/stall_seconds"]) > 0
    from_store, from_own = runs["store-resume"], runs["own-resume"]
    assert from_store["global_step"] == from_own["global_step"] == 6
    assert len(from_store["losses"]) == 3 and from_store["losses"] == from_own["losses"]


def test_a_checkpoint_path_names_a_store_step():
    from ckptstore.integrations.lightning import store_step

    assert store_step("store:400") == 400 and store_step("store:latest") is None
    with pytest.raises(BadInputError, match="store:<step> or store:latest"):
        store_step("checkpoints/last.ckpt")
