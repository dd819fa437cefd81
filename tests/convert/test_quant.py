"""FP8 128x128 block quantization (DeepSeek-V3 format): bit-exact against a slow per-block loop
that transcribes docs/LAYOUTS.md literally."""
import math

import pytest
import torch

from weight_transfer.convert.quant import dequantize_fp8_block, quantize_fp8_block, scale_shape


def slow_reference(x: torch.Tensor):
    """LAYOUTS.md, one block at a time, for a 2-D tensor."""
    N, K = x.shape
    nb, kb = math.ceil(N / 128), math.ceil(K / 128)
    xp = torch.zeros(nb * 128, kb * 128, dtype=torch.float32)
    xp[:N, :K] = x.to(torch.float32)
    q = torch.empty(nb * 128, kb * 128, dtype=torch.float8_e4m3fn)
    s = torch.empty(nb, kb, dtype=torch.float32)
    for i in range(nb):
        for j in range(kb):
            blk = xp[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = blk.abs().max()
            scale = torch.maximum(amax, torch.tensor(1e-12, dtype=torch.float32)) / torch.tensor(448.0)
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = torch.clamp(blk / scale, -448, 448).to(torch.float8_e4m3fn)
            s[i, j] = scale
    return q[:N, :K].contiguous(), s


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def _rand(shape, seed=0, dtype=torch.bfloat16, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (200, 300), (1, 5), (129, 127), (64, 1000)])
def test_matches_slow_reference(shape):
    x = _rand(shape, seed=sum(shape))
    q, s = quantize_fp8_block(x)
    rq, rs = slow_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == scale_shape(shape) == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    assert same_bytes(q, rq)
    assert same_bytes(s, rs)


def test_zero_blocks_and_large_values():
    x = _rand((256, 256), seed=3, scale=1000.0)
    x[:128, 128:] = 0  # one all-zero block
    x[200, 5] = 3e38 if x.dtype == torch.float32 else 1e30  # one huge value dominates its block
    q, s = quantize_fp8_block(x)
    rq, rs = slow_reference(x)
    assert same_bytes(q, rq) and same_bytes(s, rs)
    assert s[0, 1].item() == pytest.approx(1e-12 / 448.0, rel=1e-6)
    assert (q[:128, 128:].to(torch.float32) == 0).all()
    assert torch.isfinite(q.to(torch.float32)).all()


def test_batched_experts_each_slot_on_its_own():
    x = _rand((3, 130, 257), seed=7)
    x[1] *= 100  # slot 1 has a very different range: its scales must not leak into slot 0/2
    q, s = quantize_fp8_block(x)
    assert q.shape == x.shape and s.shape == (3, 2, 3)
    for e in range(3):
        rq, rs = slow_reference(x[e])
        assert same_bytes(q[e], rq) and same_bytes(s[e], rs)


def test_non_contiguous_input_and_float32_input():
    base = _rand((300, 200), seed=11, dtype=torch.float32)
    xt = base.t()  # [200, 300], non-contiguous
    q, s = quantize_fp8_block(xt)
    rq, rs = slow_reference(xt.contiguous())
    assert same_bytes(q, rq) and same_bytes(s, rs)


def test_dequantize_roundtrip():
    x = _rand((3, 200, 300), seed=5)
    q, s = quantize_fp8_block(x)
    y = dequantize_fp8_block(q, s)
    xf = x.float()
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 of the block max, plus subnormal floor
    err = (y - xf).abs()
    bound = s.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :200, :300] * 448 / 16 + 1e-6
    assert (err <= bound).all()
    with pytest.raises(ValueError):
        dequantize_fp8_block(q, s[..., :1, :])


def test_rejects_1d():
    with pytest.raises(ValueError):
        quantize_fp8_block(torch.ones(5))


@pytest.mark.parametrize("impl", ["auto", "torch"])
def test_out_buffers_written_in_place_same_bytes(impl):
    """``out=(q, scale)``: the result lands in the given buffers (the executor's pool slots),
    byte-identical to the allocating call; wrong shapes or dtypes are refused."""
    x = torch.randn(2, 200, 300).to(torch.bfloat16)
    q0, s0 = quantize_fp8_block(x, impl=impl)
    q = torch.full(x.shape, 7, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.full(scale_shape(tuple(x.shape)), 7.0)
    q1, s1 = quantize_fp8_block(x, impl=impl, out=(q, s))
    assert q1.data_ptr() == q.data_ptr() and s1.data_ptr() == s.data_ptr()
    assert torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(s.view(torch.int32), s0.view(torch.int32))
    with pytest.raises(ValueError, match="out scale is"):
        quantize_fp8_block(x, out=(q, torch.empty(1)))
    with pytest.raises(ValueError, match="out q is"):
        quantize_fp8_block(x, out=(q.view(torch.uint8), s))
