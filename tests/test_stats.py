"""Update statistics: fixed global sample positions, per-rank fragments, relative change."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.catalog import Catalog
from ckptstore.commit import stats
from ckptstore.model import FP32, WEIGHT, BlobRow, FileRow, Piece, StepRecord, TensorRow


def test_sample_positions_are_one_per_stratum_and_not_one_column():
    positions = stats.sample_positions(64 * 256, 256)
    assert positions.tolist() == sorted(set(positions.tolist()))
    assert all(i * 64 <= p < (i + 1) * 64 for i, p in enumerate(positions.tolist()))
    assert len({p % 64 for p in positions.tolist()}) > 32  # a plain stride would hit column 0 only
    assert stats.sample_positions(10, 256).tolist() == list(range(10))  # small tensors: every element


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=4), st.integers(1, 3000))
def test_fragments_held_by_different_ranks_merge_into_the_whole_tensor_sample(cuts, numel):
    params = {"w": {"shape": [numel]}}
    whole = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    bounds = sorted({0, numel, *(c % numel for c in cuts)})
    shares = [
        stats.own_samples([Piece("w", FP32, lo, whole[lo:hi])], params)
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    ]
    merged = stats.merge(shares, params)
    assert merged == {"w": stats.own_samples([Piece("w", FP32, 0, whole)], params)["w"][0][1]}


def test_the_master_is_sampled_and_the_weight_only_without_one():
    params = {"a": {"shape": [4]}, "frozen": {"shape": [3]}}
    pieces = [
        Piece("a", FP32, 0, torch.tensor([1.0, 2.0, 3.0, 4.0])),
        Piece("a", WEIGHT, 0, torch.tensor([9.0, 9.0, 9.0, 9.0], dtype=torch.bfloat16)),
        Piece("frozen", WEIGHT, 0, torch.tensor([5.0, 6.0, 7.0], dtype=torch.bfloat16)),
    ]
    merged = stats.merge([stats.own_samples(pieces, params)], params)
    assert np.frombuffer(merged["a"], np.float32).tolist() == [1, 2, 3, 4]
    assert np.frombuffer(merged["frozen"], np.float32).tolist() == [5, 6, 7]


def sample(values):
    return np.asarray(values, np.float32).tobytes()


def test_relative_change_weighs_parameters_by_size():
    params = {"big": {"shape": [8]}, "small": {"shape": [2]}}  # "big" is sampled 2 of 8
    before = {"big": sample([3, 4]), "small": sample([0, 0])}
    now = {"big": sample([3, 4]), "small": sample([1, 0])}
    # sqrt((8/2 * 0 + 2/2 * 1) / (8/2 * 25 + 0)) = sqrt(1 / 100)
    assert stats.relative_change(["big", "small"], now, before, params) == pytest.approx(0.1)
    assert stats.relative_change(["small"], before, before, params) == 0.0  # all zero, unmoved
    assert stats.relative_change(["small"], now, before, params) is None  # all zero before: undefined
    assert stats.relative_change(["big"], now, {}, params) is None  # nothing recorded to compare with


def test_dropping_a_step_keeps_the_samples_a_kept_step_inherits(tmp_path):
    catalog = Catalog(tmp_path / "c.db")
    for step, sources in ((1, {"a": 1, "b": 1}), (2, {"a": 1, "b": 2})):
        saved = [layer for layer, source in sources.items() if source == step]
        record = StepRecord(
            step=step, created_at="2026-01-01T00:00:00+00:00", world_size=1, description="{}",
            layer_sources=sources,
            tensors=[TensorRow(source, layer, f"{layer}.w", "fp32", 0, 4, f"k{source}{layer}")
                     for layer, source in sources.items()],
            blobs=[BlobRow(f"k{source}{layer}", 10, 16) for layer, source in sources.items()],
            updates={"a": (1, 0.5)} if step == 2 else {},
            files=[FileRow("config.json", "f" * 32, 2)], added=(1, 10),
        )  # fmt: skip
        catalog.record_step(record, samples={f"{layer}.w": sample([step]) for layer in saved})
    assert [(r.layer, r.source, r.update, r.update_since) for r in catalog.layer_rows(2)] == [
        ("a", 1, 0.5, 1),
        ("b", 2, None, None),
    ]
    catalog.drop_steps([1])
    assert catalog.samples(1, ["a.w", "b.w"]) == {"a.w": sample([1])}  # step 2 inherits layer a
    assert catalog.samples(2, ["b.w"]) == {"b.w": sample([2])}
    assert catalog.db.execute("SELECT step FROM files").fetchall() == [(2,)]
