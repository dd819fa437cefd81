"""Per-tensor and per-channel FP8 quantizers (torch reference): the checkpoint formats of vLLM's
``Fp8Config`` without ``weight_block_size`` and of its compressed-tensors FP8 ``"channel"`` scheme.

Both store a linear weight ``W`` ``[N, K]`` as ``float8_e4m3fn`` plus a float32 ``weight_scale``
beside it (the dequantized value is ``q * weight_scale``):

- **per-tensor** (``quantization_config`` ``{"quant_method": "fp8", "activation_scheme":
  "dynamic"}`` with an FP8-serialized checkpoint; vLLM's ``Fp8LinearMethod`` with a
  ``PerTensorScaleParameter``, one scale per logical shard of a fused layer: ``qkv_proj`` holds 3,
  ``gate_up_proj`` 2): one scale per checkpoint tensor, of shape ``[]`` (0-dim) as
  FP8 checkpoints store it (e.g. the per-tensor checkpoints llm-compressor and AutoFP8 write);
- **per-channel** (``{"quant_method": "compressed-tensors", "format": "float-quantized", ...
  "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": true}}``;
  vLLM's ``CompressedTensorsW8A8Fp8`` with a ``ChannelQuantScaleParameter``): one scale per
  output row, of shape ``[N, 1]``.

The arithmetic is the block quantizer's (:mod:`weight_transfer.convert.quant`, docs/LAYOUTS.md) over
another domain -- the whole tensor, or each whole row::

    x     = tensor -> float32
    amax  = max |x| over the domain                               (float32)
    scale = max(amax, 1e-12) / 448.0                             (float32)
    q     = clamp(x / scale, -448, 448).to(float8_e4m3fn)        (true division)

The same functions make the oracle's FP8 checkpoint (:func:`weight_transfer.engines.vllm.trace.fp8.fp8_checkpoint`)
and the transfer's outputs (:func:`weight_transfer.convert.transforms.apply_transform`), so the bytes a
recipe writes are those vLLM's ``load_weights`` makes of that checkpoint.
"""
from __future__ import annotations

import torch

from .quant import FP8_MAX, SCALE_EPS

__all__ = ["quantize_fp8_tensor_reference", "quantize_fp8_channel_reference", "dequantize_fp8_scaled"]


def _quantize(xf: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.clamp_min(amax, SCALE_EPS) / FP8_MAX
    q = torch.clamp(xf / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def quantize_fp8_tensor_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 of ``x`` (any shape, any floating dtype, widened to float32 exactly):
    ``(q, scale)``, ``q`` of ``x``'s shape in ``float8_e4m3fn`` (contiguous) and ``scale`` a 0-dim
    float32 tensor, ``max(amax(|x|), 1e-12) / 448`` (module docstring). ValueError for an empty
    ``x``."""
    if x.numel() == 0:
        raise ValueError(f"quantize_fp8_tensor: empty tensor of shape {tuple(x.shape)}")
    xf = x.to(torch.float32)
    return _quantize(xf, xf.abs().amax())


def quantize_fp8_channel_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8 of ``x`` ``[..., N, K]``: ``(q, scale)``, ``q`` of ``x``'s shape in
    ``float8_e4m3fn`` (contiguous) and ``scale`` ``[..., N, 1]`` float32, each row's
    ``max(amax(|row|), 1e-12) / 448`` over all its ``K`` columns (module docstring). ValueError for
    fewer than 2 dims or ``K == 0``."""
    if x.dim() < 2 or x.shape[-1] == 0:
        raise ValueError(f"quantize_fp8_channel: need [..., N, K] with K > 0, got shape {tuple(x.shape)}")
    xf = x.to(torch.float32)
    return _quantize(xf, xf.abs().amax(dim=-1, keepdim=True))


def dequantize_fp8_scaled(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` in ``dtype``: the inverse of either quantizer (``scale`` 0-dim, ``[1]`` or
    ``[..., N, 1]``, broadcast)."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)
