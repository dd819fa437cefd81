"""The Triton FP8 block quantizer, byte for byte against the CPU torch reference.

On the CPU through Triton's interpreter (``TRITON_INTERPRET=1``, numpy underneath: the same
kernel source, run in Python), and on a GPU with the compiled kernel where there is one.
Skipped, with the reason, when triton is not installed (``pip install -e .[triton]``).

The interpreter must be chosen before triton is first imported (triton.language's own helpers
are decorated at import), so the interpreter cases run in a child process: this file run as a
module (``TRITON_INTERPRET=1 python -m tests.convert.test_quant_triton`` from the checkout) checks every case and prints
one line per case.
"""
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT
from weight_transfer.convert.quant import (
    quantize_fp8_block,
    quantize_fp8_block_reference,
    scale_shape,
)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().cpu()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def check(fn, x: torch.Tensor) -> None:
    q, s = fn(x)
    rq, rs = quantize_fp8_block_reference(x.cpu())
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and q.device == x.device
    assert s.shape == scale_shape(tuple(x.shape)) and s.dtype == torch.float32
    assert torch.equal(bits(q), bits(rq)), f"q differs at {(bits(q) != bits(rq)).nonzero()[:5].tolist()}"
    assert torch.equal(bits(s), bits(rs)), f"scale differs at {(bits(s) != bits(rs)).nonzero()[:5].tolist()}"


def rand(shape, seed=0, dtype=torch.bfloat16, std=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * std).to(dtype)


def special(dtype):
    """Zeros, -0, values under the 1e-12 floor, subnormals, the dtype's max, FP8 rounding ties
    (scale exactly 2^0), inf and NaN blocks, in a [3, 256, 200] slab with ragged edges."""
    fi = torch.finfo(dtype)
    x = rand((3, 256, 200), seed=1, dtype=torch.float32)
    x[0, :128, :128] = 0.0
    x[0, :128, 128:] = -0.0
    x[0, 128:, :128] = 1e-13
    x[0, 128:, 128:] = fi.smallest_normal / 4 if dtype == torch.float32 else 1e-39
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    mids = (codes[:-1] + codes[1:]) / 2
    ties = torch.cat([codes, mids, -mids, torch.nextafter(mids, torch.zeros_like(mids))])
    blk = torch.zeros(128, 128)
    blk.view(-1)[: ties.numel()] = ties
    blk[127, 127] = 448.0  # scale exactly 1: the e4m3 rounding itself at each tie
    x[1, :128, :128] = blk
    x[1, 128:, :] = rand((128, 200), seed=2, dtype=torch.float32) * 1e30
    x[1, 200, 150] = fi.max
    x[1, 201, 151] = -fi.max
    x[2, 3, 3] = float("inf")
    x[2, 5, 130] = float("-inf")
    x[2, 6, 131] = float("-inf")
    x[2, 130, 2] = float("nan")
    x[2, 140, 150] = -float("nan")
    x[2, 141, 151] = float("inf")
    x = x.to(dtype)
    # NaN patterns (quiet, signalling, negative, all ones) in one block: the reference's scale
    # is the canonical NaN for each, q is 0x7F with x's sign
    pats = [0x7FC0, 0xFFC0, 0x7FFF, 0xFFFF, 0x7F81, 0xFF81] if dtype == torch.bfloat16 else \
        [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF800001]
    iv = x.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
    for k, p in enumerate(pats):
        iv[2, 150 + k, 10 + 3 * k] = p - (1 << (8 * x.element_size())) if p >> (8 * x.element_size() - 1) else p
    return x


def cases(big: bool = False):
    """(name, tensor) pairs on the CPU: odd shapes, special values, every bf16 pattern, strided
    and float16 inputs; ``big`` adds GPU-sized ones."""
    for dtype in (torch.bfloat16, torch.float32):
        d = str(dtype).split(".")[1]
        for shape in [(1, 1), (5, 130), (129, 127), (128, 128), (200, 300), (2, 130, 257)]:
            yield f"{d} {shape}", rand(shape, seed=sum(shape), dtype=dtype)
        yield f"{d} special values", special(dtype)
        if big:
            yield f"{d} (4096, 7168)", rand((4096, 7168), seed=5, dtype=dtype)
            yield f"{d} (3, 1000, 1030)", rand((3, 1000, 1030), seed=6, dtype=dtype)
    pats = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = pats[torch.isfinite(pats)]
    x = finite[torch.randperm(finite.numel(), generator=torch.Generator().manual_seed(0))]
    yield "every finite bf16 pattern", torch.cat([x, x[: -x.numel() % 65536]]).reshape(256, 256)
    base = rand((300, 260), seed=3)
    yield "row stride != K", base[:, 5:200]
    yield "transposed", base.t()
    yield "float16 input", rand((130, 140), seed=4, dtype=torch.float16, std=3.0)


def main() -> int:
    """Run every case through weight_transfer.convert.quant_triton on this process's terms (the interpreter
    when TRITON_INTERPRET=1); one line per case; exit status 1 if any differs."""
    from weight_transfer.convert.quant_triton import quantize_fp8_block_triton

    failed = 0
    for name, x in cases():
        try:
            check(quantize_fp8_block_triton, x)
            print(f"ok   {name}")
        except AssertionError as e:
            failed += 1
            print(f"FAIL {name}: {e}")
    for bad, kw, msg in ((torch.ones(4), {}, "2 dims"), (torch.ones(4, 4), {"block": 96}, "power of two")):
        try:
            quantize_fp8_block_triton(bad, **kw)
            failed += 1
            print(f"FAIL rejects {msg}: no error")
        except ValueError as e:
            ok = msg in str(e)
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} rejects {msg}: {e}")
    return 1 if failed else 0


@pytest.mark.triton
def test_interpreter_matches_reference():
    pytest.importorskip("triton", reason="triton not installed (pip install -e .[triton])")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "tests.convert.test_quant_triton"], capture_output=True, text=True, env=env, cwd=ROOT, check=False,
                       timeout=500)
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert len([l for l in lines if l.startswith("ok ")]) == len(list(cases())) + 2, r.stdout


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and a CUDA build of torch")
def test_gpu_compiled_kernel():
    pytest.importorskip("triton", reason="triton not installed (pip install -e .[triton])")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 in this process: the compiled kernel is not in use")
    from weight_transfer.convert.quant_triton import quantize_fp8_block_triton

    for _name, x in cases(big=True):
        x = x.cuda()
        check(quantize_fp8_block_triton, x)
        check(lambda t: quantize_fp8_block(t, impl="triton"), x)
        check(lambda t: quantize_fp8_block(t, impl="auto"), x)


if __name__ == "__main__":
    sys.exit(main())
