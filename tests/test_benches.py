"""Every benchmark in tools/ runs in a small configuration and prints its ratio lines (issue 54):
a change that breaks a bench fails here, not when someone next re-measures the README's figures.

The configurations are far too small to measure anything, and the box is shared: no test looks
at a value, only that the bench exited 0 and printed the lines its report is read by. The
defaults, which the README's figures come from, are untouched; only options are passed.

Where the time goes (the CI box has 2 cores): starting Python with torch and DeepSpeed costs
more than any bench at these sizes, so processes are shared. The benches without an engine run
in this process; the one-rank benches that build engines run one after another in one child
process (``_SINGLE_RANK``); the benches that start ranks under torchrun run as the user runs
them, the heaviest behind the others (``_BACKGROUND`` says why). Every
bench that needs S3 is given the session's moto server (``--endpoint``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.moto_s3 import S3_ENV

ROOT = Path(__file__).resolve().parents[1]

# The tiniest model the benches build: a 2-block Llama of hidden 32 over 128 tokens.
TINY = ["--hidden", "32", "--layers", "2", "--vocab", "128", "--reps", "1"]


@pytest.fixture
def restored_environ():
    """The benches set what they need in ``os.environ`` (credentials, endpoint, cache) as a
    script may; whatever a bench run in this process set is undone after it."""
    saved = os.environ.copy()
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_bench_gc_prints_its_times(capsys, restored_environ):
    from tools import bench_gc

    assert bench_gc.main(["--steps", "20", "--layers", "4", "--keep-last", "2"]) == 0
    out = capsys.readouterr().out
    assert "synthetic store: 20 steps x 4 layers" in out
    assert "gc --dry-run:" in out and "blobs)" in out


def test_bench_scale_prints_a_record_per_configuration(capsys, s3, monkeypatch, restored_environ):
    from tools import bench_scale

    # A rank's share of a layer in one pack, however big: 70 packs to upload, not 1,100.
    monkeypatch.setenv("CKPTSTORE_PACK_BYTES", str(1 << 40))
    argv = ["--configs", "8b-2-zero3,8b-4-zero2", "--s3-steps", "7", "--endpoint", s3.endpoint]
    assert bench_scale.main(argv) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["config"] for r in records] == ["8b-2-zero3", "8b-4-zero2"]
    for record in records:
        assert {"objects_per_step", "smallest_object_bytes", "manifest_bytes", "plan_seconds"} <= set(record)
    assert {"s3_steps", "fresh_open_seconds", "gc_seconds"} <= set(records[0])


def test_bench_scale_simulates_format_1_too(capsys, restored_environ):
    from tools import bench_scale

    assert bench_scale.main(["--configs", "8b-2-zero3", "--s3-steps", "0", "--format", "1"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["format"] == 1 and {"objects_per_step", "manifest_bytes", "plan_seconds"} <= set(record)


# The one-rank benches that build engines, in one child process: (name, argv, lines it prints).
# bench_codec pins the process to one core (it measures one core): it runs last.
_SINGLE_RANK = [
    (
        "bench",
        TINY,
        [
            "| full commit |",
            "| DeepSpeed load_checkpoint of its own directory |",
            "| restore (vs load_checkpoint) |",
            "| restore (vs materialize + load_checkpoint) |",
            "peak extra RSS during commit",
            "peak extra RSS during restore:",
            "peak extra RSS during load_checkpoint:",
        ],
    ),
    ("bench_export", [*TINY, "--dtypes", "bfloat16"], ["| ckptstore export, bfloat16 |", "ratios against"]),
    ("bench_cores", [*TINY, "--threads", "1"], ["| export |", "| restore |", "| commit |"]),
    ("bench_s3", [*TINY, "--endpoint", "{endpoint}"], ["| upload: ckptstore commit into S3 |", "bytes sent"]),
    (
        "bench_tiered",
        [*TINY, "--rate", "64MB", "--endpoint", "{endpoint}"],
        ["tier commit / direct S3 commit"],
    ),
    ("bench_trainer", [*TINY, "--saves", "1"], ["| with CkptStoreCallback", "store bytes added per save"]),
    (
        "tailor_eval",
        ["--steps", "2", "--every", "1", "--fail-at", "1", "--layers", "2", "--eval-batches", "1"],
        ["| update-magnitude |", "2 steps, commit every 1"],
    ),
    (
        "bench_every_step",
        [*TINY, "--steps", "3", "--seq", "16", "--batch", "2"],
        [
            "| ckptstore commit, when_busy=latest |",
            "| ckptstore commit, when_busy=wait, no deltas |",
            "| DeepSpeed save_checkpoint |",
            "materialize of the newest step",
        ],
    ),
    ("bench_deltas", [*TINY, "--warmup", "2", "--lr", "1e-3"], ["| **a commit (masters and moments)** |"]),
    (
        "bench_policy_versions",
        [*TINY, "--steps", "3", "--warmup", "1", "--seq", "16", "--batch", "2"],
        ["| dcp.save into the store (deltas) |", "ratios against DCP's FileSystemWriter"],
    ),
    ("bench_codec", [*TINY, "--steps", "1"], ["ckptstore / blosc2: decode"]),
]

# Runs each (name, argv) of the JSON list in argv[1] with tools.<name>.main(argv), between marker
# lines; an exception is the bench's failure, printed, and the next one runs.
_RUNNER = r"""
import json, os, sys, traceback
sys.path.insert(0, os.getcwd())
import tools.engines
# The first engine creates the process group and every later one reuses it (tools/engines.py);
# bench.py and tailor_eval.py destroy it at their end, as a script's last act: here it goes at exit.
tools.engines.finalize_distributed = lambda: None
import time
environ = dict(os.environ)
for name, argv in json.loads(sys.argv[1]):
    print(f"=== bench {name}", flush=True)
    started = time.monotonic()
    try:
        module = __import__(f"tools.{name}", fromlist=["main"])
        code = module.main(argv)
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        code = 1
    sys.stdout.flush()
    os.environ.clear()
    os.environ.update(environ)  # what a bench set for itself (endpoint, cache) is not the next one's
    print(f"took {time.monotonic() - started:.1f} s", flush=True)
    print(f"=== exit {name} {code}", flush=True)
"""


@pytest.fixture(scope="module")
def single_rank_outputs(s3_server, tmp_path_factory) -> dict[str, tuple[int | None, str]]:
    """Each one-rank bench's exit status and output, from one child process that runs them all."""
    endpoint, _ = s3_server
    jobs = [(name, [arg.replace("{endpoint}", endpoint) for arg in argv]) for name, argv, _ in _SINGLE_RANK]
    env = {**_bench_env(endpoint), "TMPDIR": str(tmp_path_factory.mktemp("benches"))}
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(jobs)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600,
    )  # fmt: skip
    outputs: dict[str, tuple[int | None, str]] = {}
    name = None
    for line in proc.stdout.splitlines():
        if line.startswith("=== bench "):
            name = line.split()[2]
            outputs[name] = (None, "")
        elif line.startswith("=== exit ") and name is not None:
            outputs[name] = (int(line.split()[3]), outputs[name][1])
            name = None
        elif name is not None:
            outputs[name] = (outputs[name][0], outputs[name][1] + line + "\n")
    if proc.returncode != 0:  # the process died: the bench running then is the one to blame
        outputs.setdefault("(runner)", (proc.returncode, proc.stdout[-5000:]))
    return outputs


@pytest.mark.parametrize(
    "name, lines", [pytest.param(name, lines, id=name) for name, _, lines in _SINGLE_RANK]
)
def test_single_rank_bench_runs_small(single_rank_outputs, name, lines):
    code, out = single_rank_outputs.get(name, (None, single_rank_outputs.get("(runner)", (None, ""))[1]))
    assert code == 0, f"tools/{name}.py failed:\n{out[-5000:]}"
    for line in lines:
        assert line in out, f"tools/{name}.py did not print {line!r}:\n{out[-3000:]}"


def _bench_env(endpoint: str) -> dict[str, str]:
    """A child's environment: the loopback S3 server's, no progress bars, no rank of the parent's."""
    drop = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AWS_")}
    return {**env, **S3_ENV, "AWS_ENDPOINT_URL": endpoint, "CKPTSTORE_PROGRESS": "0", "DS_ACCELERATOR": "cpu"}


# The benches that start their own ranks (torch.distributed.run), as the user runs them.
_MULTI_RANK = [
    ("bench_dcp", [*TINY, "--endpoint", "{endpoint}"], ["local save, store / fs+zstd", "half the blocks"]),
    (
        "bench_model_parallel",  # 4 blocks: ds_to_universal counts all but the first and last layer files
        # as transformer layers and divides them among the 2 stages (2 blocks: ZeroDivisionError)
        ["--split", "pipeline", "--hidden", "32", "--layers", "4", "--vocab", "128", "--reps", "1"],
        ["| commit (durable) |", "| restore into 1 way"],
    ),
    (
        "bench_megatron3d",
        ["--hidden", "32", "--heads", "4", "--ffn", "64", "--vocab", "49", "--layers", "2", "--reps", "1"],
        ["| commit (durable) |", "| materialize --universal from the store |"],
    ),
    (
        "bench_moe",
        ["--hidden", "32", "--saves", "2", "--reps", "1"],
        ["| commit (durable), per save |", "| restore into ep_size 1"],
    ),
    (
        "bench_replicas",
        [*TINY, "--steps", "2", "--every", "1", "--rate", "64MB", "--endpoint", "{endpoint}"],
        ["recovery from a peer / from S3", "replica bytes sent / new pack bytes"],
    ),
]

# bench_replicas starts 16 processes, one job after another (two torchrun nodes for each of its
# four jobs), each paying torch's and DeepSpeed's imports and op loading: about 50 s of a quiet
# 2-core box, much of it waiting for a process to start. It runs behind the others, started as
# this module starts (``background``); its test, the last, collects it.
_BACKGROUND = {"bench_replicas"}


class Started(NamedTuple):
    proc: subprocess.Popen
    output: Path  # where it prints: a pipe no one reads while it runs behind could fill and stop it

    def finish(self) -> str:
        """What it printed, once it has ended (killed past 10 minutes)."""
        try:
            self.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.output.read_text()


def _start(name: str, argv: list[str], endpoint: str, tmp: Path) -> Started:
    argv = [arg.replace("{endpoint}", endpoint) for arg in argv]
    with open(tmp / "output", "w") as output:
        proc = subprocess.Popen(
            [sys.executable, f"tools/{name}.py", *argv], cwd=ROOT, env={**_bench_env(endpoint), "TMPDIR": str(tmp)},
            stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return Started(proc, tmp / "output")


@pytest.fixture(scope="module", autouse=True)
def background(s3_server, tmp_path_factory):
    """The benches of ``_BACKGROUND``, started as this module starts; killed if still running at its end."""
    endpoint, _ = s3_server
    started = {
        name: _start(name, argv, endpoint, tmp_path_factory.mktemp(name))
        for name, argv, _ in _MULTI_RANK if name in _BACKGROUND
    }  # fmt: skip
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


@pytest.mark.parametrize(
    "name, argv, lines",
    [  # the background ones last: by then they have had the others' time to run
        pytest.param(name, argv, lines, id=name)
        for name, argv, lines in sorted(_MULTI_RANK, key=lambda job: job[0] in _BACKGROUND)
    ],
)
def test_multi_rank_bench_runs_small(s3_server, background, tmp_path, name, argv, lines):
    endpoint, _ = s3_server
    run = background.get(name) or _start(name, argv, endpoint, tmp_path)
    output = run.finish()
    assert run.proc.returncode == 0, f"tools/{name}.py failed:\n{output[-5000:]}"
    for line in lines:
        assert line in output, f"tools/{name}.py did not print {line!r}:\n{output[-3000:]}"
