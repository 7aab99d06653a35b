"""The read verbs of a step, routed to the front door that wrote it.

A step committed from a DeepSpeed engine materializes as a DeepSpeed checkpoint directory and
reads back through ``export.weights``; a step saved through DCP (``integrations.dcp``) becomes a
DCP directory and reads back through ``dcp.weights``. ``Store`` asks here, so neither it nor the
verbs below need to know which door a step came in by.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .arguments import check_step
from .catalog import Catalog
from .dcp import dcp_description
from .dcp.directory import materialize_dcp
from .dcp.weights import state_dict as dcp_state_dict
from .errors import BadInputError, UnsupportedError
from .export.weights import parse_dtype
from .export.weights import state_dict as engine_state_dict
from .materialize import compose, outputs
from .materialize.directory import materialize as materialize_engine_step
from .materialize.universal import materialize_universal
from .objects import ObjectStore


def _dcp_step(catalog: Catalog, step: Any, spec: compose.Spec | None) -> tuple[Any, dict | None]:
    """``step`` checked (unless a compose ``spec`` stands for it), and its DCP description:
    None unless the DCP front door wrote it."""
    if spec is not None:
        return step, None
    step = check_step(step)
    return step, dcp_description(catalog, step)


def materialize(
    objects: ObjectStore,
    catalog: Catalog,
    step: Any,
    out: str | os.PathLike | None,
    *,
    spec: compose.Spec | None,
    world_size: int | None,
    force: bool,
    tag: str | None,
    allow_pickle: bool = False,
    universal: bool = False,
    ep_size: int | None = None,
) -> Path:
    """``Store.materialize``: the directory of ``step`` (or of a compose ``spec``) at ``out``,
    in the layout of the door that wrote the step; raises as ``Store.materialize`` says
    (``allow_pickle`` as it documents)."""
    step, description = _dcp_step(catalog, step, spec)
    with outputs.writing(out, "materialize"):
        if universal:
            if spec is not None or world_size is not None or tag is not None or ep_size is not None:
                raise BadInputError(
                    "materialize --universal takes a step, not --spec, --world-size, --ep-size or --tag"
                )
            if description is not None:
                raise UnsupportedError(
                    f"materialize --universal of step {step}: a DCP step has no universal form"
                )
            return materialize_universal(objects, catalog, step, out, force=force)
        if description is not None:
            if ep_size is not None:
                raise BadInputError(
                    f"step {step} was saved through DCP: an expert-parallel size does not apply"
                )
            return materialize_dcp(
                objects, catalog, step, description, out,
                force=force, world_size=world_size, tag=tag, allow_pickle=allow_pickle,
            )  # fmt: skip
        return materialize_engine_step(
            objects, catalog, step, out,
            spec=spec, world_size=world_size, force=force, tag=tag, allow_pickle=allow_pickle, ep_size=ep_size,
        )  # fmt: skip


def state_dict(
    objects: ObjectStore,
    catalog: Catalog,
    step: Any,
    dtype: str | torch.dtype | None,
    spec: compose.Spec | None,
) -> dict[str, torch.Tensor]:
    """``Store.state_dict``: the full weights of ``step`` (or of a compose ``spec``) by name."""
    step, description = _dcp_step(catalog, step, spec)
    if description is not None:
        return dcp_state_dict(objects, catalog, step, description, parse_dtype(dtype))
    return engine_state_dict(objects, catalog, step, dtype, spec)
