"""Allocation bombs (issue 28): a stored object that declares more than its referrer records is
refused as corrupt before anything is allocated for it, whichever command reads it.

Each bomb is a few tens of KB written straight into a copy of a small local store: a pack entry
whose blob header declares 1 GiB (a real zstd frame of zeros), a pack preamble declaring a
64 MiB index, a layer index declaring 1 GiB of fragments (in the manifest and the catalog), a
manifest decompressing to 1 GiB, and an inline state tensor declaring 1 GiB with no bytes.
Every read runs in a process of its own (tests/bomb_probe.py) that compares its peak RSS before
and after the read.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import shutil
import sqlite3
import struct
from pathlib import Path

import pytest
import zstandard

import ckptstore
from ckptstore.errors import CorruptError
from ckptstore.format import codec, layerpacks, manifest, pack
from ckptstore.format.layout import manifest_name, pack_name
from tests import bomb_probe
from tools.engines import batches, build_engine, free_port, train

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MAX_GROWTH_KB = 100 * 1024
ENGINE = {"model": "gpt2", "zero_stage": 1, "dtype": "bf16", "seed": 0, "num_layers": 2}
STEP = 2


@pytest.fixture(scope="module")
def readers():
    """Where each read runs: a child forked, per read, from a server process that imported
    tests/bomb_probe.py (and so torch, DeepSpeed and ckptstore) once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.bomb_probe"])
    with context.Pool(1, maxtasksperchild=1) as pool:
        yield pool


def probe(readers, store: Path, *command: str) -> dict:
    """Run ``command`` (CLI arguments, or ``restore``) on ``store`` in a process of its own, measured."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "CKPTSTORE_CPU_THREADS": "2"}
    env["MASTER_PORT"] = str(free_port())  # this process's engine holds the inherited one
    return readers.apply_async(bomb_probe.read, (str(store), list(command), env)).get(timeout=300)


@functools.cache
def zeros_frame(size: int, byte: bytes = b"\0") -> bytes:
    """One zstd frame declaring and holding ``size`` copies of ``byte``: a few tens of KB."""
    out = zstandard.ZstdCompressor(level=3).compressobj(size=size)
    chunk = byte * (1 << 24)
    parts = [out.compress(chunk) for _ in range(size // len(chunk))]
    return b"".join([*parts, out.compress(byte * (size % len(chunk))), out.flush()])


@pytest.fixture(scope="module")
def clean_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("bombs") / "store"
    engine = build_engine(**ENGINE)
    train(engine, batches(2))
    store = ckptstore.open(root)
    store.commit(engine, step=STEP)
    store.close()
    return root


def first_pack(root: Path) -> tuple[Path, layerpacks.PackRef]:
    store = ckptstore.open(root, create=False)
    index = max(store.catalog.layer_packs(STEP), key=lambda i: i.layer)
    store.close()
    ref = index.packs[0]
    return root / pack_name(ref.key), ref


def blob_header_bomb(root: Path) -> None:
    """A pack whose first entry's blob header declares 1 GiB of float32 zeros (and holds them)."""
    path, ref = first_pack(root)
    data = path.read_bytes()
    entries = pack.parse_index(data, ref.key)
    bomb = codec.header(codec.ZSTD, "float32", (GIB // 4,), GIB) + zeros_frame(GIB)
    items = [(e.name, e.kind, e.start, e.key, [data[e.offset : e.offset + e.length]]) for e in entries]
    items[0] = (*items[0][:4], [bomb])
    key, parts, _ = pack.assemble(items)
    assert key == ref.key  # a pack's key is its contents' keys: the bomb keeps the name
    path.write_bytes(b"".join(bytes(p) for p in parts))


def pack_index_bomb(root: Path) -> None:
    """A pack whose preamble declares a 64 MiB index, followed by 33 KB of index-looking bytes."""
    path, _ = first_pack(root)
    path.write_bytes(pack.PREAMBLE.pack(pack.MAGIC, 1, pack.MAX_INDEX_BYTES) + b"[" * 33000)


def layer_index_bytes() -> bytes:
    """A layer index whose head declares 1 GiB of fragments, all of them stored (zeros)."""
    m = GIB // 32
    head = json.dumps({"tensors": [["x", "fp32", "float32"]], "packs": 0, "fragments": m}).encode()
    prefix = struct.pack("<I", len(head)) + head
    out = zstandard.ZstdCompressor(level=3, write_checksum=True).compressobj(size=len(prefix) + 32 * m)
    body = out.compress(prefix) + zeros_frame_body(out, 32 * m)
    return layerpacks.MAGIC + b"\x01" + body


def zeros_frame_body(out, size: int) -> bytes:
    chunk = b"\0" * (1 << 24)
    return b"".join([out.compress(chunk) for _ in range(size // len(chunk))]) + out.compress(
        b"\0" * (size % len(chunk))
    ) + out.flush()  # fmt: skip


def rewrite_manifest(root: Path, change) -> None:
    """Re-encode step STEP's manifest after ``change(record)`` (a StepRecord, changed in place)."""
    path = root / manifest_name(STEP)
    record = manifest.decode(path.read_bytes())
    record = change(record) or record
    path.write_bytes(manifest.encode(record))


def layer_index_bomb(root: Path) -> None:
    """The layer index bomb in the manifest (what rebuild and import read) and in the catalog
    row (what materialize, export, restore and verify read)."""
    bomb = layer_index_bytes()
    path = root / manifest_name(STEP)
    record = manifest.decode(path.read_bytes())
    layer = sorted(record.packs)[-1]
    data = path.read_bytes()
    # Splice the bomb in place of the layer's encoded index: manifest.encode would re-encode it.
    payload = zstandard.ZstdDecompressor().decompress(data[5:])
    (length,) = struct.unpack_from("<I", payload)
    body = json.loads(payload[4 : 4 + length])
    indexes, position, parts = payload[4 + length :], 0, []
    for entry in body["packs"]:
        chunk = indexes[position : position + entry[2]]
        position += entry[2]
        if entry[0] == layer:
            chunk, entry[2] = bomb, len(bomb)
        parts.append(chunk)
    text = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    payload = struct.pack("<I", len(text)) + text + b"".join(parts)
    path.write_bytes(data[:5] + zstandard.ZstdCompressor(level=9, write_checksum=True).compress(payload))
    with sqlite3.connect(root / "catalog.db") as db:
        db.execute("UPDATE layer_packs SET packs = ? WHERE step = ? AND layer = ?", [bomb, STEP, layer])


def manifest_bomb(root: Path) -> None:
    """A manifest whose JSON body ends in 1 GiB of (valid JSON) blanks: 33 KB stored."""
    path = root / manifest_name(STEP)
    data = path.read_bytes()
    payload = zstandard.ZstdDecompressor().decompress(data[5:])
    (length,) = struct.unpack_from("<I", payload)
    body, indexes = payload[4 : 4 + length], payload[4 + length :]
    total = 4 + length + GIB + len(indexes)
    out = zstandard.ZstdCompressor(level=3, write_checksum=True).compressobj(size=total)
    head = out.compress(struct.pack("<I", length + GIB) + body)
    chunk = b" " * (1 << 24)
    middle = b"".join(out.compress(chunk) for _ in range(GIB // len(chunk)))
    path.write_bytes(data[:5] + head + middle + out.compress(indexes) + out.flush())


def inline_tensor_bomb(root: Path) -> None:
    """Non-tensor state holding a 1 GiB float32 tensor with no bytes (in manifest and catalog)."""
    tensor = {"__tensor__": {"dtype": "float32", "shape": [GIB // 4], "data": ""}}
    description = None

    def change(record):
        nonlocal description
        d = json.loads(record.description)
        d["optimizer_state"]["bomb"] = tensor
        description = json.dumps(d, sort_keys=True, separators=(",", ":"))
        import dataclasses

        return dataclasses.replace(record, description=description)

    rewrite_manifest(root, change)
    with sqlite3.connect(root / "catalog.db") as db:
        db.execute("UPDATE steps SET description = ? WHERE step = ?", [description, STEP])


def without_catalog(bomb):
    """``bomb``, then the catalog lost: every command must read the manifest to list the step."""

    def planted(root: Path) -> None:
        bomb(root)
        (root / "catalog.db").unlink()

    return planted


BOMBS = {
    "blob header": (blob_header_bomb, ["materialize", "export", "verify", "restore"]),
    "pack index": (pack_index_bomb, ["materialize", "export", "verify", "restore"]),
    "layer index": (layer_index_bomb, ["materialize", "export", "verify", "restore", "catalog rebuild"]),
    "layer index, catalog lost": (without_catalog(layer_index_bomb), ["log", "verify", "materialize"]),
    "manifest": (manifest_bomb, ["verify", "catalog rebuild"]),
    "manifest, catalog lost": (without_catalog(manifest_bomb), ["log", "verify", "materialize"]),
    "inline tensor": (inline_tensor_bomb, ["materialize", "restore"]),
}
CASES = [(bomb, command) for bomb, (_, commands) in BOMBS.items() for command in commands]
# verify and catalog rebuild report what they cannot read against its step and exit 1
REPORTING = {"verify", "catalog rebuild"}


def command_line(command: str, tmp_path: Path) -> list[str]:
    if command == "restore":
        return ["restore", json.dumps(ENGINE), str(STEP)]
    if command in ("materialize", "export"):
        return [command, "--step", str(STEP), str(tmp_path / "out")]
    return command.split()


@pytest.mark.parametrize(("bomb", "command"), CASES, ids=[f"{b}-{c}" for b, c in CASES])
def test_a_bomb_is_refused_as_corrupt_without_allocating_what_it_declares(
    clean_store, readers, tmp_path, bomb, command
):
    root = tmp_path / "store"
    shutil.copytree(clean_store, root)
    BOMBS[bomb][0](root)
    result = probe(readers, root, *command_line(command, tmp_path))
    assert result["grown_kb"] < MAX_GROWTH_KB, result
    assert "Traceback" not in result["out"], result
    if command in REPORTING:
        assert result["rc"] == 1 and "problem" in result["out"], result
    else:
        assert result["rc"] == CorruptError.exit_code, result
    assert all(len(line) < 400 for line in result["out"].splitlines()), result
    assert not (tmp_path / "out").exists() or command not in ("materialize", "export")


def test_the_clean_store_reads_within_the_same_bound(clean_store, readers, tmp_path):
    """The measurement itself: every command on the unbombed store exits 0 within the bound."""
    for command in ("materialize", "export", "verify", "restore", "log", "catalog rebuild"):
        root = tmp_path / command.replace(" ", "-") / "store"
        shutil.copytree(clean_store, root)
        result = probe(readers, root, *command_line(command, root.parent))
        assert result["rc"] == 0 and result["grown_kb"] < MAX_GROWTH_KB, (command, result)


def test_recoverys_check_of_a_bomb_pack_from_a_peer_allocates_no_more_than_of_the_honest_pack(
    clean_store, readers, tmp_path
):
    """A peer sends 1 GiB of declared zeros under a real pack's name (its key covers the index,
    not the entries' headers): the check holds them to the catalog's sizes before decompressing."""
    honest, ref = first_pack(clean_store)
    root = tmp_path / "store"
    shutil.copytree(clean_store, root)
    blob_header_bomb(root)
    bomb = root / pack_name(ref.key)
    assert bomb.stat().st_size < 128 * 1024
    name, step = pack_name(ref.key), str(STEP)
    checked = probe(readers, clean_store, "intact", name, str(honest), step)
    refused = probe(readers, clean_store, "intact", name, str(bomb), step)
    assert checked["rc"] == 0, checked
    assert refused["rc"] == CorruptError.exit_code and "its referrer records" in refused["out"], refused
    assert refused["grown_kb"] < checked["grown_kb"] + MAX_GROWTH_KB, (checked, refused)


# 32 bytes that the weights-only unpickler's allowlist would turn into 3 GiB: bytearray(3 << 30).
PICKLE_BOMB = b"\x80\x02cbuiltins\nbytearray\n\x8a\x05\x00\x00\x00\xc0\x00\x85R."


def planted_file(root: Path, name: str, data: bytes) -> None:
    """A store writer's auxiliary file of step STEP: the object and its row in the manifest
    (the catalog is then rebuilt from the manifests at the next open)."""
    import dataclasses

    from ckptstore import auxfiles
    from ckptstore.format.layout import file_name
    from ckptstore.model import FileRow

    key = auxfiles.file_key(data)
    (root / file_name(key)).parent.mkdir(parents=True, exist_ok=True)
    (root / file_name(key)).write_bytes(data)
    row = FileRow(name, key, len(data))
    rewrite_manifest(root, lambda record: dataclasses.replace(record, files=[*record.files, row]))
    (root / "catalog.db").unlink()


@pytest.mark.parametrize("command", ["materialize", "verify"])
def test_a_32_byte_pickle_bomb_file_is_left_out_without_building_anything(
    clean_store, readers, tmp_path, command
):
    assert len(PICKLE_BOMB) <= 32
    root = tmp_path / "store"
    shutil.copytree(clean_store, root)
    planted_file(root, "custom_checkpoint_0.pkl", PICKLE_BOMB)
    result = probe(readers, root, *command_line(command, tmp_path))
    assert result["rc"] == 0 and result["grown_kb"] < MAX_GROWTH_KB, result
    if command == "materialize":
        assert "custom_checkpoint_0.pkl" in result["out"] and "left out" in result["out"], result
        assert not (tmp_path / "out" / "custom_checkpoint_0.pkl").exists()


def test_plain_data_declaring_a_gigabyte_tensor_is_corrupt_without_allocating_it(
    clean_store, readers, tmp_path
):
    from ckptstore.format import plainfile

    value = {"__tensor__": {"dtype": "float32", "shape": [GIB // 4], "data": ""}}
    data = plainfile.HEADER + json.dumps({"kind": "torch", "protocol": 2, "value": value}).encode()
    root = tmp_path / "store"
    shutil.copytree(clean_store, root)
    planted_file(root, "scheduler.pt", data)
    for command in ("materialize", "verify"):
        result = probe(readers, root, *command_line(command, tmp_path))
        assert result["grown_kb"] < MAX_GROWTH_KB, result
        assert result["rc"] == (CorruptError.exit_code if command == "materialize" else 1), result
        assert "scheduler.pt" in result["out"], result


@pytest.mark.parametrize("bomb", ["manifest", "layer index"])
def test_on_s3_a_bombed_manifest_stops_log_without_allocating(clean_store, readers, tmp_path, s3, bomb):
    """On S3 every reader imports manifests into its cache: ``log`` of a fresh cache reads them."""
    root = tmp_path / "store"
    shutil.copytree(clean_store, root)
    BOMBS[bomb][0](root)
    for path in root.rglob("*"):
        if path.is_file() and not path.name.startswith("catalog.db"):
            s3.client.upload_file(str(path), s3.bucket, f"run/{path.relative_to(root).as_posix()}")
    result = probe(readers, s3.uri(), "log")
    assert result["grown_kb"] < MAX_GROWTH_KB, result
    assert (
        result["rc"] == CorruptError.exit_code and "step 2 is committed but cannot be read" in result["out"]
    )
