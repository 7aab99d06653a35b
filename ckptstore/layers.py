"""Which layer a parameter or buffer belongs to.

A layer is a numbered block (``model.layers.7``: the module path up to and including the first
numeric index) or, for anything outside numbered blocks, its parent module (``model.embed_tokens``,
``model.norm``, ``lm_head``). An expert of a block's Mixture-of-Experts layer is a layer of its
own, inside its block (``blocks.3.moe.deepspeed_moe.experts.deepspeed_experts.5``: DeepSpeed's
MoE layer names its experts so, by global index in a step; ``model.layers.3.mlp.experts.5``: a
Hugging Face model's fused experts, stored a piece per expert, see ``fused_experts``, or its
per-expert modules), so each expert is saved, inherited, measured and shown on its own. Layers
are the unit a commit saves or inherits.
"""

from __future__ import annotations

from collections.abc import Iterable

# The module lists under which MoE layers keep their experts: DeepSpeed's MoE layer
# (deepspeed.moe.layer.MoE), and Hugging Face models (``mlp.experts``, fused or one module each).
EXPERTS = ("deepspeed_experts", "experts")


def _numbers(parts: list[str]) -> list[int]:
    return [i for i, part in enumerate(parts) if part.isdigit()]


def layer_of(name: str) -> str:
    """The layer that owns the tensor called ``name`` in the module's state dict."""
    parts = name.split(".")
    numbers = [i for i in _numbers(parts) if i < len(parts) - 1]
    if not numbers:
        return ".".join(parts[:-1]) or name
    first = numbers[0]
    expert = next((i for i in numbers[1:] if parts[i - 1] in EXPERTS), None)
    return ".".join(parts[: (first if expert is None else expert) + 1])


def block_of(layer: str) -> str | None:
    """The numbered block ``layer`` is or lies in (an expert's block), None for auxiliary layers."""
    parts = layer.split(".")
    numbers = _numbers(parts)
    if not numbers or (numbers[0] > 0 and parts[numbers[0] - 1] in EXPERTS):
        return None  # (an expert of a MoE layer outside numbered blocks is an auxiliary layer)
    return ".".join(parts[: numbers[0] + 1])


def is_block(layer: str) -> bool:
    """Whether ``layer`` is a numbered block or an expert in one (as opposed to an auxiliary
    unit such as the embedding)."""
    return block_of(layer) is not None


def block_index(layer: str) -> int | None:
    """The number of the block ``layer`` is or lies in (``model.layers.7`` -> 7), None for auxiliary layers."""
    block = block_of(layer)
    return int(block.rsplit(".", 1)[-1]) if block is not None else None


def ordered_layers(names: Iterable[str]) -> list[str]:
    """The distinct layers of ``names`` in first-appearance order (the module's own order)."""
    return list(dict.fromkeys(layer_of(n) for n in names))
