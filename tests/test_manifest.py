"""Manifests round-trip and encode canonically."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.catalog import BlobRow, FileRow, TensorRow
from ckptstore.errors import CorruptError
from ckptstore.manifest import Manifest, manifest_name


def example():
    return Manifest(
        step=6, created_at="2026-01-01T00:00:00+00:00", world_size=2, description='{"a":1}',
        layer_sources={"embed": 4, "layers.0": 6},
        tensors=[TensorRow(6, "layers.0", "layers.0.w", "fp32", 0, 12, "ab" * 16)],
        blobs=[BlobRow("ab" * 16, 40, 48)],
    )  # fmt: skip


def test_manifest_round_trips():
    manifest = example()
    assert Manifest.decode(manifest.encode()) == manifest


def test_manifest_bytes_are_pinned():
    assert example().encode() == (
        b'{"blobs":[["' + b"ab" * 16 + b'",40,48]],"created_at":"2026-01-01T00:00:00+00:00",'
        b'"description":{"a":1},"layers":[["embed",4],["layers.0",6]],"step":6,'
        b'"tensors":[["layers.0","layers.0.w","fp32",0,12,"' + b"ab" * 16 + b'"]],"version":1,"world_size":2}'
    )
    assert manifest_name(6) == "manifests/000000000006.json"


@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_corrupt(data):
    try:
        Manifest.decode(data)
    except CorruptError:
        pass


def test_a_newer_manifest_version_is_refused():
    data = example().encode().replace(b'"version":1', b'"version":2')
    with pytest.raises(CorruptError, match="version 2"):
        Manifest.decode(data)


def test_update_statistics_and_files_are_encoded_only_when_present():
    manifest = dataclasses.replace(
        example(),
        updates={"embed": (4, None), "layers.0": (4, 0.25)},
        files=[FileRow("config.json", "cd" * 16, 7)],
    )
    assert manifest.encode() == (
        b'{"blobs":[["' + b"ab" * 16 + b'",40,48]],"created_at":"2026-01-01T00:00:00+00:00",'
        b'"description":{"a":1},"files":[["config.json","' + b"cd" * 16 + b'",7]],'
        b'"layers":[["embed",4],["layers.0",6]],"step":6,'
        b'"tensors":[["layers.0","layers.0.w","fp32",0,12,"' + b"ab" * 16 + b'"]],'
        b'"updates":[["embed",4,null],["layers.0",4,0.25]],"version":1,"world_size":2}'
    )
    assert Manifest.decode(manifest.encode()) == manifest
    unmeasured = dataclasses.replace(example(), updates={"embed": (None, None)})
    assert unmeasured.encode() == example().encode()  # a first commit measures nothing
