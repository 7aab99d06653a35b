"""Non-tensor checkpoint state as plain JSON, so reading a store never unpickles anything.

DeepSpeed's state dicts mix ints, floats, tuples, dicts with int keys, small tensors (a step
counter), ``torch.Size`` and a few DeepSpeed objects (loss scalers, ``ZeroStageEnum``); the
files a Trainer or accelerate keeps beside them (``format.plainfile``) add numpy arrays of
numbers (RNG states), sets, bytes and devices. ``to_plain`` turns such a value into
JSON-compatible data with tagged objects for what JSON lacks; ``from_plain`` rebuilds it,
instantiating only the classes on an explicit allowlist. Floats keep their exact value (JSON
numbers via ``repr``), so hyperparameters round-trip bitwise.
"""

from __future__ import annotations

import base64
import binascii
import enum
import importlib
import json
import math
from typing import Any

import numpy as np
import torch

from ..errors import CorruptError, UnsupportedError, clip
from .codec import DTYPES, dtype_name

# Objects rebuilt from their attribute dict. Only these classes are ever instantiated on read.
ALLOWED_OBJECTS = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
}
ALLOWED_ENUMS = {"deepspeed.runtime.zero.config.ZeroStageEnum"}

# Inline tensors are for scalars and small client state; big tensors belong in blobs.
MAX_INLINE_TENSOR_BYTES = 1 << 20


def _qualname(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def resolve(qualname: str) -> type:
    """The class named ``qualname`` (module path and name); UnsupportedError if it cannot be imported."""
    module, _, name = qualname.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UnsupportedError(f"cannot rebuild {qualname}: {exc}") from None


def to_plain(value: Any, where: str = "state", inline_limit: int = MAX_INLINE_TENSOR_BYTES) -> Any:
    """Encode ``value`` as JSON-compatible data; raises UnsupportedError naming the path of an
    unknown type or of a tensor or array of more than ``inline_limit`` bytes."""
    if inline_limit != MAX_INLINE_TENSOR_BYTES:
        return _Encoder(inline_limit).plain(value, where)
    return _DEFAULT.plain(value, where)


class _Encoder:
    """``to_plain`` with one limit on the bytes of an inline tensor or array."""

    def __init__(self, inline_limit: int) -> None:
        self.inline_limit = inline_limit

    def _raw(self, raw: bytes, where: str) -> str:
        if len(raw) > self.inline_limit:
            raise UnsupportedError(
                f"{where} holds a {len(raw)}-byte tensor; only small tensors may live in non-tensor state"
            )
        return base64.b64encode(raw).decode("ascii")

    def plain(self, value: Any, where: str) -> Any:  # noqa: C901 - one branch per type, as from_plain
        to_plain = self.plain
        if isinstance(value, enum.Enum):  # before int: DeepSpeed's enums are IntEnums
            name = _qualname(value)
            if name not in ALLOWED_ENUMS:
                raise UnsupportedError(f"{where} holds a {name}, which ckptstore cannot store as plain data")
            return {"__enum__": name, "value": to_plain(value.value, where)}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, torch.Size):
            return {"__size__": list(value)}
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous()
            raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
            return {"__tensor__": {"dtype": dtype_name(data.dtype), "shape": list(data.shape),
                                   "data": self._raw(raw, where)}}  # fmt: skip
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value)
            if array.dtype.kind not in _NUMPY_KINDS or array.dtype.hasobject:
                raise UnsupportedError(f"{where} holds a numpy array of {array.dtype}, not of numbers")
            return {"__ndarray__": {"dtype": array.dtype.str, "shape": list(array.shape),
                                    "scalar": isinstance(value, np.generic),
                                    "data": self._raw(np.ascontiguousarray(array).tobytes(), where)}}  # fmt: skip
        if isinstance(value, torch.dtype):
            return {"__dtype__": dtype_name(value)}
        if isinstance(value, torch.device):
            return {"__device__": str(value)}
        if isinstance(value, (bytes, bytearray)):
            return {"__bytes__": self._raw(bytes(value), where)}
        if isinstance(value, (set, frozenset)):
            items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
            items.sort(key=lambda item: json.dumps(item, sort_keys=True))  # the same set, the same text
            return {"__set__": items, "frozen": isinstance(value, frozenset)}
        if isinstance(value, tuple):
            return {"__tuple__": [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: to_plain(v, f"{where}.{k}") for k, v in value.items()}
            return {
                "__items__": [[to_plain(k, where), to_plain(v, f"{where}[{k!r}]")] for k, v in value.items()]
            }
        name = _qualname(value)
        if name in ALLOWED_OBJECTS:
            return {"__object__": name, "attrs": to_plain(dict(vars(value)), where)}
        raise UnsupportedError(f"{where} holds a {name}, which ckptstore cannot store as plain data")


_DEFAULT = _Encoder(MAX_INLINE_TENSOR_BYTES)
# numpy arrays kept as plain data: booleans and numbers (an RNG state is uint32), never objects.
_NUMPY_KINDS = "biufc"


def from_plain(data: Any) -> Any:
    """Rebuild a value encoded by ``to_plain``; raises CorruptError on malformed data."""
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [from_plain(v) for v in data]
    if not isinstance(data, dict):
        raise CorruptError(f"unexpected {type(data).__name__} in stored state")
    try:
        if "__float__" in data:
            return float(data["__float__"])
        if "__size__" in data:
            return torch.Size(data["__size__"])
        if "__tensor__" in data:
            spec = data["__tensor__"]
            dtype = DTYPES[spec["dtype"]]
            shape = spec["shape"]
            raw = bytearray(base64.b64decode(spec["data"]))
            # The shape is the entry's own claim: it must be what its bytes hold, or a few
            # bytes could declare a tensor of gigabytes that a writer then fills and saves.
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise CorruptError(f"a stored tensor has a malformed shape {clip(repr(shape))}")
            if math.prod(shape) * dtype.itemsize != len(raw):
                raise CorruptError(
                    f"a stored tensor of shape {clip(repr(shape))} holds {len(raw)} bytes of {dtype}"
                )
            if not raw:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()
        if "__ndarray__" in data:
            return _array(data["__ndarray__"])
        if "__dtype__" in data:
            return DTYPES[data["__dtype__"]]
        if "__device__" in data:
            return torch.device(data["__device__"])
        if "__bytes__" in data:
            return base64.b64decode(data["__bytes__"], validate=True)
        if "__set__" in data:
            items = [from_plain(v) for v in data["__set__"]]
            return frozenset(items) if data.get("frozen") is True else set(items)
        if "__tuple__" in data:
            return tuple(from_plain(v) for v in data["__tuple__"])
        if "__items__" in data:
            return {from_plain(k): from_plain(v) for k, v in data["__items__"]}
        if "__enum__" in data:
            if data["__enum__"] not in ALLOWED_ENUMS:
                raise CorruptError(f"stored state names a class that is not allowed: {data['__enum__']}")
            return resolve(data["__enum__"])(from_plain(data["value"]))
        if "__object__" in data:
            if data["__object__"] not in ALLOWED_OBJECTS:
                raise CorruptError(f"stored state names a class that is not allowed: {data['__object__']}")
            cls = resolve(data["__object__"])
            obj = cls.__new__(cls)
            obj.__dict__.update(from_plain(data["attrs"]))
            return obj
    except (KeyError, TypeError, ValueError, RuntimeError, binascii.Error) as exc:
        raise CorruptError(f"malformed stored state: {clip(repr(exc))}") from None
    return {k: from_plain(v) for k, v in data.items()}


def _array(spec: Any) -> np.ndarray | np.generic:
    """A numpy array (or scalar) of numbers from its entry, its shape checked against its bytes."""
    dtype = np.dtype(spec["dtype"])
    if dtype.kind not in _NUMPY_KINDS or dtype.hasobject:
        raise CorruptError(f"a stored numpy array has the dtype {clip(repr(spec['dtype']))}, not numbers")
    shape, raw = spec["shape"], base64.b64decode(spec["data"], validate=True)
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise CorruptError(f"a stored numpy array has a malformed shape {clip(repr(shape))}")
    if math.prod(shape) * dtype.itemsize != len(raw):
        raise CorruptError(
            f"a stored numpy array of shape {clip(repr(shape))} holds {len(raw)} bytes of {dtype}"
        )
    array = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    return array[()] if spec.get("scalar") is True and not shape else array


def dumps(value: Any) -> str:
    """Canonical JSON text of ``to_plain(value)``: the same value always gives the same text."""
    return json.dumps(to_plain(value), sort_keys=True, separators=(",", ":"), allow_nan=False)


def loads(text: str) -> Any:
    """Inverse of ``dumps``; raises CorruptError on malformed text."""
    try:
        return from_plain(json.loads(text))
    except (json.JSONDecodeError, RecursionError) as exc:  # a nesting deeper than Python's stack
        raise CorruptError(f"stored state is not valid JSON: {clip(str(exc))}") from None
