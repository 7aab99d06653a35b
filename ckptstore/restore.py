"""Restore: a committed step straight into a live engine, each rank reading only its share.

No checkpoint directory is written. Each rank builds, in memory, the files DeepSpeed's
``load_checkpoint`` would read on that rank for the job's current world size
(``deepspeed.write``: its own ZeRO partition and the model states), reading from the store
only the fragments they hold (``StepReader.span``: a ranged read per fragment of its own
share), then DeepSpeed itself loads them (``deepspeed.load``), so the engine ends exactly as
``load_checkpoint`` of a materialized directory leaves it, every option included.

Collective: every rank calls it. Phases: (1) every rank agrees on the step (rank 0's choice);
(2) every rank reads and verifies its share; a failure on any rank raises on every rank,
naming it, before the engine is touched; (3) DeepSpeed loads.
"""

from __future__ import annotations

import json
from typing import Any

from .catalog import Catalog
from .commit import ranks
from .errors import BadInputError, CkptStoreError, NotFoundError, StorageError
from .materialize import compose
from .materialize.directory import check_resumable, step_reader
from .objects import ObjectStore

# What a failure before the load leaves: at ZeRO 1/2 the fp32 masters are decoded in place.
_untouched = "the engine's module weights and optimizer state are unchanged; its fp32 masters may not be"


def restore(
    objects: ObjectStore,
    catalog: Catalog,
    engine: Any,
    step: int | None = None,
    *,
    spec: compose.Spec | None = None,
    options: dict[str, bool] | None = None,
) -> tuple[int, dict | None]:
    """Load ``step`` (default: the newest; or a compose ``spec``) into ``engine``, as
    ``Store.restore`` documents, with ``options`` (``load_optimizer_states``,
    ``load_lr_scheduler_states``, ``load_module_only``) as ``load_checkpoint`` takes them.
    Returns ``(step, client_state)``."""
    from .deepspeed.extract import check_engine, dp_rank, optimizer_flavour
    from .deepspeed.load import derives_module_weights, fp32_partitions, load_from_memory, rank_files

    options = dict(options or {})

    def choose() -> int:
        if spec is None and step is None:
            newest = catalog.latest_step()
            if newest is None:
                raise NotFoundError(f"{objects.uri} has no committed step to restore")
            return newest
        return compose.step_or_spec(step, spec, catalog, "restore")[0]

    chosen = ranks.on_every_rank("restore", choose)[0]  # rank 0's answer, for every rank
    what = f"restore of step {chosen}"
    rank = ranks.world()[0]

    def read_share() -> tuple[dict, bool]:
        flavour = optimizer_flavour(engine)
        check_engine(engine, flavour)
        state, sources = compose.step_or_spec(chosen if spec is None else None, spec, catalog, "restore")
        check_resumable(catalog, state, sources)
        description = json.loads(catalog.description(state))
        if (description["flavour"], description["zero_stage"]) != (flavour, engine.zero_optimization_stage()):
            raise BadInputError(
                f"step {state} was committed by a ZeRO-{description['zero_stage']} engine "
                f"({description['flavour']}); this one runs ZeRO-{engine.zero_optimization_stage()} ({flavour})"
            )
        derive = derives_module_weights(engine, flavour, options)
        reader = step_reader(objects, catalog, state, description, sources)
        # Where the load copies the fp32 masters into the engine's own buffers, they are decoded
        # straight into those buffers instead: no second copy of them in memory.
        into = fp32_partitions(engine, flavour) if derive else None
        files = rank_files(
            description,
            reader,
            engine.dp_world_size,
            dp_rank(engine),
            skip_module_weights=derive,
            fp32_into=into,
        )
        return files, derive

    try:
        files, derive = ranks.each_rank(what, read_share)
    except CkptStoreError as exc:
        raise type(exc)(f"{exc} ({_untouched})") from None
    try:
        _, client_state = load_from_memory(
            engine,
            engine.load_checkpoint,
            files,
            f"global_step{chosen}",
            derive_module_weights=derive,
            **options,
        )
    except CkptStoreError:
        raise
    except Exception as exc:
        raise StorageError(
            f"{what}: DeepSpeed failed loading it on rank {rank} ({type(exc).__name__}: {exc}); "
            "the engine may be partly restored: restore again or rebuild it"
        ) from exc
    return chosen, client_state
