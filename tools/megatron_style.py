"""A tiny tensor-parallel model in the style of Megatron-LM, for DeepSpeed's ``mpu=`` door.

Megatron-DeepSpeed splits its linears itself (column- and row-parallel) and tells DeepSpeed
how its ranks are grouped through an ``mpu`` object; DeepSpeed then saves each tensor-parallel
rank's slices in its own ``mp_rank_XX`` files. This is that arrangement at toy size, with no
Megatron installed: ``MLPStack`` (a replicated embedding, blocks of a column-parallel and a
row-parallel linear, a replicated norm and head) and ``ModelParallelUnit`` (the groups).
``UNIVERSAL_INFO`` is what a Megatron client passes in its client state for
``ds_to_universal``: which parameters every rank holds whole, which are split by rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

UNIVERSAL_INFO = {
    "universal_checkpoint_info": {
        "tp_replicated_parameter_patterns": [r"embed\.weight", r"norm\.weight", r"norm\.bias", r"head\.weight",
                                             r"blocks\.\d+\.down\.bias"],
        "parameter_with_row_parallelism_patterns": [r"blocks\.\d+\.down\.weight"],
    }
}  # fmt: skip


class ModelParallelUnit:
    """The ``mpu`` DeepSpeed asks for groups: ranks ``[k*tp, (k+1)*tp)`` form a tensor-parallel
    group, ranks ``k mod tp`` equal a data-parallel one. Collective to build (every rank makes
    every group, as torch.distributed requires)."""

    def __init__(self, tp: int) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp = tp
        for first in range(0, world, tp):
            group = dist.new_group(list(range(first, first + tp)))
            if first <= rank < first + tp:
                self.tp_group = group
        for offset in range(tp):
            group = dist.new_group(list(range(offset, world, tp)))
            if rank % tp == offset:
                self.dp_group = group

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(group=self.tp_group)

    def get_model_parallel_world_size(self) -> int:
        return self.tp

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(group=self.dp_group)

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(group=self.dp_group)

    def get_data_parallel_group(self):
        return self.dp_group


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the input's gradient summed over the tensor-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """The partial outputs summed over the tensor-parallel group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _mark(param: torch.nn.Parameter, dim: int) -> None:
    # Megatron's attributes: DeepSpeed's gradient norm counts such a parameter on every rank.
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


class ParallelBlock(torch.nn.Module):
    """``x + down(gelu(up(x)))``: ``up`` split by output rows (column parallel), ``down`` by
    input columns (row parallel), its bias whole on every rank."""

    def __init__(self, hidden: int, inner: int, mpu: ModelParallelUnit) -> None:
        super().__init__()
        self.group = mpu.get_model_parallel_group()
        rank, tp = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
        full_up, full_down = torch.nn.Linear(hidden, inner), torch.nn.Linear(inner, hidden)
        share = inner // tp
        self.up = torch.nn.Linear(hidden, share)
        self.down = torch.nn.Linear(share, hidden)
        with torch.no_grad():  # every degree starts from the same full weights
            self.up.weight.copy_(full_up.weight[rank * share : (rank + 1) * share])
            self.up.bias.copy_(full_up.bias[rank * share : (rank + 1) * share])
            self.down.weight.copy_(full_down.weight[:, rank * share : (rank + 1) * share])
            self.down.bias.copy_(full_down.bias)
        _mark(self.up.weight, 0)
        _mark(self.up.bias, 0)
        _mark(self.down.weight, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.up(_CopyToTensorParallel.apply(x, self.group)))
        partial = torch.nn.functional.linear(hidden, self.down.weight)
        return x + _ReduceFromTensorParallel.apply(partial, self.group) + self.down.bias


class MLPStack(torch.nn.Module):
    """A replicated embedding, ``layers`` parallel blocks, a replicated norm and head: returns the
    next-token loss of ``input_ids``."""

    def __init__(self, mpu: ModelParallelUnit, layers: int = 2, hidden: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.blocks = torch.nn.ModuleList(ParallelBlock(hidden, 4 * hidden, mpu) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]).float(), input_ids[:, 1:].reshape(-1)
        )
