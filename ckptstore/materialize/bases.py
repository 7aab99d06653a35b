"""The bases of delta entries: a pack entry stored as a delta (``format.pack``) is decoded
against its base, the same tensor's previous version in another pack, which may itself be a
delta against an older one. Every base pack a step needs is listed in its layer indexes
(``LayerPacks.bases``), with its recorded size, so a base is read as any entry is: its pack's
index fetched once and verified against its key, then its own bytes, verified against its
content key as they are decoded.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from functools import partial

import numpy as np
import torch

from ..errors import CorruptError, NotFoundError
from ..format import codec, pack
from ..format.layout import pack_name
from ..model import PackRef
from ..objects import ObjectStore
from .fetch import fetch_pack_index

# No chain ckptstore writes is longer (``knobs.delta_chain`` is held below it); a longer one is
# a store that lies, read no further.
MAX_CHAIN = 64


class BaseMissing(NotFoundError):
    """A delta's base pack is missing: what is wrong is the base, not the delta's pack."""


class BaseCorrupt(CorruptError):
    """A delta's base fails its checks: what is wrong is the base, not the delta's pack."""


class DeltaBases:
    """Where the delta entries of a step's packs find their bases: ``of(entry)`` is what
    ``pack.decode_entry`` takes as ``base``, or what ``pack.decode`` takes as ``bases``.

    ``refs``: every base pack the step's layers list. Base pack indexes are fetched once and
    kept; a base's bytes are read when a delta needs them. Errors name the base pack.
    """

    def __init__(self, objects: ObjectStore, refs: Iterable[PackRef]) -> None:
        self._objects = objects
        self._refs = {ref.key: ref for ref in refs}
        self._indexes: dict[str, dict[tuple[str, str, int], pack.Entry]] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._refs)

    def add(self, refs: Iterable[PackRef]) -> None:
        """Know these base packs too (another layer's)."""
        self._refs.update((ref.key, ref) for ref in refs)

    def of(self, entry: pack.Entry, depth: int = 1) -> codec.Base | None:
        """The base of ``entry`` (None for an entry stored whole), read when called."""
        if entry.base is None:
            return None
        if depth > MAX_CHAIN:
            raise CorruptError(f"its chain of deltas is longer than {MAX_CHAIN}")
        return partial(self._raw, entry, depth)

    def _raw(self, entry: pack.Entry, depth: int, raw_size: int) -> np.ndarray:
        key = entry.base
        ref = self._refs.get(key)
        what = f"its base, {entry.name} {entry.kind} from element {entry.start} in pack {key}"
        if ref is None:
            raise BaseCorrupt(f"{what}, is no base its step lists")
        try:
            base = self._index(ref).get((entry.name, entry.kind, entry.start))
            if base is None:
                raise CorruptError("that pack has no such entry")
            data = self._objects.get_range(pack_name(key), base.offset, base.length)
            info = codec.parse_header(data)
            codec.check_raw_size(info, raw_size)
            out = torch.empty(
                info.raw_size // codec.DTYPES[info.dtype].itemsize, dtype=codec.DTYPES[info.dtype]
            )
            pack.decode_entry_into(data, base, out, self._objects.content_hash, self.of(base, depth + 1))
        except (BaseMissing, BaseCorrupt):
            raise  # a base of the base: named already
        except NotFoundError:
            raise BaseMissing(f"{what}, is missing") from None
        except CorruptError as exc:
            raise BaseCorrupt(f"{what}: {exc}") from None
        return out.view(torch.uint8).numpy()

    def _index(self, ref: PackRef) -> dict[tuple[str, str, int], pack.Entry]:
        with self._lock:
            found = self._indexes.get(ref.key)
        if found is None:
            found = fetch_pack_index(self._objects, ref)
            with self._lock:
                self._indexes[ref.key] = found
        return found
