"""Pickle and torch files kept as plain data, so every such file that leaves a store is one
ckptstore serialized itself, never the bytes a store writer chose.

Loaders of a checkpoint directory unpickle with ``weights_only=False``: DCP's
``FileSystemReader`` (every bytes item), accelerate's ``load_state``
(``custom_checkpoint_<i>.pkl``), ``torch.load`` and ``pickle.load`` in user code. Filters that
judged a writer's pickle before letting it out were bypassed three times, each by a loader that
read the bytes differently from the filter. So nothing is filtered:

- At commit, on the training node, a pickle or torch file is read as ``torch.load(weights_only=True)``
  reads it (numpy arrays of numbers allowed, as the Trainer and accelerate allow for their RNG
  states) and kept as plain data (``plainstate``): ``encode`` gives the stored bytes, a header
  then canonical JSON. A file that does not read so is kept as the bytes it holds (opaque).
- On the way out, ``decode`` rebuilds the value from the JSON (only ``plainstate``'s allowlist
  is ever instantiated, nothing is unpickled) and serializes it anew: ``torch.save`` for a torch
  file, ``pickle.dumps`` for a pickle.
- Opaque bytes go out as they are only when no unpickler can start on them (``opaque_refusal``):
  every unpickler dispatches on the first byte, so one that is no pickle opcode stops it before
  it reads anything else; ``torch.load`` tries a zip and a tar archive first, and some loaders
  decompress first, so it may be none of those either. Anything else is left out unless the caller opts in (``--allow-pickle``).

Reading a store never unpickles its bytes, and every decode here is bounded by the stored size:
JSON of ``n`` bytes builds a few times ``n``, an inline tensor's shape must match its bytes.
"""

from __future__ import annotations

import codecs
import collections
import io
import json
import pickle
import pickletools
import tarfile
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import CorruptError, UnsupportedError, clip
from . import plainstate

# The stored form of a file kept as plain data: this line, then canonical JSON of
# {"kind": "torch" | "pickle", "protocol": n, "value": plainstate}.
HEADER = b"ckptstore plain file 1\n"
KINDS = ("torch", "pickle")
ZIP_MAGIC = b"PK\x03\x04"  # what torch.load takes for a zip archive (``_is_zipfile``)
PICKLE_OPCODES = frozenset(ord(op.code) for op in pickletools.opcodes)
# Compressed streams (gzip, zstd, bzip2, xz, lz4): a loader that decompresses before it
# unpickles (joblib, pandas) would start on what they hold.
COMPRESSED_MAGIC = (b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"BZh", b"\xfd7zXZ\x00", b"\x04\x22\x4d\x18")
PROTO = 0x80  # the opcode that opens a pickle of protocol 2 or later, its number next

# torch's allowlist, as torch.serialization.safe_globals extends it, is process-wide: reads
# take turns, so one never ends another's extension early.
_ALLOWLIST_LOCK = threading.Lock()


@dataclass(frozen=True)
class Kept:
    """What ``encode`` made of a file's bytes: ``stored`` goes into the store; ``plain`` says
    whether it is plain data (else the bytes as they were)."""

    stored: bytes
    plain: bool


def encode(data: bytes, limit: int) -> Kept:
    """The bytes to store for a file holding ``data`` (at most ``limit`` bytes, the caller's
    bound): plain data if it is a pickle or torch file that ``torch.load(weights_only=True)``
    reads (tensors and arrays inline, up to ``limit`` bytes in all), else ``data`` itself.

    Runs on the training node, on the user's own file: the weights-only unpickler never calls
    what it does not allow, so even a crafted file runs nothing here."""
    loaded = _weights_only_value(data)
    if loaded is None:
        return Kept(data, plain=False)
    kind, protocol, value = loaded
    try:
        plain = plainstate.to_plain(value, "file", inline_limit=limit)
    except (UnsupportedError, KeyError, TypeError, ValueError, RuntimeError):
        return Kept(data, plain=False)  # an object plain data cannot hold: kept as it was
    text = json.dumps({"kind": kind, "protocol": protocol, "value": plain}, sort_keys=True,
                      separators=(",", ":"), allow_nan=False)  # fmt: skip
    stored = HEADER + text.encode("utf-8")
    if len(stored) > max(limit, 2 * len(data)):
        return Kept(data, plain=False)  # what base64 and JSON add would pass the caller's bound
    return Kept(stored, plain=True)


def is_plain(stored: bytes) -> bool:
    """Whether ``stored`` is a file kept as plain data (``encode``)."""
    return stored.startswith(HEADER)


def decode(stored: bytes, what: str) -> bytes:
    """The file ckptstore writes out for ``stored`` (``is_plain``): the value rebuilt from its
    JSON and serialized anew. CorruptError naming ``what`` if it is malformed. Unpickles
    nothing; builds a small multiple of ``len(stored)``."""
    try:
        document = json.loads(stored[len(HEADER) :])
        kind, protocol = document["kind"], document["protocol"]
        if kind not in KINDS or type(protocol) is not int or not 0 <= protocol <= pickle.HIGHEST_PROTOCOL:
            raise ValueError(f"kind {clip(repr(kind), 40)}, protocol {clip(repr(protocol), 40)}")
        value = plainstate.from_plain(document["value"])
    except CorruptError as exc:
        raise CorruptError(f"{what} is corrupt: {exc}") from None
    except (ValueError, KeyError, TypeError, RecursionError, UnicodeDecodeError) as exc:
        raise CorruptError(
            f"{what} is corrupt: it is not the plain data ckptstore keeps ({clip(str(exc))})"
        ) from None
    if kind == "pickle":
        return pickle.dumps(value, protocol=protocol)
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def opaque_refusal(data: bytes) -> str | None:
    """Why opaque bytes may not go out as they are, or None: what no unpickler can start on.

    Every unpickler dispatches on the first byte; ``torch.load`` first takes a file for a zip
    (its first four bytes) or, in the legacy path, tries it as a tar archive; some loaders
    decompress first."""
    if data[:4] == ZIP_MAGIC:
        return "is a zip archive, which torch.load would unpickle"
    if data.startswith(COMPRESSED_MAGIC):
        return "is compressed, and a loader that decompresses could unpickle what it holds"
    if data and data[0] in PICKLE_OPCODES:
        return f"could be read as a pickle (its first byte, {data[:1]!r}, is a pickle opcode)"
    if _is_tar(data):
        return "is a tar archive, which torch.load would unpickle"
    return None


def _is_tar(data: bytes) -> bool:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:"):
            return True
    except Exception:  # noqa: BLE001 - whatever tarfile refuses is not a tar archive
        return False


def _weights_only_value(data: bytes) -> tuple[str, int, Any] | None:
    """``(kind, protocol, value)`` of a pickle or torch file read weights-only, or None."""
    if not data or (data[:4] != ZIP_MAGIC and data[0] not in PICKLE_OPCODES):
        return None
    with _ALLOWLIST_LOCK, torch.serialization.safe_globals(_numpy_arrays()):
        try:
            return "torch", 2, torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception:  # noqa: BLE001 - not a torch file it reads: perhaps a bare pickle
            pass
        if data[:4] == ZIP_MAGIC:
            return None
        source = io.BytesIO(data)
        try:
            value = _PlainUnpickler(source).load()
        except Exception:  # noqa: BLE001 - any refusal of the restricted loader: kept opaque
            return None
        if source.tell() != len(data):
            return None  # more after the pickle (a legacy torch file, several pickles): kept opaque
    protocol = data[1] if data[0] == PROTO and len(data) > 1 else 0
    return "pickle", min(protocol, pickle.HIGHEST_PROTOCOL), value


class _PlainUnpickler(pickle.Unpickler):
    """``pickle.load`` of plain data, any protocol: builtin values, plus the few globals a
    pickle of sets, ordered dicts and numpy arrays of numbers names (the standard library's
    way of restricting globals); persistent ids are refused, as ``pickle.load`` refuses them."""

    def find_class(self, module: str, name: str) -> Any:
        found = _PLAIN_GLOBALS.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
        return found


def _plain_globals() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("__builtin__", "set"): set,  # protocols 0 and 1 use Python 2's names
        ("__builtin__", "frozenset"): frozenset,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("_codecs", "encode"): codecs.encode,  # how protocol 2 pickles bytes
    }
    for found in _numpy_arrays():
        allowed[(found.__module__, found.__name__)] = found
        if found.__module__.startswith("numpy._core"):  # pickles of numpy 1 name numpy.core
            allowed[(found.__module__.replace("numpy._core", "numpy.core"), found.__name__)] = found
    return allowed


def _numpy_arrays() -> list:
    """numpy's array and dtype reconstructors: arrays of numbers, as the Trainer and accelerate allow."""
    core = np._core if hasattr(np, "_core") else np.core
    dtypes = [getattr(np.dtypes, name) for name in getattr(np.dtypes, "__all__", [])]
    return [
        core.multiarray._reconstruct,
        core.multiarray.scalar,
        np.ndarray,
        np.dtype,
        codecs.encode,
        *dtypes,
    ]


_PLAIN_GLOBALS = _plain_globals()
