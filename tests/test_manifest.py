"""Manifests round-trip and encode canonically; a newer manifest is refused as unsupported."""

import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.errors import CorruptError, UnsupportedError
from ckptstore.format import manifest
from ckptstore.format.layout import manifest_name
from ckptstore.model import BlobRow, FileRow, StepRecord, TensorRow


def example():
    return StepRecord(
        step=6, created_at="2026-01-01T00:00:00+00:00", world_size=2, description='{"a":1}',
        layer_sources={"embed": 4, "layers.0": 6},
        tensors=[TensorRow(6, "layers.0", "layers.0.w", "fp32", 0, 12, "ab" * 16)],
        blobs=[BlobRow("ab" * 16, 40, 48)],
    )  # fmt: skip


def test_manifest_round_trips():
    record = example()
    assert manifest.decode(manifest.encode(record)) == record


def test_format_1_manifests_are_pinned_and_still_decode():
    assert manifest.encode_v1(example()) == (
        b'{"blobs":[["' + b"ab" * 16 + b'",40,48]],"created_at":"2026-01-01T00:00:00+00:00",'
        b'"description":{"a":1},"layers":[["embed",4],["layers.0",6]],"step":6,'
        b'"tensors":[["layers.0","layers.0.w","fp32",0,12,"' + b"ab" * 16 + b'"]],"version":1,"world_size":2}'
    )
    assert manifest.decode(manifest.encode_v1(example())) == example()
    assert manifest_name(6) == "manifests/000000000006.json"


def with_packs():
    from ckptstore.format import layerpacks
    from ckptstore.model import PackRef

    index = layerpacks.build(
        6, "layers.0", [(PackRef("ef" * 16, 0, 90, 48), [("layers.0.w", "fp32", "float32", 0, 12)])]
    )
    # A pack index is held to the parameter shapes the description gives (tests/test_bombs.py).
    description = '{"params":{"layers.0.w":{"shape":[3,4]}}}'
    return dataclasses.replace(
        example(), description=description, tensors=[], blobs=[], packs={"layers.0": index}
    )


def test_a_format_2_manifest_round_trips_its_pack_indexes():
    record = with_packs()
    data = manifest.encode(record)
    assert data[:5] == b"CKPM\x02" and manifest.decode(data) == record
    assert manifest.encode(record) == data  # canonical


def test_a_damaged_format_2_manifest_is_corrupt():
    data = manifest.encode(with_packs())
    for damaged in (data[:-1], data[:20] + bytes([data[20] ^ 1]) + data[21:], data + b"x"):
        with pytest.raises(CorruptError):
            manifest.decode(damaged)


def test_inherited_rows_decode_with_their_source_step():
    record = dataclasses.replace(
        example(),
        tensors=[*example().tensors, TensorRow(4, "embed", "embed.w", "fp32", 0, 8, "cd" * 16)],
        blobs=[*example().blobs, BlobRow("cd" * 16, 30, 32)],
    )
    decoded = manifest.decode(manifest.encode(record))
    assert decoded == record
    assert decoded.tensors_by_source() == {6: [record.tensors[0]], 4: [record.tensors[1]]}
    assert decoded.layers_saved == ["layers.0"]


@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_corrupt(data):
    try:
        manifest.decode(data)
    except CorruptError:
        pass


def test_a_newer_manifest_version_is_refused_as_unsupported():
    data = manifest.encode(example())
    with pytest.raises(UnsupportedError, match="manifest has format version 4"):
        manifest.decode(data[:4] + b"\x04" + data[5:])
    # 3 is a tagged manifest: only a store with a key reads one, having checked its tag
    with pytest.raises(CorruptError, match="tagged manifest in a store without a key"):
        manifest.decode(data[:4] + b"\x03" + data[5:])
    json_v2 = manifest.encode_v1(example()).replace(b'"version":1', b'"version":2')
    with pytest.raises(UnsupportedError, match="manifest has format version 2"):
        manifest.decode(json_v2)


def test_a_manifest_without_a_version_is_corrupt():
    data = manifest.encode_v1(example()).replace(b'"version":1', b'"version":"one"')
    with pytest.raises(CorruptError, match="no valid format version"):
        manifest.decode(data)


def test_update_statistics_and_files_are_encoded_only_when_present():
    record = dataclasses.replace(
        example(),
        updates={"embed": (4, None), "layers.0": (4, 0.25)},
        files=[FileRow("config.json", "cd" * 16, 7)],
    )
    assert manifest.encode_v1(record) == (
        b'{"blobs":[["' + b"ab" * 16 + b'",40,48]],"created_at":"2026-01-01T00:00:00+00:00",'
        b'"description":{"a":1},"files":[["config.json","' + b"cd" * 16 + b'",7]],'
        b'"layers":[["embed",4],["layers.0",6]],"step":6,'
        b'"tensors":[["layers.0","layers.0.w","fp32",0,12,"' + b"ab" * 16 + b'"]],'
        b'"updates":[["embed",4,null],["layers.0",4,0.25]],"version":1,"world_size":2}'
    )
    assert manifest.decode(manifest.encode(record)) == record
    unmeasured = dataclasses.replace(example(), updates={"embed": (None, None)})
    assert manifest.encode(unmeasured) == manifest.encode(example())  # a first commit measures nothing


def test_metrics_and_the_weights_only_mark_round_trip_and_are_encoded_only_when_present():
    record = dataclasses.replace(example(), metrics={"eval_loss": 2.31, "diverged": None}, weights_only=True)
    assert manifest.decode(manifest.encode(record)) == record
    assert b'"metrics":[["diverged",null],["eval_loss",2.31]]' in manifest.encode_v1(record)
    assert b'"weights_only":true' in manifest.encode_v1(record)
    plain = manifest.encode_v1(example())
    assert b"metrics" not in plain and b"weights_only" not in plain


def test_a_queued_commits_stall_and_the_steps_it_did_not_commit_round_trip_and_are_checked():
    record = dataclasses.replace(example(), stall=0.0125, not_committed=[(3, "skipped"), (5, "replaced")])
    assert manifest.decode(manifest.encode(record)) == record
    assert b'"not_committed":[[3,"skipped"],[5,"replaced"]]' in manifest.encode_v1(record)
    assert b"stall" not in manifest.encode_v1(example())
    for bad in ([[6, "skipped"]], [[5, "lost"]], [[3, "skipped"], [2, "skipped"]], [["3", "skipped"]], "3"):
        data = manifest.encode_v1(record).replace(
            b'"not_committed":[[3,"skipped"],[5,"replaced"]]', b'"not_committed":' + json.dumps(bad).encode()
        )
        with pytest.raises(CorruptError, match="not_committed"):
            manifest.decode(data)
    with pytest.raises(CorruptError, match="stall is '-1'"):
        manifest.decode(manifest.encode_v1(record).replace(b'"stall":0.0125', b'"stall":-1'))


def test_a_deletion_record_round_trips_and_with_a_key_binds_its_name():
    from ckptstore.format import deletions
    from ckptstore.format.layout import deletions_name
    from ckptstore.hashing import PLAIN, ContentHash

    keyed, name = ContentHash.keyed(bytes(range(32))), deletions_name(3)
    deleted = {4: 0, 10**13: 7}
    for content_hash in (PLAIN, keyed):
        assert deletions.decode(deletions.encode(deleted, name, content_hash), content_hash, name) == deleted
    tagged = deletions.encode(deleted, name, keyed)
    with pytest.raises(CorruptError, match="not authentic"):
        deletions.decode(tagged, keyed, deletions_name(4))  # moved to another sequence number
    with pytest.raises(CorruptError, match="not authentic"):
        deletions.decode(deletions.encode(deleted, name, PLAIN), keyed, name)
    with pytest.raises(CorruptError, match="tagged"):
        deletions.decode(tagged, PLAIN, name)
    with pytest.raises(UnsupportedError):
        deletions.decode(b"CKPD\x09" + tagged[5:], PLAIN, name)
    bad = deletions.encode({}, name, PLAIN)[:5] + deletions.zstd.compressor().compress(
        b'{"deleted":[[1,true]]}'
    )
    with pytest.raises(CorruptError, match="malformed"):
        deletions.decode(bad, PLAIN, name)


def tensor_parallel(change=None) -> bytes:
    """A manifest of step 6 whose description is a two-way tensor-parallel step's (its shape
    as ``combine`` writes it), after ``change(description)``."""
    import json

    own = {"module_keys": [], "aliases": {}, "groups": [], "model_state": {}, "optimizer_state": {}}
    description = {
        "flavour": "zero12", "zero_stage": 1, "world_size": 1, "bf16": False, "module_keys": [], "aliases": {},
        "params": {"w": {"shape": [4, 6], "split": {"dim": 1, "sizes": [3, 3]}}, "b": {"shape": [4]}},
        "model_parallel": {"size": 2, "pipeline": False, "ranks": [
            {**own, "params": ["w", "b"], "model_parallel": {"rank": r, "size": 2, "pipeline": False, "slice": r}}
            for r in range(2)
        ]},
    }  # fmt: skip
    if change is not None:
        change(description)
    return manifest.encode(dataclasses.replace(example(), description=json.dumps(description)))


def _split(**values):
    return lambda d: d["params"]["w"]["split"].update(values)


def _part(**values):
    return lambda d: d["model_parallel"]["ranks"][1]["model_parallel"].update(values)


MALFORMED_MODEL_PARALLEL = {
    "dim past the shape": _split(dim=7),
    "negative dim": _split(dim=-1),
    "dim as text": _split(dim="0"),
    "dim true": _split(dim=True),
    "no sizes": _split(sizes=[]),
    "sizes not a list": _split(sizes=3),
    "a negative size": _split(sizes=[7, -1]),
    "a size as text": _split(sizes=[3, "3"]),
    "sizes not adding up": _split(sizes=[3, 4]),
    "split not an object": lambda d: d["params"]["w"].update(split=[1, [3, 3]]),
    "split without a shape": lambda d: d["params"]["w"].pop("shape"),
    "slice past the sizes": _part(slice=2),
    "slice negative": _part(slice=-1),
    "slice as text": _part(slice="1"),
    "rank out of order": _part(rank=0),
    "rank of another degree": _part(size=3),
    "degree zero": lambda d: d["model_parallel"].update(size=0),
    "degree as text": lambda d: d["model_parallel"].update(size="2"),
    "fewer ranks than the degree": lambda d: d["model_parallel"]["ranks"].pop(),
    "a rank holding an undescribed parameter": lambda d: d["model_parallel"]["ranks"][0]["params"].append(
        "x"
    ),
    "a layer file outside the folder": _part(layer_files=[["../../x-model_states.pt", []]]),
}


def test_a_tensor_parallel_manifest_decodes():
    import json

    record = manifest.decode(tensor_parallel())
    assert json.loads(record.description)["params"]["w"]["split"] == {"dim": 1, "sizes": [3, 3]}


@pytest.mark.parametrize("malformed", MALFORMED_MODEL_PARALLEL)
def test_a_manifest_with_a_malformed_model_parallel_value_is_corrupt_naming_its_step(malformed):
    with pytest.raises(CorruptError, match="step 6"):
        manifest.decode(tensor_parallel(MALFORMED_MODEL_PARALLEL[malformed]))
