"""A tiny GPT in the shape of Megatron-DeepSpeed's ``GPTModelPipe``, for 3D (pipeline × tensor ×
data) DeepSpeed jobs with no Megatron installed.

Megatron-DeepSpeed trains a ``PipelineModule`` built from layer specs over a
``PipeModelDataParallelTopology``, each stage split over tensor-parallel ranks by its own
column- and row-parallel linears; ``deepspeed.initialize`` gets no ``mpu`` then, the engine's is
the topology's grid. This module is that model at toy size, with the same layer order and
parameter names, so a checkpoint of it is laid out as theirs is:

* spec 0 and the last spec are functions (Megatron's fp32/bf16 casts): no layer file;
* spec 1 is the ``TiedLayerSpec("embed")`` vocabulary-parallel embedding
  (``tied_modules.embed.word_embeddings.weight``), its rows padded to a multiple of the TP
  degree; the output layer on the last stage reuses it (``forward_fn``), and gets no file;
* specs 2.. are ``ParallelTransformerLayerPipe``: ``input_layernorm``, a column-parallel fused
  ``self_attention.query_key_value`` (per head q, k, v: the heads are what TP splits), a
  row-parallel ``self_attention.dense``, ``post_attention_layernorm``, SwiGLU whose
  column-parallel ``mlp.dense_h_to_4h`` holds two sub-parameters (each rank's slice is its part
  of the gate, then its part of the up projection) and a row-parallel ``mlp.dense_4h_to_h``;
* then the final ``LayerNorm`` (``<index>.weight``), the tied head and the cast.

``universal_checkpoint_info`` is set on the module as the dict Megatron-DeepSpeed hands to
DeepSpeed (its ``UniversalCheckpointInfo`` for a pipeline with TP > 1, layernorm, linear biases
and SwiGLU, plus the version and vocabulary sizes its ``_universal_checkpoint_info`` adds);
DeepSpeed's ``save_checkpoint`` copies a module's attribute into every ``mp_rank`` file, where
``ds_to_universal`` reads it.

Every layer draws its full (unsplit) weights from a generator seeded by the model seed and the
layer's index, then keeps its rank's slice: any layout of the same seed starts from the same
logical model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ORIGINAL_VOCAB = 49  # odd on purpose: padded to 50 at TP 1, 52 at TP 2
HIDDEN, HEADS, FFN = 32, 4, 64


@dataclass(frozen=True)
class Dims:
    """The model's sizes: the tests' toy by default; ``tools/bench_megatron3d.py`` makes it larger."""

    hidden: int = HIDDEN
    heads: int = HEADS
    ffn: int = FFN
    vocab: int = ORIGINAL_VOCAB


TOY = Dims()


def padded_vocab_size(vocab: int, tp: int, divisible_by: int = 2) -> int:
    """Megatron's ``_vocab_size_with_padding``: rounded up to a multiple of
    ``divisible_by × tp`` so that every tensor-parallel rank holds as many rows."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def universal_checkpoint_info(tp: int, vocab: int = ORIGINAL_VOCAB) -> dict:
    """What Megatron-DeepSpeed tells DeepSpeed about ``GPTModelPipe``'s parameters, for
    ``ds_to_universal`` (patterns are matched with ``re.match`` against the pipeline's names)."""
    from deepspeed.checkpoint import constants as c

    return {
        c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        c.ORIGINAL_VOCAB_SIZE: vocab,
        c.PADDED_VOCAB_SIZE: padded_vocab_size(vocab, tp),
        # rows split by TP and padded: ds_to_universal keeps original_vocab_size rows
        c.VOCABULARY_PARAMETER_PATTERNS: [r"tied_modules.embed.word_embeddings.weight"],
        # the tied embedding, also on the last stage: only the first stage's copy is read
        c.PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"tied_modules.embed.word_embeddings.weight"],
        # whole on every TP rank (ds_to_universal checks the slices are equal)
        c.TP_REPLICATED_PARAMETER_PATTERNS: [
            r"\d+.input_layernorm.weight", r"\d+.post_attention_layernorm.weight",
            r"\d+.self_attention.dense.bias", r"\d+.mlp.dense_4h_to_h.bias",
            r"\d+.input_layernorm.bias", r"\d+.post_attention_layernorm.bias",
        ],
        # BLOOM's universal checkpoint averaged its TP copies of the final norm, which bf16
        # had let drift apart; Megatron-DeepSpeed lists it as replicated. Listed here as
        # averaged, so that the pattern kind is exercised (equal copies average to themselves).
        c.PARAMETER_TO_AVERAGE_PATTERNS: [r"\d+.weight", r"\d+.bias"],
        c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [
            r"\d+.mlp.dense_4h_to_h.weight", r"\d+.self_attention.dense.weight",
        ],
        # SwiGLU: each rank's slice is [gate_r; up_r], the logical tensor [gate; up]
        c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: [r"\d+.mlp.dense_h_to_4h.weight", r"\d+.mlp.dense_h_to_4h.bias"],
    }  # fmt: skip


class TensorParallel:
    """This rank's tensor-parallel group of a topology (``axes`` pipe, data, model: TP ranks are
    consecutive, as Megatron numbers them). Collective to build: every rank makes every group."""

    def __init__(self, topology: Any) -> None:
        self.size = topology.get_dim("model")
        self.group = None
        for ranks in topology.get_axis_comm_lists("model"):
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                self.group, self.rank = group, ranks.index(dist.get_rank())
        if self.group is None:  # TP 1: get_axis_comm_lists gives no lists
            self.rank = 0


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; the input's gradient summed over the TP group (before a column-parallel
    layer, whose every rank used the whole input)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp.size > 1:
            grad = grad.contiguous()
            dist.all_reduce(grad, group=ctx.tp.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """The ranks' partial results summed over the TP group (after a row-parallel layer or a
    vocabulary-parallel lookup); identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        if tp.size > 1:
            x = x.contiguous()
            dist.all_reduce(x, group=tp.group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    """The ranks' slices of the last dimension joined (the vocabulary-parallel logits);
    backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        if tp.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        dist.all_gather(parts, x.contiguous(), group=tp.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


def _mark(param: torch.nn.Parameter, dim: int) -> None:
    # Megatron's attributes: DeepSpeed's gradient norm counts such a parameter on every TP rank,
    # a replicated one on TP rank 0 only.
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = 1


def _full(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * 0.05


class _Linear(torch.nn.Module):
    """``weight`` and ``bias`` of this rank's slice of a full ``(out, in)`` linear: its
    ``rows`` (column parallel) or ``cols`` (row parallel: the bias stays whole)."""

    def __init__(self, full_weight: torch.Tensor, full_bias: torch.Tensor, rows=None, cols=None) -> None:
        super().__init__()
        weight = full_weight[rows] if rows is not None else full_weight[:, cols]
        self.weight = torch.nn.Parameter(weight.contiguous())
        self.bias = torch.nn.Parameter((full_bias[rows] if rows is not None else full_bias).contiguous())
        _mark(self.weight, 0 if rows is not None else 1)
        if rows is not None:
            _mark(self.bias, 0)


class ParallelAttention(torch.nn.Module):
    """Causal self-attention: the fused ``query_key_value`` laid out per head (q, k, v of head 0,
    then of head 1, ...) and split by heads, ``dense`` split by its input columns."""

    def __init__(self, tp: TensorParallel, generator: torch.Generator, dims: Dims = TOY) -> None:
        super().__init__()
        hidden = dims.hidden
        self.tp, self.heads = tp, dims.heads // tp.size
        self.head_dim = hidden // dims.heads
        per_rank = 3 * hidden // tp.size
        own = slice(tp.rank * per_rank, (tp.rank + 1) * per_rank)
        self.query_key_value = _Linear(
            _full(generator, 3 * hidden, hidden), _full(generator, 3 * hidden), rows=own
        )
        cols = slice(tp.rank * hidden // tp.size, (tp.rank + 1) * hidden // tp.size)
        self.dense = _Linear(_full(generator, hidden, hidden), _full(generator, hidden), cols=cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        qkv = torch.nn.functional.linear(_CopyToTensorParallel.apply(x, self.tp), self.query_key_value.weight,
                                         self.query_key_value.bias)  # fmt: skip
        q, k, v = qkv.view(batch, seq, self.heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        context = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        context = context.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)
        partial = torch.nn.functional.linear(context, self.dense.weight)
        return _ReduceFromTensorParallel.apply(partial, self.tp) + self.dense.bias


class ParallelMLP(torch.nn.Module):
    """SwiGLU: ``dense_h_to_4h`` is the gate and the up projection, each split by rows, this
    rank's slice ``[gate_r; up_r]``; ``dense_4h_to_h`` split by its input columns."""

    def __init__(self, tp: TensorParallel, generator: torch.Generator, dims: Dims = TOY) -> None:
        super().__init__()
        self.tp = tp
        ffn, hidden = dims.ffn, dims.hidden
        share = ffn // tp.size
        gate_up, gate_up_bias = _full(generator, 2 * ffn, hidden), _full(generator, 2 * ffn)
        own = torch.cat(
            [torch.arange(tp.rank * share, (tp.rank + 1) * share) + half * ffn for half in (0, 1)]
        )
        self.dense_h_to_4h = _Linear(gate_up, gate_up_bias, rows=own)
        cols = slice(tp.rank * share, (tp.rank + 1) * share)
        self.dense_4h_to_h = _Linear(_full(generator, hidden, ffn), _full(generator, hidden), cols=cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        both = torch.nn.functional.linear(_CopyToTensorParallel.apply(x, self.tp), self.dense_h_to_4h.weight,
                                          self.dense_h_to_4h.bias)  # fmt: skip
        gate, up = both.chunk(2, dim=-1)
        partial = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.dense_4h_to_h.weight)
        return _ReduceFromTensorParallel.apply(partial, self.tp) + self.dense_4h_to_h.bias


def _layer_norm(generator: torch.Generator, hidden: int) -> torch.nn.LayerNorm:
    norm = torch.nn.LayerNorm(hidden)
    with torch.no_grad():
        norm.weight.add_(_full(generator, hidden))
        norm.bias.copy_(_full(generator, hidden))
    return norm


class ParallelTransformerLayerPipe(torch.nn.Module):
    """A pre-norm transformer block, named as Megatron's (``partition_method="type:transformer"``
    finds it by its class name)."""

    def __init__(self, tp: TensorParallel, seed: int, layer_number: int, dims: Dims = TOY) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed * 1000 + 2 + layer_number)
        self.input_layernorm = _layer_norm(generator, dims.hidden)
        self.self_attention = ParallelAttention(tp, generator, dims)
        self.post_attention_layernorm = _layer_norm(generator, dims.hidden)
        self.mlp = ParallelMLP(tp, generator, dims)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class EmbeddingPipe(torch.nn.Module):
    """The vocabulary-parallel embedding: this rank's rows of the padded table (padding rows
    start at zero, as a universal load fills them); a token another rank holds looks up zero
    here, and the ranks' lookups are summed."""

    def __init__(self, tp: TensorParallel, seed: int, dims: Dims = TOY) -> None:
        super().__init__()
        self.tp = tp
        generator = torch.Generator().manual_seed(seed * 1000 + 1)
        vocab, hidden = dims.vocab, dims.hidden
        padded = padded_vocab_size(vocab, tp.size)
        full = torch.cat([_full(generator, vocab, hidden), torch.zeros(padded - vocab, hidden)])
        self.rows = padded // tp.size
        self.first = tp.rank * self.rows
        self.word_embeddings = torch.nn.Embedding(self.rows, hidden)
        with torch.no_grad():
            self.word_embeddings.weight.copy_(full[self.first : self.first + self.rows])
        _mark(self.word_embeddings.weight, 0)

    @property
    def word_embeddings_weight(self) -> torch.nn.Parameter:
        # Megatron's name for the tied weight (TiedLayerSpec's tied_weight_attr)
        return self.word_embeddings.weight

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        elsewhere = (local < 0) | (local >= self.rows)
        found = self.word_embeddings(local.masked_fill(elsewhere, 0))
        found = found.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        return _ReduceFromTensorParallel.apply(found, self.tp)


def _logits(embedding: EmbeddingPipe, x: torch.Tensor) -> torch.Tensor:
    # The output layer is the tied embedding (Megatron's parallel_lm_logits): each rank its
    # vocabulary slice of the logits, joined here for a plain cross entropy.
    local = torch.nn.functional.linear(
        _CopyToTensorParallel.apply(x, embedding.tp), embedding.word_embeddings.weight
    )
    return _GatherFromTensorParallel.apply(local, embedding.tp)


def _to_float16(input_ids: torch.Tensor) -> torch.Tensor:
    # Megatron's first spec casts float inputs to the training dtype; token ids pass as they are.
    return input_ids


def _float16_to_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.float()


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt_model_pipe(pp: int, tp: int, dp: int, seed: int = 0, num_layers: int = 4, dims: Dims = TOY) -> Any:
    """``GPTModelPipe`` over ``pp`` stages of ``tp`` tensor-parallel ranks, ``dp`` copies (the
    job's world size is their product), of ``num_layers`` blocks of ``dims``; every rank of the
    job calls this, in the same order."""
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    class GPTModelPipe(PipelineModule):
        def __init__(self) -> None:
            topology = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
            parallel = TensorParallel(topology)
            embed = dict(tied_weight_attr="word_embeddings_weight")
            specs = [
                _to_float16,
                TiedLayerSpec("embed", EmbeddingPipe, parallel, seed, dims, **embed),
                *[
                    LayerSpec(ParallelTransformerLayerPipe, parallel, seed, n, dims)
                    for n in range(num_layers)
                ],
                LayerSpec(torch.nn.LayerNorm, dims.hidden),
                TiedLayerSpec("embed", EmbeddingPipe, parallel, seed, dims, forward_fn=_logits, **embed),
                _float16_to_fp32,
            ]
            super().__init__(layers=specs, loss_fn=_cross_entropy, topology=topology,
                             partition_method="type:transformer")  # fmt: skip
            self.universal_checkpoint_info = universal_checkpoint_info(tp, dims.vocab)

    return GPTModelPipe()


def ds_config(dtype: str = "bf16", zero_stage: int = 1, micro_batches: int = 2, **extra: Any) -> dict:
    """The DeepSpeed config of a 3D job: a micro-batch of 2 sequences, ``micro_batches`` of them
    per ``train_batch``, AdamW with warmup, ZeRO ``zero_stage``."""
    from tools.engines import ds_config as base

    config = base(zero_stage, dtype, **extra)
    config["gradient_accumulation_steps"] = micro_batches
    return config


def build_engine(
    pp: int, tp: int, dp: int, seed: int = 0, dtype: str = "bf16", zero_stage: int = 1,
    num_layers: int = 4, dims: Dims = TOY, **extra: Any,
):  # fmt: skip
    """A DeepSpeed ``PipelineEngine`` of ``gpt_model_pipe``; its ``mpu`` is the topology's grid,
    as in Megatron-DeepSpeed (which passes ``mpu=None`` for a pipeline)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    module = gpt_model_pipe(pp, tp, dp, seed=seed, num_layers=num_layers, dims=dims)
    engine, *_ = deepspeed.initialize(
        model=module,
        model_parameters=[p for p in module.parameters() if p.requires_grad],
        config=ds_config(dtype, zero_stage, **extra),
    )
    return engine


def batches(
    n: int, seed: int = 4321, seq: int = 8, vocab: int = ORIGINAL_VOCAB
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` micro-batches of (input ids, next-token labels) over the original vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (2, seq + 1), generator=generator)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def train(engine, micro_batches: list, per_step: int = 2) -> list[float]:
    """One ``train_batch`` per ``per_step`` micro-batches; the losses (every stage gets the last
    stage's)."""
    return [
        float(engine.train_batch(data_iter=iter(micro_batches[first : first + per_step])).float().item())
        for first in range(0, len(micro_batches) - per_step + 1, per_step)
    ]
