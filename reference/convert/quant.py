"""FP8 block quantizer (DeepSeek-V3 ``weight_scale_inv`` format): a fast path per device and
the torch reference that they are tested against byte for byte.

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
each slot quantized on its own).

Implementations (:func:`quantize_fp8_block`'s ``impl``):

- ``"torch"``: :func:`quantize_fp8_block_reference`, the arithmetic above in torch ops (on the
  CPU one 128-row band at a time in reused buffers). The oracle of the other two.
- ``"native"`` (CPU default): a C kernel (``_fp8_cpu.c``) compiled on first use with the
  system C compiler and loaded with ctypes; 5-7x the torch path, 50-65% of a same-run
  ``memcpy`` of the BF16 input on one thread (``weight-transfer bench-quant``,
  results/quant_bench.csv). Hand-written because torch's own kernels
  cannot get there: measured on this project's CPU (one thread, ``[4096, 7168]`` BF16), the
  ``float32 -> float8_e4m3fn`` cast alone (``Tensor.copy_``) takes 3.2x the memcpy of the BF16
  input, before any amax or division; and ``torch.compile`` of the whole quantizer (Inductor's
  C++ backend) took 92 s to compile and ran at 21% of memcpy. The kernel reads each band twice
  (amax, then quantize), converts with c10's own e4m3 rounding written branch-free, and hands
  bands holding inf/NaN back to the torch reference, so every byte is the reference's (tested,
  tests/convert/test_transforms.py). The call releases the GIL (ctypes), so the executor's other stage
  threads run meanwhile. The built library is cached per source, flags and CPU in
  ``$WT_CACHE_DIR`` or ``~/.cache/weight-transfer`` (a temporary folder if neither is
  writable); the first build takes about a second. Set ``WT_FP8_NATIVE=0`` to use the torch
  path instead; without a C compiler the torch path is used (:func:`native_status` says why).
- ``"triton"`` (CUDA default when Triton is installed): :mod:`weight_transfer.convert.quant_triton`.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F

from ..native.build import NativeKernel

FP8_MAX = 448.0
"""Largest finite ``float8_e4m3fn`` value."""
SCALE_EPS = 1e-12
"""Floor of a block's amax, so an all-zero block gets a tiny positive scale instead of 0."""
QUANT_BLOCK = 128
"""FP8 block size in elements per dim (DeepSeek-V3 ``weight_block_size`` [128, 128]); the
planner cuts FP8 row bands at multiples of it."""
IMPLS = ("auto", "native", "torch", "triton")
"""Values of :func:`quantize_fp8_block`'s ``impl``."""


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``)."""
    return -(-a // b)


def scale_shape(shape: tuple[int, ...], block: int = QUANT_BLOCK) -> tuple[int, ...]:
    """Shape of ``weight_scale_inv`` for a weight of ``shape``: last two dims divided by
    ``block``, rounded up; leading dims unchanged."""
    if len(shape) < 2:
        raise ValueError(f"fp8 block quantization needs >= 2 dims, got shape {tuple(shape)}")
    return (*shape[:-2], cdiv(shape[-2], block), cdiv(shape[-1], block))


def quantize_fp8_block(
    x: torch.Tensor, block: int = QUANT_BLOCK, *, impl: str = "auto",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[..., N, K]`` to FP8 e4m3 with one float32 scale per ``block x block``
    block of the last two dims.

    Returns ``(q, scale)``: ``q`` of ``x``'s shape in ``torch.float8_e4m3fn`` (contiguous) and
    ``scale`` ``[..., ceil(N/block), ceil(K/block)]`` float32, the DeepSeek-V3
    ``weight_scale_inv``, on ``x``'s device. ``x`` may be any floating dtype and need not be
    contiguous; callers that serve BF16 pass the BF16 tensor (it is widened to float32 exactly).

    ``impl``: ``"auto"`` (CPU: the C kernel if it builds, else torch; CUDA: Triton if
    installed, else torch), ``"native"``, ``"triton"`` or ``"torch"`` (the reference). All give
    the same bytes (the module docstring says what each is). Raises ``ValueError`` for fewer
    than 2 dims or an unknown ``impl``, ``RuntimeError`` when a named ``impl`` is unavailable
    here (the message says why).

    ``out``: ``(q, scale)`` tensors to write the result into (contiguous, the shapes and dtypes
    above, on ``x``'s device; e.g. views of the executor's registered output pool) and return;
    the CPU paths write there directly, the GPU paths copy their result in. ValueError when
    they do not match.
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8_block: need >= 2 dims, got shape {tuple(x.shape)}")
    if impl not in IMPLS:
        raise ValueError(f"quantize_fp8_block: impl {impl!r} is not one of {IMPLS}")
    if out is not None:
        _check_out(x, block, out)
    if impl == "torch" or x.numel() == 0:
        return _into(out, *quantize_fp8_block_reference(x, block, out=out))
    if x.device.type == "cpu" and impl in ("auto", "native"):
        lib = _native_lib()
        if lib is not None:
            return _quantize_native(lib, x, block, out)
        if impl == "native":
            raise RuntimeError(f"quantize_fp8_block: native CPU kernel unavailable: {native_status()}")
    elif x.device.type == "cuda" and impl in ("auto", "triton"):
        try:
            from .quant_triton import quantize_fp8_block_triton
        except ImportError as e:
            if impl == "triton":
                raise RuntimeError(f"quantize_fp8_block: triton unavailable: {e}") from e
        else:
            return _into(out, *quantize_fp8_block_triton(x, block))
    elif impl != "auto":
        raise RuntimeError(f"quantize_fp8_block: impl {impl!r} does not run on {x.device}")
    return _into(out, *quantize_fp8_block_reference(x, block, out=out))


def _check_out(x: torch.Tensor, block: int, out) -> None:
    """``out`` is ``(q, scale)`` of the result's shapes and dtypes, contiguous, on ``x``'s device."""
    q, s = out
    want = ((tuple(x.shape), torch.float8_e4m3fn), (scale_shape(tuple(x.shape), block), torch.float32))
    for name, t, (shape, dt) in zip(("q", "scale"), (q, s), want):
        if tuple(t.shape) != shape or t.dtype != dt or not t.is_contiguous() or t.device != x.device:
            raise ValueError(f"quantize_fp8_block: out {name} is {tuple(t.shape)} {t.dtype} on {t.device} "
                             f"(contiguous: {t.is_contiguous()}), need {shape} {dt} contiguous on {x.device}")


def _into(out, q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``, or ``out`` with them copied in (skipped when they already are ``out``)."""
    if out is None:
        return q, s
    for dst, src in zip(out, (q, s)):
        if dst.data_ptr() != src.data_ptr():
            dst.copy_(src)
    return out


def quantize_fp8_block_reference(
    x: torch.Tensor, block: int = QUANT_BLOCK, *, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference arithmetic in torch ops (the oracle of the fast paths): on the CPU one
    128-row band at a time (:func:`_quantize_banded`), elsewhere vectorized over all blocks.
    Same arguments and returns as :func:`quantize_fp8_block` (``out``: the CPU path writes
    there; elsewhere the caller copies)."""
    if x.dim() < 2:
        raise ValueError(f"quantize_fp8_block: need >= 2 dims, got shape {tuple(x.shape)}")
    if x.device.type == "cpu":
        return _quantize_banded(x, block, out)
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


# --------------------------------------------------------------------------------------------
# native CPU kernel (_fp8_cpu.c through ctypes)

def _declare_fp8(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for fn in (lib.fp8_block_bf16, lib.fp8_block_f32):
        fn.argtypes = [ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr]
        fn.restype = i64
    lib.fp8_check_bf16_division.argtypes = [ctypes.c_uint32] * 3 + [ctypes.POINTER(i64)]
    lib.fp8_check_bf16_division.restype = i64


_CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11")
_KERNEL = NativeKernel(Path(__file__).with_name("_fp8_cpu.c"), stem="fp8_cpu", env="WT_FP8_NATIVE",
                       flag_sets=(_CFLAGS, tuple(f for f in _CFLAGS if f != "-march=native")), libs=("-lm",),
                       declare=_declare_fp8)
"""The native kernel (built and cached by :class:`weight_transfer.native.build.NativeKernel`; without
``-march=native`` where the compiler refuses it)."""


def _native_lib() -> ctypes.CDLL | None:
    """The loaded kernel, or None (reason in :func:`native_status`). Built once per process."""
    return _KERNEL.lib()


def native_status() -> str:
    """``"ok"`` when the native CPU kernel is in use, else why not (no compiler, build error,
    ``WT_FP8_NATIVE=0``)."""
    return _KERNEL.status()


def _quantize_native(lib: ctypes.CDLL, x: torch.Tensor, block: int, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU, through the C kernel; bands it flags (inf/NaN inside) are redone by the reference.
    ``out``: ``(q, scale)`` written in place (checked by the caller)."""
    *lead, N, K = x.shape
    nb, kb = cdiv(N, block), cdiv(K, block)
    if x.dtype not in (torch.bfloat16, torch.float32):
        x = x.to(torch.float32)  # what the reference does first; exact for fp16, same rounding for fp64
    x3 = x.reshape(-1, N, K)
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    L = x3.shape[0]
    if out is None:
        q = torch.empty((L, N, K), dtype=torch.float8_e4m3fn)
        scale = torch.empty((L, nb, kb), dtype=torch.float32)
    else:
        q, scale = out[0].view(L, N, K), out[1].view(L, nb, kb)
    bad = torch.empty((L, nb), dtype=torch.uint8)
    if x3.dtype == torch.bfloat16:
        fn, acc = lib.fp8_block_bf16, torch.empty(K, dtype=torch.int16)
    else:
        fn, acc = lib.fp8_block_f32, torch.empty(K, dtype=torch.int32)
    nbad = fn(x3.data_ptr(), L, N, K, x3.stride(1), x3.stride(0), block,
              q.data_ptr(), scale.data_ptr(), bad.data_ptr(), acc.data_ptr())
    if nbad:
        for l, i in bad.nonzero().tolist():
            r0, r1 = i * block, min(N, (i + 1) * block)
            qi, si = _quantize_banded(x3[l, r0:r1], block)
            q[l, r0:r1].copy_(qi)
            scale[l, i].copy_(si[0])
    return q.reshape(*lead, N, K), scale.reshape(*lead, nb, kb)


def _quantize_banded(x: torch.Tensor, block: int, out=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference, CPU: the same arithmetic one 128-row band at a time, in reused float32
    buffers that stay in cache (5x the whole-tensor version's throughput on this project's
    CPUs; same bytes, tested). GPUs take the vectorized path. ``out``: ``(q, scale)`` written
    in place."""
    *lead, N, K = x.shape
    nb, kb = cdiv(N, block), cdiv(K, block)
    x3 = x.reshape(-1, N, K)
    if out is None:
        q = torch.empty((x3.shape[0], N, K), dtype=torch.float8_e4m3fn)
        scale = torch.empty((x3.shape[0], nb, kb), dtype=torch.float32)
    else:
        q, scale = out[0].view(x3.shape[0], N, K), out[1].view(x3.shape[0], nb, kb)
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
