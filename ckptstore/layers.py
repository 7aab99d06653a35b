"""Which layer a parameter or buffer belongs to.

A layer is a numbered block (``model.layers.7``: the module path up to and including the first
numeric index) or, for anything outside numbered blocks, its parent module (``model.embed_tokens``,
``model.norm``, ``lm_head``). Layers are the unit a commit saves or inherits.
"""

from __future__ import annotations

from collections.abc import Iterable


def layer_of(name: str) -> str:
    """The layer that owns the tensor called ``name`` in the module's state dict."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def is_block(layer: str) -> bool:
    """Whether ``layer`` is a numbered block (as opposed to an auxiliary unit such as the embedding)."""
    return layer.rsplit(".", 1)[-1].isdigit()


def block_index(layer: str) -> int | None:
    """The number of a numbered block (``model.layers.7`` -> 7), None for auxiliary layers."""
    return int(layer.rsplit(".", 1)[-1]) if is_block(layer) else None


def ordered_layers(names: Iterable[str]) -> list[str]:
    """The distinct layers of ``names`` in first-appearance order (the module's own order)."""
    return list(dict.fromkeys(layer_of(n) for n in names))
