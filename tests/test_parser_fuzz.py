"""The parsers of what a store holds (blob, pack index, layer index, manifest, inline state)
answer any bytes with a value or a ckptstore error: never another exception, never a hang,
never an allocation of what the bytes merely declare (issue 28, acceptance 5).

Inputs are arbitrary bytes and valid objects mutated two ways: raw bytes (flips, cuts,
insertions, copied runs, a little-endian integer overwritten with a huge one) and, for the
zstd-framed ones, the decompressed payload mutated the same way and framed again, so that the
mutations reach the JSON, counts and offsets behind the frame. The memory bound is measured in
a fresh interpreter, whose peak RSS before the fuzzing is its baseline.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.errors import CkptStoreError, CorruptError
from ckptstore.format import codec, layerpacks, manifest, pack, plainstate
from ckptstore.model import PackRef, StepRecord

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("CKPTSTORE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,  # a hang is caught by the subprocess's timeout, not by a flaky per-example clock
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PARAMS = {"layers.0.w": [6, 4], "layers.0.b": [6]}
DESCRIPTION = json.dumps({"params": {name: {"shape": shape} for name, shape in PARAMS.items()}})
NUMELS = layerpacks.numels(DESCRIPTION)


def a_blob() -> bytes:
    return codec.encode(torch.arange(24, dtype=torch.float32).reshape(6, 4))[1]


def a_pack() -> tuple[bytes, str]:
    key, parts, _ = pack.encode_parts(
        [
            ("layers.0.w", "fp32", 0, torch.arange(12, dtype=torch.float32)),
            ("layers.0.b", "fp32", 0, torch.ones(6, dtype=torch.bfloat16)),
        ]
    )
    return b"".join(bytes(p) for p in parts), key


def an_index() -> layerpacks.LayerPacks:
    entries = [("layers.0.w", "fp32", "float32", 0, 12), ("layers.0.b", "fp32", "float32", 0, 6)]
    return layerpacks.build(
        4,
        "layers.0",
        [
            (PackRef("ab" * 16, 0, 200, 72), entries),
            (PackRef("cd" * 16, 1, 150, 48), [("layers.0.w", "fp32", "float32", 12, 12)]),
        ],
    )


def a_manifest() -> bytes:
    record = StepRecord(
        step=4, created_at="2026-01-01T00:00:00+00:00", world_size=2, description=DESCRIPTION,
        layer_sources={"layers.0": 4}, tensors=[], blobs=[], packs={"layers.0": an_index()},
    )  # fmt: skip
    return manifest.encode(record)


def inline_state() -> bytes:
    state = {"step": 3, "betas": (0.9, 0.95), "t": torch.arange(5, dtype=torch.int64)}
    return json.dumps(plainstate.to_plain(state)).encode()


# -- mutations -------------------------------------------------------------------------------

HUGE = [1 << 31, (1 << 32) - 1, 1 << 40, (1 << 63) - 1, 1 << 30]


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` with one to four mutations."""
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        match draw(st.sampled_from(["flip", "cut", "insert", "repeat", "huge"])):
            case "flip" if data:
                data[at] ^= 1 << draw(st.integers(0, 7))
            case "cut":
                data = data[:at] if draw(st.booleans()) else data[:at] + data[at + draw(st.integers(1, 16)) :]
            case "insert":
                data[at:at] = draw(st.binary(min_size=1, max_size=16))
            case "repeat":
                data[at:at] = data[at : at + draw(st.integers(1, 64))] * draw(st.integers(1, 8))
            case "huge":
                width = draw(st.sampled_from([4, 8]))
                data[at : at + width] = draw(st.sampled_from(HUGE)).to_bytes(8, "little")[:width]
    return bytes(data)


def reframed(prefix_size: int, data: bytes) -> st.SearchStrategy[bytes]:
    """``data`` (``prefix_size`` plain bytes, then one zstd frame) with its payload mutated."""
    prefix = data[:prefix_size]
    payload = zstandard.ZstdDecompressor().decompress(data[prefix_size:])
    frame = zstandard.ZstdCompressor(write_checksum=True).compress
    return mutated(payload).map(lambda body: prefix + frame(body))


def either(prefix_size: int | None, data: bytes) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, ``data`` mutated, and for a framed object its payload mutated."""
    strategies = [st.binary(max_size=400), mutated(data)]
    if prefix_size is not None:
        strategies.append(reframed(prefix_size, data))
    return st.one_of(strategies)


def answers_or_refuses(parse: Callable[[], object]) -> None:
    try:
        parse()
    except CkptStoreError as exc:
        assert len(str(exc)) < 400, str(exc)  # one line, whatever the object quotes


# -- the parsers -------------------------------------------------------------------------------


@FUZZ
@given(either(None, a_blob()), st.sampled_from([None, 96]))
def test_blob(data, raw_size):
    answers_or_refuses(lambda: codec.decode(data, None, raw_size))
    answers_or_refuses(lambda: list(codec.decode_pieces(data, None, torch.bfloat16, raw_size)))


@FUZZ
@given(either(None, a_pack()[0]))
def test_pack(data):
    size = len(a_pack()[0])  # what the layer index records for it
    answers_or_refuses(lambda: pack.decode(data, None, 60))  # 12 fp32 + 6 bf16
    answers_or_refuses(lambda: pack.parse_index(data, None, size))


@FUZZ
@given(either(layerpacks._PREAMBLE.size, layerpacks.encode(an_index())))
def test_layer_index(data):
    answers_or_refuses(lambda: layerpacks.decode(data, 4, "layers.0", NUMELS))


@FUZZ
@given(either(5, a_manifest()))
def test_manifest(data):
    answers_or_refuses(lambda: manifest.decode(data))


@FUZZ
@given(either(None, inline_state()))
def test_inline_state(data):
    answers_or_refuses(lambda: plainstate.loads(data.decode("utf-8", "replace")))


def test_valid_objects_parse():
    """The seeds themselves are valid: the mutations start from real objects."""
    assert codec.decode(a_blob()).shape == (6, 4)
    assert len(pack.decode(*a_pack())) == 2
    assert layerpacks.decode(layerpacks.encode(an_index()), 4, "layers.0", NUMELS) == an_index()
    assert manifest.decode(a_manifest()).packs["layers.0"] == an_index()
    assert torch.equal(plainstate.from_plain(json.loads(inline_state()))["t"], torch.arange(5))


_FUZZ_ALL = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
from tests import test_parser_fuzz as fuzz
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
fuzz.test_valid_objects_parse()
before = peak()
for test in (fuzz.test_blob, fuzz.test_pack, fuzz.test_layer_index, fuzz.test_manifest, fuzz.test_inline_state):
    test()
print(json.dumps({"grown_kb": peak() - before}))
"""


def test_fuzzing_every_parser_stays_within_100_mb_and_finishes():
    env = {**os.environ, "CKPTSTORE_FUZZ_EXAMPLES": str(EXAMPLES)}
    done = subprocess.run(
        [sys.executable, "-c", _FUZZ_ALL, str(ROOT)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    grown = json.loads(done.stdout.strip().splitlines()[-1])["grown_kb"]
    assert grown < 100 * 1024, f"peak RSS grew {grown} KB while fuzzing"


def test_a_declared_size_alone_never_allocates():
    """The huge-integer mutation at the places sizes live, spelled out once each."""
    blob = a_blob()
    info = codec.parse_header(blob)
    tampered = codec.header(codec.ZSTD, "float32", (1 << 28,), 1 << 30) + blob[info.header_size :]
    with pytest.raises(CorruptError, match="declares 1073741824 bytes, its referrer records 96"):
        codec.decode(tampered, None, 96)
    data, _ = a_pack()
    preamble = pack.PREAMBLE.pack(pack.MAGIC, 1, 1 << 26)
    with pytest.raises(CorruptError, match="does not fit the pack's recorded"):
        pack.parse_index(preamble + data[pack.PREAMBLE.size :], None, len(data))
    head = json.dumps({"tensors": [["layers.0.w", "fp32", "float32"]], "packs": 1, "fragments": 1 << 40})
    body = struct.pack("<I", len(head)) + head.encode() + np.zeros(8, np.int64).tobytes()
    index = layerpacks.MAGIC + b"\x01" + zstandard.ZstdCompressor().compress(body)
    with pytest.raises(CorruptError, match="have room for 24"):
        layerpacks.decode(index, 4, "layers.0", NUMELS)


def test_nesting_deeper_than_the_interpreter_stack_is_corrupt_not_a_crash():
    deep = "[" * 100_000
    for parse in (
        lambda: plainstate.loads(deep),
        lambda: plainstate.loads('{"a":' * 5000 + "1" + "}" * 5000),
        lambda: pack.parse_index(pack.PREAMBLE.pack(pack.MAGIC, 1, len(deep)) + deep.encode()),
        lambda: manifest.decode(deep.encode()),
        lambda: manifest.decode(
            b"CKPM\x02" + zstandard.ZstdCompressor().compress(struct.pack("<I", len(deep)) + deep.encode())
        ),
    ):
        with pytest.raises(CorruptError):
            parse()
