"""Non-blocking commits: training waits only for the snapshot; the step is recorded later."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.commit.background import SnapshotBuffers
from ckptstore.deepspeed.extract import extract
from ckptstore.errors import BadInputError, StorageError
from tools.engines import batches, build_engine, train

DATA = batches(24)
WORKER = Path(__file__).with_name("crash_worker.py")


def state_values(engine):
    return {(p.name, p.kind): p.tensor.clone() for p in extract(engine).pieces}


def test_non_blocking_commits_at_every_step_resume_bit_exactly(tmp_path):
    # No lr scheduler: with DeepSpeed's WarmupLR past its warmup, even DeepSpeed's own
    # save_checkpoint/load_checkpoint does not resume bit-exactly after ~18 steps on this CPU.
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2, scheduler=False)
    handles = []
    at_10 = None
    for step in range(1, 21):
        train(engine, DATA[step - 1 : step])
        handles.append(store.commit(engine, step=step, blocking=False))
        if step == 10:
            at_10 = state_values(engine)
        # the next training step runs while the commit is still hashing and writing
    engine.save_checkpoint(str(tmp_path / "deepspeed20"))  # DeepSpeed's own, of the same state
    train(engine, DATA[20:23])
    reports = [handle.result() for handle in handles]
    assert [report.step for report in reports] == list(range(1, 21))
    assert store.steps() == list(range(1, 21))

    # Compared with a resume from DeepSpeed's own checkpoint: on some CPUs even that one does not
    # continue bit-exactly like the uninterrupted run.
    store.materialize(20, tmp_path / "out20")
    losses = []
    for directory in ("out20", "deepspeed20"):
        resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=7, num_layers=2, scheduler=False)
        resumed.load_checkpoint(str(tmp_path / directory))
        assert resumed.global_steps == 20
        losses.append(train(resumed, DATA[20:23]))
    assert losses[0] == losses[1]

    store.materialize(10, tmp_path / "out10")  # taken before the optimizer moved on
    again = build_engine("llama", zero_stage=2, dtype="bf16", seed=7, num_layers=2, scheduler=False)
    again.load_checkpoint(str(tmp_path / "out10"))
    loaded = state_values(again)
    assert loaded.keys() == at_10.keys()
    assert all(torch.equal(loaded[k], at_10[k]) for k in at_10)


@pytest.mark.parametrize(("stage", "dtype"), [(0, "fp32"), (0, "bf16"), (2, "bf16"), (3, "bf16")])
def test_training_runs_during_the_snapshot_copy_and_its_optimizer_step_waits_for_it(
    tmp_path, monkeypatch, stage, dtype
):
    copy_finished = threading.Event()
    real_copy = SnapshotBuffers.copy

    def slow_copy(self, snapshot, ready=None):
        time.sleep(0.5)  # the next forward and backward run meanwhile
        copy = real_copy(self, snapshot, ready)
        copy_finished.set()
        return copy

    monkeypatch.setattr(SnapshotBuffers, "copy", slow_copy)
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=stage, dtype=dtype, seed=0, num_layers=2)
    train(engine, DATA[:2])
    at_commit = state_values(engine)
    handle = store.commit(engine, step=2, blocking=False)
    assert not copy_finished.is_set()  # commit returned before copying anything
    train(engine, DATA[2:3])
    assert copy_finished.is_set()  # the optimizer step waited for the copy
    assert not torch.equal(
        *(state[("model.norm.weight", "fp32")] for state in (at_commit, state_values(engine)))
    )
    handle.result()

    store.materialize(2, tmp_path / "out")
    resumed = build_engine("llama", zero_stage=stage, dtype=dtype, seed=7, num_layers=2)
    resumed.load_checkpoint(str(tmp_path / "out"))
    loaded = state_values(resumed)
    assert loaded.keys() == at_commit.keys()
    assert [k for k in at_commit if not torch.equal(loaded[k], at_commit[k])] == []


def test_a_non_blocking_commit_compresses_at_a_lower_cpu_priority_than_training(tmp_path, monkeypatch):
    from ckptstore.format import codec

    niceness = []
    real_encode = codec.encode_parts

    def observed_encode(tensor, key=None):
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_encode(tensor, key)

    monkeypatch.setattr(codec, "encode_parts", observed_encode)
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=2)
    training = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    train(engine, DATA[:1])
    store.commit(engine, step=1)
    assert niceness and set(niceness) == {training}  # a blocking commit runs at full speed
    niceness.clear()
    train(engine, DATA[1:2])
    store.commit(engine, step=2, blocking=False).result()
    assert niceness and min(niceness) == min(training + 10, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == training


def test_a_non_blocking_commit_compresses_on_the_cpus_set_aside_for_it(tmp_path, monkeypatch):
    from ckptstore.format import codec

    cpus = []
    real_encode = codec.encode_parts

    def observed_encode(tensor, key=None):
        cpus.append(frozenset(os.sched_getaffinity(0)))
        return real_encode(tensor, key)

    monkeypatch.setattr(codec, "encode_parts", observed_encode)
    training = os.sched_getaffinity(0)
    last = max(training)
    monkeypatch.setenv("CKPTSTORE_BACKGROUND_CPUS", str(last))
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=2)
    train(engine, DATA[:1])
    store.commit(engine, step=1, blocking=False).result()
    assert cpus and set(cpus) == {frozenset({last})}
    assert os.sched_getaffinity(0) == training  # training keeps every core
    monkeypatch.setenv("CKPTSTORE_BACKGROUND_CPUS", f"{os.cpu_count()}")
    with pytest.raises(BadInputError, match="CKPTSTORE_BACKGROUND_CPUS"):
        ckptstore.open(tmp_path / "store")


def test_a_failed_background_commit_records_nothing_and_raises_on_wait(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=2)
    train(engine, DATA[:1])
    store.commit(engine, step=1)
    train(engine, DATA[1:2])
    healthy_put = store.objects.put_if_absent

    def failing_put(name, data):
        raise StorageError("injected: bucket gone")

    store.objects.put_if_absent = failing_put
    handle = store.commit(engine, step=2, blocking=False)
    with pytest.raises(StorageError, match="bucket gone"):
        store.wait()
    assert handle.done() and store.steps() == [1]
    store.objects.put_if_absent = healthy_put
    assert store.commit(engine, step=2, blocking=False).result().step == 2
    assert store.steps() == [1, 2] and store.verify().ok


def test_an_error_of_a_background_commit_surfaces_at_the_next_commit(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=0, dtype="fp32", seed=0, num_layers=2)
    train(engine, DATA[:1])
    store.objects.put_if_absent = lambda name, data: (_ for _ in ()).throw(StorageError("injected"))
    store.commit(engine, step=1, blocking=False)
    with pytest.raises(StorageError, match="injected"):
        store.commit(engine, step=2, blocking=False)
    assert store.steps() == []


def test_an_error_raised_by_result_is_raised_once_and_the_next_commit_saves_its_own_step(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=2)
    train(engine, DATA[:1])
    healthy_put = store.objects.put_if_absent
    store.objects.put_if_absent = lambda name, data: (_ for _ in ()).throw(
        StorageError("injected: disk gone")
    )
    failed = store.commit(engine, step=1, blocking=False)
    with pytest.raises(StorageError, match="disk gone"):
        failed.result()
    with pytest.raises(StorageError, match="disk gone"):
        failed.result()  # the handle answers as often as it is asked
    store.objects.put_if_absent = healthy_put
    train(engine, DATA[1:2])

    assert store.commit(engine, step=2, blocking=False).result().step == 2
    assert store.wait().step == 2  # the commit in flight's report, not the old error
    assert store.commit(engine, step=3).step == 3
    store.close()  # raises nothing: the error was delivered
    assert ckptstore.open(tmp_path / "store").steps() == [2, 3]


def test_closing_the_store_flushes_a_commit_in_flight(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=3, dtype="bf16", seed=0, num_layers=2)
    train(engine, DATA[:1])
    store.commit(engine, step=1, blocking=False)
    store.close()
    assert ckptstore.open(tmp_path / "store").steps() == [1]
    with pytest.raises(ckptstore.BadInputError, match="closed"):
        store.commit(engine, step=2)


@pytest.mark.either_key  # multi-process: with a key or without, alternating (conftest)
def test_interpreter_exit_flushes_a_commit_in_flight(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MASTER_PORT"}
    result = subprocess.run([sys.executable, str(WORKER), "commit-async-exit", str(tmp_path / "store")],
                            capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    store = ckptstore.open(tmp_path / "store")
    assert store.steps() == [1] and store.verify().ok


def test_a_non_blocking_commit_keeps_its_files_as_they_were_when_submitted(tmp_path):
    # The Trainer's save_total_limit may delete a checkpoint folder while its commit still runs.
    import shutil

    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    train(engine, DATA[:1])
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "trainer_state.json").write_text('{"global_step": 1}')
    handle = store.commit(engine, step=1, files=folder, blocking=False)
    shutil.rmtree(folder)
    handle.result()
    out = store.materialize(1, tmp_path / "out")
    assert (out / "trainer_state.json").read_text() == '{"global_step": 1}'
    with pytest.raises(ckptstore.BadInputError, match="not a file or directory"):
        store.commit(engine, step=2, files=folder, blocking=False)  # refused at once, not later
