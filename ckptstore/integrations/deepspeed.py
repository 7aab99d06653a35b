"""``attach``: a DeepSpeed engine's own ``save_checkpoint`` and ``load_checkpoint`` go through a store.

DeepSpeed lets a ``CheckpointEngine`` (``engine.checkpoint_engine``) take over how checkpoint
files are written; DataStates and Nebula plug in there. ``StoreCheckpointEngine`` writes none
of them: when ``save_checkpoint`` commits, the engine's state is committed into the store as
step ``engine.global_steps``, and the tag folder gets one small file, ``ckptstore.json``,
naming the store and the step. DeepSpeed still writes ``latest``. So code that calls
``save_checkpoint(dir, tag)`` (a hand-written loop, the Hugging Face Trainer, accelerate's
``save_state``) fills the store instead of ``dir``.

Loading reads files by name from the directory before any ``CheckpointEngine.load``, so
``attach`` wraps the engine's ``load_checkpoint`` instead: a tag folder holding
``ckptstore.json`` is restored straight from the store (``Store.restore``: each rank reads only
its share, at the job's current world size). With a ``load_checkpoint`` option restore does not
take, the step is instead materialized into a private temporary directory on each rank and
loaded from there by DeepSpeed itself, every file read with ``weights_only=True``
(``deepspeed.torchfile.load``): nothing the store supplies runs as code. Any other directory
loads as before, with the engine's own checkpoint engine.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from .. import strategies
from ..commit import ranks
from ..commit.queue import CommitHandle
from ..commit.step import CommitReport
from ..deepspeed import torchfile
from ..errors import BadInputError, CorruptError
from ..opening import open as open_store
from ..store import Store

MARKER = "ckptstore.json"
# The load_checkpoint options restore takes; with any other, the step is materialized and loaded.
_RESTORE_OPTIONS = {"load_optimizer_states", "load_lr_scheduler_states", "load_module_only"}
# Model-states entries that are engine state rather than client state (extract reads those live).
_ENGINE_ENTRIES = {"module", "optimizer"}


class StoreCheckpointEngine(CheckpointEngine):
    """A ``CheckpointEngine`` whose checkpoints are steps of ``store`` (see the module doc)."""

    def __init__(
        self,
        store: Store,
        engine: Any,
        *,
        layers: strategies.Selection = None,
        files=None,
        blocking: bool = True,
        deferred: bool = False,
    ) -> None:
        super().__init__()
        self.name = "ckptstore"
        self.store, self.engine = store, engine
        self.layers, self.files, self.blocking = layers, files, blocking
        # deferred: save_checkpoint only names the step; the caller commits it with
        # ``commit_pending`` once the files it keeps with the step are written (the Trainer).
        self.deferred = deferred
        self.pending: dict | None = None
        self._client_state: dict | None = None

    def create(self, info: CheckpointCommitInfo) -> None:
        self._client_state = None

    def save(self, state_dict: Any, path: str) -> None:
        # Nothing is written: the commit reads the engine's state live. The model-states dict
        # is where save_checkpoint put its client_state, which the step must keep (a
        # pipeline's layer_XX-model_states.pt files hold only a layer's weights).
        is_model_states = "mp_rank_" in Path(path).name and path.endswith("model_states.pt")
        if is_model_states and self._client_state is None and isinstance(state_dict, dict):
            self._client_state = {k: v for k, v in state_dict.items() if k not in _ENGINE_ENTRIES}

    def load(self, path: str, map_location=None) -> Any:
        return torchfile.load(path, map_location)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        step = int(self.engine.global_steps)
        if self.deferred:
            self.pending = {"step": step, "client_state": self._client_state}
        else:
            self.commit_pending(step, self._client_state, self.files)
        if ranks.world()[0] == 0:
            folder = Path(info.save_dir) / info.tag
            folder.mkdir(parents=True, exist_ok=True)
            marker = {"store": self.store.objects.uri, "step": step, "tag": info.tag}
            (folder / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        self._client_state = None
        return True

    def commit_pending(
        self, step: int, client_state: dict | None, files, metrics=None
    ) -> CommitReport | CommitHandle:
        """Commit the engine's state as ``step`` with ``files`` and ``metrics`` (collective);
        returns ``Store.commit``'s report, or its handle for a non-blocking commit."""
        return self.store.commit(
            self.engine,
            step,
            layers=self.layers,
            client_state=client_state,
            files=files,
            metrics=metrics,
            blocking=self.blocking,
        )


def attach(
    engine: Any,
    store: Store | str,
    *,
    layers: strategies.Selection = None,
    files=None,
    blocking: bool = True,
    deferred: bool = False,
) -> StoreCheckpointEngine:
    """From now on, ``engine.save_checkpoint(dir, tag)`` commits into ``store`` and
    ``engine.load_checkpoint(dir, tag)`` restores what it committed (see the module doc).

    ``store`` is a Store or a URI. ``layers``, ``files`` and ``blocking`` are passed to every
    commit (``Store.commit``); the step is ``engine.global_steps``. Collective like the calls
    it changes: every rank attaches. ``deferred``: ``save_checkpoint`` only names the step and
    the caller commits it (``StoreCheckpointEngine.commit_pending``). Returns the checkpoint
    engine now in place.
    """
    if isinstance(store, (str, os.PathLike)):
        store = open_store(store)
    if getattr(engine, "_ckptstore_attached", None) is not None:
        raise BadInputError("this engine is already attached to a store")
    checkpoint_engine = StoreCheckpointEngine(
        store, engine, layers=layers, files=files, blocking=blocking, deferred=deferred
    )
    original_load = engine.load_checkpoint

    def load_checkpoint(load_dir, tag=None, **options):
        return _load(engine, store, original_load, load_dir, tag, options)

    engine._ckptstore_attached = (engine.checkpoint_engine, original_load)
    engine.checkpoint_engine = checkpoint_engine
    engine.load_checkpoint = load_checkpoint
    return checkpoint_engine


def detach(engine: Any) -> None:
    """Give ``engine`` back its own checkpoint engine and ``load_checkpoint``."""
    attached = getattr(engine, "_ckptstore_attached", None)
    if attached is None:
        return
    checkpoint_engine, original_load = attached
    checkpoint_engine_now = engine.checkpoint_engine
    if isinstance(checkpoint_engine_now, StoreCheckpointEngine):
        checkpoint_engine_now.store.wait()
    engine.checkpoint_engine, engine.load_checkpoint = checkpoint_engine, original_load
    engine._ckptstore_attached = None


def resume_from_markers() -> None:
    """Let every DeepSpeed engine, attached or not, load a folder that names a ckptstore step
    (``<tag>/ckptstore.json``) by materializing that step from the store it names.

    For frameworks that load a checkpoint before anything could attach the engine (the Hugging
    Face Trainer resuming from ``checkpoint-N/``). Other folders load exactly as before.
    Idempotent.
    """
    from deepspeed import DeepSpeedEngine

    original = DeepSpeedEngine.load_checkpoint
    if getattr(original, "_ckptstore_markers", False):
        return

    def load_checkpoint(self, load_dir, tag=None, **options):
        return _load(self, None, functools.partial(original, self), load_dir, tag, options)

    load_checkpoint._ckptstore_markers = True
    functools.update_wrapper(load_checkpoint, original)
    DeepSpeedEngine.load_checkpoint = load_checkpoint


def _load(engine: Any, store: Store | None, original_load, load_dir, tag, options: dict):
    """``original_load`` of ``load_dir``, or of the step its tag folder names, materialized."""
    folder_tag = tag if tag is not None else _latest(load_dir)
    marker = Path(load_dir) / str(folder_tag) / MARKER if folder_tag is not None else None
    if marker is None or not marker.is_file():
        own = engine.checkpoint_engine
        if isinstance(own, StoreCheckpointEngine):  # not a restore's in-memory one: DeepSpeed's own reads it
            own = engine._ckptstore_attached[0]
        with _loading_with(engine, own):
            return original_load(load_dir, tag, **options)
    return _load_from_store(engine, store, original_load, marker, str(folder_tag), options)


class _SafeLoads:
    """``checkpoint_engine`` with ``load`` reading through ``torchfile.load`` (weights only)."""

    def __init__(self, checkpoint_engine: Any) -> None:
        self._wrapped = checkpoint_engine

    def load(self, path, map_location=None) -> Any:
        return torchfile.load(path, map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


@contextlib.contextmanager
def _loading_with(engine: Any, checkpoint_engine: Any):
    """``engine.checkpoint_engine`` is ``checkpoint_engine`` inside: DeepSpeed's
    ``load_checkpoint`` reads every file through ``self.checkpoint_engine.load``."""
    saved = engine.checkpoint_engine
    engine.checkpoint_engine = checkpoint_engine
    try:
        yield
    finally:
        engine.checkpoint_engine = saved


def _latest(load_dir) -> str | None:
    latest = Path(load_dir) / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def _load_from_store(engine: Any, store: Store | None, original_load, marker: Path, tag: str, options: dict):
    try:
        named = json.loads(marker.read_text())
        step, uri = int(named["step"]), str(named["store"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptError(f"{marker} does not name a ckptstore step ({exc!r})") from None
    if store is not None:
        store.wait()  # a non-blocking commit in flight may be the step asked for
    source = store if store is not None and uri == store.objects.uri else open_store(uri, create=False)
    if set(options) <= _RESTORE_OPTIONS:
        # Straight from the store: each rank reads only its own share.
        _, client_state = source.restore(engine, step, **options)
        return str(marker.parent), client_state
    with tempfile.TemporaryDirectory(prefix="ckptstore-load-") as scratch:
        # Each rank materializes on its own: no directory has to be shared between machines.
        out = source.materialize(step, Path(scratch) / "checkpoint", world_size=engine.dp_world_size, tag=tag)
        with _loading_with(engine, _SafeLoads(engine.checkpoint_engine)):
            return original_load(str(out), tag, **options)
