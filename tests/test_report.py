"""``ckptstore report``: what the store saw, drawn. The figures are the catalog's own (what
``log`` and ``show`` print), the heatmap marks exactly the layers each step saved, and the
charts are real PNGs an ``index.html`` shows with the numbers behind them."""

from __future__ import annotations

import json

import pytest

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
