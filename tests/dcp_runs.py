"""Running tests/dcp_jobs.py (FSDP2 and DTensor jobs) from tests, and comparing what they dump.

The jobs run as subprocesses (torchrun for the distributed ones); tests/test_dcp_fsdp.py runs them
against the store and against DCP's own FileSystemWriter.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from tools.engines import free_port

JOBS = Path(__file__).with_name("dcp_jobs.py")
ROOT = JOBS.parents[1]
_results = itertools.count()


def job_env() -> dict[str, str]:
    """This environment minus the rendezvous variables that tests/conftest.py sets for in-process
    DeepSpeed: a plain ``python`` job must pick its own port, not the one pytest may listen on."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
        and not k.startswith("TORCHELASTIC_")
    }
    # One thread per rank: 2 ranks on a small shared box without oversubscription.
    return env | {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def run_job(args: list[Any], nproc: int | None, tmp_path: Path, timeout: float = 600) -> dict:
    """Run one tests/dcp_jobs.py subcommand and return the JSON result rank 0 wrote.

    ``nproc`` ranks under ``torch.distributed.run`` on a free port; ``None`` runs a plain ``python``
    process (world size 1, or no process group at all for tp-load-nodist). Fails the test, with the
    job's output, unless the job exits 0.
    """
    result = tmp_path / f"result-{next(_results)}.json"
    job = [str(JOBS), *map(str, args), "--result", str(result)]
    if nproc is None:
        command = [sys.executable, *job]
    else:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        command = [sys.executable, *launcher, "--master_port", str(free_port()), *job]
    proc = subprocess.run(command, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(result.read_text())


def run_jobs(jobs: list[list[Any]], nproc: int, tmp_path: Path, timeout: float = 900) -> list[dict]:
    """Run several tests/dcp_jobs.py subcommands one after another in one job of ``nproc`` ranks
    (``dcp_jobs.py sequence``: one interpreter start per rank, not one per subcommand); the JSON
    result each wrote. Fails the test, with the job's output, unless the job exits 0."""
    results = [tmp_path / f"result-{next(_results)}.json" for _ in jobs]
    spec = tmp_path / f"sequence-{next(_results)}.json"
    commands = [[*map(str, args), "--result", str(r)] for args, r in zip(jobs, results, strict=True)]
    spec.write_text(json.dumps(commands))
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    command = [sys.executable, *launcher, "--master_port", str(free_port()), str(JOBS), "sequence", str(spec)]
    proc = subprocess.run(command, cwd=ROOT, env=job_env(), capture_output=True, text=True, timeout=timeout)
    names = " + ".join(str(args[0]) for args in jobs)
    assert proc.returncode == 0, f"{names} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return [json.loads(r.read_text()) for r in results]


def assert_same_state(expected: Any, actual: Any, path: str = "") -> int:
    """Nested dicts/lists of tensors and plain values are equal: tensors by dtype, shape and
    ``torch.equal`` (bit-for-bit), everything else by ``==``. Returns the number of tensors."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), path
        assert torch.equal(actual, expected), path
        return 1
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (path, set(actual) ^ set(expected))
        return sum(assert_same_state(expected[k], actual[k], f"{path}.{k}") for k in expected)
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), path
        return sum(
            assert_same_state(e, a, f"{path}[{i}]")
            for i, (e, a) in enumerate(zip(expected, actual, strict=True))
        )
    assert actual == expected, (path, expected, actual)
    return 0


def load(path: Path) -> Any:
    return torch.load(path, weights_only=True)
