"""Non-tensor state round-trips through plain JSON without pickles."""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptstore.errors import CorruptError, UnsupportedError
from ckptstore.format import plainstate


def test_deepspeed_like_state_round_trips_exactly():
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    scaler = DynamicLossScaler(
        init_scale=2.0**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
    )
    value = {
        "lr_scheduler": {"last_batch_iteration": 7},
        "param_groups": [{"lr": 0.1 + 0.2, "betas": (0.9, 0.999), "eps": 1e-8, "name": "decay"}],
        "state": {0: {"step": torch.tensor(3.0)}, 1: {"step": 3}},
        "zero_stage": ZeroStageEnum.gradients,
        "loss_scaler": scaler,
        "shape": torch.Size([3, 4]),
        "inf": math.inf,
        "__sneaky": 1,
    }
    back = plainstate.loads(plainstate.dumps(value))
    assert back["param_groups"][0]["lr"] == 0.1 + 0.2
    assert back["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["state"][1] == {"step": 3} and torch.equal(back["state"][0]["step"], torch.tensor(3.0))
    assert back["zero_stage"] is ZeroStageEnum.gradients
    assert type(back["loss_scaler"]) is DynamicLossScaler and vars(back["loss_scaler"]) == vars(scaler)
    assert back["shape"] == torch.Size([3, 4]) and back["inf"] == math.inf and back["__sneaky"] == 1


def test_same_value_always_encodes_to_the_same_text():
    a = {"b": 1, "a": [1.5, (2, 3)]}
    b = {"a": [1.5, (2, 3)], "b": 1}
    assert plainstate.dumps(a) == plainstate.dumps(b)


def test_unknown_objects_are_refused_with_their_path():
    with pytest.raises(UnsupportedError, match=r"state\.client\.thing"):
        plainstate.to_plain({"client": {"thing": object()}})


def test_reading_never_instantiates_classes_off_the_allowlist():
    text = '{"__object__": "os.system", "attrs": {}}'
    with pytest.raises(CorruptError, match="not allowed"):
        plainstate.loads(text)


@given(st.text(max_size=100))
def test_arbitrary_text_raises_a_ckptstore_error_or_parses(text):
    try:
        plainstate.loads(text)
    except CorruptError:
        pass
