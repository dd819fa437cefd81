"""Dense (Llama / Qwen3) rules: GQA attention with a fused ``qkv_proj`` and the dense MLP's
fused ``gate_up_proj``, as vLLM's ``QKVParallelLinear`` / ``MergedColumnParallelLinear`` shard
them (``docs/LAYOUTS.md``).

- ``self_attn.qkv_proj`` on TP rank r: the rank's query heads, then its KV heads (replicated
  when ``tp > num_key_value_heads``: TP rank r holds KV head ``r // (tp / nkv)``), stacked by
  rows; ``o_proj`` column-sharded; ``q_norm`` / ``k_norm`` replicated.
- ``mlp.gate_up_proj``: the rank's gate rows then its up rows; ``down_proj`` column-sharded.
"""
from __future__ import annotations

from ...types import PlanError
from .base import RecipeBuilder


def attention(b: RecipeBuilder, p: str):
    """Layer ``p``'s Qwen3 GQA attention: ``qkv_proj``, ``o_proj``, ``q_norm``, ``k_norm``."""
    cfg, T = b.cfg, b.T
    H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    qh = b.divide(f"{p}.self_attn num_attention_heads", nh, T)
    if T <= nkv:
        kvr = b.divide(f"{p}.self_attn num_key_value_heads", nkv, T)

        def kv_head0(r):
            return r * kvr
    else:
        rep = T // nkv
        if T % nkv:
            raise PlanError(
                f"layout {b.L.describe()} does not fit {cfg.label}: tp = {T} > "
                f"num_key_value_heads = {nkv} but not a multiple of it ({p}.self_attn.qkv_proj)"
            )
        kvr = 1

        def kv_head0(r):
            return r // rep

    q, k, v = (f"{p}.self_attn.{x}_proj.weight" for x in "qkv")

    def parts(r):
        h0 = kv_head0(r)
        return (
            (q, r * qh * hd, (r + 1) * qh * hd),
            (k, h0 * hd, (h0 + kvr) * hd),
            (v, h0 * hd, (h0 + kvr) * hd),
        )

    b.row_stack(f"{p}.self_attn.qkv_proj", parts, H)
    b.col_shard(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj.weight", H, nh * hd)
    b.replicated(f"{p}.self_attn.q_norm.weight", (hd,))
    b.replicated(f"{p}.self_attn.k_norm.weight", (hd,))


def mlp(b: RecipeBuilder, prefix: str, inter: int):
    """``prefix.gate_up_proj`` (gate rows; up rows of the rank's slice) and ``down_proj``."""
    H = b.cfg.hidden_size
    il = b.divide(f"{prefix} intermediate size", inter, b.T)
    g, u = f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"
    b.row_stack(
        f"{prefix}.gate_up_proj",
        lambda r: ((g, r * il, (r + 1) * il), (u, r * il, (r + 1) * il)),
        H,
    )
    b.col_shard(f"{prefix}.down_proj", f"{prefix}.down_proj.weight", H, inter)
