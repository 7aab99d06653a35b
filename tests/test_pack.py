"""Packs: many tensors in one object, each readable on its own range, all verified."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.errors import CorruptError, UnsupportedError
from ckptstore.format import codec, pack


def items():
    return [
        ("layers.0.w", "fp32", 0, torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("layers.0.w", "exp_avg", 0, torch.zeros(6)),
        ("layers.0.b", "fp32", 4, torch.tensor([1.5, -2.0], dtype=torch.bfloat16)),
    ]


def packed(tensors=None):
    key, parts, entries = pack.encode_parts(items() if tensors is None else tensors)
    return key, b"".join(bytes(memoryview(p)) for p in parts), entries


def test_a_pack_round_trips_every_entry_with_its_place():
    key, data, entries = packed()
    decoded = pack.decode(data, key)
    assert [(e.name, e.kind, e.start) for e, _ in decoded] == [(n, k, s) for n, k, s, _ in items()]
    for (_, tensor), (_, _, _, original) in zip(decoded, items(), strict=True):
        assert tensor.dtype == original.dtype and torch.equal(tensor, original)
    assert [e.key for e in entries] == [codec.tensor_key(t) for _, _, _, t in items()]


def test_one_entry_is_read_from_the_preamble_the_index_and_its_own_range():
    key, data, _ = packed()
    length = pack.index_length(data[: pack.PREAMBLE.size])
    entries = pack.parse_index(data[: pack.PREAMBLE.size + length], key)
    third = entries[2]
    tensor = pack.decode_entry(data[third.offset : third.offset + third.length], third)
    assert torch.equal(tensor, items()[2][3])


def test_the_key_depends_on_contents_and_places_only():
    assert packed()[0] == packed()[0]
    moved = [(n, k, s + 1, t) for n, k, s, t in items()]
    changed = [*items()[:2], ("layers.0.b", "fp32", 4, torch.tensor([1.5, -3.0], dtype=torch.bfloat16))]
    assert len({packed()[0], packed(moved)[0], packed(changed)[0]}) == 3


def test_pack_bytes_are_pinned():
    # Preamble (magic, version 1, index length 66), the index, then the entry's own blob.
    key, data, _ = packed(items()[2:])
    assert data == (
        b"CKPK\x01\x42\x00\x00\x00"
        b'[["layers.0.b","fp32",4,"395cd9844862253c5e06715f4582651f",75,36]]'
        + bytes.fromhex("434b504201000862666c6f617431360102000000000000000400000000000000c03f00c0")
    )  # fmt: skip
    # The key is over the contents alone: the codec's choices do not change it.
    assert key == "d930535e839b61ddc92a8f5ffc71335c"
    assert key == pack.pack_key([("layers.0.b", "fp32", 4, "395cd9844862253c5e06715f4582651f")])


@pytest.mark.parametrize("where", ["index", "entry"])
def test_a_damaged_pack_is_refused(where):
    key, data, entries = packed()
    damaged = bytearray(data)
    damaged[pack.PREAMBLE.size + 3 if where == "index" else entries[1].offset + entries[1].length - 1] ^= 0x01
    with pytest.raises(CorruptError):
        pack.decode(bytes(damaged), key)


def test_truncated_and_padded_packs_are_refused():
    key, data, _ = packed()
    for damaged in (data[:-1], data + b"\x00"):
        with pytest.raises(CorruptError):
            pack.decode(damaged, key)


def test_a_pack_of_a_newer_format_is_refused_as_unsupported():
    key, data, _ = packed()
    with pytest.raises(UnsupportedError, match="pack has format version 2"):
        pack.decode(data[:4] + b"\x02" + data[5:], key)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_pack_parser(data):
    try:
        pack.decode(data)
    except (CorruptError, UnsupportedError):
        pass
