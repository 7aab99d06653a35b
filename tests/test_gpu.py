"""Tensors on a GPU: the same content keys and blobs as their host copies, and DeepSpeed engines
on a GPU committed and restored bit for bit. Skipped where torch sees no CUDA device (CI); run
on a GPU machine with ``python -m pytest tests/test_gpu.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore.format import codec
from tools.engines import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_a_gpu_tensor_has_the_key_and_blob_of_its_host_copy(dtype):
    host = (torch.randn(3000, 700) * 100).to(dtype)
    device = host.cuda()
    assert codec.tensor_key(device) == codec.tensor_key(host)
    assert codec.encode(device) == codec.encode(host)
    assert codec.encode(device.t()) == codec.encode(host.t())  # not contiguous


def test_deepspeed_engines_on_a_gpu_commit_and_restore_bit_for_bit(tmp_path):
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "DS_ACCELERATOR": "cuda", "MASTER_PORT": str(free_port()), "PYTHONPATH": path}
    result = tmp_path / "result.json"
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "gpu_worker.py"), str(tmp_path), str(result)],
        env=env,
        check=True,
        timeout=600,
    )
    for config, seen in json.loads(result.read_text()).items():
        assert seen["blocking_wrong"] == [] and seen["background_wrong"] == [], config
        assert seen["restored_state_equal"], config
        # Decoded into the engine's own GPU tensors: no second copy of the state, on the GPU or the host.
        assert seen["restored_in_place"], config
        restored, loaded = seen["losses"]
        assert restored == loaded, config


def _on_gpu(state):
    if isinstance(state, torch.Tensor):
        return state.cuda()
    if isinstance(state, dict):
        return {key: _on_gpu(value) for key, value in state.items()}
    return state


def test_a_dcp_state_dict_on_a_gpu_is_stored_as_its_host_copy_and_loads_back(tmp_path):
    import torch.distributed.checkpoint as dcp

    import ckptstore
    from ckptstore.integrations.dcp import StoreReader, StoreWriter
    from tests.test_dcp_store import assert_equal_states, emptied, training_state

    host = training_state()
    device = _on_gpu(host)
    for where, state in (("gpu", device), ("host", host)):
        with ckptstore.open(tmp_path / where) as store:
            dcp.save(state, storage_writer=StoreWriter(store, step=1))
    with ckptstore.open(tmp_path / "gpu") as store:
        loaded = emptied(device)
        dcp.load(loaded, storage_reader=StoreReader(store, step=1))
    assert_equal_states(loaded, device)
    packs = {where: sorted(p.name for p in (tmp_path / where).rglob("*") if "packs" in p.parts and p.is_file())
             for where in ("gpu", "host")}  # fmt: skip
    assert packs["gpu"] == packs["host"] and packs["gpu"]  # the same content keys, so the same packs
