"""Benchmark: FP8 block quantization throughput beside memcpy, in one run.

    python -m experiments bench-quant [--repeats 5] [--device cpu|cuda] [--out results/quant_bench.csv]

Shapes: a 4096x4096 linear weight, and Kimi-K2's expert shapes (``moe_intermediate_size``
2048, ``hidden_size`` 7168, from reference/configs/kimi-k2.json): the fused ``w13`` slab of one
expert ``[2*2048, 7168]`` and ``w2`` ``[7168, 2048]``. GB/s counts BF16 *input* bytes
(1e9 B/s); memcpy is a same-size ``copy_`` of the BF16 tensor on the same device in the same
run. Both implementations are timed: the trainer-side ``reference.quant`` and the engine's
own loader quantizer (the oracle); their outputs are checked byte-identical. Best of
``--repeats``; on CUDA, timed with events after a warm-up.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

SHAPES = {
    "linear 4096x4096": (4096, 4096),
    "kimi-k2 expert w13 [4096,7168]": (4096, 7168),
    "kimi-k2 expert w2 [7168,2048]": (7168, 2048),
}


def _time(fn, repeats: int, device: str) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def run(repeats: int = 5, device: str = "cpu", threads: int = 1) -> list[dict]:
    from engines.engine import quantize_block_fp8
    from reference.quant import quantize_fp8_block

    torch.set_num_threads(threads)
    rows = []
    for label, shape in SHAPES.items():
        x = (torch.randn(shape, device=device) * 0.02).to(torch.bfloat16)
        y = torch.empty_like(x)
        q1, s1 = quantize_fp8_block(x)
        q2, s2 = quantize_block_fp8(x)
        same = torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
        t_mem = _time(lambda: y.copy_(x), repeats, device)
        t_ref = _time(lambda: quantize_fp8_block(x), repeats, device)
        t_eng = _time(lambda: quantize_block_fp8(x), repeats, device)
        for impl, t in (("memcpy", t_mem), ("reference.quant", t_ref), ("engine loader", t_eng)):
            rows.append({"shape": label, "impl": impl, "device": device, "threads": threads,
                         "bytes": x.nbytes, "seconds": t, "identical": same if impl != "memcpy" else None})
    return rows


@dataclass(kw_only=True, slots=True)
class QuantBenchConfig:
    """Options of ``python -m experiments bench-quant``."""

    repeats: int = 5
    """Timed runs per shape and implementation; the best is reported."""
    device: str = "cpu"
    """``cpu`` or ``cuda``."""
    threads: int = 1
    """torch intra-op threads."""
    out: str = "results/quant_bench.csv"
    """CSV the rows are written to (overwritten)."""

    def __post_init__(self):
        if self.repeats < 1 or self.threads < 1:
            raise ValueError(f"repeats={self.repeats}, threads={self.threads}: both >= 1")


def main(a: QuantBenchConfig) -> int:
    """Run the benchmark, print the table, write ``a.out``; 0 if both quantizers agree."""
    import platform

    import pandas as pd

    rows = run(a.repeats, a.device, a.threads)
    print(f"# FP8 block quantization (128x128, e4m3, weight_scale_inv) vs memcpy, best of {a.repeats}")
    print(f"# host: {platform.node()}  torch {torch.__version__}  device {a.device}  threads {a.threads}")
    print(f"{'shape':>32} {'impl':>16} {'bytes':>12} {'time':>10} {'GB/s':>8} {'vs memcpy':>10} {'same':>6}")
    print(f"{'':>32} {'':>16} {'(B)':>12} {'(ms)':>10} {'(in)':>8} {'(x)':>10} {'':>6}")
    mem = {r["shape"]: r["seconds"] for r in rows if r["impl"] == "memcpy"}
    for r in rows:
        same = "" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        print(f"{r['shape']:>32} {r['impl']:>16} {r['bytes']:>12} {r['seconds'] * 1e3:>10.2f} "
              f"{r['bytes'] / r['seconds'] / 1e9:>8.3f} {r['seconds'] / mem[r['shape']]:>10.1f} {same:>6}")
    ok = all(r["identical"] is not False for r in rows)
    print(f"# reference and engine quantizers byte-identical: {'yes' if ok else 'NO'}")
    pd.DataFrame(rows).to_csv(a.out, index=False)
    print(f"# rows written to {a.out}")
    return 0 if ok else 1
