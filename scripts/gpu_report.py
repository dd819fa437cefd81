"""The one table (and results/gpu/summary.csv) of scripts/gpu_check.sh.

    python scripts/gpu_report.py STEPS_TSV RESULTS_DIR
    python scripts/gpu_report.py --junit JUNIT_XML CSV_OUT

``STEPS_TSV``: one line per step, written by gpu_check.sh: ``name<TAB>status<TAB>seconds<TAB>
exit code<TAB>log file<TAB>command``; status is PASS, FAIL, TIMEOUT or SKIP. Each step's
headline figure is read from the CSV it wrote in ``RESULTS_DIR`` (the FP8 quantizers' share of
the same-run device copy, the main job's p50 GB/s, NIXL's GB/s beside the copy, each vLLM
weight-transfer backend's p50 GB/s), or, for a step that did not pass, from the last line of
its log (a step that skipped itself, exit 77, says why there; a dry run's: its command). Writes ``RESULTS_DIR/summary.csv`` (one row
per step, the device named) and prints the table. Exit status 0 when no step FAILED or TIMED
OUT, 1 otherwise, 2 on bad arguments. Needs only the standard library (runs before anything
is installed).

``--junit``: the ``tests`` step's verdict on pytest's JUnit XML: one CSV row per test (``test,
outcome, seconds, message``; outcome passed, failed, error or skipped), one line ``N passed,
N failed, N errors, N skipped``, exit status 1 when a test failed, errored or was SKIPPED, or
none ran (on the GPU machine every GPU-marked test must run: a skip there means a missing
package or a broken CUDA setup, never a pass), 2 when the file cannot be read.
"""
from __future__ import annotations

import csv
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

STATUSES = ("PASS", "FAIL", "TIMEOUT", "SKIP")
FIELDS = ["step", "status", "seconds", "exit_code", "headline", "device", "command", "log"]


def read_steps(path: Path) -> list[dict]:
    """Parse the steps file; raises ValueError naming the line when one is malformed."""
    steps = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("\t")
        if len(parts) != 6 or parts[1] not in STATUSES:
            raise ValueError(f"{path}:{i}: want name, status ({'|'.join(STATUSES)}), seconds, "
                             f"exit code, log, command separated by tabs; got {line!r}")
        name, status, secs, rc, log, cmd = parts
        steps.append({"step": name, "status": status, "seconds": float(secs), "exit_code": int(rc),
                      "log": log, "command": cmd})
    return steps


def _rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _last_line(log: str) -> str:
    p = Path(log)
    if not log or not p.is_file():
        return ""
    lines = [l.strip() for l in p.read_text(errors="replace").splitlines() if l.strip()]
    return lines[-1][:160] if lines else ""


def quant_headline(results: Path) -> str:
    """``triton 71% / torch reference 35% / ... of d2d copy (...)`` for the largest shape of
    quant_bench.csv: each quantizer's time as a share of the same-run copy's."""
    rows = _rows(results / "quant_bench.csv")
    if not rows:
        return ""
    big = max(rows, key=lambda r: int(r["bytes"]))["shape"]
    at = {r["impl"]: r for r in rows if r["shape"] == big}
    if "memcpy" not in at:
        return ""
    copy = float(at["memcpy"]["seconds_min"])
    parts = []
    for impl, r in at.items():
        if impl == "memcpy":
            continue
        same = "" if r.get("identical") in ("True", "true", "1") else " NOT IDENTICAL"
        parts.append(f"{impl} {copy / float(r['seconds_min']):.0%}{same}")
    gbps = int(at["memcpy"]["bytes"]) / copy / 1e9
    return f"{' / '.join(parts)} of d2d copy ({gbps:.0f} GB/s in); {big}"


def trial_headline(results: Path, name: str) -> str:
    """p50 GB/s of the main job's measured updates (experiments CSV: bytes, seconds per row)."""
    rows = [r for r in _rows(results / name)
            if r.get("bytes") and r.get("seconds") and r.get("warmup", "False") not in ("True", "true", "1")]
    if not rows:
        return ""
    g = [int(r["bytes"]) / float(r["seconds"]) / 1e9 for r in rows if float(r["seconds"]) > 0]
    ok = all(r.get("verified", "True") in ("True", "true", "1") for r in rows)
    return f"p50 {statistics.median(g):.2f} GB/s over {len(g)} updates, verified: {'yes' if ok else 'NO'}"


def nixl_headline(results: Path) -> str:
    rows = _rows(results / "nixl_cuda.csv")
    if not rows:
        return ""
    parts = []
    for r in rows:
        if r.get("error") or not r.get("gbps"):
            parts.append(f"{r['case']} FAILED: {r.get('error', '')[:80]}")
        else:
            copy = float(r["copy_gbps"]) if r.get("copy_gbps") else float("nan")
            parts.append(f"{r['case']} {float(r['gbps']):.0f} GB/s ({float(r['gbps']) / copy:.0%} of d2d copy)"
                         f"{'' if r['verified'] == 'True' else ' NOT VERIFIED'}")
    return "; ".join(parts)


def vllm_backends_headline(results: Path) -> str:
    """``one_sided p50 0.52 GB/s 3/3 verified; ipc ...; nccl skipped: ...`` from vllm_backends.csv
    (scripts/gpu_vllm_backends.py: one row per update, or one ``skipped:`` / ``error:`` row)."""
    rows = _rows(results / "vllm_backends.csv")
    parts = []
    for b in dict.fromkeys(r["backend"] for r in rows):
        rs = [r for r in rows if r["backend"] == b]
        timed = [r for r in rs if r.get("gbps")]
        other = next((r["status"] for r in rs if r["status"] != "ok"), "")
        if not timed:
            parts.append(f"{b} {other[:70]}")
            continue
        ok = sum(r["verified"] in ("True", "true", "1") for r in timed)
        parts.append(f"{b} p50 {statistics.median(float(r['gbps']) for r in timed):.2f} GB/s "
                     f"{ok}/{len(timed)} verified{'; ' + other[:60] if other else ''}")
    return "; ".join(parts)


TEST_FIELDS = ["test", "outcome", "seconds", "message"]


def junit_rows(path: Path) -> list[dict]:
    """One row per ``<testcase>`` of pytest's JUnit XML (``--junitxml``): ``test``
    (``classname::name``), ``outcome`` (passed / failed / error / skipped), ``seconds``,
    ``message`` (first line of the failure, error or skip reason). Raises OSError or
    ValueError (malformed XML)."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise ValueError(f"{path}: not JUnit XML ({e})") from None
    rows = []
    for tc in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = "failed" if tag == "failure" else tag
                message = (el.get("message") or el.text or "").strip().splitlines()[:1]
                message = message[0][:200] if message else ""
                break
        rows.append({"test": f"{tc.get('classname', '')}::{tc.get('name', '')}", "outcome": outcome,
                     "seconds": float(tc.get("time") or 0.0), "message": message})
    return rows


def junit_counts(rows: list[dict]) -> str:
    n = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    return f"{n['passed']} passed, {n['failed']} failed, {n['error']} errors, {n['skipped']} skipped"


def junit_main(xml_path: Path, csv_out: Path) -> int:
    """``--junit``: write the tests' CSV, print the counts (and every test that did not pass),
    return 0 only when at least one test ran and every test passed."""
    try:
        rows = junit_rows(xml_path)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    csv_out.parent.mkdir(parents=True, exist_ok=True)
    with csv_out.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TEST_FIELDS)
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        if r["outcome"] != "passed":
            print(f"{r['outcome'].upper()}: {r['test']}: {r['message']}")
    ok = bool(rows) and all(r["outcome"] == "passed" for r in rows)
    print(f"{junit_counts(rows)}{'' if rows else ' (no test ran)'}"
          f"{'' if ok else ' -- every GPU test must run and pass here'}")
    return 0 if ok else 1


def tests_headline(results: Path) -> str:
    """Counts of the ``tests`` step (gpu_tests.csv, written by ``--junit``)."""
    rows = _rows(results / "gpu_tests.csv")
    return f"{junit_counts(rows)} (GPU-marked tests)" if rows else ""


HEADLINES = {
    "tests": tests_headline,
    "quant": quant_headline,
    "cuda_ipc": lambda d: trial_headline(d, "main_cuda_ipc.csv"),
    "nixl": nixl_headline,
    "vllm_backends": vllm_backends_headline,
}


def device_name(results: Path) -> str:
    p = results / "device.txt"
    return p.read_text().strip().splitlines()[0] if p.is_file() and p.read_text().strip() else "unknown"


def summarize(steps: list[dict], results: Path) -> list[dict]:
    """Add ``headline`` and ``device`` to each step."""
    dev = device_name(results)
    out = []
    for s in steps:
        head = ""
        if s["status"] == "PASS" and s["step"] in HEADLINES:
            head = HEADLINES[s["step"]](results)
        if not head and s["status"] != "SKIP":
            head = _last_line(s["log"])
        if s["status"] == "SKIP" and not head:  # a step that skipped itself says why last; a dry run has no log
            head = _last_line(s["log"])
        if s["status"] == "SKIP" and not head:
            head = s["command"] if len(s["command"]) <= 100 else s["command"][:97] + "..."
        out.append({**s, "headline": head, "device": dev})
    return out


def format_table(rows: list[dict]) -> str:
    dev = rows[0]["device"] if rows else "unknown"
    lines = [f"# GPU check (scripts/gpu_check.sh) on {dev}",
             f"{'step':<13} {'status':<8} {'time':>7}  headline",
             f"{'':<13} {'':<8} {'(s)':>7}"]
    for r in rows:
        lines.append(f"{r['step']:<13} {r['status']:<8} {r['seconds']:>7.1f}  {r['headline']}")
    bad = [r["step"] for r in rows if r["status"] in ("FAIL", "TIMEOUT")]
    lines.append(f"# {sum(r['status'] == 'PASS' for r in rows)} passed, {len(bad)} failed"
                 f"{' (' + ', '.join(bad) + ')' if bad else ''}, "
                 f"{sum(r['status'] == 'SKIP' for r in rows)} skipped")
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 3 and argv[0] == "--junit":
        return junit_main(Path(argv[1]), Path(argv[2]))
    if len(argv) != 2 or argv[0].startswith("-"):
        usage = [line.strip() for line in __doc__.strip().splitlines()[2:4]]
        print("usage: " + "\n       ".join(usage), file=sys.stderr)
        return 2
    steps_file, results = Path(argv[0]), Path(argv[1])
    try:
        steps = read_steps(steps_file)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = summarize(steps, results)
    write_csv(rows, results / "summary.csv")
    print(format_table(rows))
    return 1 if any(r["status"] in ("FAIL", "TIMEOUT") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
