"""Keeping the local tier small: once steps are uploaded, only what the newest few need stays.

The local tier keeps every object its ``keep`` newest steps name (so restoring one of them on
this node reads nothing from the remote) and everything of every step not uploaded yet; the
rest, which the remote holds, is deleted, manifests and upload marks of the dropped steps last.
A peer's replicas are kept by the same rule: the manifest of a step names every rank's objects,
and where this node lacks the manifest, the replica's own record names them.
It runs under the tier's exclusive lock, so a commit in flight (which holds it shared) never
has a pack it wrote or found deleted before its manifest names it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..catalog.sync import read_manifest
from ..format import layout
from ..objects import ObjectStore
from ..objects.tiered import SHARES
from .replicas import REPLICAS, REPLICATED, held_records, read_held
from .upload import (
    object_names,
    pending_shares,
    pending_steps,
    read_share,
    share_lists,
    share_steps,
    uploaded_name,
    uploaded_steps,
)


@dataclass
class PruneReport:
    """What pruning removed from the local tier."""

    steps_dropped: list[int]
    objects_deleted: int
    bytes_freed: int


def prune(local: ObjectStore, keep: int) -> PruneReport:
    """Delete from ``local`` what neither its ``keep`` newest steps nor a step (or a rank's
    share of one) still to upload need. Steps the remote does not have are never touched.
    Raises what ``local`` raises."""
    with local.lock(exclusive=True):
        manifests = layout.list_manifests(local)
        shares = share_steps(local)
        # A peer's replicas of a step whose manifest this node lacks (a DCP save's manifest is
        # only on its coordinator's node) are kept by their own records.
        held = held_records(local)
        steps = sorted(set(manifests.found) | shares | {step for step, _, _ in held})
        pending = set(pending_steps(local)) | {step for step, _ in pending_shares(local)}
        kept = set(steps[-keep:] if keep > 0 else []) | pending
        needed: set[str] = set()
        for step in kept:
            if step in manifests.found:
                needed.update(object_names(read_manifest(local, step, manifests.generation(step))))
        for step, rank in share_lists(local):
            if step in kept:
                needed.update(read_share(local, step, rank))
        for step, rank, _ in held:
            if step in kept:
                needed.update(read_held(local, step, rank))
        stored = [
            info
            for prefix in (layout.PACKS, layout.BLOBS, layout.FILES)
            for info in local.list(prefix)
            if info.name not in needed
        ]
        local.delete_many([info.name for info in stored])
        dropped = [step for step in steps if step not in kept]
        local.delete_many(
            [
                layout.manifest_name(step, generation)
                for step in dropped
                for generation in manifests.generations.get(step, [])
            ]
        )
        done = uploaded_steps(local)
        local.delete_many([uploaded_name(step) for step in dropped if step in done])
        for records in (SHARES, REPLICAS, REPLICATED):
            local.delete_many(
                [info.name for info in local.list(records) if _step_of(records, info.name) in dropped]
            )
    return PruneReport(dropped, len(stored), sum(info.size for info in stored))


def _step_of(records: str, name: str) -> int | None:
    """The step of a record under ``records/<step>/``."""
    return layout.parse_number(name[len(records) :].partition("/")[0])
