"""Host bytes of accelerator tensors: chunks and byte planes equal to what the host path reads,
and a GPU tensor's blob (taken by the device path) equal to its host copy's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptstore.format import codec, devicecopy, planes

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.uint8, torch.bool]


def sample(dtype: torch.dtype, shape=(301, 77)) -> torch.Tensor:
    return (torch.randn(shape) * 100).to(dtype)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_host_chunks_are_the_tensor_bytes_in_order(chunk):
    tensor = sample(torch.bfloat16).t()  # not contiguous: read in C order all the same
    joined = np.concatenate([c.copy() for c in devicecopy.host_chunks(tensor, chunk)])
    assert bytes(joined) == bytes(codec.raw_bytes(tensor))
    assert all(c.size <= chunk for c in devicecopy.host_chunks(tensor, chunk))


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.itemsize > 1])
@pytest.mark.parametrize("chunk", [2, 1000, 1 << 20])
def test_host_planes_are_the_planes_of_the_tensor_bytes(dtype, chunk):
    tensor = sample(dtype).t()
    expected = planes.split_planes(codec.raw_bytes(tensor), tensor.element_size())
    assert np.array_equal(devicecopy.host_planes(tensor, chunk), expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (), (513, 130)])
@pytest.mark.parametrize("compress", [True, False])
def test_the_device_path_encodes_the_blob_the_host_path_does(monkeypatch, dtype, shape, compress):
    """A tensor's key and blob do not depend on where it lies (the device path runs here on
    host tensors; tests/test_gpu.py runs it on a GPU's)."""
    if not compress:
        monkeypatch.setenv("CKPTSTORE_MIN_COMPRESS_RATIO", "0")  # every payload stored raw
    tensor = sample(dtype, shape)
    expected = codec.encode(tensor)
    monkeypatch.setattr(devicecopy, "on_host", lambda t: False)
    assert codec.tensor_key(tensor) == expected[0]
    assert codec.encode(tensor) == expected
    assert codec.decode(expected[1], expected[0]).equal(tensor)
