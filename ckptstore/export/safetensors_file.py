"""A safetensors file written one tensor at a time, in any order, from several threads.

safetensors' ``save_file`` needs the whole shard in memory; an exported model would then cost
a shard of RAM. The format is simple and fixed (an 8-byte little-endian header length, a JSON
header of every tensor's dtype, shape and byte range, then the bytes), so the header is
written first from the shapes alone and each tensor's bytes land at their offset when read.
The library reads the result (the tests load every file with ``safetensors.safe_open``).
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import struct
import threading
from pathlib import Path

import torch

from ..deepspeed.torchfile import pwrite_all
from ..errors import UnsupportedError
from ..format.codec import raw_bytes

DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


def _libc_fallocate():
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError, TypeError):  # not Linux
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return function


_fallocate = _libc_fallocate()


def _reserve(fd: int, size: int) -> None:
    """Make the empty file ``fd`` ``size`` bytes long, its disk blocks allocated up front
    (fallocate) where the file system can: ext4 then skips its delayed allocation at every
    page written, a third of the writes' CPU (162 MB in 1 MB pwrites: 20 ms instead of 30 on
    the bench box). Elsewhere the file is only sized, never filled with zeros as glibc's
    ``posix_fallocate`` does where the file system cannot. OSError as a write would raise it."""
    if _fallocate is not None and size:
        if _fallocate(fd, 0, 0, size) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code))
    os.ftruncate(fd, size)


def tensor_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes a tensor of ``shape`` and ``dtype`` takes in the file."""
    return math.prod(shape) * dtype.itemsize


class SafetensorsFile:
    """An open safetensors file whose header lists ``tensors`` (name -> (shape, dtype)) in that order.

    ``write`` each of them once (any thread, any order), then ``close``. ``metadata`` goes
    under ``__metadata__`` (transformers writes ``{"format": "pt"}``).
    """

    def __init__(
        self, path: Path, tensors: dict[str, tuple[tuple[int, ...], torch.dtype]], metadata: dict[str, str]
    ) -> None:
        header: dict = {"__metadata__": metadata}
        self._slots: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
        position = 0
        for name, (shape, dtype) in tensors.items():
            if dtype not in DTYPE_CODES:
                raise UnsupportedError(f"{name}: dtype {dtype} cannot be written to safetensors here")
            size = tensor_bytes(shape, dtype)
            header[name] = {
                "dtype": DTYPE_CODES[dtype],
                "shape": list(shape),
                "data_offsets": [position, position + size],
            }
            self._slots[name] = (position, tuple(shape), dtype)
            position += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the tensor bytes start 8-byte aligned, as the library writes them
        self._base = 8 + len(text)
        self.size = self._base + position
        self._writing = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _reserve(self._fd, self.size)
            pwrite_all(self._fd, memoryview(struct.pack("<Q", len(text)) + text), 0)
        except BaseException:
            self.close()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s bytes at ``name``'s place; its shape and dtype must be the header's."""
        _, shape, dtype = self._slots[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the header says {shape} {dtype}"
            )
        self.write_part(name, 0, tensor)

    def write_part(self, name: str, start: int, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s elements as elements ``start`` on of ``name`` (flattened, C order);
        its dtype must be the header's and it must end within ``name``."""
        offset, shape, dtype = self._slots[name]
        if tensor.dtype != dtype or start < 0 or start + tensor.numel() > math.prod(shape):
            raise ValueError(
                f"{name}: {tensor.numel()} x {tensor.dtype} from {start} do not fit {shape} {dtype}"
            )
        # One writer at a time: concurrent pwrites to one file contend for its inode lock, and
        # the kernel spins on it (rwsem_spin_on_owner was 4% of an export's profile).
        with self._writing:
            pwrite_all(self._fd, raw_bytes(tensor), self._base + offset + start * dtype.itemsize)

    def close(self) -> None:
        """Close the file (not fsynced: like materialize, and like ``save_pretrained``)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
