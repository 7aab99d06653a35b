"""The figures of one commit as scalars for a training run's own logger (TensorBoard, W&B...).

The Trainer callback and the Lightning strategy send these beside the loss, named alike:
``ckptstore/bytes_stored`` (bytes the commit added to the store, after dedup and compression),
``ckptstore/layers_saved`` (layers it stored rather than inherited), ``ckptstore/stall_seconds``
(the seconds the training loop waited for the save) and ``ckptstore/step`` (the committed
step: a non-blocking commit's figures arrive at a later training step).
"""

from __future__ import annotations

PREFIX = "ckptstore/"


def scalars(step: int, bytes_stored: int, layers_saved: int, stall_seconds: float) -> dict[str, float]:
    """One commit's figures, named for a run's logger."""
    return {
        f"{PREFIX}step": step,
        f"{PREFIX}bytes_stored": bytes_stored,
        f"{PREFIX}layers_saved": layers_saved,
        f"{PREFIX}stall_seconds": round(stall_seconds, 6),
    }
