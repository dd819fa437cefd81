"""Benchmark: FP8 block quantization throughput beside memcpy, in one run.

    weight-transfer bench-quant [--repeats 5] [--device cpu|cuda] [--out results/quant_bench.csv]

Shapes: a 4096x4096 linear weight, and Kimi-K2's expert shapes (``moe_intermediate_size``
2048, ``hidden_size`` 7168, from reference/testing/configs/kimi-k2.json): the fused ``w13`` slab of one
expert ``[2*2048, 7168]`` and ``w2`` ``[7168, 2048]``. GB/s counts BF16 *input* bytes
(1e9 B/s); memcpy is a same-size ``copy_`` of the BF16 tensor on the same device in the same
run. Timed: the fast path of ``weight_transfer.convert.quant`` (the native C kernel on the CPU, Triton on
CUDA), the torch reference (``quantize_fp8_block_reference``, the oracle) and the engine's own
loader quantizer; every output is checked byte-identical to the reference. Rounds alternate
copy and quantizers; min/median/max of ``--repeats`` rounds; on CUDA, timed with events after a
warm-up, and one more shape (8 experts' ``w13``, 470 MB) to be far past launch overhead.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

SHAPES = {
    "linear 4096x4096": (4096, 4096),
    "kimi-k2 expert w13 [4096,7168]": (4096, 7168),
    "kimi-k2 expert w2 [7168,2048]": (7168, 2048),
}
CUDA_SHAPES = {"kimi-k2 8 experts w13 [8,4096,7168]": (8, 4096, 7168)}
"""Added on CUDA: a slab big enough (470 MB) that a launch is far past its overhead."""


def _timer(device: str):
    """``(seconds, cpu seconds)`` of one call of ``fn``: wall clock and this thread's CPU time
    on the CPU (the CPU time is what load from other processes on a shared machine does not
    inflate), CUDA events (and no CPU time) on a GPU."""
    if device == "cpu":
        def t(fn):
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            return time.perf_counter() - t0, time.thread_time() - c0
        return t

    def t(fn):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3, None
    return t


def _impls(device: str) -> dict:
    """The quantizers to time on ``device``: the fast path, the torch reference (oracle) and
    the engine's own loader quantizer, by table label."""
    from weight_transfer.convert.quant import (
        native_status,
        quantize_fp8_block,
        quantize_fp8_block_reference,
    )
    from weight_transfer.engines.engine import quantize_block_fp8

    out = {}
    if device == "cpu":
        if native_status() == "ok":
            out["native (C)"] = lambda x: quantize_fp8_block(x, impl="native")
        else:
            print(f"# native CPU kernel skipped: {native_status()}")
    else:
        try:
            from weight_transfer.convert.quant_triton import quantize_fp8_block_triton

            out["triton"] = lambda x: quantize_fp8_block(x, impl="triton")
            for w in (4, 16):  # the default is 8 warps per block; these show whether to change it
                out[f"triton {w} warps"] = lambda x, w=w: quantize_fp8_block_triton(x, num_warps=w)
        except ImportError as e:
            print(f"# triton skipped: {e}")
    out["torch reference"] = quantize_fp8_block_reference
    out["engine loader"] = quantize_block_fp8
    return out


def run(repeats: int = 5, device: str = "cpu", threads: int = 1) -> list[dict]:
    """One row per (shape, implementation): min/median/max seconds over ``repeats`` rounds; in
    each round memcpy and every quantizer run back to back (alternating, so load on a shared
    machine hits them alike). ``identical``: bytes of q and scale equal the torch reference."""
    torch.set_num_threads(threads)
    impls = _impls(device)
    shapes = dict(SHAPES, **(CUDA_SHAPES if device != "cpu" else {}))
    rows = []
    for label, shape in shapes.items():
        rows += _one_shape(label, shape, impls, _timer(device), repeats, device, threads)
        if device != "cpu":
            torch.cuda.empty_cache()
    return rows


def _one_shape(label, shape, impls, timer, repeats, device, threads) -> list[dict]:
    import statistics

    x = (torch.randn(shape, device=device) * 0.02).to(torch.bfloat16)
    y = torch.empty_like(x)
    rq, rs = impls["torch reference"](x)
    same = {}
    for name, fn in impls.items():
        q, s = fn(x)  # also the warm-up
        same[name] = bool(torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
                          and torch.equal(s.view(torch.int32), rs.view(torch.int32)))
    y.copy_(x)
    times = {"memcpy": [], **{n: [] for n in impls}}
    for _ in range(repeats):
        times["memcpy"].append(timer(lambda: y.copy_(x)))
        for name, fn in impls.items():
            times[name].append(timer(lambda fn=fn: fn(x)))
    rows = []
    for name, tc in times.items():
        ts = [w for w, _ in tc]
        cs = [c for _, c in tc if c is not None]
        rows.append({"shape": label, "impl": name, "device": device, "threads": threads,
                     "bytes": x.nbytes, "seconds_min": min(ts),
                     "seconds_median": statistics.median(ts), "seconds_max": max(ts),
                     "cpu_seconds_median": statistics.median(cs) if cs else None,
                     "identical": same.get(name)})
    return rows


@dataclass(kw_only=True, slots=True)
class QuantBenchConfig:
    """Options of ``weight-transfer bench-quant``."""

    repeats: int = 5
    """Timed rounds per shape (each round: copy, then every quantizer); min/median/max reported."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (needs a CUDA build of torch and a GPU; on ``cuda`` the run fails
    when the GPU fast path, the Triton kernel, cannot be imported: that is what it measures)."""
    threads: int = 1
    """torch intra-op threads."""
    out: str = "results/quant_bench.csv"
    """CSV the rows are written to (overwritten); empty: none."""

    def __post_init__(self):
        if self.repeats < 1 or self.threads < 1:
            raise ValueError(f"repeats={self.repeats}, threads={self.threads}: both >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: cpu or cuda")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device='cuda' but torch.cuda.is_available() is False here (torch {torch.__version__})")


def main(a: QuantBenchConfig) -> int:
    """Run the benchmark, print the table, write ``a.out``; 0 if every quantizer agrees with
    the torch reference (and, on ``cuda``, the Triton kernel was among them), else 1."""
    import platform

    import pandas as pd

    rows = run(a.repeats, a.device, a.threads)
    dev = torch.cuda.get_device_name() if a.device != "cpu" else platform.processor() or platform.machine()
    print(f"# FP8 block quantization (128x128, e4m3, weight_scale_inv) vs same-run "
          f"{'memcpy' if a.device == 'cpu' else 'device-to-device copy'}, {a.repeats} alternating rounds")
    print(f"# host: {platform.node()}  torch {torch.__version__}  device {a.device} ({dev})  threads {a.threads}")
    print("# GB/s = BF16 input bytes / time (1e9 B/s), from the best round; vs copy = copy time / "
          "quantizer time, best rounds (100% = as fast as copying the input); min/med/max in ms")
    print("# cpu: the same ratio from median thread CPU times (CPU only; robust to other load)")
    print(f"{'shape':>36} {'impl':>16} {'bytes':>11} {'min':>8} {'med':>8} {'max':>8} {'GB/s':>7} "
          f"{'vs copy':>8} {'cpu':>5} {'same':>5}")
    mem = {r["shape"]: r for r in rows if r["impl"] == "memcpy"}
    for r in rows:
        m = mem[r["shape"]]
        r["gbps"] = r["bytes"] / r["seconds_min"] / 1e9
        r["vs_memcpy"] = m["seconds_min"] / r["seconds_min"]
        r["vs_memcpy_cpu"] = (m["cpu_seconds_median"] / r["cpu_seconds_median"]
                              if r["cpu_seconds_median"] else None)
        same = "" if r["identical"] is None else ("yes" if r["identical"] else "NO")
        cpu = f"{r['vs_memcpy_cpu']:.0%}" if r["vs_memcpy_cpu"] else "-"
        print(f"{r['shape']:>36} {r['impl']:>16} {r['bytes']:>11} {r['seconds_min'] * 1e3:>8.2f} "
              f"{r['seconds_median'] * 1e3:>8.2f} {r['seconds_max'] * 1e3:>8.2f} {r['gbps']:>7.2f} "
              f"{r['vs_memcpy']:>8.0%} {cpu:>5} {same:>5}")
    ok = all(r["identical"] is not False for r in rows)
    print(f"# every quantizer byte-identical to the torch reference: {'yes' if ok else 'NO'}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(a.out, index=False)
        print(f"# rows written to {a.out}")
    if a.device == "cuda" and not any(r["impl"] == "triton" for r in rows):
        print("error: the GPU fast path (the Triton kernel) did not run: see '# triton skipped' above")
        return 1
    return 0 if ok else 1
