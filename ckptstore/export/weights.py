"""The model weights of a step: which stored tensor each state-dict entry is read from.

A trainable parameter's weight is its fp32 master (what ``zero_to_fp32`` consolidates); a
frozen one is its stored module weight; a persistent buffer is stored as is. Tied parameters
(``aliases``) are one stored tensor under several names. A padded vocabulary (Megatron's, whose
``universal_checkpoint_info`` gives its ``original_vocab_size``) is read without its padding.
Only these tensors are read, never optimizer state, so a weights-only step exports like a
full one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import knobs, tensorsplit
from ..catalog import Catalog
from ..deepspeed.universal_info import ORIGINAL_VOCAB
from ..errors import BadInputError, CorruptError
from ..format.cast import cast
from ..format.codec import DTYPES
from ..materialize import compose
from ..materialize.directory import step_reader
from ..model import BUFFER, FP32, WEIGHT, Weight
from ..objects import ObjectStore

_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}  # fmt: skip


# A vocabulary parameter's rows that are no padding (DeepSpeed's original_vocab_size, from the
# universal_checkpoint_info of a Megatron-style model, kept on the parameter's entry by
# ``parallel.mark_vocabulary``); the step stores the padded rows.
VOCAB_ROWS = ORIGINAL_VOCAB


def exported_shape(info: dict) -> tuple[int, ...]:
    """The shape a parameter (its description entry) is exported at: its logical shape, a
    vocabulary's rows cut to ``original_vocab_size`` as ``ds_to_universal`` cuts them (an
    averaged parameter's: one copy's, ``tensorsplit.logical_shape``)."""
    shape = tensorsplit.logical_shape(info)
    if VOCAB_ROWS in info:
        shape[0] = info[VOCAB_ROWS]
    return tuple(shape)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``dtype`` as a floating torch dtype (names: float32/fp32, bfloat16/bf16, float16/fp16).

    None stays None (the training dtype). Raises BadInputError for anything else.
    """
    if dtype is None or dtype in _DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    raise BadInputError(f"dtype {dtype!r} is not one of float32, bfloat16, float16")


class StepWeights:
    """The weights of one committed step (or compose plan), read from the store on demand.

    ``entries`` lists them in the module's state-dict order, without tied duplicates;
    ``aliases`` maps each tied name to the entry it shares (``lm_head.weight`` ->
    ``transformer.wte.weight``). ``training_dtype`` is the dtype the module trained in.
    Raises NotFoundError for an unknown step, BadInputError for a bad spec.
    """

    def __init__(
        self, objects: ObjectStore, catalog: Catalog, step: int | None, spec: compose.Spec | None = None
    ) -> None:
        self.step, sources = compose.step_or_spec(step, spec, catalog, "export")
        description = json.loads(catalog.description(self.step))
        self._params = params = description["params"]
        self.aliases: dict[str, str] = dict(description.get("aliases", {}))
        self.entries: list[Weight] = []
        for key, what in description["module_keys"]:
            if what == "alias":
                continue
            if what == BUFFER:
                self.entries.append(Weight(key, BUFFER, None))
            else:
                kind = FP32 if params[key]["trainable"] else WEIGHT
                self.entries.append(Weight(key, kind, exported_shape(params[key])))
        trainable = [p for p in params.values() if p["trainable"]] or list(params.values())
        self.training_dtype = DTYPES[trainable[0]["dtype"]] if trainable else torch.float32
        only = {(w.name, w.kind) for w in self.entries}
        self._reader = step_reader(
            objects, catalog, self.step, description, sources, only=only, readahead=True
        )

    def read(self, weight: Weight, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor of ``weight``, floating point cast to ``dtype`` (default: as stored, fp32
        for masters). Raises NotFoundError / CorruptError naming the object and the step."""
        tensor = self._reader(weight.name, weight.kind)
        if tensor is None:
            raise CorruptError(f"step {self.step} has no stored {weight.kind} tensor for {weight.name}")
        if weight.name in self._params:  # a tensor-parallel one is stored a slice after another
            tensor = tensorsplit.to_logical(tensor, self._params[weight.name])
            if VOCAB_ROWS in self._params[weight.name]:  # the vocabulary's padding left out
                tensor = tensor[: self._params[weight.name][VOCAB_ROWS]]
        if dtype is not None and tensor.is_floating_point():
            tensor = cast(tensor, dtype)
        return tensor

    def stored_dtype(self, weight: Weight) -> torch.dtype | None:
        """The dtype ``weight`` is stored in when ``read_pieces`` can decode it (it is stored in
        packs in the weight's own order), else None (``read`` it)."""
        info = self._params.get(weight.name)
        if info is not None and (not tensorsplit.in_logical_order(info) or VOCAB_ROWS in info):
            return None
        if self._reader.pieces(weight.name, weight.kind) is None:
            return None
        return self._reader.dtype(weight.name, weight.kind)

    def read_pieces(self, weight: Weight, dtype: torch.dtype) -> Iterator[tuple[int, torch.Tensor]]:
        """``weight`` a piece at a time, as ``(first element, 1-D tensor)`` of ``dtype`` (its
        stored dtype or, cast as ``Tensor.to`` casts, another floating one) in memory reused
        for the next piece (see ``codec.decode_pieces``): only for a weight stored in packs
        (``stored_dtype`` is not None). Every fragment is verified once its last piece is out:
        nothing is to be trusted until the iteration ends. Raises NotFoundError / CorruptError
        as ``read`` does, CorruptError also when its fragments do not tile it."""
        pieces = self._reader.pieces(weight.name, weight.kind)
        if pieces is None:
            raise CorruptError(f"step {self.step}: {weight.name} {weight.kind} is not stored in packs")
        covered = 0
        for start, numel in sorted(pieces):
            if start != covered:
                raise CorruptError(f"step {self.step}: fragments of {weight.name} {weight.kind} "
                                   f"do not tile it (gap or overlap at element {covered})")  # fmt: skip
            covered += numel
        if covered != math.prod(weight.shape):
            raise CorruptError(
                f"step {self.step}: fragments of {weight.name} {weight.kind} hold {covered} elements, "
                f"its shape {weight.shape}"
            )
        for start, numel in pieces:
            yield from self._reader.read_pieces(weight.name, weight.kind, start, numel, dtype)

    def read_all(self, entries: list[Weight], dtype: torch.dtype | None = None) -> Iterator[torch.Tensor]:
        """``read`` of each of ``entries``, in order, several read ahead on I/O threads."""
        with ThreadPoolExecutor(knobs.io_threads()) as pool:
            window = knobs.io_threads() * 2
            pending = [pool.submit(self.read, w, dtype) for w in entries[:window]]
            for i in range(len(entries)):
                tensor = pending[i].result()
                pending[i] = None  # forget it once handed out
                if i + window < len(entries):
                    pending.append(pool.submit(self.read, entries[i + window], dtype))
                yield tensor


def state_dict(
    objects: ObjectStore,
    catalog: Catalog,
    step: int | None,
    dtype: str | torch.dtype | None = torch.float32,
    spec: compose.Spec | None = None,
) -> dict[str, torch.Tensor]:
    """The consolidated weights of ``step`` in memory, as ``Store.state_dict`` documents."""
    weights = StepWeights(objects, catalog, step, spec)
    dtype = parse_dtype(dtype)
    out = dict(zip((w.name for w in weights.entries), weights.read_all(weights.entries, dtype), strict=True))
    for alias, owner in weights.aliases.items():
        out[alias] = out[owner]
    return out
