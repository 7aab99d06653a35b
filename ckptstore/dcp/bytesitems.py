"""DCP bytes items in and out of a store: kept as plain data, handed out as ckptstore's own bytes.

DCP's planner ``torch.save``s every non-tensor value of a state dict into a bytes item, and its
``FileSystemReader`` (like DCP's load planner behind ``StoreReader``) ``torch.load``s it with
``weights_only=False``. So at save an item is kept as plain data (``format.plainfile``), and on
the way out (a materialized directory, ``dcp.load`` from the store) it is ``torch.save``d anew
from that data: never the bytes a store writer stored. An item kept as its bytes (one that is
no plain data, or a step saved before ckptstore kept items so) goes out only where the caller
trusts everyone who can write the store (``allow_pickle``).
"""

from __future__ import annotations

import logging

from .. import knobs
from ..errors import CorruptError
from ..format import plainfile

log = logging.getLogger("ckptstore")


def keep(raw: bytes, fqn: str) -> bytes:
    """What to store for the bytes item ``fqn`` whose bytes DCP's planner gave: plain data,
    or ``raw`` itself (with a warning: loads then need ``allow_pickle``)."""
    kept = plainfile.encode(raw, knobs.max_file_bytes())
    if not kept.plain:
        log.warning(
            "ckptstore: the DCP bytes item %s holds more than plain data; it is kept as it is and "
            "loads from the store only with allow_pickle (materialize --allow-pickle)",
            fqn,
        )
    return kept.stored


def problem(stored: bytes) -> str | None:
    """Why the stored bytes item ``stored`` goes out only with ``allow_pickle``, or None."""
    if plainfile.is_plain(stored):
        return None
    return "is kept as the bytes a job gave DCP, not as plain data, and DCP's loader would unpickle them"


def give(stored: bytes, fqn: str, step: int, *, allow_pickle: bool) -> bytes:
    """The bytes DCP gets for the stored bytes item ``fqn`` of ``step``: ``torch.save`` of its
    plain data; its stored bytes only with ``allow_pickle``. CorruptError otherwise, or where
    the plain data is malformed."""
    if plainfile.is_plain(stored):
        return plainfile.decode(stored, f"step {step}'s DCP bytes item {fqn}")
    if allow_pickle:
        return stored
    raise CorruptError(
        f"step {step}'s DCP bytes item {fqn} {problem(stored)}: refused (if everyone who can write "
        "the store is trusted: materialize --allow-pickle, or StoreReader(..., allow_pickle=True))"
    )
