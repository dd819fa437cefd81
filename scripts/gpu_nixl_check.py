"""NIXL over UCX's CUDA transports: one-sided WRITEs from GPU memory into another process's GPU
memory, verified, beside a same-run device-to-device copy (a step of scripts/gpu_check.sh).

    python scripts/gpu_nixl_check.py [--mib 256] [--op-mib 4] [--repeats 5] [--out results/gpu/nixl_cuda.csv]

Cases (each a fresh receiver process holding a CUDA buffer registered as VRAM, and a sender in
this process writing ``--mib`` MiB in ``--op-mib`` MiB WRITEs through
:class:`weight_transfer.transport.nixl.NixlTransport`):

- ``ucx-default``: UCX_TLS unset (UCX's choice; on one GPU host that should be ``cuda_ipc``);
- ``cuda_ipc``: ``UCX_TLS=cuda_ipc,cuda_copy,tcp`` (tcp only carries the wire-up).

Each case: one warm-up write, then the best of ``--repeats`` timed writes (wall clock around
``write().wait()``); the receiver then compares its whole buffer with the sender's on the GPU
(``torch.equal``) and reports. One CSV row per case (``case, bytes, seconds, gbps, copy_gbps,
verified, error``); a case that raises is a row with its error, and the exit status is 1.
GB/s = bytes / seconds / 1e9; ``copy_gbps`` is a same-size ``copy_`` between two buffers on the
GPU in this process, same run.
"""
from __future__ import annotations

import argparse
import csv
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {"ucx-default": None, "cuda_ipc": "cuda_ipc,cuda_copy,tcp"}
START_TIMEOUT = 40
"""Seconds a receiver may take to start (import torch, create its NIXL agent, register)."""
WRITE_TIMEOUT = 20.0
"""Seconds one write batch may take before the case is reported failed: short enough that both
cases finish inside the check's time limit for this step (scripts/gpu_check.sh) even when the
first one hangs."""
FIELDS = ["case", "ucx_tls", "bytes", "seconds", "gbps", "copy_gbps", "verified", "error"]


def _receiver(conn, tls: str | None, nbytes: int) -> None:
    import torch

    from weight_transfer.transport.nixl import NixlTransport

    if tls is not None:
        os.environ["UCX_TLS"] = tls
    else:
        os.environ.pop("UCX_TLS", None)
    t = NixlTransport()
    buf = torch.full((nbytes,), 0xA5, dtype=torch.uint8, device="cuda")
    r = t.register(buf)
    conn.send(r.descriptor())
    while True:
        cmd, arg = conn.recv()
        if cmd == "verify":  # arg: the seed of the sender's pattern
            g = torch.Generator(device="cuda").manual_seed(arg)
            want = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
            torch.cuda.synchronize()
            conn.send(bool(torch.equal(buf, want)))
        else:
            t.close()
            conn.send(True)
            return


def run_case(name: str, tls: str | None, nbytes: int, op_bytes: int, repeats: int) -> dict:
    import torch

    from weight_transfer.transport import WriteOp
    from weight_transfer.transport.nixl import NixlTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, tls, nbytes), daemon=True)
    proc.start()
    row = {"case": name, "ucx_tls": tls or "", "bytes": nbytes, "seconds": "", "gbps": "",
           "verified": False, "error": ""}
    try:
        if not parent.poll(START_TIMEOUT):
            raise RuntimeError(f"receiver did not start within {START_TIMEOUT} s")
        desc = parent.recv()
        if tls is not None:
            os.environ["UCX_TLS"] = tls
        else:
            os.environ.pop("UCX_TLS", None)
        t = NixlTransport()
        try:
            seed = 1234
            g = torch.Generator(device="cuda").manual_seed(seed)
            src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda", generator=g)
            loc = t.register(src)
            t.connect([desc])
            ops = [WriteOp(loc, o, desc, o, min(op_bytes, nbytes - o)) for o in range(0, nbytes, op_bytes)]
            torch.cuda.synchronize()
            t.write(ops).wait(WRITE_TIMEOUT)  # warm-up (connection, registration caches)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                t.write(ops).wait(WRITE_TIMEOUT)
                best = min(best, time.perf_counter() - t0)
            parent.send(("verify", seed))
            row.update(seconds=best, gbps=nbytes / best / 1e9, verified=parent.recv())
        finally:
            t.close()
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        try:
            parent.send(("exit", None))
            parent.poll(10)
        except (BrokenPipeError, OSError):
            pass
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return row


def copy_gbps(nbytes: int, repeats: int) -> float:
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        best = min(best, e0.elapsed_time(e1) / 1e3)
    return nbytes / best / 1e9


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes per timed write batch (MiB)")
    ap.add_argument("--op-mib", type=int, default=4, help="bytes per WRITE (MiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {','.join(CASES)}")
    ap.add_argument("--out", default=str(ROOT / "results" / "gpu" / "nixl_cuda.csv"))
    a = ap.parse_args(argv)
    names = [c for c in a.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown or a.mib < 1 or a.op_mib < 1 or a.repeats < 1:
        ap.error(f"unknown cases {unknown} (known: {list(CASES)})" if unknown else
                 "--mib, --op-mib and --repeats must be >= 1")
    import torch

    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU and a CUDA build of torch", file=sys.stderr)
        return 1
    nbytes, op = a.mib << 20, a.op_mib << 20
    cgb = copy_gbps(nbytes, a.repeats)
    print(f"# NIXL VRAM -> VRAM one-sided WRITEs between two processes on {torch.cuda.get_device_name()}, "
          f"{a.mib} MiB in {a.op_mib} MiB ops, best of {a.repeats}; same-run d2d copy {cgb:.0f} GB/s", flush=True)
    print(f"{'case':>12} {'UCX_TLS':>24} {'GB/s':>8} {'vs copy':>8} {'verified':>9}  error", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in names:  # the CSV is rewritten after every case: a run stopped midway keeps the cases done
        r = dict(run_case(n, CASES[n], nbytes, op, a.repeats), copy_gbps=cgb)
        rows.append(r)
        g = f"{r['gbps']:.1f}" if r["gbps"] != "" else "-"
        v = f"{r['gbps'] / cgb:.0%}" if r["gbps"] != "" else "-"
        print(f"{r['case']:>12} {r['ucx_tls'] or '(unset)':>24} {g:>8} {v:>8} {r['verified']!s:>9}  {r['error']}",
              flush=True)
        with out.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(rows)
    print(f"# rows written to {out}")
    return 0 if all(r["verified"] is True and not r["error"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
