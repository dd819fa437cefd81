"""Reference FP8 block quantizer (DeepSeek-V3 ``weight_scale_inv`` format).

DeepSeek-V3 / Kimi-K2 serve their linear weights as ``float8_e4m3fn`` with one float32 scale
per 128x128 block of the ``[out_features, in_features]`` matrix, stored next to the weight as
``<name>.weight_scale_inv`` of shape ``[ceil(N/128), ceil(K/128)]`` (the dequantized value is
``q * weight_scale_inv``; edge blocks are zero padded). See the ``quantization_config`` of
https://huggingface.co/deepseek-ai/DeepSeek-V3 (``"weight_block_size": [128, 128]``).

The arithmetic follows ``docs/LAYOUTS.md`` bit for bit::

    x     = tensor -> float32, zero padded to a multiple of 128 in the last two dims
    amax  = max |x_b| over each 128x128 block b                   (float32)
    scale = max(amax, 1e-12) / 448.0                             (float32)
    q_b   = clamp(x_b / scale, -448, 448).to(float8_e4m3fn)      (true division)

Leading dimensions are batched (an expert slab ``[El, N, K]`` gets a scale ``[El, nb, kb]``,
each slot quantized on its own). Everything is vectorized over blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
SCALE_EPS = 1e-12
"""Floor of a block's amax, so an all-zero block gets a tiny positive scale instead of 0."""
QUANT_BLOCK = 128
"""FP8 block size in elements per dim (DeepSeek-V3 ``weight_block_size`` [128, 128]); the
planner cuts FP8 row bands at multiples of it."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``)."""
    return -(-a // b)


def scale_shape(shape: tuple[int, ...], block: int = QUANT_BLOCK) -> tuple[int, ...]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape``: last two dims divided by
    ``block``, rounded up; leading dims unchanged."""
    if len(shape) < 2:
        raise ValueError(f"fp8 block quantization needs >= 2 dims, got shape {tuple(shape)}")
    return (*shape[:-2], cdiv(shape[-2], block), cdiv(shape[-1], block))


def quantize_fp8_block(x: torch.Tensor, block: int = QUANT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[..., N, K]`` to FP8 e4m3 with one float32 scale per ``block x block``
    block of the last two dims.

    Returns ``(q, scale)``: ``q`` of ``x``'s shape in ``torch.float8_e4m3fn`` (contiguous) and
    ``scale`` ``[..., ceil(N/block), ceil(K/block)]`` float32, the DeepSeek-V3
    ``weight_scale_inv``. ``x`` may be any floating dtype and need not be contiguous; callers
    that serve BF16 pass the BF16 tensor (it is widened to float32 exactly).
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8_block: need >= 2 dims, got shape {tuple(x.shape)}")
    if x.device.type == "cpu":
        return _quantize_banded(x, block)
    *lead, N, K = x.shape
    nb, kb = cdiv(N, block), cdiv(K, block)
    xf = x.to(torch.float32)
    if nb * block != N or kb * block != K:
        xf = F.pad(xf, (0, kb * block - K, 0, nb * block - N))
    xb = xf.reshape(*lead, nb, block, kb, block)
    amax = xb.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.clamp_min(amax, SCALE_EPS) / FP8_MAX
    q = torch.clamp(xb / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(*lead, nb * block, kb * block)
    if nb * block != N or kb * block != K:
        q = q[..., :N, :K]
    return q.contiguous(), scale.contiguous()


def _quantize_banded(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU path: the same arithmetic one 128-row band at a time, in reused float32 buffers
    that stay in cache (5x the whole-tensor version's throughput on this project's CPUs; same
    bytes, tested). GPUs take the vectorized path."""
    *lead, N, K = x.shape
    nb, kb = cdiv(N, block), cdiv(K, block)
    x3 = x.reshape(-1, N, K)
    q = torch.empty((x3.shape[0], N, K), dtype=torch.float8_e4m3fn)
    scale = torch.empty((x3.shape[0], nb, kb), dtype=torch.float32)
    buf = torch.zeros(block, kb * block, dtype=torch.float32)
    tmp = torch.empty_like(buf)
    for l in range(x3.shape[0]):
        for i in range(nb):
            r0, r1 = i * block, min(N, (i + 1) * block)
            n = r1 - r0
            if n < block:
                buf.zero_()
            band = buf[:n]
            band[:, :K].copy_(x3[l, r0:r1])
            torch.abs(buf, out=tmp)
            s = scale[l, i]
            torch.amax(tmp.view(block, kb, block), dim=(0, 2), out=s)
            s.clamp_(min=SCALE_EPS).div_(FP8_MAX)
            band.view(n, kb, block).div_(s.view(1, kb, 1)).clamp_(-FP8_MAX, FP8_MAX)
            q[l, r0:r1].copy_(band[:, :K])
    return q.reshape(*lead, N, K), scale.reshape(*lead, nb, kb)


def dequantize_fp8_block(
    q: torch.Tensor, scale: torch.Tensor, block: int = QUANT_BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8_block`: ``q * weight_scale_inv`` broadcast over each
    block, in ``dtype`` (float32 by default)."""
    *lead, N, K = q.shape
    nb, kb = cdiv(N, block), cdiv(K, block)
    if tuple(scale.shape) != (*lead, nb, kb):
        raise ValueError(
            f"dequantize_fp8_block: scale shape {tuple(scale.shape)} does not match weight "
            f"{tuple(q.shape)} (expected {(*lead, nb, kb)})"
        )
    s = scale.to(torch.float32).repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return (q.to(torch.float32) * s[..., :N, :K]).to(dtype)
