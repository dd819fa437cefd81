"""An unmodified vLLM engine as the receiving side (see ``engines/vllm/engine.py``).

Importing this package does not import vLLM; :class:`VllmEngine` does, when constructed.
Install with ``make vllm`` (the ``.[vllm]`` extra plus the torchvision fix, see README).
"""
from weight_transfer.engines.vllm.checkpoint import hf_config, write_checkpoint
from weight_transfer.engines.vllm.engine import EXTENSION, VllmEngine, vllm_available, vllm_version
from weight_transfer.engines.vllm.worker.runtime import RuntimeLayout, RuntimeTarget, retarget, runtime_layout

__all__ = ["EXTENSION", "RuntimeLayout", "RuntimeTarget", "VllmEngine", "hf_config", "retarget",
           "runtime_layout", "vllm_available", "vllm_version", "write_checkpoint"]
