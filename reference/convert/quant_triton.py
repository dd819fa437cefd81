"""FP8 e4m3 block quantization on the GPU, in Triton (DeepSeek-V3 ``weight_scale_inv`` format).

One program per 128x128 block: it loads the block once (masked at the edges, zero padding),
takes amax on the bit patterns (sign bit cleared: the integer max of those is the float max of
the magnitudes, and a NaN, whose pattern is above the infinity's, wins as ``torch.amax``'s does),
computes ``scale = max(amax, 1e-12) / 448`` and ``q = e4m3(clamp(|x| / scale, 448))`` with the
sign of ``x``, and writes the bytes. The arithmetic is :mod:`weight_transfer.convert.quant`'s, bit for bit:

- the division is IEEE round-to-nearest (``tl.math.div_rn``; Triton's ``/`` is approximate);
- the e4m3 rounding is c10's ``fp8e4m3fn_from_fp32_value`` in integer ops (round to nearest
  even, subnormals by adding 2^14), not the hardware ``cvt``, so the interpreter
  (``TRITON_INTERPRET=1``, CPU) and the GPU compute the same bytes;
- libdevice's flush-to-zero (Triton's default) cannot change a byte: a subnormal ``x`` or
  quotient is far below e4m3's smallest subnormal (2^-9), and scales are >= 1e-12/448;
- blocks holding inf/NaN get the CPU reference's bytes as x86 computes them: a block with
  +-inf has scale inf, q = 0xFF where x is +-inf (inf/inf is x86's negative default NaN) and
  a signed zero elsewhere; a block with NaN has scale 0x7FC00000 (the canonical NaN, what the
  reference's ``amax`` -> ``clamp_min`` -> division gives for every NaN pattern tested) and
  q = 0x7F, or 0x7F with x's sign where x is NaN.

Tested bit for bit against the CPU reference in tests/convert/test_quant_triton.py, on the CPU through
the Triton interpreter, and on a GPU where there is one. Speed target: 60% of a same-run
device-to-device copy (``weight-transfer bench-quant --device cuda``; scripts/gpu_check.sh).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["quantize_fp8_block_triton"]


@triton.jit
def _fp8_block_kernel(x_ptr, q_ptr, s_ptr, N, K, stride_l, stride_n, nb, kb,
                      BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # l * nb + i
    j = tl.program_id(1)
    l = pid // nb
    i = pid % nb
    rows = i * BLOCK + tl.arange(0, BLOCK)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    src = x_ptr + l.to(tl.int64) * stride_l + rows[:, None].to(tl.int64) * stride_n + cols[None, :]
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)

    xbits = x.to(tl.int32, bitcast=True)
    abits = xbits & 0x7FFFFFFF
    sign = (xbits >> 24) & 0x80
    mbits = tl.max(tl.max(abits, axis=1), axis=0)  # amax, as a bit pattern
    amax = mbits.to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(tl.where(amax < 1e-12, 1e-12, amax), 448.0)

    # finite block: e4m3 of min(|x| / scale, 448), c10's rounding
    a = tl.minimum(tl.math.div_rn(abits.to(tl.float32, bitcast=True), scale), 448.0)
    b = a.to(tl.int32, bitcast=True)
    d = (a + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)  # subnormal e4m3 (a < 2^-6)
    n = (b + ((7 - 127) << 23) + 0x7FFFF + ((b >> 20) & 1)) >> 20  # normal e4m3
    q = tl.where(b < (121 << 23), d, n) | sign

    # blocks with inf / NaN: what the CPU reference's arithmetic gives on x86
    INF: tl.constexpr = 0x7F800000
    q_inf = tl.where(abits == INF, 0xFF, sign)
    q_nan = tl.where(abits > INF, 0x7F | sign, 0x7F)
    q = tl.where(mbits < INF, q, tl.where(mbits == INF, q_inf, q_nan))
    sbits = tl.where(mbits > INF, 0x7FC00000, scale.to(tl.int32, bitcast=True))

    dst = q_ptr + (l.to(tl.int64) * N + rows[:, None]) * K + cols[None, :]
    tl.store(dst, q.to(tl.uint8), mask=mask)
    tl.store(s_ptr + pid * kb + j, sbits.to(tl.float32, bitcast=True))


def quantize_fp8_block_triton(
    x: torch.Tensor, block: int = 128, *, num_warps: int = 8
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[..., N, K]`` (any float dtype; BF16 and float32 are read as they are,
    others are widened to float32 first, as the reference does) on its device.

    Returns ``(q, scale)``: ``q`` ``float8_e4m3fn`` of ``x``'s shape (contiguous) and ``scale``
    float32 ``[..., ceil(N/block), ceil(K/block)]`` (``weight_scale_inv``), byte-identical to
    :func:`weight_transfer.convert.quant.quantize_fp8_block_reference`. ``block`` must be a power of two
    (Triton's ``tl.arange``). Raises ``ValueError`` for fewer than 2 dims or such a ``block``.
    Runs wherever Triton runs: CUDA tensors on a GPU; CPU tensors under ``TRITON_INTERPRET=1``.
    ``num_warps``: warps per 128x128 block's program (the benchmark also times 4 and 16; the
    bytes do not depend on it).
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8_block_triton: need >= 2 dims, got shape {tuple(x.shape)}")
    if block <= 0 or block & (block - 1):
        raise ValueError(f"quantize_fp8_block_triton: block must be a power of two, got {block}")
    *lead, N, K = x.shape
    nb, kb = -(-N // block), -(-K // block)
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.to(torch.float32)
    x3 = x.reshape(-1, N, K)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    L = x3.shape[0]
    q = torch.empty((L, N, K), dtype=torch.uint8, device=x.device)
    scale = torch.empty((L, nb, kb), dtype=torch.float32, device=x.device)
    if q.numel():
        _fp8_block_kernel[(L * nb, kb)](x3, q, scale, N, K, x3.stride(0), x3.stride(1), nb, kb,
                                        BLOCK=block, num_warps=num_warps)
    return q.view(torch.float8_e4m3fn).reshape(*lead, N, K), scale.reshape(*lead, nb, kb)
