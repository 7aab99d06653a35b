"""Auxiliary files come from the store, so where they may land is one rule, applied on every path.

Whoever can write the store (a shared directory, the bucket) can add a row to the catalog's
``files`` table or a manifest. Such a row must never put a file where DeepSpeed unpickles or a
script runs: materialize and export refuse it with CorruptError (exit 4) naming the step and the
path, before anything is written, and the store's own loads never run a pickle.
"""

from __future__ import annotations

import contextlib
import io
import logging
import pathlib
import pickle
import random
import sqlite3

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptstore
from ckptstore import auxfiles
from ckptstore.deepspeed import torchfile
from ckptstore.errors import BadInputError, CorruptError
from ckptstore.format import manifest, plainfile
from ckptstore.format.layout import file_name, manifest_name
from ckptstore.integrations.dcp import StoreReader, StoreWriter
from tests.test_dcp_store import emptied, save_hostile_dcp_step, training_state
from tools.engines import batches, build_engine, train

KEY = bytes(range(32))

# What a store writer might name a file to get it run or unpickled on a reader.
REFUSED = [
    "./global_step4/mp_rank_00_model_states.pt",
    "latest",
    "latest_universal",
    "zero_to_fp32.py",
    "zero_to_torch.py",
    "global_step4/x",
    "global_step4",
    "a/../b",
    "/abs",
    "a//b",
    "a/./b",
    "a\\b",
    "a\0b",
    "",
]


class RunsCode:
    """Unpickling this writes ``path``: the proof that a load ran a store writer's code."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.write_text, (self.path, "ran"))


def code_running_pickle(marker: pathlib.Path) -> bytes:
    buffer = io.BytesIO()
    torch.save({"module": RunsCode(marker)}, buffer)
    return buffer.getvalue()


def torch_saved(obj, **options) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, **options)
    return buffer.getvalue()


def rng_state() -> dict:
    """What the Trainer's ``rng_state.pth`` and accelerate's ``random_states_0.pkl`` hold."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}


@pytest.fixture(scope="module")
def engine(zero1_engine):
    return zero1_engine


@pytest.fixture
def store(tmp_path, engine):
    config = tmp_path / "src" / "config.json"
    config.parent.mkdir()
    config.write_text('{"hidden": 32}')
    store = ckptstore.open(tmp_path / "store")
    store.commit(engine, step=4, files=[config])
    return store


def add_row(store, step: int, path: str, data: bytes) -> None:
    """What a store writer can do: store an object and point a catalog row at it."""
    key = auxfiles.file_key(data)
    store.objects.put_if_absent(file_name(key), data)
    with sqlite3.connect(store.objects.root / "catalog.db") as db:
        db.execute(
            "INSERT INTO files (step, path, key, size) VALUES (?, ?, ?, ?)", [step, path, key, len(data)]
        )


def listing(folder: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "path", ["config.json", "tok/tokenizer.json", "a.b/c", ".hidden", "x..y", "latest.txt"]
)
def test_the_rule_allows_canonical_relative_paths_outside_the_checkpoint(path):
    assert auxfiles.refusal(path) is None


@pytest.mark.parametrize("path", REFUSED)
def test_the_rule_refuses_paths_that_are_not_canonical_or_replace_deepspeed_files(path):
    assert auxfiles.refusal(path)


def test_commit_applies_the_same_rule(tmp_path, engine):
    source = tmp_path / "src" / "global_step7"
    source.mkdir(parents=True)
    (source / "x.json").write_text("{}")
    store = ckptstore.open(tmp_path / "store")
    with pytest.raises(
        BadInputError, match="global_step7/x.json would replace part of the DeepSpeed checkpoint"
    ):
        store.commit(engine, step=1, files=tmp_path / "src")
    assert store.steps() == []


@pytest.mark.parametrize("path", ["./global_step4/mp_rank_00_model_states.pt", "latest", "zero_to_fp32.py",
                                  "global_step4/x", "a/../b", "/abs"])  # fmt: skip
def test_materialize_refuses_an_aux_file_under_the_checkpoint_folder_or_off_the_rule(store, tmp_path, path):
    marker = tmp_path / "ran"
    add_row(store, 4, path, code_running_pickle(marker))
    with pytest.raises(CorruptError, match=f"step 4 keeps an auxiliary file at {path!r}"):
        store.materialize(4, tmp_path / "out")
    with pytest.raises(CorruptError, match=f"step 4 keeps an auxiliary file at {path!r}"):
        store.export(4, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "store"]  # nothing written, not even staging
    assert not marker.exists()
    [problem] = store.verify().catalog_problems
    assert problem.startswith(f"step 4 keeps an auxiliary file at {path!r}")


def test_a_refused_row_leaves_a_forced_output_as_it_was(store, tmp_path):
    out = store.materialize(4, tmp_path / "out")
    before = listing(out)
    add_row(store, 4, "latest", b"global_step666")
    with pytest.raises(CorruptError, match="step 4 keeps an auxiliary file at 'latest'"):
        store.materialize(4, out, force=True)
    assert listing(out) == before


def test_rows_that_clash_with_each_other_are_refused(store, tmp_path):
    add_row(store, 4, "config.json/inner", b"{}")
    with pytest.raises(CorruptError, match="'config.json' and another under it"):
        store.materialize(4, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_with_exit_4_and_one_line(store, tmp_path, run):
    add_row(store, 4, "./global_step4/mp_rank_00_model_states.pt", code_running_pickle(tmp_path / "ran"))
    for command in (["materialize", "--step", 4, tmp_path / "out"], ["export", "--step", 4, tmp_path / "hf"]):
        result = run("--store", store.objects.uri, *command)
        assert result.returncode == 4, result
        # A fresh process checks step 4's rows against their digest first: the added row is
        # refused as a changed catalog before its path is; either way, step 4 is named.
        assert result.stderr.startswith(
            (
                "error: step 4 keeps an auxiliary file at './global_step4/",
                "error: the catalog's rows of step 4",
            )
        )
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1
    assert (
        not (tmp_path / "out").exists() and not (tmp_path / "hf").exists() and not (tmp_path / "ran").exists()
    )


def test_a_manifest_naming_a_refused_path_is_not_imported_from_s3(s3, tmp_path, engine, monkeypatch, run):
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "cache-a"))
    config = tmp_path / "config.json"
    config.write_text("{}")
    store = ckptstore.open(s3.uri())
    store.commit(engine, step=4, files=[config])
    store.commit(engine, step=5)
    store.close()
    objects = store.objects
    record = manifest.decode(objects.get(manifest_name(4)))
    add = auxfiles.store(
        objects, [("./global_step4/mp_rank_00_model_states.pt", code_running_pickle(tmp_path / "ran"))]
    )
    record.files = record.files + add
    objects.delete(manifest_name(4))
    objects.put_if_absent(manifest_name(4), manifest.encode(record))

    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "cache-b"))  # another machine reads the bucket
    elsewhere = ckptstore.open(s3.uri(), create=False)
    with pytest.raises(ckptstore.CorruptError, match="step 4 cannot be read: .*global_step4"):
        elsewhere.materialize(4, tmp_path / "out4")
    assert elsewhere.steps() == [5]  # the tampered manifest was skipped as corrupt
    out = elsewhere.materialize(5, tmp_path / "out5")
    assert (out / "config.json").read_text() == "{}"
    elsewhere.close()
    result = run("--store", s3.uri(), "catalog", "rebuild")
    assert result.returncode == 1
    assert "step 4 keeps an auxiliary file at './global_step4/mp_rank_00_model_states.pt'" in result.stdout
    assert not (tmp_path / "ran").exists()


def test_the_stores_own_loads_never_run_a_pickle(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "evil.pt").write_bytes(code_running_pickle(marker))
    with pytest.raises(CorruptError, match="evil.pt holds more than a checkpoint ckptstore writes"):
        torchfile.load(tmp_path / "evil.pt")
    assert not marker.exists()


@pytest.mark.parametrize("stage, dtype", [(0, "fp32"), (1, "bf16"), (2, "bf16"), (3, "fp32")])
def test_every_file_materialize_writes_loads_with_weights_only(tmp_path, stage, dtype):
    engine = build_engine("llama", zero_stage=stage, dtype=dtype, seed=0, num_layers=2)
    train(engine, batches(1))
    store = ckptstore.open(tmp_path / "store")
    store.commit(engine, step=1)
    out = store.materialize(1, tmp_path / "out")
    files = sorted((out / "global_step1").glob("*.pt"))
    assert len(files) >= (1 if stage == 0 else 2)
    for path in files:
        assert isinstance(torchfile.load(path, "cpu"), dict)


def test_an_attached_load_that_materializes_reads_every_file_weights_only(tmp_path, monkeypatch):
    from ckptstore.integrations.deepspeed import attach

    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    train(engine, batches(2))
    store = ckptstore.open(tmp_path / "store")
    attach(engine, store)
    engine.save_checkpoint(str(tmp_path / "run"))
    loaded = []
    safe_load = torchfile.load
    monkeypatch.setattr(
        torchfile, "load", lambda path, *a, **k: loaded.append(path) or safe_load(path, *a, **k)
    )
    resumed = build_engine("llama", zero_stage=2, dtype="bf16", seed=1, num_layers=2)
    attach(resumed, store)
    # load_module_strict is an option restore does not take: the step is materialized and loaded
    path, _ = resumed.load_checkpoint(str(tmp_path / "run"), load_module_strict=True)
    assert path is not None and resumed.global_steps == engine.global_steps
    read = [
        p for p in map(str, loaded) if "/checkpoint/global_step" in p
    ]  # DeepSpeed's reads, not the writer's
    assert len(read) >= 2 and all(p.endswith(".pt") for p in read)


def committed_with(tmp_path, engine, files: dict[str, bytes], keyed: bool = False, uri=None):
    """A store (at ``uri``, default tmp_path/store) whose step 4 keeps ``files``, committed as
    any user would (``files=``)."""
    source = tmp_path / "src"
    for name, data in files.items():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_bytes(data)
    store = ckptstore.open(uri or tmp_path / "store", key=KEY if keyed else None)
    store.commit(engine, step=4, files=source)
    return store


# Ways to put a code-running pickle in a file: torch.save's zip, its legacy format, a bare pickle.
HOSTILE_CONTENT = {
    "zip": code_running_pickle,
    "legacy": lambda marker: torch_saved({"m": RunsCode(marker)}, _use_new_zipfile_serialization=False),
    "bare": lambda marker: pickle.dumps(RunsCode(marker), protocol=0),
}


@pytest.mark.parametrize(
    "name, content, keyed",
    [("custom_checkpoint_0.pkl", "zip", False), ("notes.txt", "bare", True), ("vocab.pt", "legacy", False)],
)
def test_a_file_that_is_no_plain_data_is_left_out_with_a_warning_unless_allow_pickle(
    tmp_path, engine, name, content, keyed, caplog
):
    marker = tmp_path / "ran"
    data = HOSTILE_CONTENT[content](marker)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        store = committed_with(tmp_path, engine, {name: data, "config.json": b"{}"}, keyed)
    assert f"the file {name} " in caplog.text and "materialize leaves it out" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        out = store.materialize(4, tmp_path / "out", tag="pytorch_model")
    assert f"step 4's auxiliary file {name} " in caplog.text and "left out" in caplog.text
    assert (out / "config.json").read_bytes() == b"{}" and not (out / name).exists()
    if name.startswith("vocab"):  # a name export copies into a model folder
        assert not (store.export(4, tmp_path / "hf").path / name).exists()
    assert store.verify().ok  # nothing is corrupt

    out = store.materialize(4, tmp_path / "trusted", tag="pytorch_model", allow_pickle=True)
    assert not marker.exists()
    with contextlib.suppress(RuntimeError):  # a bare pickle runs as torch.load reads its magic number
        torch.load(out / name, weights_only=False)  # what accelerate's load_state does with it
    assert marker.read_text() == "ran"  # the attack is real


def test_the_cli_leaves_out_a_pickle_with_a_warning_and_writes_it_with_allow_pickle(tmp_path, engine, run):
    marker = tmp_path / "ran"
    store = committed_with(tmp_path, engine, {"custom_checkpoint_0.pkl": code_running_pickle(marker)})
    uri = store.objects.uri
    done = run("--store", uri, "materialize", "--step", 4, "--tag", "pytorch_model", tmp_path / "out")
    assert done.returncode == 0, done
    assert "step 4's auxiliary file custom_checkpoint_0.pkl is a zip archive" in done.stderr
    assert "left out (materialize --allow-pickle writes it)" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "out" / "custom_checkpoint_0.pkl").exists()
    assert run("--store", uri, "verify").returncode == 0
    written = run("--store", uri, "materialize", "--step", 4, "--allow-pickle", tmp_path / "trusted")
    assert written.returncode == 0, written
    assert (tmp_path / "trusted" / "custom_checkpoint_0.pkl").is_file() and not marker.exists()
    assert "--allow-pickle" in run("materialize", "--help").stdout


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's, reading the protocol 5 one
def test_data_files_go_out_as_they_were_and_pickles_as_ckptstores_own_bytes_of_the_same_value(
    tmp_path, engine
):
    from tests.test_plainfile import data_files, load_any, pickle_files, same

    files = {**data_files(), **pickle_files()}
    store = committed_with(tmp_path, engine, files)
    out = store.materialize(4, tmp_path / "out")
    assert {name: (out / name).read_bytes() for name in data_files()} == data_files()
    for name, data in pickle_files().items():
        assert same(load_any((out / name).read_bytes()), load_any(data)), name
        assert (out / name).stat().st_mode & 0o777 == 0o644
    assert store.verify().ok


def every_file_loaded(out: pathlib.Path) -> int:
    """Load every file under ``out`` as the most trusting loaders would; how many were pickles."""
    from accelerate.utils import load as accelerate_load

    loaded = 0
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        for load in (
            lambda p: torch.load(p, weights_only=False, map_location="cpu"),
            lambda p: accelerate_load(p, map_location="cpu", weights_only=False),
            lambda p: pickle.loads(p.read_bytes()),
        ):
            with contextlib.suppress(Exception):
                load(path)
                loaded += 1
    return loaded


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize(
    "where, keyed", [("local", False), ("local", True), ("s3", False)], ids=["unkeyed", "keyed", "s3"]
)
def test_no_pickle_flavour_committed_or_planted_reaches_any_loader_of_the_directory(
    tmp_path, engine, where, keyed, request
):
    from tests.test_plainfile import hostile_files, pickle_files

    marker = tmp_path / "ran"
    hostile = {name.replace(".", "-committed."): data for name, data in hostile_files(marker).items()}
    uri = request.getfixturevalue("s3").uri() if where == "s3" else None
    store = committed_with(tmp_path, engine, {**hostile, **pickle_files()}, keyed, uri)  # a commit runs none
    if where == "local" and not keyed:  # a writer points rows at the bytes (a keyed store refuses such rows)
        for name, data in hostile_files(marker).items():
            add_row(store, 4, name.replace(".", "-planted."), data)
        assert {row.path for row in store.files(4)} >= {
            n.replace(".", "-planted.") for n in hostile_files(marker)
        }
    out = store.materialize(4, tmp_path / "out")
    # Out go only ckptstore's own bytes: of what a commit read as plain data (a torch zip's
    # data.pkl without its extra record), never a planted row's bytes.
    went_out = {p.name for p in out.iterdir() if "-committed." in p.name or "-planted." in p.name}
    assert went_out == {name for name, data in hostile.items() if plainfile.encode(data, 1 << 20).plain}
    assert every_file_loaded(out) >= len(pickle_files())
    engine.load_checkpoint(str(out))  # DeepSpeed reads the directory too
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["deepspeed", "accelerate", "dcp"])
def test_every_loader_of_every_materialized_directory_runs_no_store_writers_code(tmp_path, engine, kind):
    from accelerate.utils import load as accelerate_load

    marker = tmp_path / "ran"
    benign, hostile = tmp_path / "benign", tmp_path / "hostile"
    benign.mkdir()
    hostile.mkdir()
    if kind == "dcp":
        with ckptstore.open(benign / "store") as store:
            dcp.save(training_state(), storage_writer=StoreWriter(store, step=4))
            out = store.materialize(4, tmp_path / "out")
        with ckptstore.open(hostile / "store") as store:
            save_hostile_dcp_step(store, marker, step=4)
            with pytest.raises(CorruptError):
                store.materialize(4, tmp_path / "refused")
        loaded = emptied(training_state())
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(out))  # DCP's own reader
        assert loaded["train"] == training_state()["train"]
    else:
        tag = "pytorch_model" if kind == "accelerate" else None
        kept = {"custom_checkpoint_0.pkl": torch_saved({"count": torch.tensor(3)}),
                "random_states_0.pkl": torch_saved(rng_state())}  # fmt: skip
        out = committed_with(benign, engine, kept).materialize(4, tmp_path / "out", tag=tag)
        store = committed_with(hostile, engine, {"custom_checkpoint_0.pkl": code_running_pickle(marker)})
        left = store.materialize(4, tmp_path / "left", tag=tag)
        assert not (left / "custom_checkpoint_0.pkl").exists()
        every_file_loaded(left)

        # accelerate's load_state: load_custom_state's call for a registered object, then its RNG states
        custom = accelerate_load(out / "custom_checkpoint_0.pkl", map_location="cpu", weights_only=False)
        assert custom["count"] == 3
        assert accelerate_load(out / "random_states_0.pkl")["numpy"][0] == "MT19937"
    pickles = [p for p in out.rglob("*") if p.suffix in (".pt", ".pkl", ".bin", ".pth")]
    assert pickles or kind == "dcp"
    for path in pickles:
        torch.load(path, weights_only=False)
    assert not (tmp_path / "refused").exists() and not marker.exists()


@pytest.mark.parametrize(
    "name", ["torch.py", "sitecustomize.py", "deepspeed/__init__.py", "x.pth", "ext.cpython-311-x86_64.so",
             "pkg/__pycache__/m.cpython-311.pyc", "usercustomize"],
)  # fmt: skip
def test_a_name_python_would_import_or_run_is_refused_at_commit_and_left_out_on_the_way_out(
    tmp_path, engine, name, caplog
):
    source = tmp_path / "src"
    (source / name).parent.mkdir(parents=True)
    (source / name).write_bytes(b"import os; os.system('touch ran')\n")
    store = ckptstore.open(tmp_path / "store")
    with pytest.raises(BadInputError, match=f"files=: {name} is .*; rename it or leave it out"):
        store.commit(engine, step=4, files=source)
    assert store.steps() == []

    store.commit(engine, step=4)  # a store writer adds the row
    add_row(store, 4, name, b"import os; os.system('touch ran')\n")
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        out = store.materialize(4, tmp_path / "out", allow_pickle=True)  # not even for a trusted store
    assert f"step 4's auxiliary file {name} is " in caplog.text and not (out / name).exists()


def test_a_trainers_rng_state_pth_is_kept_as_plain_data_and_goes_out_with_mode_0644(tmp_path, engine):
    from tests.test_plainfile import same

    store = committed_with(tmp_path, engine, {"rng_state.pth": torch_saved(rng_state())})
    out = store.materialize(4, tmp_path / "out")
    assert same(
        torch.load(out / "rng_state.pth", weights_only=False),
        torch.load(tmp_path / "src" / "rng_state.pth", weights_only=False),
    )
    assert (out / "rng_state.pth").stat().st_mode & 0o777 == 0o644


def test_no_read_path_calls_an_unpickler_on_store_bytes(tmp_path, engine, monkeypatch):
    """A step whose files and DCP bytes items are plain data is read whole by every verb with
    every unpickler broken: reading a store never unpickles its bytes."""
    from tests.test_plainfile import pickle_files

    store = committed_with(tmp_path, engine, {"config.json": b"{}", **pickle_files()})
    with ckptstore.open(tmp_path / "dcp-store") as dcp_store:
        dcp.save(training_state(), storage_writer=StoreWriter(dcp_store, step=1))

    def refuse(*args, **kwargs):
        raise AssertionError("an unpickler ran on a read path")

    # DCP's load planner torch.loads each bytes item it is handed: only ckptstore's own bytes.
    ours, real_load, real_unpickler, rebuild = set(), torch.load, pickle.Unpickler, plainfile.decode
    monkeypatch.setattr(plainfile, "decode", lambda *args: ours.add(rebuild(*args)) or rebuild(*args))

    def load_ours(source, *args, **kwargs):
        if not (isinstance(source, io.BytesIO) and source.getvalue() in ours):
            refuse()
        refusing, pickle.Unpickler = pickle.Unpickler, real_unpickler
        try:
            return real_load(source, *args, **kwargs)
        finally:
            pickle.Unpickler = refusing

    class Refusing(pickle.Unpickler):
        def __init__(self, *args, **kwargs):
            refuse()

    monkeypatch.setattr(pickle, "Unpickler", Refusing)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", load_ours)
    store.materialize(4, tmp_path / "out")
    store.export(4, tmp_path / "hf")
    assert store.verify().ok
    assert store.restore(engine, 4)[0] == 4
    with ckptstore.open(tmp_path / "dcp-store") as dcp_store:
        dcp_store.materialize(1, tmp_path / "dcp-out")
        assert dcp_store.verify().ok
        loaded = emptied(training_state())
        dcp.load(loaded, storage_reader=StoreReader(dcp_store, step=1))
    assert loaded["train"] == training_state()["train"]
