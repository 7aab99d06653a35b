"""The canonical rule of ``format.plainfile``: a pickle or torch file is kept as plain data at
commit and written out as ckptstore serializes it; bytes kept as they are go out only where no
unpickler can start on them. Nothing is filtered and nothing from a store is unpickled, so no
pickle flavour a store writer picks reaches a loader. How materialize applies it:
tests/test_auxfiles.py (files) and tests/test_dcp_store.py (DCP bytes items); RELIABILITY.md
scenarios 21, 26 and 27.
"""

from __future__ import annotations

import collections
import gzip
import io
import json
import pickle
import tarfile
import zipfile

import numpy as np
import pytest
import torch

from ckptstore.errors import CorruptError
from ckptstore.format import plainfile
from tests.test_auxfiles import RunsCode, code_running_pickle, rng_state, torch_saved

LIMIT = 1 << 20


def pickle_files() -> dict[str, bytes]:
    """Pickles and torch files of plain data, as the Trainer, accelerate and users write them."""
    return {
        "rng_state.pth": torch_saved(rng_state()),
        "custom_checkpoint_0.pkl": torch_saved({"weight": torch.ones(3), "step": 7, "name": "sched"}),
        "scheduler.pt": torch_saved({"last_epoch": 3, "_last_lr": [0.001], "base_lrs": [0.01]}),
        "legacy.pt": torch_saved({"weight": torch.ones(3)}, _use_new_zipfile_serialization=False),
        "numpy.pt": torch_saved({"scalar": np.float32(1.5), "array": np.arange(6).reshape(2, 3)}),
        **{
            f"plain{protocol}.pkl": pickle.dumps(
                {"lr": [1e-3, 2e-3], "names": ("a", "b"), "raw": b"\x00", "ids": {1, 2}, "on": True},
                protocol=protocol,
            )
            for protocol in range(pickle.HIGHEST_PROTOCOL + 1)
        },
        "ordered.pkl": pickle.dumps(collections.OrderedDict(a=1), protocol=2),
    }


def data_files() -> dict[str, bytes]:
    """Files no unpickler can start on: they go out as they are."""
    return {
        "config.json": b'{"hidden": 32}',
        "merges.txt": b"#version: 0.2\na b\n",
        "vocab.txt": b"[PAD]\n[UNK]\n",
        "tokenizer.model": b"\n\x0e\n\x05<unk>\x15\x00\x00\x00\x00",
        "noise.bin": bytes(range(256)) * 8,
        "empty": b"",
    }


def hostile_files(marker) -> dict[str, bytes]:
    """A payload that writes ``marker`` when unpickled, as every flavour of pickle we know."""
    payload = RunsCode(marker)
    script = torch.jit.script(torch.nn.ReLU())  # no parameters: a ZeRO-3 test may leave Linear patched
    torchscript = io.BytesIO()
    torch.jit.save(script, torchscript)
    tarred = io.BytesIO()
    with tarfile.open(fileobj=tarred, mode="w") as archive:
        member = pickle.dumps(payload, protocol=2)
        info = tarfile.TarInfo("storages")
        info.size = len(member)
        archive.addfile(info, io.BytesIO(member))
    extra = io.BytesIO(torch_saved({"w": torch.ones(2)}))
    with zipfile.ZipFile(extra, "a") as archive:  # a torch zip with one more record
        archive.writestr("archive/extra.pkl", pickle.dumps(payload))
    command = b"touch " + str(marker).encode()
    # The round-3 bypass: a legacy torch file whose fourth pickle starts with a "*Storage"
    # global of a module that cannot be imported, then reaches os.system.
    legacy_bypass = (
        pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)
        + pickle.dumps(1001, protocol=2)
        + pickle.dumps({}, protocol=2)
        + b"c!!\nFloatStorage\n0cos\nsystem\n(V"
        + command
        + b"\ntR."
    )
    return {
        **{f"protocol{p}.pkl": pickle.dumps(payload, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)},
        "zip.pt": code_running_pickle(marker),
        "legacy.pt": torch_saved({"m": payload}, _use_new_zipfile_serialization=False),
        "legacy-bypass.pt": legacy_bypass,
        "second.pkl": pickle.dumps(1) + pickle.dumps(payload, protocol=2),
        "nested.pt": torch_saved({"a": [{"b": (payload,)}]}),
        "os.txt": b"cos\nsystem\n(S'" + command + b"'\ntR.",
        "torchscript.pt": torchscript.getvalue(),
        "legacy.tar": tarred.getvalue(),
        "extra-record.pt": extra.getvalue(),
        "compressed.pkl.gz": gzip.compress(pickle.dumps(payload)),
    }


def same(a, b) -> bool:
    """Equal values, tensors and numpy arrays compared exactly, types kept."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (np.ndarray, np.generic)):
        return type(a) is type(b) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def load_any(data: bytes):
    """What a loader gets from ``data``: torch.load of a torch file, else pickle.load."""
    try:
        return torch.load(io.BytesIO(data), weights_only=False)
    except RuntimeError:  # a bare pickle: torch.load reads it as a legacy file's magic number
        return pickle.loads(data)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's, reading the protocol 5 one
def test_a_pickle_of_plain_data_is_kept_as_plain_data_and_goes_out_loading_to_the_same_value():
    for name, data in pickle_files().items():
        kept = plainfile.encode(data, LIMIT)
        assert kept.plain and plainfile.is_plain(kept.stored), name
        written = plainfile.decode(kept.stored, name)
        assert same(load_any(written), load_any(data)), name
        assert plainfile.encode(written, LIMIT).stored == kept.stored, name  # the same value, the same bytes


def test_data_files_are_kept_as_they_are_and_go_out_as_they_are():
    for name, data in data_files().items():
        kept = plainfile.encode(data, LIMIT)
        assert not kept.plain and kept.stored == data, name
        assert plainfile.opaque_refusal(data) is None, name


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
def test_no_pickle_flavour_that_reaches_code_is_kept_as_plain_data_or_goes_out_as_it_is(tmp_path):
    marker = tmp_path / "ran"
    for name, data in hostile_files(marker).items():
        kept = plainfile.encode(data, LIMIT)  # the commit's weights-only read runs nothing
        if (
            kept.plain
        ):  # what torch.load(weights_only=True) read of it (a zip's data.pkl, not its extra record)
            load_any(plainfile.decode(kept.stored, name))
        else:
            assert kept.stored == data and plainfile.opaque_refusal(data), name
    assert not marker.exists()


def test_what_goes_out_is_rebuilt_from_plain_data_whatever_the_stored_json_says(tmp_path):
    def stored(document) -> bytes:
        return plainfile.HEADER + json.dumps(document).encode()

    # A writer's plain data can only name the classes plain data allows.
    sneaky = {"kind": "pickle", "protocol": 2, "value": {"__object__": "os.system", "attrs": {}}}
    with pytest.raises(CorruptError, match="step 4's file x.pkl is corrupt: .*not allowed: os.system"):
        plainfile.decode(stored(sneaky), "step 4's file x.pkl")
    for document in (
        {"kind": "exec", "protocol": 2, "value": 1},
        {"kind": "pickle", "protocol": 99, "value": 1},
        {"kind": "torch", "protocol": "2", "value": 1},
        {"kind": "torch"},
        [1, 2],
    ):
        with pytest.raises(CorruptError, match="x is corrupt"):
            plainfile.decode(stored(document), "x")
    with pytest.raises(CorruptError, match="x is corrupt"):
        plainfile.decode(plainfile.HEADER + b"[" * 100_000, "x")
    # A few bytes cannot declare a big tensor or array: the shape must be what the bytes hold.
    for tag in ("__tensor__", "__ndarray__"):
        bomb = {"dtype": "float32" if tag == "__tensor__" else "<f4", "shape": [1 << 30], "data": ""}
        with pytest.raises(CorruptError, match="holds 0 bytes"):
            plainfile.decode(stored({"kind": "torch", "protocol": 2, "value": {tag: bomb}}), "x")
    bad = {"__ndarray__": {"dtype": "|O", "shape": [1], "data": "AAAAAAAAAAA="}}
    with pytest.raises(CorruptError, match="not numbers"):
        plainfile.decode(stored({"kind": "pickle", "protocol": 2, "value": bad}), "x")


def test_a_file_whose_plain_data_would_pass_the_bound_is_kept_as_it_is():
    data = torch_saved({"big": torch.zeros(4096)})
    assert plainfile.encode(data, LIMIT).plain
    assert not plainfile.encode(data, 1024).plain  # its 16 KiB tensor is past a 1 KiB bound
