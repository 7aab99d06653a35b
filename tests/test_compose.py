"""Compose specs: a checkpoint assembled from layer ranges of chosen steps, and clear errors for bad specs."""

import pytest
import torch
import yaml

import ckptstore
from ckptstore.cli import main
from ckptstore.deepspeed.extract import extract
from ckptstore.errors import BadInputError
from ckptstore.layers import layer_of
from ckptstore.materialize.compose import plan
from ckptstore.strategies import Parity
from tools.engines import batches, build_engine, train

DATA = batches(8)


def state_values(engine):
    return {(p.name, p.kind): p.tensor.clone() for p in extract(engine).pieces}


def test_a_spec_materializes_each_layer_from_the_step_it_names(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=4)
    saved = {}
    for step, layers in ((2, None), (4, None), (6, Parity())):
        train(engine, DATA[step - 2 : step])
        store.commit(engine, step=step, layers=layers)
        saved[step] = state_values(engine)
    spec = {
        "state": 4,
        "slices": [
            {"layer_range": [0, 1], "step": 6},  # step 6 inherits block 0 from step 4
            {"layer_range": [1, 3], "step": 2},
            {"layer_range": [3, 4], "step": 6},
        ],
        "aux": {"model.embed_tokens": 2, "lm_head": 6},  # model.norm: the state step's
    }
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(spec))
    expected_sources = {
        "model.embed_tokens": 2, "model.layers.0": 4, "model.layers.1": 2, "model.layers.2": 2,
        "model.layers.3": 6, "model.norm": 4, "lm_head": 6,
    }  # fmt: skip
    assert plan(tmp_path / "compose.yaml", store.catalog).sources == expected_sources

    fetched = []
    real_get = store.objects.get
    store.objects.get = lambda name: fetched.append(name) or real_get(name)
    out = store.materialize(spec=tmp_path / "compose.yaml", out=tmp_path / "out")
    needed = {row.blob for s in set(expected_sources.values()) for row in store.catalog.tensors(s)
              if expected_sources[row.layer] == s}  # fmt: skip
    assert sorted(fetched) == sorted(f"blobs/{key[:2]}/{key}" for key in needed)  # each needed blob, once
    assert (out / "latest").read_text() == "global_step4"

    resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=9, num_layers=4)
    resumed.load_checkpoint(str(out))
    assert resumed.global_steps == 4  # counters and scheduler: the state step's
    loaded = state_values(resumed)
    assert loaded.keys() == saved[4].keys()
    for (name, kind), tensor in loaded.items():
        assert torch.equal(tensor, saved[expected_sources[layer_of(name)]][(name, kind)]), (name, kind)
    assert all(torch.isfinite(torch.tensor(train(resumed, DATA[6:8]))))


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory, store_key):
    """Steps 2 and 3 of a 2-block Llama, and step 9 of a 3-block one."""
    root = tmp_path_factory.mktemp("compose") / "store"
    store = ckptstore.open(root)
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=2)
    train(engine, DATA[:1])
    store.commit(engine, step=2)
    train(engine, DATA[1:2])
    store.commit(engine, step=3, layers=["model.layers.1"])
    store.commit(build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=3), step=9)
    store.close()
    return root


def both(step_a=2, step_b=3):
    return [{"layer_range": [0, 1], "step": step_a}, {"layer_range": [1, 2], "step": step_b}]


BAD_SPECS = [
    ({"state": 3, "slices": [{"layer_range": [0, 2], "step": 7}]},
     "slices[0].step: step 7 does not exist; committed steps: 2, 3, 9"),
    ({"state": 8, "slices": both()}, "state: step 8 does not exist"),
    ({"state": 3, "slices": [{"layer_range": [0, 2], "step": 2}, {"layer_range": [1, 2], "step": 3}]},
     "slices[1].layer_range [1, 2] overlaps slices[0] at block 1"),
    ({"state": 3, "slices": [{"layer_range": [0, 1], "step": 2}]}, "block 1 in no slice"),
    ({"state": 3, "slices": [{"layer_range": [0, 3], "step": 2}]},
     "slices[0].layer_range [0, 3] is out of range: the model has blocks 0-1"),
    ({"state": 3, "slices": [{"layer_range": [1, 1], "step": 2}]}, "is empty or negative"),
    ({"state": 3, "slices": both(), "aux": {"model.layers.0": 2}},
     "aux: model.layers.0 is not an auxiliary layer of the model (its auxiliary layers are "
     "model.embed_tokens, model.norm, lm_head)"),
    ({"state": 3, "slices": both(), "aux": {"transformer.wte": 2}}, "transformer.wte is not an auxiliary layer"),
    ({"state": 3, "slice": both()}, "unknown key slice (expected state, slices, aux)"),
    ({"slices": both()}, "'state' (the step giving the non-tensor state) is missing"),
    ({"state": 3, "slices": [{"layer_range": [0, 2], "step": True}]}, "slices[0].step must be an integer"),
    ({"state": 3, "slices": [{"range": [0, 2], "step": 2}]}, "slices[0] must have exactly the keys layer_range and step"),
    ({"state": 9, "slices": [{"layer_range": [0, 3], "step": 2}]}, "step 2 holds a different model than the state step 9"),
    ("- 1\n- 2\n", "must be a mapping with keys state, slices, aux"),
    ("state: [1, 2\n", "is not valid YAML"),
]  # fmt: skip


@pytest.mark.parametrize("spec, message", BAD_SPECS, ids=[m.split(":")[0][:40] for _, m in BAD_SPECS])
def test_bad_specs_are_refused_with_one_clear_line_and_nothing_written(
    two_steps, tmp_path, capsys, spec, message
):
    path = tmp_path / "compose.yaml"
    path.write_text(spec if isinstance(spec, str) else yaml.safe_dump(spec))
    store = ckptstore.open(two_steps)
    with pytest.raises(BadInputError) as error:
        store.materialize(spec=path, out=tmp_path / "out")
    assert message in str(error.value)

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["--store", str(two_steps), "materialize", "--spec", str(path), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith("error: compose spec") and message in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compose.yaml"]  # no output, no staging


def test_the_cli_materializes_a_spec_and_refuses_a_step_with_it(two_steps, tmp_path, capsys):
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump({"state": 3, "slices": both(step_a=3, step_b=2)}))
    main(["--store", str(two_steps), "materialize", "--spec", str(path), str(tmp_path / "out")])
    assert (tmp_path / "out" / "latest").read_text() == "global_step3"
    with pytest.raises(SystemExit) as exit_:
        main(
            [
                "--store",
                str(two_steps),
                "materialize",
                "--step",
                "3",
                "--spec",
                str(path),
                str(tmp_path / "o2"),
            ]
        )
    assert exit_.value.code == 2 and "exclude each other" in capsys.readouterr().err


def test_a_missing_spec_file_is_bad_input(two_steps, tmp_path):
    with pytest.raises(BadInputError, match="cannot read compose spec"):
        ckptstore.open(two_steps).materialize(spec=tmp_path / "nope.yaml", out=tmp_path / "out")
