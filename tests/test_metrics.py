"""Metrics recorded with a step, and retention that never drops the best step by one."""

from __future__ import annotations

import json

import pytest

import ckptstore
from ckptstore.errors import BadInputError
from tools.engines import batches, build_engine, destroy_engine, train

EVAL_LOSS = {1: 3.0, 2: 1.5, 3: 2.0, 4: float("nan"), 5: 2.5}


@pytest.fixture
def evaluated(tmp_path):
    """Steps 1-5, each with the eval loss of EVAL_LOSS (step 4's diverged) and its accuracy."""
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=1, dtype="bf16", num_layers=2)
    for step, (data, loss) in enumerate(zip(batches(5), EVAL_LOSS.values(), strict=True), start=1):
        train(engine, [data])
        store.commit(engine, step, metrics={"eval_loss": loss, "accuracy": 1 / step})
    destroy_engine(engine)
    yield store
    store.close()


def test_metrics_are_recorded_with_the_step_and_shown_by_log(evaluated, run, tmp_path):
    rows = evaluated.log()
    assert [row.metrics["eval_loss"] for row in rows] == [3.0, 1.5, 2.0, None, 2.5]  # not finite -> None
    assert rows[1].metrics == {"accuracy": 0.5, "eval_loss": 1.5}
    uri = evaluated.objects.uri
    lines = run("--store", uri, "log", "--json").stdout.splitlines()
    assert [json.loads(line)["metrics"]["eval_loss"] for line in lines] == [3.0, 1.5, 2.0, None, 2.5]
    text = run("--store", uri, "log").stdout.splitlines()
    assert text[0].endswith("metrics") and text[2].endswith("accuracy=0.5 eval_loss=1.5")
    assert text[4].endswith("eval_loss=nan")


def test_metrics_travel_in_the_manifest(evaluated, tmp_path):
    log = evaluated.log()
    evaluated.close()
    (tmp_path / "store" / "catalog.db").unlink()
    ckptstore.rebuild_catalog(str(tmp_path / "store"))
    with ckptstore.open(tmp_path / "store") as rebuilt:
        assert [row.metrics for row in rebuilt.log()] == [row.metrics for row in log]


def test_metrics_that_are_not_numbers_fail_the_commit_and_record_nothing(tmp_path):
    store = ckptstore.open(tmp_path / "store")
    engine = build_engine("llama", zero_stage=0, num_layers=2)
    for metrics, message in [
        ({"eval_loss": "low"}, "not a number"),
        ({"": 1.0}, "metric name"),
        ([1.0], "mapping"),
    ]:
        with pytest.raises(BadInputError, match=message):
            store.commit(engine, 1, metrics=metrics)
    assert store.steps() == []
    store.commit(engine, 1, metrics={"eval_loss": 2})  # an int is a number
    assert store.log()[0].metrics == {"eval_loss": 2.0}
    destroy_engine(engine)


def test_keep_best_keeps_the_best_step_that_retention_would_drop(evaluated, tmp_path):
    report = evaluated.gc(keep_last=1, keep_best=["eval_loss:min"], grace=0)
    assert report.steps_kept == [2, 5] and report.steps_dropped == [1, 3, 4]
    evaluated.materialize(2, tmp_path / "best")  # the best step is whole: it still resumes


def test_keep_best_takes_a_count_and_either_direction_and_never_picks_a_nan(evaluated):
    report = evaluated.gc(keep_best=["eval_loss:max:2", "accuracy:max"], dry_run=True)
    assert report.steps_kept == [1, 5]  # eval_loss 3.0 and 2.5 (step 4's NaN is no maximum); accuracy 1.0
    report = evaluated.gc(keep_best=[("eval_loss", "min", 3)], dry_run=True)
    assert report.steps_kept == [2, 3, 5]


def test_cli_keep_best_and_its_errors(evaluated, run):
    uri = evaluated.objects.uri
    result = run(
        "--store", uri, "gc", "--keep-last", "1", "--keep-best", "eval_loss:min", "--json", "--grace", "0s"
    )
    assert result.returncode == 0 and json.loads(result.stdout)["steps_kept"] == [2, 5]
    typo = run("--store", uri, "gc", "--keep-last", "1", "--keep-best", "eval_los:min")
    assert (
        typo.returncode == 2 and "eval_los" in typo.stderr and "recorded: accuracy, eval_loss" in typo.stderr
    )
    bad = run("--store", uri, "gc", "--keep-best", "eval_loss:lowest")
    assert bad.returncode == 2 and "NAME:min|max[:COUNT]" in bad.stderr
    assert evaluated.steps() == [2, 5]
