"""Auxiliary files (config, tokenizer) are kept with a step and copied out by materialize."""

import pytest

import ckptstore
from ckptstore.errors import BadInputError
from ckptstore.format import manifest
from ckptstore.format.layout import manifest_name
from tools.engines import batches, build_engine, train


@pytest.fixture(scope="module")
def engine():
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=2)
    train(engine, batches(1))
    return engine


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_files_round_trip_are_inherited_and_stored_once(tmp_path, engine):
    config = write(tmp_path / "src" / "config.json", '{"hidden": 32}')
    tokenizer = write(tmp_path / "src" / "tok" / "tokenizer.json", '{"vocab": {}}')
    store = ckptstore.open(tmp_path / "store")
    store.commit(engine, step=1, files=[config, tokenizer])
    store.commit(engine, step=2)  # no files given: step 1's are kept
    store.commit(engine, step=3, files=tmp_path / "src")  # a directory: relative paths
    store.commit(engine, step=4, files=[])

    assert [f.path for f in store.files(1)] == ["config.json", "tokenizer.json"]
    assert store.files(2) == store.files(1)
    assert [f.path for f in store.files(3)] == ["config.json", "tok/tokenizer.json"]
    assert store.files(4) == []
    assert len(list(store.objects.list("files/"))) == 2  # identical contents stored once
    record = manifest.decode(
        store.objects.get(manifest_name(3)), store.objects.content_hash, manifest_name(3)
    )
    assert [(f.path, f.size) for f in record.files] == [("config.json", 14), ("tok/tokenizer.json", 13)]

    out = store.materialize(2, tmp_path / "out2")
    assert (out / "config.json").read_text() == '{"hidden": 32}'
    assert (out / "tokenizer.json").read_text() == '{"vocab": {}}'
    assert (out / "latest").read_text() == "global_step2"
    out = store.materialize(3, tmp_path / "out3")
    assert (out / "tok" / "tokenizer.json").read_text() == '{"vocab": {}}'
    assert not any(p.name.endswith(".json") for p in store.materialize(4, tmp_path / "out4").iterdir())


def test_bad_files_are_refused_before_anything_is_stored(tmp_path, engine):
    store = ckptstore.open(tmp_path / "store")
    a = write(tmp_path / "a" / "config.json", "a")
    b = write(tmp_path / "b" / "config.json", "b")
    with pytest.raises(BadInputError, match="two files would be stored as config.json"):
        store.commit(engine, step=1, files=[a, b])
    with pytest.raises(BadInputError, match="is not a file or directory"):
        store.commit(engine, step=1, files=[tmp_path / "missing.json"])
    with pytest.raises(BadInputError, match="latest would replace part of the DeepSpeed checkpoint"):
        store.commit(engine, step=1, files=[write(tmp_path / "latest", "x")])
    assert store.steps() == [] and not list(store.objects.list("blobs/"))


def test_oversized_files_are_refused(tmp_path, engine, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_MAX_FILE_BYTES", "4")
    with pytest.raises(BadInputError, match="more than the 4 allowed"):
        ckptstore.open(tmp_path / "store").commit(
            engine, step=1, files=[write(tmp_path / "big.txt", "12345")]
        )


def test_gc_deletes_files_only_dropped_steps_carried(tmp_path, engine):
    old = write(tmp_path / "v1" / "config.json", '{"version": 1}')
    new = write(tmp_path / "v2" / "config.json", '{"version": 2}')
    store = ckptstore.open(tmp_path / "store")
    store.commit(engine, step=1, files=[old])
    store.commit(engine, step=2)  # inherits step 1's file
    store.commit(engine, step=3, files=[new])

    kept_both = store.gc(keep_steps=[2, 3], grace=0)
    assert kept_both.steps_dropped == [1] and kept_both.files_freed == 0  # step 2 still carries v1

    dry = store.gc(keep_last=1, grace=0, dry_run=True)
    assert dry.files_freed == 1 and len(list(store.objects.list("files/"))) == 2
    young = store.gc(keep_last=1)  # the default grace period protects new objects
    assert young.files_freed == 0 and young.files_spared == 1
    report = store.gc(grace=0)
    assert report.files_freed == 1 and report.bytes_freed >= len('{"version": 1}')
    assert [info.size for info in store.objects.list("files/")] == [len('{"version": 2}')]
    assert (store.materialize(3, tmp_path / "out") / "config.json").read_text() == '{"version": 2}'
    assert store.verify().ok


def test_verify_names_a_missing_or_damaged_file_and_the_steps_carrying_it(tmp_path, engine):
    from ckptstore.format.layout import file_name

    store = ckptstore.open(tmp_path / "store")
    store.commit(engine, step=1, files=[write(tmp_path / "config.json", '{"hidden": 32}')])
    store.commit(engine, step=2)
    assert store.verify().files_checked == 1 and store.verify().ok
    key = store.files(1)[0].key
    path = store.objects.root / file_name(key)

    path.write_text('{"hidden": 64}')  # same size, other bytes
    assert store.verify(deep=False).ok  # fast mode compares sizes only
    [problem] = store.verify().file_problems
    assert problem.describe() == (
        f"auxiliary file config.json (stored as {key}) is corrupt (its content does not hash to its key); "
        "needed by steps 1, 2"
    )
    path.unlink()
    [problem] = store.verify(deep=False).file_problems
    assert problem.problem == "is missing"
    with pytest.raises(ckptstore.CorruptError, match="auxiliary file"):
        store.gc(grace=0)  # gc does not run on a damaged store


def test_materialize_names_the_checkpoint_folder_by_the_tag_a_loader_asks_for(tmp_path, engine):
    # accelerate's save_state/load_state use the tag "pytorch_model", not global_step<N>.
    store = ckptstore.open(tmp_path / "store")
    store.commit(engine, step=1, files=[write(tmp_path / "pytorch_model" / "x.json", "{}")])
    with pytest.raises(BadInputError, match="name of a file kept with the step"):
        store.materialize(1, tmp_path / "clash", tag="x.json")
    store.commit(engine, step=2, files=[write(tmp_path / "config.json", "{}")])
    out = store.materialize(2, tmp_path / "out", tag="pytorch_model")
    assert (out / "latest").read_text() == "pytorch_model"
    assert {p.name for p in out.iterdir()} >= {"config.json", "latest", "pytorch_model"}
    assert not any(p.name.startswith("global_step") for p in out.iterdir())
    resumed = build_engine("llama", zero_stage=1, dtype="bf16", seed=1, num_layers=2)
    path, _ = resumed.load_checkpoint(str(out), tag="pytorch_model")
    assert path is not None and resumed.global_steps == engine.global_steps
    for bad in ("", "latest", "a/b", ".."):
        with pytest.raises(BadInputError, match="cannot name a checkpoint folder"):
            store.materialize(2, tmp_path / "bad", tag=bad)
    assert not (tmp_path / "bad").exists() and not (tmp_path / "clash").exists()
