"""Peer replicas: each rank's new objects of a commit copied into other nodes' local tiers.

With ``open(uri, local=PATH, replicas=N)``, once a commit is durable in the tiers each rank
sends the objects its share names (the packs and files it wrote, ``note_share``) to the rank
of the same local index on each of the ``N`` nodes after its own (a ring over node indexes,
so that no two copies share a node), over the commit process group, behind training. Only
what a peer lacks travels: the names go first, the peer answers with those it does not hold,
then their bytes, one object at a time. The peer writes each into its tier (create-only and
durable, as a commit writes it: objects are named by content, so one it holds is the same)
and records what it holds for whom (``tier/replicas/<step>/<rank>.json``); the sender marks
its share replicated (``tier/replicated/<step>/<rank>``) once every peer has said it is
durable. A replica is trusted no more than any object: a read verifies each piece's content key.
The peer checks each object against its name before keeping it, as far as the share list's
stored sizes allow without decompressing anything (``check_replica``); a share with an object
that fails is not kept whole, so not marked.

Every rank runs the same replications in the same order (one per commit), so each pair of
ranks meets in step; with one rank per node, or one node, there is no peer and nothing to do.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import dataclass

from .. import knobs, remote_knobs
from ..auxfiles import file_key
from ..errors import CkptStoreError, CorruptError, clip
from ..format import layout, pack
from ..hashing import ContentHash
from ..objects import ObjectStore
from . import p2p

log = logging.getLogger("ckptstore")

REPLICAS = "tier/replicas/"
REPLICATED = "tier/replicated/"
# A peer's list of names or answer is JSON; far beyond any share's, and checked before allocating.
_MAX_LIST_BYTES = 1 << 30


def replicas_name(step: int, rank: int) -> str:
    """Where a tier lists what it holds of rank ``rank``'s share of ``step`` for that rank."""
    return f"{REPLICAS}{step:012d}/{rank}.json"


def replicated_name(step: int, rank: int) -> str:
    """The sender's mark that rank ``rank``'s share of ``step`` is durable on every peer."""
    return f"{REPLICATED}{step:012d}/{rank}"


def node_name() -> str:
    """This process's node: ``CKPTSTORE_NODE``, else torchrun's ``GROUP_RANK`` (the agent's
    node rank), else the host name."""
    return remote_knobs.node() or os.environ.get("GROUP_RANK") or socket.gethostname()


@dataclass(frozen=True)
class Peers:
    """Whom one rank sends its share to (``send_to``) and receives replicas from
    (``receive_from``), pair by pair: ``send_to[k]`` receives from this rank while it receives
    from ``receive_from[k]``."""

    send_to: list[int]
    receive_from: list[int]

    @classmethod
    def of(cls, nodes: list[str], rank: int, replicas: int) -> Peers:
        """The peers of ``rank`` in a job whose rank ``r`` runs on node ``nodes[r]``: the rank
        of the same local index on each of the ``replicas`` nodes after its own (and before
        it, to receive from), in the order the nodes first appear; fewer where the job has
        fewer nodes or a node has fewer ranks."""
        order = list(dict.fromkeys(nodes))
        ranks_on = {node: [r for r, n in enumerate(nodes) if n == node] for node in order}
        here = order.index(nodes[rank])
        index = ranks_on[nodes[rank]].index(rank)
        send_to, receive_from = [], []
        for k in range(1, min(replicas, len(order) - 1) + 1):
            after, before = ranks_on[order[(here + k) % len(order)]], ranks_on[order[(here - k) % len(order)]]
            if index < len(after) and index < len(before):
                send_to.append(after[index])
                receive_from.append(before[index])
        return cls(send_to, receive_from)


@dataclass
class ReplicaReport:
    """What one rank's replication of a step moved: objects and bytes sent to its peers, and
    received from the ranks it keeps replicas for."""

    step: int
    sent_objects: int = 0
    sent_bytes: int = 0
    received_objects: int = 0
    received_bytes: int = 0


def replicate(
    local: ObjectStore, step: int, rank: int, share: dict[str, int], peers: Peers, group
) -> ReplicaReport:
    """Copy ``share`` (this rank's objects of ``step``: name -> size) into each peer's tier and
    keep theirs in ``local``, as the module says; returns what moved. Every rank of ``group``
    with peers calls it for the same step. Raises what torch.distributed raises when a peer
    is gone, CorruptError for a peer's malformed message; the share is then not marked."""
    report = ReplicaReport(step)
    for send_to, receive_from in zip(peers.send_to, peers.receive_from, strict=True):
        link = _Link(send_to, receive_from, group)
        theirs = parse_names(
            link.exchange(json.dumps(share, sort_keys=True).encode()), f"rank {receive_from}"
        )
        if not isinstance(theirs, dict) or not all(
            isinstance(size, int) and 0 <= size <= knobs.MAX_BYTES for size in theirs.values()
        ):
            raise CorruptError(f"rank {receive_from} sent a share without the size of each object")
        wanted = [name for name in theirs if not local.exists(name)]
        asked = list(parse_names(link.exchange(json.dumps(wanted).encode()), f"rank {send_to}"))
        if not set(asked) <= set(share):
            raise CorruptError(f"rank {send_to} asked for objects not in step {step}'s share of rank {rank}")
        refused = []
        for i in range(max(len(asked), len(wanted))):
            data = local.get(asked[i]) if i < len(asked) else None
            receiving = i < len(wanted)
            received = link.exchange(data, receive=receiving, size=theirs[wanted[i]] if receiving else None)
            if data is not None:
                report.sent_objects += 1
                report.sent_bytes += len(data)
            if received is not None:
                if (problem := check_replica(wanted[i], received, local.content_hash)) is not None:
                    refused.append(f"{wanted[i]} {problem}")
                    continue  # the exchange goes on in step: this rank's own share still goes out
                local.put_if_absent(wanted[i], received)
                report.received_objects += 1
                report.received_bytes += len(received)
        if refused:
            # No record and no word that it is durable: the sender's wait for that times out,
            # and its share is not marked replicated.
            raise CorruptError(
                f"rank {receive_from} sent {len(refused)} objects of step {step} that are not what "
                f"their names say (not kept): {refused[0]}"
            )
        local.delete(replicas_name(step, receive_from))  # a failed try of the same step may have left one
        local.put_if_absent(replicas_name(step, receive_from), json.dumps(theirs, sort_keys=True).encode())
        link.exchange(b"durable")  # said once the replicas (and their list) are durable here
    local.put_if_absent(replicated_name(step, rank), b"")
    return report


def check_replica(name: str, data: bytes, content_hash: ContentHash) -> str | None:
    """None if ``data`` may be kept as ``name``, a peer's replica; else what is wrong with it.
    A file must hash to its key; a pack's index must hash to its key and account for every
    byte (``pack.check_layout``). Nothing is decompressed: the share list records stored
    sizes only, and a pack's headers could declare gigabytes. Its entries are verified by
    every read, and by a recovery's check (``recover.intact``), within the catalog's sizes.
    A blob is no part of a share (format 1 only)."""
    try:
        if (key := layout.parse_pack_name(name)) is not None:
            pack.check_layout(data, key, content_hash)
        elif (key := layout.parse_file_name(name)) is not None:
            if file_key(data, content_hash) != key:
                return "does not hash to its key"
        else:
            return "is no pack or file of a share"
    except CkptStoreError as exc:
        return f"is corrupt ({clip(str(exc))})"
    return None


def held_records(local: ObjectStore) -> list[tuple[int, int, int]]:
    """``(step, rank, size of the record)`` of every replica record ``local`` keeps for others."""
    held = []
    for info in local.list(REPLICAS):
        step, _, leaf = info.name[len(REPLICAS) :].partition("/")
        step, of = layout.parse_number(step), layout.parse_number(leaf.removesuffix(".json"))
        if step is not None and of is not None and leaf.endswith(".json"):
            held.append((step, of, info.size))
    return sorted(held)


def read_held(local: ObjectStore, step: int, rank: int) -> dict[str, int]:
    """The objects ``local`` keeps of rank ``rank``'s share of ``step`` (name -> size)."""
    names = parse_names(local.get(replicas_name(step, rank)), f"{local.uri}/{replicas_name(step, rank)}")
    if not isinstance(names, dict):
        raise CorruptError(
            f"{local.uri}/{replicas_name(step, rank)} is not a list of objects with their sizes"
        )
    return names


def replicated_steps(local: ObjectStore, shares: list[tuple[int, int]]) -> set[int]:
    """The steps of which this node's tier marked every share it lists (``shares``:
    ``(step, rank)``) replicated: every rank of the node that committed it has its copies."""
    marked = set()
    for info in local.list(REPLICATED):
        step, _, rank = info.name[len(REPLICATED) :].partition("/")
        if (number := layout.parse_number(step)) is not None and (
            who := layout.parse_number(rank)
        ) is not None:
            marked.add((number, who))
    steps = {step for step, _ in shares}
    return {step for step in steps if all((s, rank) in marked for s, rank in shares if s == step)}


def parse_names(data: bytes, sender: str) -> dict[str, int] | list[str]:
    """A peer's list of object names (or names with sizes), each a pack, blob or file name.
    CorruptError for anything else (not JSON, nested past the decoder's recursion limit)."""
    try:
        names = json.loads(data)
    except ValueError:
        raise CorruptError(f"{sender} sent a list of objects that is not JSON") from None
    except RecursionError:
        # json's decoder recurses per level: ``[[[...]]]`` 100,000 deep is a few hundred KB.
        raise CorruptError(f"{sender} sent a list of objects nested too deeply to be one") from None
    listed = list(names) if isinstance(names, dict | list) else None
    if listed is None or not all(isinstance(name, str) and _is_object(name) for name in listed):
        raise CorruptError(f"{sender} sent names that are no pack, blob or file of a store")
    return names


def _is_object(name: str) -> bool:
    return any(parse(name) is not None for parse in (layout.parse_pack_name, layout.parse_blob_name,
                                                      layout.parse_file_name))  # fmt: skip


class _Link:
    """Messages between this rank and a pair of peers: each ``exchange`` sends one message to
    ``send_to`` while it receives one from ``receive_from`` (the same rank, with two nodes)."""

    def __init__(self, send_to: int, receive_from: int, group) -> None:
        self.send_to, self.receive_from, self.group = send_to, receive_from, group

    def exchange(self, data: bytes | None, *, receive: bool = True, size: int | None = None) -> bytes | None:
        """Send ``data`` (None: nothing) and receive a message (``receive`` False: none) of
        ``size`` bytes (None: a list, of a bounded size); returns what was received. The sizes
        go first, checked before anything is allocated for the message; each wait is bounded
        (``p2p``)."""
        sending = p2p.post(data, self.send_to, self.group) if data is not None else []
        received = None
        if receive:
            length = p2p.receive_length(self.receive_from, self.group)
            if length != size if size is not None else not 0 <= length <= _MAX_LIST_BYTES:
                raise CorruptError(f"rank {self.receive_from} announced a message of {length} bytes")
            received = p2p.receive_bytes(length, self.receive_from, self.group)
        p2p.finish(sending, self.send_to)
        return received
