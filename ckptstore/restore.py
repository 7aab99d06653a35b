"""Restore: a committed step straight into a live engine, each rank reading only its share.

No checkpoint directory is written. Each rank builds, in memory, the files DeepSpeed's
``load_checkpoint`` would read on that rank for the job's current world size
(``deepspeed.write``: its own ZeRO partition and the model states), reading from the store
only the fragments they hold (``StepReader.span``: from a store across a network, the
entries of each pack the rank reads in one request), then DeepSpeed itself loads them (``deepspeed.load``), so the engine ends exactly as
``load_checkpoint`` of a materialized directory leaves it, every option included.

Collective: every rank calls it. Phases: (1) every rank agrees on the step (rank 0's choice);
(2) every rank reads and verifies its share; a failure on any rank raises on every rank,
naming it, before the engine is touched; (3) DeepSpeed loads.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

from .arguments import check_engine, check_step
from .catalog import Catalog
from .commit import ranks
from .errors import BadInputError, CkptStoreError, NotFoundError, StorageError, UnsupportedError
from .materialize import compose
from .materialize.directory import check_resumable, step_reader
from .model import FP32
from .objects import ObjectStore

if TYPE_CHECKING:
    from .deepspeed.load import RankShare
    from .tier.recover import Recovery

log = logging.getLogger("ckptstore")

# What a failed read leaves, said in the error. At ZeRO 1/2 restore decodes straight into the
# engine's own fp32 masters first, then its optimizer state, deriving the module weights from
# the masters in between; elsewhere nothing of the engine's is written before the load.
_UNCHANGED = "the engine is unchanged"
_MASTERS = (
    "the engine's module weights are unchanged, its fp32 masters and optimizer state may be "
    "partly overwritten: restore again before training"
)
_STATE = (
    "the engine's module weights and fp32 masters are the step's, its optimizer state may be "
    "partly overwritten: restore again before training"
)


def restore(
    objects: ObjectStore,
    catalog: Catalog,
    engine: Any,
    step: int | None = None,
    *,
    spec: compose.Spec | None = None,
    recovery: Recovery | None = None,
    **options: bool,
) -> tuple[int, dict | None]:
    """Load ``step`` (default: the newest; or a compose ``spec``) into ``engine``, as
    ``Store.restore`` documents, with ``options`` (``load_optimizer_states``,
    ``load_lr_scheduler_states``, ``load_module_only``) as ``load_checkpoint`` takes them.
    ``recovery``: read what this node's tier lacks from the job's other tiers first
    (``tier.recover``; the newest step is then the newest the job can assemble).
    Returns ``(step, client_state)``. BadInputError for a step outside 0..2**63-1, what is
    no DeepSpeed engine, or one configured to load a universal checkpoint."""
    from .deepspeed.extract import optimizer_flavour
    from .deepspeed.load import load_from_memory, start_module_weights

    check_engine(engine)
    if getattr(engine, "load_universal_checkpoint", lambda: False)():
        # DeepSpeed's load_checkpoint then reads nothing but ds_to_universal's zero/ folder.
        raise BadInputError(
            'this engine is configured with "checkpoint": {"load_universal": true}, for which DeepSpeed '
            "loads only a universal checkpoint: restore into an engine without it (a restore into "
            f"another layout reshards on its own); {_UNCHANGED}"
        )
    step = None if step is None else check_step(step)

    def choose() -> int:
        if spec is None and step is None:
            newest = catalog.latest_step()
            if newest is None:
                raise NotFoundError(f"{objects.uri} has no committed step to restore")
            return newest
        return compose.step_or_spec(step, spec, catalog, "restore")[0]

    if recovery is not None:
        recovery.share_manifests("restore")
    if recovery is not None and spec is None and step is None:
        chosen = recovery.newest("restore")
    else:
        chosen = ranks.on_every_rank("restore", choose)[0]  # rank 0's answer, for every rank
    what = f"restore of step {chosen}"
    flavour = optimizer_flavour(engine)
    written = [False]  # whether this rank has written into the engine's own tensors

    def first_phase(share: RankShare) -> None:  # the masters alone where the weights overlap the rest
        written[0] = share.in_place
        if not objects.reads_are_local:
            # Across a network every kind is read in one pass, so that each pack's entries
            # come in one request: a pass per kind would fetch every pack once per pass.
            share.overlaps = False
        share.fill((lambda kind: kind == FP32) if share.overlaps else (lambda kind: True))

    try:
        share = ranks.each_rank(what, lambda: _plan(objects, catalog, engine, flavour, chosen, spec, options))
        if recovery is not None:
            recovery.fetch(chosen, ranks.each_rank(what, share.objects))
            log.info("ckptstore: restore of %s", recovery.sources.describe())
        ranks.each_rank(what, lambda: first_phase(share))
    except CkptStoreError as exc:
        raise type(exc)(f"{exc} ({_MASTERS if written[0] else _UNCHANGED})") from None
    if share.overlaps:
        # The masters are in: the module weights are cast and all-gathered from them while the
        # optimizer state is read, where DeepSpeed would do it after the whole load.
        module_weights = start_module_weights(engine, flavour)
        try:
            ranks.each_rank(what, lambda: share.fill(lambda kind: kind != FP32))
        except Exception as exc:
            module_weights()  # every rank started the all-gather: each finishes it
            if isinstance(exc, CkptStoreError):
                raise type(exc)(f"{exc} ({_STATE})") from None
            raise
        # Finished before the load, not after it: DeepSpeed's load reads and writes module
        # weights, the very memory the all-gather fills on gloo's own thread. A pipeline's
        # (PipelineModule.load_state_dir) ends by broadcasting each tied weight from its first
        # stage: sent before the gather had filled it, a rank's tied embedding stayed the fresh
        # engine's on the other stage (seen with the first stage's gloo threads held up, as a
        # loaded host holds them up).
        module_weights()
    try:
        _, client_state = load_from_memory(
            engine, engine.load_checkpoint, share.files, f"global_step{chosen}", **options
        )
        if share.skip_module_weights and not share.overlaps:  # left unread: derived from the loaded masters
            engine.optimizer.update_lp_params()
    except CkptStoreError:
        raise
    except Exception as exc:
        raise StorageError(
            f"{what}: DeepSpeed failed loading it on rank {ranks.world()[0]} ({type(exc).__name__}: {exc}); "
            "the engine may be partly restored: restore again or rebuild it"
        ) from exc
    return chosen, client_state


def _plan(
    objects: ObjectStore,
    catalog: Catalog,
    engine: Any,
    flavour: str,
    chosen: int,
    spec: compose.Spec | None,
    options: dict[str, bool],
) -> RankShare:
    """This rank's share of step ``chosen`` (or of ``spec``), checked against the engine, not yet read."""
    from .deepspeed import experts, parallel, reshard
    from .deepspeed.extract import check_engine, dp_rank, extract
    from .deepspeed.load import RankShare, derives_module_weights, engine_tensors, loads_partitions

    check_engine(engine, flavour)
    state, sources = compose.step_or_spec(chosen if spec is None else None, spec, catalog, "restore")
    check_resumable(catalog, state, sources)
    description = json.loads(catalog.description(state))
    stage = engine.zero_optimization_stage()
    if (description["flavour"], description["zero_stage"]) != (flavour, stage):
        raise BadInputError(
            f"step {state} was committed by a ZeRO-{description['zero_stage']} engine "
            f"({description['flavour']}); this one runs ZeRO-{stage} ({flavour})"
        )
    reader = step_reader(objects, catalog, state, description, sources)
    # the engine's experts are the step's, spread over the engine's expert-parallel ranks
    description = experts.with_ep_size(description, experts.ep_size_of(engine), engine.dp_world_size, state)
    if not parallel.same_split(description, engine, f"step {state}"):
        if "experts" in description:
            raise UnsupportedError(
                f"step {state} holds MoE layers and was committed by an engine split otherwise "
                "(other pipeline stages or tensor-parallel slices); restore it into the same split"
            )
        stored = description
        # The engine is split as the step's own universal_checkpoint_info says, if it has one.
        target = extract(engine, reshard.split_info(stored)).description
        description = reshard.recut(stored, target, f"step {state}")
        reader = reshard.Relayout(reader, stored["params"], description["params"])
    # Where the load copies the fp32 masters and optimizer state into the engine's own buffers,
    # they are decoded straight into those buffers instead: no second copy in memory, and the
    # module weights the load then derives are handed over as the engine's own, never copied.
    rank = dp_rank(engine)
    derive = derives_module_weights(engine, flavour, options)
    into = (
        engine_tensors(engine, flavour, rank, module_weights=derive)
        if loads_partitions(engine, flavour, options)
        else None
    )
    share = RankShare(
        description, reader, engine.dp_world_size, rank, skip_module_weights=derive, into=into,
        mp_rank=getattr(engine, "checkpoint_mp_rank", 0), slices=parallel.tensor_degree(engine),
    )  # fmt: skip
    experts.hand_optimizer_file_as_asked(share.files, engine, getattr(engine, "checkpoint_mp_rank", 0))
    return share
