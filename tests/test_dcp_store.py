"""DCP's ``dcp.save``/``dcp.load`` through ``StoreWriter``/``StoreReader`` in one process: the
store keeps a DCP state dict's tensors, bytes items and metadata as a step, deduplicates
unchanged layers, composes steps layer by layer, and the rest of the store (log, sources,
verify, gc) treats the step like any other. Multi-rank FSDP2 and tensor parallelism:
tests/test_dcp_fsdp.py.
"""

from __future__ import annotations

import copy
import json
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptstore
from ckptstore.dcp.chunks import chunk_start
from ckptstore.dcp.naming import STATE_LAYER, name_items
from ckptstore.errors import BadInputError, CorruptError, NotFoundError
from ckptstore.format.layout import pack_name
from ckptstore.integrations.dcp import StoreReader, StoreWriter

# DCP says once per call that torch.distributed is not initialised: one process is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

BLOCKS = ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3"]


def training_state(seed: int = 0) -> dict:
    """A state dict shaped as ``get_state_dict(model, AdamW)`` gives it: parameters by name,
    Adam moments and step counters by parameter name, param groups, and user state."""
    generator = torch.Generator().manual_seed(seed)
    names = ["model.embed_tokens.weight", *(f"{b}.mlp.up_proj.weight" for b in BLOCKS), "lm_head.weight"]
    model = {name: torch.randn(16, 8, generator=generator) for name in names}
    state = {
        name: {"exp_avg": torch.randn(16, 8, generator=generator), "step": torch.tensor(3.0)}
        for name in names
    }
    return {
        "model": model,
        "optim": {"state": state, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": names}]},
        "train": {"step": 3, "epoch": 1},
    }


def emptied(state: dict) -> dict:
    """The same structure with every tensor zeroed and every plain value changed: what a
    resumed job holds before ``dcp.load``."""
    out = copy.deepcopy(state)
    for tensors in (out["model"], *out["optim"]["state"].values()):
        for tensor in tensors.values():
            tensor.zero_()
    out["optim"]["param_groups"][0]["lr"] = 0.0
    out["train"] = {"step": 0, "epoch": 0}
    return out


def assert_equal_states(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, dict):
            assert_equal_states(actual[key], value)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


@pytest.fixture
def store(tmp_path):
    with ckptstore.open(tmp_path / "store") as opened:
        yield opened


def test_a_saved_step_loads_every_tensor_and_every_plain_value_back(store):
    saved = training_state()
    dcp.save(saved, storage_writer=StoreWriter(store, step=100))
    loaded = emptied(saved)
    dcp.load(loaded, storage_reader=StoreReader(store, step=100))
    assert_equal_states(loaded, saved)
    assert store.steps() == [100]


def test_one_reader_parses_the_steps_description_once_however_often_it_loads(store, monkeypatch):
    saved = training_state()
    dcp.save(saved, storage_writer=StoreWriter(store, step=100))
    read = []
    description = store.catalog.description
    monkeypatch.setattr(store.catalog, "description", lambda step: read.append(step) or description(step))
    reader = StoreReader(store, step=100)  # as a Lightning resume loads: module, optimizer, the rest
    for _ in range(3):
        loaded = emptied(saved)
        dcp.load(loaded, storage_reader=reader)
        assert_equal_states(loaded, saved)
    assert read == [100]


def test_each_block_with_its_optimizer_state_is_a_layer_and_the_rest_is_the_steps_own_state(store):
    dcp.save(training_state(), storage_writer=StoreWriter(store, step=1))
    assert list(store.sources(1)) == ["model.embed_tokens", *BLOCKS, "lm_head", STATE_LAYER]
    names = name_items(
        ["optim.state.model.layers.1.mlp.up_proj.weight.exp_avg", "optim.param_groups", "train.step"],
        {
            "optim.state.model.layers.1.mlp.up_proj.weight.exp_avg": ("optim", "state", "model.layers.1.mlp.up_proj.weight", "exp_avg"),
            "model.model.layers.1.mlp.up_proj.weight": ("model", "model.layers.1.mlp.up_proj.weight"),
            "optim.param_groups": ("optim", "param_groups"),
            "train.step": ("train", "step"),
        },
    )  # fmt: skip
    assert names["optim.state.model.layers.1.mlp.up_proj.weight.exp_avg"].layer == "model.layers.1"
    assert names["optim.state.model.layers.1.mlp.up_proj.weight.exp_avg"].kind == "optim.state.*.exp_avg"
    assert names["optim.param_groups"].layer == STATE_LAYER and names["train.step"].layer == STATE_LAYER


def test_saving_unchanged_state_again_adds_no_bytes_and_half_the_blocks_add_about_half(store):
    state = training_state()
    dcp.save(state, storage_writer=StoreWriter(store, step=1))
    dcp.save(state, storage_writer=StoreWriter(store, step=2))
    for name in ("model.layers.1.mlp.up_proj.weight", "model.layers.3.mlp.up_proj.weight"):
        state["model"][name] += 1
        state["optim"]["state"][name]["exp_avg"] += 1
    dcp.save(state, storage_writer=StoreWriter(store, step=3, layers=["model.layers.1", "model.layers.3"]))
    full, again, half = (row.bytes_added for row in store.log())
    assert again == 0  # the same state again adds nothing, its own (state) layer included
    assert half < 0.45 * full
    assert store.sources(3) == {
        "model.embed_tokens": 2, "model.layers.0": 2, "model.layers.1": 3, "model.layers.2": 2,
        "model.layers.3": 3, "lm_head": 2, STATE_LAYER: 3,
    }  # fmt: skip


def test_a_composite_step_loads_its_blocks_from_itself_and_the_rest_from_the_earlier_step(store):
    first = training_state(seed=0)
    dcp.save(first, storage_writer=StoreWriter(store, step=1))
    second = training_state(seed=1)
    dcp.save(second, storage_writer=StoreWriter(store, step=2, layers=["model.layers.0", "model.layers.2"]))
    loaded = emptied(first)
    dcp.load(loaded, storage_reader=StoreReader(store))  # the newest step
    for name, tensor in loaded["model"].items():
        expected = second if ".layers.0." in name or ".layers.2." in name else first
        assert torch.equal(tensor, expected["model"][name]), name
        assert torch.equal(
            loaded["optim"]["state"][name]["exp_avg"], expected["optim"]["state"][name]["exp_avg"]
        )
    assert loaded["train"] == second["train"]


def test_layers_that_cannot_be_saved_alone_are_refused_on_every_rank_with_nothing_recorded(store):
    with pytest.raises(CheckpointException, match="first step, so it must save every layer"):
        dcp.save(training_state(), storage_writer=StoreWriter(store, step=1, layers=["model.layers.0"]))
    dcp.save(training_state(), storage_writer=StoreWriter(store, step=1))
    with pytest.raises(CheckpointException, match="unknown layers model.layers.9"):
        dcp.save(training_state(), storage_writer=StoreWriter(store, step=2, layers=["model.layers.9"]))
    with pytest.raises(CheckpointException, match="step 1 is already committed"):
        dcp.save(training_state(), storage_writer=StoreWriter(store, step=1))
    with pytest.raises(BadInputError, match="not a single string"):
        StoreWriter(store, step=3, layers="model.layers.0")
    assert store.steps() == [1]


def test_chunks_are_named_by_the_flat_index_of_their_first_element():
    assert chunk_start([0, 0], [6, 4]) == 0
    assert chunk_start([3, 0], [6, 4]) == 12  # a row block (Shard(0))
    assert chunk_start([0, 2], [6, 4]) == 2  # a column block (Shard(1))
    assert chunk_start([], []) == 0


def test_verify_gc_and_log_treat_dcp_steps_like_any_other(store):
    state = training_state()
    for step in (1, 2, 3):
        state["model"]["lm_head.weight"] += 1
        dcp.save(state, storage_writer=StoreWriter(store, step=step, metrics={"loss": 4.0 - step}))
    assert store.verify().ok
    report = store.gc(keep_last=1, grace=0)
    assert store.steps() == [3] and report.steps_dropped == [1, 2]
    assert store.verify().ok
    loaded = emptied(state)
    dcp.load(loaded, storage_reader=StoreReader(store, step=3))
    assert_equal_states(loaded, state)


def test_a_flipped_byte_in_a_pack_fails_the_load_naming_it_corrupt(store):
    dcp.save(training_state(), storage_writer=StoreWriter(store, step=5))
    index = next(i for i in store.catalog.layer_packs(5) if i.layer == "model.layers.2")
    path = store.objects.root / pack_name(index.packs[0].key)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointException, match=r"step 5 layer model.layers.2: pack \w+ .*is corrupt"):
        dcp.load(emptied(training_state()), storage_reader=StoreReader(store, step=5))
    assert not store.verify().ok


def test_materialize_writes_a_dcp_directory_that_dcps_own_reader_and_tools_read(store, tmp_path):
    saved = training_state()
    dcp.save(saved, storage_writer=StoreWriter(store, step=7))
    out = store.materialize(7, tmp_path / "dcp-7")
    loaded = emptied(saved)
    dcp.load(loaded, storage_reader=dcp.FileSystemReader(out))
    assert_equal_states(loaded, saved)
    dcp_to_torch_save(out, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)  # our own file, written just now
    assert torch.equal(full["model"]["lm_head.weight"], saved["model"]["lm_head.weight"])
    assert full["train"] == saved["train"]
    with pytest.raises(BadInputError, match="loads at any world size"):
        store.materialize(7, tmp_path / "again", world_size=2)


def test_deepspeed_verbs_refuse_a_dcp_step_and_say_what_reads_it(store, tmp_path):
    dcp.save(training_state(), storage_writer=StoreWriter(store, step=7))
    with pytest.raises(BadInputError, match=r"saved through PyTorch DCP .*StoreReader\(store, step=7\)"):
        store.materialize(
            spec={"state": 7, "slices": [{"layer_range": [0, 4], "step": 7}]}, out=tmp_path / "out"
        )
    assert not (tmp_path / "out").exists()


def test_a_step_that_does_not_exist_is_named(store):
    with pytest.raises(CheckpointException, match="step 4 does not exist"):
        dcp.load(training_state(), storage_reader=StoreReader(store, step=4))
    with pytest.raises(CheckpointException, match="has no steps yet"):
        dcp.load(training_state(), storage_reader=StoreReader(store))


def test_the_metadata_is_kept_as_json_in_the_description(store):
    dcp.save(training_state(), storage_writer=StoreWriter(store, step=1))
    description = json.loads(store.catalog.description(1))
    assert description["format"] == "dcp"
    item = description["dcp"]["items"]["model.lm_head.weight"]
    assert item == {
        "chunks": [[[0, 0], [16, 8]]],
        "dtype": "float32",
        "requires_grad": False,
        "size": [16, 8],
    }
    assert description["dcp"]["items"]["optim.param_groups.0.lr"] == {"bytes": True}  # DCP pickles it


def test_nothing_is_left_to_warn_about(store):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        dcp.save(training_state(), storage_writer=StoreWriter(store, step=1))
    with pytest.raises(NotFoundError):
        store.sources(2)


def test_state_dict_gives_the_models_full_tensors_under_its_own_names(store):
    saved = training_state()
    dcp.save(saved, storage_writer=StoreWriter(store, step=3))
    weights = store.state_dict(3)
    assert list(weights) == list(saved["model"])
    for name, tensor in saved["model"].items():
        assert torch.equal(weights[name], tensor), name
    assert store.state_dict(3, dtype="bf16")["lm_head.weight"].dtype == torch.bfloat16


def test_export_writes_the_models_weights_as_safetensors(store, tmp_path):
    from safetensors.torch import load_file

    saved = training_state()
    dcp.save(saved, storage_writer=StoreWriter(store, step=3))
    report = store.export(3, tmp_path / "hf", dtype="bf16")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert report.tensors == len(saved["model"]) == len(weights)
    for name, tensor in saved["model"].items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name


def test_dcp_and_deepspeed_steps_never_inherit_from_each_other(store, zero1_engine):
    store.commit(zero1_engine, step=1)
    with pytest.raises(CheckpointException, match="step 1 was committed from a DeepSpeed engine"):
        dcp.save(training_state(), storage_writer=StoreWriter(store, step=2, layers=["model.layers.0"]))
    with pytest.raises(CheckpointException, match="not through DCP: resume it with store.restore"):
        dcp.load(training_state(), storage_reader=StoreReader(store, step=1))
    dcp.save(training_state(), storage_writer=StoreWriter(store, step=2))  # every layer: fine
    with pytest.raises(BadInputError, match="step 2 was saved through PyTorch DCP; a DeepSpeed step cannot"):
        store.commit(zero1_engine, step=3, layers=["model.layers.0"])
    with pytest.raises(BadInputError, match="saved through PyTorch DCP"):
        store.restore(zero1_engine, 2)
    assert store.steps() == [1, 2]


def test_keep_best_and_catalog_rebuild_keep_dcp_steps_whole(store, run):
    state = training_state()
    for step, loss in ((1, 3.0), (2, 1.0), (3, 2.0)):
        state["model"]["lm_head.weight"] += 1
        dcp.save(state, storage_writer=StoreWriter(store, step=step, metrics={"loss": loss}))
    root = store.objects.root
    store.close()
    assert (
        run("--store", root, "gc", "--keep-last", "1", "--keep-best", "loss:min", "--grace", "0").returncode
        == 0
    )
    (root / "catalog.db").unlink()
    assert run("--store", root, "catalog", "rebuild").returncode == 0
    with ckptstore.open(root, create=False) as reopened:
        assert reopened.steps() == [2, 3]
        loaded = emptied(state)
        dcp.load(loaded, storage_reader=StoreReader(reopened, step=3))
        assert_equal_states(loaded, state)


def test_a_load_from_s3_reads_each_pack_in_at_most_two_requests(s3, tmp_path, monkeypatch):
    # Big enough that a layer's entries do not fit in the first read of its pack (64 KiB).
    state = {
        "model": {f"model.layers.{i}.w": torch.randn(256, 256) for i in range(3)},
        "optim": {"state": {f"model.layers.{i}.w": {"exp_avg": torch.randn(256, 256)} for i in range(3)}},
    }
    with ckptstore.open(s3.uri()) as writer:
        dcp.save(state, storage_writer=StoreWriter(writer, step=1))
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "another-node"))
    with ckptstore.open(s3.uri(), create=False) as reader:
        gets = []
        reader.objects.client.meta.events.register(
            "before-send.s3.GetObject", lambda request, **kwargs: gets.append(request.url)
        )
        loaded = copy.deepcopy(state)
        for tensor in (*loaded["model"].values(), *(s["exp_avg"] for s in loaded["optim"]["state"].values())):
            tensor.zero_()
        dcp.load(loaded, storage_reader=StoreReader(reader, step=1))
        packs = {ref.key for index in reader.catalog.layer_packs(1) for ref in index.packs}
    assert_equal_states(loaded, state)
    assert len(packs) == 3
    pack_gets = [url for url in gets if "/packs/" in url]
    assert len(pack_gets) <= 2 * len(packs), pack_gets


def test_the_cli_materializes_and_lists_a_dcp_step(store, run, tmp_path):
    dcp.save(training_state(), storage_writer=StoreWriter(store, step=9))
    root = store.objects.root
    done = run("--store", root, "materialize", "--step", "9", tmp_path / "out")
    assert done.returncode == 0 and (tmp_path / "out" / ".metadata").is_file()
    shown = run("--store", root, "show", "--step", "9")
    assert shown.returncode == 0 and "(state)" in shown.stdout and "model.layers.3" in shown.stdout


def test_a_bytes_item_that_would_run_code_is_refused_before_dcp_unpickles_it(store, tmp_path):
    from tests.test_auxfiles import RunsCode

    marker = tmp_path / "ran"
    crafted = training_state()
    crafted["train"] = {"step": RunsCode(marker), "epoch": 1}  # what a store writer could put there
    dcp.save(crafted, storage_writer=StoreWriter(store, step=1))
    assert not marker.exists()
    with pytest.raises(CheckpointException, match="train.step is kept as the bytes a job gave DCP"):
        dcp.load(emptied(training_state()), storage_reader=StoreReader(store, step=1))
    assert not marker.exists()


def save_hostile_dcp_step(store, marker, step: int = 1) -> None:
    """A DCP step whose bytes item ``train.step`` unpickles into a call: DCP's planner
    torch.saves a non-tensor value as it is, so the real writer stores the writer's pickle."""
    from tests.test_auxfiles import RunsCode

    crafted = training_state()
    crafted["train"] = {"step": RunsCode(marker), "epoch": 1}
    dcp.save(crafted, storage_writer=StoreWriter(store, step=step))


@pytest.mark.parametrize("where, keyed", [("local", False), ("s3", True)], ids=["local", "s3-with-key"])
def test_materialize_refuses_a_dcp_bytes_item_that_is_no_plain_data(tmp_path, run, request, where, keyed):
    marker = tmp_path / "ran"
    uri = str(tmp_path / "store") if where == "local" else request.getfixturevalue("s3").uri()
    store = ckptstore.open(uri, key=bytes(range(32)) if keyed else None)
    save_hostile_dcp_step(store, marker)
    refusal = "step 1's DCP bytes item train.step is kept as the bytes a job gave DCP"
    with pytest.raises(CorruptError, match=refusal):
        store.materialize(1, tmp_path / "out")
    assert not [p.name for p in tmp_path.iterdir() if p.name not in ("store", "cache")]  # not even staging
    [problem] = store.verify().problems
    assert [(user[0], user[2]) for user in problem.users] == [(1, "train.step")]
    assert "DCP bytes item train.step" in problem.describe() and "needed by step 1" in problem.describe()
    if not keyed:  # (the CLI takes a key from a file: tests/test_cli.py)
        refused = run("--store", uri, "materialize", "--step", 1, tmp_path / "out")
        assert refused.returncode == 4 and refused.stderr.startswith(f"error: {refusal}")

    out = store.materialize(1, tmp_path / "out", allow_pickle=True)
    assert not marker.exists()
    dcp.load(emptied(training_state()), storage_reader=dcp.FileSystemReader(out))
    assert marker.read_text() == "ran"  # the attack is real


def imports_of(path) -> set[str]:
    """What unpickling ``path`` imports (a file this test wrote: loading it runs nothing foreign)."""
    imported = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            imported.add(f"{module}.{name}")
            return super().find_class(module, name)

    with open(path, "rb") as handle:
        Recording(handle).load()
    return imported


def test_a_dcp_directorys_metadata_imports_only_what_dcps_own_save_imports(store, tmp_path):
    """``.metadata`` is DCP's pickle of the ``Metadata`` ckptstore rebuilds from the
    description's JSON: DCP's classes holding builtin values, never bytes from the store."""
    state = training_state()
    dcp.save(state, storage_writer=StoreWriter(store, step=1))
    out = store.materialize(1, tmp_path / "out")
    dcp.save(state, checkpoint_id=tmp_path / "dcps-own")
    ours, theirs = imports_of(out / ".metadata"), imports_of(tmp_path / "dcps-own" / ".metadata")
    assert ours <= theirs, ours - theirs
    assert not [name for name in ours if not name.startswith(("torch.", "pathlib.", "builtins."))]


def test_a_state_of_tensors_alone_has_no_empty_state_layer_and_verifies_clean(store):
    weights = {"model": training_state()["model"]}  # policy weights: no plain values, no bytes items
    dcp.save(weights, storage_writer=StoreWriter(store, step=1))
    assert "(state)" not in store.sources(1)
    assert store.verify().ok
    loaded = emptied({"model": weights["model"], "optim": {"state": {}, "param_groups": [{}]}, "train": {}})
    dcp.load({"model": loaded["model"]}, storage_reader=StoreReader(store, step=1))
    assert_equal_states(loaded["model"], weights["model"])
