"""Recovery from peers: a restore takes what this node's tier lacks from the other nodes' tiers.

With replicas (``open(uri, local=PATH, replicas=N)``) every commit's objects are in another
node's tier too, so a job that restarts, even on a replaced node whose tier is empty, needs
nothing from the remote store that some node of the job still holds. A restore then runs
these collective steps, every rank together, before it reads (``Recovery``):

1. ``share_manifests``: each rank says which step manifests its tier holds (and which steps it
   uploaded, and whose shares it keeps replicas of); each takes the manifests it lacks from a
   rank that has them, so every node's catalog lists every step any node committed. A rank
   whose tier lost its own share of a step not uploaded yet takes back its share list from
   the peer that keeps its replica, so that its uploads go on once it holds them again.
2. ``newest``: without a step named, the newest step the job can assemble: uploaded, or every
   object it needs in some rank's tier. A newer one that cannot be is named in a warning.
3. ``fetch``: each rank names the objects its read needs (and its lost shares) that its tier
   lacks; a rank that holds one (its own or a replica) sends it over the process group, the
   first holder after the asking rank in rank order first. The receiver verifies it against
   its content key (packs, blobs and files; manifests against their tag in a keyed store)
   before writing it to its tier; a corrupt or missing one is asked of the next holder, then
   left to the remote store. Where the rank's bytes came from is returned (``Sources``).
   A pack or blob is decoded for that check only within the sizes this rank's catalog
   records for it (``recorded_raw_sizes``), never what its own headers declare: a pack's key
   covers its index, not its entries' headers, so a few KB under a real pack's name could
   otherwise declare gigabytes. One the catalog records no size of is not taken.

Every rank computes the same transfers from what was gathered, and runs them in the same
order, each a blocking send matched by a receive, so no pair waits on another.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..auxfiles import file_key
from ..catalog import Catalog, sync
from ..commit import ranks
from ..errors import CkptStoreError, CorruptError, NotFoundError
from ..format import codec, layout, manifest, pack
from ..model import layers_by_source
from ..objects import ObjectStore
from ..objects.tiered import share_name
from . import p2p
from .replicas import REPLICAS, held_records, parse_names, replicas_name
from .upload import read_share, share_lists, uploaded_name, uploaded_steps

log = logging.getLogger("ckptstore")

_MISSING = "is missing there"


@dataclass
class Sources:
    """Where one rank's restore of ``step`` found the stored bytes it reads: its own tier, each
    peer rank (rank -> bytes it sent), or none of them (left to the remote store)."""

    step: int
    tier: int = 0
    peers: dict[int, int] = field(default_factory=dict)
    remote: int = 0
    #: Objects a peer sent that failed verification (asked of the next source instead).
    corrupt: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: ``step 6: 10 MB from its tier, 20 MB from rank 1, 0 B from the remote``."""
        parts = [f"{self.tier} B from its tier"]
        parts += [f"{size} B from rank {rank}'s tier" for rank, size in sorted(self.peers.items())]
        parts.append(f"{self.remote} B left to the remote store")
        corrupt = (
            f"; {len(self.corrupt)} corrupt replicas passed over ({self.corrupt[0]}, ...)"
            if self.corrupt
            else ""
        )
        return f"step {self.step}: " + ", ".join(parts) + corrupt


@dataclass(frozen=True)
class _Transfer:
    """One object ``receiver`` lacks: ``name`` at the holders, ``size`` bytes, kept as ``keep_as``."""

    receiver: int
    name: str
    size: int
    keep_as: str
    holders: tuple[int, ...]


class Recovery:
    """A restore's collective reads from peers (the module's steps), for one rank of the job."""

    def __init__(self, local: ObjectStore, objects: ObjectStore, catalog: Catalog) -> None:
        ranks.use_commit_group()  # p2p on a gloo group of its own, whatever the default one is
        self.local, self.objects, self.catalog = local, objects, catalog
        self.rank, self.size = ranks.world()
        self.group = ranks.commit_group()
        self._uploaded: set[int] = set()
        self._tiers_have: set[int] = set()  # steps whose manifest some rank's tier holds
        self._lost_shares: list[int] = []  # steps of this rank's own share it took back
        self._raw_sizes: dict[str, int] = {}  # what bounds the check of a pack or blob received
        #: Where this rank's read found its bytes (``fetch``).
        self.sources: Sources | None = None

    def share_manifests(self, what: str) -> None:
        """Step 1 of the module: every manifest any rank's tier holds, in every rank's tier
        and catalog; this rank's lost share lists of steps not uploaded, back in its tier."""
        gathered = ranks.on_every_rank(what, self._inventory)
        self._uploaded = set().union(*(set(inventory["uploaded"]) for inventory in gathered))
        manifests: dict[str, tuple[int, list[int]]] = {}
        for rank, inventory in enumerate(gathered):
            for name, size in inventory["manifests"].items():
                manifests.setdefault(name, (size, []))[1].append(rank)
        self._tiers_have = {layout.parse_manifest_name(name)[0] for name in manifests}
        transfers = [
            _Transfer(receiver, name, size, name, tuple(holders))
            for receiver, inventory in enumerate(gathered)
            for name, (size, holders) in sorted(manifests.items())
            if name not in inventory["manifests"]
        ]
        lost_steps: dict[int, _Transfer] = {}  # this rank's lost shares, by step
        for receiver, inventory in enumerate(gathered):
            own = {tuple(share) for share in inventory["shares"]}
            lost: dict[tuple[int, int], tuple[int, list[int]]] = {}
            for rank, other in enumerate(gathered):
                for step, of, size in other["replicas"]:
                    if of == receiver and step not in self._uploaded and (step, of) not in own:
                        lost.setdefault((step, of), (size, []))[1].append(rank)
            for (step, of), (size, holders) in sorted(lost.items()):
                transfer = _Transfer(
                    receiver, replicas_name(step, of), size, share_name(step, of), tuple(holders)
                )
                transfers.append(transfer)
                if receiver == self.rank:
                    lost_steps[step] = transfer
        got = self._exchange(transfers)
        self._lost_shares = sorted(step for step, transfer in lost_steps.items() if transfer in got)

        def take_in() -> None:  # on every rank together: a failure here raises on each
            for step in self._uploaded - uploaded_steps(self.local):
                self.local.put_if_absent(uploaded_name(step), b"")  # no second upload of it from here
            if any(transfer.keep_as == transfer.name for transfer in got):  # manifests
                sync.sync(self.catalog, self.objects)

        ranks.each_rank(what, take_in)

    def _inventory(self) -> dict:
        local = self.local
        return {
            "manifests": {
                info.name: info.size
                for info in local.list(layout.MANIFESTS)
                if layout.parse_manifest_name(info.name)
            },
            "uploaded": sorted(uploaded_steps(local)),
            "shares": share_lists(local),
            "replicas": held_records(local),
        }

    def newest(self, what: str) -> int:
        """Step 2 of the module: the newest step the job can assemble. NotFoundError if there is none."""
        offline = getattr(self.objects, "offline", False)
        candidates = ranks.on_rank_zero(what, lambda: sorted(self.catalog.steps(), reverse=True))
        passed = []
        for step in candidates:
            if step not in self._tiers_have or (step in self._uploaded and not offline):
                break  # in the remote store: whatever no tier holds is read from there
            names = sorted(ranks.on_rank_zero(what, lambda step=step: step_objects(self.catalog, step)))
            lacking = ranks.on_every_rank(
                what, lambda names=names: np.packbits([not self.local.exists(n) for n in names]).tobytes()
            )
            nowhere = np.bitwise_and.reduce([np.frombuffer(bits, dtype=np.uint8) for bits in lacking])
            missing = [names[i] for i in np.flatnonzero(np.unpackbits(nowhere)[: len(names)])]
            if not missing:
                break
            passed.append(f"step {step} ({len(missing)} objects in no tier of the job, {missing[0]}, ...)")
        else:
            raise NotFoundError(
                f"{self.objects.uri} has no step the job can restore"
                + (f": {'; '.join(passed)}, and it was never uploaded" if passed else "")
            )
        if passed:
            log.warning(
                "ckptstore: restoring step %d: the newer %s cannot be assembled and never reached %s",
                step, ", ".join(passed), self.objects.uri,
            )  # fmt: skip
        return step

    def fetch(self, step: int, reads: dict[str, int]) -> Sources:
        """Step 3 of the module: every object of ``reads`` (name -> size: what this rank's read
        of ``step`` touches) and of its lost shares that a rank of the job holds, in this
        rank's tier; where its bytes come from. Collective."""
        at_hand: dict[str, int] = {}

        def lacking_here() -> dict[str, int]:
            wanted = dict(reads)
            for lost in self._lost_shares:
                wanted.update(read_share(self.local, lost, self.rank))
            at_hand.update((name, size) for name, size in wanted.items() if self.local.exists(name))
            lacking = {name: size for name, size in wanted.items() if name not in at_hand}
            self._raw_sizes = recorded_raw_sizes(self.catalog, [step, *self._lost_shares], lacking)
            return lacking

        what = f"restore of step {step}"
        gathered = ranks.on_every_rank(what, lacking_here)
        lacking = gathered[self.rank]
        union = sorted(set().union(*gathered))
        holding = ranks.on_every_rank(
            what, lambda: np.packbits([self.local.exists(name) for name in union]).tobytes()
        )
        holds = [np.unpackbits(np.frombuffer(bits, dtype=np.uint8))[: len(union)] for bits in holding]
        column = {name: i for i, name in enumerate(union)}
        transfers = [
            _Transfer(receiver, name, size, name,
                      tuple(r for r in range(self.size) if r != receiver and holds[r][column[name]]))
            for receiver, names in enumerate(gathered)
            for name, size in sorted(names.items())
        ]  # fmt: skip
        sources = Sources(step, tier=sum(size for name, size in at_hand.items() if name in reads))
        got = self._exchange(transfers, sources)
        for transfer in got:
            if transfer.name in reads:
                sender = got[transfer]
                sources.peers[sender] = sources.peers.get(sender, 0) + transfer.size
        received = {transfer.name for transfer in got}
        sources.remote = sum(size for name, size in reads.items() if name in lacking and name not in received)
        self.sources = sources
        return sources

    def _exchange(self, transfers: list[_Transfer], sources: Sources | None = None) -> dict[_Transfer, int]:
        """Run ``transfers`` (the same list on every rank), each from its first holder that has
        it intact; this rank's received ones -> the rank that sent it."""
        import torch.distributed as dist

        tried = [0] * len(transfers)
        open_ = [i for i, transfer in enumerate(transfers) if transfer.holders]
        got: dict[_Transfer, int] = {}
        while open_:
            failed = []
            for i in open_:
                transfer = transfers[i]
                sender = sorted(transfer.holders, key=lambda r: (r - transfer.receiver) % self.size)[tried[i]]
                if self.rank == sender:
                    self._send(transfer)
                elif self.rank == transfer.receiver:
                    problem = self._receive(transfer, sender)
                    if problem is None:
                        got[transfer] = sender
                        continue
                    failed.append(i)
                    log.warning("ckptstore: %s from rank %d %s: asking the next source", transfer.name,
                                sender, problem)  # fmt: skip
                    if sources is not None and problem != _MISSING:
                        sources.corrupt.append(transfer.name)
            everyone: list = [None] * self.size
            dist.all_gather_object(everyone, failed, group=self.group)
            open_ = sorted(i for failures in everyone for i in failures)
            for i in open_:
                tried[i] += 1
            open_ = [i for i in open_ if tried[i] < len(transfers[i].holders)]
        return got

    def _send(self, transfer: _Transfer) -> None:
        try:
            data = self.local.get(transfer.name)
        except CkptStoreError:
            data = None
        p2p.send(
            data if data is not None and len(data) == transfer.size else None, transfer.receiver, self.group
        )

    def _receive(self, transfer: _Transfer, sender: int) -> str | None:
        """Receive ``transfer`` from ``sender``, verify it and keep it in the tier; None, or
        what was wrong with it."""
        length = p2p.receive_length(sender, self.group)
        if length == p2p.NOTHING:
            return _MISSING
        if length != transfer.size:  # the stream would be out of step: the job cannot go on
            raise CorruptError(
                f"rank {sender} announced {transfer.name} as {length} bytes, not {transfer.size}"
            )
        data = p2p.receive_bytes(length, sender, self.group)
        problem = intact(
            transfer.keep_as, transfer.name, data, self.objects, self._raw_sizes.get(transfer.keep_as)
        )
        if problem is None:
            try:
                self.local.put_if_absent(transfer.keep_as, data)
            except (CkptStoreError, OSError) as exc:  # a full disk: the next source may be read directly
                return f"could not be kept in {self.local.uri}: {exc}"
        return problem


def step_objects(catalog: Catalog, step: int) -> dict[str, int]:
    """Every stored object ``step`` reads (name -> stored size): the packs and blobs of each
    layer at the step that saved it, whichever front door committed it."""
    return {name: size for name, (size, _) in _step_sizes(catalog, step).items()}


def recorded_raw_sizes(catalog: Catalog, steps: list[int], names: Iterable[str]) -> dict[str, int]:
    """The uncompressed size ``catalog`` records for each pack or blob of ``names`` that one of
    ``steps`` reads (a pack: the bytes of the tensors its layer index gives it; a blob: its
    size row): what bounds ``intact``'s decode. Steps the catalog lacks are passed over; a
    name none of them reads is left out. The steps' layer indexes are read only if a pack or
    blob is named."""
    wanted = {name for name in names if layout.parse_pack_name(name) or layout.parse_blob_name(name)}
    found: dict[str, int] = {}
    for step in steps:
        if wanted <= found.keys():
            break
        try:
            sizes = _step_sizes(catalog, step)
        except NotFoundError:  # a lost share of a step no tier holds a manifest of
            continue
        found.update((name, sizes[name][1]) for name in wanted & sizes.keys())
    return found


def _step_sizes(catalog: Catalog, step: int) -> dict[str, tuple[int, int]]:
    """``step_objects`` with each object's recorded uncompressed size: name -> (stored, raw)."""
    found: dict[str, tuple[int, int]] = {}
    for source, layers in layers_by_source(catalog.sources(step)).items():
        packed = set()
        for index in catalog.layer_packs(source, layers):
            packed.add(index.layer)
            found.update((layout.pack_name(ref.key), (ref.size, ref.raw_size)) for ref in index.all_packs)
        rows = catalog.tensors(source, [layer for layer in layers if layer not in packed])
        sizes = catalog.blob_sizes({row.blob for row in rows})
        found.update((layout.blob_name(key), (size.size, size.raw_size)) for key, size in sizes.items())
    return found


def intact(
    name: str, sent_as: str, data: bytes, objects: ObjectStore, raw_size: int | None = None
) -> str | None:
    """None if ``data`` is what ``name`` must hold (``sent_as`` at the sender: a peer's replica
    record is this rank's share list), checked against its content key (a pack's every
    entry, a blob, a file; a manifest's tag in a keyed store); else what is wrong.

    ``raw_size``: the uncompressed size the catalog records for a pack or blob
    (``recorded_raw_sizes``). Its headers must declare exactly that before anything is
    decompressed, so a crafted object costs at most what the honest one would; a pack or
    blob without it is refused unread."""
    content_hash = objects.content_hash
    packed, blob = layout.parse_pack_name(name), layout.parse_blob_name(name)
    if (packed is not None or blob is not None) and raw_size is None:
        return "is not taken: the catalog records no size to check it against"
    try:
        if packed is not None:
            pack.check(data, packed, raw_size, content_hash)
        elif blob is not None:
            codec.decode(data, blob, raw_size, content_hash)
        elif (key := layout.parse_file_name(name)) is not None:
            if file_key(data, content_hash) != key:
                return "is corrupt: its content does not hash to its key"
        elif (step := layout.parse_manifest_name(name)) is not None:
            if manifest.decode(data, content_hash, name).step != step[0]:
                return f"is corrupt: it describes another step than {step[0]}"
        elif sent_as.startswith(REPLICAS):
            shared = parse_names(data, sent_as)
            if not isinstance(shared, dict) or not all(
                isinstance(size, int) and not isinstance(size, bool) and size >= 0 for size in shared.values()
            ):
                return "is corrupt: not a share list"
        else:
            return "is no object a restore takes from a peer"
    except CkptStoreError as exc:
        return f"is corrupt: {exc}"
    return None
