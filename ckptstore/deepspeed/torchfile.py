"""``torch.save`` files written in two passes: the skeleton first, the tensor bytes after.

``torch.save`` needs every tensor in memory at once, and a ZeRO optimizer file holds the
whole model. Instead the writer pickles a skeleton whose tensors are untouched
``torch.empty`` placeholders (virtual memory only) with torch's ``skip_data``, which leaves
the byte ranges of storages as holes, and asks the archive where each storage's bytes go. The
bytes are then written there with ``pwrite``, a parameter at a time, from several threads.
torch does not check zip CRCs of storage records (it writes none itself when
``compute_crc32`` is off), so the filled file loads like one ``torch.save`` wrote.
"""

from __future__ import annotations

import os
import pickle
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CorruptError
from ..format import plainstate


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
    belong: the key torch's pickler gives each storage, recorded as it pickles, and the offset
    of that key's record in the archive. Nothing is unpickled, not even the file just written.
    Raises RuntimeError if torch laid the file out in a way this cannot follow.
    """
    keys: dict[str, torch.UntypedStorage] = {}
    with torch.serialization.skip_data():
        torch.save(obj, path, pickle_module=_recording_pickle(keys))
    reader = torch._C.PyTorchFileReader(str(path))
    offsets: dict[int, tuple[torch.UntypedStorage, int]] = {}
    for key, storage in keys.items():
        if storage.nbytes() == 0:
            continue
        offset = reader.get_record_offset(f"data/{key}")
        if offsets.setdefault(storage.data_ptr(), (storage, offset))[1] != offset:
            raise RuntimeError(f"{path.name}: one storage was given two offsets")
    return list(offsets.values())


def _recording_pickle(keys: dict[str, torch.UntypedStorage]) -> types.ModuleType:
    """A ``pickle_module`` for ``torch.save`` whose pickler notes, in ``keys``, the storage
    behind each persistent id torch gives (``("storage", type, key, location, numel)``)."""

    class Recording(pickle.Pickler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            given = type(self).persistent_id  # torch's own subclass, around this one

            def recorded(value: Any) -> Any:
                found = given(self, value)
                if isinstance(found, tuple) and found[:1] == ("storage",):
                    untyped = (
                        value._untyped_storage if isinstance(value, torch.storage.TypedStorage) else value
                    )
                    keys.setdefault(found[2], untyped)
                return found

            self.persistent_id = recorded  # looked up when the pickler is made: set it first
            super().__init__(*args, **kwargs)

    module = types.ModuleType("ckptstore_recording_pickle")
    module.Pickler = Recording
    return module


def storage_bytes(storage: torch.UntypedStorage) -> np.ndarray:
    """The bytes of a CPU storage as a uint8 array (no copy)."""
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),)).numpy()


def pwrite_all(fd: int, data: np.ndarray | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd`` (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
