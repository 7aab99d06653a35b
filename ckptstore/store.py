"""``Store``: commit, materialize, list and verify steps. Orchestration only.

The parts it calls know the formats: ``deepspeed.extract``/``deepspeed.write`` the DeepSpeed
files, ``codec`` the blob bytes, ``catalog`` the SQLite index, ``objects`` the storage medium.
Write order of a commit: blobs, then the manifest, then the catalog row (the commit point).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from . import catalog_sync, codec, collective, compose, knobs, stats, strategies
from . import files as auxfiles
from .background import CommitHandle, CommitQueue, device_ready, lower_thread_priority
from .catalog import BlobRow, Catalog, FileRow, LayerRow, StepRow, TensorRow
from .deepspeed.layout import Snapshot
from .errors import BadInputError, ConflictError, CorruptError, NotFoundError, UnsupportedError
from .gc import GcReport, collect
from .layers import layer_of, ordered_layers
from .manifest import Manifest, manifest_name
from .objects import ObjectStore, data_size, open_objects
from .progress import progress_bar
from .reader import StepReader, blob_name, fetch_blob

STORE_FORMAT_VERSION = 1
CONFIG_NAME = "config.json"


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
    """What one rank stored for a commit (the description comes from rank 0)."""

    description: dict | None
    world_size: int
    all_layers: list[str]
    saved_layers: list[str]
    rows: list[TensorRow]
    blobs: list[BlobRow]
    created: dict[str, int]


@dataclass
class BlobProblem:
    """A referenced blob that is missing or corrupt, with every (step, layer, name, kind) needing it."""

    blob: str
    problem: str
    users: list[tuple[int, str, str, str]]

    def describe(self) -> str:
        steps = sorted({u[0] for u in self.users})
        layer, name, kind = self.users[0][1:]
        return (
            f"blob {self.blob} ({layer}: {name} {kind}) {self.problem}; "
            f"needed by step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
        )


@dataclass
class FileProblem:
    """A stored auxiliary file that is missing or corrupt, with every (step, path, size) needing it."""

    key: str
    problem: str
    users: list[tuple[int, str, int]]

    def describe(self) -> str:
        steps = sorted({u[0] for u in self.users})
        return (
            f"auxiliary file {self.users[0][1]} (stored as {self.key}) {self.problem}; "
            f"needed by step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"
        )


@dataclass
class VerifyReport:
    """Outcome of ``Store.verify``: problems make it fail; orphans are information only."""

    blobs_checked: int = 0
    bytes_checked: int = 0
    deep: bool = True
    problems: list[BlobProblem] = field(default_factory=list)
    files_checked: int = 0
    file_problems: list[FileProblem] = field(default_factory=list)
    catalog_problems: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    stray_manifests: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and not self.file_problems and not self.catalog_problems


def _seconds(grace: timedelta | float | None) -> float:
    if grace is None:
        return knobs.gc_grace_seconds()
    seconds = grace.total_seconds() if isinstance(grace, timedelta) else float(grace)
    if seconds < 0:
        raise BadInputError(f"the grace period cannot be negative ({seconds} s)")
    return seconds


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _piece_bytes(piece) -> int:
    return piece.tensor.numel() * piece.tensor.element_size()


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise BadInputError(f"a step is a non-negative integer, not {step!r}")
    return step


class Store:
    """A checkpoint store: blobs in an ObjectStore, an index in a Catalog."""

    def __init__(self, objects: ObjectStore, catalog: Catalog, *, manifest_commits: bool = False) -> None:
        self.objects = objects
        self.catalog = catalog
        # True for stores whose manifests are the commit points and the catalog a local index
        # of them (S3, see catalog_sync); False where the catalog row commits (local stores).
        self.manifest_commits = manifest_commits
        self._queue: CommitQueue | None = None
        self._closed = False

    def close(self) -> None:
        """Flush a background commit in flight (raising its error), then release the catalog."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._queue is not None:
                self._queue.close()
        finally:
            self.catalog.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries ---------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self.catalog.steps()

    def sources(self, step: int) -> dict[str, int]:
        """Every layer of ``step`` -> the step whose tensors it uses. Raises NotFoundError."""
        return self.catalog.sources(_check_step(step))

    def log(self) -> list[StepRow]:
        """Summary of every committed step (time, layers saved, bytes added), oldest first."""
        return self.catalog.log()

    def show(self, step: int) -> list[LayerRow]:
        """Every layer of ``step``: the step it comes from, its stored bytes, and its update
        (relative change of its fp32 masters since its last save, measured at ``step``).
        Raises NotFoundError."""
        return self.catalog.layer_rows(_check_step(step))

    def files(self, step: int) -> list[FileRow]:
        """The auxiliary files kept with ``step``. Raises NotFoundError."""
        return self.catalog.files(_check_step(step))

    # -- commit ----------------------------------------------------------------------------

    def commit(
        self,
        engine: Any,
        step: int,
        layers: strategies.Selection = None,
        client_state: dict | None = None,
        files: auxfiles.FileSpec | None = None,
        *,
        blocking: bool = True,
    ) -> CommitReport | CommitHandle:
        """Store the engine's checkpoint state as ``step``.

        Blocking (the default): returns the CommitReport once the step is durable.
        ``blocking=False``: returns a CommitHandle at once; the tensors are copied into host
        buffers in the background while training goes on, and the engine's next optimizer
        step waits until that copy is done (forward and backward passes do not change what
        is saved). Do not change the engine's state any other way (``load_checkpoint``,
        editing weights) before ``handle.result()``. Hashing, compression, writes and
        recording run in the background too. ``handle.result()`` or ``store.wait()`` waits
        and raises if that failed (a failed commit records nothing); the next commit and
        ``close()`` wait too.
        Arguments as for ``_commit``.
        """
        self._ensure_open()
        if blocking:
            self.wait()
            return self._commit(engine, step, layers, client_state, files)
        from .deepspeed.extract import extract

        step = _check_step(step)
        queue = self._background()
        queue.wait()  # one commit in flight at a time; the previous one's error surfaces here
        self._check_new_step(step)
        collective.use_commit_group()  # background collectives must not mix with training's
        snapshot = extract(engine, client_state)  # views of the live tensors, plain state copied
        if not queue.gate.guard(engine):
            copy = queue.buffers.copy(snapshot)  # nothing to hold the engine's steps with: copy now
            return queue.submit(step, lambda: self._commit(None, step, layers, None, files, prepared=copy))
        ready = device_ready(snapshot)

        def copy_then_commit() -> CommitReport:
            try:
                copy = queue.buffers.copy(snapshot, ready)
            finally:
                queue.gate.open()  # the engine's next optimizer step may run
            return self._commit(None, step, layers, None, files, prepared=copy)

        queue.gate.close()
        try:
            return queue.submit(step, copy_then_commit)
        except BaseException:
            queue.gate.open()
            raise

    def wait(self) -> CommitReport | None:
        """Wait for a background commit in flight; returns its report, raises its error."""
        return self._queue.wait() if self._queue is not None else None

    def _check_new_step(self, step: int) -> None:
        if self.catalog.has_step(step):
            raise ConflictError(f"step {step} is already committed")
        user = self.catalog.inheritor_of(step)
        if user is not None:
            # The dropped step's tensors still serve step `user`; a new step under the same
            # number would have to replace them.
            raise ConflictError(
                f"step {step} was dropped, but step {user} still uses layers it saved; commit under another step number"
            )

    def _background(self) -> CommitQueue:
        if self._queue is None:
            self._queue = CommitQueue()
        return self._queue

    def _ensure_open(self) -> None:
        if self._closed:
            raise BadInputError("this store was closed; open it again")

    def _commit(
        self,
        engine: Any,
        step: int,
        layers: strategies.Selection = None,
        client_state: dict | None = None,
        files: auxfiles.FileSpec | None = None,
        prepared: Snapshot | None = None,
    ) -> CommitReport:
        """Store the engine's checkpoint state (or the ``prepared`` snapshot of it) as ``step``.

        ``layers`` = None saves every layer; a list saves only those layers and inherits the
        rest from the newest earlier step; a ``ckptstore.strategies.Strategy`` or a callable
        ``(layer, context) -> bool`` chooses them from the store's history and the update
        statistics (a store's first commit saves every layer whatever they say). Every commit
        records each layer's update since its last save (``show``). ``client_state`` is kept
        like DeepSpeed's ``save_checkpoint(client_state=...)``. ``files`` (paths, or a
        directory) are kept with the step and copied out by ``materialize``; None keeps the
        previous step's. Raises ConflictError if the step exists, BadInputError for unknown
        layers, a partial first commit or unusable files, UnsupportedError for engines
        ckptstore cannot store. On any error nothing is recorded.
        """
        from .deepspeed.extract import extract

        step = _check_step(step)
        own: dict[str, Any] = {}  # this rank's snapshot and outcomes, kept between the phases
        rank_zero = collective.world()[0] == 0

        def sample_own_share() -> stats.RankSamples:
            self._check_new_step(step)
            own["files"] = auxfiles.collect(files) if rank_zero and files is not None else None
            own["snapshot"] = snapshot = prepared if prepared is not None else extract(engine, client_state)
            return stats.own_samples(snapshot.pieces, snapshot.description["params"])

        def store_own_share() -> _RankShare:
            snapshot = own.pop("snapshot")
            description = snapshot.description
            names = [key for key, role in description["module_keys"] if role != "alias"]
            all_layers = ordered_layers(names)
            samples = stats.merge(sampled, description["params"])
            context, own["updates"], refusal = self._tailoring_context(step, all_layers, description, samples)
            own["sources"] = context.sources
            saved = self._select_layers(all_layers, strategies.resolve(layers, context), refusal)
            pieces = [p for p in snapshot.pieces if layer_of(p.name) in saved]
            rows, blobs, created = self._store_pieces(step, pieces, background=prepared is not None)
            if rank_zero:
                own["samples"] = {name: s for name, s in samples.items() if layer_of(name) in saved}
                own["files"] = self._store_files(step, own["files"])
            return _RankShare(
                description if snapshot.rank == 0 else None, snapshot.world_size, all_layers,
                [layer for layer in all_layers if layer in saved], rows, blobs, created,
            )  # fmt: skip

        # The shared gc lock spans reading the previous step, reusing blobs and recording: a
        # concurrent gc (exclusive) runs wholly before or wholly after this commit.
        with self.objects.lock(exclusive=False):
            # Every rank measures the updates from every rank's samples, so all choose alike.
            sampled = collective.on_every_rank(f"commit of step {step}", sample_own_share)
            # Every rank's blobs are durable before any rank goes on (the gather is the barrier).
            shares = collective.on_every_rank(f"commit of step {step}", store_own_share)
            first = shares[0]
            rows = [row for share in shares for row in share.rows]
            blobs = list({blob.key: blob for share in shares for blob in share.blobs}.values())
            created = {key: size for share in shares for key, size in share.created.items()}
            saved = first.saved_layers
            if len(saved) == len(first.all_layers):
                layer_sources = {layer: step for layer in first.all_layers}
            else:
                inherited = own["sources"]  # a partial commit was allowed: the previous step's
                layer_sources = {
                    layer: step if layer in saved else inherited[layer] for layer in first.all_layers
                }

            collective.on_rank_zero(
                f"recording step {step}",
                lambda: self._record(
                    step, first.world_size, first.description, layer_sources, rows, blobs, created,
                    updates=own["updates"], samples=own["samples"], files=own["files"],
                ),
            )  # fmt: skip
            if self.manifest_commits:
                # Ranks on other machines have their own index: add the step rank 0 committed.
                catalog_sync.import_step(self.catalog, self.objects, step)
        return CommitReport(
            step=step,
            layers_saved=saved,
            layers_inherited={layer: s for layer, s in layer_sources.items() if s != step},
            tensors=len(rows),
            blobs_added=len(created),
            bytes_added=sum(created.values()),
            updates={layer: update for layer, (_, update) in own["updates"].items()},
        )

    def _tailoring_context(
        self, step: int, all_layers: list[str], description: dict, samples: dict[str, bytes]
    ) -> tuple[strategies.CommitContext, dict[str, tuple[int | None, float | None]], str | None]:
        """What a strategy sees at this commit, every layer's (step compared with, update), and
        why this commit must save every layer (None when it may inherit from the previous step)."""
        previous = self.catalog.latest_step(before=step)
        sources = self.catalog.sources(previous) if previous is not None else {}
        same_layers = list(sources) == all_layers
        if not same_layers:
            sources = {}  # another model: nothing to compare with, nothing to inherit
        updates = stats.layer_updates(all_layers, sources, description["params"], samples, self.catalog)
        refusal = self._inheritance_refusal(step, previous, same_layers, description)
        if refusal is not None:
            sources = {}
        context = strategies.CommitContext(
            step=step,
            layers=tuple(all_layers),
            steps=tuple(s for s in self.catalog.steps() if s < step),
            sources=sources,
            updates={layer: update for layer, (_, update) in updates.items()},
        )
        return context, updates, refusal

    def _store_files(self, step: int, entries: list | None) -> list[FileRow]:
        """Store the given auxiliary files; without any, the previous step's files are kept."""
        if entries is not None:
            return auxfiles.store(self.objects, entries)
        previous = self.catalog.latest_step(before=step)
        return self.catalog.files(previous) if previous is not None else []

    def _record(
        self,
        step: int,
        world_size: int,
        description: dict,
        layer_sources: dict[str, int],
        rows: list[TensorRow],
        blobs: list[BlobRow],
        created: dict[str, int],
        *,
        updates: dict[str, tuple[int | None, float | None]] | None = None,
        samples: dict[str, bytes] | None = None,
        files: list[FileRow] | None = None,
    ) -> None:
        """Write the step's manifest, then its catalog rows (the commit point)."""
        inherited_rows = [
            row
            for source in sorted(set(layer_sources.values()) - {step})
            for row in self.catalog.tensors(
                source, [layer for layer, s in layer_sources.items() if s == source]
            )
        ]
        all_blobs = {**self.catalog.blob_sizes(r.blob for r in inherited_rows), **{b.key: b for b in blobs}}
        manifest = Manifest(
            step=step,
            created_at=_now(),
            world_size=world_size,
            description=json.dumps(description, sort_keys=True, separators=(",", ":")),
            layer_sources=layer_sources,
            tensors=rows + inherited_rows,
            blobs=list(all_blobs.values()),
            updates=updates or {},
            files=files or [],
        )
        if self.manifest_commits:
            # The manifest, written create-only, is the commit point; the index follows it.
            catalog_sync.publish(self.objects, manifest)
            catalog_sync.import_manifest(
                self.catalog, manifest, blobs_added=len(created), bytes_added=sum(created.values()),
                samples=samples,
            )  # fmt: skip
            return
        # A manifest left by a commit that died before its catalog row is not a step; replace it.
        self.objects.delete(manifest_name(step))
        self.objects.put_if_absent(manifest_name(step), manifest.encode())
        self.catalog.record_step(
            step=step,
            created_at=manifest.created_at,
            world_size=world_size,
            description=manifest.description,
            layer_sources=layer_sources,
            tensors=rows,
            blobs=blobs,
            blobs_added=len(created),
            bytes_added=sum(created.values()),
            updates=updates,
            samples=samples,
            files=files,
        )

    @staticmethod
    def _select_layers(all_layers: list[str], layers: Iterable[str] | None, refusal: str | None) -> set[str]:
        if layers is None:
            return set(all_layers)
        if isinstance(layers, str):
            raise BadInputError("layers= takes a list of layer names, not a single string")
        wanted = list(dict.fromkeys(layers))
        unknown = [layer for layer in wanted if layer not in all_layers]
        if unknown:
            raise BadInputError(
                f"unknown layer{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                f"the model's layers are {', '.join(all_layers)}"
            )
        if len(wanted) < len(all_layers) and refusal is not None:
            raise BadInputError(refusal)
        return set(wanted)

    def _inheritance_refusal(
        self, step: int, previous: int | None, same_layers: bool, description: dict
    ) -> str | None:
        """Why ``step`` cannot inherit layers from ``previous`` (None when it can)."""
        if previous is None:
            return f"step {step} would be the store's first step, so it must save every layer (layers=None)"
        before = json.loads(self.catalog.description(previous))
        same_params = before["params"] == description["params"]
        if not (same_layers and same_params and before["world_size"] == description["world_size"]):
            return (
                f"the model or world size changed since step {previous}, so layers cannot be "
                "inherited from it; commit every layer (layers=None)"
            )
        return None

    def _store_pieces(
        self, step: int, pieces: list, *, background: bool = False
    ) -> tuple[list[TensorRow], list[BlobRow], dict[str, int]]:
        """Hash, encode and store pieces in parallel; returns rows, blob sizes, {created key: size}.

        ``background`` (a non-blocking commit) runs the work at a lower CPU priority.
        """

        # More threads than cores, so fsyncs and uploads overlap compression; the slots keep
        # the compressing threads to one per core. Every rank on this machine commits at once,
        # so each takes its share of the cores.
        cpu = threading.BoundedSemaphore(max(1, knobs.cpu_threads() // knobs.ranks_on_this_machine()))

        def store(piece) -> tuple[TensorRow, BlobRow, bool] | None:
            with cpu:
                if piece.redundant():
                    return None  # a module weight that is its fp32 master cast down
                key = codec.tensor_key(piece.tensor)
            name = blob_name(key)
            raw_size = _piece_bytes(piece)
            created = False
            # Hashing is cheap, compressing is not: an existing blob is only freshened.
            size = self.objects.touch(name)
            if size is None:
                with cpu:
                    key, parts = codec.encode_parts(piece.tensor, key)
                created = self.objects.put_if_absent(name, parts)
                size = data_size(parts)
            row = TensorRow(
                step, layer_of(piece.name), piece.name, piece.kind, piece.start, piece.tensor.numel(), key
            )
            return row, BlobRow(key, size, raw_size), created

        with ThreadPoolExecutor(
            knobs.io_threads(), initializer=lower_thread_priority if background else None
        ) as pool:
            # Largest first, so no big tensor starts last while the other threads sit idle.
            tasks = {id(p): pool.submit(store, p) for p in sorted(pieces, key=_piece_bytes, reverse=True)}
            results = [result for p in pieces if (result := tasks[id(p)].result()) is not None]
        rows = [r for r, _, _ in results]
        blobs = {blob.key: blob for _, blob, _ in results}
        created = {blob.key: blob.size for _, blob, was_created in results if was_created}
        return rows, list(blobs.values()), created

    # -- materialize -----------------------------------------------------------------------

    def materialize(
        self,
        step: int | None = None,
        out: str | os.PathLike | None = None,
        *,
        spec: compose.Spec | None = None,
        world_size: int | None = None,
        force: bool = False,
    ) -> Path:
        """Write a DeepSpeed checkpoint directory for ``step`` at ``out`` and return its path.

        ``out`` gets ``latest`` and ``global_step<step>/``, and the step's auxiliary files;
        ``engine.load_checkpoint(out)`` resumes from it. Instead of a step, ``spec`` (a compose
        spec: YAML file or mapping, see ``ckptstore.compose``) picks the step of every layer
        range and of the non-tensor state, which names the directory. The directory is built
        beside ``out`` and renamed into place, so ``out`` never holds a partial checkpoint. An
        existing non-empty ``out`` is refused unless ``force``. Raises NotFoundError (unknown
        step, missing blob), BadInputError (a bad spec: nothing is written), CorruptError (a
        blob fails verification: nothing is written), ConflictError (non-empty ``out``).
        """
        from .deepspeed.write import write_checkpoint

        if out is None:
            raise BadInputError("materialize needs an output directory")
        sources = None
        if spec is not None:
            if step is not None:
                raise BadInputError("materialize takes a step or a compose spec, not both")
            plan = compose.plan(spec, self.catalog)
            step, sources = plan.state, plan.sources
        step = _check_step(step)
        if world_size is not None and (not isinstance(world_size, int) or world_size < 1):
            raise BadInputError(f"world size must be a positive integer, not {world_size!r}")
        description = json.loads(self.catalog.description(step))
        out = Path(out).absolute()
        if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
            raise ConflictError(f"output directory {out} exists and is not empty (use --force to replace it)")
        tensors = self._reader(step, description, sources)
        files = self.catalog.files(step)
        auxfiles.check_rows(files)

        out.parent.mkdir(parents=True, exist_ok=True)
        staging = out.parent / f".{out.name}.ckptstore-{uuid.uuid4().hex[:8]}.tmp"
        try:
            write_checkpoint(description, tensors, staging, f"global_step{step}", world_size)
            auxfiles.copy_out(self.objects, files, staging)
            self._swap_into_place(staging, out)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return out

    @staticmethod
    def _swap_into_place(staging: Path, out: Path) -> None:
        if out.exists():
            trash = out.parent / f".{out.name}.ckptstore-old-{uuid.uuid4().hex[:8]}"
            out.rename(trash)
            staging.rename(out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            staging.rename(out)

    def _reader(self, step: int, description: dict, sources: dict[str, int] | None = None) -> StepReader:
        """A lazy reader of every tensor ``step`` (or ``sources``) needs."""
        sources = self.catalog.sources(step) if sources is None else sources
        by_source: dict[int, list[str]] = defaultdict(list)
        for layer, source in sources.items():
            by_source[source].append(layer)
        rows = [row for source, layers in by_source.items() for row in self.catalog.tensors(source, layers)]
        missing_layers = set(sources) - {row.layer for row in rows}
        if missing_layers:
            raise CorruptError(
                f"the catalog has no tensors for layers {', '.join(sorted(missing_layers))} of step {step}"
            )
        sizes = self.catalog.blob_sizes(row.blob for row in rows)
        return StepReader(self.objects, description["params"], rows, sizes, step)

    # -- retention -------------------------------------------------------------------------

    def gc(
        self,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_steps: Iterable[int] = (),
        grace: timedelta | float | None = None,
        dry_run: bool = False,
        allow_empty: bool = False,
        now: float | None = None,
    ) -> GcReport:
        """Drop the steps the retention rules do not keep, then delete blobs and files no kept step needs.

        Blobs younger than ``grace`` (default ``CKPTSTORE_GC_GRACE`` seconds, 1 hour) are never
        deleted. With no rule, no step is dropped and only unreferenced blobs go. ``dry_run``
        changes nothing and reports what a real run would free. Safe to run while commits run.
        """
        return collect(
            self, keep_last=keep_last, keep_every=keep_every, keep_steps=keep_steps, grace=_seconds(grace),
            dry_run=dry_run, allow_empty=allow_empty, now=now,
        )  # fmt: skip

    def delete(self, step: int, *, dry_run: bool = False) -> GcReport:
        """Drop one step's record; its blobs go at the next gc unless other steps need them.

        Raises NotFoundError for an unknown step.
        """
        step = _check_step(step)
        self.catalog.description(step)  # NotFoundError names the known steps
        return collect(self, drop_steps=[step], grace=float("inf"), dry_run=dry_run, allow_empty=True)

    # -- verify ----------------------------------------------------------------------------

    def verify(self, *, deep: bool = True) -> VerifyReport:
        """Check every blob and auxiliary file the committed steps reference, and the catalog.

        Fast mode (``deep=False``) checks that every blob exists with the size the catalog
        recorded, from one listing; ``deep`` also reads, decodes and re-hashes every blob.
        Read-only: problems are reported, never repaired. Unreferenced blobs (orphans) and
        manifests of steps that never committed are information, not problems.
        """
        users = self.catalog.referenced_blobs()
        sizes = self.catalog.blob_sizes(users)
        report = VerifyReport(deep=deep)
        report.catalog_problems.extend(self.catalog.consistency_problems())
        for blob in users:
            if blob not in sizes:
                report.catalog_problems.append(f"blob {blob} is referenced but has no size record")
        steps = set(self.catalog.steps())
        manifests = {
            int(info.name.rsplit("/", 1)[-1].split(".")[0]) for info in self.objects.list("manifests/")
        }
        report.catalog_problems.extend(
            f"step {step} has no manifest in the store (a catalog rebuild would lose it)"
            for step in sorted(steps - manifests)
        )
        report.stray_manifests = sorted(manifests - steps)
        stored = {info.name.rsplit("/", 1)[-1]: info.size for info in self.objects.list("blobs/")}
        cpu = threading.BoundedSemaphore(knobs.cpu_threads())

        def check(key: str) -> tuple[str, str | None, int]:
            if key not in stored:
                return key, "is missing", 0
            if key in sizes and stored[key] != sizes[key].size:
                return key, f"has {stored[key]} bytes, the catalog recorded {sizes[key].size}", stored[key]
            if deep:
                try:
                    fetch_blob(self.objects, key, cpu)
                except NotFoundError:
                    return key, "is missing", 0
                except CorruptError as exc:
                    return key, f"is corrupt ({exc})", stored[key]
            return key, None, stored[key]

        with ThreadPoolExecutor(knobs.io_threads()) as pool:
            checks = pool.map(check, users) if deep else map(check, users)
            for key, problem, size in progress_bar(checks, total=len(users), desc="verify", unit="blob"):
                report.blobs_checked += 1
                report.bytes_checked += size
                if problem:
                    report.problems.append(BlobProblem(key, problem, users[key]))
        report.orphans = sorted(set(stored) - set(users))
        self._verify_files(report, deep)
        return report

    def _verify_files(self, report: VerifyReport, deep: bool) -> None:
        """Check the auxiliary files committed steps carry: there, of the recorded size, and (deep) intact."""
        stored = {info.name.rsplit("/", 1)[-1]: info.size for info in self.objects.list("files/")}
        for key, users in self.catalog.referenced_files().items():
            report.files_checked += 1
            size = users[0][2]
            if key not in stored:
                problem = "is missing"
            elif stored[key] != size:
                problem = f"has {stored[key]} bytes, the catalog recorded {size}"
            elif deep and auxfiles.file_key(self.objects.get(auxfiles.file_name(key))) != key:
                problem = "is corrupt (its content does not hash to its key)"
            else:
                continue
            report.file_problems.append(FileProblem(key, problem, users))


def open(  # noqa: A001 - the public name
    uri: str | os.PathLike, *, create: bool = True, endpoint_url: str | None = None
) -> Store:
    """Open (and by default create) the store at ``uri``: a path, ``file://`` or ``s3://bucket/prefix``.

    An S3 store's catalog is a local index under ``CKPTSTORE_CACHE``, brought up to date from
    the bucket's manifests here (steps committed elsewhere later appear on the next open).
    ``endpoint_url`` names an S3-compatible server (default: ``AWS_ENDPOINT_URL``, else AWS).
    Raises NotFoundError if the store (or its bucket) does not exist and ``create`` is false,
    UnsupportedError if it was written by a newer ckptstore format, StorageError if the
    storage cannot be reached or refuses access.
    """
    objects = _open_objects(uri, create=create, endpoint_url=endpoint_url)
    root = getattr(objects, "root", None)
    if root is None:
        return Store(objects, catalog_sync.open_index(objects), manifest_commits=True)
    return Store(objects, Catalog(Path(root) / "catalog.db"))


def rebuild_catalog(uri: str | os.PathLike, *, endpoint_url: str | None = None) -> catalog_sync.SyncReport:
    """Replace the store's catalog by one rebuilt from its manifests; returns what it holds.

    For an S3 store that is the local index; for a local store its ``catalog.db`` (which may
    be missing or corrupt). Every step whose manifest is readable and whose blobs are all
    present comes back, including, on a local store, steps whose commit was interrupted
    between manifest and catalog row. Run it while nothing else uses the store's catalog.
    Raises NotFoundError if there is no store at ``uri``.
    """
    objects = _open_objects(uri, create=False, endpoint_url=endpoint_url)
    root = getattr(objects, "root", None)
    path = catalog_sync.cache_path(objects) if root is None else Path(root) / "catalog.db"
    return catalog_sync.rebuild(path, objects)


def _open_objects(uri: str | os.PathLike, *, create: bool, endpoint_url: str | None) -> ObjectStore:
    uri = os.fspath(uri)
    if not uri:
        raise BadInputError("no store given (pass a path or URI, or set CKPTSTORE_STORE)")
    objects = open_objects(uri, create=create, endpoint_url=endpoint_url)
    _check_config(objects)
    return objects


def _check_config(objects: ObjectStore) -> None:
    try:
        config = json.loads(objects.get(CONFIG_NAME))
    except NotFoundError:
        config = {"format_version": STORE_FORMAT_VERSION, "hash": "xxh3-128", "codec": "ckpb1+zstd"}
        objects.put_if_absent(CONFIG_NAME, json.dumps(config, sort_keys=True).encode())
        return
    except ValueError:
        raise CorruptError(f"{objects.uri}/{CONFIG_NAME} is not valid JSON") from None
    version = config.get("format_version")
    if not isinstance(version, int) or version > STORE_FORMAT_VERSION:
        raise UnsupportedError(
            f"the store {objects.uri} has format version {version}; this ckptstore reads up to "
            f"{STORE_FORMAT_VERSION} (upgrade ckptstore)"
        )
