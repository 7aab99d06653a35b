"""Every ``CKPTSTORE_*`` setting is checked when the CLI starts or a store opens (RELIABILITY.md
scenario 25): a bad value is exit 2 / BadInputError naming it, before any work; a name that is
no setting is one warning line naming the close one. No engine is needed: the checks come first.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ckptstore
from ckptstore import knobs, settings
from ckptstore.errors import BadInputError

ROOT = Path(__file__).resolve().parents[1]

# A value each kind of setting refuses.
JUNK = {
    "integer": "abc",
    "number": "zz",
    "flag": "maybe",
    "choice": "sometimes",
    "store": "ftp://host/run",
    "directory": "{file}/below-a-file",
    "key file": "{tmp}/no-such.key",
    "node name": "rack 7",
    "CPU list": "4-x",
}


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    """An empty store, opened once so that it exists, with no setting in the environment."""
    for name in list(knobs.SETTINGS):
        monkeypatch.delenv(name, raising=False)
    path = tmp_path / "store"
    ckptstore.open(path).close()
    return path


def _junk(kind: str, tmp_path: Path) -> str:
    (tmp_path / "a-file").write_text("")
    return JUNK[kind].format(file=tmp_path / "a-file", tmp=tmp_path)


def test_every_setting_named_in_code_tests_tools_and_readme_is_registered():
    named = set()
    for path in [
        ROOT / "README.md",
        *ROOT.glob("docs/*.md"),
        *ROOT.glob("ckptstore/**/*.py"),
        *ROOT.glob("t*/**/*.py"),
    ]:
        named |= set(re.findall(r"\bCKPTSTORE_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    assert named - set(knobs.SETTINGS) == set()
    assert {"CKPTSTORE_FUZZ_EXAMPLES", "CKPTSTORE_TEST_HARD_EXIT"} <= named  # read by tests only


def test_every_setting_has_a_default_that_passes_its_own_check(store):
    knobs.check_all()
    assert {name: entry.read() for name, entry in knobs.SETTINGS.items()}["CKPTSTORE_IO_THREADS"] >= 1


@pytest.mark.parametrize("name", sorted(knobs.SETTINGS))
def test_a_bad_value_of_any_setting_exits_2_naming_it_before_any_work(
    run, store, tmp_path, monkeypatch, name
):
    junk = _junk(knobs.SETTINGS[name].kind, tmp_path)
    out = tmp_path / "out"
    if name == "CKPTSTORE_STORE":
        result = run("materialize", "--step", 1, out, env_store=junk)
    else:
        monkeypatch.setenv(name, junk)
        result = run("materialize", "--step", 1, out, env_store=store)
    assert result.returncode == 2, result
    assert name in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
    with pytest.raises(BadInputError, match=name):
        ckptstore.open(store)


@pytest.mark.parametrize(
    "name, value",
    [
        ("CKPTSTORE_IO_THREADS", "abc"),  # issue 37's: `ckptstore log` took it
        ("CKPTSTORE_READAHEAD_BYTES", "zz"),  # and `materialize` ignored it
        ("CKPTSTORE_S3_MAX_ATTEMPTS", str(10**30)),
        ("CKPTSTORE_ZSTD_LEVEL", str(10**30)),  # an OverflowError at commit before
        ("CKPTSTORE_ZSTD_LEVEL", "23"),
        ("CKPTSTORE_BACKGROUND_NICE", "abc"),
        ("CKPTSTORE_BACKGROUND_NICE", "20"),
        ("CKPTSTORE_GC_GRACE", "1e30"),
        ("CKPTSTORE_GC_GRACE", "nan"),
        ("CKPTSTORE_IO_THREADS", "1000000"),
        ("CKPTSTORE_S3_TIMEOUT", "0"),
        ("CKPTSTORE_LOCAL_POLL_SECONDS", "0"),
        ("CKPTSTORE_MIN_COMPRESS_RATIO", "-0.5"),
    ],
)
def test_out_of_range_settings_are_refused_naming_their_range(run, store, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    result = run("--store", store, "log")
    assert result.returncode == 2
    assert re.search(rf"^error: {name} must be an? (integer|number) (from|above) ", result.stderr)


def test_zstd_compresses_at_both_ends_of_its_level_range(monkeypatch):
    from ckptstore.format import zstd

    data = bytes(range(256)) * 64
    for level in (knobs.ZSTD_MIN_LEVEL, knobs.ZSTD_MAX_LEVEL):
        monkeypatch.setenv("CKPTSTORE_ZSTD_LEVEL", str(level))
        for planes in (False, True):
            frame = zstd.compressor(planes).compress(data)
            assert zstd.decompress_frame(frame, len(data)) == data


def test_an_empty_setting_is_its_default(store, monkeypatch):
    monkeypatch.setenv("CKPTSTORE_IO_THREADS", "")
    monkeypatch.setenv("CKPTSTORE_LOCAL", "")
    assert knobs.io_threads() >= 8 and knobs.local_tier() == ""
    ckptstore.open(store).close()


def test_an_unknown_setting_is_one_warning_line_naming_the_close_one(run, store, monkeypatch, caplog):
    monkeypatch.setattr(settings, "_warned", set())
    misspelt = "CKPTSTORE_" + "LOCALKEEP"
    monkeypatch.setenv(misspelt, "3")
    unlike = "CKPTSTORE_" + "NOTHING_LIKE_IT"
    monkeypatch.setenv(unlike, "1")
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        assert run("--store", store, "log").returncode == 0
        ckptstore.open(store).close()  # warned once per process, not per open
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        f"ckptstore: {misspelt} is not a ckptstore setting; it is ignored (did you mean CKPTSTORE_LOCAL_KEEP?)",
        f"ckptstore: {unlike} is not a ckptstore setting; it is ignored",
    ]


@pytest.mark.parametrize(
    "argument, value",
    [
        ("local_upload", "bogus"),  # refused only after the tier was made, before
        ("s3_timeout", -1),  # taken by a local store, before
        ("s3_timeout", float("nan")),
        ("local_keep", -1),
        ("local_max_bytes", -1),
        ("replicas", 1001),
    ],
)
def test_every_argument_of_open_is_held_to_the_range_of_its_setting(
    store, tmp_path, monkeypatch, argument, value
):
    name, tier = f"CKPTSTORE_{argument.upper()}", tmp_path / "nvme"
    monkeypatch.setenv(name, str(value))
    with pytest.raises(BadInputError, match=name):
        ckptstore.open(store, local=tier)
    monkeypatch.delenv(name)
    with pytest.raises(BadInputError, match=f"^{argument} must be (an integer|a number|background)"):
        ckptstore.open(store, local=tier, **{argument: value})
    assert not tier.exists()
    with pytest.raises(BadInputError, match="create must be True or False"):
        ckptstore.open(store, create="no")
    ckptstore.open(store, local=tier, local_upload="drain", s3_timeout=2.5, local_keep=0).close()


def test_thread_counts_follow_the_cores_this_process_may_use_with_the_settings_as_caps(monkeypatch):
    for cores in ({0}, {1, 3}, set(range(24))):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: cores)
        assert knobs.cpu_threads() == len(cores)
        assert knobs.export_threads() == len(cores) + 1  # no fixed cap (it was 4)
        assert knobs.io_threads() == max(8, len(cores))
    monkeypatch.setenv("CKPTSTORE_CPU_THREADS", "3")
    assert (knobs.cpu_threads(), knobs.export_threads(), knobs.io_threads()) == (3, 4, 8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert knobs.cpu_threads() == 2  # a setting past the cores is a cap, not more threads
    monkeypatch.setenv("CKPTSTORE_EXPORT_THREADS", "2")
    assert knobs.export_threads() == 2


def test_a_process_pinned_to_one_core_decodes_on_one_thread():
    pinned = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from ckptstore import knobs; print(knobs.cpu_threads(), knobs.export_threads())"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTSTORE_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    result = subprocess.run(
        [sys.executable, "-c", pinned], capture_output=True, text=True, env=env, check=True
    )
    assert result.stdout.split() == ["1", "2"]
