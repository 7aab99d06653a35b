"""A node-local store in front of a remote one: writes land locally, reads take the nearest copy.

A commit through a ``TieredObjectStore`` writes its packs and manifest to the local tier only,
under the local store's commit-point rules, and never waits on the network; ``ckptstore.tier``
uploads them behind. A read takes the local copy when there is one and the remote's otherwise;
either way the reader verifies what it decoded, so a damaged local copy is an error, not a
silent fallback. Listings are the union of both tiers, so the catalog sees the steps S3 has
plus those only this node has so far.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

from ..errors import NotFoundError
from . import Data, ObjectInfo, ObjectStore
from .local import LocalObjectStore

SHARES = "tier/shares/"
UPLOADED = "tier/uploaded/"


def share_name(step: int, rank: int) -> str:
    """Where the local tier lists rank ``rank``'s objects of ``step`` (``note_share``)."""
    return f"{SHARES}{step:012d}/{rank}.json"


def uploaded_name(step: int) -> str:
    """The local tier's mark that ``step`` is in the remote store (``ckptstore.tier.upload``)."""
    return f"{UPLOADED}{step:012d}"


class TieredObjectStore(ObjectStore):
    """``local`` (a node-local directory) in front of ``remote`` (the store itself, usually S3)."""

    def __init__(self, local: LocalObjectStore, remote: ObjectStore, *, offline: bool = False) -> None:
        self.local = local
        self.remote = remote
        #: The remote could not be reached when the store was opened: listings are the local
        #: tier's alone, and the catalog keeps the remote's steps it already knew.
        self.offline = offline
        self.uri = remote.uri
        # The catalog file and the refusal to write outputs into the store follow the local tier.
        self.root: Path = local.root
        self.spill_directory = local.spill_directory
        self._thread = threading.local()  # local_only, per thread: a background commit has its own

    @property
    def private_catalog(self) -> bool:
        """The catalog lives in the local tier but is this node's own, like an S3 store's cache:
        a step whose manifest is gone from both tiers was dropped by a gc elsewhere. Offline,
        the remote's manifests are not listed, so its steps are kept as they were."""
        return not self.offline

    def put_if_absent(self, name: str, data: Data, *, single_request: bool = False) -> bool:
        """Store ``data`` on the local tier (durable there when it returns); uploads come later."""
        return self.local.put_if_absent(name, data, single_request=single_request)

    def touch(self, name: str) -> int | None:
        # Only the local tier is asked: a commit never waits on the network. A pack only the
        # remote still has is written locally again, and the upload then finds it there.
        return self.local.touch(name)

    @contextlib.contextmanager
    def local_only(self) -> Iterator[None]:
        """Within it, this thread's reads and listings take the local tier's copy or none: the
        remote is not asked (a missing object is a NotFoundError saying so). What a commit runs in."""
        before = getattr(self._thread, "local_only", False)
        self._thread.local_only = True
        try:
            yield
        finally:
            self._thread.local_only = before

    def at_hand(self, name: str) -> bool:
        return not getattr(self._thread, "local_only", False) or self.local.exists(name)

    def _remote(self, name: str) -> ObjectStore:
        """The remote, to read ``name`` from, unless this thread is ``local_only``."""
        if getattr(self._thread, "local_only", False):
            raise NotFoundError(
                f"{name} is not in the local tier {self.local.uri}, and a commit does not ask {self.remote.uri}"
            )
        return self.remote

    def get(self, name: str) -> bytes:
        try:
            return self.local.get(name)
        except NotFoundError:
            return self._remote(name).get(name)

    def get_range(self, name: str, start: int, length: int) -> bytes | memoryview:
        try:
            return self.local.get_range(name, start, length)
        except NotFoundError:
            return self._remote(name).get_range(name, start, length)

    def info(self, name: str) -> ObjectInfo:
        try:
            return self.local.info(name)
        except NotFoundError:
            return self._remote(name).info(name)

    def delete(self, name: str) -> None:
        """Remove the object from the local tier only: the remote is collected by its own gc."""
        self.local.delete(name)

    def lock(self, *, exclusive: bool) -> contextlib.AbstractContextManager:
        # Held by commits (shared) and by the local tier's pruning (exclusive), so that pruning
        # never deletes a pack a commit in flight has written or found but not yet published.
        return self.local.lock(exclusive=exclusive)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object either tier has, once each (the local copy's info where both do);
        offline, the local tier's."""
        remote = not (self.offline or getattr(self._thread, "local_only", False))
        found = {info.name: info for info in self.remote.list(prefix)} if remote else {}
        found.update((info.name, info) for info in self.local.list(prefix))
        yield from (found[name] for name in sorted(found))

    def list_temporary(self) -> Iterator[ObjectInfo]:
        return self.local.list_temporary()

    def delete_temporary(self, names: list[str]) -> None:
        self.local.delete_temporary(names)

    def note_share(self, step: int, rank: int, names: dict[str, int]) -> None:
        name = share_name(step, rank)
        self.local.delete(name)  # a failed commit of the same step may have left an older list
        # A step deleted and committed again: what this tier uploaded of the old one is not it.
        self.local.delete_many([uploaded_name(step), name.removesuffix(".json") + ".done"])
        self.local.put_if_absent(name, json.dumps(names, sort_keys=True).encode())

    def __repr__(self) -> str:
        return f"TieredObjectStore(local={self.local!r}, remote={self.remote!r})"
