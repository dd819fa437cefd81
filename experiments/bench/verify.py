"""What the end-to-end fingerprints cost (issue 56's acceptance: ``sample`` within 5% of
``off`` on the main job, ``full`` stated, measured in one run).

The main job (``weight-transfer run``'s default: 2 FSDP2 ranks -> a TP=2 block-FP8 instance,
1.585 GB per update, every update also verified bit-exact by the harness) with
``--fingerprints off``, ``sample`` and ``full``, ``--rounds`` rounds of one trial per mode, the
order rotating each round (so that a drift of the machine's load hits every mode alike): per
mode the p50 of every measured update of its trials, the bytes the fingerprints checked per
update, the seconds from the coordinator's request to the comparison, and the ratios to ``off``
(overall, and per round: each round's three trials ran back to back).

    weight-transfer bench-verify                           # 3 rounds x 4 updates, the main job
    weight-transfer bench-verify --rounds 1 --steps 2 --override num_hidden_layers=1

Writes ``--out`` (one row per trial and measured update: the mode, the round and the trial's
tidy columns, ``verify_bytes`` / ``verify_s`` included).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ..config import main_job_with
from ..paths import project_dir
from ..trial import run_trial

ROOT = project_dir()
MODES = ("off", "sample", "full")


@dataclass(kw_only=True, slots=True)
class VerifyBenchConfig:
    """Options of ``weight-transfer bench-verify``."""

    rounds: int = 3
    """Rounds of one trial per mode (``off``, ``sample``, ``full``), the order rotating."""
    steps: int = 4
    """Measured updates per trial."""
    warmup: int = 1
    """Updates before the measured ones."""
    cycle: int = 32
    """``sample``: versions per full coverage (``--fingerprint-cycle``)."""
    override: tuple[str, ...] = ()
    """HF-config overrides ``KEY=VALUE``, comma-separated, on top of the main job's (tests use a
    smaller model)."""
    out: str = str(ROOT / "results" / "runs" / "verify_bench.csv")
    """CSV of one row per trial and measured update (overwritten; the default is untracked: pass
    ``--out results/verify/verify_bench.csv`` to record a campaign); empty: none."""

    def __post_init__(self):
        for name in ("rounds", "steps", "cycle"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: at least 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup}: at least 0")


def _trial(args: VerifyBenchConfig, mode: str) -> list[dict]:
    cfg = main_job_with(args.override, steps=args.steps, warmup=args.warmup, fingerprints=mode,
                        fingerprint_cycle=args.cycle)
    res = run_trial(cfg)
    bad = [r["step"] for r in res.rows if r["verified"] is not True]
    if bad:
        raise RuntimeError(f"bench-verify: updates {bad} not verified ({mode})")
    if mode != "off" and any(r.get("fingerprints") != mode for r in res.rows):
        raise RuntimeError(f"bench-verify: an update of the {mode} trial ran no fingerprints")
    return [r for r in res.rows if not r["warmup"]]


def main(args: VerifyBenchConfig) -> int:
    """Run the rounds, print the table, write ``args.out``."""
    from ..env import git_sha

    rows: list[dict] = []
    per_round: list[dict[str, float]] = []
    t_all = time.perf_counter()
    for i in range(args.rounds):
        order = MODES[i % 3:] + MODES[:i % 3]
        got = {}
        for mode in order:
            t0 = time.perf_counter()
            meas = _trial(args, mode)
            rows += [{**r, "bench": mode, "round": i} for r in meas]
            got[mode] = statistics.median(r["seconds"] for r in meas)
            print(f"# round {i} {mode:>6}: p50 {got[mode]:.4f} s over {len(meas)} updates "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        per_round.append(got)
    p50 = {m: statistics.median(r["seconds"] for r in rows if r["bench"] == m) for m in MODES}
    base = main_job_with(args.override)
    lines = ["# weight-transfer bench-verify: the main job with end-to-end fingerprints off, sample "
             f"(cycle {args.cycle}) and full (every update also verified bit-exact by the harness); git {git_sha()}",
             f"# model: {base.model_config().label}; {base.train.n_train} training ranks -> {base.inference.describe()}; "
             f"{args.rounds} round(s) of one trial per mode, the order rotating, {args.steps} measured updates each "
             f"after {args.warmup} warm-up; load average at the end {os.getloadavg()[0]:.2f}",
             "#", f"{'mode':>8} {'updates':>8} {'p50':>8} {'p95':>8} {'min':>8} {'checked':>10} {'verify':>8} {'ratio':>7}",
             f"{'':>8} {'':>8} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'p50 (MB)':>10} {'p50 (s)':>8} {'(x off)':>7}"]
    for m in MODES:
        mine = [r for r in rows if r["bench"] == m]
        s = sorted(r["seconds"] for r in mine)
        chk = statistics.median(float(r.get("verify_bytes") or 0) for r in mine) / 1e6
        vs = statistics.median(float(r.get("verify_s") or 0.0) for r in mine)
        lines.append(f"{m:>8} {len(s):>8} {p50[m]:>8.4f} {s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]:>8.4f} "
                     f"{s[0]:>8.4f} {chk:>10.1f} {vs:>8.4f} {p50[m] / p50['off']:>7.3f}")
    rs = {m: [g[m] / g["off"] for g in per_round] for m in ("sample", "full")}
    lines += ["#"] + [f"# {m} / off p50: {p50[m] / p50['off']:.4f}x (per round: " + ", ".join(f"{x:.3f}" for x in rs[m])
                      + f"; median {statistics.median(rs[m]):.3f}x)" for m in ("sample", "full")]
    lines += ["# target: sample within 5% of off (<= 1.05x); full stated", f"# wall {time.perf_counter() - t_all:.0f} s"]
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(args.out, index=False)
        print(f"# rows written to {args.out}", flush=True)
    return 0
