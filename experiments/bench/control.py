"""What the authenticated control plane costs (issue 54's acceptance: the main job's p50 with
authentication within 2% of without, measured in one run).

Two tables:

1. **Store round trips**: per operation (``check`` of a flag, ``set`` and ``get`` of a 200-byte
   value, ``set`` of a 1 MiB value), microseconds per call from a client process of its own, to
   the job's store (:class:`weight_transfer.security.secure_store.SecureStore`: mutual TLS, every value
   sealed with AES-SIV) and to torch's plain ``TCPStore`` (the ``WEIGHT_TRANSFER_INSECURE=1``
   opt-out), the median of ``--repeats`` batches.
2. **The main job** (``weight-transfer run``'s default, every update verified) with the store
   authenticated and with the opt-out, ``--pairs`` pairs of trials alternating which goes first
   (so that a drift of the machine's load hits both alike): per mode the p50 of every measured
   update of its trials, and the ratio authenticated / opt-out of the p50s, overall and per pair.

    weight-transfer bench-control                           # 3 pairs x 4 updates, the main job
    weight-transfer bench-control --pairs 1 --steps 2 --override num_hidden_layers=1

Writes ``--out`` (one row per trial and measured update: mode, pair, step, raw bytes and
seconds, the phase columns) and ``--ops-out`` (one row per store operation and mode).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from weight_transfer.security.secret import ENV_INSECURE

from ..config import main_job_with
from ..paths import project_dir
from ..trial import run_trial

ROOT = project_dir()
MODES = ("authenticated", "opt-out")


@dataclass(kw_only=True, slots=True)
class ControlBenchConfig:
    """Options of ``weight-transfer bench-control``."""

    pairs: int = 3
    """Pairs of trials (one authenticated, one with the opt-out), alternating which runs first."""
    steps: int = 4
    """Measured updates per trial."""
    warmup: int = 1
    """Updates before the measured ones."""
    override: tuple[str, ...] = ()
    """HF-config overrides ``KEY=VALUE``, comma-separated, on top of the main job's (tests use a
    smaller model)."""
    repeats: int = 5
    """Batches per store operation in the round-trip table (its median)."""
    calls: int = 2000
    """Calls per batch of the round-trip table."""
    out: str = str(ROOT / "results" / "runs" / "control_bench.csv")
    """CSV of one row per trial and measured update (overwritten; the default is untracked: pass
    ``--out results/security/control_bench.csv`` to record a campaign); empty: none."""
    ops_out: str = str(ROOT / "results" / "runs" / "control_ops.csv")
    """CSV of the round-trip table (overwritten); empty: none."""
    ops_only: bool = False
    """Only the round-trip table, no trials."""

    def __post_init__(self):
        for name in ("pairs", "steps", "repeats", "calls"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: at least 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup}: at least 0")


_CLIENT = r"""
import os, statistics, sys, time, weight_transfer as wt
host, port, calls, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = wt.connect_store((host, port), timeout=60)
small, big = b"x" * 200, b"y" * (1 << 20)
s.set("bench/flag", b"1"); s.set("bench/small", small)
ops = {"check (flag)": lambda: s.check(["bench/flag"]), "set (200 B)": lambda: s.set("bench/small", small),
       "get (200 B)": lambda: s.get("bench/small"), "set (1 MiB)": lambda: s.set("bench/big", big)}
for name, f in ops.items():
    n = max(1, calls // 100) if "MiB" in name else calls
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        per.append((time.perf_counter() - t0) / n)
    print(f"{name}\t{statistics.median(per) * 1e6:.2f}", flush=True)
"""


def _ops(mode: str, args: ControlBenchConfig) -> list[dict]:
    """The round-trip table's rows for ``mode``: a store served here, a client process of its own."""
    import weight_transfer as wt

    env = dict(os.environ)
    if mode == "opt-out":
        env[ENV_INSECURE] = "1"
        store = wt.serve_store("127.0.0.1", 0, insecure=True)
    else:
        env.pop(ENV_INSECURE, None)
        store = wt.serve_store("127.0.0.1", 0, insecure=False)
        env.update(store.secret.env())
    try:
        out = subprocess.run([sys.executable, "-c", _CLIENT, "127.0.0.1", str(store.port), str(args.calls),
                              str(args.repeats)], env=env, capture_output=True, text=True, timeout=600)
    finally:
        if hasattr(store, "close"):
            store.close()
    if out.returncode != 0:
        raise RuntimeError(f"bench-control: the {mode} client failed: {out.stderr[-2000:]}")
    rows = []
    for line in out.stdout.splitlines():
        name, us = line.split("\t")
        rows.append({"mode": mode, "op": name, "us_per_call": float(us)})
    return rows


def _trial(base, mode: str) -> list[dict]:
    if mode == "opt-out":
        os.environ[ENV_INSECURE] = "1"
    else:
        os.environ.pop(ENV_INSECURE, None)
    try:
        res = run_trial(base)
    finally:
        os.environ.pop(ENV_INSECURE, None)
    bad = [r["step"] for r in res.rows if r["verified"] is not True]
    if bad:
        raise RuntimeError(f"bench-control: updates {bad} not verified ({mode})")
    return [r for r in res.rows if not r["warmup"]]


def _p(xs, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main(args: ControlBenchConfig) -> int:
    """Run both tables, print them, write ``args.ops_out`` and ``args.out``."""
    from ..env import git_sha

    ops = [r for m in MODES for r in _ops(m, args)]
    by = {(r["mode"], r["op"]): r["us_per_call"] for r in ops}
    lines = ["# weight-transfer bench-control: store round trips (one client process, loopback; median of "
             f"{args.repeats} x {args.calls} calls)", "#",
             f"{'op':>14} {'authenticated':>14} {'opt-out':>10} {'ratio':>7}",
             f"{'':>14} {'(us/call)':>14} {'(us/call)':>10} {'(x)':>7}"]
    for op in dict.fromkeys(r["op"] for r in ops):
        a, b = by[("authenticated", op)], by[("opt-out", op)]
        lines.append(f"{op:>14} {a:>14.1f} {b:>10.1f} {a / b:>7.2f}")
    print("\n".join(lines), flush=True)
    if args.ops_out:
        Path(args.ops_out).parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(ops).to_csv(args.ops_out, index=False)
    if args.ops_only:
        return 0

    base = main_job_with(args.override, steps=args.steps, warmup=args.warmup)
    rows: list[dict] = []
    pair_ratio = []
    t_all = time.perf_counter()
    for i in range(args.pairs):
        order = MODES if i % 2 == 0 else MODES[::-1]
        got = {}
        for mode in order:
            t0 = time.perf_counter()
            meas = _trial(base, mode)
            rows += [{**r, "bench": mode, "pair": i} for r in meas]
            got[mode] = statistics.median(r["seconds"] for r in meas)
            print(f"# pair {i} {mode:>13}: p50 {got[mode]:.4f} s over {len(meas)} updates "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        pair_ratio.append(got["authenticated"] / got["opt-out"])
    p50 = {m: statistics.median(r["seconds"] for r in rows if r["bench"] == m) for m in MODES}
    lines = ["# weight-transfer bench-control: the main job with the store authenticated and with the opt-out "
             f"(every update verified bit-exact); git {git_sha()}",
             f"# model: {base.model_config().label}; {base.train.n_train} training ranks -> {base.inference.describe()}; "
             f"{args.pairs} pair(s) of trials alternating which runs first, {args.steps} measured updates each after "
             f"{args.warmup} warm-up; load average at the end {os.getloadavg()[0]:.2f}",
             "#", f"{'mode':>14} {'updates':>8} {'p50':>8} {'p95':>8} {'min':>8} {'publish':>8}",
             f"{'':>14} {'':>8} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'p50 (s)':>8}"]
    for m in MODES:
        s = [r["seconds"] for r in rows if r["bench"] == m]
        pub = [r.get("phase_publish_s") or 0.0 for r in rows if r["bench"] == m]
        lines.append(f"{m:>14} {len(s):>8} {p50[m]:>8.4f} {_p(s, 0.95):>8.4f} {min(s):>8.4f} "
                     f"{statistics.median(pub):>8.4f}")
    ratio = p50["authenticated"] / p50["opt-out"]
    lines += ["#", f"# authenticated / opt-out p50: {ratio:.4f}x (per pair: "
                   + ", ".join(f"{x:.4f}" for x in pair_ratio) + f"; median {statistics.median(pair_ratio):.4f}x); "
                   "target: within 2% (<= 1.02x)",
              f"# wall {time.perf_counter() - t_all:.0f} s"]
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(args.out, index=False)
        print(f"# rows written to {args.out}", flush=True)
    return 0
