"""One decoder layer of the hand-written families: its norms, attention (GQA or MLA) and MLP
(dense or MoE), the rules of :mod:`.dense`, :mod:`.mla` and :mod:`.moe`. Used for the target's
layers (:func:`weight_transfer.plan.recipes.build_recipes`) and an MTP draft's block (:mod:`.mtp`)."""
from __future__ import annotations

from . import dense, mla, moe
from .base import RecipeBuilder


def decoder_layer(b: RecipeBuilder, p: str, i: int) -> None:
    """Layer ``i``'s recipes, its checkpoint names under ``p`` (``model.layers.{i}``), appended to ``b``."""
    cfg = b.cfg
    H = cfg.hidden_size
    b.replicated(f"{p}.input_layernorm.weight", (H,))
    if cfg.is_mla:
        mla.attention(b, p)
    else:
        dense.attention(b, p)
    b.replicated(f"{p}.post_attention_layernorm.weight", (H,))
    if cfg.is_moe_layer(i):
        moe.experts(b, p)
    else:
        dense.mlp(b, f"{p}.mlp", cfg["intermediate_size"])
