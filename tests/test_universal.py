"""``materialize --universal``: DeepSpeed's universal checkpoint of a step, written from the store."""

import sys
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, UnsupportedError
from tools.engines import batches, build_engine, destroy_engine, train

sys.path.insert(0, str(Path(__file__).parent))
from model_parallel_worker import same, to_universal, universal_unlike  # noqa: E402
from test_store_deepspeed import build_variant  # noqa: E402

DATA = batches(4)
# ds_to_universal refuses a checkpoint without universal_checkpoint_info; a plain engine's has none.
CLIENT_STATE = {"universal_checkpoint_info": {}}
UNIVERSAL = {"checkpoint": {"load_universal": True}}


def files_of(folder: Path) -> dict[str, object]:
    """Every file under ``folder`` by its relative path, loaded."""
    return {
        str(path.relative_to(folder)): torch.load(path, weights_only=False)
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_universal_materialize_equals_ds_to_universal_and_load_universal_trains_on_alike(
    tmp_path, stage, dtype
):
    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_engine("llama", zero_stage=stage, dtype=dtype, seed=0, num_layers=2)
    train(engine, DATA[:2])
    store.commit(engine, step=2, client_state=CLIENT_STATE)
    engine.save_checkpoint(
        str(tmp_path / "deepspeed"), tag="global_step2_universal", client_state=CLIENT_STATE
    )
    destroy_engine(engine)
    to_universal(tmp_path / "deepspeed" / "global_step2_universal", tmp_path / "theirs")

    out = store.materialize(2, tmp_path / "ours", universal=True)

    assert (out / "latest_universal").read_text() == "global_step2_universal"
    ours, theirs = (
        files_of(out / "global_step2_universal"),
        files_of(tmp_path / "theirs" / "global_step2_universal"),
    )
    assert sorted(ours) == sorted(theirs)
    assert [path for path in ours if not same(ours[path], theirs[path])] == []
    assert "zero/model.norm.weight/step.pt" in ours

    losses = {}
    for name, folder in (("ours", out), ("theirs", tmp_path / "theirs")):
        resumed = build_engine(
            "llama", zero_stage=1 if stage == 2 else 2, dtype=dtype, seed=9, num_layers=2, **UNIVERSAL
        )
        resumed.load_checkpoint(str(folder))
        assert resumed.global_steps == 2
        losses[name] = train(resumed, DATA[2:])
        destroy_engine(resumed)
    assert losses["ours"] == losses["theirs"]


@pytest.mark.parametrize("variant", ["tied", "frozen"])
def test_universal_materialize_writes_a_models_other_entries_from_its_model_states_as_ds_to_universal(
    tmp_path, variant
):
    # GPT-2's lm_head is its embedding under another name, and a frozen layer no optimizer
    # group holds: ds_to_universal writes them (fp32.pt alone) from the model-states file
    store = ckptstore.open(tmp_path / "store", create=True)
    if variant == "tied":
        engine, name = (
            build_engine("gpt2", zero_stage=1, dtype="bf16", seed=0, num_layers=1),
            "lm_head.weight",
        )
    else:
        engine = build_variant(1, "bf16", 0, freeze=["model.layers.0"])
        name = "model.layers.0.self_attn.q_proj.weight"
    train(engine, DATA[:2])
    store.commit(engine, step=2, client_state=CLIENT_STATE)
    engine.save_checkpoint(str(tmp_path / "deepspeed"), tag="global_step2", client_state=CLIENT_STATE)
    destroy_engine(engine)
    to_universal(tmp_path / "deepspeed" / "global_step2", tmp_path / "theirs")

    out = store.materialize(2, tmp_path / "ours", universal=True)

    ours = out / "global_step2_universal"
    assert universal_unlike(ours, tmp_path / "theirs" / "global_step2") == []
    assert sorted(path.name for path in (ours / "zero" / name).iterdir()) == ["fp32.pt"]


def test_universal_materialize_refuses_what_it_does_not_reach_yet(tmp_path):
    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_engine("llama", zero_stage=0, dtype="fp32", seed=0, num_layers=1)
    train(engine, DATA[:1])
    store.commit(engine, step=1)
    destroy_engine(engine)
    with pytest.raises(UnsupportedError, match="only ZeRO-1/2"):
        store.materialize(1, tmp_path / "out", universal=True)
    assert not (tmp_path / "out").exists()


def test_universal_materialize_on_the_command_line_writes_latest_universal_and_refuses_naming_what(
    tmp_path, run
):
    store = ckptstore.open(tmp_path / "store", create=True)
    # sub-parameters given by a count, as before universal checkpoint version 0.4
    legacy = {"universal_checkpoint_info": {"parameter_with_sub_params": [
        {"patterns": [r"model\.layers\.0\.mlp\.gate_proj\.weight"], "shape": [2, -1], "partition_dim": 0}
    ]}}  # fmt: skip
    for step, stage, client_state in ((1, 0, CLIENT_STATE), (2, 1, CLIENT_STATE), (3, 1, legacy)):
        engine = build_engine("llama", zero_stage=stage, dtype="fp32", seed=0, num_layers=1)
        train(engine, DATA[:1])
        store.commit(engine, step=step, client_state=client_state)
        destroy_engine(engine)
    store.close()

    done = run("--store", tmp_path / "store", "materialize", "--universal", "--step", 2, tmp_path / "out")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "latest_universal").read_text() == "global_step2_universal"
    assert (tmp_path / "out" / "global_step2_universal" / "zero" / "model.norm.weight" / "fp32.pt").is_file()

    refused = run(
        "--store", tmp_path / "store", "materialize", "--universal", "--step", 1, tmp_path / "zero0"
    )
    assert refused.returncode == 6 and "ZeRO 0" in refused.stderr
    legacy = run("--store", tmp_path / "store", "materialize", "--universal", "--step", 3, tmp_path / "sub")
    assert legacy.returncode == 6, legacy.stderr
    assert "model.layers.0.mlp.gate_proj.weight" in legacy.stderr and "0.4" in legacy.stderr
    assert not (tmp_path / "sub").exists()
    tagged = run(
        "--store", tmp_path / "store", "materialize", "--universal", "--step", 2, "--tag", "x", tmp_path / "t"
    )
    assert tagged.returncode == 2  # a universal checkpoint's folder is named for its step


GATE = r"model\.layers\.0\.mlp\.gate_proj\.weight"
SUB = {"patterns": [GATE], "shape": [[32, 32], 16], "partition_dim": 0}
# (universal_checkpoint_info, what the refusal names: its key and the bad entry)
MALFORMED = [
    ([r"model\.norm\.weight"], ["universal_checkpoint_info is no dict"]),
    ({"tp_replicated_parameter_patterns": r"model\.norm\.weight"}, ["tp_replicated_parameter_patterns", "no list"]),
    ({"parameter_to_average_patterns": [3]}, ["parameter_to_average_patterns", "no string", "3"]),
    ({"parameter_with_row_parallelism_patterns": ["model.(layers"]}, ["parameter_with_row_parallelism_patterns",
                                                                      "no regular expression", "model.(layers"]),
    ({"vocabulary_parameter_patterns": [None]}, ["vocabulary_parameter_patterns", "None"]),
    ({"parameter_with_sub_params": [GATE]}, ["parameter_with_sub_params", "no dict of partition_dim"]),
    ({"parameter_with_sub_params": [{**SUB, "partition_dim": 2}]}, ["parameter_with_sub_params", "partition_dim"]),
    ({"parameter_with_sub_params": [{**SUB, "shape": ["32"]}]}, ["parameter_with_sub_params", "shape"]),
    ({"parameter_with_sub_params": [{**SUB, "patterns": ["(("]}]}, ["parameter_with_sub_params", "(("]),
    ({"parameter_with_sub_params": {"patterns": [GATE]}}, ["parameter_with_sub_params", "no list"]),
    ({"original_vocab_size": "32000"}, ["original_vocab_size", "no positive int", "32000"]),
    ({"original_vocab_size": True}, ["original_vocab_size", "True"]),
    ({"padded_vocab_size": 0}, ["padded_vocab_size", "0"]),
    ({"universal_checkpoint_version": "0.4"}, ["universal_checkpoint_version", "0.4"]),
]  # fmt: skip


def test_a_malformed_universal_checkpoint_info_is_refused_at_commit_naming_its_key_and_entry(tmp_path):
    # Each kind of bad entry a client (or a module's universal_checkpoint_info) can give is a
    # BadInputError naming the key and the entry, before anything is written: the store holds
    # no step and no file more after it, and a good commit of the same step goes through.
    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=1)
    train(engine, DATA[:1])
    before = sorted(
        path for path in (tmp_path / "store").rglob("*") if "catalog" not in path.name and path.name != "lock"
    )
    for info, named in MALFORMED:
        with pytest.raises(BadInputError) as refused:
            store.commit(engine, step=1, client_state={"universal_checkpoint_info": info})
        assert all(part in str(refused.value) for part in named), (str(refused.value), named)
    assert store.steps() == []
    assert (
        sorted(
            path
            for path in (tmp_path / "store").rglob("*")
            if "catalog" not in path.name and path.name != "lock"
        )
        == before
    )
    good = {
        "parameter_with_sub_params": [SUB],
        "original_vocab_size": 32,
        "tp_replicated_parameter_patterns": [],
    }
    store.commit(engine, step=1, client_state={"universal_checkpoint_info": good})
    destroy_engine(engine)
    assert store.steps() == [1]


def commit_named_module(store, tmp_path, module_name: str, step: int = 1) -> None:
    """Commit (ZeRO-1, fp32) a one-layer model whose only module is called ``module_name``
    (PyTorch allows a '/' in a module's name, so a parameter may be named by a path)."""
    import collections

    import deepspeed

    from tools.engines import ds_config

    torch.manual_seed(0)
    model = torch.nn.Sequential(collections.OrderedDict([(module_name, torch.nn.Linear(8, 8))]))
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(1, "fp32", scheduler=False, optimizer={"params": {"torch_adam": True}}),
    )
    engine.backward(engine(torch.randn(2, 8)).pow(2).mean())
    engine.step()
    store.commit(engine, step=step, client_state=CLIENT_STATE)
    destroy_engine(engine)


def test_a_parameter_named_by_an_absolute_path_is_refused_and_nothing_is_written_outside_the_output(
    tmp_path, run
):
    # A store's writer names a module by an absolute path: ds_to_universal would join it to
    # zero/ as it is and write fp32.pt, exp_avg.pt... there. The reader's materialize refuses
    # the step before writing anything, naming the parameter; a name with '/' inside is
    # nested folders under zero/, as ds_to_universal writes it.
    store = ckptstore.open(tmp_path / "store", create=True)
    outside = tmp_path / "outside"
    commit_named_module(store, tmp_path, str(outside / "planted"), step=1)
    commit_named_module(store, tmp_path, "blocks/0", step=2)
    store.close()

    refused = run("--store", tmp_path / "store", "materialize", "--universal", "--step", 1, tmp_path / "out")

    assert refused.returncode == 6, refused
    assert f"{outside}/planted.bias" in refused.stderr and "is absolute" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert not outside.exists() and not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []

    nested = run("--store", tmp_path / "store", "materialize", "--universal", "--step", 2, tmp_path / "out")
    assert nested.returncode == 0, nested.stderr
    zero = tmp_path / "out" / "global_step2_universal" / "zero"
    assert sorted(p.name for p in (zero / "blocks" / "0.weight").iterdir()) == [
        "exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt",
    ]  # fmt: skip


# Matched with re.match, as ds_to_universal matches, this takes hours on a 38-character name.
BACKTRACKING = r"(.|\w)*(?<=X)"


def test_a_pattern_that_backtracks_without_bound_is_refused_at_commit_and_a_planted_one_at_read(
    tmp_path, run, monkeypatch
):
    monkeypatch.setenv("CKPTSTORE_PATTERN_SECONDS", "0.2")
    store = ckptstore.open(tmp_path / "store", create=True)
    engine = build_engine("llama", zero_stage=1, dtype="fp32", seed=0, num_layers=1)
    train(engine, DATA[:1])
    slow = {"universal_checkpoint_info": {"tp_replicated_parameter_patterns": [BACKTRACKING]}}

    with pytest.raises(BadInputError, match=r"universal_checkpoint_info.*takes more than 0.2 s to match"):
        store.commit(engine, step=1, client_state=slow)
    assert store.steps() == []
    too_long = {"universal_checkpoint_info": {"tp_replicated_parameter_patterns": ["x" * 1025]}}
    with pytest.raises(BadInputError, match="longer than 1024 characters"):
        store.commit(engine, step=1, client_state=too_long)
    affine = {"universal_checkpoint_info": {"affine_map": {"params": {"((": {}}}}}
    with pytest.raises(BadInputError, match="affine_map has a pattern that is no regular expression"):
        store.commit(engine, step=1, client_state=affine)

    # A writer of the store who skips the commit's check plants the pattern in a step.
    from ckptstore.deepspeed import universal_info

    with monkeypatch.context() as planting:
        planting.setattr(universal_info, "check_patterns", lambda *args: None)
        store.commit(engine, step=1, client_state=slow)
    destroy_engine(engine)
    store.close()

    refused = run("--store", tmp_path / "store", "materialize", "--universal", "--step", 1, tmp_path / "out")

    assert refused.returncode == 4, refused
    assert "step 1" in refused.stderr and "backtracks without bound" in refused.stderr
    assert not (tmp_path / "out").exists()
