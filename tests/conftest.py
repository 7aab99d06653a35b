"""Shared pytest set-up.

* Puts the repository root on sys.path so tests can ``from tools.engines import ...``.
* Points TORCH_EXTENSIONS_DIR at this checkout's own folder (tools.engines.own_torch_extensions_dir).
* Sets the single-process CPU DeepSpeed environment (DS_ACCELERATOR=cpu, MASTER_ADDR/PORT, RANK,
  WORLD_SIZE, LOCAL_RANK) at import time, i.e. before collection imports deepspeed anywhere: the
  accelerator is chosen once, at deepspeed's first use, so a fixture would run too late.
* ``run``: the CLI run in this process, returning (returncode, stdout, stderr).
* ``zero1_engine``: a small trained engine to commit, one per test module.
* At session end destroys the torch.distributed process group that the first DeepSpeed engine
  created (engines share it for the whole process). A clean exit did not need this in any case
  tried (see tools/engines.py), it is insurance.
* Opt-in escape hatch: with ``CKPTSTORE_TEST_HARD_EXIT=1`` the process leaves through
  ``os._exit(<pytest's exit status>)`` after everything is reported, skipping interpreter
  teardown (use only if a native "terminate called without an active exception" abort at exit
  ever turns a green run red; it also skips atexit handlers such as coverage's).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

# The loopback S3 server (session) and a bucket per test: see tests/moto_s3.py.
from tests.moto_s3 import machine, s3, s3_server  # noqa: E402, F401
from tools.engines import (  # noqa: E402
    finalize_distributed,
    own_torch_extensions_dir,
    setup_single_process_env,
)

# The suite's JIT-built DeepSpeed ops live in this checkout (under .venv/), whatever the shell says:
# a stale build lock in a shared ~/.cache/torch_extensions would stall every engine (issue 54).
os.environ["TORCH_EXTENSIONS_DIR"] = own_torch_extensions_dir()
setup_single_process_env()

_EXIT_STATUS: list[int] = []


def pytest_configure(config):
    # Noise from DeepSpeed's ZeRO-3 / JIT code paths, not from ckptstore.
    for line in (
        "ignore:`torch.distributed.all_gather_into_tensor` is deprecated:FutureWarning",
        "ignore:`torch.distributed.reduce_scatter_tensor` is deprecated:FutureWarning",
        "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning",
    ):
        config.addinivalue_line("filterwarnings", line)
    config.addinivalue_line(
        "markers",
        "either_key: in the KEYED_SUITE, each parameter set runs once, with a key or without"
        " (alternating), not both",
    )


class CliResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def run(capsys, monkeypatch):
    """Run the CLI in this process, as the console script would, and capture what it printed."""
    from ckptstore.cli import main

    def invoke(*args, env_store=None) -> CliResult:
        monkeypatch.delenv("CKPTSTORE_STORE", raising=False)
        if env_store:
            monkeypatch.setenv("CKPTSTORE_STORE", str(env_store))
        capsys.readouterr()
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code or 0
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return invoke


@pytest.fixture(scope="module")
def zero1_engine():
    """A ZeRO-1 bf16 two-block Llama trained one batch: state to commit, built once per module."""
    from tools.engines import batches, build_engine, train

    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=2)
    train(engine, batches(1))
    return engine


# Where a key changes behaviour, modules run twice: once as is, once with every store opened
# with a key (``CKPTSTORE_KEY_FILE``, which ranks started as subprocesses inherit): the
# DeepSpeed door's commit, materialize and restore, gc, and S3. Authentication, the catalog,
# sync, verify and the DCP door test their keyed cases themselves (test_authentication,
# test_catalog_sync, test_dcp_store's s3-with-key). The rest of the DeepSpeed suite (compose,
# export, background commits, many ranks, streaming, weights-only, files, strategies) reads and
# writes through the same content-key and manifest-tag code, so it runs once (issue 48: the
# whole suite twice took a third of CI). Within these modules, the multi-process jobs and the
# matrices of engine configurations (ZeRO stage x dtype x model, whose bytes a key hashes like
# any other) are ``either_key``: each configuration once, the modes alternating across them.
KEYED_SUITE = {"test_store_deepspeed", "test_restore", "test_gc", "test_store_s3"}


def pytest_generate_tests(metafunc):
    if metafunc.module.__name__.rsplit(".", 1)[-1] in KEYED_SUITE:
        metafunc.parametrize("store_key", ["no-key", "key"], indirect=True, scope="module")


def pytest_collection_modifyitems(config, items):
    """Of each ``either_key`` test of the KEYED_SUITE (multi-process jobs, the slowest of the
    suite, and the engine-configuration matrices), keep one mode: with a key and without
    alternate from one such test (or parameter set) to the next in each module, so both modes
    still run every kind of job and configurations of every matrix, and the module's other
    tests run both. Each mode alone costs these tests as much as both did. Tests marked
    ``either_key(job=NAME)`` read one shared job, so they are kept in the same mode."""
    keep, dropped, seen = [], [], {}
    for item in items:
        mode = getattr(getattr(item, "callspec", None), "params", {}).get("store_key")
        if mode is None or item.get_closest_marker("either_key") is None:
            keep.append(item)
            continue
        others = tuple((k, repr(v)) for k, v in item.callspec.params.items() if k != "store_key")
        job = item.get_closest_marker("either_key").kwargs.get("job")
        group = (item.module.__name__, job, ()) if job else (item.module.__name__, item.originalname, others)
        n = sum(g[0] == group[0] for g in seen)  # key, no-key, no-key, key, ...: a matrix's
        wanted = seen.setdefault(group, "key" if (n + n // 2) % 2 == 0 else "no-key")  # last axis gets both
        (keep if mode == wanted else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture(scope="module", autouse=True)
def store_key(request, tmp_path_factory):
    """In the ``KEYED_SUITE``: whether the module's stores are opened with a key ("key": a fresh
    one in a 0600 file named by ``CKPTSTORE_KEY_FILE``) or without ("no-key"), each module run
    once each way; a module-scoped fixture that opens a store takes ``store_key`` so that it
    is made again for each. Elsewhere (None) the environment is left as it is."""
    param = getattr(request, "param", None)
    if param is None:
        yield None
        return
    with pytest.MonkeyPatch.context() as patch:
        if param == "key":
            path = tmp_path_factory.mktemp("key") / "store.key"
            path.write_bytes(os.urandom(32))
            path.chmod(0o600)
            patch.setenv("CKPTSTORE_KEY_FILE", str(path))
        else:
            patch.delenv("CKPTSTORE_KEY_FILE", raising=False)
        yield param


@pytest.fixture(scope="session", autouse=True)
def _single_process_deepspeed_env():
    setup_single_process_env()  # idempotent; never overrides a launcher's values
    yield
    finalize_distributed()


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))
    finalize_distributed()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if os.environ.get("CKPTSTORE_TEST_HARD_EXIT") == "1" and _EXIT_STATUS:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
