"""A step's description re-cut for an engine of another split, and its tensors served in that
engine's order (``ckptstore.deepspeed.reshard``); the 3D job (tests/test_megatron3d.py) checks
the same against DeepSpeed's universal checkpoint on real engines."""

import pytest
import torch

from ckptstore.deepspeed import reshard
from ckptstore.errors import BadInputError, UnsupportedError

NAME = "tied_modules.embed.word_embeddings.weight"


def description(rows: int, original: int | None = 5, split: dict | None = None) -> dict:
    """A one-parameter step (or engine) description: a vocabulary of ``rows`` padded rows."""
    entry = {"shape": [rows, 2], "dtype": "float32", "trainable": True}
    if original is not None:
        entry["original_vocab_size"] = original
    if split is not None:
        entry["split"] = split
    group = {"params": [NAME], "hyper": {"lr": 0.1}, "scalars": {"step": 2}, "state_kinds": ["exp_avg"]}
    return {"params": {NAME: entry}, "groups": [group], "model_state": {"mp_world_size": 1},
            "optimizer_state": {}}  # fmt: skip


class Stored:
    """A ``TensorSource`` of plain tensors, by (name, kind)."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = tensors

    def __call__(self, name: str, kind: str) -> torch.Tensor | None:
        return self.tensors.get((name, kind))


def test_a_vocabulary_padded_for_another_degree_is_repadded_with_zeros_past_its_original_rows():
    # stored at TP 2 (8 rows, 2 per rank's padding), read by an engine of TP 1 (6 rows) and back
    stored, target = description(8, split={"dim": 0, "sizes": [4, 4]}), description(6)
    recut = reshard.recut(stored, target, "step 2")
    assert recut["params"][NAME]["shape"] == [6, 2]
    padded = torch.arange(16.0).view(8, 2)
    relayout = reshard.Relayout(Stored({(NAME, "fp32"): padded}), stored["params"], recut["params"])
    out = relayout(NAME, "fp32")
    assert torch.equal(out[:5], padded[:5]) and torch.equal(out[5:], torch.zeros(1, 2))
    assert torch.equal(relayout.span(NAME, "fp32", 8, 12), out.reshape(-1)[8:12])
    back = reshard.Relayout(Stored({(NAME, "fp32"): out}), target["params"], stored["params"])
    assert torch.equal(back(NAME, "fp32"), torch.cat([padded[:5], torch.zeros(3, 2)]))
    # into another layout at the same padded size, the padding the step's training moved (its
    # Adam moments above all) is zeros too, as ds_to_universal + load_universal leave it
    same = reshard.Relayout(Stored({(NAME, "exp_avg"): padded}), stored["params"], stored["params"])
    assert torch.equal(same(NAME, "exp_avg"), torch.cat([padded[:5], torch.zeros(3, 2)]))


def test_a_vocabulary_whose_padding_the_step_does_not_say_is_refused_naming_it():
    with pytest.raises(UnsupportedError, match=f"{NAME} with 8 rows, this engine 6.*original_vocab_size"):
        reshard.recut(description(8, original=None), description(6), "step 2")
    # another vocabulary, or another hidden size, is another model
    with pytest.raises(BadInputError, match=f"holds {NAME} of shape"):
        reshard.recut(description(8, original=5), description(6, original=4), "step 2")
    other = description(6)
    other["params"][NAME]["shape"] = [6, 3]
    with pytest.raises(BadInputError, match=f"holds {NAME} of shape"):
        reshard.recut(description(8), other, "step 2")
