"""Every failure is one clear, classified error (issue 29).

Storage faults (a full disk, a read-only file system, a file size limit) are StorageError, exit
7, naming the path; bad arguments and settings are BadInputError, exit 2, naming what they take;
a store that cannot be written still answers every verb that only reads; S3 calls time out.

Disks fill for real: a small tmpfs where ``mount`` is permitted (those tests skip otherwise), and
``RLIMIT_FSIZE`` (``ulimit -f``), which works for any user, for every case as well. A read-only
store is a read-only bind mount as root, an unwritable copy otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, CorruptError, StorageError
from ckptstore.format import pack
from tests.moto_s3 import s3_environment
from tools.engines import batches, build_engine, train

# The longest one line of error may be: a few hundred characters, however big the object.
LONGEST_MESSAGE = 400


@pytest.fixture(scope="module")
def engine():
    """The smallest engine to commit: one block, ZeRO 0, torch's AdamW (no DeepSpeed op to build)."""
    engine = build_engine(
        "llama", zero_stage=0, seed=0, num_layers=1,
        optimizer={"type": "AdamW", "params": {"torch_adam": True, "lr": 1e-2}},
    )  # fmt: skip
    train(engine, batches(1))
    return engine


@pytest.fixture(scope="module")
def committed(engine, tmp_path_factory) -> Path:
    """A store holding step 1 (copy it before changing anything)."""
    path = tmp_path_factory.mktemp("failures") / "store"
    with ckptstore.open(path) as store:
        store.commit(engine, step=1)
    return path


def copy_store(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, symlinks=True)
    return target


def one_line(result) -> str:
    """The error line of a failed command, checked to be one short line."""
    assert result.stdout == "" or result.returncode == 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert len(lines[0]) < LONGEST_MESSAGE, lines[0]
    assert "internal error" not in lines[0] and "Traceback" not in result.stderr
    return lines[0]


def objects_of(store: Path) -> dict[str, int]:
    """Every file of a store but the catalog's, with its size: what a failed command must not change."""
    return {
        str(path.relative_to(store)): path.stat().st_size
        for path in store.rglob("*")
        if path.is_file() and not path.name.startswith("catalog.db")
    }


def assert_consistent(run, store: Path, steps: list[int]) -> None:
    result = run("--store", store, "verify", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["ok"]
    with ckptstore.open(store, create=False) as opened:
        assert opened.steps() == steps
        assert not list(opened.objects.list_temporary())


# -- making disks full and file systems read-only ------------------------------------------------


def _mount(*args: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"mount is not permitted here ({result.stderr.strip() or result.returncode})")


@pytest.fixture
def mounts():
    """Mount points made by the test, unmounted (innermost first) at teardown."""
    points: list[Path] = []
    yield points
    busy = []
    for point in reversed(points):
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            busy.append(point)  # something the test opened there is still open
            subprocess.run(["umount", "--lazy", str(point)], capture_output=True)
    assert not busy, f"files left open under {busy}"


@pytest.fixture
def tmpfs(tmp_path, mounts):
    """``tmpfs(name, size)``: a fresh tmpfs of ``size`` (e.g. "4m") at ``tmp_path/name``."""

    def make(name: str, size: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(point))
        mounts.append(point)
        return point

    return make


def fill(folder: Path) -> None:
    """Write a file into ``folder`` until its file system is full."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    # A last few bytes: whatever was left of a block.
    with contextlib.suppress(OSError):
        (folder / "filler-2").write_bytes(b"\0" * 4096)


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """``ulimit -f`` for this process: writes past ``nbytes`` of any file fail with EFBIG."""
    # CPython ignores SIGXFSZ, so the write fails instead of the process being killed.
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


@pytest.fixture
def read_only(tmp_path, mounts):
    """``read_only(folder)``: a view of ``folder`` that cannot be written (a read-only bind mount
    as root, whom permissions do not stop; the folder itself made unwritable otherwise)."""
    chmodded: list[Path] = []

    def make(folder: Path) -> Path:
        if os.geteuid() != 0:
            for path in [folder, *folder.rglob("*")]:
                path.chmod(path.stat().st_mode & ~0o222)
            chmodded.append(folder)
            return folder
        view = tmp_path / f"read-only-{len(mounts)}"
        view.mkdir()
        _mount("--bind", str(folder), str(view))
        mounts.append(view)
        _mount("-o", "remount,ro,bind", str(view))
        return view

    yield make
    for folder in chmodded:
        for path in [folder, *folder.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)


@pytest.fixture(params=["tmpfs", "ulimit -f"])
def full_store(request, committed, tmp_path):
    """``(store, full)``: a copy of the store, and a context in which its disk is full (a full
    tmpfs, or a file size limit of 0 bytes for this process)."""
    if request.param == "tmpfs":
        point = request.getfixturevalue("tmpfs")("full", "4m")
        store = copy_store(committed, point / "store")
        fill(point)
        yield store, contextlib.nullcontext
        return
    yield copy_store(committed, tmp_path / "store"), lambda: file_size_limit(0)


# -- a store on a full disk ------------------------------------------------------------------------


def test_log_show_and_verify_work_on_a_full_store(run, full_store):
    store, full = full_store
    with full():
        assert run("--store", store, "log").returncode == 0
        result = run("--store", store, "show", "--step", 1)
        assert result.returncode == 0, result.stderr
        result = run("--store", store, "verify")
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr


def test_materialize_reads_a_full_store(run, committed, tmpfs, tmp_path):
    point = tmpfs("full", "4m")
    store = copy_store(committed, point / "store")
    fill(point)
    result = run("--store", store, "materialize", "--step", 1, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "latest").read_text() == "global_step1"


def test_commit_and_delete_on_a_full_store_exit_7_and_change_nothing(run, full_store, engine):
    store, full = full_store
    before = objects_of(store)
    with full():
        with ckptstore.open(store, create=False) as opened, pytest.raises(StorageError) as caught:
            opened.commit(engine, step=2)
        result = run("--store", store, "delete", "--step", 1)
    message = str(caught.value)
    assert str(store) in message and len(message) < LONGEST_MESSAGE
    assert result.returncode == 7
    line = one_line(result)
    assert "catalog" in line and str(store) in line
    assert objects_of(store) == before
    for filler in store.parent.glob("filler*"):
        filler.unlink()
    assert_consistent(run, store, [1])


def test_a_store_whose_disk_fills_after_it_was_opened_still_reads_its_steps(
    committed, engine, tmpfs, tmp_path
):
    # Step 2 committed elsewhere: its manifest and packs, which the store's catalog only lists.
    other = copy_store(committed, tmp_path / "other")
    with ckptstore.open(other, create=False) as opened:
        opened.commit(engine, step=2)
    point = tmpfs("full", "4m")
    store = copy_store(committed, point / "store")
    for path in other.rglob("*"):
        if path.is_file() and path.parts[len(other.parts)] in ("manifests", "packs"):
            target = store / path.relative_to(other)
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                shutil.copy2(path, target)
    with ckptstore.open(store, create=False) as opened:
        fill(point)
        assert [row.step for row in opened.log()] == [1, 2]  # step 2 imported into a copy
        assert opened.verify().ok
        with pytest.raises(StorageError, match="catalog"):
            opened.delete(2)
    with ckptstore.open(store, create=False) as opened:
        assert opened.steps() == [1, 2]


def test_a_disk_that_fills_while_the_catalog_row_is_written_is_a_storage_error(
    run, committed, engine, tmp_path, monkeypatch
):
    store = copy_store(committed, tmp_path / "store")
    with ckptstore.open(store, create=False) as opened:
        record = opened.catalog.record_step

        def record_on_a_full_disk(*args, **kwargs):
            with file_size_limit(0):
                return record(*args, **kwargs)

        monkeypatch.setattr(opened.catalog, "record_step", record_on_a_full_disk)
        with pytest.raises(StorageError) as caught:
            opened.commit(engine, step=2)
    message = str(caught.value)
    assert "step 2 is committed" in message and str(store / "catalog.db") in message
    assert "\n" not in message and len(message) < LONGEST_MESSAGE
    # The manifest is the commit point: the next open lists the step, whole.
    assert_consistent(run, store, [1, 2])


def test_a_disk_that_fills_while_packs_are_written_is_a_storage_error_and_commits_nothing(
    run, engine, tmp_path
):
    # A commit encodes each pack into a spill file beside the store's objects: that write is
    # the first to meet a full disk, and says which pack and where.
    store = tmp_path / "fresh"
    with ckptstore.open(store) as opened:
        with file_size_limit(4096), pytest.raises(StorageError) as caught:
            opened.commit(engine, step=1)
    message = str(caught.value)
    assert "spill pack packs/" in message and str(store) in message
    assert "\n" not in message and len(message) < LONGEST_MESSAGE
    assert_consistent(run, store, [])


def test_a_disk_that_fills_before_the_catalog_is_checkpointed_is_never_taken_for_damage(
    run, committed, engine, tmpfs
):
    # Step 2's rows reach the catalog's write-ahead log; the disk fills before SQLite copies them
    # into catalog.db (when the store closes), so that copy stops after the file's header: the
    # file is shorter than its header says, and what is missing is in the log. Then a commit
    # meets the full disk, and the next commands run on it, and after space returns.
    point = tmpfs("full", "4m")
    store = copy_store(committed, point / "store")
    catalog = store / "catalog.db"
    with ckptstore.open(store, create=False) as opened:
        opened.commit(engine, step=2)
        fill(point)
    header = catalog.read_bytes()[:100]
    page_size, pages = int.from_bytes(header[16:18], "big"), int.from_bytes(header[28:32], "big")
    assert pages * page_size > catalog.stat().st_size and (store / "catalog.db-wal").stat().st_size > 0
    catalog_files = sorted(path.name for path in store.glob("catalog.db*"))

    with ckptstore.open(store, create=False) as opened, pytest.raises(StorageError):
        opened.commit(engine, step=3)
    for command in (["log", "--json"], ["verify", "--json"]):
        result = run("--store", store, *command)
        assert result.returncode in (0, 1) and "damaged" not in result.stderr, result.stderr
    assert [
        json.loads(line)["step"] for line in run("--store", store, "log", "--json").stdout.splitlines()
    ] == [1, 2]
    result = run("--store", store, "catalog", "rebuild")
    assert result.returncode == 7, result.stderr
    assert "catalog" in one_line(result)
    # Nothing renamed, no temporary file left, the log kept.
    assert sorted(path.name for path in store.glob("catalog.db*")) == catalog_files

    for filler in point.glob("filler*"):
        filler.unlink()
    assert_consistent(run, store, [1, 2])
    assert not list(store.glob("catalog.db.*"))
    with sqlite3.connect(catalog) as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()


# -- a read-only store -----------------------------------------------------------------------------


@pytest.fixture
def read_only_store(committed, read_only, tmp_path) -> Path:
    copy_store(committed, tmp_path / "source" / "store")
    return read_only(tmp_path / "source") / "store"


def test_read_verbs_work_on_a_read_only_store(run, read_only_store, tmp_path):
    for command in (["log"], ["show", "--step", 1], ["verify"], ["gc", "--keep-last", 1, "--dry-run"]):
        result = run("--store", read_only_store, *command)
        assert result.returncode == 0, (command, result.stderr)
    result = run("--store", read_only_store, "materialize", "--step", 1, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "latest").read_text() == "global_step1"


def test_verbs_that_write_a_read_only_store_exit_7_naming_it(run, read_only_store, engine):
    before = objects_of(read_only_store)
    for command in (["delete", "--step", 1], ["gc", "--keep-last", 1], ["catalog", "rebuild"]):
        result = run("--store", read_only_store, *command)
        assert result.returncode == 7, (command, result.stderr)
        assert str(read_only_store) in one_line(result)
    with ckptstore.open(read_only_store, create=False) as opened, pytest.raises(StorageError):
        opened.commit(engine, step=2)
    assert objects_of(read_only_store) == before
    assert_consistent(run, read_only_store, [1])


def test_an_s3_store_whose_catalog_cache_cannot_be_written_still_lists_and_reads(
    run, s3, engine, read_only, tmp_path, monkeypatch
):
    with ckptstore.open(s3.uri()) as store:
        store.commit(engine, step=1)
    (tmp_path / "caches").mkdir()
    monkeypatch.setenv("CKPTSTORE_CACHE", str(read_only(tmp_path / "caches") / "cache"))
    result = run("--store", s3.uri(), "log", "--json")
    assert result.returncode == 0, result.stderr
    assert [json.loads(line)["step"] for line in result.stdout.splitlines()] == [1]
    result = run("--store", s3.uri(), "materialize", "--step", 1, tmp_path / "out")
    assert result.returncode == 0, result.stderr
    result = run("--store", s3.uri(), "delete", "--step", 1)
    assert result.returncode == 7 and "catalog" in one_line(result)
    assert any(key.startswith("run/manifests/") for key in s3.keys())


# -- materialize and export into a file system that cannot take them -------------------------------


@pytest.mark.parametrize("verb", ["materialize", "export"])
def test_materialize_into_a_full_filesystem_exits_7_naming_the_path(run, committed, tmpfs, verb):
    point = tmpfs("small", "64k")
    result = run("--store", committed, verb, "--step", 1, point / "out")
    assert result.returncode == 7
    line = one_line(result)
    assert str(point / "out") in line and "no space left" in line
    assert list(point.iterdir()) == []  # no staging folder, no partial output


@pytest.mark.parametrize("verb", ["materialize", "export"])
def test_materialize_under_a_file_size_limit_raises_storage_error_and_leaves_nothing(
    committed, tmp_path, verb
):
    parent = tmp_path / "outputs"
    parent.mkdir()
    with ckptstore.open(committed, create=False) as store:
        with file_size_limit(16 * 1024), pytest.raises(StorageError) as caught:
            getattr(store, verb)(1, parent / "out")
    assert caught.value.exit_code == 7
    assert str(parent / "out") in str(caught.value) and len(str(caught.value)) < LONGEST_MESSAGE
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("verb", ["materialize", "export"])
def test_materialize_into_a_read_only_filesystem_exits_7(run, committed, read_only, tmp_path, verb):
    (tmp_path / "outputs").mkdir()
    outputs = read_only(tmp_path / "outputs")
    result = run("--store", committed, verb, "--step", 1, outputs / "out")
    assert result.returncode == 7
    assert str(outputs / "out") in one_line(result)
    assert list(outputs.iterdir()) == []


@pytest.mark.parametrize("verb", ["materialize", "export"])
def test_an_output_that_cannot_be_a_folder_exits_2_and_nothing_is_written(run, committed, tmp_path, verb):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "dir")
    (tmp_path / "a-file").write_text("x")
    for out, says in [
        (tmp_path / "dangling", "symbolic link to nothing"),
        (tmp_path / "dangling" / "sub", "is not a folder"),
        (tmp_path / "a-file" / "sub", "is not a folder"),
    ]:
        result = run("--store", committed, verb, "--step", 1, out)
        assert result.returncode == 2, (out, result.stderr)
        assert says in one_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "dangling"]


# -- S3 timeouts and endpoint secrets --------------------------------------------------------------


@pytest.fixture
def blackhole():
    """An endpoint on 127.0.0.1 that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_silent_s3_endpoint_fails_within_the_timeout_and_retries(run, blackhole, monkeypatch, tmp_path):
    s3_environment(monkeypatch, blackhole, tmp_path / "cache")
    monkeypatch.setenv("CKPTSTORE_S3_TIMEOUT", "0.5")
    monkeypatch.setenv("CKPTSTORE_S3_MAX_ATTEMPTS", "2")
    started = time.monotonic()
    result = run("--store", "s3://bucket/run", "log")
    assert time.monotonic() - started < 30  # 2 attempts of 0.5 s and one backoff of at most 1 s
    assert result.returncode == 7
    line = one_line(result)
    assert "s3://bucket/run" in line and "timeout" in line.lower()


def test_the_default_s3_timeouts_bound_a_call_to_a_minute(monkeypatch, tmp_path):
    from ckptstore.objects.s3 import S3ObjectStore

    s3_environment(monkeypatch, "http://127.0.0.1:9", tmp_path / "cache")
    for name in ("CKPTSTORE_S3_TIMEOUT", "CKPTSTORE_S3_MAX_ATTEMPTS"):
        monkeypatch.delenv(name, raising=False)
    config = S3ObjectStore("s3://bucket/run", check=False).client.meta.config
    attempts = config.retries["total_max_attempts"]
    # botocore's standard mode waits at most 2**n s (n = 0, 1, ...) before the n+1-th retry.
    backoff = sum(min(2**n, 20) for n in range(attempts - 1))
    assert config.retries["mode"] == "standard"
    assert attempts * config.read_timeout + backoff <= 60  # it connects and never answers
    assert attempts * config.connect_timeout + backoff <= 60  # it never lets us connect


def test_s3_timeout_is_an_open_option(s3):
    with ckptstore.open(s3.uri(), s3_timeout=2.5) as store:
        assert store.objects.client.meta.config.read_timeout == 2.5
        assert store.objects.client.meta.config.connect_timeout == 2.5
    for bad in (0, -1, float("nan"), "2"):
        with pytest.raises(BadInputError, match="s3_timeout"):
            ckptstore.open(s3.uri(), s3_timeout=bad)


def test_s3_errors_never_show_the_userinfo_of_an_endpoint(run, monkeypatch, tmp_path):
    with socket.socket() as closed:  # a port nothing listens on: connections are refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://AKIDSECRET:hunter2@127.0.0.1:{closed.getsockname()[1]}"
    s3_environment(monkeypatch, endpoint, tmp_path / "cache")
    monkeypatch.setenv("CKPTSTORE_S3_MAX_ATTEMPTS", "1")
    with pytest.raises(StorageError) as caught:
        ckptstore.open("s3://bucket/run", endpoint_url=endpoint, create=False)
    result = run("--store", "s3://bucket/run", "log")
    assert result.returncode == 7
    for text in (str(caught.value), one_line(result)):
        assert "hunter2" not in text and "AKIDSECRET" not in text and "127.0.0.1" in text


# -- bad arguments and settings --------------------------------------------------------------------


def test_bad_commit_arguments_are_bad_input_naming_them_before_any_work(committed, tmp_path, engine):
    store_path = copy_store(committed, tmp_path / "store")
    before = objects_of(store_path)
    with ckptstore.open(store_path, create=False) as store:
        for arguments, says in [
            (dict(engine=engine, step=2**63), "step"),
            (dict(engine=engine, step=-1), "step"),
            (dict(engine=engine, step="2"), "step"),
            (dict(engine=engine, step=2, layers=[1]), "layers"),
            (dict(engine=engine, step=2, layers="model.layers.0"), "layers"),
            (dict(engine=None, step=2), "DeepSpeed engine"),
            (dict(engine=torch.nn.Linear(2, 2), step=2), "DeepSpeed engine"),
            (dict(engine=engine, step=2, client_state=5), "client_state"),  # a TypeError before
            (dict(engine=engine, step=2, files=5), "files="),
            (dict(engine=engine, step=2, metrics={"loss": 10**400}), "metrics="),  # an OverflowError
        ]:
            with pytest.raises(BadInputError, match=says) as caught:
                store.commit(**arguments)
            assert len(str(caught.value)) < LONGEST_MESSAGE
    assert objects_of(store_path) == before


def test_bad_read_arguments_are_bad_input_naming_them(committed, tmp_path):
    with ckptstore.open(committed, create=False) as store:
        with pytest.raises(BadInputError, match="world_size must be at most"):
            store.materialize(1, tmp_path / "out", world_size=100000)
        with pytest.raises(BadInputError, match="world_size"):
            store.materialize(1, tmp_path / "out", world_size=0)
        with pytest.raises(BadInputError, match="grace"):
            store.gc(grace="1h", dry_run=True)
        with pytest.raises(BadInputError, match="step"):
            store.show(2**63)
        assert store.gc(grace=timedelta(hours=1), dry_run=True).steps_dropped == []
    assert not (tmp_path / "out").exists()
    for uri in (None, 123, b"/tmp/x"):
        with pytest.raises(BadInputError, match="path or a URI"):
            ckptstore.open(uri)


def test_bad_argument_types_and_numbers_are_bad_input_never_a_type_error(committed, tmp_path, engine):
    out = tmp_path / "out"
    with ckptstore.open(committed, create=False) as store:
        for call, says in [  # issue 37 item 15's raw TypeError/AttributeError first
            (lambda: store.materialize(1, 123), "output directory"),
            (lambda: store.export(1, b"/tmp/x"), "output directory"),
            (lambda: store.gc(keep_last=1.5, dry_run=True), "keep-last"),
            (lambda: store.gc(keep_last=2**64, dry_run=True), "keep-last"),
            (lambda: store.gc(keep_every=0, dry_run=True), "keep-every"),
            (lambda: store.gc(keep_steps=5, dry_run=True), "keep-step"),
            (lambda: store.gc(keep_best=5, dry_run=True), "keep_best"),
            (lambda: store.gc(grace=1e30, dry_run=True), "grace"),
            (lambda: store.gc(grace=timedelta(days=99999), dry_run=True), "grace"),
            (lambda: store.gc(now="today", dry_run=True), "now"),
            (lambda: store.restore(None), "DeepSpeed engine"),
            (lambda: store.export(1, out, max_shard_size="1e999GB"), "max shard size"),  # OverflowError
            (lambda: store.export(1, out, max_shard_size=-5), "max shard size"),
            (lambda: ckptstore.open(committed, local=5), "local must be a path"),
            (lambda: ckptstore.open(committed, local=tmp_path / "t", local_keep=10**30), "local_keep"),
            (lambda: ckptstore.open("s3://bucket/run", endpoint_url=5), "endpoint_url"),
            (lambda: ckptstore.open("s3://bucket/run", s3_timeout=1e9), "s3_timeout"),
        ]:
            with pytest.raises(BadInputError, match=says) as caught:
                call()
            assert len(str(caught.value)) < LONGEST_MESSAGE
        assert store.steps() == [1]
    assert not out.exists() and not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    "command, says",
    [
        (["export", "--step", 1, "--max-shard-size", "-5GB", "OUT"], "max shard size"),  # 39 shards before
        (["export", "--step", 1, "--max-shard-size", "1e999GB", "OUT"], "max shard size"),  # exit 70 before
        (["gc", "--grace", "99999999999999999999d"], "ten years"),  # taken before: nothing ever swept
        (["gc", "--keep-last", str(2**64)], "keep-last"),
        (["materialize", "--step", 1, "--world-size", str(2**64), "OUT"], "world_size"),
    ],
)
def test_numbers_out_of_range_on_the_command_line_exit_2(run, committed, tmp_path, command, says):
    result = run("--store", committed, *[tmp_path / "out" if a == "OUT" else a for a in command])
    assert result.returncode == 2 and says in result.stderr.splitlines()[-1]  # click's usage error, or ours
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_bad_s3_endpoint_or_drain_timeout_exits_2(run, committed, tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "not-a-url")  # exit 70, a ValueError, before
    result = run("--store", "s3://bucket/run", "log")
    assert result.returncode == 2 and "AWS_ENDPOINT_URL" in one_line(result)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    store = copy_store(committed, tmp_path / "store")
    ckptstore.open(store, local=tmp_path / "nvme", local_upload="drain").close()
    for timeout in ("nan", "-1", "1e30"):  # nan never ended a drain that could not upload
        result = run("drain", "--local", tmp_path / "nvme", "--timeout", timeout)
        assert result.returncode == 2 and "timeout" in one_line(result)


def test_every_method_of_a_closed_store_is_bad_input(committed, tmp_path):
    store = ckptstore.open(committed, create=False)
    store.close()
    for call in (
        lambda: store.materialize(1, tmp_path / "out"),
        lambda: store.steps(),
        lambda: store.log(),
        lambda: store.verify(),
        lambda: store.gc(dry_run=True),
    ):
        with pytest.raises(BadInputError, match="was closed"):
            call()


@pytest.mark.parametrize(
    "setting, value, command",
    [
        ("CKPTSTORE_GC_GRACE", "abc", ["gc", "--dry-run"]),
        ("CKPTSTORE_IO_THREADS", "abc", ["verify"]),
        ("CKPTSTORE_IO_THREADS", "0", ["verify"]),
        ("CKPTSTORE_CPU_THREADS", "two", ["materialize", "--step", 1, "OUT"]),
        ("CKPTSTORE_S3_TIMEOUT", "nan", ["log"]),
    ],
)
def test_bad_settings_exit_2_naming_the_setting(
    run, committed, tmp_path, monkeypatch, setting, value, command
):
    monkeypatch.setenv(setting, value)
    store = "s3://bucket/run" if "S3" in setting else committed
    if "S3" in setting:
        s3_environment(monkeypatch, "http://127.0.0.1:9", tmp_path / "cache")
    result = run("--store", store, *[tmp_path / "out" if a == "OUT" else a for a in command])
    assert result.returncode == 2
    assert setting in one_line(result)
    assert not (tmp_path / "out").exists()


def test_a_cache_setting_under_a_file_exits_2_naming_it(run, s3, monkeypatch):
    with ckptstore.open(s3.uri()):
        pass
    monkeypatch.setenv("CKPTSTORE_CACHE", "/dev/null/x")
    result = run("--store", s3.uri(), "log")
    assert result.returncode == 2
    assert "CKPTSTORE_CACHE" in one_line(result)


def test_show_of_a_step_past_the_largest_exits_2(run, committed):
    result = run("--store", committed, "show", "--step", 2**63)
    assert result.returncode == 2
    assert "step" in one_line(result)


# -- corruption stays corruption, in one short line -------------------------------------------------


def test_a_malformed_pack_index_is_one_short_line_naming_the_pack(run, committed, tmp_path):
    store = copy_store(committed, tmp_path / "store")
    target = max(store.glob("packs/*/*"), key=lambda path: path.stat().st_size)
    data = target.read_bytes()
    length = pack.index_length(data)
    rows = json.loads(data[pack.PREAMBLE.size : pack.PREAMBLE.size + length])
    assert len(rows) > 3
    # Rows of five fields instead of six, padded to the same length: valid JSON, wrong shape.
    index = json.dumps([row[:5] for row in rows], separators=(",", ":")).encode().ljust(length)
    target.write_bytes(data[: pack.PREAMBLE.size] + index + data[pack.PREAMBLE.size + length :])
    result = run("--store", store, "materialize", "--step", 1, tmp_path / "out")
    assert result.returncode == CorruptError.exit_code == 4
    line = one_line(result)
    assert "pack index" in line and target.name in line
    assert not (tmp_path / "out").exists()
