"""Compare the data planes available on this machine, beside memcpy, in one run, in the shape
of nccl-tests: every transport against memcpy at 1 and 2 threads over message sizes from 4 KiB
to 256 MiB, and the cost of registering memory, separately.

    .venv/bin/weight-transfer bench-transports                # all that work here
    .venv/bin/weight-transfer bench-transports --mib 64 --repeats 2 --transports memcpy,cma

Three tables, each row verified (the receiver's SHA-256 equals the expected image's):

1. **Sizes** (``size``): per message size ``S`` (``--min-kib`` .. ``--max-mib``, x4 steps), a
   batch of ``ceil(--window-mib / S)`` writes of ``S`` bytes each into distinct offsets of the
   receiver's region, at 1 and 2 threads (``--threads``): 2 threads split the batch in halves,
   each posted by its own thread on its own transport object (transports are not thread-safe;
   the kernel copies of ``process_vm_writev`` and torch's ``copy_`` release the GIL, so two
   threads can keep both cores copying). Columns: time per batch, latency per message
   (time / messages / threads-in-parallel), algbw (bytes / time) and busbw (= algbw: a
   point-to-point write moves each byte once), and ``%memcpy``: algbw against the same-run
   memcpy at the same size and threads (the floor).
2. **Cases**: ``large`` (one op of ``--mib`` MiB) and the default model's tensors
   (``qwen3-0.6b``: one write per checkpoint tensor, BF16, into one packed receiver arena, as a
   trial's engine arena), one thread.
3. **Registration** (``register``): seconds to register (and publish a descriptor of) a region
   of 1 MiB, 64 MiB and ``--mib`` MiB, per transport, the best of ``--repeats``: what the
   executor pays once at setup for its shard storages and output pool (``Executor.setup_stats``),
   and what it paid per task per update before it registered once.

Rows: ``memcpy`` (``torch`` ``copy_`` in one process, the floor), ``cma`` (``process_vm_writev``),
``shm`` (a ``memcpy`` into the receiver's shared segment, mapped once), ``nixl`` (UCX's default
choice on one host: CMA puts, TCP wire-up), ``nixl-tcp`` (``UCX_TLS=tcp`` over loopback). Each
transport row writes from this process into a spawned receiver that allocated its buffer
through the transport (``Transport.allocate``) and registered it once; times are the best of ``--repeats`` timed batches
after one warm-up batch (the warm-up also makes connections), from ``write()`` to ``wait()``
returning. A transport that cannot run here is listed in the footer with the reason.

Output: the tables on stdout and ``results/transports.csv`` (raw bytes and seconds, one row per
(transport, case, threads, message size); GB/s = bytes / seconds / 1e9, see docs/PERFORMANCE.md).
"""
from __future__ import annotations

import csv
import datetime as dt
import hashlib
import multiprocessing as mp
import os
import platform
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.transport import WriteOp, make_transport

from ..env import git_sha

POISON = 0xA5
ALL = ("memcpy", "cma", "shm", "nixl", "nixl-tcp")


def _env_for(name: str) -> dict:
    return {"UCX_TLS": "tcp"} if name == "nixl-tcp" else {}


def _kind(name: str) -> str:
    return "nixl" if name.startswith("nixl") else name


def _receiver(conn, name: str, nbytes: int) -> None:
    os.environ.update(_env_for(name))
    torch.set_num_threads(1)
    t = make_transport(_kind(name))
    buf = t.allocate(nbytes).fill_(POISON)  # memory the transport can publish (shm: a shared segment)
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


def size_cases(min_kib: int, max_mib: int, window_mib: int) -> dict[int, list[tuple[int, int, int]]]:
    """message size -> a batch of writes of that size covering ``max(window, size)`` bytes of
    a packed source and a packed destination (distinct offsets, no overlap)."""
    out, size = {}, min_kib << 10
    while size <= max_mib << 20:
        n = max(1, -(-(window_mib << 20) // size))
        out[size] = [(i * size, i * size, size) for i in range(n)]
        size *= 4
    return out


def _split(ops, threads: int) -> list[list]:
    """``ops`` cut into ``threads`` contiguous halves (thirds, ...) of near-equal count."""
    k = -(-len(ops) // threads)
    return [ops[i:i + k] for i in range(0, len(ops), k)][:threads]


class _Gang:
    """``len(fns)`` threads started once; :meth:`run` has each call its function once, at the
    same time, and returns when all are done (so a timed batch does not include thread
    start-up); the first failure is re-raised. :meth:`close` ends the threads."""

    def __init__(self, fns):
        self.fns, self.errs, self.stop = fns, [], False
        self.go, self.done = threading.Barrier(len(fns) + 1), threading.Barrier(len(fns) + 1)
        self.threads = [threading.Thread(target=self._loop, args=(f,), daemon=True) for f in fns]
        for t in self.threads:
            t.start()

    def _loop(self, f):
        while True:
            self.go.wait()
            if self.stop:
                return
            try:
                f()
            except BaseException as e:  # re-raised by run()
                self.errs.append(e)
            self.done.wait()

    def run(self) -> None:
        self.go.wait()
        self.done.wait()
        if self.errs:
            raise self.errs[0]

    def close(self) -> None:
        self.stop = True
        self.go.wait()
        for t in self.threads:
            t.join()


def _timed(fns, repeats: int) -> list[float]:
    """Seconds per batch: ``fns`` run at once (one thread each; inline when there is one),
    ``repeats`` timed after one warm-up."""
    gang = _Gang(fns) if len(fns) > 1 else None
    times = []
    try:
        for r in range(repeats + 1):
            t0 = time.perf_counter()
            if gang is None:
                fns[0]()
            else:
                gang.run()
            if r:
                times.append(time.perf_counter() - t0)
    finally:
        if gang is not None:
            gang.close()
    return times


def bench_memcpy_threads(ops, src, dst, repeats, threads: int):
    """Seconds per batch (``repeats`` timed after one warm-up), ``threads`` threads each
    copying its part of ``ops`` with ``copy_``."""
    def part(po):
        def go():
            for so, do, n in po:
                dst[do:do + n].copy_(src[so:so + n])
        return go
    return _timed([part(po) for po in _split(ops, threads)], repeats)


class _Rx:
    """A spawned receiver of transport ``name`` holding one registered region of ``nbytes``
    (POISON-filled): ``desc``, ``reset()``, ``sha()``, ``close()``."""

    def __init__(self, name: str, nbytes: int):
        ctx = mp.get_context("spawn")
        self.p, c = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver, args=(c, name, nbytes), daemon=True)
        self.proc.start()
        if not self.p.poll(120):
            self.close()
            raise RuntimeError("receiver did not start")
        self.desc = self.p.recv()

    def _ask(self, cmd):
        self.p.send(cmd)
        return self.p.recv()

    def reset(self) -> None:
        self._ask("reset")

    def sha(self) -> str:
        return self._ask("sha")

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self._ask("exit")
        except (OSError, EOFError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def timed_writes(name, desc, ops, src, repeats, threads: int) -> list[float]:
    """Seconds per batch (``repeats`` timed after one warm-up) of ``ops`` from ``src`` into the
    region ``desc``, ``threads`` threads each posting its part on its own transport object."""
    os.environ.update(_env_for(name))
    kw = {"progress_thread": False} if _kind(name) == "nixl" else {}
    ts, batches = [], []
    try:
        for po in _split(ops, threads):
            t = make_transport(_kind(name), **kw)
            ts.append(t)
            t.connect([desc])
            loc = t.register(src)
            batches.append((t, [WriteOp(loc, so, desc, do, n) for so, do, n in po]))
        return _timed([lambda t=t, w=w: t.write(w).wait(300) for t, w in batches], repeats)
    finally:
        for t in ts:
            t.close()
        os.environ.pop("UCX_TLS", None)


def bench_transport(name, ops, src, nbytes, repeats) -> tuple[list[float], str]:
    """One thread's :func:`timed_writes` of ``ops`` into a fresh receiver of ``nbytes``; returns
    (seconds per batch, the receiver's SHA-256 afterwards)."""
    rx = _Rx(name, nbytes)
    try:
        times = timed_writes(name, rx.desc, ops, src, repeats, 1)
        return times, rx.sha()
    finally:
        rx.close()


def registration_seconds(name: str, nbytes: int, repeats: int) -> float:
    """Best of ``repeats``: seconds to ``register`` a fresh ``nbytes`` host tensor (from the
    transport's ``allocate``, not timed) and publish its descriptor on transport ``name``
    (``memcpy``: 0, nothing to register), deregistered after."""
    if name == "memcpy":
        return 0.0
    os.environ.update(_env_for(name))
    kw = {"progress_thread": False} if _kind(name) == "nixl" else {}
    t = make_transport(_kind(name), **kw)
    try:
        best = float("inf")
        for _ in range(repeats):
            buf = t.allocate(nbytes)
            buf[::4096] = 0  # touch every page first: registration, not page faults, is timed
            t0 = time.perf_counter()
            r = t.register(buf)
            r.descriptor()
            best = min(best, time.perf_counter() - t0)
            t.deregister(r)
        return best
    finally:
        t.close()
        os.environ.pop("UCX_TLS", None)


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
    """Rows to run, comma-separated: memcpy, cma, shm, nixl, nixl-tcp."""
    min_kib: int = 4
    """Smallest message of the size sweep (KiB); sizes grow x4 up to ``max_mib``."""
    max_mib: int = 256
    """Largest message of the size sweep (MiB)."""
    window_mib: int = 64
    """Bytes one batch of the size sweep covers (MiB): ``window / size`` messages per batch."""
    threads: tuple[int, ...] = (1, 2)
    """Sender threads of the size sweep, comma-separated (each its own transport object)."""
    csv: str = "results/transports.csv"
    """CSV the rows are written to (overwritten); empty: none."""

    def __post_init__(self):
        bad = [t for t in self.transports if t not in ALL]
        if bad:
            raise ValueError(f"transports {bad}: known {', '.join(ALL)}")
        if self.mib < 1 or self.repeats < 1:
            raise ValueError(f"mib={self.mib}, repeats={self.repeats}: both >= 1")
        if self.min_kib < 1 or self.max_mib < 1 or self.window_mib < 1 or (self.min_kib << 10) > (self.max_mib << 20):
            raise ValueError(f"min_kib={self.min_kib}, max_mib={self.max_mib}, window_mib={self.window_mib}: "
                             "all >= 1 and min_kib KiB <= max_mib MiB")
        if not self.threads or min(self.threads) < 1:
            raise ValueError(f"threads={self.threads}: one or more counts >= 1")


def _size_label(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


@dataclass
class _Rows:
    """The tidy rows of one run: the run's own columns (``run_id``, ``git_sha``, ``timestamp``,
    ``host``), the rows so far, and the back ends that did not run (name -> why)."""

    run: dict
    repeats: int
    rows: list[dict] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def add(self, name, case, threads, msg, ops, nbytes, times, ok) -> tuple[float, float]:
        """Append one row (``times``: seconds per timed batch); returns its best and median seconds."""
        best, med = min(times), sorted(times)[len(times) // 2]
        self.rows.append(dict(**self.run, transport=name, case=case, threads=threads, msg_bytes=msg, ops=ops,
                              bytes=nbytes, seconds=f"{best:.6f}", seconds_median=f"{med:.6f}", repeats=self.repeats,
                              verified=ok))
        return best, med


def _header(a: TransportBenchConfig) -> _Rows:
    """The ``#`` lines on the run and the host; the run's (still empty) rows."""
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
          "shm = memcpy into the receiver's segment, mapped once; "
          f"memcpy = torch copy_ in one process, the floor; busbw = algbw (point to point)")
    return _Rows(run=dict(run_id=run_id, git_sha=sha, timestamp=stamp, host=host), repeats=a.repeats)


def _size_table(a: TransportBenchConfig, out: _Rows) -> None:
    """[1] message sizes x sender threads, every back end; percentages of memcpy's bandwidth.
    A back end whose library is missing, or that fails, goes to ``out.skipped``."""
    from weight_transfer.options import transport_unavailable

    sizes = size_cases(a.min_kib, a.max_mib, a.window_mib)
    span = max(max(do + n for _, do, n in ops) for ops in sizes.values())
    g = torch.Generator().manual_seed(1)
    src = torch.randint(0, 256, (span,), dtype=torch.uint8, generator=g)
    want = {s: _image(ops, src, span) for s, ops in sizes.items()}
    print("#")
    print(f"# [1] message sizes: batches of writes covering {a.window_mib} MiB (or one message), threads {a.threads}")
    print(f"# {'transport':>10} {'threads':>7} {'size':>8} {'msgs':>6} {'bytes':>11} {'time':>9} {'lat/msg':>9} "
          f"{'algbw':>7} {'busbw':>7} {'%memcpy':>7} {'verified':>8}")
    print(f"# {'':>10} {'(#)':>7} {'':>8} {'(#)':>6} {'(B)':>11} {'(s)':>9} {'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} "
          f"{'':>7} {'':>8}")
    for name in a.transports:  # a back end whose library is missing is listed, not started (no receiver to wait for)
        why = None if name == "memcpy" else transport_unavailable(_kind(name))
        if why:
            out.skipped[name] = why
    floor: dict[tuple[int, int], float] = {}
    for name in a.transports:
        if name in out.skipped:
            continue
        try:
            if name == "memcpy":
                dst = torch.full((span,), POISON, dtype=torch.uint8)
                rx = None
            else:
                rx = _Rx(name, span)
            for size, ops in sizes.items():
                nbytes = sum(n for *_, n in ops)
                for th in a.threads:
                    if rx is None:
                        dst.fill_(POISON)
                        times = bench_memcpy_threads(ops, src, dst, a.repeats, th)
                        got = hashlib.sha256(dst.numpy().tobytes()).hexdigest()
                    else:
                        rx.reset()
                        times = timed_writes(name, rx.desc, ops, src, a.repeats, th)
                        got = rx.sha()
                    ok = got == want[size]
                    best, _ = out.add(name, "size", th, size, len(ops), nbytes, times, ok)
                    bw = nbytes / best / 1e9
                    if name == "memcpy":
                        floor[(size, th)] = bw
                    pct = f"{100 * bw / floor[(size, th)]:.0f}%" if (size, th) in floor else "-"
                    lat = best / max(1, -(-len(ops) // th)) * 1e6
                    print(f"  {name:>10} {th:>7} {_size_label(size):>8} {len(ops):>6} {nbytes:>11} {best:>9.4f} "
                          f"{lat:>9.1f} {bw:>7.2f} {bw:>7.2f} {pct:>7} {'ok' if ok else 'WRONG':>8}", flush=True)
            if rx is not None:
                rx.close()
            else:
                del dst
        except Exception as e:
            out.skipped[name] = f"{type(e).__name__}: {e}"
    del src


def _case_table(a: TransportBenchConfig, out: _Rows) -> None:
    """[2] one large op, and one write per checkpoint tensor of ``a.model`` into a packed arena
    (one thread), every back end still running."""
    print("#")
    print("# [2] cases: one large op; one write per checkpoint tensor into a packed arena (one thread)")
    print(f"# {'transport':>10} {'case':>12} {'ops':>6} {'bytes':>12} {'time':>9} {'median':>9} {'algbw':>7} {'verified':>8}")
    print(f"# {'':>10} {'':>12} {'(#)':>6} {'(B)':>12} {'(s)':>9} {'(s)':>9} {'(GB/s)':>7} {'':>8}")
    for cname, ops in cases(a.mib, a.model).items():
        nbytes = max(do + n for _, do, n in ops)
        g = torch.Generator().manual_seed(1)
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        want_c = _image(ops, src, nbytes)
        for name in a.transports:
            if name in out.skipped:
                continue
            try:
                if name == "memcpy":
                    dst = torch.full((nbytes,), POISON, dtype=torch.uint8)
                    times = bench_memcpy_threads(ops, src, dst, a.repeats, 1)
                    got = hashlib.sha256(dst.numpy().tobytes()).hexdigest()
                    del dst
                else:
                    times, got = bench_transport(name, ops, src, nbytes, a.repeats)
            except Exception as e:
                out.skipped[name] = f"{type(e).__name__}: {e}"
                continue
            ok = got == want_c
            best, med = out.add(name, cname, 1, 0, len(ops), nbytes, times, ok)
            print(f"  {name:>10} {cname:>12} {len(ops):>6} {nbytes:>12} {best:>9.4f} {med:>9.4f} "
                  f"{nbytes / best / 1e9:>7.2f} {'ok' if ok else 'WRONG':>8}", flush=True)
        del src


def _registration_table(a: TransportBenchConfig, out: _Rows) -> None:
    """[3] register() + descriptor() of a fresh host tensor of 1 MiB, 64 MiB and ``a.mib`` MiB."""
    print("#")
    print("# [3] registration: register() + descriptor() of a fresh (paged-in) host tensor, best of "
          f"{a.repeats}")
    print(f"# {'transport':>10} {'bytes':>12} {'time':>10} {'per GiB':>10}")
    print(f"# {'':>10} {'(B)':>12} {'(s)':>10} {'(s)':>10}")
    for name in a.transports:
        if name in out.skipped or name == "memcpy":
            continue
        for nbytes in sorted({1 << 20, 64 << 20, a.mib << 20}):
            try:
                sec = registration_seconds(name, nbytes, a.repeats)
            except Exception as e:
                out.skipped[name] = f"{type(e).__name__}: {e}"
                break
            out.add(name, "register", 1, nbytes, 1, nbytes, [sec], True)
            print(f"  {name:>10} {nbytes:>12} {sec:>10.6f} {sec / nbytes * (1 << 30):>10.6f}", flush=True)


def main(a: TransportBenchConfig) -> int:
    """Run every table, print it, write ``a.csv``; 0 if every row ran and verified."""
    torch.set_num_threads(1)
    out = _header(a)
    _size_table(a, out)
    _case_table(a, out)
    _registration_table(a, out)
    rows = out.rows
    allok = all(r["verified"] for r in rows)
    print(f"# Out of bounds values : {sum(not r['verified'] for r in rows)} {'OK' if allok else 'FAILED'}")
    for name, why in out.skipped.items():
        print(f"# not run: {name}: {why}")
    if a.csv:
        os.makedirs(os.path.dirname(a.csv) or ".", exist_ok=True)
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["run_id"])
            w.writeheader()
            w.writerows(rows)
        print(f"# results: {a.csv} ({len(rows)} rows)")
    return 0 if allok and rows else 1
