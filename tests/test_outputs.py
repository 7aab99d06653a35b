"""What materialize, export and the read-only commands may change: never a store, never a folder
a person made, never the working directory; and a killed materialize leaves nothing for good."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckptstore
from ckptstore.errors import BadInputError, ConflictError, CorruptError, NotFoundError
from ckptstore.materialize import outputs
from ckptstore.materialize.outputs import MARKER


@pytest.fixture(scope="module")
def engine(zero1_engine):
    return zero1_engine


@pytest.fixture
def store(tmp_path, engine):
    store = ckptstore.open(tmp_path / "runs" / "store")
    store.commit(engine, step=4)
    return store


def tree(folder) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def test_force_never_replaces_the_store_a_folder_holding_it_or_one_inside_it(store, tmp_path):
    root = store.objects.root
    before = tree(tmp_path)
    for out in (root, root.parent, tmp_path, root / "packs", root / "new"):
        with pytest.raises(BadInputError, match="is the store .*, holds it or lies inside it"):
            store.materialize(4, out, force=True)
        with pytest.raises(BadInputError, match="is the store .*, holds it or lies inside it"):
            store.export(4, out, force=True)
    assert tree(tmp_path) == before
    assert store.verify().ok


def test_force_never_replaces_the_working_directory_or_an_empty_path(store, tmp_path, monkeypatch, run):
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    for out in ("", ".", tmp_path / "work", tmp_path):
        with pytest.raises(BadInputError):
            store.materialize(4, out, force=True)
    result = run("--store", store.objects.uri, "materialize", "--step", 4, "--force", "")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    result = run("--store", store.objects.uri, "export", "--step", 4, "--force", ".")
    assert result.returncode == 2 and "working directory" in result.stderr
    assert tree(work) == {"notes.txt": 4}


def test_force_replaces_only_a_folder_materialize_or_export_wrote(store, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for write in (store.materialize, store.export):
        with pytest.raises(ConflictError, match="--force replaces only a folder materialize or export wrote"):
            write(4, mine, force=True)
    assert tree(mine) == {"notes.txt": 4}

    out = store.materialize(4, tmp_path / "out")
    assert (out / MARKER).is_file() and (out / "latest").read_text() == "global_step4"
    (out / "extra").write_text("x")
    store.materialize(4, out, force=True)
    assert not (out / "extra").exists()
    hf = store.export(4, tmp_path / "hf").path
    assert (hf / MARKER).is_file()
    store.export(4, hf, force=True)
    store.export(4, out, force=True)  # one marker for both: either may replace what the other wrote
    assert (out / "model.safetensors").is_file() and not (out / "latest").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine", "out", "runs"]


def test_a_killed_materialize_leaves_staging_that_the_next_one_removes(store, tmp_path):
    old = time.time() - 7200  # older than the default grace period (1 h)
    stale = [tmp_path / ".out.ckptstore-0badf00d.tmp", tmp_path / ".out.ckptstore-old-0badf00d"]
    young = tmp_path / ".out.ckptstore-12345678.tmp"  # perhaps a materialize running now
    other = tmp_path / ".other.ckptstore-0badf00d.tmp"  # another output's
    for folder in [*stale, young, other]:
        (folder / "global_step4").mkdir(parents=True)
        (folder / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 100)
    for folder in [*stale, other]:
        os.utime(folder, (old, old))
    store.materialize(4, tmp_path / "out")
    assert not any(folder.exists() for folder in stale)
    assert young.exists() and other.exists()
    store.export(4, tmp_path / "other")
    assert not other.exists() and young.exists()


# One command of a user, in a process of its own, held (or killed) once its staging folder is
# full: ``outputs.mark`` runs just before the folder is renamed into place.
_HELD = """
import os, sys, time
from pathlib import Path
import ckptstore
from ckptstore.materialize import outputs

verb, uri, out, ready, go = sys.argv[1:]
mark = outputs.mark

def held(folder, *args):
    Path(ready).write_text(str(folder))
    while not os.path.exists(go):
        time.sleep(0.05)
    mark(folder, *args)

outputs.mark = held
store = ckptstore.open(uri, create=False)
getattr(store, verb)(out) if verb == "report" else getattr(store, verb)(4, out)
"""


def _held_command(verb: str, store, out, tmp_path) -> tuple[subprocess.Popen, Path]:
    """``verb`` of step 4 into ``out`` in another process, once its staging folder is written
    and before it is renamed; the process and the staging folder (``tmp_path / "go"`` lets it
    finish)."""
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HELD, verb, store.objects.uri, str(out), str(ready), str(tmp_path / "go")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "the command never reached its staging folder"
        time.sleep(0.05)
    staging = Path(ready.read_text())
    assert staging.is_dir() and any(staging.iterdir()) and staging.parent == out.parent
    return proc, staging


def _command(verb: str) -> list[str]:
    if verb == "report":
        pytest.importorskip("matplotlib")
        return ["report"]
    return [verb, "--step", "4"]


@pytest.mark.parametrize("verb", ["materialize", "export", "report"])
def test_a_killed_command_leaves_staging_that_the_same_command_run_again_removes_at_once(
    store, tmp_path, run, verb
):
    command = _command(verb)
    out = tmp_path / "out"
    proc, staging = _held_command(verb, store, out, tmp_path)
    proc.kill()  # kill -9: nothing of it runs again
    proc.wait(60)
    assert staging.is_dir() and not out.exists()  # younger than any grace period
    result = run("--store", store.objects.uri, *command, out)
    assert result.returncode == 0, result
    assert (out / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "ready", "runs"]  # nothing else beside it


def test_the_staging_folder_of_a_command_still_running_is_never_removed(store, tmp_path, run):
    out = tmp_path / "out"
    proc, staging = _held_command("materialize", store, out, tmp_path)
    try:
        before = tree(staging)
        result = run("--store", store.objects.uri, "materialize", "--step", "4", out)
        assert result.returncode == 0, result
        assert tree(staging) == before  # the other's work, untouched
    finally:
        (tmp_path / "go").write_text("")
        output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output  # it went on and renamed its folder into place
    assert (out / "latest").read_text() == "global_step4" and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "out", "ready", "runs"]


def test_a_staging_folder_goes_once_no_process_holds_its_lock_and_an_orphan_lock_goes_too(tmp_path):
    out = tmp_path / "out"
    staging, orphan = tmp_path / ".out.ckptstore-0000aaaa.tmp", tmp_path / ".out.ckptstore-0000bbbb.lock"
    (staging / "global_step4").mkdir(parents=True)
    lock = outputs.lock_of(staging)
    lock.write_text("")
    orphan.write_text("")  # killed before its staging folder was made
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / ".out.ckptstore-0000cccc.lock").symlink_to(elsewhere / "x")  # never followed, kept
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the command building it holds it
        assert outputs.remove_stale(out) == [] and staging.is_dir() and lock.exists()
    assert outputs.remove_stale(out) == [staging]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.ckptstore-0000cccc.lock", "elsewhere"]


def test_commands_other_than_commit_never_create_a_store(tmp_path, run):
    folder = tmp_path / "home"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    empty = tmp_path / "empty"
    empty.mkdir()
    for command in (["log"], ["verify"], ["gc", "--grace", "0"], ["catalog", "rebuild"]):
        result = run("--store", folder, *command)
        assert result.returncode == 2, (command, result)
        assert (
            result.stderr.strip()
            == f"error: {folder} is not a ckptstore store: it has no config.json and holds notes.txt"
        )
        result = run("--store", empty, *command)
        assert result.returncode == 3, (command, result)
        assert result.stderr.strip() == f"error: no store at {empty} (it has no config.json)"
    with pytest.raises(NotFoundError, match="no store at"):
        ckptstore.open(f"file://{empty}", create=False)
    for uri in ("file://", ""):
        with pytest.raises(BadInputError, match="names no path|no store given"):
            ckptstore.open(uri, create=False)
    with pytest.raises(BadInputError, match="is not a ckptstore store"):
        ckptstore.open(folder)  # not even to commit into
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"] and list(empty.iterdir()) == []
    ckptstore.open(empty).close()  # an empty folder becomes a store when asked to
    assert (empty / "config.json").is_file()


def contents(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_store_that_lost_its_config_is_reported_and_left_unchanged(store, tmp_path, run):
    root = store.objects.root
    store.close()
    (root / "config.json").unlink()
    before = contents(root)
    out = tmp_path / "out"
    for command in (
        ["log"], ["show", "--step", 4], ["verify"], ["materialize", "--step", 4, out],
        ["export", "--step", 4, out], ["gc", "--keep-last", 1, "--grace", 0], ["delete", "--step", 4],
        ["catalog", "rebuild"],
    ):  # fmt: skip
        result = run("--store", root, *command)
        assert result.returncode == 4, (command, result)
        assert (
            "holds objects but no config.json" in result.stderr
            and "put its config.json back" in result.stderr
        )
    for create in (False, True):  # not even to commit into: only an empty folder becomes a store
        with pytest.raises(CorruptError, match="holds objects but no config.json"):
            ckptstore.open(root, create=create)
    assert contents(root) == before and not out.exists()


def test_a_keyed_store_that_lost_its_config_never_gets_one_without_its_key(tmp_path, run, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_CACHE", str(tmp_path / "cache"))  # a keyed store's catalog
    key_file = tmp_path / "store.key"
    key_file.write_bytes(os.urandom(32))
    key_file.chmod(0o600)
    root = tmp_path / "keyed"
    ckptstore.open(root, key=key_file.read_bytes()).close()
    (root / "packs" / "ab").mkdir(parents=True)
    (root / "packs" / "ab" / ("ab" * 16)).write_bytes(b"a pack")
    config = (root / "config.json").read_bytes()
    (root / "config.json").unlink()
    assert run("--store", root, "log").returncode == 4
    assert run("log", "--store", root, "--key-file", key_file).returncode == 4
    with pytest.raises(CorruptError):
        ckptstore.open(root)  # an unkeyed config here would lock the key out
    assert not (root / "config.json").exists()
    (root / "config.json").write_bytes(config)  # the fix the message names
    assert run("log", "--store", root, "--key-file", key_file).stdout == "no steps committed yet\n"


def test_an_s3_store_that_lost_its_config_is_reported_and_left_unchanged(s3, run):
    ckptstore.open(s3.uri()).close()
    s3.client.put_object(Bucket=s3.bucket, Key="run/packs/ab/" + "ab" * 16, Body=b"a pack")
    s3.client.delete_object(Bucket=s3.bucket, Key="run/config.json")
    for command in (["log"], ["verify"], ["gc", "--keep-last", 1]):
        assert run("--store", s3.uri(), *command).returncode == 4
    with pytest.raises(CorruptError, match="holds objects but no config.json"):
        ckptstore.open(s3.uri())
    assert s3.keys() == ["run/packs/ab/" + "ab" * 16]


@pytest.mark.parametrize("grace", ["nan", "inf", "-1", "-5m", "soon", "NaNs"])
def test_gc_refuses_a_grace_that_is_not_a_finite_non_negative_duration(store, run, grace, monkeypatch):
    result = run("--store", store.objects.uri, "gc", "--grace", grace)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    monkeypatch.setenv("CKPTSTORE_GC_GRACE", grace)
    with pytest.raises(BadInputError, match="CKPTSTORE_GC_GRACE"):
        store.gc()


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), -1.0, "soon", True])
def test_gc_refuses_such_a_grace_from_python_too(store, grace):
    with pytest.raises(BadInputError, match="grace period"):
        store.gc(grace=grace)
    assert store.steps() == [4]
