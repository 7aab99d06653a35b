"""ckptstore: content-addressed, deduplicated storage for DeepSpeed training checkpoints.

``store = ckptstore.open("runs/store")``, then ``store.commit(engine, step)`` and
``store.materialize(step, "out/")``; see README.md and docs/
"""

from .errors import (
    BadInputError,
    CkptStoreError,
    ConflictError,
    CorruptError,
    NotFoundError,
    StorageError,
    UnsupportedError,
    WeightsOnlyError,
)
from .model import StepRow
from .opening import open, rebuild_catalog
from .store import CommitReport, Store, VerifyReport

__all__ = [
    "open",
    "rebuild_catalog",
    "Store",
    "CommitReport",
    "VerifyReport",
    "StepRow",
    "CkptStoreError",
    "NotFoundError",
    "CorruptError",
    "ConflictError",
    "UnsupportedError",
    "BadInputError",
    "StorageError",
    "WeightsOnlyError",
]
__version__ = "0.1.0"
