"""Fixtures of this project's tests, benchmarks and harness, not the transfer itself: the model
catalog (:mod:`.catalog`: published Hugging Face configs of Qwen3, Qwen3-MoE, DeepSeek-V3 and
Kimi-K2 in ``configs/``, their checkpoint parameter lists), deterministic synthetic weights
(:mod:`.weights`) and FSDP2 / DTensor model builders with a synthetic training step
(:mod:`.training`), with :mod:`.hf_specs` (checkpoint parameter lists), :mod:`.replay` (an RL run's
saved steps served as weights) and :mod:`.tiny` (the tiny models the live-vLLM tests start). The library (``weight_transfer``) never imports this package; an embedding
trainer brings its own model and calls :func:`weight_transfer.plan.metadata.collect_metas`.

Imports: ``types``, ``model_config``, ``plan``.
"""
