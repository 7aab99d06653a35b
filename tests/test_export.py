"""Weights out: ``store.state_dict`` and ``store.export`` against DeepSpeed's own consolidation.

The reference is ``get_fp32_state_dict_from_zero_checkpoint`` of a ``save_checkpoint`` of the
same engine state; ``from_pretrained`` must load the exported folder with no missing or
unexpected keys.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ckptstore
from tools.engines import batches, build_engine, destroy_engine, train

DATA = batches(4)
CONFIGS = [(model, stage) for model in ("llama", "gpt2") for stage in (2, 3)]


def zero_to_fp32(directory: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(directory))


def commit_and_save(root: Path, model: str, stage: int) -> tuple[ckptstore.Store, dict]:
    """A bf16 engine trained 2 steps, committed as step 2 (with its config.json) and saved by DeepSpeed."""
    engine = build_engine(model, zero_stage=stage, dtype="bf16", num_layers=2)
    train(engine, DATA[:2])
    engine.module.config.save_pretrained(root / "config")
    store = ckptstore.open(root / "store")
    store.commit(engine, 2, files=[root / "config" / "config.json"])
    engine.save_checkpoint(str(root / "deepspeed"))
    destroy_engine(engine)
    return store, zero_to_fp32(root / "deepspeed")


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{m}-zero{s}" for m, s in CONFIGS])
def committed(request, tmp_path_factory, store_key):
    model, stage = request.param
    store, reference = commit_and_save(tmp_path_factory.mktemp(f"{model}{stage}"), model, stage)
    yield model, store, reference
    store.close()


def load_pretrained(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
    assert info["mismatched_keys"] == set() and info["error_msgs"] == [], info
    return model.state_dict()


def test_state_dict_is_deepspeeds_consolidated_fp32_state_dict(committed):
    _, store, reference = committed
    ours = store.state_dict(2)
    assert list(ours) == list(reference) or set(ours) == set(reference)
    assert all(
        ours[name].dtype == torch.float32 and torch.equal(ours[name], reference[name]) for name in reference
    )


def test_export_loads_with_from_pretrained_and_holds_the_masters_cast_to_the_training_dtype(
    committed, tmp_path
):
    model, store, reference = committed
    report = store.export(2, tmp_path / "out")
    assert report.weight_files == ["model.safetensors"] and report.copied_files == ["config.json"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        ".ckptstore-output",
        "config.json",
        "model.safetensors",
    ]
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = set(f.keys())
        assert all(f.get_tensor(name).dtype == torch.bfloat16 for name in names)
    if model == "gpt2":  # tied: stored once, under the name transformers keeps
        assert "transformer.wte.weight" in names and "lm_head.weight" not in names
    loaded = load_pretrained(tmp_path / "out", torch.bfloat16)
    assert set(loaded) == set(reference)
    assert all(torch.equal(loaded[name], reference[name].to(torch.bfloat16)) for name in reference)


def test_a_sharded_fp32_export_splits_at_the_limit_and_indexes_every_tensor(committed, tmp_path):
    _, store, reference = committed
    limit = 24 * 1024
    report = store.export(2, tmp_path / "out", dtype="float32", max_shard_size=limit)
    out = tmp_path / "out"
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards == report.weight_files
    assert shards == [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    written = {}
    for shard in shards:
        with safe_open(out / shard, "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= limit or len(tensors) == 1, (shard, size)
        written.update(dict.fromkeys(tensors, shard))
    assert index["weight_map"] == written
    assert index["metadata"]["total_size"] == report.bytes
    loaded = load_pretrained(out, torch.float32)
    assert all(torch.equal(loaded[name], reference[name]) for name in reference)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_an_export_in_small_pieces_casts_bit_for_bit(committed, tmp_path, monkeypatch, dtype):
    from safetensors.torch import load_file

    from ckptstore.export import writer
    from ckptstore.format import planes

    _, store, reference = committed
    monkeypatch.setattr(planes, "PIECE", 1000)  # tensors decoded, cast and written in many pieces
    monkeypatch.setenv("CKPTSTORE_EXPORT_BUFFER_BYTES", "1")  # those read whole: one at a time,
    monkeypatch.setattr(writer, "_CAST_WINDOW", 4096)  # in many windows
    report = store.export(2, tmp_path / "out", dtype=dtype, max_shard_size=8 * 1024)
    assert len(report.weight_files) > 2
    index = json.loads((report.path / "model.safetensors.index.json").read_text())
    written = {}
    for shard in report.weight_files:
        tensors = load_file(report.path / shard)
        written.update(dict.fromkeys(tensors, shard))
        for name, tensor in tensors.items():
            assert tensor.dtype == dtype and torch.equal(tensor, reference[name].to(dtype)), name
    assert index["weight_map"] == written and written.keys() <= reference.keys()


def test_export_of_a_composite_step_takes_each_layer_from_its_source(tmp_path):
    engine = build_engine("llama", zero_stage=2, dtype="bf16", num_layers=2)
    store = ckptstore.open(tmp_path / "store")
    train(engine, DATA[:2])
    engine.module.config.save_pretrained(tmp_path / "config")
    store.commit(engine, 1, files=[tmp_path / "config" / "config.json"])
    train(engine, DATA[2:4])
    store.commit(engine, 2, layers=["model.layers.1"])  # keeps step 1's files
    live = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    destroy_engine(engine)
    step1, step2 = store.state_dict(1), store.state_dict(2)
    exported = load_pretrained(store.export(2, tmp_path / "out", dtype="float32").path, torch.float32)
    for name, tensor in exported.items():
        source = step2 if name.startswith("model.layers.1.") else step1
        assert torch.equal(tensor, source[name]), name
    # Layer 1 is the engine's at step 2; layer 0 is not (it trained on, but was not saved).
    assert torch.equal(
        exported["model.layers.1.mlp.up_proj.weight"].bfloat16(), live["model.layers.1.mlp.up_proj.weight"]
    )
    assert not torch.equal(
        exported["model.layers.0.mlp.up_proj.weight"].bfloat16(), live["model.layers.0.mlp.up_proj.weight"]
    )
    spec = {"state": 2, "slices": [{"layer_range": [0, 2], "step": 1}]}
    assert all(torch.equal(t, step1[n]) for n, t in store.state_dict(spec=spec).items())
    store.close()


def test_export_reads_an_s3_store(s3, tmp_path):
    engine = build_engine("gpt2", zero_stage=3, dtype="bf16", num_layers=2)
    train(engine, DATA[:1])
    with ckptstore.open(s3.uri()) as store:
        store.commit(engine, 1)
        expected = store.state_dict(1, dtype=torch.bfloat16)
    destroy_engine(engine)
    with ckptstore.open(s3.uri()) as store:  # a fresh process would see the same
        report = store.export(1, tmp_path / "out")
    assert not report.has_config
    with safe_open(report.path / "model.safetensors", "pt") as f:
        assert {n: f.get_tensor(n) for n in f.keys()}.keys() == expected.keys() - {"lm_head.weight"}  # noqa: SIM118
        assert all(torch.equal(f.get_tensor(n), expected[n]) for n in f.keys())  # noqa: SIM118


def test_a_failed_export_leaves_nothing_behind(committed, tmp_path):
    _, store, _ = committed
    with pytest.raises(ckptstore.errors.BadInputError, match="not a size"):
        store.export(2, tmp_path / "out", max_shard_size="lots")
    with pytest.raises(ckptstore.errors.BadInputError, match="dtype"):
        store.state_dict(2, dtype="int8")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep").write_text("mine")
    with pytest.raises(ckptstore.errors.ConflictError):
        store.export(2, tmp_path / "busy")
    assert [p.name for p in tmp_path.iterdir()] == ["busy"]


def test_cli_export_writes_the_folder_and_explains_errors(committed, run, tmp_path):
    _, store, _ = committed
    uri = store.objects.uri
    result = run("--store", uri, "export", "--step", 2, "--dtype", "float32", tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("exported step 2 (") and "float32" in result.stdout
    assert result.stderr == ""
    assert run("--store", uri, "export", "--step", 2, tmp_path / "out").returncode == 5
    missing = run("--store", uri, "export", "--step", 9, tmp_path / "other")
    assert missing.returncode == 3 and "9" in missing.stderr
    bad = run("--store", uri, "export", "--step", 2, "--max-shard-size", "huge", tmp_path / "other")
    assert bad.returncode == 2 and "not a size" in bad.stderr
    assert not (tmp_path / "other").exists()


@pytest.mark.either_key  # multi-process: with a key or without, alternating (conftest)
def test_steps_committed_on_two_ranks_export_like_deepspeeds_consolidation(tmp_path):
    from tests.test_many_ranks import torchrun

    torchrun("export", tmp_path)
    for model, stage in CONFIGS:
        root = tmp_path / f"{model}-zero{stage}"
        reference = zero_to_fp32(root / "deepspeed")
        with ckptstore.open(root / "store") as store:
            assert store.log()[0].world_size == 2
            ours = store.state_dict(2)
            assert set(ours) == set(reference)
            assert all(torch.equal(ours[name], reference[name]) for name in reference), (model, stage)
            loaded = load_pretrained(store.export(2, root / "out").path, torch.bfloat16)
        assert all(torch.equal(loaded[n], reference[n].to(torch.bfloat16)) for n in reference), (model, stage)


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_and_materialize_write_the_same_bytes_on_one_thread_as_on_every_core(
    committed, tmp_path, monkeypatch
):
    from ckptstore import forked
    from ckptstore.export import folder
    from ckptstore.format import planes

    _, store, _ = committed
    monkeypatch.setattr(planes, "PIECE", 1000)  # many pieces, decoded on the threads in turn
    monkeypatch.setattr(forked, "worth_running", lambda written, most: most)  # as for a large model
    used = []

    def write_files(*args):
        used.append(args[-2:])  # (threads, processes)
        return original(*args)

    original = folder.write_files
    monkeypatch.setattr(folder, "write_files", write_files)
    written = {}
    for cores in ({0}, set(range(24))):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores)
        out = tmp_path / str(len(cores))
        for dtype in ("bfloat16", "float32"):
            store.export(2, out / dtype, dtype=dtype)
        store.materialize(2, out / "deepspeed")
        written[len(cores)] = _tree_bytes(out)
    # No cap of 4: on one core, two threads (one and one more); on 24, a forked process per core.
    assert used == [(2, 1), (2, 1), (24, 24), (24, 24)]
    assert written[1] == written[24] and len(written[1]) > 4


def test_an_export_from_a_local_store_decodes_in_a_forked_process_per_core(committed, tmp_path, monkeypatch):
    from ckptstore import forked
    from ckptstore.export import safetensors_file

    _, store, _ = committed
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    monkeypatch.setattr(forked, "worth_running", lambda written, most: most)  # as for a large model
    writers = tmp_path / "writers"
    writers.mkdir()
    original = safetensors_file.SafetensorsFile.write_part

    here = os.getpid()

    def write_part(self, name, start, tensor):
        (writers / str(os.getpid())).touch()  # a worker's writes cannot reach this process's memory
        time.sleep(0.05)  # slow enough that every process gets tasks before they are all taken
        return original(self, name, start, tensor)

    monkeypatch.setattr(safetensors_file.SafetensorsFile, "write_part", write_part)
    store.export(2, tmp_path / "forked", dtype="bfloat16")
    pids = {int(p.name) for p in writers.iterdir()}
    assert len(pids) == 3 and here in pids  # this process and two forked workers
    for p in writers.iterdir():
        p.unlink()
    monkeypatch.setenv("CKPTSTORE_EXPORT_THREADS", "1")  # one decoder: this process's own thread
    store.export(2, tmp_path / "here", dtype="bfloat16")
    assert [int(p.name) for p in writers.iterdir()] == [here]
    assert _tree_bytes(tmp_path / "forked") == _tree_bytes(tmp_path / "here")


@pytest.mark.parametrize("verb", ["export", "materialize"])
def test_a_worker_process_that_fails_stops_the_output_with_its_own_error(
    committed, tmp_path, monkeypatch, verb
):
    from ckptstore import forked

    _, store, _ = committed
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(forked, "worth_running", lambda written, most: most)  # as for a large model
    here, original = os.getpid(), forked.run_forked

    def failing_in_workers(tasks, run, done, processes):
        def run_or_fail(task):
            if os.getpid() != here:
                raise ckptstore.errors.CorruptError("step 2: a blob does not match its key")
            time.sleep(0.05)  # the worker gets tasks too
            run(task)

        original(tasks, run_or_fail, done, processes)

    monkeypatch.setattr(forked, "run_forked", failing_in_workers)
    with pytest.raises(ckptstore.errors.CorruptError, match="^step 2: a blob does not match its key$"):
        getattr(store, verb)(2, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []  # no staging folder, no partial output
