"""Mixture-of-Experts engines (``deepspeed.moe.layer.MoE``): refused until the store can hold
their experts, so no step is recorded that DeepSpeed or ``restore`` could not load."""

import pytest
import torch

import ckptstore
from ckptstore.errors import UnsupportedError
from tools.engines import ds_config, setup_single_process_env


class ExpertsModel(torch.nn.Module):
    """A projection, then DeepSpeed's MoE layer of two experts (expert parallelism 1)."""

    def __init__(self) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.moe = MoE(hidden_size=8, expert=torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, aux_loss, _ = self.moe(self.inp(x))
        return out.pow(2).mean() + aux_loss


def stored_files(root) -> list:
    """The store's objects: every file but its catalog and its lock (a commit takes the lock)."""
    return sorted(p for p in root.rglob("*") if "catalog" not in p.name and p.name != "lock")


@pytest.fixture(scope="module")
def moe_engine():
    setup_single_process_env()
    import deepspeed

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    torch.manual_seed(0)
    model = ExpertsModel()
    config = ds_config(2, "fp32", scheduler=False, optimizer={"params": {"torch_adam": True}})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    loss = engine(torch.randn(4, 8))
    engine.backward(loss)
    engine.step()
    return engine


@pytest.mark.parametrize("blocking", [True, False])
def test_a_moe_engine_is_refused_at_commit_naming_its_layer_and_nothing_is_recorded(
    tmp_path, moe_engine, blocking
):
    store = ckptstore.open(tmp_path / "store", create=True)
    before = stored_files(tmp_path / "store")

    with pytest.raises(UnsupportedError, match=r"Mixture-of-Experts layer moe \(deepspeed.moe.layer.MoE\)"):
        store.commit(moe_engine, step=1, blocking=blocking)
    store.wait()

    assert store.steps() == []
    assert stored_files(tmp_path / "store") == before
