"""Real FSDP2 and DTensor tensor-parallel jobs (torchrun, 2 ranks, gloo, CPU) save into and load
from the store through ``StoreWriter``/``StoreReader`` (issue 24, acceptance 1-7).

The jobs are tests/dcp_jobs.py; ``store:<uri>:<step>[:<layers>]`` picks the store, ``fs:<dir>``
DCP's own FileSystemWriter for comparison.
"""

from __future__ import annotations

import json

import pytest
import torch

import ckptstore
from ckptstore.dcp.naming import STATE_LAYER
from tests.dcp_runs import assert_same_state, load, run_job, run_jobs

N, K = 3, 2  # steps before the save, steps after it
BLOCKS = [f"model.layers.{i}" for i in range(4)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same 2-rank training twice (one after the other in one job): N steps, saved into a
    store (step N) and into a DCP directory, then K more steps."""
    root = tmp_path_factory.mktemp("dcp-store")
    names = {"store": f"store:{root / 'store'}:{N}", "fs": f"fs:{root / 'fs'}"}
    runs = [["train-save", "--steps", N, "--then", K, "--save", spec, "--dump", root / f"{name}.pt"]
            for name, spec in names.items()]  # fmt: skip
    jobs = dict(zip(names, run_jobs(runs, 2, root), strict=True))
    assert jobs["store"]["losses"] == jobs["fs"]["losses"]
    return root, jobs["store"]


def test_resuming_from_the_store_trains_as_resuming_from_dcps_own_directory(saved, tmp_path):
    root, trained = saved
    from_store, from_fs = run_jobs(  # one job, resuming from each in turn
        [["resume", "--load", f"store:{root / 'store'}:{N}", "--steps", K],
         ["resume", "--load", f"fs:{root / 'fs'}", "--steps", K]], 2, tmp_path,
    )  # fmt: skip
    assert from_store["losses"] == from_fs["losses"]
    assert from_store["losses"] == trained["losses"][N:]  # and as the run that never stopped


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_step_loads_at_one_and_two_ranks_with_every_tensor_equal(saved, tmp_path, nproc):
    root, _ = saved
    run_job(
        ["dump-full", "--load", f"store:{root / 'store'}:{N}", "--out", tmp_path / "loaded.pt"],
        nproc,
        tmp_path,
    )
    tensors = assert_same_state(load(root / "store.pt"), load(tmp_path / "loaded.pt"))
    assert tensors == (4 * 9 + 3) * 4  # every parameter with its step, exp_avg and exp_avg_sq


def test_the_rest_of_the_store_sees_an_fsdp2_step_like_any_other(saved):
    root, _ = saved
    with ckptstore.open(root / "store", create=False) as store:
        assert list(store.sources(N)) == ["model.embed_tokens", *BLOCKS, "model.norm", "lm_head", STATE_LAYER]
        assert store.verify().ok
        weights = store.state_dict(N)
    full = load(root / "store.pt")["model"]
    assert list(weights) == list(full)
    for name, tensor in full.items():
        assert torch.equal(weights[name], tensor), name


def test_a_composite_step_loads_its_blocks_from_itself_and_the_rest_from_the_earlier_step(tmp_path):
    store = tmp_path / "store"
    three = ["train-save", "--steps", 3, "--save", f"store:{store}:3", "--dump", tmp_path / "three.pt"]
    again = ["train-save", "--steps", 3, "--save", f"store:{store}:4", "--dump", tmp_path / "again.pt"]
    layers = "model.layers.1,model.layers.3"
    five = ["train-save", "--steps", 5, "--save", f"store:{store}:5:{layers}", "--dump", tmp_path / "five.pt"]
    loaded = ["dump-full", "--load", f"store:{store}:5", "--out", tmp_path / "loaded.pt"]
    run_jobs([three, again, five, loaded], 2, tmp_path)  # one job, the four in turn

    three, five, loaded = (
        load(tmp_path / "three.pt"),
        load(tmp_path / "five.pt"),
        load(tmp_path / "loaded.pt"),
    )
    for name, tensor in loaded["model"].items():
        expected = five if ".layers.1." in name or ".layers.3." in name else three
        assert torch.equal(tensor, expected["model"][name]), name
        for state, value in loaded["optim"]["state"][name].items():
            if state != "step":  # the step counter is the step's own state
                assert torch.equal(value, expected["optim"]["state"][name][state]), (name, state)
    with ckptstore.open(store, create=False) as opened:
        full, same, half = (row.bytes_added for row in opened.log())
        assert opened.sources(5)["model.layers.1"] == 5 and opened.sources(5)["model.layers.0"] == 4
    assert same == 0, same  # the same state again adds nothing
    assert half < 0.6 * full


def test_async_save_through_the_store_holds_the_state_at_the_save(saved, tmp_path):
    root, trained = saved
    spec = f"store:{tmp_path / 'store'}:{N}"
    args = [
        "train-save",
        "--steps",
        N,
        "--then",
        K,
        "--save",
        spec,
        "--save-async",
        "--dump",
        tmp_path / "at.pt",
    ]
    during = run_job(args, 2, tmp_path)
    assert during["losses"] == trained["losses"]  # training went on, undisturbed, during the save
    run_job(["dump-full", "--load", spec, "--out", tmp_path / "loaded.pt"], None, tmp_path)
    assert_same_state(load(root / "store.pt"), load(tmp_path / "loaded.pt"))


def test_on_s3_a_two_rank_save_loads_in_one_rank_with_an_empty_cache(s3, tmp_path, monkeypatch):
    spec = f"store:{s3.uri()}:{N}"
    run_job(["train-save", "--steps", N, "--save", spec, "--dump", tmp_path / "saved.pt"], 2, tmp_path)
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "another-node"))
    run_job(["dump-full", "--load", spec, "--out", tmp_path / "loaded.pt"], None, tmp_path)
    assert_same_state(load(tmp_path / "saved.pt"), load(tmp_path / "loaded.pt"))


def test_tensor_parallel_chunks_load_whole_in_one_plain_process(tmp_path):
    spec = f"store:{tmp_path / 'store'}:1"
    run_job(["tp-save", "--save", spec, "--dump", tmp_path / "saved.pt"], 2, tmp_path)
    with ckptstore.open(tmp_path / "store", create=False) as store:
        index = next(i for i in store.catalog.layer_packs(1) if i.layer == "down")
        assert len(index.packs) == 2  # each rank stored its own column block of the rowwise weight
        items = json.loads(store.catalog.description(1))["dcp"]["items"]
    assert items["model.down.weight"]["chunks"] == [[[0, 0], [16, 16]], [[0, 16], [16, 16]]]  # Shard(1)
    assert items["model.up.weight"]["chunks"] == [[[0, 0], [16, 16]], [[16, 0], [16, 16]]]  # Shard(0)
    run_job(["tp-load-nodist", "--load", spec, "--out", tmp_path / "loaded.pt"], None, tmp_path)
    assert assert_same_state(load(tmp_path / "saved.pt"), load(tmp_path / "loaded.pt")) == 4 * 4
