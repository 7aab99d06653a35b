"""A store's commits of DeepSpeed engines: blocking ones, and those behind training.

``Store.commit`` hands every call here: the engine and arguments are checked before any work,
then the step is committed at once (``step.commit_step``) or queued (``step.submit_commit``)
on the one background worker this store keeps. A local tier, when there is one, is asked for
room before a commit and told of every blocking commit that landed in it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol

from .. import auxfiles, knobs, strategies
from ..arguments import check_commit, check_layers, check_step, check_when_busy
from ..catalog import Catalog
from ..objects import ObjectStore
from . import ranks
from .deltas import Versions
from .queue import WAIT, CommitHandle, CommitQueue
from .step import CommitReport, commit_step, submit_commit


class TierCommits(Protocol):
    """What a commit asks of the local tier in front of the store (``tier.Tier``)."""

    def wait_for_room(self) -> None: ...

    def committed(self) -> None: ...

    replicas: int

    def replicate(self, step: int) -> Any: ...


class EngineCommits:
    """The commits of one store: ``commit`` as ``Store.commit`` documents it, ``wait`` for the
    one in flight, ``close`` to flush it and stop the background worker."""

    def __init__(self, objects: ObjectStore, catalog: Catalog, tier: TierCommits | None = None) -> None:
        self.objects = objects
        self.catalog = catalog
        self.tier = tier
        self._queue: CommitQueue | None = None  # made on the first non-blocking commit
        # What this rank committed last: deltas are against it (commit.deltas).
        self._versions = Versions()

    def commit(
        self,
        engine: Any,
        step: Any,
        layers: strategies.Selection,
        client_state: dict | None,
        files: auxfiles.FileSpec | None,
        *,
        metrics: Mapping[str, float] | None,
        blocking: bool,
        when_busy: str = WAIT,
    ) -> CommitReport | CommitHandle:
        """Commit ``engine``'s state as ``step`` (``Store.commit``'s contract)."""
        from ..deepspeed.extract import extract

        step = check_step(step)
        check_commit(engine, client_state)
        check_when_busy(when_busy, blocking)
        options = dict(
            layers=check_layers(layers), files=files, metrics=metrics, versions=self.delta_versions()
        )
        take_snapshot = functools.partial(extract, engine, client_state)
        if self.tier is not None:
            self.tier.wait_for_room()
        replicate = self.tier is not None and self.tier.replicas > 0
        if not blocking:
            self._queue = self._queue or CommitQueue()
            return submit_commit(
                self._queue, self.objects, self.catalog, step, engine, take_snapshot,
                then=functools.partial(self.tier.replicate, step) if replicate else None,
                when_busy=when_busy, **options,
            )  # fmt: skip
        self.wait()
        report = commit_step(self.objects, self.catalog, step, take_snapshot, **options)
        if self.tier is not None:
            self.tier.committed()
        if replicate:
            self.replicate_behind(step)
        return report

    def delta_versions(self) -> Versions | None:
        """What this rank's next commit stores its changed pieces as deltas against (None:
        deltas are off, ``CKPTSTORE_DELTA_CHAIN=1``); the DCP writer's saves use it too."""
        return self._versions if knobs.delta_chain() > 1 else None

    def replicate_behind(self, step: int) -> None:
        """Copy this rank's share of the committed ``step`` into its peers' tiers behind
        training, after the commit in flight, as a non-blocking commit's own copies are made
        (nothing without replicas). Collective: every rank calls it after the same commits."""
        if self.tier is None or self.tier.replicas == 0:
            return
        ranks.use_commit_group()
        self._queue = self._queue or CommitQueue()
        self._queue.submit(step, functools.partial(_replicate, self.tier, step))

    def wait(self) -> CommitReport | None:
        """Wait for the commit in flight, if any; returns its report, raises its error."""
        return self._queue.wait() if self._queue is not None else None

    def close(self) -> None:
        """Flush the commit in flight (raising its error) and stop the background worker."""
        if self._queue is not None:
            self._queue.close()


def _replicate(tier: TierCommits, step: int) -> None:
    # A queued job's result is what ``wait`` returns: a blocking commit's replication has none.
    tier.replicate(step)
