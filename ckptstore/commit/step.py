"""One commit, across every rank: extract, sample, plan, store blobs, then record on rank 0.

Two collective phases, each a barrier that also shares every rank's outcome (``ranks``):
1. every rank checks the step, extracts its share of the engine's state and samples it;
2. from every rank's samples each rank measures the same updates, so all plan alike, then
   stores its own pieces. When the gather returns, every rank's blobs are durable.
Then rank 0 builds the step's record and publishes it (``record``). The shared gc lock spans
all of it: a concurrent gc (exclusive) runs wholly before or wholly after the commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .. import auxfiles, fused_experts, strategies
from ..catalog import Catalog, sync
from ..errors import BadInputError, NotFoundError
from ..format import config, layerpacks
from ..format.layout import file_name, manifest_name
from ..layers import layer_of
from ..model import FileRow, LayerPacks, QueueFigures, Snapshot
from ..objects import ObjectStore
from . import ranks, stats
from .deltas import Versions
from .packs import StoredPacks, store_pieces
from .plan import CommitPlan, check_new_step, plan_commit
from .queue import WAIT, Admission, CommitHandle, CommitQueue
from .record import build_record, check_metrics, publish


@dataclass
class CommitReport:
    """What a commit stored: the step, the layers it saved, and what it added to the store."""

    step: int
    layers_saved: list[str]
    layers_inherited: dict[str, int]
    tensors: int
    blobs_added: int
    bytes_added: int
    # layer -> relative change of its fp32 masters since its last save (None: not measurable)
    updates: dict[str, float | None] = field(default_factory=dict)


@dataclass
class _RankShare:
    """What one rank stored, as the other ranks see it (the description comes from rank 0,
    combined from every model-parallel rank's part where they describe parts)."""

    description: dict | None
    world_size: int
    stored: StoredPacks
    files: list[FileRow] | None  # the files this rank was given (None: none given)


class _RankCommit:
    """This rank's part of one commit, phase by phase; what a phase learns stays on this rank."""

    def __init__(
        self, objects: ObjectStore, catalog: Catalog, step: int, background: bool, versions: Versions | None
    ) -> None:
        self.objects, self.catalog, self.step, self.background = objects, catalog, step, background
        self.versions = versions
        self.rank_zero = ranks.world()[0] == 0
        self.snapshot: Snapshot | None = None
        self.file_entries: auxfiles.Entries | None = None
        self.plan: CommitPlan | None = None
        self.samples: dict[str, bytes] = {}
        self.metrics: dict[str, float | None] = {}

    def sample(
        self, take_snapshot: Callable[[], Snapshot], files: auxfiles.FileSpec | None, metrics
    ) -> tuple[stats.RankSamples, dict | None]:
        """Phase 1: check the step and the metrics, take this rank's snapshot; returns its share
        of the samples and, where ranks describe their model-parallel part, that part."""
        check_new_step(self.catalog, self.step)
        self.metrics = check_metrics(metrics)
        if self.rank_zero:
            config.upgrade(self.objects)
        self.file_entries = auxfiles.collect(files) if files is not None else None
        self.snapshot = snapshot = take_snapshot()
        # A model-parallel part is the same on every data-parallel rank: the first one sends it
        # (of expert-parallel parts, the first of each expert-data-parallel group).
        sends = snapshot.rank == 0 if snapshot.sends_part is None else snapshot.sends_part
        part = snapshot.description if snapshot.combine is not None and sends else None
        params = fused_experts.piece_params(snapshot.description["params"])  # as pieces name them
        return stats.own_samples(snapshot.pieces, params), part

    def store(
        self, sampled: list[tuple[stats.RankSamples, dict | None]], selection: strategies.Selection
    ) -> _RankShare:
        """Phase 2: plan from every rank's samples, then store this rank's pieces of the saved layers."""
        snapshot, self.snapshot = self.snapshot, None  # the tensors are not needed past this phase
        description = snapshot.description
        if snapshot.combine is not None:
            description = snapshot.combine([part for _, part in sampled if part is not None])
        samples = stats.merge([own for own, _ in sampled], fused_experts.piece_params(description["params"]))
        self.plan = plan = plan_commit(self.catalog, self.step, description, samples, selection)
        saved = set(plan.saved)
        pieces = [p for p in snapshot.pieces if layer_of(p.name) in saved]
        stored = store_pieces(
            self.objects, snapshot.rank, pieces, background=self.background, versions=self.versions
        )
        if self.rank_zero:
            self.samples = {name: s for name, s in samples.items() if layer_of(name) in saved}
        files = auxfiles.store(self.objects, self.file_entries) if self.file_entries is not None else None
        # By global rank, as a tier uploads and replicates shares: a model-parallel job has
        # several ranks of one data-parallel rank.
        self.objects.note_share(self.step, ranks.world()[0], _share_names(stored, files))
        return _RankShare(description if self.rank_zero else None, snapshot.world_size, stored, files)

    def step_files(self, shares: list[_RankShare]) -> list[FileRow]:
        """The step's auxiliary files: every rank's (each rank its own paths, the same file from
        several ranks once); with none given on any rank, the previous step's."""
        given = [(rank, share.files) for rank, share in enumerate(shares) if share.files is not None]
        if not given:
            previous = self.plan.previous
            return self.catalog.files(previous) if previous is not None else []
        by_path: dict[str, tuple[int, FileRow]] = {}
        for rank, rows in given:
            for row in rows:
                first = by_path.setdefault(row.path, (rank, row))
                if first[1].key != row.key:
                    raise BadInputError(
                        f"files=: ranks {first[0]} and {rank} give different contents for {row.path}; "
                        "give each rank's own files their own names (rng_state_<rank>.pth)"
                    )
        return [row for _, row in sorted(by_path.values(), key=lambda item: item[1].path)]


def commit_step(
    objects: ObjectStore,
    catalog: Catalog,
    step: int,
    take_snapshot: Callable[[], Snapshot],
    *,
    layers: strategies.Selection = None,
    files: auxfiles.FileSpec | None = None,
    metrics: Mapping[str, float] | None = None,
    background: bool = False,
    queued: Callable[[], QueueFigures] | None = None,
    versions: Versions | None = None,
) -> CommitReport:
    """Commit what ``take_snapshot()`` returns on every rank as ``step``; durable when it returns.

    Collective: every rank calls it, and an error on any rank raises on every rank with
    nothing recorded. ``layers`` chooses the saved layers (``commit.plan.plan_commit``);
    ``files`` are kept with the step (None keeps the previous step's); ``metrics`` (rank 0's)
    are recorded with it; ``background`` lowers the CPU priority; ``queued``: what the queue of
    a non-blocking commit measured and decided, recorded with it; ``versions``: this rank's
    previous commit, what changed since is stored as deltas against (``commit.deltas``). Raises ConflictError, on every
    rank, if another writer committed the step first (its objects are left as they are).
    """
    what = f"commit of step {step}"
    started = time.monotonic()
    own = _RankCommit(objects, catalog, step, background, versions)

    def sample() -> Any:
        # Inside the first collective step: a rank whose own catalog cannot be written (its
        # disk is full) makes every rank raise, rather than leave the others waiting for it.
        catalog.require_writable("commit")
        return own.sample(take_snapshot, files, metrics)

    # local_only: a commit through a local tier reads what the tier and catalog hold, never
    # the store behind it, so an outage there never reaches training.
    with objects.lock(exclusive=False), objects.local_only():
        sampled = ranks.on_every_rank(what, sample)
        shares = ranks.on_every_rank(what, lambda: own.store(sampled, layers))
        created = {key: size for share in shares for key, size in share.stored.created.items()}
        plan = own.plan

        def record() -> None:
            step_record = build_record(
                catalog, step, shares[0].world_size, shares[0].description, plan.layer_sources,
                _layer_indexes(step, plan.saved, shares), plan.updates, own.step_files(shares), created,
                own.metrics, time.monotonic() - started, None if queued is None else queued(),
            )  # fmt: skip
            return publish(objects, catalog, step_record, samples=own.samples)

        generation, manifest = ranks.on_rank_zero(f"recording step {step}", record)
        _import_committed(catalog, objects, step, generation, manifest)
    return CommitReport(
        step=step,
        layers_saved=plan.saved,
        layers_inherited={layer: s for layer, s in plan.layer_sources.items() if s != step},
        tensors=sum(share.stored.tensors for share in shares),
        blobs_added=len(created),
        bytes_added=sum(created.values()),
        updates={layer: update for layer, (_, update) in plan.updates.items()},
    )


def _import_committed(
    catalog: Catalog, objects: ObjectStore, step: int, generation: int, manifest: bytes
) -> None:
    """Add the step rank 0 committed to this rank's index (ranks on other machines have their
    own). A local tier on another node than rank 0's does not have the manifest yet: it gets
    the one rank 0 sent, so that this node lists the step and its uploader knows it."""
    if catalog.is_recorded(step):
        return
    try:
        sync.import_step(catalog, objects, step, generation)
    except NotFoundError:
        objects.put_if_absent(manifest_name(step, generation), manifest, single_request=True)
        sync.import_step(catalog, objects, step, generation)


def _share_names(stored: StoredPacks, files: list[FileRow] | None) -> dict[str, int]:
    """Every object one rank's part of a commit names: its packs and its files (name -> size)."""
    names = stored.object_names()
    names.update((file_name(row.key), row.size) for row in files or ())
    return names


def _layer_indexes(step: int, saved: list[str], shares: list[_RankShare]) -> dict[str, LayerPacks]:
    """The fragment index of every saved layer, from every rank's packs in rank order."""
    return {
        layer: layerpacks.build(
            step,
            layer,
            [p for share in shares for p in share.stored.layers.get(layer, [])],
            [b for share in shares for b in share.stored.bases.get(layer, [])],
        )
        for layer in saved
    }


def submit_commit(
    queue: CommitQueue,
    objects: ObjectStore,
    catalog: Catalog,
    step: int,
    engine: Any,
    take_snapshot: Callable[[], Snapshot],
    then: Callable[[], Any] | None = None,
    when_busy: str = WAIT,
    **options: Any,
) -> CommitHandle:
    """Start a commit of ``step`` that runs behind training; returns its handle at once;
    ``then`` runs after it, on the same thread, once it is durable.

    ``when_busy`` says what happens while the previous commit still runs (``queue``): ``wait``
    for it (raising its error), commit the ``latest`` snapshot after it, or ``skip`` this step.
    Then checks the step and takes the snapshot (views of the engine's live tensors), which
    ``queue`` copies in the background while the engine's next optimizer step waits for the
    copy. ``options`` as ``commit_step``.
    """
    called = time.monotonic()  # training is held from here until the call returns
    if when_busy == WAIT:
        queue.wait()  # one commit in flight at a time; the previous one's error surfaces here
    with objects.local_only():
        check_new_step(catalog, step)
    if options.get("files") is not None:
        # Read now: by the time the commit runs, the files may have changed or gone (the
        # Trainer's save_total_limit deletes old checkpoint folders).
        options["files"] = auxfiles.read(options["files"])
    ranks.use_commit_group()  # background collectives must not mix with training's
    admission = Admission(skip=False) if when_busy == WAIT else queue.admit(when_busy, ranks.agree_busy)
    if admission.skip:
        return queue.skip(step)
    snapshot = take_snapshot()

    def commit(copy: Snapshot, queued: Callable[[], QueueFigures]) -> CommitReport:
        report = commit_step(objects, catalog, step, lambda: copy, background=True, queued=queued, **options)
        if then is not None:
            then()
        return report

    return queue.submit_queued(step, engine, snapshot, commit, admission, called)
