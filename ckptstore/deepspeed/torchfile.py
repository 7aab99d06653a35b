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
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CorruptError, UnsupportedError
from ..format import plainstate


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


def _safe_classes() -> list:
    """The DeepSpeed classes a checkpoint file ckptstore writes may hold, besides what torch's
    weights-only unpickler allows anyway (tensors, containers, ``torch.Size``, dtypes)."""
    from deepspeed.utils.tensor_fragment import fragment_address

    names = sorted(plainstate.ALLOWED_OBJECTS | plainstate.ALLOWED_ENUMS)
    return [plainstate.resolve(name) for name in names] + [fragment_address]


def load(path: str | os.PathLike, map_location: Any = None) -> Any:
    """``torch.load`` of a DeepSpeed checkpoint file with ``weights_only=True``: it builds
    tensors, plain containers and the few DeepSpeed classes materialize writes, and runs no
    other code. Raises CorruptError naming the file for anything else in the pickle.

    DeepSpeed's own ``TorchCheckpointEngine.load`` passes ``weights_only=False`` (0.19), which
    runs whatever the file's pickle calls: a store writer's code, for files a store supplied.
    """
    with torch.serialization.safe_globals(_safe_classes()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CorruptError(f"{path} holds more than a checkpoint ckptstore writes: {exc}") from None


def save_skeleton(obj: Any, path: Path) -> list[tuple[torch.UntypedStorage, int]]:
    """``torch.save(obj, path)`` without any tensor bytes (holes read back as zeros).

    Returns each distinct non-empty storage of ``obj`` with the file offset where its bytes
    belong. Raises RuntimeError if torch laid the file out in a way this cannot follow, and
    UnsupportedError on a torch too old to say where storages are.
    """
    with torch.serialization.skip_data():
        torch.save(obj, path)
    # A meta-device load reads only the pickle and reports each storage's byte offset.
    loaded = load(path, map_location="meta")
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
