"""The export writer's parts: the cast it does on its own threads, the memory it reuses, the files it writes."""

from __future__ import annotations

import ctypes
import errno
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from ckptstore.export import safetensors_file
from ckptstore.export.writer import Scratch
from ckptstore.format.cast import cast, cast_into


def awkward_floats(n: int) -> torch.Tensor:
    """``n`` fp32 values with every case a rounding can get wrong: ties, subnormals, infinities,
    NaNs, signed zeros, values past the half and bfloat16 ranges."""
    torch.manual_seed(0)
    values = torch.randn(n) * torch.logspace(-45, 38, n).clamp(max=3e38)
    special = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-40, 65504.0, 65520.0, 7e4, 3.4e38]
    )
    values[: len(special)] = special
    ties = torch.arange(1000, dtype=torch.int32) << 16 | 0x8000  # exactly halfway between bf16 values
    values[len(special) : len(special) + 1000] = ties.view(torch.float32)
    return values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_cast_is_bit_identical_to_tensor_to_across_its_chunks(dtype):
    source = awkward_floats(2 * 50_001).reshape(2, -1)  # past the chunks cast_into copies in
    expected = source.to(dtype)
    out = torch.empty(source.shape, dtype=dtype)
    cast_into(source, out)
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    back = cast(out, torch.float32)
    assert torch.equal(back.view(torch.int32), out.to(torch.float32).view(torch.int32))
    assert cast(source, torch.float32) is source


def test_cast_refuses_a_target_of_another_size():
    with pytest.raises(ValueError, match="cannot cast"):
        cast_into(torch.zeros(10), torch.empty(9, dtype=torch.bfloat16))


def test_scratch_reuses_its_memory_and_keeps_within_its_budget():
    scratch = Scratch(640)  # pieces are whole multiples of 64 bytes
    with scratch.take(600) as first:
        first.fill_(1)
        kept = first.data_ptr()
    with scratch.take(100) as second, scratch.take(64) as third:  # the same memory, not new
        assert second.data_ptr() == kept and len(second) == 100
        assert third.data_ptr() == kept + 128
    in_use, most = [0], [0]
    lock = threading.Lock()

    def use(nbytes: int) -> None:
        with scratch.take(nbytes) as memory:
            assert kept <= memory.data_ptr() <= kept + 640 - nbytes
            with lock:
                in_use[0] += nbytes
                most[0] = max(most[0], in_use[0])
            time.sleep(0.01)
            with lock:
                in_use[0] -= nbytes

    threads = [threading.Thread(target=use, args=(64 * n,)) for n in (3, 5, 2, 6, 1, 4) * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert 64 * 6 <= most[0] <= 640


def test_scratch_gives_a_tensor_larger_than_its_budget_an_arena_of_its_own():
    scratch = Scratch(64)
    with scratch.take(4):
        pass
    with scratch.take(1000) as big:
        assert len(big) == 1000
        kept = big.data_ptr()
    with scratch.take(8) as small, scratch.take(900) as other:  # the larger arena, from now on
        assert len(small) == 8 and other.data_ptr() == kept + 64


def refusing(code: int):
    """A stand-in for libc's fallocate that fails with ``code``."""

    def fallocate(fd, mode, offset, length):
        ctypes.set_errno(code)
        return -1

    return fallocate


@pytest.mark.parametrize("fallocate", ["the kernel's", "unsupported", "absent"])
def test_a_safetensors_file_is_sized_up_front_and_written_in_parts_in_any_order(
    tmp_path, monkeypatch, fallocate
):
    if fallocate == "unsupported":  # glibc's posix_fallocate would write zeros over the file instead
        monkeypatch.setattr(safetensors_file, "_fallocate", refusing(errno.EOPNOTSUPP))
    elif fallocate == "absent":
        monkeypatch.setattr(safetensors_file, "_fallocate", None)
    tensors = {"a": awkward_floats(2000)[-15:].reshape(3, 5), "b": torch.arange(7, dtype=torch.int64)}
    path = tmp_path / "model.safetensors"
    file = safetensors_file.SafetensorsFile(
        path, {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}, {"format": "pt"}
    )
    assert path.stat().st_size == file.size
    file.write("b", tensors["b"])
    file.write_part("a", 8, tensors["a"].reshape(-1)[8:])
    file.write_part("a", 0, tensors["a"].reshape(-1)[:8])
    file.close()
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tensors.items())


def test_a_safetensors_file_that_finds_no_room_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_file, "_fallocate", refusing(errno.ENOSPC))
    with pytest.raises(OSError) as caught:
        safetensors_file.SafetensorsFile(tmp_path / "x", {"a": ((4,), torch.float32)}, {})
    assert caught.value.errno == errno.ENOSPC
