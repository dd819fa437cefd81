"""Tracing vLLM's own weight loader: which checkpoint bytes land where, for any architecture
vLLM serves (docs/VLLM.md).

- :mod:`.loader`: the trace on a CPU skeleton of the model, turned into recipes;
- :mod:`.fp8`: the same on a model's FP8 checkpoint form (block, per-tensor, per-channel);
- :mod:`.draft`: the draft model of speculative decoding beside the target;
- :mod:`.cache`: traces kept on disk per (model config, layout, vLLM, tracer source);
- :mod:`.publish`: the worker's side, publishing its trace at the backend's init.
"""
