"""Non-tensor checkpoint state as plain JSON, so reading a store never unpickles anything.

DeepSpeed's state dicts mix ints, floats, tuples, dicts with int keys, small tensors (a step
counter), ``torch.Size`` and a few DeepSpeed objects (loss scalers, ``ZeroStageEnum``).
``to_plain`` turns such a value into JSON-compatible data with tagged objects for what JSON
lacks; ``from_plain`` rebuilds it, instantiating only the classes on an explicit allowlist.
Floats keep their exact value (JSON numbers via ``repr``), so hyperparameters round-trip bitwise.
"""

from __future__ import annotations

import base64
import enum
import importlib
import json
import math
from typing import Any

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


def to_plain(value: Any, where: str = "state") -> Any:
    """Encode ``value`` as JSON-compatible data; raises UnsupportedError naming the path of an unknown type."""
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
        nbytes = data.numel() * data.element_size()
        if nbytes > MAX_INLINE_TENSOR_BYTES:
            raise UnsupportedError(
                f"{where} holds a {nbytes}-byte tensor; only small tensors may live in non-tensor state"
            )
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"__tensor__": {"dtype": dtype_name(data.dtype), "shape": list(data.shape),
                               "data": base64.b64encode(raw).decode("ascii")}}  # fmt: skip
    if isinstance(value, torch.dtype):
        return {"__dtype__": dtype_name(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: to_plain(v, f"{where}.{k}") for k, v in value.items()}
        return {"__items__": [[to_plain(k, where), to_plain(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    name = _qualname(value)
    if name in ALLOWED_OBJECTS:
        return {"__object__": name, "attrs": to_plain(dict(vars(value)), where)}
    raise UnsupportedError(f"{where} holds a {name}, which ckptstore cannot store as plain data")


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
        if "__dtype__" in data:
            return DTYPES[data["__dtype__"]]
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
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CorruptError(f"malformed stored state: {clip(repr(exc))}") from None
    return {k: from_plain(v) for k, v in data.items()}


def dumps(value: Any) -> str:
    """Canonical JSON text of ``to_plain(value)``: the same value always gives the same text."""
    return json.dumps(to_plain(value), sort_keys=True, separators=(",", ":"), allow_nan=False)


def loads(text: str) -> Any:
    """Inverse of ``dumps``; raises CorruptError on malformed text."""
    try:
        return from_plain(json.loads(text))
    except (json.JSONDecodeError, RecursionError) as exc:  # a nesting deeper than Python's stack
        raise CorruptError(f"stored state is not valid JSON: {clip(str(exc))}") from None
