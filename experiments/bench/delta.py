"""Full against delta updates (issue 26 item 4, first half), on the README's main job.

For each change fraction (synthetic steps that change that fraction of every tensor's
elements, uniformly scattered: ``--change-fraction``), two real trials with the same steps
and seed: one with full updates, one with ``--delta``; every update of both verified bit-exact
against a fresh oracle. Per trial the warm updates' p50 seconds and the bytes written per
update; delta's ratio to full, and where delta stops paying (the smallest fraction at which
its p50 is no better than full's).

Prints an nccl-tests-style table, writes ``results/delta_bench.csv`` (one row per trial and
measured update: raw ``bytes``, ``delta_bytes``, ``seconds``, the phase columns).

    weight-transfer bench-delta                                # 0.1%, 1%, 10%, 50% on the main job
    weight-transfer bench-delta --fractions 0.01 --steps 2 --op-costs 0,-1 --granularity 8
    weight-transfer bench-delta --ops-only                     # the cost of one op by size (cma, shm)

The op table (first, or alone with ``--ops-only``; ``results/delta_ops.csv``) is what the
granularity and the merge gap are chosen from: many writes of one size from a 64 MiB region into
another process's, each op built, checked and posted through the real transport, its seconds per
op and GB/s.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..config import TrialConfig, main_job_with
from ..paths import project_dir
from ..trial import run_trial

ROOT = project_dir()


@dataclass(kw_only=True, slots=True)
class DeltaBenchConfig:
    """Options of ``weight-transfer bench-delta``."""

    fractions: tuple[float, ...] = (0.001, 0.01, 0.1, 0.5)
    """Change fractions per step (comma-separated), each a pair of trials (full, delta)."""
    merge_gaps: tuple[int, ...] = (0,)
    """``delta_merge_gap`` values (bytes, comma-separated): one delta trial per value, op cost and fraction."""
    op_costs: tuple[int, ...] = (0, -1)
    """``delta_op_cost`` values (bytes, comma-separated; -1: the transport's measured cost, cma
    1024 / shm 64): one delta trial per value, merge gap and fraction. 0 writes every output's runs
    (fewest bytes); the transport's cost writes an output whole when its runs cost more."""
    granularity: int = 8
    """``delta_granularity`` (bytes) of the delta trials."""
    transport: str = "cma"
    """Transport of every trial."""
    steps: int = 3
    """Measured updates per trial."""
    warmup: int = 1
    """Updates before the measured ones (the first is full in the delta trial too)."""
    override: tuple[str, ...] = ()
    """HF-config overrides ``KEY=VALUE``, comma-separated, on top of the main job's (tests use a
    smaller model)."""
    out: str = str(ROOT / "results" / "runs" / "delta_bench.csv")
    """CSV of one row per trial and measured update (overwritten; the default is untracked: pass
    ``--out results/delta_bench.csv`` to record a campaign); empty: none."""
    ops_only: bool = False
    """Only the op table (the cost of one op by size on cma and shm), no trials."""
    ops_out: str = str(ROOT / "results" / "runs" / "delta_ops.csv")
    """CSV of the op table (overwritten; the default is untracked: pass ``--ops-out
    results/delta_ops.csv`` to record a campaign); empty: none."""
    op_sizes: tuple[int, ...] = (8, 64, 128, 256, 1024, 4096, 16384, 65536)
    """Write sizes of the op table (bytes, comma-separated)."""

    def __post_init__(self):
        if not self.fractions or any(not 0 <= f <= 1 for f in self.fractions):
            raise ValueError(f"fractions={self.fractions}: at least one, each in [0, 1]")
        if any(g < 0 for g in self.merge_gaps) or not self.merge_gaps:
            raise ValueError(f"merge_gaps={self.merge_gaps}: at least one, bytes >= 0")
        if not self.op_sizes or any(g < 1 for g in self.op_sizes):
            raise ValueError(f"op_sizes={self.op_sizes}: at least one, bytes >= 1")
        if any(c < -1 for c in self.op_costs) or not self.op_costs:
            raise ValueError(f"op_costs={self.op_costs}: at least one, bytes >= 0 or -1 (the transport's)")
        for kv in self.override:
            if "=" not in kv:
                raise ValueError(f"override {kv!r}: wants KEY=VALUE")
        if self.steps < 1 or self.warmup < 1:
            raise ValueError(f"steps={self.steps}, warmup={self.warmup}: need steps >= 1 and warmup >= 1 (the "
                             "first update of a delta trial is full)")


def _rx(conn, name: str) -> None:
    from weight_transfer.transport import make_transport

    t = make_transport(name)
    buf = t.allocate(64 << 20)
    buf.zero_()
    conn.send(t.register(buf).descriptor())
    conn.recv()
    t.close()


def op_costs(transports=("cma", "shm"), sizes=(8, 64, 128, 256, 1024, 4096, 16384, 65536), repeats: int = 3) -> list[dict]:
    """Seconds per op of batches of equal-size writes (spread over a 64 MiB region) into a spawned
    receiver, per transport and size, best of ``repeats``: ``path`` ``op``, one WriteOp per write
    (building + the base checks + posting); ``run``, one :class:`weight_transfer.transport.runs.RunsOp`
    holding every write as a run (the delta path: checks and posting from C)."""
    import multiprocessing as mp

    import torch

    from weight_transfer.transport import WriteOp, make_transport
    from weight_transfer.transport.runs import RunsOp, posts_natively
    from weight_transfer.transport.runs import write as write_runs

    out = []
    for name in transports:
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        p = ctx.Process(target=_rx, args=(b, name), daemon=True)
        p.start()
        try:
            d = a.recv()
            t = make_transport(name)
            t.connect([d])
            ls = t.register(torch.randint(0, 255, (64 << 20,), dtype=torch.uint8))
            for g in sizes:
                n = min(16384, (64 << 20) // (2 * g))
                stride = (64 << 20) // n
                best = float("inf")
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    t.write([WriteOp(ls, i * stride, d, i * stride, g) for i in range(n)]).wait()
                    best = min(best, time.perf_counter() - t0)
                out.append({"transport": name, "path": "op", "op_bytes": g, "ops": n, "us_per_op": best * 1e6 / n,
                            "gbps": n * g / best / 1e9})
                if not posts_natively(t):
                    continue
                m = min(32768, (64 << 20) // (2 * g))
                stride = (64 << 20) // m
                op = RunsOp(ls, 0, d, 0, 64 << 20, torch.arange(m, dtype=torch.int64) * stride,
                            torch.full((m,), g, dtype=torch.int64))
                best = float("inf")
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    write_runs(t, [op]).wait()
                    best = min(best, time.perf_counter() - t0)
                out.append({"transport": name, "path": "run", "op_bytes": g, "ops": m, "us_per_op": best * 1e6 / m,
                            "gbps": m * g / best / 1e9})
            t.close()
        finally:
            a.send(1)
            p.join(10)
    return out


def packed_costs(elements: int = 8 << 20, fraction: float = 0.0128, repeats: int = 3) -> list[dict]:
    """Seconds of each delta phase on one bf16 output of ``elements`` elements cast from an fp32
    master, ``fraction`` of its elements changed (uniformly scattered, 8-byte blocks), best of
    ``repeats``, in this process: ``separate`` the cast (torch) then the native comparison,
    ``fused`` the fused cast + compare (:mod:`weight_transfer.delta.fused`), ``pack`` packing the
    runs into one record, ``apply`` the receiver's scatter of it (:mod:`weight_transfer.delta.packed`);
    then the two packed formats at 1-byte granularity, the packed default: ``cast`` torch's cast
    alone (the floor a fused pass is held to), ``fused-runs`` / ``pack-runs`` / ``check-runs`` /
    ``apply-runs`` (format 2: ``wt_cast_bf16_delta`` with the run values, ``wt_pack_runs_v``,
    ``wt_check_packed``, ``wt_unpack``) and ``fused-masks`` / ``pack-masks`` / ``check-masks`` /
    ``apply-masks`` (format 3: ``wt_masks`` without writing the output, the record's three copies,
    ``wt_check_masks``, ``wt_unpack_masks``). Every row on one thread. Rows as :func:`op_costs`'
    (``ops``: runs, or changed 64-byte chunks for the masks rows; ``us_per_op``: per op) plus
    ``seconds``."""
    import torch

    from weight_transfer.delta.runs import KERNEL

    lib = KERNEL.lib()
    if lib is None:
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # every row on one thread, torch's cast included (as a training rank runs it)
    try:
        return _packed_costs(lib, elements, fraction, repeats)
    finally:
        torch.set_num_threads(threads)


def _packed_costs(lib, elements: int, fraction: float, repeats: int) -> list[dict]:
    import ctypes

    import torch

    from weight_transfer.delta.fused import cast_bf16_delta
    from weight_transfer.delta.runs import changed_masks, changed_runs_native, index_size

    g = torch.Generator().manual_seed(0)
    a = torch.randn(elements, generator=g) * 0.02
    b = a.clone()
    idx = torch.randperm(elements, generator=g)[:int(elements * fraction)]
    b[idx] = b[idx].to(torch.bfloat16).float() * (1 + 2 ** -6)  # a changed bf16 element
    base = a.to(torch.bfloat16).view(torch.uint8)
    out = torch.empty(2 * elements, dtype=torch.uint8)
    rows, best = [], {}

    def timed(name, fn):
        t = float("inf")
        for _ in range(repeats):
            shadow = base.clone()
            t0 = time.perf_counter()
            r = fn(shadow)
            t = min(t, time.perf_counter() - t0)
        best[name] = (t, r)

    def separate(shadow):
        out.view(torch.bfloat16).copy_(b)
        return changed_runs_native(out, shadow, 8)

    timed("separate", separate)
    timed("fused", lambda shadow: cast_bf16_delta(b, out, shadow, 8))
    runs = best["fused"][1]
    m, c = len(runs), runs.nbytes
    q, nix = index_size(runs, out.numel(), 8)  # format 2: varint index in 8-byte units, then the bytes
    rec = torch.empty(nix + c, dtype=torch.uint8)
    timed("pack", lambda _s: lib.wt_pack_runs(out.data_ptr(), runs.starts.data_ptr(), runs.lens.data_ptr(), m, q,
                                              rec.data_ptr(), rec[nix:].data_ptr()))
    dst = base.clone()
    timed("apply", lambda _s: lib.wt_unpack(ctypes.c_void_p(dst.data_ptr()), rec.data_ptr(), nix, rec[nix:].data_ptr(),
                                            m, out.numel(), q))
    ops = dict.fromkeys(best, m)
    # the two packed formats at 1-byte granularity (the default of a delta that may pack)
    timed("cast", lambda _s: out.view(torch.bfloat16).copy_(b))
    timed("fused-runs", lambda shadow: cast_bf16_delta(b, out, shadow, 1, inline=True))
    r1 = best["fused-runs"][1]
    ix1 = r1.index[2]
    rec1 = torch.empty(ix1 + r1.nbytes + 64, dtype=torch.uint8)
    timed("pack-runs", lambda _s: lib.wt_pack_runs_v(out.data_ptr(), r1.starts.data_ptr(), r1.lens.data_ptr(),
                                                     r1.vals.data_ptr(), len(r1), 1, rec1.data_ptr(),
                                                     rec1[ix1:].data_ptr()))
    tot, why = ctypes.c_int64(0), ctypes.c_int64(0)
    timed("check-runs", lambda _s: lib.wt_check_packed(rec1.data_ptr(), ix1, len(r1), out.numel(), 1,
                                                       ctypes.byref(tot), ctypes.byref(why)))
    dst1 = base.clone()
    timed("apply-runs", lambda _s: lib.wt_unpack(ctypes.c_void_p(dst1.data_ptr()), rec1.data_ptr(), ix1,
                                                 rec1[ix1:].data_ptr(), len(r1), out.numel(), 1))
    timed("fused-masks", lambda shadow: changed_masks(b, shadow))
    mk = best["fused-masks"][1]
    k, c = len(mk), mk.nbytes
    rec3 = torch.empty(12 * k + c + 64, dtype=torch.uint8)

    def pack3(_s):  # what Packer.pack_masks copies
        rec3[:8 * k].view(torch.int64).copy_(mk.masks)
        rec3[8 * k:12 * k].view(torch.int32).copy_(mk.chunks)
        rec3[12 * k:12 * k + c].copy_(mk.vals)

    timed("pack-masks", pack3)
    timed("check-masks", lambda _s: lib.wt_check_masks(mk.masks.data_ptr(), mk.chunks.data_ptr(), k, out.numel(),
                                                       ctypes.byref(tot), ctypes.byref(why)))
    dst3 = base.clone()
    timed("apply-masks", lambda _s: lib.wt_unpack_masks(ctypes.c_void_p(dst3.data_ptr()), mk.masks.data_ptr(),
                                                        mk.chunks.data_ptr(), k, mk.vals.data_ptr(), c, out.numel()))
    if not (torch.equal(dst1, dst3) and torch.equal(dst1, out)):
        raise RuntimeError("bench-delta: the runs and masks records did not rebuild the same output (a bug)")
    ops.update({n: len(r1) for n in ("cast", "fused-runs", "pack-runs", "check-runs", "apply-runs")})
    ops.update({n: k for n in ("fused-masks", "pack-masks", "check-masks", "apply-masks")})
    for name, (t, _r) in best.items():
        rows.append({"transport": "cpu", "path": name, "op_bytes": 2 * elements, "ops": ops[name],
                     "us_per_op": t * 1e6 / max(ops[name], 1), "gbps": 2 * elements / t / 1e9, "seconds": t})
    return rows


def _packed_table(rows: list[dict]) -> list[str]:
    lines = ["# delta phases on one bf16 output cast from fp32 (1.28% of elements changed):",
             "# 8-byte blocks: separate = torch cast + native compare; fused = one pass (cast, compare, shadow, runs);",
             "# pack = the runs into one record; apply = the receiver's scatter of it. 1-byte (the packed default):",
             "# cast = torch's cast alone; *-runs = format 2 (ops: runs), *-masks = format 3 (ops: changed 64-B chunks)",
             f"{'path':>11} {'output':>10} {'ops':>8} {'seconds':>9} {'per op':>8} {'output GB/s':>11}",
             f"{'':>11} {'(B)':>10} {'':>8} {'(s)':>9} {'(us)':>8} {'':>11}"]
    for r in rows:
        lines.append(f"{r['path']:>11} {r['op_bytes']:>10} {r['ops']:>8} {r['seconds']:>9.4f} {r['us_per_op']:>8.4f} "
                     f"{r['gbps']:>11.2f}")
    by = {r["path"]: r["seconds"] for r in rows}
    if "fused" in by and "separate" in by:
        lines.append(f"# fused / separate: {by['fused'] / by['separate']:.3f}x")
    if all(k in by for k in ("cast", "fused-runs", "fused-masks")):
        f2 = sum(by[k] for k in ("fused-runs", "pack-runs", "check-runs", "apply-runs"))
        f3 = sum(by[k] for k in ("fused-masks", "pack-masks", "check-masks", "apply-masks"))
        lines.append(f"# over the cast: fused-runs {1e3 * (by['fused-runs'] - by['cast']):+.2f} ms, fused-masks "
                     f"{1e3 * (by['fused-masks'] - by['cast']):+.2f} ms; all four phases: format 2 {1e3 * f2:.2f} ms, "
                     f"format 3 {1e3 * f3:.2f} ms ({f3 / f2:.3f}x)")
    return lines


def _ops_table(rows: list[dict]) -> list[str]:
    lines = ["# op: one WriteOp per write (+ base checks + post); run: one RunsOp holding every write as a run",
             "# (checked and posted from C); writes spread over a 64 MiB region of another process",
             f"{'transport':>9} {'path':>4} {'op size':>8} {'ops':>7} {'per op':>8} {'bandwidth':>10}",
             f"{'':>9} {'':>4} {'(B)':>8} {'':>7} {'(us)':>8} {'(GB/s)':>10}"]
    for r in rows:
        lines.append(f"{r['transport']:>9} {r['path']:>4} {r['op_bytes']:>8} {r['ops']:>7} {r['us_per_op']:>8.3f} "
                     f"{r['gbps']:>10.3f}")
    return lines


def _trial(base: TrialConfig, **kw) -> list[dict]:
    res = run_trial(base.replace(**kw))
    bad = [r["step"] for r in res.rows if r["verified"] is not True]
    if bad:
        raise RuntimeError(f"bench-delta: updates {bad} not verified ({kw})")
    return [r for r in res.rows if not r["warmup"]]


def main(args: DeltaBenchConfig) -> int:
    """Run the op table and the trials, print the tables, write ``args.ops_out`` and ``args.out``."""
    ops = op_costs(sizes=args.op_sizes)
    print("\n".join(["# weight-transfer bench-delta: the cost of one op", *_ops_table(ops)]), flush=True)
    phases = packed_costs()
    print("\n".join(_packed_table(phases)), flush=True)
    ops += phases
    if args.ops_out:
        Path(args.ops_out).parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(ops).to_csv(args.ops_out, index=False)
    if args.ops_only:
        return 0

    base = main_job_with(args.override, steps=args.steps, warmup=args.warmup, transport=args.transport,
                         delta_granularity=args.granularity)
    mcfg = base.model_config()
    t_all = time.perf_counter()
    rows: list[dict] = []
    summary = []
    for f in args.fractions:
        runs = [("full", dict(delta=False))] + [
            (f"delta cost={'auto' if c < 0 else c}" + (f" gap={g}" if len(args.merge_gaps) > 1 or g else ""),
             dict(delta=True, delta_merge_gap=g, delta_op_cost=None if c < 0 else c))
            for g in args.merge_gaps for c in args.op_costs]
        got = {}
        for label, kw in runs:
            t0 = time.perf_counter()
            meas = _trial(base, change_fraction=(f,), **kw)
            for r in meas:
                rows.append({**r, "bench": label, "change_fraction": f, "delta_merge_gap": kw.get("delta_merge_gap"),
                             "delta_op_cost": kw.get("delta_op_cost")})
            p50 = statistics.median(r["seconds"] for r in meas)
            wrote = statistics.median(r["delta_bytes"] for r in meas)
            cmp_s = statistics.median(r.get("delta_compare_s") or 0.0 for r in meas)
            got[label] = (p50, wrote, meas[0]["bytes"], statistics.median(r.get("n_writes") or 0 for r in meas), cmp_s)
            print(f"# {label:>16} at {f:g}: p50 {p50:.4f} s (compare {cmp_s:.4f} s), {wrote / 1e9:.4f} GB written "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        full_s = got["full"][0]
        for label, (p50, wrote, total, nw, cmp_s) in got.items():
            summary.append((f, label, p50, wrote, total, nw, full_s / p50, cmp_s))
    lines = [
        "# weight-transfer bench-delta: full vs delta updates (every update verified bit-exact)",
        f"# model: {mcfg.label}; {base.train.n_train} training ranks -> {base.inference.describe()} "
        f"({base.inference.quant or 'bf16'}); transport {args.transport}; granularity {args.granularity} B "
        f"(compare: the slowest rank's comparison + runs + shadow seconds, inside the write stage); "
        f"{args.steps} measured updates per trial after {args.warmup} warm-up",
        "# synthetic steps: that fraction of every tensor's elements changes per step, uniformly scattered",
        "#",
        f"{'fraction':>9} {'mode':>16} {'p50':>9} {'compare':>8} {'written':>14} {'of full':>8} {'writes':>9} "
        f"{'speedup':>8}",
        f"{'':>9} {'':>16} {'(s)':>9} {'(s)':>8} {'(B)':>14} {'(%)':>8} {'':>9} {'(x)':>8}",
    ]
    for f, label, p50, wrote, total, nw, sp, cmp_s in summary:
        lines.append(f"{f:>9g} {label:>16} {p50:>9.4f} {cmp_s:>8.4f} {wrote:>14.0f} {100 * wrote / total:>8.2f} "
                     f"{nw or 0:>9.0f} {sp:>8.2f}")
    stops = [f for f, label, p50, *_ in summary if label != "full" and p50 >= next(
        s[2] for s in summary if s[0] == f and s[1] == "full")]
    pays = sorted({f for f, label, p50, *_ in summary if label != "full"} - set(stops))
    lines += ["#", f"# delta p50 below full p50 at fractions {pays or 'none'}; no better than full at "
                   f"{sorted(set(stops)) or 'none'} (where delta stops paying)",
              f"# total {time.perf_counter() - t_all:.0f} s"]
    print("\n".join(lines))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(args.out, index=False)
        print(f"# rows: {args.out}")
    return 0
