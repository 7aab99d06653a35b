"""A layer's fragment index round-trips, stays small for regular partitions, and refuses damage."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.deepspeed.layout import zero3_bounds
from ckptstore.errors import CorruptError, UnsupportedError
from ckptstore.format import layerpacks
from ckptstore.model import PackRef

SHAPES = {"layers.0.q.weight": 8192 * 8192, "layers.0.norm.weight": 8192}


def zero3_layer(world_size: int, bases=()):
    """The packs of a ZeRO-3 layer on ``world_size`` ranks: one a rank, fp32 and two moments."""
    packs = []
    for rank in range(world_size):
        entries = []
        for name, numel in SHAPES.items():
            start, count = zero3_bounds(numel, world_size, rank)
            entries += [(name, kind, "float32", start, count) for kind in ("fp32", "exp_avg", "exp_avg_sq")]
        key = f"{rank:032x}"
        packs.append((PackRef(key, rank, 1000 + rank, 12 * sum(e[4] for e in entries)), entries))
    return layerpacks.build(7, "layers.0", packs, list(bases))


def test_an_index_round_trips_and_finds_every_fragment_of_a_tensor():
    index = zero3_layer(4)
    decoded = layerpacks.decode(layerpacks.encode(index), 7, "layers.0")
    assert decoded == index
    dtype, rows = decoded.by_tensor()[("layers.0.norm.weight", "exp_avg")]
    assert dtype == "float32"
    assert [tuple(r[1:]) for r in rows] == [(rank, rank * 2048, 2048) for rank in range(4)]


def test_a_regular_partition_on_512_ranks_takes_a_few_bytes_a_pack():
    data = layerpacks.encode(zero3_layer(512))
    assert len(data) < 512 * 24  # the pack keys (16 bytes each) are most of it


def test_a_damaged_or_newer_index_is_refused():
    data = layerpacks.encode(zero3_layer(2))
    with pytest.raises(CorruptError):
        layerpacks.decode(data[:-3] + bytes([data[-3] ^ 1]) + data[-2:], 7, "layers.0")
    with pytest.raises(UnsupportedError, match="format version 3"):
        layerpacks.decode(data[:4] + b"\x03" + data[5:], 7, "layers.0")


def test_a_layer_without_bases_is_written_as_before_and_one_with_bases_keeps_them():
    plain = zero3_layer(2)
    assert layerpacks.encode(plain)[4] == 1  # older readers read it, digests stay as they were
    bases = [PackRef("b" * 32, 1, 50, 80), PackRef("a" * 32, 0, 40, 80)]
    index = zero3_layer(2, bases)
    data = layerpacks.encode(index)
    assert data[4] == 2
    decoded = layerpacks.decode(data, 7, "layers.0")
    assert decoded == index and [ref.key for ref in decoded.bases] == ["a" * 32, "b" * 32]
    assert decoded.all_packs == [*plain.packs, *decoded.bases]
    lazy = layerpacks.decode_lazily(data, 7, "layers.0")
    assert (lazy.size, lazy.raw_size) == (plain.size, plain.raw_size)  # its own packs alone
    assert lazy.bases == decoded.bases


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 10**12), st.integers(0, 10**9)),
        max_size=30,
    )
)
def test_any_fragments_round_trip(rows):
    packs = [(PackRef(f"{p:032x}", p, 1, 1), []) for p in range(3)]
    for tensor, pack, start, numel in rows:
        packs[pack][1].append((f"t{tensor}", "fp32", "float32", start, numel))
    index = layerpacks.build(1, "x", packs)
    assert layerpacks.decode(layerpacks.encode(index), 1, "x") == index


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_index_parser(data):
    try:
        layerpacks.decode(b"CKLP\x01" + data, 1, "x")
    except CorruptError:
        pass


def test_a_layer_past_the_pack_size_is_cut_into_parts_none_of_them_small():
    from ckptstore.commit.packs import cut_points

    assert cut_points([10, 10, 10], 100) == [slice(0, 3)]
    assert cut_points([60, 60, 60, 60], 100) == [slice(0, 1), slice(1, 2), slice(2, 3), slice(3, 4)]
    # A small tail joins the part before it rather than becoming an object of its own.
    assert cut_points([90, 90, 5], 100) == [slice(0, 1), slice(1, 3)]
    # Small tensors before a big one stay with it until the part holds a quarter of the limit.
    assert cut_points([5, 500, 5], 100) == [slice(0, 3)]
    assert cut_points([], 100) == [slice(0, 0)]
