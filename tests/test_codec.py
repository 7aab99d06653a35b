"""The blob format: round trips, content keys, the pinned header, and corruption detection."""

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore import codec
from ckptstore.errors import CorruptError, UnsupportedError

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 0, 4), (64, 33)])
def test_encode_decode_round_trips_every_dtype_and_shape(dtype, shape):
    tensor = (torch.randn(shape) * 100).to(dtype)
    key, blob = codec.encode(tensor)
    back = codec.decode(blob, key)
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_key_depends_on_content_dtype_and_shape_but_not_on_codec(monkeypatch):
    tensor = torch.randn(32, 32)
    key, blob = codec.encode(tensor)
    assert key == codec.tensor_key(tensor)
    assert codec.tensor_key(tensor.reshape(16, 64)) != key
    assert codec.tensor_key(tensor.view(torch.int32)) != key
    monkeypatch.setenv("CKPTSTORE_MIN_COMPRESS_RATIO", "0")  # forces the raw codec
    raw_key, raw_blob = codec.encode(tensor)
    assert raw_key == key and raw_blob != blob
    assert codec.parse_header(raw_blob).codec == codec.RAW


def test_floats_are_byte_grouped_and_compressed():
    tensor = torch.randn(256, 256).bfloat16()
    _, blob = codec.encode(tensor)
    assert codec.parse_header(blob).codec == codec.ZSTD_PLANES
    assert len(blob) < 0.8 * tensor.numel() * 2


def test_blob_header_bytes_are_pinned():
    _, blob = codec.encode(torch.arange(3, dtype=torch.int32).reshape(1, 3))
    header = codec.parse_header(blob)
    expected = (
        b"CKPB\x01" + bytes([header.codec]) + b"\x05int32" + b"\x02"
        + (1).to_bytes(8, "little") + (3).to_bytes(8, "little") + (12).to_bytes(8, "little")
    )  # fmt: skip
    assert blob[: header.header_size] == expected


def test_zero_dim_tensor_has_a_stable_key():
    assert codec.tensor_key(torch.tensor(5)) == codec.tensor_key(torch.tensor(5))
    assert codec.tensor_key(torch.tensor(5)) != codec.tensor_key(torch.tensor([5]))


@pytest.mark.parametrize("position", [0, 4, 10, -1, -100])
def test_a_flipped_byte_is_detected(position):
    tensor = torch.randn(64, 64)
    key, blob = codec.encode(tensor)
    damaged = bytearray(blob)
    damaged[position] ^= 0xFF
    with pytest.raises(CorruptError):
        codec.decode(bytes(damaged), key)


@pytest.mark.parametrize("min_ratio", ["0", "0.97"])
def test_truncation_and_trailing_garbage_are_detected(monkeypatch, min_ratio):
    monkeypatch.setenv("CKPTSTORE_MIN_COMPRESS_RATIO", min_ratio)
    key, blob = codec.encode(torch.randn(40, 40))
    for damaged in (blob[:-1], blob[: len(blob) // 2], blob + b"\x00garbage"):
        with pytest.raises(CorruptError):
            codec.decode(damaged, key)


def test_a_zstd_frame_declaring_another_size_is_refused_before_it_is_decompressed():
    key, blob = codec.encode(torch.zeros(1000, dtype=torch.uint8))
    header = codec.parse_header(blob)
    assert header.codec == codec.ZSTD
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))  # 64 MiB of zeros in a few KiB
    with pytest.raises(CorruptError, match=f"declares {64 << 20} bytes, expected 1000"):
        codec.decode(blob[: header.header_size] + bomb, key)


def test_a_byte_plane_decompressing_to_another_size_is_detected():
    tensor = torch.zeros(4096, dtype=torch.float32)
    key, blob = codec.encode(tensor)
    header = codec.parse_header(blob)
    assert header.codec == codec.ZSTD_PLANES
    # the same planes, one element short: every frame now holds the wrong number of bytes
    _, short = codec.encode(torch.zeros(4095, dtype=torch.float32))
    with pytest.raises(CorruptError, match="expected 4096"):
        codec.decode(blob[: header.header_size] + short[codec.parse_header(short).header_size :], key)


def test_encoded_parts_laid_end_to_end_are_the_blob():
    tensor = torch.randn(128, 64)
    key, parts = codec.encode_parts(tensor)
    assert (key, b"".join(parts)) == codec.encode(tensor)
    assert len(parts) > 2  # header, then each byte plane's length and data, never joined


def test_a_blob_under_another_key_is_detected():
    key_a, _ = codec.encode(torch.ones(8))
    _, blob_b = codec.encode(torch.zeros(8))
    with pytest.raises(CorruptError, match="does not hash to its key"):
        codec.decode(blob_b, key_a)


def test_exotic_dtypes_are_refused():
    with pytest.raises(UnsupportedError):
        codec.encode(torch.zeros(2, dtype=torch.complex64))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash_the_parser(data):
    try:
        codec.decode(data)
    except CorruptError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_after_a_valid_header_never_crash(data):
    _, blob = codec.encode(torch.arange(4, dtype=torch.float32))
    header = codec.parse_header(blob)
    try:
        codec.decode(blob[: header.header_size] + data)
    except CorruptError:
        pass
