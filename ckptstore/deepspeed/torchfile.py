"""``torch.save`` files written in two passes: the skeleton first, the tensor bytes after.

``torch.save`` needs every tensor in memory at once, and a ZeRO optimizer file holds the
whole model. Instead the writer pickles a skeleton whose tensors are untouched
``torch.empty`` placeholders (virtual memory only) with torch's ``skip_data``, which leaves
the byte ranges of storages as holes, and asks torch where each storage's bytes go. The
bytes are then written there with ``pwrite``, a parameter at a time, from several threads.
torch does not check zip CRCs of storage records (it writes none itself when
``compute_crc32`` is off), so the filled file loads like one ``torch.save`` wrote.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedError


def _tensors_in(obj: Any, seen: set[int] | None = None) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``obj``, depth first, in the order pickling meets them."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, list | tuple):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = list(vars(obj).values())
    else:
        return
    for child in children:
        yield from _tensors_in(child, seen)


def save_skeleton(obj: Any, path: Path) -> list[tuple[torch.UntypedStorage, int]]:
    """``torch.save(obj, path)`` without any tensor bytes (holes read back as zeros).

    Returns each distinct non-empty storage of ``obj`` with the file offset where its bytes
    belong. Raises RuntimeError if torch laid the file out in a way this cannot follow, and
    UnsupportedError on a torch too old to say where storages are.
    """
    with torch.serialization.skip_data():
        torch.save(obj, path)
    # A meta-device load reads only the pickle and reports each storage's byte offset.
    loaded = torch.load(path, map_location="meta", weights_only=False)
    ours, theirs = list(_tensors_in(obj)), list(_tensors_in(loaded))
    if len(ours) != len(theirs):
        raise RuntimeError(f"{path.name}: {len(ours)} tensors pickled, {len(theirs)} read back")
    offsets: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for mine, meta in zip(ours, theirs, strict=True):
        if mine.shape != meta.shape or mine.dtype != meta.dtype:
            raise RuntimeError(f"{path.name}: tensor {tuple(mine.shape)} {mine.dtype} read back differently")
        storage = mine.untyped_storage()
        if storage.nbytes() == 0:
            continue
        offset = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
        if offset is None:
            raise UnsupportedError(f"materialize needs torch >= 2.6 (this is torch {torch.__version__})")
        if offsets.setdefault(storage.data_ptr(), (storage, offset))[1] != offset:
            raise RuntimeError(f"{path.name}: one storage was given two offsets")
    return list(offsets.values())


def storage_bytes(storage: torch.UntypedStorage) -> np.ndarray:
    """The bytes of a CPU storage as a uint8 array (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).numpy()


def pwrite_all(fd: int, data: np.ndarray | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
