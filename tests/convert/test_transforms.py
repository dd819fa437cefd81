"""The fast FP8 block quantizers against the torch reference, byte for byte.

The native CPU kernel (reference/convert/_fp8_cpu.c) is compared with ``quantize_fp8_block_reference``
(the oracle, itself tested against a per-block loop in test_quant.py) and with the engine's own
loader quantizer, on odd shapes, edges that are not multiples of 128, zeros, inf/NaN, subnormals,
maximum values, FP8 rounding ties, every BF16 bit pattern, strided inputs and every input dtype.
Skipped with the reason when the kernel cannot be built here (no C compiler).
"""
import ctypes

import pytest
import torch

from tests.helpers import ROOT
from weight_transfer.convert import quant
from weight_transfer.convert.quant import (
    QUANT_BLOCK,
    native_status,
    quantize_fp8_block,
    quantize_fp8_block_reference,
    scale_shape,
)
from weight_transfer.engines.engine import quantize_block_fp8 as engine_quantize

native = pytest.mark.skipif(native_status() != "ok", reason=f"native FP8 kernel: {native_status()}")


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def assert_same(x: torch.Tensor, impl: str = "native", engine: bool = True) -> None:
    q, s = quantize_fp8_block(x, impl=impl)
    rq, rs = quantize_fp8_block_reference(x)
    assert q.shape == x.shape and q.dtype == torch.float8_e4m3fn and q.is_contiguous()
    assert s.shape == scale_shape(tuple(x.shape)) and s.dtype == torch.float32
    assert torch.equal(bits(q), bits(rq)), f"q differs at {(bits(q) != bits(rq)).nonzero()[:5].tolist()}"
    assert torch.equal(bits(s), bits(rs)), f"scale differs at {(bits(s) != bits(rs)).nonzero()[:5].tolist()}"
    if engine:  # an independent implementation (the inference engine's loader)
        eq, es = engine_quantize(x)
        assert torch.equal(bits(q), bits(eq)) and torch.equal(bits(s), bits(es))


def rand(shape, seed=0, dtype=torch.bfloat16, std=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * std).to(dtype)


def test_block_constant():
    assert QUANT_BLOCK == 128


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (5, 1), (127, 129), (129, 127), (128, 128),
                                   (200, 300), (256, 384), (300, 1000), (1000, 130), (3, 130, 257),
                                   (2, 2, 129, 140)])
def test_odd_shapes(shape, dtype):
    assert_same(rand(shape, seed=sum(shape), dtype=dtype))


@native
@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_input_dtypes(dtype):
    assert_same(rand((130, 260), seed=4, dtype=dtype, std=3.0))


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zeros_negative_zero_and_tiny_blocks(dtype):
    x = rand((256, 384), seed=1, dtype=dtype)
    x[:128, :128] = 0.0
    x[:128, 128:256] = -0.0  # negative zeros quantize to 0x80
    x[128:, :128] = 1e-13  # amax below the 1e-12 floor
    x[128:, 128:256] = torch.tensor(-3e-14).to(dtype)
    assert_same(x)
    assert_same(torch.zeros(130, 7, dtype=dtype))
    assert_same(torch.full((130, 7), -0.0, dtype=dtype))


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_subnormals(dtype):
    fi = torch.finfo(dtype)
    x = rand((256, 256), seed=2, dtype=torch.float32) * 0
    x[:128, :128] = torch.linspace(-8, 8, 128 * 128).reshape(128, 128) * fi.smallest_normal / 8
    x[:128, 128:] = rand((128, 128), seed=3, dtype=torch.float32) * 1e-3
    x[:128, 128:][::7, ::3] = fi.smallest_normal / 4  # subnormals beside normals
    x[128:, :] = rand((128, 256), seed=4, dtype=torch.float32)
    x[128:, :][::5, ::11] = fi.smallest_normal / 16
    assert_same(x.to(dtype))


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_max_values(dtype):
    fi = torch.finfo(dtype)
    x = rand((256, 256), seed=5, dtype=dtype, std=1e30)
    x[0, 0] = fi.max
    x[1, 1] = -fi.max
    x[130, 130] = fi.max
    x[129, 0] = -fi.max
    x[128:, :128] = x[128:, :128].sign() * fi.max
    assert_same(x)


@native
def test_rounding_ties_and_bounds():
    """Scale a power of two so x / scale is exact: the FP8 rounding itself is exercised at each
    tie (midpoints between neighbouring e4m3 values, normal and subnormal) and just beside it."""
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    mids = (codes[:-1] + codes[1:]) / 2  # exact in float32
    ys = torch.cat([codes, mids, torch.nextafter(mids, torch.zeros_like(mids)),
                    torch.nextafter(mids, torch.full_like(mids, 1e9))])
    for k in (-20, 0, 7):
        vals = torch.cat([ys, -ys]) * 2.0 ** k
        x = torch.zeros(128, 128)
        x.view(-1)[: vals.numel()] = vals
        x[127, 127] = 448.0 * 2.0 ** k  # amax -> scale exactly 2^k
        assert_same(x, engine=True)


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_inf_and_nan_bands_follow_the_reference(dtype):
    x = rand((3, 300, 400), seed=6, dtype=dtype)
    x[0, 5, 7] = float("inf")
    x[0, 200, 390] = float("-inf")
    x[1, 130, 3] = float("nan")
    x[1, 131, 3] = -float("nan")
    x[2, 299, 399] = float("nan")
    x[2, 0, 0] = float("inf")
    _, s = quantize_fp8_block(x, impl="native")
    assert_same(x, engine=False)  # NaN payloads/signs are the reference's (x86 semantics)
    assert torch.isnan(s[1, 1, 0]) and torch.isinf(s[0, 0, 0])
    assert torch.isfinite(s[0, 1, 0])  # other blocks unaffected


@native
def test_every_bf16_pattern():
    """All 65536 bf16 bit patterns, shuffled into 128x128 blocks, four ways."""
    pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = pats[torch.isfinite(pats)]
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        x = finite[torch.randperm(finite.numel(), generator=g)]
        x = torch.cat([x, x[: -x.numel() % (512 * 128)]]).reshape(-1, 512)
        assert_same(x)
        assert_same(x.reshape(-1, 128, 128)[:, :100, :77])  # edges
    assert_same(pats.reshape(512, 128))  # with inf/NaN: those bands go through the reference


@native
def test_strided_inputs():
    base = rand((300, 520), seed=7)
    assert_same(base[:, 5:400])  # row stride != K
    assert_same(base.t())  # columns not contiguous
    assert_same(base[::2, ::3])
    assert_same(rand((4, 200, 300), seed=8)[1:3, 10:, :250])
    assert_same(rand((200, 300), seed=9).expand(3, 200, 300))  # slab stride 0


@native
def test_bf16_division_exhaustive_sample():
    """The kernel's corrected product equals a true division in every FP8 byte: every bf16 x
    against every 61st bf16 block amax (the slow test below does all of them)."""
    lib = quant._native_lib()
    f32 = ctypes.c_int64()
    assert lib.fp8_check_bf16_division(0, 0x7F80, 61, ctypes.byref(f32)) == 0
    assert f32.value == 0


@native
@pytest.mark.slow
def test_bf16_division_exhaustive_all():
    lib = quant._native_lib()
    f32 = ctypes.c_int64()
    assert lib.fp8_check_bf16_division(0, 0x7F80, 1, ctypes.byref(f32)) == 0
    assert f32.value == 0


@native
def test_prepare_uses_the_native_kernel(monkeypatch):
    """The executor's prepare stage quantizes through weight_transfer.convert.transforms.apply_transform."""
    from weight_transfer.convert.transforms import apply_transform

    calls = []
    real = quant._quantize_native
    monkeypatch.setattr(quant, "_quantize_native", lambda *a: calls.append(1) or real(*a))
    x = rand((256, 256), seed=10)

    from types import SimpleNamespace

    from weight_transfer.convert.layouts import IDENTITY

    class R:  # the attributes apply_transform reads: two outputs (weight, weight_scale_inv) as loaded
        transform = "fp8_block"
        name = "w"
        outputs = (SimpleNamespace(layout=IDENTITY),) * 2

    q, _ = apply_transform(R(), x)
    assert calls and torch.equal(bits(q), bits(quantize_fp8_block_reference(x)[0]))


def test_impl_errors_and_fallback(monkeypatch):
    x = rand((130, 130), seed=11)
    with pytest.raises(ValueError, match="impl"):
        quantize_fp8_block(x, impl="fast")
    with pytest.raises(RuntimeError, match="triton"):
        quantize_fp8_block(x, impl="triton")  # CPU tensor
    monkeypatch.setattr(quant._KERNEL, "loaded", None)
    monkeypatch.setattr(quant._KERNEL, "error", "no C compiler (test)")
    assert native_status() == "no C compiler (test)"
    with pytest.raises(RuntimeError, match="no C compiler"):
        quantize_fp8_block(x, impl="native")
    q, s = quantize_fp8_block(x)  # auto falls back to the reference
    rq, rs = quantize_fp8_block_reference(x)
    assert torch.equal(bits(q), bits(rq)) and torch.equal(bits(s), bits(rs))


def test_disabled_by_environment(tmp_path):
    import subprocess
    import sys

    code = ("from weight_transfer.convert.quant import native_status, quantize_fp8_block; import torch; "
            "quantize_fp8_block(torch.ones(3, 3)); print(native_status())")
    env = {"WT_FP8_NATIVE": "0", "PATH": "/usr/bin:/bin", "WT_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "disabled by WT_FP8_NATIVE=0"


# ---- recipe_outputs(out=): outputs built in given buffers (the executor's output pool) ---------


@pytest.mark.parametrize("quant,dtype", [(None, None), (None, "float32"), ("fp8", None)])
def test_recipe_outputs_into_buffers_same_bytes(quant, dtype):
    """Every recipe of a small model (plain copies, fused bands, casts from fp32 masters, block
    FP8), built into flat uint8 buffers of ``output_nbytes`` each, gives the same bytes as the
    allocating call; ``output_view`` is exactly the recipes whose output is a source's view."""
    from weight_transfer.convert.transforms import output_nbytes, output_view, recipe_outputs
    from weight_transfer.plan import build_recipes
    from weight_transfer.testing.catalog import load_config, param_specs
    from weight_transfer.testing.weights import SyntheticCheckpoint
    from weight_transfer.types import InferenceLayout, dtype_name

    cfg = load_config("qwen3-0.6b", num_hidden_layers=1, vocab_size=500, hidden_size=256, intermediate_size=256,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    src = {n: t for n, t in SyntheticCheckpoint(param_specs(cfg), step=1, seed=0, dtype_override=dtype)}
    recipes = build_recipes(cfg, InferenceLayout(tp=2, quant=quant), source_dtypes={n: dtype_name(t.dtype) for n, t in src.items()})
    views = 0
    recipes = list(recipes)
    for r in recipes:
        want = recipe_outputs(r, src.__getitem__)
        sizes = output_nbytes(r)
        assert sizes == [t.nbytes for t in want], r.name
        v = output_view(r, src.__getitem__)
        if v is not None:
            views += 1
            assert v.data_ptr() == want[0].data_ptr(), r.name  # the output *is* the view
        bufs = [torch.full((n,), 0x5A, dtype=torch.uint8) for n in sizes]
        got = recipe_outputs(r, src.__getitem__, out=bufs)
        for g, w, b in zip(got, want, bufs):
            assert g.data_ptr() == b.data_ptr() and g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), r.name
            assert torch.equal(b, w.contiguous().view(-1).view(torch.uint8)), r.name
    assert views > 0 or dtype == "float32"
    with pytest.raises(ValueError, match="need"):
        recipe_outputs(recipes[0], src.__getitem__, out=[torch.empty(1, dtype=torch.uint8)] * len(recipes[0].outputs))


@pytest.mark.parametrize("layout", ["blocked:16x1", "blocked:16x2", "blocked:32x2", "blocked:4x1", "transposed"])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_assemble_in_layout_one_pass_equals_the_general_path(layout, src_dtype):
    """Issue 43: an expert slot ``[gate rows; up rows]`` (and a zero piece, a short last block)
    built straight into a runtime layout, cast from the fp32 master on the way, has the bytes of
    assemble -> cast -> apply_layout; a piece that cuts a row block falls back, still exact."""
    from weight_transfer.convert.transforms import assemble_in_layout, recipe_outputs
    from weight_transfer.types import Output, Piece, Recipe

    g = torch.Generator().manual_seed(1)
    srcs = {"gate": torch.randn(64, 24, generator=g).to(src_dtype), "up": torch.randn(64, 24, generator=g).to(src_dtype)}
    for cuts in [(48, 96, 112), (48, 96, 100), (40, 96, 112)]:  # aligned, short last block, a cut inside a block
        a, b, n = cuts
        pieces = (Piece("gate", ((0, a), (0, 24)), ((0, 1), (0, a), (0, 24))),
                  Piece("up", ((0, b - a), (0, 24)), ((0, 1), (a, b), (0, 24))),
                  Piece(None, (), ((0, 1), (b, n), (0, 24))))
        rec = Recipe("slot", (0,), (1, n, 24), "bfloat16", pieces, "copy",
                     (Output("w", ((0, 1), (0, n), (0, 24)), "bfloat16", layout),))
        want = recipe_outputs(rec, srcs.__getitem__)[0]
        buf = torch.full((n * 24 * 2,), 0xAB, dtype=torch.uint8)
        got = recipe_outputs(rec, srcs.__getitem__, out=[buf])[0]
        assert torch.equal(buf, want.contiguous().reshape(-1).view(torch.uint8)), (layout, cuts)
        assert got.data_ptr() == buf.data_ptr()
        one_pass = assemble_in_layout(rec, srcs.__getitem__, torch.empty_like(buf))
        bn = 0 if layout == "transposed" else int(layout.split(":")[1].split("x")[0])
        assert (one_pass is not None) == (bn == 0 or (a % bn == 0 and b % bn == 0)), (layout, cuts)
        if one_pass is not None:
            assert torch.equal(one_pass.reshape(-1).view(torch.uint8), buf)
