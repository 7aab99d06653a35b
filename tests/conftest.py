"""Shared pytest set-up.

* Puts the repository root on sys.path so tests can ``from tools.engines import ...``.
* Sets the single-process CPU DeepSpeed environment (DS_ACCELERATOR=cpu, MASTER_ADDR/PORT, RANK,
  WORLD_SIZE, LOCAL_RANK) at import time, i.e. before collection imports deepspeed anywhere: the
  accelerator is chosen once, at deepspeed's first use, so a session fixture would run too late.
* At session end destroys the torch.distributed process group that the first DeepSpeed engine
  created (it lives for the whole process; engines share it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from tools.engines import finalize_distributed, setup_single_process_env  # noqa: E402

setup_single_process_env()


@pytest.fixture(scope="session", autouse=True)
def _single_process_deepspeed_env():
    setup_single_process_env()  # idempotent; never overrides a launcher's values
    yield
    finalize_distributed()


def pytest_sessionfinish(session, exitstatus):
    finalize_distributed()
