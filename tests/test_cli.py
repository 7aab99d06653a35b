"""The command line: one line per error, documented exit codes, never a traceback."""

import json
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

import ckptstore
from tools.engines import batches, build_engine, train


def test_python_m_ckptstore_is_the_cli_and_reports_errors_without_a_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "ckptstore", "--store", str(tmp_path / "none"), "verify"],
        capture_output=True, text=True, env={**os.environ, "CKPTSTORE_STORE": ""},
    )  # fmt: skip
    assert result.returncode == 3
    assert result.stderr.strip() == f"error: no store at {tmp_path / 'none'}"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "store"
    store = ckptstore.open(path)
    engine = build_engine("llama", zero_stage=2, dtype="bf16", seed=0, num_layers=2)
    train(engine, batches(2))
    store.commit(engine, step=300)
    store.commit(engine, step=400, layers=["model.layers.1"])
    store.close()
    return path


def test_log_lists_steps_with_layers_saved(run, store_path):
    result = run("--store", store_path, "log")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[0] == "step"
    assert lines[1].split()[0] == "300" and "5/5" in lines[1]
    assert lines[2].split()[0] == "400" and "1/5" in lines[2]
    rows = [json.loads(line) for line in run("--store", store_path, "log", "--json").stdout.splitlines()]
    assert [r["step"] for r in rows] == [300, 400] and rows[1]["bytes_added"] == 0


def test_read_only_commands_at_a_mistyped_local_tier_exit_3_and_make_nothing(
    run, store_path, tmp_path, monkeypatch
):
    typo = tmp_path / "nmve" / "tier"
    for args in (["--local", typo, "log"], ["show", "--step", 300, "--local", typo]):
        result = run("--store", store_path, *args)
        assert result.returncode == 3 and result.stderr.startswith(f"error: no local tier at {typo} ")
        assert len(result.stderr.splitlines()) == 1
    monkeypatch.setenv("CKPTSTORE_LOCAL", str(typo))
    result = run("--store", store_path, "log")
    assert result.returncode == 3 and f"no local tier at {typo}" in result.stderr
    assert not typo.parent.exists()


def test_materialize_writes_a_deepspeed_directory(run, store_path, tmp_path):
    result = run("materialize", "--step", 400, tmp_path / "out", env_store=store_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "latest").read_text() == "global_step400"
    assert (tmp_path / "out" / "global_step400" / "mp_rank_00_model_states.pt").exists()
    assert (tmp_path / "out" / "global_step400" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").exists()


def test_verify_is_clean_and_says_so(run, store_path):
    result = run("--store", store_path, "verify")
    assert result.returncode == 0 and "clean" in result.stdout
    report = json.loads(run("--store", store_path, "verify", "--json").stdout)
    assert report["ok"] and report["problems"] == []


def test_verify_names_a_corrupt_pack_and_exits_1(run, store_path, tmp_path):
    blob = sorted(p for p in (store_path / "packs").rglob("*") if p.is_file())[-1]
    original = blob.read_bytes()
    blob.write_bytes(original[:-1] + bytes([original[-1] ^ 0xFF]))
    try:
        result = run("--store", store_path, "verify")
        assert result.returncode == 1
        assert blob.name in result.stdout and "corrupt" in result.stdout
        result = run("--store", store_path, "materialize", "--step", 400, tmp_path / "out")
        assert result.returncode == 4 and blob.name in result.stderr
        assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    finally:
        blob.write_bytes(original)


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["materialize", "--step", "7", "OUT"], 3, "step 7 does not exist"),
        (["log"], 3, "no store at"),
        (["materialize", "OUT"], 2, "Missing option '--step'"),
    ],
)
def test_bad_input_gives_one_line_and_a_documented_exit_code(run, store_path, tmp_path, args, code, message):
    store = store_path if args != ["log"] else tmp_path / "missing"
    args = [str(tmp_path / "out") if a == "OUT" else a for a in args]
    result = run("--store", store, *args)
    assert result.returncode == code
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists()


def test_non_empty_output_is_refused_without_force(run, store_path, tmp_path):
    assert run("--store", store_path, "materialize", "--step", 300, tmp_path / "out").returncode == 0
    result = run("--store", store_path, "materialize", "--step", 300, tmp_path / "out")
    assert result.returncode == 5 and "--force" in result.stderr
    assert (
        run("--store", store_path, "materialize", "--step", 300, "--force", tmp_path / "out").returncode == 0
    )
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "x").write_text("x")  # a folder materialize did not write: --force keeps off it
    result = run("--store", store_path, "materialize", "--step", 300, "--force", tmp_path / "mine")
    assert (
        result.returncode == 5
        and "--force replaces only a folder materialize or export wrote" in result.stderr
    )
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["x"]


def test_help_explains_every_command(run):
    result = run("--help")
    for command in ("materialize", "log", "verify", "show"):
        assert command in result.stdout
    assert "Example:" in run("materialize", "--help").stdout


def test_show_lists_each_layer_with_its_source_step_bytes_and_update(run, store_path):
    result = run("--store", store_path, "show", "--step", 400)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["layer", "from", "step", "bytes", "update", "since"]
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert list(rows) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    assert {layer: row[1] for layer, row in rows.items()} == {
        "model.embed_tokens": "300", "model.layers.0": "300", "model.layers.1": "400",
        "model.norm": "300", "lm_head": "300",
    }  # fmt: skip
    assert rows["model.layers.1"][4:] == ["0.00e+00", "300"]  # nothing trained between the commits
    assert lines[-1].startswith("1 of 5 layers saved at step 400;")
    shown = run("--store", store_path, "show", "--step", 300, "--json").stdout
    first = [json.loads(line) for line in shown.splitlines()]
    assert {row["layer"]: (row["source"], row["update"]) for row in first}["model.layers.0"] == (300, None)
    assert all(row["bytes"] > 0 and row["raw_bytes"] > 0 for row in first)
    assert run("--store", store_path, "show", "--step", 7).returncode == 3


@pytest.fixture
def gc_store(tmp_path, store_path):
    """A copy of the module's store, for commands that change it."""
    import shutil

    copy = tmp_path / "gc-store"
    shutil.copytree(store_path, copy)
    return copy


def test_gc_dry_run_prints_what_would_go_and_changes_nothing(run, gc_store):
    result = run("--store", gc_store, "gc", "--keep-last", 1, "--grace", "0s", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("would drop 1 step(s): 300; kept 1")
    assert "would free" in result.stdout
    assert [
        json.loads(line)["step"] for line in run("--store", gc_store, "log", "--json").stdout.splitlines()
    ] == [
        300,
        400,
    ]


def test_gc_is_quiet_under_cron_and_reports_json_for_scripts(run, gc_store):
    quiet = run("--store", gc_store, "gc", "--keep-last", 1, "--grace", "0")
    assert quiet.returncode == 0 and quiet.stdout == ""  # not a terminal: nothing to say
    report = json.loads(run("--store", gc_store, "gc", "--grace", "0", "--json").stdout)
    assert report["steps_dropped"] == [] and report["steps_kept"] == [400]
    assert run("--store", gc_store, "verify").returncode == 0


def test_gc_refuses_to_drop_every_step_and_bad_durations(run, gc_store):
    result = run("--store", gc_store, "gc", "--keep-last", 0)
    assert result.returncode == 2 and "--allow-empty" in result.stderr
    result = run("--store", gc_store, "gc", "--grace", "soon")
    assert result.returncode == 2 and "not a duration" in result.stderr


def test_delete_drops_a_step_record(run, gc_store):
    result = run("--store", gc_store, "delete", "--step", 300)
    assert result.returncode == 0 and "dropped step 300" in result.stdout
    assert run("--store", gc_store, "materialize", "--step", 300, gc_store.parent / "o").returncode == 3
    assert run("--store", gc_store, "delete", "--step", 300).returncode == 3


@pytest.mark.parametrize(
    "stray",
    ["manifests/notes", "manifests/7.json", "blobs/zz/not-a-key", "blobs/README", "files/ab/readme.txt"],
)
def test_verify_reports_a_stray_object_as_information_and_exits_0(run, gc_store, stray):
    target = gc_store.joinpath(*stray.split("/"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("left here by hand")
    result = run("--store", gc_store, "verify")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"info: 1 object(s) whose names ckptstore does not write: {stray}" in result.stdout
    assert "clean" in result.stdout
    report = json.loads(run("--store", gc_store, "verify", "--json").stdout)
    assert report["ok"] and report["stray_objects"] == [stray] and report["orphans"] == []
    # Neither gc nor a catalog rebuild takes it for one of the store's own objects.
    assert run("--store", gc_store, "gc", "--grace", "0s").returncode == 0
    assert target.exists()
    assert run("--store", gc_store, "catalog", "rebuild").returncode == 0
    assert ckptstore.open(gc_store).steps() == [300, 400]


def _newer(path, name, old, new):
    target = path.joinpath(*name.split("/"))
    data = target.read_bytes()
    assert old in data
    target.write_bytes(data.replace(old, new, 1))


def test_a_store_written_by_a_newer_format_is_refused_with_exit_6(run, gc_store):
    _newer(gc_store, "config.json", b'"format_version": 2', b'"format_version": 4')
    for args in (["log"], ["verify"], ["catalog", "rebuild"]):
        result = run("--store", gc_store, *args)
        assert result.returncode == 6, (args, result.stderr)
        assert "format version 4" in result.stderr and "upgrade ckptstore" in result.stderr


def test_a_manifest_written_by_a_newer_format_is_refused_by_catalog_rebuild(run, gc_store):
    from ckptstore.format.layout import manifest_name

    _newer(gc_store, manifest_name(400), b"CKPM\x02", b"CKPM\x04")
    before = (gc_store / "catalog.db").read_bytes()
    result = run("--store", gc_store, "catalog", "rebuild")
    assert result.returncode == 6
    assert result.stderr.startswith(f"error: {manifest_name(400)}: manifest has format version 4")
    assert (gc_store / "catalog.db").read_bytes() == before  # nothing was replaced


@pytest.mark.parametrize("what", ["pack", "blob"])
def test_a_pack_or_blob_written_by_a_newer_format_is_refused_by_materialize(run, gc_store, tmp_path, what):
    from ckptstore.format import pack

    blob = sorted(p for p in (gc_store / "packs").rglob("*") if p.is_file())[-1]
    data = bytearray(blob.read_bytes())
    if what == "pack":
        data[4] = 2  # the pack's format version byte
    else:  # the version byte of the first tensor's blob inside the pack
        data[pack.parse_index(bytes(data))[0].offset + 4] = 2
    blob.write_bytes(bytes(data))
    result = run("--store", gc_store, "materialize", "--step", 400, tmp_path / "out")
    assert result.returncode == 6
    assert f"pack {blob.name}" in result.stderr and f"{what} has format version 2" in result.stderr
    assert not (tmp_path / "out").exists()
    verified = run("--store", gc_store, "verify")
    assert (
        verified.returncode == 1
        and f"pack {blob.name}" in verified.stdout
        and "cannot be read" in verified.stdout
    )


def test_python_m_ckptstore_cli_is_the_cli_too(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ckptstore", "--version"])
    runpy.run_module("ckptstore.cli", run_name="__main__")
    assert capsys.readouterr().out.startswith("ckptstore, version ")


def test_group_options_are_accepted_after_the_command(run, gc_store, tmp_path):
    steps = [300, 400]
    listed = run("log", "--json", "--store", gc_store)
    assert [json.loads(line)["step"] for line in listed.stdout.splitlines()] == steps
    # Given on both sides, the one after the command wins, as a command's own option does.
    assert run("--store", tmp_path / "missing", "log", "--store", gc_store).returncode == 0
    assert run("catalog", "rebuild", "--store", gc_store).returncode == 0
    assert run("catalog", "--store", gc_store, "rebuild").returncode == 0
    nvme = tmp_path / "nvme"
    ckptstore.open(gc_store, local=nvme, local_upload="drain").close()
    result = run("drain", "--local", nvme)  # the README's own line: exit 2 "No such option" before
    assert result.returncode == 0 and result.stdout.startswith("nothing to upload"), result
    through_tier = run("log", "--local", nvme).stdout.splitlines()  # the store the tier fronts
    assert (
        through_tier[0].endswith("where") and [line.split()[-1] for line in through_tier[1:]] == ["store"] * 2
    )


def _command_lines() -> list[str]:
    """Every `ckptstore ...` command line of the README and docs/ (shell blocks, inline code) and
    of the commands' own help texts, without the word ckptstore."""
    root = Path(__file__).resolve().parents[1]
    texts = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    readme = "\n".join(path.read_text() for path in texts)
    # A line that is a command: crontab fields and VAR=value settings may come before it.
    command = re.compile(r"^(?:[\d*/,-]+\s+)*(?:[A-Z][A-Z0-9_]*=\S*\s+)*ckptstore\s+(.*)$")
    lines, fence = [], None
    for line in readme.splitlines():
        if line.startswith("```"):
            fence = None if fence is not None else line[3:].strip()
        elif fence is None:
            lines += re.findall(r"`ckptstore\s+([^`]+)`", line)
        elif fence != "python" and (found := command.match(line.strip())):
            lines.append(found.group(1))

    def helps(group: click.Group):
        for sub in group.commands.values():
            yield sub.help or ""
            if isinstance(sub, click.Group):
                yield from helps(sub)

    from ckptstore.cli import cli

    for text in [cli.help or "", *helps(cli)]:
        lines += [found.group(1) for found in map(command.search, text.splitlines()) if found]
    return lines


def test_the_readme_and_the_help_texts_have_command_lines():
    lines = _command_lines()
    assert len(lines) >= 30 and "drain --local /nvme/ckpt/run7" in [
        line.split("#")[0].strip() for line in lines
    ]


@pytest.mark.parametrize("line", _command_lines())
def test_every_documented_command_line_parses(line):
    from ckptstore.cli import cli

    # `[--json]`: an option that may be left out; the line is tried with it.
    args = shlex.split(line.replace("[", "").replace("]", ""), comments=True)
    result = CliRunner().invoke(cli, [*args, "--help"], prog_name="ckptstore")
    assert result.exit_code == 0, f"ckptstore {line}: {result.output}"
    assert result.output.startswith("Usage: ckptstore")
