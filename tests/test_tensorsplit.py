"""A tensor-parallel parameter's slices, one after another, in one flat order."""

import torch

from ckptstore import tensorsplit

ROW_PARALLEL = {"shape": [3, 5], "split": {"dim": 1, "sizes": [3, 2]}}  # uneven, as AutoTP may cut


def test_each_slice_is_a_contiguous_range_of_the_stored_order():
    logical = torch.arange(15.0).view(3, 5)
    stored = tensorsplit.from_logical(logical, ROW_PARALLEL)
    for index, expected in enumerate(logical.split([3, 2], dim=1)):
        start = tensorsplit.slice_offset(ROW_PARALLEL, index)
        shape = tensorsplit.slice_shape(ROW_PARALLEL, index)
        assert torch.equal(stored[start : start + expected.numel()].view(shape), expected)
    assert torch.equal(tensorsplit.to_logical(stored, ROW_PARALLEL), logical)


def test_a_column_split_is_the_logical_order_and_any_degree_of_it_reads_alike():
    column = {"shape": [4, 2], "split": {"dim": 0, "sizes": [2, 2]}}
    other = {"shape": [4, 2], "split": {"dim": 0, "sizes": [1, 1, 1, 1]}}
    logical = torch.arange(8.0).view(4, 2)
    assert torch.equal(tensorsplit.from_logical(logical, column), logical.reshape(-1))
    assert tensorsplit.same_order(column, other) and tensorsplit.same_order(column, {"shape": [4, 2]})
    assert not tensorsplit.same_order(ROW_PARALLEL, {"shape": [3, 5]})
