"""The receiver's commit of a packed delta (``weight_transfer.delta.packed.apply_landing``: every
record checked, then scattered) on 1 and more threads, on records shaped like the RL loop's lr
1e-6 step: 30 records of 0.5-4 M bf16 elements (the 2-layer Qwen3 of ``weight-transfer rl``, 72
MB of targets), each with the runs of a cast whose fp32 source moved by 1e-6 in half its elements
(~2% of the bytes, ~790k runs of 1-2 bytes). Caches are flushed before each timed apply.

Prints one row per thread count (best of ``--repeats``): records, runs, milliseconds and ns per
run, and the speedup over 1 thread measured in the same run. Units: ms, ns.

Run:  .venv/bin/python scripts/bench_apply.py [--threads 1,2] [--repeats 7]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time

import torch

SIZES = [4 << 20] + [1 << 20] * 8 + [512 << 10] * 8 + [1536 << 10] * 13
"""Elements per record: the embedding, then the attention and MLP outputs of two layers."""


def build(version: int = 7):
    """(landing buffer, target arena): every record of ``SIZES`` packed for ``version`` into one
    training rank's area, with its directory entry."""
    from weight_transfer.delta import packed as dp
    from weight_transfer.delta.runs import KERNEL

    lib = KERNEL.lib()
    if lib is None:
        raise SystemExit("error: the native delta kernel is not available (weight_transfer.delta.runs.native_status())")
    g = torch.Generator().manual_seed(0)
    land = torch.zeros(8 << 20, dtype=torch.uint8)
    at, _ = dp.area(land.numel(), 1, 0)
    first, off = at, 0
    for n in SIZES:
        w = torch.randn(n, generator=g) * 0.02
        shadow = w.to(torch.bfloat16).view(torch.uint8).clone()
        w -= 1e-6 * torch.sign(torch.randn(n, generator=g)) * (torch.rand(n, generator=g) < 0.5)
        out = torch.empty(2 * n, dtype=torch.uint8)
        st, ln, vals = (torch.zeros(n, dtype=torch.int64) for _ in range(3))
        tot, ixb = ctypes.c_int64(0), ctypes.c_int64(0)
        m = lib.wt_cast_bf16_delta(w.data_ptr(), n, out.data_ptr(), shadow.data_ptr(), 1, 0, st.data_ptr(),
                                   ln.data_ptr(), n, ctypes.byref(tot), vals.data_ptr(), ctypes.byref(ixb))
        c, ix = tot.value, ixb.value
        rec = land[at:at + dp.record_size(ix, c)]
        rec[:dp.HEADER].view(torch.int64).copy_(torch.tensor([dp.MAGIC_REC, off, 2 * n, m, c, ix, version, 1]))
        lib.wt_pack_runs_v(out.data_ptr(), st.data_ptr(), ln.data_ptr(), vals.data_ptr(), m, 1,
                           rec[dp.HEADER:].data_ptr(), rec[dp.HEADER + ix:].data_ptr())
        at += rec.numel()
        off += 2 * n
    e = [dp.MAGIC_DIR, version, first, at - first, len(SIZES), 1]
    land[:dp.HEADER].view(torch.int64).copy_(torch.tensor(e + [dp._check(e), 0]))
    return land, torch.zeros(off, dtype=torch.uint8)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (APPLY_THREADS)")
    ap.add_argument("--repeats", type=int, default=7, help="timed applies per thread count (best kept)")
    a = ap.parse_args(argv)
    from weight_transfer.delta import packed as dp

    try:
        counts = [int(x) for x in a.threads.split(",")]
        if not counts or min(counts) < 1:
            raise ValueError
    except ValueError:
        print(f"error: --threads {a.threads!r}: comma-separated positive integers", file=sys.stderr)
        return 2
    if a.repeats < 1:
        print(f"error: --repeats {a.repeats}: a positive integer", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    land, target = build()
    flush = torch.zeros(32 << 20, dtype=torch.int64)  # 256 MB: larger than the caches
    print(f"{'threads':>7} {'records':>7} {'runs':>8} {'apply ms':>9} {'ns/run':>7} {'speedup':>8}")
    base = None
    for t in counts:
        dp.APPLY_THREADS, dp._POOL = t, None
        best, st = float("inf"), None
        for _ in range(a.repeats):
            flush.add_(1)
            t0 = time.perf_counter()
            st = dp.apply_landing(land, 7, target.data_ptr(), [(0, target.numel())])
            best = min(best, time.perf_counter() - t0)
        base = base or best
        print(f"{t:>7} {st['delta_records']:>7} {st['delta_runs']:>8} {best * 1e3:>9.2f} "
              f"{best * 1e9 / st['delta_runs']:>7.1f} {base / best:>7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
