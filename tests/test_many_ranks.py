"""Data-parallel jobs: collective commits, and materializing for a different world size.

The two-rank halves run under ``torch.distributed.run`` (gloo on CPU) in tests/dist_worker.py;
one-rank halves run in this process. The tests here share one two-rank job that runs every
scenario in turn (``two_ranks``): each interpreter start costs seconds (issue 48).
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptstore
from tests.dist_worker import RESHARD, commit_only, matches_store
from tools.engines import batches, build_engine, free_port, train

WORKER = Path(__file__).with_name("dist_worker.py")

# Every test here reads the one torchrun job: with a key or without, alternating (conftest).
pytestmark = pytest.mark.either_key


def torchrun(mode: str, root: Path, nproc: int = 2) -> list[dict]:
    """Run one worker mode on ``nproc`` ranks; returns each rank's observations."""
    return torchrun_modes([mode], root, nproc)[mode]


def torchrun_modes(
    modes: list[str], root: Path, nproc: int = 2, worker: Path = WORKER, timeout: float = 600
) -> dict[str, list[dict]]:
    """Run several modes of ``worker`` one after another in one job of ``nproc`` ranks (each in
    ``root/<mode>`` when there are several, ``timeout`` seconds each at most); each mode's
    observations of each rank."""
    result = root / "result"
    port = free_port()  # so parallel runs never meet
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
         str(worker), ",".join(modes), str(root), str(result)],
        capture_output=True, text=True, timeout=timeout * len(modes),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    names = {mode: f"{result}.{mode}" if len(modes) > 1 else str(result) for mode in modes}
    return {
        mode: [json.loads(Path(f"{names[mode]}.{rank}.json").read_text()) for rank in range(nproc)]
        for mode in modes
    }


MODES = ["resume", "non_blocking", "latest", "composite", "fail", "files", "attach", "commit", "load"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict[str, list[dict]]]:
    """One two-rank job running every mode of this module, each in its own folder of the root;
    "load" reads the steps this process commits on one rank first, "trainer" runs where
    accelerate is installed."""
    root = tmp_path_factory.mktemp("many_ranks")
    commit_only(root / "load")
    modes = MODES + (["trainer"] if importlib.util.find_spec("accelerate") else [])
    return root, torchrun_modes(modes, root)


def test_two_rank_commits_resume_bit_exactly_on_two_ranks(two_ranks):
    for rank, observed in enumerate(two_ranks[1]["resume"]):
        assert set(observed) == {f"zero{s}-{d}" for s in (0, 1, 2, 3) for d in ("fp32", "bf16")}
        for config, run in observed.items():
            assert run["loaded_step"] == 3, (rank, config)
            assert run["resumed"] == run["reference"], (rank, config)


def test_two_rank_non_blocking_commits_resume_bit_exactly(two_ranks):
    for observed in two_ranks[1]["non_blocking"]:
        for config, run in observed.items():
            assert run["steps"] == [1, 2, 3], config
            assert run["resumed"] == run["reference"], config


def test_two_ranks_decide_alike_which_steps_a_commit_every_step_commits(two_ranks):
    for observed in two_ranks[1]["latest"]:
        # step 1 held in flight (by the store's lock): 2 queued, then replaced by 3; 4 skipped
        assert observed["held"] == [None, "replaced", None, "skipped"]
        assert observed["outcomes"] == ["committed", "replaced", "committed", "skipped"]
        assert observed["steps"] == [1, 3]
    assert two_ranks[1]["latest"][0]["materialized"] == []


def test_two_rank_composite_steps_take_each_layer_from_its_source(two_ranks):
    for observed in two_ranks[1]["composite"]:
        for config, run in observed.items():
            assert run["wrong"] == [], config
            assert run["sources"]["model.layers.1"] == 3 and run["sources"]["model.layers.0"] == 2
            assert all(loss == loss and loss < 10 for loss in run["losses"])


def test_a_failing_rank_fails_the_commit_everywhere_and_records_nothing(two_ranks):
    rank0, rank1 = two_ranks[1]["fail"]
    assert rank0["outcome"] == "StorageError: commit of step 1 failed on rank 1: injected: disk on fire"
    assert rank1["outcome"] == "StorageError: injected: disk on fire"
    assert rank0["steps"] == rank1["steps"] == []


def test_each_rank_keeps_its_own_files_with_the_step(two_ranks, tmp_path):
    root, observed_by_mode = two_ranks
    for observed in observed_by_mode["files"]:
        assert observed["files"] == ["rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"]
        assert "different contents for trainer_state.json" in observed["outcome"]
        assert observed["steps"] == [1]
    out = ckptstore.open(root / "files" / "files").materialize(1, tmp_path / "out")
    for r in (0, 1):  # each rank's own torch file, as ckptstore serializes its plain data
        kept = torch.load(out / f"rng_state_{r}.pth", weights_only=True)
        assert kept["rank"] == r and torch.equal(kept["cpu"], torch.arange(4, dtype=torch.uint8) + r)
    assert (out / "trainer_state.json").read_text() == '{"global_step": 1}'


def test_an_attached_store_takes_save_and_load_checkpoint_on_two_ranks_at_zero_0_to_3(two_ranks):
    for observed in two_ranks[1]["attach"]:
        assert set(observed) == {"zero0", "zero1", "zero2", "zero3"}
        for config, run in observed.items():
            assert run["steps"] == [3] and run["pt_files"] == 0, config
            assert run["resumed"] == run["reference"], config


def test_a_two_rank_trainer_resumes_from_a_materialized_step_as_from_its_own_checkpoint(two_ranks):
    pytest.importorskip("accelerate")
    for observed in two_ranks[1]["trainer"]:
        for config, run in observed.items():
            assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= set(run["files"]), config
            assert run["resumed"] == run["reference"] and run["reference"], config


def test_committed_on_two_ranks_loads_on_one(two_ranks, tmp_path):
    root = two_ranks[0] / "commit"
    for name, (stage, overrides) in RESHARD.items():
        store = ckptstore.open(root / name)
        assert json.loads(store.catalog.description(3))["world_size"] == 2
        # One object per rank and layer: at ZeRO-3 every layer is split across both ranks.
        indexes = store.catalog.layer_packs(3)
        assert len(indexes) == len(store.sources(3))
        if stage == 3:
            assert all(sorted(ref.rank for ref in index.packs) == [0, 1] for index in indexes), name
        stored = {info.name for info in store.objects.list("packs/")}
        assert stored == {f"packs/{r.key[:2]}/{r.key}" for index in indexes for r in index.packs}
        assert not list(store.objects.list("blobs/"))
        store.materialize(3, tmp_path / f"{name}-w1", world_size=1)
        engine = build_engine("llama", zero_stage=stage, dtype="bf16", seed=99, num_layers=3, **overrides)
        engine.load_checkpoint(str(tmp_path / f"{name}-w1"))
        assert engine.global_steps == 3
        assert matches_store(engine, store, 3) == [], name
        losses = train(engine, batches(6)[3:5])
        assert all(loss == loss and loss < 10 for loss in losses)


def test_committed_on_one_rank_loads_on_two(two_ranks):
    for rank, observed in enumerate(two_ranks[1]["load"]):
        assert set(observed) == set(RESHARD)
        for name, run in observed.items():
            assert run["loaded_step"] == 3 and run["wrong"] == [], (rank, name)
            assert all(loss == loss and loss < 10 for loss in run["losses"])
