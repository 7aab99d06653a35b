"""The Hugging Face Trainer with CkptStoreCallback: every save goes into the store, and a
Trainer resumes from a materialized step exactly as from its own checkpoint."""

import logging
import re

import pytest
import torch

import ckptstore
from tests.test_plainfile import same
from tools.engines import batches, build_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from ckptstore.integrations.transformers import CkptStoreCallback  # noqa: E402
from ckptstore.strategies import Parity  # noqa: E402


class Losses(transformers.TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


class Figures(transformers.TrainerCallback):
    """The store's figures the Trainer logged: what its report_to integrations receive."""

    def __init__(self):
        self.logged = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "ckptstore/step" in logs:
            self.logged.append({k: v for k, v in logs.items() if k.startswith("ckptstore/")})


def train(out, stage, resume=None, callbacks=(), max_steps=4, evaluate=False, report_to=(), **arguments):
    """A tiny Llama (attention dropout on) under the Trainer with DeepSpeed on CPU (bf16, the
    Trainer's own LR schedule), saving every 2 steps; returns the logged loss of each step."""
    model = build_model("llama", seed=0, num_layers=2, hidden=32, vocab=128)
    for module in model.modules():  # dropout on: a resume must restore the RNG states too
        if hasattr(module, "attention_dropout"):
            module.attention_dropout = 0.2
    deepspeed = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage}, "bf16": {"enabled": "auto"}, "gradient_clipping": "auto",
    }  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=max_steps, save_steps=2, logging_steps=1,
        deepspeed=deepspeed, bf16=True, use_cpu=True, report_to=list(report_to), seed=0, learning_rate=1e-2,
        lr_scheduler_type="linear", warmup_steps=1, dataloader_num_workers=0, **arguments,
    )  # fmt: skip
    data = [{"input_ids": ids[0], "labels": ids[0]} for ids in batches(16, batch=1)]
    losses = Losses()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, eval_dataset=data[:4] if evaluate else None,
        callbacks=[losses, *callbacks],
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return losses.losses


@pytest.mark.parametrize("stage, every_file", [(2, False), (3, True)], ids=["zero2", "zero3-every-file"])
def test_a_trainer_resumes_from_a_materialized_step_as_from_its_own_checkpoint(
    tmp_path, stage, every_file, monkeypatch, caplog
):
    if every_file:  # a user who keeps every file of the folder: training_args.bin and the weights too
        from ckptstore.integrations import transformers as integration

        monkeypatch.setattr(integration, "_NOT_KEPT", re.compile(r"latest|zero_to_.*\.py"))
    own = train(tmp_path / "own", stage)
    reference = train(tmp_path / "own-resumed", stage, resume=tmp_path / "own" / "checkpoint-2")

    store = ckptstore.open(tmp_path / "store")
    with_store = train(tmp_path / "run", stage, callbacks=[CkptStoreCallback(store)])
    assert with_store == own  # the callback changes nothing about training
    assert store.steps() == [2, 4]
    checkpoint = tmp_path / "run" / "checkpoint-2"
    # DeepSpeed's files hold no tensors there: its tag folder only names the step.
    assert [p.name for p in (checkpoint / "global_step2").iterdir()] == ["ckptstore.json"]
    kept = {row.path for row in store.files(2)}
    assert {"trainer_state.json", "rng_state.pth", "scheduler.pt"} <= kept
    if every_file:
        assert "training_args.bin" in kept
    else:
        assert not any("safetensors" in path for path in kept)  # the weights the Trainer writes itself
        assert "training_args.bin" not in kept  # no plain data: materialize leaves it out

    after_2 = {s: loss for s, loss in reference.items() if s > 2}
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        out = store.materialize(2, tmp_path / "elsewhere" / "checkpoint-2")
    # The Trainer's own pickles go out as ckptstore's bytes of the same values.
    for name in ("rng_state.pth", "scheduler.pt"):
        theirs = torch.load(checkpoint / name, weights_only=False)
        assert same(torch.load(out / name, weights_only=False), theirs), name
    assert ("training_args.bin" in caplog.text) == every_file and not (out / "training_args.bin").exists()
    resumed = train(tmp_path / "resumed", stage, resume=out)
    assert {s: loss for s, loss in resumed.items() if s > 2} == after_2
    # Or straight from the run's own checkpoint-2, which names the step in the store.
    again = train(
        tmp_path / "again", stage, resume=checkpoint, callbacks=[CkptStoreCallback(tmp_path / "store2")]
    )
    assert {s: loss for s, loss in again.items() if s > 2} == after_2


def blocks_by_source(store, step):
    return {layer: source for layer, source in store.sources(step).items() if ".layers." in layer}


def test_a_strategy_saves_half_the_blocks_at_alternate_saves(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    train(tmp_path / "run", 2, callbacks=[CkptStoreCallback(store, layers=Parity())], max_steps=6)
    saved = {row.step: row.layers_saved for row in store.log()}
    assert saved[2] == 5 and saved[4] == saved[6] == 4  # embed, norm, head and one of the two blocks
    assert sorted(blocks_by_source(store, 6).values()) == [4, 6]
    reference = train(tmp_path / "own", 2, max_steps=6)
    checkpoint = store.materialize(2, tmp_path / "out" / "checkpoint-2")
    resumed = train(tmp_path / "resumed", 2, resume=checkpoint, max_steps=6)
    assert {s: loss for s, loss in resumed.items() if s > 2} == {
        s: loss for s, loss in reference.items() if s > 2
    }


def test_non_blocking_commits_survive_the_trainer_deleting_old_checkpoints(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    own = train(tmp_path / "own", 2, max_steps=6)
    figures = Figures()
    ours = train(tmp_path / "run", 2, callbacks=[CkptStoreCallback(store, blocking=False), figures],
                 max_steps=6, save_total_limit=1)  # fmt: skip
    assert ours == own
    # Each commit's figures reach the Trainer's loggers once the commit is durable.
    assert [
        (f["ckptstore/step"], f["ckptstore/bytes_stored"], f["ckptstore/layers_saved"])
        for f in figures.logged
    ] == [(row.step, row.bytes_added, row.layers_saved) for row in store.log()]
    assert all(f["ckptstore/stall_seconds"] >= 0 for f in figures.logged)
    assert store.steps() == [2, 4, 6] and [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == [
        "checkpoint-6"
    ]
    assert {"trainer_state.json", "rng_state.pth"} <= {row.path for row in store.files(2)}


def test_each_commits_figures_reach_the_trainers_tensorboard_beside_the_loss(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = ckptstore.open(tmp_path / "store")
    train(tmp_path / "run", 2, callbacks=[CkptStoreCallback(store)], report_to=["tensorboard"])
    [folder] = {path.parent for path in (tmp_path / "run").rglob("events.out.tfevents.*")}
    events = EventAccumulator(str(folder))
    events.Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert set(scalars["train/loss"]) == {1, 2, 3, 4}
    rows = store.log()
    # The Trainer's loggers prefix what it logs with train/ (transformers' rewrite_logs).
    assert scalars["train/ckptstore/bytes_stored"] == {row.step: row.bytes_added for row in rows}
    assert (
        scalars["train/ckptstore/layers_saved"]
        == {row.step: row.layers_saved for row in rows}
        == {2: 5, 4: 5}
    )
    assert set(scalars["train/ckptstore/stall_seconds"]) == {2, 4}
    assert all(seconds > 0 for seconds in scalars["train/ckptstore/stall_seconds"].values())


def test_accelerate_save_state_and_load_state_go_through_an_attached_store(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("accelerate_worker.py")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT",)}  # each job its own port

    def start(mode):
        return subprocess.Popen([sys.executable, str(worker), mode, str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip

    def result(job):
        out, err = job.communicate(timeout=300)
        assert job.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    assert result(start("save")) == {"steps": [3], "pt": 0}
    loads = [start("load-store"), start("load-own")]  # the two loads side by side, one process each
    try:
        assert result(loads[0])["losses"] == result(loads[1])["losses"]
    finally:
        for job in loads:
            job.kill()  # none outlives a failed assertion (a no-op once it has ended)


def test_the_trainers_evaluation_metrics_are_recorded_with_each_save(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    train(
        tmp_path / "run",
        2,
        callbacks=[CkptStoreCallback(store)],
        evaluate=True,
        eval_strategy="steps",
        eval_steps=2,
    )
    rows = store.log()
    assert [row.step for row in rows] == [2, 4]
    assert all(0 < row.metrics["eval_loss"] < 10 for row in rows)
    assert rows[0].metrics["eval_loss"] != rows[1].metrics["eval_loss"]
    assert store.gc(keep_best=["eval_loss:min"], dry_run=True).steps_kept in ([2], [4])


def test_callback_jobs_beside_a_cpu_heavy_process_exit_cleanly(tmp_path):
    # Issue 37 item 19: "terminate called without an active exception" (rc -6) at interpreter
    # exit, after the work was done. Each job leaves through a normal interpreter exit with a
    # process spinning on the CPU beside it (tests/exit_worker.py).
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("exit_worker.py")
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT",)}  # each job its own port
    done = subprocess.run([sys.executable, str(worker), str(tmp_path), "blocking,background,blocking"],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0, 0], "steps": [[2, 4, 6]] * 3}
