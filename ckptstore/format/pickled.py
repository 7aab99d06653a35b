"""Whether bytes a store hands out could run code in the loader that reads them.

A materialized directory goes to loaders that unpickle with ``weights_only=False``: DCP's
``FileSystemReader`` (every bytes item), accelerate's ``load_state``
(``custom_checkpoint_<i>.pkl``), ``torch.load`` and ``pickle.load`` in user code. Whoever can
write the store chooses those bytes, so they are judged here, by content (never by name) and
without running them, before they go out:

- A DCP bytes item is always read by ``torch.load``: ``torch_refusal`` loads it with
  ``weights_only=True`` to the meta device (no tensor bytes are allocated).
- A file of any name (``refusal``) is judged as each loader would read it. A zip archive that
  torch reads as a checkpoint (``PK\\x03\\x04`` with a ``data.pkl``; TorchScript's
  ``constants.pkl`` is always refused) must load with ``weights_only=True``; a legacy torch
  tar archive is refused, as ``weights_only=True`` refuses it. Anything else is walked as the
  pickle stream(s) ``pickle.load`` reads from its first byte, opcode by opcode without
  building anything; only a pickle that reaches an opcode that imports or calls something
  (``GLOBAL``/``INST`` of an importable name, ``STACK_GLOBAL``, ``EXT*``) is then loaded by
  torch's weights-only unpickler, which never calls what it does not allow. Text and binary
  files that are no such pickle go out as they are, and so does a pickle of plain data (dicts,
  lists, numbers, strings, of any protocol), which no unpickler can make run code.

"Allowed" is torch's ``weights_only`` allowlist plus numpy arrays of numbers (``_reconstruct``,
``ndarray``, ``dtype`` and its classes, ``_codecs.encode``): what the Trainer and accelerate
allow when they load their own RNG state files (``rng_state.pth``, ``random_states_0.pkl``).
The walk runs at the regex engine's speed and builds nothing; a pickle to be loaded holds
at most ``MAX_PICKLE_OPCODES`` opcodes, so what the weights-only unpickler builds stays near
100 MB, whatever the size of the file (``CKPTSTORE_MAX_FILE_BYTES``, a pack's size).
"""

from __future__ import annotations

import codecs
import io
import pickletools
import re
import tarfile
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import _weights_only_unpickler

from ..errors import clip

ZIP_MAGIC = b"PK\x03\x04"  # what torch.load takes for a zip archive (``_is_zipfile``)

# Opcode byte -> (name, argument length, or pickletools' negative code for a variable one).
_OPCODES = {ord(op.code): (op.name, op.arg.n if op.arg else 0) for op in pickletools.opcodes}
# Opcodes that reach code: an import by name, an import by names on the stack, the extension
# registry. Every call (REDUCE, BUILD, NEWOBJ, OBJ) needs a callable one of them put there;
# nothing else a pickle holds is more than builtin data.
_IMPORTS_BY_NAME = {"GLOBAL", "INST"}
_REACHES_CODE = {"STACK_GLOBAL", "EXT1", "EXT2", "EXT4"}
# A persistent id with no ``persistent_load`` to take it stops ``pickle.load`` (and the first
# pickle torch.load reads of a legacy file): nothing after it in that pickle is read.
_PERSISTENT_IDS = {"PERSID", "BINPERSID"}

# The most opcodes (counted as bytes, outside variable-length arguments) a pickle to be loaded
# may hold. The weights-only unpickler builds up to ~110 bytes per opcode (empty sets appended
# to a list: 113 MB at this limit, measured), so a crafted 256 MB file cannot make a check
# build gigabytes; a torch checkpoint's pickle counts ~70 per tensor (15,000 tensors).
MAX_PICKLE_OPCODES = 1 << 20

# torch's allowlist, as torch.serialization.safe_globals extends it, is process-wide: checks
# take turns, so one never ends another's extension early.
_ALLOWLIST_LOCK = threading.Lock()


def refusal(data: bytes) -> str | None:
    """Why ``data`` (a file of any name) may not go out, or None if it may: a pickle or torch
    archive that ``torch.load(weights_only=True)`` would refuse (see the module doc). Runs
    nothing from ``data``."""
    if data[:4] == ZIP_MAGIC:
        return _zip_refusal(data)
    return _tar_refusal(data) or _stream_refusal(data)


def torch_refusal(data: bytes) -> str | None:
    """Why ``data``, which ``torch.load`` will read (a DCP bytes item), may not go out, or None:
    it must load with ``weights_only=True``."""
    if data[:4] == ZIP_MAGIC:
        pickle_bytes = _record(data, "data.pkl")
        opcodes = _walk(pickle_bytes, 0, first=False).opcodes if pickle_bytes else 0
    else:  # a legacy torch file: five pickles, then raw storage bytes
        opcodes = sum(walked.opcodes for walked in _pickles(data)[:5])
    return _too_many(opcodes) or _load_refusal(data)


def _load_refusal(data: bytes, start: int | None = None) -> str | None:
    """Why ``torch.load(weights_only=True)`` of ``data`` to the meta device (or, from ``start``,
    its weights-only unpickler on one pickle) fails, with the allowlist above, or None."""
    source = io.BytesIO(data)
    with _ALLOWLIST_LOCK, torch.serialization.safe_globals(_numpy_arrays()):
        try:
            if start is None:
                torch.load(source, weights_only=True, map_location="meta")
            else:
                source.seek(start)
                _weights_only_unpickler.load(source, encoding="utf-8")
        except Exception as exc:  # noqa: BLE001 - any refusal of the restricted loader is a refusal here
            return _reason(exc)
    return None


def _numpy_arrays() -> list:
    """numpy's array and dtype reconstructors: arrays of numbers, as the Trainer and accelerate allow."""
    core = np._core if hasattr(np, "_core") else np.core
    dtypes = [getattr(np.dtypes, name) for name in getattr(np.dtypes, "__all__", [])]
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, codecs.encode, *dtypes]


def _reason(exc: Exception) -> str:
    """What was refused (torch prefixes advice on how to load anyway)."""
    text = str(exc)
    marker = "WeightsUnpickler error: "
    if marker in text:
        text = text.split(marker, 1)[1]
    text = text.split(". ")[0].split("\n")[0].strip() or type(exc).__name__
    if text.startswith("Unsupported operand "):
        code = int(text.rsplit(" ", 1)[1]) if text.rsplit(" ", 1)[1].isdigit() else -1
        text = f"the opcode {_OPCODES.get(code, (code,))[0]}, which the weights-only unpickler does not take"
    return clip(text, 160)


def _too_many(opcodes: int) -> str | None:
    if opcodes <= MAX_PICKLE_OPCODES:
        return None
    return f"a pickle of {opcodes} opcodes, more than the {MAX_PICKLE_OPCODES} a check builds objects for"


def _record(data: bytes, name: str) -> bytes:
    """Record ``name`` of the torch zip archive ``data``; empty if there is none."""
    try:
        return bytes(torch._C.PyTorchFileReader(io.BytesIO(data)).get_record(name))
    except Exception:  # noqa: BLE001 - no such record, or not an archive torch can open
        return b""


def _zip_refusal(data: bytes) -> str | None:
    """A zip torch.load reads: its ``data.pkl`` must load weights-only; a TorchScript archive is
    refused (torch.load hands it to torch.jit.load). One torch cannot read as a checkpoint
    makes torch.load fail before it unpickles anything, and ``pickle.load`` stops at its
    first byte (a persistent id)."""
    try:
        records = set(torch._C.PyTorchFileReader(io.BytesIO(data)).get_all_records())
    except Exception:  # noqa: BLE001 - not an archive torch can open
        return None
    if "constants.pkl" in records:
        return "a TorchScript archive, which torch.load would run through torch.jit.load"
    if "data.pkl" not in records:
        return None
    return torch_refusal(data)


def _tar_refusal(data: bytes) -> str | None:
    """torch.load of a file tries the legacy tar format first, and unpickles its ``storages``
    member with the unpickler it was given; ``weights_only=True`` refuses that format."""
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            names = tar.getnames()
    except Exception:  # noqa: BLE001 - not a tar archive
        return None
    if "storages" in names:
        return "a legacy torch tar archive, which torch.load(weights_only=True) refuses"
    return None


def _stream_refusal(data: bytes) -> str | None:
    """The pickles read one after another from the first byte (``pickle.load`` reads the
    first, torch.load of a legacy file five): None unless one reaches code and the
    weights-only unpickler refuses it. A legacy torch file is judged whole, by torch.load."""
    pickles = _pickles(data)
    reaching = [i for i, walked in enumerate(pickles) if walked.reaches_code]
    if not reaching:
        return None
    read = pickles[: reaching[-1] + 1]
    too_many = _too_many(sum(walked.opcodes for walked in read))
    if too_many or _load_refusal(data) is None:
        return too_many  # or torch.load read it (a legacy torch file) weights-only
    for walked in read:
        reason = _load_refusal(data, walked.start) if walked.reaches_code else None
        if reason:
            return reason
    return None


@dataclass(frozen=True)
class _Walked:
    """One pickle as ``_walk`` found it."""

    start: int
    end: int | None  # the offset after its STOP; None where the stream breaks off
    reaches_code: bool
    opcodes: int


def _pickles(data: bytes) -> list[_Walked]:
    """The pickles of ``data`` one after another from its first byte, as far as they go."""
    found: list[_Walked] = []
    start = 0
    while start < len(data):
        found.append(_walk(data, start, first=not found))
        if found[-1].end is None:
            break
        start = found[-1].end
    return found


def _walk(data: bytes, start: int, first: bool) -> _Walked:
    """Walk the pickle at ``start`` as the unpickler would parse it, building nothing.

    Where an argument's content is malformed the unpickler would stop, but the walk goes on:
    it may read further than any unpickler would, never less far."""
    pos, end, reaches_code, opcodes = start, len(data), False, 0
    while pos < end:
        run = _PLAIN_RUN.match(data, pos).end()  # plain data opcodes, at C speed
        pos, opcodes = run, opcodes + run - pos  # counted as their bytes: at least one each
        if pos >= end:
            break
        name, size = _OPCODES.get(data[pos], (None, 0))
        pos, opcodes = pos + 1, opcodes + 1
        if name is None:
            break
        if name in _IMPORTS_BY_NAME:
            module_end = data.find(b"\n", pos)
            name_end = data.find(b"\n", module_end + 1) if module_end >= 0 else -1
            # Unless the module is a dotted identifier, the import fails (a Python source file
            # may start so: "import torch" reads as INST of module "mport torch").
            if name_end < 0 or not _importable(data[pos:module_end]):
                break
            reaches_code, pos = True, name_end + 1
            continue
        if name == "STOP":
            return _Walked(start, pos, reaches_code, opcodes)
        if first and name in _PERSISTENT_IDS:
            break
        reaches_code = reaches_code or name in _REACHES_CODE
        pos = _skip_argument(data, pos, size)
        if pos is None or pos > end:
            break
    return _Walked(start, None, reaches_code, opcodes)


def _skip_argument(data: bytes, pos: int, size: int) -> int | None:
    """The offset after the argument at ``pos`` of ``size`` (pickletools' code for a variable
    one), or None if it cannot be read."""
    if size >= 0:
        return pos + size
    if size == pickletools.UP_TO_NEWLINE:
        newline = data.find(b"\n", pos)
        return None if newline < 0 else newline + 1
    width = _LENGTH_WIDTHS[size]
    length = int.from_bytes(
        data[pos : pos + width], "little", signed=size == pickletools.TAKEN_FROM_ARGUMENT4
    )
    return None if length < 0 else pos + width + length


_LENGTH_WIDTHS = {
    pickletools.TAKEN_FROM_ARGUMENT1: 1,
    pickletools.TAKEN_FROM_ARGUMENT4: 4,
    pickletools.TAKEN_FROM_ARGUMENT4U: 4,
    pickletools.TAKEN_FROM_ARGUMENT8U: 8,
}


def _plain_run() -> re.Pattern:
    """A run of opcodes with no argument or one of fixed length that neither reach code nor end
    a pickle: most of a pickle, walked by the regex engine (possessive: no backtracking state)."""
    by_length: dict[int, list[bytes]] = {}
    special = _IMPORTS_BY_NAME | _REACHES_CODE | _PERSISTENT_IDS | {"STOP"}
    for code, (name, size) in _OPCODES.items():
        if size >= 0 and name not in special:
            by_length.setdefault(size, []).append(re.escape(bytes([code])))
    one = b"|".join(
        b"[%s]%s" % (b"".join(codes), b".{%d}" % size if size else b"")
        for size, codes in sorted(by_length.items())
    )
    return re.compile(b"(?:%s)*+" % one, re.DOTALL)


_PLAIN_RUN = _plain_run()


def _importable(module: bytes) -> bool:
    try:
        text = module.decode("utf-8")
    except UnicodeDecodeError:
        return False  # the unpickler decodes the name as UTF-8 before importing
    return all(part.isidentifier() for part in text.split("."))
