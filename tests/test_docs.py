"""The front page and the guide cannot rot: the README stays a front page that starts with
the two commands CI runs, every relative link in it and in docs/ resolves, and the guide
builds as a site with ``mkdocs build --strict``. (Every ``ckptstore ...`` line they show
parses: tests/test_cli.py; every ``CKPTSTORE_*`` they name exists: tests/test_settings.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_a_front_page_that_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)
    assert blocks[0].strip().startswith("python3 -m venv .venv") and "tools/demo.py" in blocks[0]
    assert blocks[1].strip().endswith("-m pytest -q")
    assert text.index(blocks[0]) < text.index("## What it does")  # first, before anything else


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{page.name} links to {target}, which does not exist"


def test_every_guide_page_is_in_the_sites_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert {p.name for p in PAGES[1:]} == set(re.findall(r"([\w-]+\.md)", nav))


def test_the_guide_builds_as_a_site_with_no_warning(tmp_path):
    if shutil.which("mkdocs") is None and not (Path(sys.executable).parent / "mkdocs").exists():
        pytest.skip("mkdocs is not installed (pip install -e '.[dev]' installs it)")
    mkdocs = shutil.which("mkdocs") or str(Path(sys.executable).parent / "mkdocs")
    done = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "site" / "security" / "index.html").is_file()


FRAGMENT = re.compile(r"<!-- a fragment: [^>]+ -->\s*$")


def python_blocks() -> list[tuple[str, str]]:
    """``(where, code)`` of every Python block of the README and docs/ not marked as a fragment
    (an HTML comment ``<!-- a fragment: why -->`` on the line before it)."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("```python") and not (i and FRAGMENT.match(lines[i - 1])):
                end = lines.index("```", i + 1)
                found.append((f"{page.name}:{i + 1}", "\n".join(lines[i + 1 : end])))
    return found


def test_every_python_block_is_marked_a_fragment_or_runs_as_written(tmp_path, monkeypatch):
    """Each runnable block runs in a fresh folder with ``engine``, a tiny trained DeepSpeed
    engine of four blocks, as the quick start assumes one."""
    from tools.engines import batches, build_engine, destroy_engine, train

    blocks = python_blocks()
    assert {where.split(":")[0] for where, _ in blocks} >= {"README.md", "getting-started.md"}
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=4)
    try:
        for where, code in blocks:
            folder = tmp_path / where.replace(":", "-")
            folder.mkdir()
            monkeypatch.chdir(folder)
            train(engine, batches(1))
            exec(compile(code, where, "exec"), {"engine": engine})  # noqa: S102 - our own docs
    finally:
        destroy_engine(engine)


def test_the_cli_page_shows_every_command_and_the_guide_every_option():
    """Checked against the CLI itself: every command and subcommand of ``ckptstore --help`` has
    a ``ckptstore <command>`` line on the command-line page, and every long option of each
    is named there or on the operations page."""
    import click

    from ckptstore.cli import cli

    page = (ROOT / "docs" / "cli.md").read_text()
    both = page + (ROOT / "docs" / "operations.md").read_text()

    def commands(group: click.Group, prefix: str = ""):
        for name, command in group.commands.items():
            yield f"{prefix}{name}", command
            if isinstance(command, click.Group):
                yield from commands(command, f"{prefix}{name} ")

    for name, command in commands(cli):
        assert re.search(rf"ckptstore (?:--\S+ \S+ )*{re.escape(name)}\b", page), f"docs/cli.md lacks {name}"
        options = [o for p in command.params for o in getattr(p, "opts", []) if o.startswith("--")]
        assert not [o for o in options if o not in both], (name, [o for o in options if o not in both])
