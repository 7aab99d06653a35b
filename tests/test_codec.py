"""The blob format: round trips, content keys, the pinned header, and corruption detection."""

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptstore.errors import CorruptError, UnsupportedError
from ckptstore.format import codec, planes

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


# Whole blobs, header (magic, version, codec byte, dtype, shape, size) and payload, for each codec.
GOLDEN = {
    "raw": (
        torch.tensor([1.5, -2.0, 0.25]),
        "11f37163befa1311021f55324b42dc5d",
        "434b5042010007666c6f617433320103000000000000000c000000000000000000c03f000000c00000803e",
    ),
    "zstd": (
        torch.zeros(64, dtype=torch.uint8),
        "356982a8a919d91923910f6ea7204bb1",
        "434b504201010575696e7438014000000000000000400000000000000028b52ffd20404500001000000100930016",
    ),
    "planes": (
        torch.ones(4, 16, dtype=torch.bfloat16),
        "40398121b5510d41aa768a9832e0ec27",
        "434b504201030862666c6f617431360204000000000000001000000000000000800000000000000001110000000000000028b52ffd"
        "2040450000108080010093001601110000000000000028b52ffd2040450000103f3f0100930016",
    ),
    # Byte-grouped in one zstd frame: no longer written, still read.
    "grouped": (
        torch.full((32,), 2.0, dtype=torch.float16),
        "3f99919ab99f07ffdb5e43fb9f6cfcea",
        "434b5042010207666c6f61743136012000000000000000400000000000000028b52ffd20405d0000180000400200a01122c002",
    ),
}
CODEC_BYTES = {
    "raw": codec.RAW,
    "zstd": codec.ZSTD,
    "planes": codec.ZSTD_PLANES,
    "grouped": codec.ZSTD_GROUPED,
}


@pytest.mark.parametrize("name", GOLDEN)
def test_whole_blob_bytes_are_pinned_for_each_codec(name):
    tensor, key, pinned = GOLDEN[name]
    blob = bytes.fromhex(pinned)
    assert codec.parse_header(blob).codec == CODEC_BYTES[name]
    if name != "grouped":
        assert codec.encode(tensor) == (key, blob)
    decoded = codec.decode(blob, key)
    assert decoded.dtype == tensor.dtype and torch.equal(decoded, tensor)


def test_a_blob_of_a_newer_format_version_is_refused_as_unsupported():
    _, _, pinned = GOLDEN["raw"]
    newer = bytearray.fromhex(pinned)
    newer[4] = 2
    with pytest.raises(UnsupportedError, match="blob has format version 2, written by a newer ckptstore"):
        codec.decode(bytes(newer))


@pytest.mark.parametrize("position", [0, 5, 10, -1, -100])
def test_a_flipped_byte_is_detected(position):
    tensor = torch.randn(64, 64)
    key, blob = codec.encode(tensor)
    damaged = bytearray(blob)
    damaged[position] ^= 0xFF
    with pytest.raises(CorruptError):
        codec.decode(bytes(damaged), key)


def test_a_flipped_version_byte_reads_as_a_newer_format_and_is_refused():
    # The version byte cannot tell a newer format from damage: either way the blob is refused.
    key, blob = codec.encode(torch.randn(64, 64))
    damaged = bytearray(blob)
    damaged[4] ^= 0xFF
    with pytest.raises(UnsupportedError, match="blob has format version 254"):
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


@pytest.mark.parametrize("name", GOLDEN)
def test_decode_into_fills_a_given_tensor_as_decode_would(name):
    tensor, key, pinned = GOLDEN[name]
    blob = bytes.fromhex(pinned)
    host = torch.full((tensor.numel() + 4,), -1, dtype=tensor.dtype)
    codec.decode_into(blob, key, host[2 : 2 + tensor.numel()])  # a slice of a bigger tensor
    assert torch.equal(host[2 : 2 + tensor.numel()], tensor.reshape(-1))
    assert (host[:2] == -1).all() and (host[-2:] == -1).all()
    with pytest.raises(CorruptError, match="does not fit"):
        codec.decode_into(blob, key, torch.empty(tensor.numel() + 1, dtype=tensor.dtype))
    with pytest.raises(CorruptError, match="does not hash"):
        codec.decode_into(blob, "0" * 32, torch.empty(tensor.numel(), dtype=tensor.dtype))


MULTIBYTE = [*(dtype for dtype in DTYPES if dtype.itemsize > 1), torch.int16]


def planes_of(blob: bytes) -> list[tuple[bool, bytes]]:
    """A ZSTD_PLANES blob's planes as the layout describes them: ``u8 compressed? u64 length data``."""
    header = codec.parse_header(blob)
    assert header.codec == codec.ZSTD_PLANES
    payload, planes = blob[header.header_size :], []
    while payload:
        compressed, length = payload[0], int.from_bytes(payload[1:9], "little")
        data = payload[9 : 9 + length]
        planes.append((bool(compressed), zstandard.decompress(data) if compressed else data))
        payload = payload[9 + length :]
    return planes


def with_planes(dtype: torch.dtype, count: int, noisy: set[int], seed: int = 0) -> torch.Tensor:
    """``count`` elements of ``dtype`` whose byte planes in ``noisy`` are random (stored raw) and
    the others nearly constant (compressed)."""
    itemsize = dtype.itemsize
    g = torch.Generator().manual_seed(seed)
    grid = torch.randint(0, 4, (count, itemsize), generator=g, dtype=torch.uint8)
    for i in noisy:
        grid[:, i] = torch.randint(0, 256, (count,), generator=g, dtype=torch.uint8)
    return grid.reshape(-1).view(dtype)


@pytest.mark.parametrize("dtype", MULTIBYTE)
@pytest.mark.parametrize("noisy", ["none", "low", "all but high", "all"])
def test_byte_planes_hold_each_element_byte_by_position_and_decode_bit_exact(dtype, noisy):
    itemsize = dtype.itemsize
    chosen = {
        "none": set(),
        "low": {0},
        "all but high": set(range(itemsize - 1)),
        "all": set(range(itemsize)),
    }
    tensor = with_planes(dtype, 3000, chosen[noisy])
    key, blob = codec.encode(tensor)
    if noisy == "all":  # nothing compresses: stored raw
        assert codec.parse_header(blob).codec == codec.RAW
    else:
        planes = planes_of(blob)
        grid = tensor.view(torch.uint8).reshape(-1, itemsize)
        assert [compressed for compressed, _ in planes] == [i not in chosen[noisy] for i in range(itemsize)]
        for i, (_, data) in enumerate(planes):
            assert data == grid[:, i].numpy().tobytes()  # plane i: byte i of every element, in memory order
    out = torch.full_like(tensor, 7)
    codec.decode_into(blob, key, out)
    assert torch.equal(out.view(torch.uint8), tensor.view(torch.uint8))
    assert torch.equal(codec.decode(blob, key).view(torch.uint8), tensor.view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(MULTIBYTE),
    data=st.binary(min_size=0, max_size=512),
    fill=st.integers(0, 255),
    every_plane_compressed=st.booleans(),
)
def test_every_bit_pattern_round_trips_through_byte_planes(dtype, data, fill, every_plane_compressed):
    # NaNs of every payload, -0.0, subnormals: decoding gives back the bytes, not just equal values.
    itemsize = dtype.itemsize
    count = (len(data) // itemsize + 64) // 2 * 2
    raw = bytearray(data[: count * itemsize].ljust(count * itemsize, bytes([fill])))
    tensor = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(2, -1).T  # not contiguous
    ratio = "1000" if every_plane_compressed else "0.97"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CKPTSTORE_MIN_COMPRESS_RATIO", ratio)
        key, blob = codec.encode(tensor)
    if every_plane_compressed:
        assert all(compressed for compressed, _ in planes_of(blob))
    out = torch.empty(tensor.shape, dtype=dtype)
    codec.decode_into(blob, key, out)
    assert torch.equal(out.view(torch.uint8), tensor.contiguous().view(torch.uint8))
    wrong = tensor.contiguous().clone()
    wrong.view(torch.uint8).view(-1)[0] ^= 1
    with pytest.raises(CorruptError, match="does not hash to its key"):
        codec.decode_into(blob, codec.tensor_key(wrong), out)


def awkward_floats(n: int) -> torch.Tensor:
    """``n`` fp32 values with every case a rounding can get wrong: ties, subnormals, infinities,
    NaNs of several payloads and both signs, signed zeros, values past the half and bf16 ranges."""
    torch.manual_seed(0)
    values = torch.randn(n) * torch.logspace(-45, 38, n).clamp(max=3e38)
    special = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-40, 65504.0, 7e4, 3.4e38]
    )
    values[: len(special)] = special
    nans = torch.tensor([0x7FC00000, 0xFFC00001 - (1 << 32), 0x7F800001, 0x7FFFFFFF, 0xFF80FFFF - (1 << 32)])
    values[20:25] = nans.to(torch.int32).view(torch.float32)
    ties = torch.arange(1000, dtype=torch.int32) << 16 | 0x8000  # exactly halfway between bf16 values
    values[100:1100] = ties.view(torch.float32)
    return values


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("target", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("min_ratio", ["0", "0.97", "1000"])  # RAW, planes some compressed, all
def test_decode_into_another_floating_dtype_casts_as_tensor_to(monkeypatch, stored, target, min_ratio):
    # Past several of the chunks planes are joined and cast in, and not a whole number of them.
    monkeypatch.setenv("CKPTSTORE_MIN_COMPRESS_RATIO", min_ratio)
    tensor = awkward_floats(2 * planes.CHUNK + 12_346).to(stored).reshape(-1, 2)
    key, blob = codec.encode(tensor)
    out = torch.empty(tensor.shape, dtype=target)
    codec.decode_into(blob, key, out)
    assert torch.equal(out.view(torch.uint8), tensor.to(target).view(torch.uint8))
    wrong = tensor.clone()
    wrong.view(-1)[-1] = 1.0  # in the last chunk: the key is checked over every stored byte
    with pytest.raises(CorruptError, match="does not hash to its key"):
        codec.decode_into(blob, codec.tensor_key(wrong), out)


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("target", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("min_ratio", ["0", "0.97", "1000"])  # RAW, planes some compressed, all
def test_decode_pieces_hands_out_the_tensor_in_order_in_reused_memory(monkeypatch, stored, target, min_ratio):
    monkeypatch.setenv("CKPTSTORE_MIN_COMPRESS_RATIO", min_ratio)
    monkeypatch.setattr(planes, "PIECE", planes.CHUNK + 1000)  # pieces across chunks, the last a part
    tensor = awkward_floats(3 * planes.CHUNK + 12_346).to(stored).reshape(-1, 2)
    key, blob = codec.encode(tensor)
    raw_size = tensor.numel() * stored.itemsize
    starts, pieces, memory = [], [], set()
    with planes.kept_memory():
        for start, piece in codec.decode_pieces(blob, key, target, raw_size):
            starts.append(start)
            pieces.append(piece.clone())
            memory.add(piece.data_ptr())
    assert torch.equal(torch.cat(pieces).view(torch.uint8), tensor.reshape(-1).to(target).view(torch.uint8))
    streamed = codec.parse_header(blob).codec == codec.ZSTD_PLANES  # else decoded whole, one piece
    if streamed:
        assert starts == list(range(0, tensor.numel(), planes.PIECE)) and len(memory) == 1
    wrong = tensor.clone()
    wrong.view(-1)[-1] = 1.0  # in the last piece: checked once every piece is out
    handed_out = 0
    with pytest.raises(CorruptError, match="does not hash to its key"):
        for _ in codec.decode_pieces(blob, codec.tensor_key(wrong), target, raw_size):
            handed_out += 1
    assert handed_out == (len(starts) if streamed else 0)
    with pytest.raises(CorruptError, match="referrer records"):  # before any piece
        next(codec.decode_pieces(blob, key, target, raw_size - stored.itemsize))
    with pytest.raises(CorruptError, match="cannot be decoded as"):
        next(codec.decode_pieces(blob, key, torch.int32, raw_size))


def test_decode_pieces_keeps_its_memory_for_the_next_decode_only_while_asked_to():
    key, blob = codec.encode(torch.randn(5000))
    with planes.kept_memory():
        first = [piece.data_ptr() for _, piece in codec.decode_pieces(blob, key, torch.bfloat16)]
        again = [piece.data_ptr() for _, piece in codec.decode_pieces(blob, key, torch.bfloat16)]
        assert first == again and planes._kits  # the same memory, not fresh pages
    assert not planes._kits  # released with the block: nothing held once an export is over


@pytest.mark.parametrize("held", [-1, +1])
def test_decode_pieces_detects_a_byte_plane_of_another_size_without_a_declared_one(monkeypatch, held):
    monkeypatch.setattr(planes, "PIECE", 1000)
    tensor = torch.zeros(4096, dtype=torch.float32)
    key, blob = codec.encode(tensor)
    header = codec.parse_header(blob)
    payload = bytes(blob[header.header_size :])
    length = int.from_bytes(payload[1:9], "little")
    assert payload[0]  # compressed: its frame declares 4096 bytes, this one nothing
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(4096 + held))
    payload = b"\x01" + len(frame).to_bytes(8, "little") + frame + payload[9 + length :]
    with pytest.raises(CorruptError, match="zstd frame holds"):
        list(codec.decode_pieces(bytes(blob[: header.header_size]) + payload, key, torch.float32))


def test_decode_into_casts_only_between_floating_dtypes():
    key, blob = codec.encode(torch.arange(10, dtype=torch.int32))
    with pytest.raises(CorruptError, match="does not fit"):
        codec.decode_into(blob, key, torch.empty(10, dtype=torch.int64))
    key, blob = codec.encode(torch.randn(10))
    with pytest.raises(CorruptError, match="does not fit"):
        codec.decode_into(blob, key, torch.empty(10, dtype=torch.int32))


def test_a_byte_plane_with_more_after_its_frame_is_detected():
    tensor = torch.zeros(4096, dtype=torch.float32)
    key, blob = codec.encode(tensor)
    header = codec.parse_header(blob)
    payload = bytearray(blob[header.header_size :])
    compressed, length = payload[0], int.from_bytes(payload[1:9], "little")
    assert compressed
    for extra in (b"\x00garbage", zstandard.ZstdCompressor().compress(b"more")):
        grown = payload[:1] + (length + len(extra)).to_bytes(8, "little") + payload[9 : 9 + length] + extra
        tampered = bytes(blob[: header.header_size] + grown + payload[9 + length :])
        with pytest.raises(CorruptError):
            codec.decode(tampered, key)
        with pytest.raises(CorruptError):
            list(codec.decode_pieces(tampered, key, torch.float32))
