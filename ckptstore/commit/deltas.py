"""Which pieces a commit stores as deltas, and against what: the versions this process last
committed.

A training step moves every tensor a little, so dedup finds nothing, but the XOR of a tensor's
bits with its previous version's is mostly zeros in the sign, exponent and high mantissa
bytes (``codec.XOR_PLANES``). ``Versions`` keeps, per piece (name, kind, start), the bytes it
had at this rank's last commit and where they are stored: its pack, how many deltas lie
between it and a whole entry (its depth), and the packs those deltas need (its chain). A
commit then plans each changed piece as a delta against that version when:

- the version has the piece's dtype and size, and the piece is on the host and floating;
- its depth is below ``knobs.delta_chain`` - 1, so a read decodes at most that many objects;
- deltas of it have paid. A delta above ``_WORTH`` of the piece's size when last stored
  whole is a miss: the next version is stored whole (which also sizes it afresh: the first
  commit's masters, still bf16 values, compress far better than trained ones), and after
  further misses in a row, more (Adam's first moment moves nearly every bit at every step).

A pack's key covers its entries' bases, so a pack written against other bases is another
pack; a layer that did not change at all plans exactly its previous pack and is only
freshened. The versions live in memory: a new process starts with whole pieces. Before a
base is used its pack and chain are freshened (``touch``) under the commit's shared gc lock:
a gc between two commits may have swept a base whose step it dropped, and then the piece is
stored whole.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from .. import knobs
from ..format import codec, devicecopy, pack
from ..format.layout import pack_name
from ..model import PackRef, Piece
from ..objects import ObjectStore

# A delta is worth its read only below this share of the piece's whole size.
_WORTH = 0.8
# Pieces smaller than this are stored whole: their delta saves less than its bookkeeping.
_MIN_BYTES = 4096

PieceId = tuple[str, str, int]  # name, kind, start


@dataclass
class Version:
    """A piece as this rank last committed it."""

    key: str  # content key
    raw: np.ndarray | None  # its bytes (None: not kept, no delta against it)
    pack: str  # the pack it is in
    depth: int  # deltas between it and a whole entry
    whole_share: float  # stored size over raw size when last stored whole
    itemsize: int  # bytes of one element: a delta's planes are its base's
    rest: int = 0  # versions still to store whole, after a delta that did not pay
    misses: int = 0  # deltas in a row that did not pay


@dataclass
class PackVersion:
    """A pack of the last commit: its record, what it holds, and every base it needs."""

    ref: PackRef
    contents: tuple[tuple, ...]
    chain: tuple[PackRef, ...]


class Versions:
    """The versions of one rank's pieces its last commit stored (see the module doc)."""

    def __init__(self) -> None:
        self.pieces: dict[PieceId, Version] = {}
        self.packs: dict[str, PackVersion] = {}
        self._lock = threading.Lock()

    def unchanged_pack(self, members: list[tuple[Piece, str]]) -> PackVersion | None:
        """The pack of the last commit that holds exactly these ``(piece, content key)``, if any."""
        first = self.pieces.get(_id(members[0][0]))
        found = None if first is None else self.packs.get(first.pack)
        if found is None or len(found.contents) != len(members):
            return None
        same = all(
            row[:4] == (p.name, p.kind, p.start, key)
            for row, (p, key) in zip(found.contents, members, strict=True)
        )
        return found if same else None

    def plan(self, piece: Piece, chain: int) -> Version | None:
        """The version to store ``piece`` as a delta against, or None: whole. ``chain``: the
        most objects a read may decode for it."""
        version = self.pieces.get(_id(piece))
        tensor = piece.tensor
        if (
            version is None
            or version.raw is None
            or version.rest
            or version.depth + 2 > chain
            or not tensor.is_floating_point()
            or not devicecopy.on_host(tensor)
            or version.raw.size != piece.nbytes
            or version.itemsize != tensor.element_size()
            or piece.nbytes < _MIN_BYTES
        ):
            return None
        return version

    def chain_of(self, bases: set[str]) -> tuple[PackRef, ...]:
        """Every pack deltas against the packs ``bases`` need: those and their own chains."""
        refs = {}
        for key in bases:
            found = self.packs[key]
            refs[key] = found.ref
            refs.update((ref.key, ref) for ref in found.chain)
        return tuple(refs[key] for key in sorted(refs))

    def freshen(self, objects: ObjectStore, bases: set[str], fresh: dict[str, bool]) -> set[str]:
        """Of the packs ``bases``, those whose chain is still stored (freshened, once per commit
        in ``fresh``): a gc since the last commit may have swept them."""
        kept = set()
        for key in bases:
            needed = [self.packs[key].ref, *self.packs[key].chain]
            for ref in needed:
                with self._lock:
                    known = fresh.get(ref.key)
                if known is None:
                    known = objects.touch(pack_name(ref.key)) is not None
                    with self._lock:
                        fresh[ref.key] = known
                if not known:
                    break
            else:
                kept.add(key)
        return kept

    def record(
        self,
        ref: PackRef,
        members: list[tuple[Piece, str]],
        bases: list[Version | None],
        entries: list[pack.Entry] | None,
        chain: tuple[PackRef, ...],
    ) -> None:
        """Remember the pieces of the pack ``ref`` as stored, their bytes copied for the next
        commit's deltas, with the ``bases`` they were planned against; ``entries``: the pack's
        index (None: it was there already, as planned)."""
        contents = tuple(
            (p.name, p.kind, p.start, key) if base is None else (p.name, p.kind, p.start, key, base.pack)
            for (p, key), base in zip(members, bases, strict=True)
        )
        with self._lock:
            self.packs[ref.key] = PackVersion(ref, contents, chain)
        for i, ((piece, key), base) in enumerate(zip(members, bases, strict=True)):
            share = None if entries is None else entries[i].length / max(1, piece.nbytes)
            raw = _copy(piece.tensor) if piece.tensor.is_floating_point() else None
            with self._lock:
                old = self.pieces.get(_id(piece))
            if base is None:
                whole = share if share is not None else 1.0
                version = Version(key, raw, ref.key, 0, whole, piece.tensor.element_size())
                if old is not None:
                    version.rest, version.misses = max(0, old.rest - 1), old.misses
            else:
                version = Version(
                    key, raw, ref.key, base.depth + 1, base.whole_share, piece.tensor.element_size()
                )
                if share is not None and share > _WORTH * base.whole_share:
                    version.misses = base.misses + 1
                    version.rest = (
                        1 if version.misses == 1 else min(64, knobs.delta_chain() * (version.misses - 1))
                    )
            with self._lock:
                self.pieces[_id(piece)] = version

    def forget_packs_unused(self) -> None:
        """Drop the packs no piece's version is in, nor needs as a base."""
        used = {v.pack for v in self.pieces.values()}
        needed = set(used)
        for key in used:
            found = self.packs.get(key)
            if found is not None:
                needed.update(ref.key for ref in found.chain)
        self.packs = {key: found for key, found in self.packs.items() if key in needed}


def _id(piece: Piece) -> PieceId:
    return piece.name, piece.kind, piece.start


def _copy(tensor: torch.Tensor) -> np.ndarray | None:
    """A host copy of the tensor's bytes, or None for one not on the host."""
    if not devicecopy.on_host(tensor):
        return None
    return codec.raw_bytes(tensor).copy()
