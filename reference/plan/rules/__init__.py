"""Per-family vLLM shard rules (one module per model family, like torchtitan's state-dict
adapters): :mod:`.dense` (Llama / Qwen3 GQA attention and MLP), :mod:`.moe` (Qwen3-MoE and
DeepSeek experts), :mod:`.mla` (DeepSeek-V3 / Kimi-K2 attention), over the shared constructors
of :mod:`.base`. :func:`weight_transfer.plan.recipes.build_recipes` walks a model's layers and calls
them."""
