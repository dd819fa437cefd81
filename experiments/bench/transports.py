"""Compare the data planes available on this machine, beside memcpy, in one run.

    .venv/bin/weight-transfer bench-transports                # all that work here
    .venv/bin/weight-transfer bench-transports --mib 64 --repeats 2 --transports cma

Cases: ``large`` (one op of ``--mib`` MiB) and the default model's tensors (``qwen3-0.6b``:
one write per checkpoint tensor, BF16, into one packed receiver arena, as a trial's engine
arena). Rows: ``memcpy`` (``torch`` ``copy_`` in one process, the floor), ``cma``
(``process_vm_writev``), ``nixl`` (UCX's default choice on one host: CMA puts, TCP wire-up),
``nixl-tcp`` (``UCX_TLS=tcp`` over loopback). Each transport row writes from this process into a
spawned receiver that registered its buffer once; ``time_s`` is the best of ``--repeats`` timed
batches after one warm-up batch (the warm-up also makes connections), from ``write()`` to
``wait()`` returning. Every row is verified: the receiver's SHA-256 equals the expected
image's. A transport that cannot run here is listed in the footer with the reason.

Output: an nccl-tests-style table on stdout and ``results/transports.csv`` (raw bytes and
seconds; GB/s = bytes / seconds / 1e9, see docs/PERFORMANCE.md).
"""
from __future__ import annotations

import csv
import datetime as dt
import hashlib
import multiprocessing as mp
import os
import platform
import socket
import time
import uuid
from dataclasses import dataclass

import torch

from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.transport import WriteOp, make_transport

from ..env import git_sha

POISON = 0xA5
ALL = ("memcpy", "cma", "nixl", "nixl-tcp")


def _env_for(name: str) -> dict:
    return {"UCX_TLS": "tcp"} if name == "nixl-tcp" else {}


def _kind(name: str) -> str:
    return "nixl" if name.startswith("nixl") else name


def _receiver(conn, name: str, nbytes: int) -> None:
    os.environ.update(_env_for(name))
    torch.set_num_threads(1)
    t = make_transport(_kind(name))
    buf = torch.full((nbytes,), POISON, dtype=torch.uint8)
    r = t.register(buf)
    conn.send(r.descriptor())
    while True:
        cmd = conn.recv()
        if cmd == "sha":
            conn.send(hashlib.sha256(buf.numpy().tobytes()).hexdigest())
        elif cmd == "reset":
            buf.fill_(POISON)
            conn.send(True)
        else:
            conn.send(True)
            return


def cases(mib: int, model: str) -> dict[str, list[tuple[int, int, int]]]:
    """name -> [(src offset, dst offset, length)] over a packed source of the same size."""
    big = mib << 20
    out = {"large": [(0, 0, big)]}
    specs = param_specs(load_config(model))
    ops, pos = [], 0
    for s in specs:
        n = 2
        for d in s.shape:
            n *= d
        ops.append((pos, pos, n))
        pos += n
    out[model] = ops
    return out


def _image(ops, src: torch.Tensor, nbytes: int) -> str:
    img = torch.full((nbytes,), POISON, dtype=torch.uint8)
    for so, do, n in ops:
        img[do:do + n] = src[so:so + n]
    return hashlib.sha256(img.numpy().tobytes()).hexdigest()


def bench_memcpy(ops, src, dst, repeats):
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for so, do, n in ops:
            dst[do:do + n].copy_(src[so:so + n])
        if r:
            times.append(time.perf_counter() - t0)
    return times


def bench_transport(name, ops, src, nbytes, repeats):
    ctx = mp.get_context("spawn")
    p, c = ctx.Pipe()
    env_before = {k: os.environ.get(k) for k in ("UCX_TLS",)}
    pr = ctx.Process(target=_receiver, args=(c, name, nbytes), daemon=True)
    pr.start()
    try:
        if not p.poll(120):
            raise RuntimeError("receiver did not start")
        d = p.recv()
        os.environ.update(_env_for(name))
        kw = {"progress_thread": False} if _kind(name) == "nixl" else {}
        t = make_transport(_kind(name), **kw)
        t.connect([d])
        loc = t.register(src)
        wops = [WriteOp(loc, so, d, do, n) for so, do, n in ops]
        times = []
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            t.write(wops).wait(300)
            if r:
                times.append(time.perf_counter() - t0)
        p.send("sha")
        sha = p.recv()
        t.close()
        p.send("exit")
        p.recv()
        return times, sha
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        pr.join(10)
        if pr.is_alive():
            pr.kill()


@dataclass(kw_only=True, slots=True)
class TransportBenchConfig:
    """Options of ``weight-transfer bench-transports``."""

    mib: int = 256
    """Size of the ``large`` case (MiB)."""
    model: str = "qwen3-0.6b"
    """Catalog model whose checkpoint tensors make the per-tensor case."""
    repeats: int = 3
    """Timed batches per row (after one warm-up); best and median reported."""
    transports: tuple[str, ...] = ALL
    """Rows to run, comma-separated: memcpy, cma, nixl, nixl-tcp."""
    csv: str = "results/transports.csv"
    """CSV the rows are written to (overwritten); empty: none."""

    def __post_init__(self):
        bad = [t for t in self.transports if t not in ALL]
        if bad:
            raise ValueError(f"transports {bad}: known {', '.join(ALL)}")
        if self.mib < 1 or self.repeats < 1:
            raise ValueError(f"mib={self.mib}, repeats={self.repeats}: both >= 1")


def main(a: TransportBenchConfig) -> int:
    """Run every row, print the table, write ``a.csv``; 0 if every row ran and verified."""
    torch.set_num_threads(1)
    names = list(a.transports)
    cs = cases(a.mib, a.model)
    run_id, sha, stamp, host = uuid.uuid4().hex[:8], git_sha(), dt.datetime.now().isoformat(timespec="seconds"), socket.gethostname()
    try:
        from importlib.metadata import version

        nixl_v = version("nixl-cu12")
    except Exception:
        nixl_v = "not installed"
    print(f"# bench_transports: one-sided write bandwidth into another process on this host; run {run_id}, git {sha}, {stamp}")
    print(f"# host {host}: {os.cpu_count()} cpus, {platform.system()} {platform.release()}, python {platform.python_version()}, "
          f"torch {torch.__version__}, nixl-cu12 {nixl_v}")
    print(f"# best of {a.repeats} timed batches after 1 warm-up; nixl = UCX's choice (CMA put, TCP wire-up), nixl-tcp = UCX_TLS=tcp; "
          f"memcpy = torch copy_ in one process")
    print("#")
    hdr = f"# {'transport':>10} {'case':>12} {'ops':>6} {'bytes':>12} {'time':>9} {'median':>9} {'algbw':>7} {'verified':>8}"
    units = f"# {'':>10} {'':>12} {'(#)':>6} {'(B)':>12} {'(s)':>9} {'(s)':>9} {'(GB/s)':>7} {'':>8}"
    print(hdr)
    print(units)
    rows, skipped = [], []
    for cname, ops in cs.items():
        nbytes = max(do + n for _, do, n in ops)
        g = torch.Generator().manual_seed(1)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        want = _image(ops, src, nbytes)
        for name in names:
            if name in {s[0] for s in skipped}:
                continue
            try:
                if name == "memcpy":
                    dst = torch.full((nbytes,), POISON, dtype=torch.uint8)
                    times = bench_memcpy(ops, src, dst, a.repeats)
                    got = hashlib.sha256(dst.numpy().tobytes()).hexdigest()
                    del dst
                else:
                    times, got = bench_transport(name, ops, src, nbytes, a.repeats)
            except Exception as e:
                skipped.append((name, f"{type(e).__name__}: {e}"))
                continue
            best, med = min(times), sorted(times)[len(times) // 2]
            ok = got == want
            row = dict(run_id=run_id, git_sha=sha, timestamp=stamp, host=host, transport=name, case=cname, ops=len(ops),
                       bytes=nbytes, seconds=f"{best:.6f}", seconds_median=f"{med:.6f}", repeats=a.repeats, verified=ok)
            rows.append(row)
            print(f"  {name:>10} {cname:>12} {len(ops):>6} {nbytes:>12} {best:>9.4f} {med:>9.4f} "
                  f"{nbytes / best / 1e9:>7.2f} {'ok' if ok else 'WRONG':>8}", flush=True)
    allok = all(r["verified"] for r in rows)
    print(f"# Out of bounds values : {sum(not r['verified'] for r in rows)} {'OK' if allok else 'FAILED'}")
    for name, why in skipped:
        print(f"# not run: {name}: {why}")
    if a.csv:
        os.makedirs(os.path.dirname(a.csv) or ".", exist_ok=True)
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["run_id"])
            w.writeheader()
            w.writerows(rows)
        print(f"# results: {a.csv} ({len(rows)} rows)")
    return 0 if allok and rows else 1

