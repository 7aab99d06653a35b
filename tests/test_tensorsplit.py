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


# A fused q/k/v of grouped-query attention on 2 ranks (6 query heads, 3 key/value heads of 2
# rows): q, k and v each cut on head boundaries, unevenly, as AutoTP records them.
FUSED_QKV = {"shape": [12, 2], "split": {"dim": 0, "sizes": [8, 4], "sub": [[4, 2], [2, 1], [2, 1]]}}


def test_a_fused_parameters_slice_is_each_rank_holds_a_piece_of_every_sub_parameter_as_deepspeed_cuts_it():
    from deepspeed.module_inject.layers import _partition_logical_tensor

    logical = torch.arange(24.0).view(12, 2)  # q rows 0-5, k rows 6-8, v rows 9-11
    widths = FUSED_QKV["split"]["sub"]
    stored = tensorsplit.from_logical(logical, FUSED_QKV)
    for rank in range(2):
        start = tensorsplit.slice_offset(FUSED_QKV, rank)
        shape = tensorsplit.slice_shape(FUSED_QKV, rank)
        held = _partition_logical_tensor(logical, 0, 2, rank, widths, subparam_sizes=[6, 3, 3])
        assert shape == list(held.shape)
        assert torch.equal(stored[start : start + held.numel()].view(shape), held)
    # the logical tensor is the sub-parameters whole, one after another (ds_to_universal's)
    assert torch.equal(tensorsplit.to_logical(stored, FUSED_QKV), logical)


def test_a_fused_parameter_is_out_of_logical_order_even_split_along_its_first_dimension():
    whole = {"shape": [12, 2]}
    assert not tensorsplit.in_logical_order(FUSED_QKV)
    assert not tensorsplit.same_order(FUSED_QKV, whole)
    even = {"shape": [12, 2], "split": {"dim": 0, "sizes": [6, 6], "sub": [[3, 3], [3], [3]]}}
    assert tensorsplit.description_problem({"params": {"qkv": even}}) is not None
    one_sub = {"shape": [12, 2], "split": {"dim": 0, "sizes": [8, 4], "sub": [[8, 4]]}}
    assert tensorsplit.in_logical_order(one_sub) and tensorsplit.same_order(one_sub, whole)
    # into another degree and back through the logical tensor, as a restore reorders it
    logical = torch.randn(12, 2)
    four = {
        "shape": [12, 2],
        "split": {"dim": 0, "sizes": [3, 3, 3, 3], "sub": [[2, 1, 1, 2], [1, 1, 1, 0], [0, 1, 1, 1]]},
    }
    for split in (FUSED_QKV, four):
        assert tensorsplit.description_problem({"params": {"qkv": split}}) is None
        assert torch.equal(tensorsplit.to_logical(tensorsplit.from_logical(logical, split), split), logical)


BAD_SUBS = {
    "not a list": 3,
    "empty": [],
    "a width short": [[4, 2], [2], [2, 1]],
    "a negative width": [[5, 3], [2, -1], [1, 2]],
    "widths unlike the sizes": [[4, 2], [1, 2], [2, 1]],
    "a width as text": [[4, 2], [2, "1"], [2, 1]],
}


def test_a_split_whose_sub_parameters_do_not_tile_its_slices_is_a_malformed_description():
    for bad, sub in BAD_SUBS.items():
        info = {"shape": [12, 2], "split": {"dim": 0, "sizes": [8, 4], "sub": sub}}
        problem = tensorsplit.description_problem({"params": {"model.qkv_proj.weight": info}})
        assert problem is not None and "model.qkv_proj.weight" in problem, bad


def test_a_vocabulary_keeps_at_most_its_rows_as_its_original_vocab_size():
    padded = {"shape": [52, 32], "split": {"dim": 0, "sizes": [26, 26]}}
    assert (
        tensorsplit.description_problem({"params": {"embed": {**padded, "original_vocab_size": 49}}}) is None
    )
    for bad in (53, -1, "49", 49.0, True):
        problem = tensorsplit.description_problem(
            {"params": {"embed": {**padded, "original_vocab_size": bad}}}
        )
        assert problem is not None and "embed" in problem, bad


def test_an_averaged_parameter_keeps_every_ranks_copy_and_reads_as_their_mean_as_ds_to_universal():
    # two TP ranks' copies of a norm, drifted apart: stored one after another, each rank's
    # slice its own copy; the logical tensor is merge_tp_slices' sum(slices) / len(slices)
    copies = [torch.randn(4, dtype=torch.float32), torch.randn(4, dtype=torch.float32)]
    info = {"shape": [8], "split": {"dim": 0, "sizes": [4, 4], "average": True}}
    assert tensorsplit.description_problem({"params": {"norm": info}}) is None
    assert tensorsplit.logical_shape(info) == [4] and not tensorsplit.in_logical_order(info)
    assert [tensorsplit.slice_shape(info, t) for t in (0, 1)] == [[4], [4]]
    assert [tensorsplit.slice_offset(info, t) for t in (0, 1)] == [0, 4]
    logical = tensorsplit.to_logical(torch.cat(copies), info)
    assert torch.equal(logical, sum(copies) / len(copies))
    # another degree gets the mean on every rank; one rank's layout the mean itself
    three = {"shape": [12], "split": {"dim": 0, "sizes": [4, 4, 4], "average": True}}
    assert torch.equal(tensorsplit.from_logical(logical, three), logical.repeat(3))
    assert not tensorsplit.same_order(info, three) and not tensorsplit.same_order(info, {"shape": [4]})
    assert tensorsplit.same_order(info, dict(info))
    for bad in ({"average": 1}, {"sizes": [4, 3]}, {"dim": 1}, {"sub": [[2, 2], [2, 2]]}):
        split = {**info["split"], **bad}
        shape = [8, 1] if bad.get("dim") == 1 else [sum(split["sizes"])]
        problem = tensorsplit.description_problem({"params": {"norm": {"shape": shape, "split": split}}})
        assert problem is not None and "norm" in problem, bad
