"""``ckptstore report``: what the store saw, drawn. The figures are the catalog's own (what
``log`` and ``show`` print), the heatmap marks exactly the layers each step saved, and the
charts are real PNGs an ``index.html`` shows with the numbers behind them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import ckptstore
from ckptstore.errors import BadInputError, NotFoundError
from ckptstore.format import layout, manifest
from ckptstore.report import charts
from ckptstore.strategies import Parity
from tools.engines import batches, build_engine, train

pytest.importorskip("matplotlib")
from matplotlib.image import imread  # noqa: E402

STEPS = list(range(1, 12))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Eleven commits of a two-block Llama with the Parity strategy (half the blocks at
    alternate saves), training a batch between each."""
    engine = build_engine("llama", zero_stage=1, dtype="bf16", seed=0, num_layers=2)
    store = ckptstore.open(tmp_path_factory.mktemp("report") / "store")
    for step, batch in zip(STEPS, batches(len(STEPS)), strict=True):
        train(engine, [batch])
        store.commit(engine, step=step, layers=Parity())
    return store


def test_the_figures_are_the_catalogs_and_mark_exactly_the_layers_each_step_saved(store):
    figures = store.report()
    assert figures.steps == STEPS
    log = {row.step: row for row in store.log()}
    for i, step in enumerate(figures.steps):
        shown = {row.layer: row for row in store.show(step)}
        assert set(figures.layers) == set(shown)
        saved = {layer for layer, mark in zip(figures.layers, figures.saved[i], strict=True) if mark}
        assert saved == {layer for layer, row in shown.items() if row.source == step}
        assert len(saved) == log[step].layers_saved
        assert figures.updates[i] == [shown[layer].update for layer in figures.layers]
        assert figures.logical_bytes[i] == sum(row.raw_bytes for row in shown.values())
        assert figures.stored_bytes[i] == log[step].bytes_added
    assert figures.cumulative_stored_bytes[-1] == sum(row.bytes_added for row in log.values())
    assert figures.dedup_ratio == figures.cumulative_logical_bytes[-1] / figures.cumulative_stored_bytes[-1]
    assert figures.dedup_ratio > 1  # compression and the inherited halves
    assert any(not all(row) for row in figures.saved[1:])  # the strategy saved only some layers


def test_each_commits_duration_is_the_one_its_manifest_records(store):
    figures = store.report()
    for step, seconds in zip(figures.steps, figures.commit_seconds, strict=True):
        written = manifest.decode(store.objects.get(layout.manifest_name(step, 0)))
        assert seconds is not None and seconds > 0 and seconds == written.seconds
    assert figures.upload_seconds == [None] * len(STEPS)  # no local tier, nothing uploaded


@pytest.mark.parametrize("seconds", [-1, 1e9, "3", True, float("nan")])
def test_a_manifest_whose_duration_is_no_duration_is_corrupt(seconds):
    from ckptstore.errors import CorruptError
    from ckptstore.model import StepRecord

    record = StepRecord(
        step=1, created_at="t", world_size=1, description="{}", layer_sources={}, tensors=[], blobs=[]
    )
    data = json.dumps({"version": 1, **manifest._body(record), "seconds": seconds}).encode()
    with pytest.raises(CorruptError, match="seconds"):
        manifest.decode(data)


def test_report_writes_png_charts_and_a_page_with_the_numbers(store, tmp_path, run):
    result = run("--store", store.objects.uri, "report", "--steps", "3..9", tmp_path / "report")
    assert result.returncode == 0, result
    assert "reported steps 3 to 9" in result.stdout
    folder = tmp_path / "report"
    for name in charts.CHARTS:
        picture = imread(folder / name)  # a PNG that decodes
        height, width = picture.shape[:2]
        assert 200 <= width <= 3000 and 200 <= height <= 4000, (name, picture.shape)
        assert 5_000 < (folder / name).stat().st_size < 2_000_000
        assert f'src="{name}"' in (folder / "index.html").read_text()
    written = json.loads((folder / "figures.json").read_text())
    assert written == store.report(steps="3..9").as_json() and written["steps"] == list(range(3, 10))
    again = run("--store", store.objects.uri, "report", tmp_path / "report")
    assert (
        again.returncode == 5 and "--force" in again.stderr
    )  # an existing report is never overwritten unasked
    assert run("--store", store.objects.uri, "report", "--force", tmp_path / "report").returncode == 0


def test_report_json_prints_the_figures_without_drawing(store, run):
    result = run("--store", store.objects.uri, "report", "--json", "--steps", "10..")
    assert result.returncode == 0, result
    assert json.loads(result.stdout) == store.report(steps="10..").as_json()
    assert "Example:" in run("report", "--help").stdout


@pytest.mark.parametrize("steps", ["9..3", "x..4", "1...2"])
def test_a_malformed_range_is_bad_input(store, steps):
    with pytest.raises(BadInputError, match="--steps"):
        store.report(steps=steps)


def test_a_range_with_no_step_is_not_found(store, run):
    with pytest.raises(NotFoundError, match="no committed step between 50 and the last"):
        store.report(steps="50..")
    result = run("--store", store.objects.uri, "report", "--json", "--steps", "50..")
    assert result.returncode == 3 and result.stderr.startswith("error: no committed step")


@pytest.mark.parametrize("steps", ["-5..", "..-1", "-3", "-9..-2"])
def test_a_negative_step_is_bad_input_as_in_every_other_command(store, run, steps):
    with pytest.raises(BadInputError, match="--steps"):
        store.report(steps=steps)
    result = run("--store", store.objects.uri, "report", "--json", "--steps", steps)
    assert result.returncode == 2 and result.stderr.startswith("error: --steps") and not result.stdout


class _Named(torch.nn.Module):
    """A model under a module of the given name: every layer's name starts with it."""

    def __init__(self, name: str, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner_name = name
        self.add_module(name, inner)

    def forward(self, *args, **kwargs):
        return getattr(self, self.inner_name)(*args, **kwargs)


def test_a_layer_name_matplotlib_would_read_as_mathtext_is_drawn_as_written(tmp_path, run):
    # PyTorch takes any module name without a dot; `$\frac{$` is a malformed TeX formula.
    import deepspeed

    from tools.engines import _param_groups, build_model, ds_config

    name = "$\\frac{$"
    module = _Named(name, build_model("llama", num_layers=1))
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=_param_groups(module, 0.01), config=ds_config(1, "bf16")
    )
    store = ckptstore.open(tmp_path / "store")
    for step, batch in zip((1, 2), batches(2), strict=True):
        train(engine, [batch])
        store.commit(engine, step=step)
    result = run("--store", store.objects.uri, "report", tmp_path / "report")
    assert result.returncode == 0, result
    layers = json.loads((tmp_path / "report" / "figures.json").read_text())["layers"]
    assert layers and all(layer.startswith(f"{name}.") for layer in layers)
    assert imread(tmp_path / "report" / "updates.png").shape[0] > 200


def _copy(store, tmp_path):
    """A copy of ``store``'s folder without its catalog: opened, it reads every manifest again
    (as a fresh machine's index of an S3 store does)."""
    copy = tmp_path / "copy"
    shutil.copytree(store.objects.root, copy, ignore=shutil.ignore_patterns("catalog.db*"))
    return copy


def test_a_step_whose_manifest_cannot_be_read_is_corrupt_naming_it_and_nothing_is_written(
    store, tmp_path, run
):
    copy = _copy(store, tmp_path)
    (copy / layout.manifest_name(5, 0)).write_bytes(b"not a manifest")
    result = run("--store", copy, "report", "--steps", "3..9", tmp_path / "report")
    assert result.returncode == 4 and "step 5" in result.stderr and "verify" in result.stderr, result
    assert not (tmp_path / "report").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["copy"]
    assert run("--store", copy, "report", "--json", "--steps", "3..9").returncode == 4
    # the steps around it still report
    assert run("--store", copy, "report", "--json", "--steps", "6..9").returncode == 0


def test_report_reads_no_pack_and_says_verify_is_the_check(store, tmp_path, run):
    copy = _copy(store, tmp_path)
    pack_file = next(p for p in (copy / "packs").rglob("*") if p.is_file())
    pack_file.unlink()
    result = run("--store", copy, "report", "--json")
    assert result.returncode == 0 and json.loads(result.stdout) == store.report().as_json()
    assert "verify" in " ".join(run("report", "--help").stdout.split())


def test_past_eighty_layers_the_experts_of_each_moe_layer_share_one_heatmap_row():
    from ckptstore.report.figures import Figures

    experts = [
        f"blocks.{b}.moe.deepspeed_moe.experts.deepspeed_experts.{e}" for b in (1, 3) for e in range(64)
    ]
    layers = ["embed", "blocks.0", "blocks.1", *experts[:64], "blocks.2", "blocks.3", *experts[64:], "head"]
    updates = [[0.5 if layer.endswith(".7") else 0.1 if "experts" in layer else None for layer in layers]]
    saved = [[layer.endswith(".7") for layer in layers]]
    figures = Figures([4], layers, updates, saved, [1], [1], [1], [1], None, [None], [None], [None], [[]])

    labels, rows, marks = charts.heatmap_rows(figures)
    group = "blocks.{}.moe.deepspeed_moe.experts.deepspeed_experts.* (64 experts, largest update)"
    assert labels == [
        "embed",
        "blocks.0",
        "blocks.1",
        group.format(1),
        "blocks.2",
        "blocks.3",
        group.format(3),
        "head",
    ]
    assert rows[3] == rows[6] == [0.5] and marks[3] == marks[6] == [True]
    assert rows[0] == [None] and marks[0] == [False]
    # a few experts keep a row each
    assert charts.heatmap_rows(figures, limit=len(layers))[0] == layers
