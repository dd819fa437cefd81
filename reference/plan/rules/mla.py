"""Multi-head latent attention rules (DeepSeek-V3, Kimi-K2): vLLM's ``DeepseekV2MLAAttention``.

With ``q_lora_rank``: ``fused_qkv_a_proj`` = ``q_a_proj`` rows then ``kv_a_proj_with_mqa`` rows,
replicated; ``q_a_layernorm`` replicated; ``q_b_proj`` and ``kv_b_proj`` row-sharded by heads.
Without it (beyond LAYOUTS.md, vLLM's rule): ``q_proj`` row-sharded and ``kv_a_proj_with_mqa``
replicated, unfused. ``kv_a_layernorm`` replicated; ``o_proj`` column-sharded.
"""
from __future__ import annotations

from ...types import Piece
from .base import RecipeBuilder


def attention(b: RecipeBuilder, p: str):
    """Layer ``p``'s MLA attention."""
    cfg, T = b.cfg, b.T
    H, nh = cfg.hidden_size, cfg.num_heads
    qlr, kvlr = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    hl = b.divide(f"{p}.self_attn num_attention_heads", nh, T)
    a = f"{p}.self_attn"
    kv_a = f"{a}.kv_a_proj_with_mqa.weight"
    if qlr:
        q_a = f"{a}.q_a_proj.weight"
        n = qlr + kvlr + rope
        b.linear(
            f"{a}.fused_qkv_a_proj", b.all_ranks, (n, H),
            (
                Piece(q_a, ((0, qlr), (0, H)), ((0, qlr), (0, H))),
                Piece(kv_a, ((0, kvlr + rope), (0, H)), ((qlr, n), (0, H))),
            ),
            name=f"{a}.fused_qkv_a_proj.weight",
        )
        b.replicated(f"{a}.q_a_layernorm.weight", (qlr,))
        qb = f"{a}.q_b_proj.weight"
        w = hl * (nope + rope)
        b.row_stack(f"{a}.q_b_proj", lambda r: ((qb, r * w, (r + 1) * w),), qlr)
    else:  # vLLM: q_proj row-sharded, kv_a_proj_with_mqa replicated and unfused
        qp = f"{a}.q_proj.weight"
        w = hl * (nope + rope)
        b.row_stack(f"{a}.q_proj", lambda r: ((qp, r * w, (r + 1) * w),), H)
        b.linear(
            f"{a}.kv_a_proj_with_mqa", b.all_ranks, (kvlr + rope, H),
            (Piece(kv_a, ((0, kvlr + rope), (0, H)), ((0, kvlr + rope), (0, H))),),
            name=kv_a,
        )
    b.replicated(f"{a}.kv_a_layernorm.weight", (kvlr,))
    kvb = f"{a}.kv_b_proj.weight"
    w2 = hl * (nope + vd)
    b.row_stack(f"{a}.kv_b_proj", lambda r: ((kvb, r * w2, (r + 1) * w2),), kvlr)
    b.col_shard(f"{a}.o_proj", f"{a}.o_proj.weight", H, nh * vd)
