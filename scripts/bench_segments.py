"""What a strided TP slice costs written through CMA (issue 29 item 2/3), printed as a table and
written to ``results/segments_bench.csv``.

A receiver arena in this process is written through ``process_vm_writev`` (CMA to its own pid:
the same syscall and checks as across processes) from ``--slices`` column slices of
``[rows, 2 * row_bytes]`` uint8 matrices (default 64 x 1024 rows x 768 B: the main job's
``w2_weight`` TP halves), four ways, best and median of ``--repeats``:

- ``segments``: one op per slice with a :class:`~weight_transfer.transport.base.Segments` per
  row (what the executor posts now: merged iovecs, up to IOV_MAX a side per call);
- ``pairs``: the same ops with one local + one remote iovec per segment (the CMA code before);
- ``copy+write``: ``.contiguous()`` into a buffer, then one write (what the executor did before);
- ``contiguous``: a contiguous source of the same bytes, one write (the floor), and ``memcpy``.

Every row is checked bit-exact against ``torch.cat`` of the slices. Usage::

    .venv/bin/python scripts/bench_segments.py [--slices 64] [--rows 1024] [--row-bytes 768]
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weight_transfer.transport import cma
from weight_transfer.transport.base import Segments, WriteOp
from weight_transfer.transport.cma import CmaTransport


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slices", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--row-bytes", type=int, default=768)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--csv", default="results/segments_bench.csv")
    a = ap.parse_args(argv)
    n, rows, part = a.slices, a.rows, a.row_bytes
    rx, tx = CmaTransport(), CmaTransport()
    arena = torch.zeros(n * rows * part, dtype=torch.uint8)
    d = rx.register(arena).descriptor()
    tx.connect([d])
    src = torch.randint(0, 255, (n, rows, 2 * part), dtype=torch.uint8)
    ls = tx.register(src)
    views = [src[i, :, :part] for i in range(n)]
    ops = []
    for i, v in enumerate(views):
        sg = Segments.strided(v.shape, v.stride(), 1, v.storage_offset())
        ops.append(WriteOp(ls, 0, d, i * rows * part, sg.nbytes, sg))
    buf = torch.zeros(n * rows * part, dtype=torch.uint8)
    lb = tx.register(buf)
    flat = torch.randint(0, 255, (n * rows * part,), dtype=torch.uint8)
    lf = tx.register(flat)
    want = torch.cat([v.reshape(-1) for v in views])

    def pairs():
        old, cma._SMALL, tx.segment_arrays = cma._SMALL, 1 << 60, False
        try:
            tx.write(ops)
        finally:
            cma._SMALL, tx.segment_arrays = old, True

    def copy_write():
        for i, v in enumerate(views):
            buf[i * rows * part:(i + 1) * rows * part].view(rows, part).copy_(v)
        tx.write([WriteOp(lb, 0, d, 0, buf.numel())])

    cases = [("segments", lambda: tx.write(ops), want), ("pairs", pairs, want), ("copy+write", copy_write, want),
             ("contiguous", lambda: tx.write([WriteOp(lf, 0, d, 0, flat.numel())]), flat),
             ("memcpy", lambda: arena.copy_(flat), flat)]
    load = os.getloadavg()[0]
    out = []
    print(f"# {n} slices x {rows} rows x {part} B ({n * rows * part / 1e6:.1f} MB, {n * rows} segments), "
          f"best / median of {a.repeats}; load average {load:.2f}")
    print(f"{'case':>12} {'best_ms':>9} {'median_ms':>10} {'GB/s':>7} verified")
    for name, fn, expect in cases:
        ts = []
        for _ in range(a.repeats):
            arena.zero_()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        ok = bool(torch.equal(arena, expect))
        best, med = min(ts), statistics.median(ts)
        print(f"{name:>12} {best * 1e3:>9.2f} {med * 1e3:>10.2f} {arena.numel() / best / 1e9:>7.2f} {'yes' if ok else 'NO'}")
        out.append({"case": name, "slices": n, "rows": rows, "row_bytes": part, "bytes": arena.numel(),
                    "best_s": best, "median_s": med, "repeats": a.repeats, "load": load, "verified": ok,
                    "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if a.csv:
        p = Path(a.csv)
        p.parent.mkdir(parents=True, exist_ok=True)
        new = not p.exists()
        with p.open("a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out[0]))
            if new:
                w.writeheader()
            w.writerows(out)
        print(f"# rows appended to {p}")
    return 0 if all(r["verified"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
