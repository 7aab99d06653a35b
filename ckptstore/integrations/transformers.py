"""``CkptStoreCallback``: every save of a Hugging Face Trainer running DeepSpeed goes into a store.

The Trainer saves a checkpoint by calling the DeepSpeed engine's ``save_checkpoint`` and then
writing its own files (``trainer_state.json``, ``rng_state_<rank>.pth``, ...) into
``checkpoint-N/``. The callback attaches the store to the engine when training begins
(``integrations.deepspeed.attach``, deferred), so ``save_checkpoint`` writes no tensors and
only names the step; at ``on_save``, once the Trainer's files exist, every rank commits the
engine's state with its own files of that step. The model weights the Trainer may write on
its own (``model.safetensors``) are left where it wrote them and not stored.

A resume either goes through the store (the Trainer's ``checkpoint-N/`` names the step, and
DeepSpeed engines follow that name while a callback exists: ``resume_from_markers``) or
from ``ckptstore materialize --step N out/checkpoint-N`` on any machine, at any world size.

Each commit's figures (``integrations.figures``) go to the run's own logger through
``Trainer.log``, the one path that reaches every ``report_to`` integration (TensorBoard, W&B,
MLflow...) and ``state.log_history``. A callback is never given the Trainer (the callback
handler passes the model, optimizer, scheduler and data loaders only), nor can it add entries to
the other callbacks' ``on_log``; so at ``on_train_begin`` it looks up the Trainer whose callback
handler holds it, as it looks up the DeepSpeed engine.
"""

from __future__ import annotations

import gc
import re
import time
import warnings
from pathlib import Path
from typing import Any

from transformers import Trainer, TrainerCallback

from .. import strategies
from ..commit import ranks
from ..commit.queue import CommitHandle
from ..commit.step import CommitReport
from ..errors import BadInputError
from ..opening import open as open_store
from ..store import Store
from .deepspeed import MARKER, StoreCheckpointEngine, attach, resume_from_markers
from .figures import scalars

# Files of checkpoint-N that are not the Trainer's state: DeepSpeed's, model weights, and
# ``training_args.bin``, a pickle of the TrainingArguments object that a resume never reads and
# materialize would leave out (it is no plain data: ``format.plainfile``).
_NOT_KEPT = re.compile(r"(latest|zero_to_fp32\.py|zero_to_torch\.py|.*\.safetensors|pytorch_model.*\.bin"
                       r"|model\.safetensors\.index\.json|training_args\.bin)")  # fmt: skip
_RANK_FILE = re.compile(r"rng_state_(\d+)\.pth")


class CkptStoreCallback(TrainerCallback):
    """Commit every Trainer save of a DeepSpeed run into ``store`` (a Store or a URI).

    ``layers`` chooses the saved layers per commit (a list, a Strategy such as ``Parity()``,
    or None for all); ``blocking=False`` commits behind training. The step is the Trainer's
    ``global_step``; the Trainer's latest evaluation metrics (``eval_loss``...), when it has
    evaluated, are recorded with it (``gc --keep-best eval_loss:min``). Needs ``trainer.model_wrapped`` to be a DeepSpeed engine (``deepspeed=``
    in the TrainingArguments).

    Each commit's figures are logged with ``Trainer.log`` (``ckptstore/bytes_stored``,
    ``ckptstore/layers_saved``, ``ckptstore/stall_seconds``, ``ckptstore/step``; TensorBoard
    and W&B show them as ``train/ckptstore/...``). A blocking commit's at its own save; a
    non-blocking commit's at the next save (which waits for it anyway) or at the end of
    training. (Not as soon as it is durable: ``Trainer.log`` from ``on_step_end`` would clear
    ``control.should_log`` before the Trainer logs that step's loss.) ``stall_seconds`` is the
    time ``on_save`` held the training loop (a non-blocking commit: waiting for the previous one
    and taking the snapshot; the engine's next optimizer step also waits for the copy, uncounted).
    """

    def __init__(
        self, store: Store | str, *, layers: strategies.Selection = None, blocking: bool = True
    ) -> None:
        self.store = store
        self.layers, self.blocking = layers, blocking
        self.checkpoint_engine: StoreCheckpointEngine | None = None
        # The Trainer resumes (deepspeed_load_checkpoint) before any callback event, so the
        # engine cannot be attached yet: let it follow the folder's ckptstore.json on its own.
        resume_from_markers()
        self.metrics: dict[str, float] = {}  # the Trainer's latest evaluation, recorded with the next save
        self.trainer: Trainer | None = None  # the Trainer running this callback: its log() takes the figures
        self._background: tuple[CommitHandle, float] | None = None  # non-blocking commit, seconds waited

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        if self.trainer is None:
            self.trainer = _trainer_of(self)
        if self.checkpoint_engine is not None:
            return
        if not isinstance(self.store, Store):
            self.store = open_store(self.store)
        engine = _engine_of(model)
        self.checkpoint_engine = attach(
            engine, self.store, layers=self.layers, blocking=self.blocking, deferred=True
        )

    def on_evaluate(self, args, state, control, metrics=None, **kwargs) -> None:
        numbers = {
            k: v for k, v in (metrics or {}).items() if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if numbers:
            self.metrics = numbers

    def on_save(self, args, state, control, **kwargs) -> None:
        checkpoint_engine = self.checkpoint_engine
        if checkpoint_engine is None or checkpoint_engine.pending is None:
            return
        pending, checkpoint_engine.pending = checkpoint_engine.pending, None
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        started = time.perf_counter()
        previous = self._finished()  # the commit below would wait for it anyway
        result = checkpoint_engine.commit_pending(
            pending["step"], pending["client_state"], trainer_files(folder), metrics=self.metrics or None
        )
        waited = time.perf_counter() - started
        if previous is not None:
            self._log(*previous)
        if isinstance(result, CommitHandle):
            self._background = (result, waited)
        else:
            self._log(result, waited)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if isinstance(self.store, Store):
            self.store.wait()
        finished = self._finished()
        if finished is not None:
            # The Trainer's TensorBoardCallback closed its writer before this callback's
            # on_train_end; its on_log opens a new one in the same folder.
            self._log(*finished)

    def _finished(self) -> tuple[CommitReport, float] | None:
        """The non-blocking commit in flight, waited for, with the seconds its save held
        training; None if there is none or it failed: the store raises that itself, at the next
        commit, ``wait()`` or ``close()``."""
        if self._background is None:
            return None
        (handle, waited), self._background = self._background, None
        try:
            return handle.result(), waited
        except Exception:
            return None

    def _log(self, report: CommitReport, waited: float) -> None:
        if self.trainer is not None:
            self.trainer.log(scalars(report.step, report.bytes_added, len(report.layers_saved), waited))


def trainer_files(folder: Path) -> list[Path]:
    """The files of a Trainer checkpoint folder this rank keeps with the step: its own
    ``rng_state_<rank>.pth``, and on rank 0 the Trainer's other files (``trainer_state.json``,
    ``rng_state.pth``, ``scaler.pt``, ``config.json``, tokenizer files...), never DeepSpeed's
    files, model weights or ``training_args.bin``."""
    rank = ranks.world()[0]
    kept = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if not path.is_file() or _NOT_KEPT.fullmatch(path.name):
            continue
        own = _RANK_FILE.fullmatch(path.name)
        if (own and int(own.group(1)) == rank) or (not own and rank == 0):
            kept.append(path)
    return kept


def _engine_of(model: Any) -> Any:
    """The DeepSpeed engine wrapping ``model`` (the Trainer passes callbacks the bare model)."""
    from deepspeed import DeepSpeedEngine

    if isinstance(model, DeepSpeedEngine):
        return model
    # Callbacks are not given the engine; it is the one object that holds this model. (Some
    # objects warn when merely inspected, e.g. torch's deprecated reduce_op.)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for candidate in gc.get_objects():
            if (
                type(candidate) is not type
                and isinstance(candidate, DeepSpeedEngine)
                and candidate.module is model
            ):
                return candidate
    raise BadInputError(
        "CkptStoreCallback needs the Trainer to run DeepSpeed (TrainingArguments(deepspeed=...)); "
        "no DeepSpeed engine wraps the model"
    )


def _trainer_of(callback: CkptStoreCallback) -> Trainer | None:
    """The Trainer whose callback handler holds ``callback`` (callbacks are not given it);
    None outside a Trainer, where the figures go nowhere."""
    for candidate in gc.get_objects():
        # By type, not isinstance: that would ask proxies (lazy modules...) for __class__.
        if issubclass(type(candidate), Trainer):
            if any(c is callback for c in candidate.callback_handler.callbacks):
                return candidate
    return None


__all__ = ["CkptStoreCallback", "MARKER", "trainer_files"]
