"""The receiving side: a minimal inference engine with vLLM's layouts and load_weights semantics
(the oracle the reference transfer is verified against)."""
from .engine import (
    Engine,
    UpdateInProgress,
    dequantize_block_fp8,
    engine_tensor_metas,
    expected_from_checkpoint,
    quantize_block_fp8,
    read_consistent,
)

__all__ = [
    "Engine",
    "UpdateInProgress",
    "dequantize_block_fp8",
    "engine_tensor_metas",
    "expected_from_checkpoint",
    "quantize_block_fp8",
    "read_consistent",
]
