"""The content rule of ``format.pickled``: bytes a store hands out are judged by what a loader
would do with them, never by their name, and without running them. Data files, and pickles of
plain data or of what ``torch.load(weights_only=True)`` allows (tensors, numpy arrays of
numbers), go out; a pickle or torch archive that reaches anything else is refused. How
materialize and verify apply it: tests/test_auxfiles.py (files) and tests/test_dcp_store.py
(DCP bytes items); RELIABILITY.md scenario 21.
"""

from __future__ import annotations

import collections
import io
import pickle
import tarfile
import zipfile

import pytest
import torch

from ckptstore.format import pickled
from tests.test_auxfiles import RunsCode, code_running_pickle, rng_state, torch_saved


def benign_files() -> dict[str, bytes]:
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as archive:
        archive.writestr("readme.txt", "not a checkpoint")
    return {
        "config.json": b'{"hidden": 32}',
        "modeling_custom.py": b"import torch\nfrom torch import nn\n\nclass Custom(nn.Module):\n    pass\n",
        "cat.txt": b"a line\nanother\n",
        "rng_state.pth": torch_saved(rng_state()),
        "custom_checkpoint_0.pkl": torch_saved({"weight": torch.ones(3), "step": 7, "name": "sched"}),
        "legacy.pt": torch_saved({"weight": torch.ones(3)}, _use_new_zipfile_serialization=False),
        "plain.pkl": pickle.dumps({"lr": [1e-3, 2e-3], "names": ("a", "b"), "raw": b"\x00", "ids": {1, 2}}),
        "plain0.pkl": pickle.dumps({"lr": [1e-3], "name": "x"}, protocol=0),
        "ordered.pkl": pickle.dumps(collections.OrderedDict(a=1), protocol=2),
        "data.zip": zipped.getvalue(),
        "noise.bin": bytes(range(256)) * 8,
    }


def hostile_files(marker) -> dict[str, bytes]:
    script = torch.jit.script(torch.nn.ReLU())  # no parameters: a ZeRO-3 test may leave Linear patched
    torchscript = io.BytesIO()
    torch.jit.save(script, torchscript)
    tarred = io.BytesIO()
    with tarfile.open(fileobj=tarred, mode="w") as archive:
        member = pickle.dumps(RunsCode(marker), protocol=2)
        info = tarfile.TarInfo("storages")
        info.size = len(member)
        archive.addfile(info, io.BytesIO(member))
    return {
        "zip.pt": code_running_pickle(marker),
        "legacy.pt": torch_saved({"m": RunsCode(marker)}, _use_new_zipfile_serialization=False),
        "protocol0.pkl": pickle.dumps(RunsCode(marker), protocol=0),
        "protocol2.pkl": pickle.dumps(RunsCode(marker), protocol=2),
        "protocol5.pkl": pickle.dumps(RunsCode(marker)),
        "second.pkl": pickle.dumps(1) + pickle.dumps(RunsCode(marker), protocol=2),
        "os.txt": b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.",
        "torchscript.pt": torchscript.getvalue(),
        "legacy.tar": tarred.getvalue(),
    }


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's, loading the protocol 5 one
def test_the_content_rule_lets_out_data_and_plain_pickles_and_refuses_pickles_that_reach_code(tmp_path):
    marker = tmp_path / "ran"
    for name, data in benign_files().items():
        assert pickled.refusal(data) is None, name
    for name, data in hostile_files(marker).items():
        assert pickled.refusal(data), name
    assert pickled.torch_refusal(torch_saved(rng_state())) is None  # DCP bytes items: the same allowlist
    assert pickled.torch_refusal(code_running_pickle(marker))
    assert pickled.torch_refusal(b"not a pickle")  # DCP's reader would torch.load it
    assert not marker.exists()


def test_a_pickle_too_big_to_judge_is_refused_without_building_it():
    # a list of empty sets, then an import: the weights-only unpickler would build every set
    crafted = b"\x80\x02]" + b"\x8fa" * pickled.MAX_PICKLE_OPCODES + b"ccollections\nOrderedDict\n)R."
    assert "more than the" in pickled.refusal(crafted)
    assert pickled.refusal(b"\x80\x02]" + b"\x8fa" * pickled.MAX_PICKLE_OPCODES + b".") is None  # plain data
