"""Commits across data-parallel ranks: every rank's outcome is known before anything is recorded.

Each rank runs its own part (extract, hash, upload) and the outcomes are exchanged with one
``all_gather_object`` over the default process group, which doubles as the barrier. If any
rank failed, every rank raises and nothing is recorded; otherwise rank 0 records the step and
broadcasts whether that worked. A rank that raises still reaches the collective, so a failure
on one rank never leaves the others waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from .. import errors
from ..errors import CkptStoreError

T = TypeVar("T")

# The process group commits talk over. Non-blocking commits run their collectives on a
# background thread while training runs its own on the default group; collectives of two
# threads on one group may interleave differently on each rank, so commits get their own.
_group = None
# The group the training thread agrees over whether the previous commit is still running
# (``agree_busy``), while the background thread may be in a commit's collectives on ``_group``.
_decisions = None


def use_commit_group() -> None:
    """Give commits a process group of their own, and their decisions on the training thread
    another (collective: every rank must call it)."""
    global _group, _decisions
    import torch.distributed as dist

    if _group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        _group = dist.new_group(backend="gloo")
        _decisions = dist.new_group(backend="gloo")


def agree_busy(busy: bool, unstarted: bool) -> tuple[bool, bool, bool]:
    """Every rank's view of its commits joined: (whether any rank's previous commit is still
    running, whether every rank has a queued commit not yet started, whether any rank has).
    Collective on the training thread, after ``use_commit_group``."""
    if _decisions is None:
        return busy, unstarted, unstarted
    import torch
    import torch.distributed as dist

    flags = torch.tensor([int(busy), int(unstarted), int(not unstarted)])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=_decisions)
    return bool(flags[0]), not bool(flags[2]), bool(flags[1])


def commit_group():
    """The process group commits talk over (None: the default one, until ``use_commit_group``)."""
    return _group


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _outcome(fn: Callable[[], T]) -> tuple[tuple, BaseException | None]:
    try:
        return ("ok", fn()), None
    except Exception as exc:  # shared with the other ranks, then re-raised
        return ("error", type(exc).__name__, str(exc)), exc


def _remote_error(what: str, rank: int, outcome: tuple) -> CkptStoreError:
    cls = getattr(errors, outcome[1], None)
    if not (isinstance(cls, type) and issubclass(cls, CkptStoreError)):
        cls = CkptStoreError
    return cls(f"{what} failed on rank {rank}: {outcome[2]}")


def on_every_rank(what: str, fn: Callable[[], T]) -> list[T]:
    """Run ``fn`` on every rank and return all ranks' results, in rank order.

    Raises on every rank if ``fn`` raised on any: the local exception where it happened,
    elsewhere an error of the same ckptstore class naming the failed rank.
    """
    rank, size = world()
    outcome, local_error = _outcome(fn)
    if size == 1:
        if local_error is not None:
            raise local_error
        return [outcome[1]]
    import torch.distributed as dist

    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, outcome, group=_group)
    if local_error is not None:
        raise local_error
    for other, result in enumerate(gathered):
        if result[0] == "error":
            raise _remote_error(what, other, result)
    return [result[1] for result in gathered]


def each_rank(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on every rank and return this rank's result; only whether it succeeded is
    shared (a rank's result stays on that rank). Raises everywhere as ``on_every_rank``."""
    kept: list[T] = []

    def run() -> None:
        kept.append(fn())

    on_every_rank(what, run)
    return kept[0]


def on_rank_zero(what: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only; every rank returns fn's result (sent to the others) or raises together."""
    rank, size = world()
    if size == 1:
        return fn()
    import torch.distributed as dist

    outcome, local_error = _outcome(fn) if rank == 0 else (("ok", None), None)
    shared = [outcome if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0, group=_group)
    if local_error is not None:
        raise local_error
    if shared[0][0] == "error":
        raise _remote_error(what, 0, shared[0])
    return outcome[1] if rank == 0 else shared[0][1]
