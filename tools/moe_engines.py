"""Tiny DeepSpeed engines with DeepSpeed's Mixture-of-Experts layer (``deepspeed.moe.layer.MoE``),
for tests and benchmarks: the model docs/moe.md measured, trained with ``tools.engines.train``.

    engine = build_moe_engine(zero_stage=2, dtype="bf16", ep_size=1)
    train(engine, batches(3, vocab=VOCAB))

Every rank of a job calls ``build_moe_engine`` with the same arguments; ``ep_size`` must divide
both the number of experts and the world size (DeepSpeed's expert-parallel groups).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from tools.engines import ds_config, setup_single_process_env

VOCAB = 64


class Expert(torch.nn.Module):
    """One expert: a two-layer MLP."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden, hidden // 2)
        self.fc2 = torch.nn.Linear(hidden // 2, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Block(torch.nn.Module):
    """A residual linear block, with an MoE layer after it where ``experts`` is not 0."""

    def __init__(self, hidden: int, experts: int, ep_size: int, top_k: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.fc = torch.nn.Linear(hidden, hidden)
        self.moe = (
            MoE(hidden, Expert(hidden), num_experts=experts, ep_size=ep_size, k=top_k, min_capacity=8)
            if experts
            else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + torch.relu(self.fc(x))
        if self.moe is None:
            return x, x.new_zeros(())
        out, aux_loss, _ = self.moe(x)
        return x + out, aux_loss


class ExpertsLM(torch.nn.Module):
    """An embedding, ``num_layers`` blocks (every other one, from block 1, with an MoE layer of
    ``experts`` experts) and a head; ``forward(input_ids, labels)`` answers like a Hugging Face
    causal LM (``.loss``: cross entropy plus the gates' load-balancing loss)."""

    def __init__(self, hidden: int, num_layers: int, experts: int, ep_size: int, top_k: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden)
        self.blocks = torch.nn.ModuleList(
            Block(hidden, experts if i % 2 else 0, ep_size, top_k) for i in range(num_layers)
        )
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        x = self.embed(input_ids)
        aux = x.new_zeros(())
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        logits = self.head(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))
        return SimpleNamespace(loss=loss + 0.01 * aux)


class PipelineMoEBlock(torch.nn.Module):
    """A pipeline layer: a residual linear block, then an MoE layer (its load-balancing loss
    dropped: a pipeline layer passes one tensor on)."""

    def __init__(self, hidden: int, experts: int, ep_size: int, top_k: int) -> None:
        super().__init__()
        self.block = Block(hidden, experts, ep_size, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


def build_moe_engine(
    zero_stage: int = 2,
    dtype: str = "bf16",
    seed: int = 0,
    ep_size: int = 1,
    experts: int = 4,
    hidden: int = 16,
    num_layers: int = 4,
    top_k: int = 2,
    frozen_experts: int = 0,
    **config_overrides: Any,
):
    """A DeepSpeed engine over ``ExpertsLM``, its optimizer groups split into dense and expert
    groups as DeepSpeed's MoE needs (``split_params_into_different_moe_groups_for_optimizer``);
    each rank's first ``frozen_experts`` local experts of every MoE layer are frozen (as in
    upcycling or expert-frozen fine-tuning)."""
    setup_single_process_env()
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    rng_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = ExpertsLM(hidden, num_layers, experts, ep_size, top_k)
    finally:
        torch.set_rng_state(rng_state)
    for name, param in model.named_parameters():
        local = name.split(".deepspeed_experts.")[1].split(".")[0] if ".deepspeed_experts." in name else None
        if local is not None and int(local) < frozen_experts:
            param.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": trainable, "name": "dense-params"}]
    )
    config = ds_config(zero_stage, dtype, **config_overrides)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return engine


def build_mixtral_engine(
    zero_stage: int = 2,
    dtype: str = "bf16",
    seed: int = 0,
    experts: int = 4,
    hidden: int = 16,
    num_layers: int = 2,
    **config_overrides: Any,
):
    """A DeepSpeed engine over a tiny random ``MixtralForCausalLM`` (top-2 of ``experts``): a
    Hugging Face MoE model that holds each layer's experts fused, in ``mlp.experts.gate_up_proj``
    [experts, 2 x intermediate, hidden] and ``mlp.experts.down_proj`` (docs/moe.md section 11),
    under plain ZeRO."""
    setup_single_process_env()
    import deepspeed
    from transformers import MixtralConfig, MixtralForCausalLM

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    config = MixtralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=24, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=experts, num_experts_per_tok=2,
        max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "eager"
    rng_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = MixtralForCausalLM(config)
    finally:
        torch.set_rng_state(rng_state)
    model.train()
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=ds_config(zero_stage, dtype, **config_overrides),
    )
    return engine


def build_moe_pipeline_engine(
    zero_stage: int = 1,
    dtype: str = "bf16",
    seed: int = 0,
    experts: int = 4,
    hidden: int = 16,
    stages: int = 2,
    **config_overrides: Any,
):
    """A DeepSpeed ``PipelineEngine`` (Megatron-DeepSpeed's GPT-MoE shape) of ``stages`` stages
    over two dense blocks and two MoE blocks (``experts`` experts, top-2, expert parallelism 1),
    one after the other, between the tied embedding and its transpose (2 stages: a dense and an
    MoE block each); train it with ``tools.engines.train_pipeline``, on as many ranks as stages."""
    setup_single_process_env()
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    from tools.engines import _tied_logits

    deepspeed.init_distributed(dist_backend=None, verbose=False)
    rng_state = torch.get_rng_state()
    torch.manual_seed(seed)
    try:
        blocks = [LayerSpec(PipelineMoEBlock, hidden, experts if i % 2 else 0, 1, 2) for i in range(4)]
        layers = [
            TiedLayerSpec("embed", torch.nn.Embedding, VOCAB, hidden, tied_weight_attr="weight"),
            *blocks,
            TiedLayerSpec(
                "embed", torch.nn.Embedding, VOCAB, hidden, forward_fn=_tied_logits, tied_weight_attr="weight"
            ),
        ]
        module = PipelineModule(
            layers, num_stages=stages, loss_fn=torch.nn.CrossEntropyLoss(), partition_method="uniform"
        )
    finally:
        torch.set_rng_state(rng_state)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [p for p in module.parameters() if p.requires_grad], "name": "dense-params"}]
    )
    config = ds_config(zero_stage, dtype, **config_overrides)
    config["gradient_accumulation_steps"] = 2  # micro-batches, so that the stages overlap
    engine, *_ = deepspeed.initialize(model=module, model_parameters=groups, config=config)
    return engine
