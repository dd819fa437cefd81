"""Run the public API's fault worlds (tests/api/test_api_faults.py, case C28) and print what every
rank saw, one row per push: the fault injected, each training rank's outcome (returned, or the
exception type and the first 90 characters of its message), the slowest rank's seconds, and
every receiver's state after it (``c`` complete with every byte equal to a fresh engine's
``load_weights`` of that version, ``C`` complete with other bytes -- never expected --, ``i``
incomplete, ``w`` writing, ``-`` none, ``x`` process gone). docs/FAULTS.md shows a run.

Usage (from the repository root; about 2 minutes on 2 cores)::

    .venv/bin/python scripts/api_faults.py [WORLD ...]       # default: every world

The worlds are tests.api.test_api_faults.WORLDS; an unknown name is one ``error:`` line, exit 2.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fault(f) -> str:
    return "" if f is None else f"{f.role} {f.rank} {f.stage} {f.kind}"


def _outcome(r) -> str:
    if r is None:
        return "(died)"
    if r["ok"]:
        return "ok"
    msg = r["msg"].replace("\n", " ")
    return f"{r['type']}: {msg[:90]}{'...' if len(msg) > 90 else ''}"


def _state(c) -> str:
    if c is None:
        return "x"
    if c["state"] == "complete":
        return "c" if c["bytes_ok"] else "C"
    return {"incomplete": "i", "writing": "w", "none": "-"}.get(c["state"], "?")


def main(argv: list[str]) -> int:
    from tests.api.test_api_faults import WORLDS
    from tests.helpers.api_world import run

    names = argv or list(WORLDS)
    bad = [n for n in names if n not in WORLDS]
    if bad:
        print(f"error: unknown world(s) {bad}; known: {', '.join(WORLDS)}", file=sys.stderr)
        return 2
    for name in names:
        t0 = time.monotonic()
        w = run(WORLDS[name](), tempfile.mkdtemp(prefix="wt-api-faults-"))
        print(f"# {name}: {w.n_train} training ranks, TP={w.tp} x DP={w.dp}, coordinator {w.coordinator}, "
              f"timeout {w.timeout:g} s ({time.monotonic() - t0:.0f} s)")
        print(f"#  {'push':>4}  {'version':>12}  {'fault':<24} {'s':>5}  {'receivers':<9}  training ranks")
        for k, p in enumerate(w.pushes):
            res = [w.results["train"][r].get(k) for r in range(w.n_train)]
            secs = max((r["seconds"] for r in res if r is not None), default=float("nan"))
            recv = "".join(_state(w.results["infer"][i].get(k)) for i in range(w.n_infer))
            outs = [_outcome(r) for r in res]
            same = len({o for o in outs if o != "(died)"}) == 1
            shown = outs[0] if same and "(died)" not in outs else " | ".join(f"{r}: {o}" for r, o in enumerate(outs))
            print(f"   {k:>4}  {str(p.version):>12}  {_fault(p.fault):<24} {secs:5.2f}  {recv:<9}  "
                  f"{'every rank: ' if same and '(died)' not in outs else ''}{shown}")
            if p.last:
                break
        print(f"#  processes left: {w.results['left'] or 'none'}; exit codes {w.results['exit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
