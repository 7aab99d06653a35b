"""``Store``: the library's face. One short method per verb; the parts below do the work.

``commit`` (the ``commit`` package), ``materialize`` (``materialize``), ``verify``, ``gc``;
the queries (``queries.StoreQueries``) go to the ``catalog``. ``ckptstore.open`` (``opening``) builds a Store from a URI.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from . import auxfiles, frontdoors, strategies
from .arguments import check_step, while_open
from .catalog import Catalog
from .commit.deltas import Versions
from .commit.engine import EngineCommits
from .commit.queue import CommitHandle
from .commit.step import CommitReport
from .errors import BadInputError
from .export.folder import DEFAULT_MAX_SHARD_SIZE, ExportReport
from .export.folder import export as export_folder
from .gc import GcReport, collect, delete_step
from .materialize import compose, outputs
from .objects import ObjectStore
from .queries import StoreQueries
from .restore import restore as restore_engine
from .retention import KeepBest, grace_seconds
from .tier import Tier
from .tier.verbs import TierVerbs
from .verify import VerifyReport, verify

__all__ = ["Store", "CommitReport", "VerifyReport"]


class Store(StoreQueries, TierVerbs):
    """A checkpoint store: blobs in an ObjectStore, an index of the steps in a Catalog."""

    def __init__(self, objects: ObjectStore, catalog: Catalog, *, tier: Tier | None = None) -> None:
        self.objects = objects
        self.catalog = catalog
        #: The local tier in front of the store (``open(local=...)``), or None.
        self.tier = tier
        self._commits = EngineCommits(objects, catalog, tier)
        self._closed = False

    def close(self) -> None:
        """Flush a background commit in flight (raising its error), then release the catalog."""
        if self._closed:
            return
        self._closed = True
        try:
            self._commits.close()
        finally:
            try:
                if self.tier is not None:
                    self.tier.close()
            finally:
                self.catalog.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- commit ----------------------------------------------------------------------------

    @while_open
    def commit(
        self,
        engine: Any,
        step: int,
        layers: strategies.Selection = None,
        client_state: dict | None = None,
        files: auxfiles.FileSpec | None = None,
        *,
        metrics: Mapping[str, float] | None = None,
        blocking: bool = True,
        when_busy: str = "wait",
    ) -> CommitReport | CommitHandle:
        """Store the engine's checkpoint state as ``step``. Collective: every rank calls it.

        ``layers`` = None saves every layer; a list saves only those layers and inherits the
        rest from the newest earlier step; a ``ckptstore.strategies.Strategy`` or a callable
        ``(layer, context) -> bool`` chooses them from the store's history and the update
        statistics (a store's first commit saves every layer whatever they say). Every commit
        records each layer's update since its last save (``show``). ``client_state`` is kept
        like DeepSpeed's ``save_checkpoint(client_state=...)``. ``files`` (paths, or a
        directory) are kept with the step and copied out by ``materialize``; each rank's own
        are kept (the same path from two ranks must have the same contents); None on every
        rank keeps the previous step's.

        Blocking (the default): returns the CommitReport once the step is durable.
        ``blocking=False``: returns a CommitHandle at once; the tensors are copied into host
        buffers in the background while training goes on, and the engine's next optimizer
        step waits until that copy is done (forward and backward passes do not change what
        is saved). Do not change the engine's state any other way (``load_checkpoint``,
        editing weights) before ``handle.result()``. Hashing, compression, writes and
        recording run in the background too. ``handle.result()`` or ``store.wait()`` waits
        and raises if that failed; the next commit and ``close()`` wait too. The error is
        raised once: after ``handle.result()`` raised it, neither ``store.wait()``, the next
        commit (which then commits its own step) nor ``close()`` raises it again; else the
        first of them raises it (the next commit then records nothing of its own step).

        ``when_busy`` (non-blocking commits) says what a commit does while the previous one
        still runs: ``"wait"`` for it (the default), ``"latest"``: queue this snapshot behind
        it, replacing one queued and not started (at most one runs and one waits, so a
        commit every step never holds training for more than the snapshot copy), or
        ``"skip"`` this step. A replaced or skipped step is not committed: its handle's
        ``outcome`` says which, and ``result()`` is None. Every rank decides alike.

        Raises ConflictError if the step exists, BadInputError (before any work) for a step
        outside 0..2**63-1, an ``engine`` that is no DeepSpeed engine, ``layers`` that are not
        names, unknown layers, a partial first commit, unusable files or a malformed
        ``universal_checkpoint_info`` (``deepspeed.universal_info.check_universal_info``), UnsupportedError for
        engines ckptstore cannot store, StorageError when the store or its catalog cannot be
        written (full disk, read-only). On any error nothing is recorded, except that a
        StorageError from recording the catalog's rows after the manifest leaves the step
        committed (the next open lists it). Every method of a closed store raises BadInputError.
        """
        return self._commits.commit(
            engine, step, layers, client_state, files, metrics=metrics, blocking=blocking, when_busy=when_busy
        )

    def wait(self) -> CommitReport | None:
        """Wait for a background commit in flight; returns its report, raises its error."""
        return self._commits.wait()

    def delta_versions(self) -> Versions | None:
        """What this rank's next commit, or DCP save, stores changed tensors as deltas against
        (``commit.deltas.Versions``; None with ``CKPTSTORE_DELTA_CHAIN=1``)."""
        return self._commits.delta_versions()

    def replicate_behind(self, step: int) -> None:
        """Copy this rank's share of ``step`` into its peers' tiers behind training (with
        ``replicas``; else nothing): what a commit does after it, and what the DCP writer asks
        for once its packs are durable. Collective: every rank calls it for the same steps."""
        self._commits.replicate_behind(step)

    # -- reading back ----------------------------------------------------------------------

    @while_open
    def materialize(
        self,
        step: int | None = None,
        out: str | os.PathLike | None = None,
        *,
        spec: compose.Spec | None = None,
        world_size: int | None = None,
        force: bool = False,
        tag: str | None = None,
        allow_pickle: bool = False,
        universal: bool = False,
        ep_size: int | None = None,
    ) -> Path:
        """Write a DeepSpeed checkpoint directory for ``step`` at ``out`` and return its path.

        ``out`` gets ``latest`` and ``<tag>/`` (default ``global_step<step>``, what
        ``save_checkpoint`` names it; accelerate's ``save_state`` uses ``pytorch_model``), and
        the step's auxiliary files at the paths they were kept under;
        ``engine.load_checkpoint(out)`` resumes from it, at ``world_size`` ranks (default: the
        committed one). Instead of a step, ``spec`` (a compose spec: YAML file or mapping, see
        ``ckptstore.materialize.compose``) picks the step of every layer range and of the
        non-tensor state, which names the directory. The directory is built beside ``out``
        and renamed into place, so ``out`` never holds a partial checkpoint. An existing
        non-empty ``out`` is refused unless ``force``, and ``force`` replaces only a folder
        materialize or export wrote (``materialize.outputs``). Raises NotFoundError (unknown
        step, missing blob), BadInputError (a bad spec, or an ``out`` that is empty, is, holds
        or lies in the store, or holds the working directory: nothing is written),
        CorruptError (a blob fails verification, or an auxiliary file row names a path
        ``auxfiles.refusal`` refuses: nothing is written), ConflictError (non-empty ``out``),
        StorageError naming ``out`` when it cannot be written (full disk, read-only file
        system, permissions, ``ulimit -f``: nothing is left there). ``world_size`` is at most
        the trainable parameter elements and under ``ulimit -n`` (BadInputError). A step with
        DeepSpeed MoE layers is written for ``ep_size`` expert-parallel ranks (default: the
        committed degree), which must divide ``world_size`` and every layer's experts
        (BadInputError, as is ``ep_size`` for a step without experts): DeepSpeed's own load
        cannot change the degree, the store can (docs/moe.md).

        A step saved through DCP (``integrations.dcp.StoreWriter``) becomes a standard DCP
        checkpoint directory instead (``FileSystemReader`` and ``dcp_to_torch_save`` read it),
        which loads at any world size: ``world_size`` and ``tag`` do not apply to it.

        Every pickle or torch file written (an auxiliary file, a DCP bytes item) is one
        ckptstore serializes from the plain data kept at commit (``format.plainfile``), never
        store bytes. An auxiliary file kept as bytes that an unpickler could read is left out
        with a warning naming it, and a DCP bytes item kept as bytes is a CorruptError naming
        step and item (nothing written); ``allow_pickle=True`` writes them as stored, and
        loaders of ``out`` (accelerate's ``load_state``, DCP) run any code in them: only for a
        trusted store.

        ``universal=True`` writes instead what DeepSpeed's ``ds_to_universal`` writes for the
        step, straight from the store: ``out/latest_universal`` and
        ``out/global_step<step>_universal/`` (``zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt``,
        ``zero/optimizer_state.pt``, the model-states files), which ``load_checkpoint`` with
        ``load_universal`` reads at another layout (``materialize.universal``). Only a ZeRO-1/2
        step without model parallelism yet: UnsupportedError naming anything else, and
        BadInputError with ``spec``, ``world_size`` or ``tag``.
        """
        return frontdoors.materialize(
            self.objects, self.catalog, step, out,
            spec=spec, world_size=world_size, force=force, tag=tag, allow_pickle=allow_pickle,
            universal=universal, ep_size=ep_size,
        )  # fmt: skip

    @while_open
    def export(
        self,
        step: int | None = None,
        out: str | os.PathLike | None = None,
        *,
        spec: compose.Spec | None = None,
        dtype: str | torch.dtype | None = None,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
        force: bool = False,
    ) -> ExportReport:
        """Write ``step``'s model weights as a Hugging Face model folder at ``out``.

        ``out`` gets ``model.safetensors`` (or, past ``max_shard_size`` bytes such as
        ``"2GB"``, shards with ``model.safetensors.index.json``) as ``save_pretrained`` writes
        it, so ``from_pretrained(out)`` loads it, plus the model-folder files kept with the
        step (``config.json``, ``generation_config.json``, tokenizer files). The weights are
        the step's fp32 masters (frozen weights and buffers as stored) cast to ``dtype``
        (float32, bfloat16 or float16; default the training dtype); tied weights are written
        once. ``spec`` (a compose spec) instead of a step takes each layer from its step.
        Memory stays a few tensors; ``out`` appears only once complete, and an existing
        non-empty ``out`` is refused unless ``force`` (which replaces only a folder materialize
        or export wrote, as for ``materialize``). Of a step saved through DCP, the weights are
        the full tensors of the state dict's ``model`` entry (``state_dict``), cast to ``dtype``
        (default: the dtype most were saved in). Raises NotFoundError (unknown step, missing
        pack), BadInputError (bad dtype, size, spec or ``out``), CorruptError, ConflictError,
        StorageError naming ``out`` when it cannot be written (as ``materialize``).
        """
        if out is None:
            raise BadInputError("export needs an output directory")
        with outputs.writing(out, "export"):
            return export_folder(
                self.objects, self.catalog, step, out,
                spec=spec, dtype=dtype, max_shard_size=max_shard_size, force=force,
            )  # fmt: skip

    @while_open
    def state_dict(
        self,
        step: int | None = None,
        dtype: str | torch.dtype | None = torch.float32,
        *,
        spec: compose.Spec | None = None,
    ) -> dict[str, torch.Tensor]:
        """The consolidated weights of ``step`` in memory: ``{name: tensor}`` in the module's order.

        What DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` returns for the same
        state, without a checkpoint directory: fp32 masters of trainable parameters, frozen
        weights and persistent buffers, and tied names sharing one tensor. Floating tensors
        are cast to ``dtype`` (None keeps them as stored). Of a step saved through DCP
        (``integrations.dcp.StoreWriter``): the full tensors of the state dict's ``model``
        entry under its own keys (of a flat state dict, its parameters). Raises as ``export``.
        """
        return frontdoors.state_dict(self.objects, self.catalog, step, dtype, spec)

    @while_open
    def restore(
        self,
        engine: Any,
        step: int | None = None,
        *,
        spec: compose.Spec | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
    ) -> tuple[int, dict | None]:
        """Put ``engine`` where it was at ``step`` (default: the newest step), straight from the
        store; returns ``(step, client_state)``. Collective: every rank calls it.

        The engine ends as ``engine.load_checkpoint`` of ``materialize(step,
        world_size=<the job's>)`` would leave it (module weights, fp32 masters, optimizer
        state, scheduler, counters, loss scaler), with the same three load options, at any
        world size the step was committed at; ``spec`` (a compose spec) instead of a step. No
        directory is written: each rank reads only the fragments its own partition holds (at
        ZeRO 0 every rank holds everything); at ZeRO 1-3 the fp32 masters and optimizer state
        are decoded straight into the engine's own tensors, so it takes almost no memory
        beyond the engine's. A failure while reading on any rank raises on every rank, naming
        it, before DeepSpeed loads anything; the message says what the engine then holds
        (at ZeRO 1-3 its masters and optimizer state may be partly overwritten: restore again
        before training). Raises NotFoundError (no such step, missing pack),
        WeightsOnlyError, CorruptError, BadInputError (a bad spec, an engine of another ZeRO
        stage or optimizer).
        """
        recovery = self.tier.recovery(self.objects, self.catalog) if self.tier is not None else None
        restored = restore_engine(
            self.objects, self.catalog, engine, step, spec=spec, recovery=recovery,
            load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
            load_module_only=load_module_only,
        )  # fmt: skip
        if recovery is not None:
            self.tier.restored_from = recovery.sources
        return restored

    @while_open
    def verify(self, *, deep: bool = True, quarantine: bool = False) -> VerifyReport:
        """Check every step's manifest, and every blob and auxiliary file the committed steps
        reference, and the catalog.

        Every manifest is read and compared with the catalog's rows of its step. Fast mode
        (``deep=False``) checks that every blob exists with the size the catalog recorded, from
        one listing; ``deep`` also reads, decodes and re-hashes every blob. Read-only: problems
        are reported, never repaired. Unreferenced blobs (orphans) and stray objects are
        information, not problems. ``quarantine``: then move the manifests it could not read or
        authenticate to ``quarantine/`` (kept; see ``ckptstore.quarantine``), so that gc runs.
        """
        return verify(self.objects, self.catalog, deep=deep, quarantine=quarantine)

    # -- retention -------------------------------------------------------------------------

    @while_open
    def gc(
        self,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_steps: Iterable[int] = (),
        keep_best: Iterable[KeepBest | str] = (),
        keep_weights_every: int | None = None,
        keep_weights_last: int | None = None,
        grace: timedelta | float | None = None,
        dry_run: bool = False,
        allow_empty: bool = False,
        now: float | None = None,
    ) -> GcReport:
        """Drop the steps the retention rules do not keep, then delete blobs and files no kept step needs.

        ``keep_best`` keeps the best steps by a metric recorded with ``commit(metrics=...)``:
        ``["eval_loss:min", "accuracy:max:3"]`` (``NAME:min|max[:COUNT]``, COUNT default 1).
        ``keep_weights_every=K`` / ``keep_weights_last=N`` keep, of the steps no other rule
        keeps, those divisible by K / the N newest as *weights-only* steps: their weights stay
        (``export``, ``state_dict``), their optimizer state goes, except what a whole-kept step
        inherits; ``materialize`` refuses them.
        Blobs younger than ``grace`` (default ``CKPTSTORE_GC_GRACE`` seconds, 1 hour) are never
        deleted. With no rule, no step is dropped and only unreferenced blobs go. ``dry_run``
        changes nothing and reports what a real run would free. Safe to run while commits run.
        Every step the catalog lacks is imported from its manifest first: CorruptError
        (nothing changed) while such a manifest cannot be read, or a kept step misses a blob.
        BadInputError through a local tier (``open(local=...)``): gc runs on the store itself.
        StorageError (nothing changed) when the catalog cannot be written (full disk, read-only
        mount); ``dry_run`` still works there.
        """
        self._refuse_tier("gc")
        return collect(
            self.objects, self.catalog, keep_last=keep_last, keep_every=keep_every, keep_steps=keep_steps,
            keep_best=keep_best, keep_weights_every=keep_weights_every, keep_weights_last=keep_weights_last,
            grace=grace_seconds(grace), dry_run=dry_run, allow_empty=allow_empty, now=now,
        )  # fmt: skip

    @while_open
    def delete(self, step: int, *, dry_run: bool = False) -> GcReport:
        """Drop one step's record; its blobs go at the next gc unless other steps need them.

        Raises NotFoundError for an unknown step, BadInputError through a local tier,
        StorageError when the catalog cannot be written (full disk, read-only mount).
        """
        self._refuse_tier("delete")
        return delete_step(self.objects, self.catalog, check_step(step), dry_run=dry_run)
