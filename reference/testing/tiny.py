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
  ``MODELS["qwen3_moe_staged"]``) and tests/engines/vllm/test_backend.py (``WORLDS["host_path"]``).
- :data:`TINY_QWEN3`: ``qwen3-0.6b`` (``Qwen3ForCausalLM``: dense, tied embeddings), 2 layers,
  hidden 256, FFN 512, 4 query / 2 KV heads of 64, vocabulary 1024. Used by
  tests/engines/vllm/test_engine.py (``MODELS["qwen3"]``), tests/engines/vllm/test_backend.py
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


def override_args(overrides: Mapping[str, object]) -> list[str]:
    """The ``weight-transfer`` command-line form of ``overrides``: ``["--override", "k=v", ...]``
    in the mapping's order (``str(v)`` for each value; a bool or a float prints as Python writes
    it). A fresh list each call."""
    return [a for k, v in overrides.items() for a in ("--override", f"{k}={v}")]
