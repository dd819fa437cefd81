"""``weight-transfer analyze``: results CSVs -> results/summary.md and PNG plots.

    weight-transfer analyze                                   # every sweep CSV in results/
    weight-transfer analyze results/qwen3_cpu_small.csv -o results
    weight-transfer analyze --timeline results/timeline.json  # (re)draw one update's pipeline

Without ``--timeline``, an existing ``timeline.png`` in the output directory (the one
experiments/bench/pipeline.py draws) is kept and linked; otherwise ``results/timeline.json``
is drawn if present.

Reads CSV (and Chrome-trace JSON for the timeline) only; never imports the transfer code.
Plots: latency_vs_size.png, bandwidth_vs_ranks.png, watermark.png, timeline.png (see
analysis/plots.py); a plot whose data is missing is skipped with a note.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import plots
from .paths import project_dir

RESULTS = project_dir() / "results"


def _env_line(df) -> str:
    parts = []
    for col, name in (("host", "host"), ("git_sha", "git"), ("cluster", "cluster"), ("transport", "transport")):
        if col in df and df[col].notna().any():
            parts.append(f"{name}: {', '.join(sorted(map(str, df[col].dropna().unique())))}")
    if "memcpy_gbps" in df and df["memcpy_gbps"].notna().any():
        parts.append(f"memcpy (1 thread, same runs): {df['memcpy_gbps'].median():.2f} GB/s median")
    if "timestamp" in df and df["timestamp"].notna().any():
        parts.append(f"measured {df['timestamp'].min()} .. {df['timestamp'].max()}")
    return "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="weight-transfer analyze", description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="*", help="results CSVs (default: every sweep CSV in results/, i.e. with trial_key)")
    ap.add_argument("-o", "--out", default=str(RESULTS), help="directory for summary.md and the PNGs")
    ap.add_argument("--timeline", default=None,
                    help="Chrome-trace JSON of one update to draw (default: results/timeline.json if present)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [Path(p) for p in args.csv] or sorted(p for p in RESULTS.glob("*.csv") if plots.is_trial_csv(p))
    if not paths:
        print(f"error: no sweep results (CSV with a trial_key column) in {RESULTS}; run "
              f"`weight-transfer sweep NAME` first", file=sys.stderr)
        return 2
    df = plots.load(paths)
    s = plots.summarize(df)
    wrote = []
    note = f"  [{df['host'].iloc[0]}]" if "host" in df and len(df) and df["host"].nunique() == 1 else ""
    for name, fn in (("latency_vs_size.png", plots.plot_latency_vs_size),
                     ("bandwidth_vs_ranks.png", plots.plot_bandwidth_vs_ranks),
                     ("watermark.png", plots.plot_watermark), ("phases.png", plots.plot_phases)):
        p = fn(df if fn is plots.plot_phases else s, out / name, title_note=note)
        print(f"# {name}: " + (f"wrote {p}" if p else "skipped (not enough data in these results)"))
        if p:
            wrote.append(p)
    tl = Path(args.timeline) if args.timeline else RESULTS / "timeline.json"
    if not args.timeline and (out / "timeline.png").exists():  # drawn by experiments/bench/pipeline.py: keep it
        print(f"# timeline.png: kept {out / 'timeline.png'} (redraw with --timeline TRACE.json)")
        wrote.append(out / "timeline.png")
    elif tl.exists():
        try:
            from .timeline import plot_timeline
        except ImportError:
            print("# timeline.png: skipped (analysis/timeline.py not available)")
        else:
            p = plot_timeline([tl], out / "timeline.png", title=f"Pipeline timeline of one update ({tl.name})")
            print(f"# timeline.png: wrote {p}")
            wrote.append(p)
    elif args.timeline:
        print(f"error: {tl} does not exist", file=sys.stderr)
        return 2
    md = plots.summary_markdown(s, sources=[str(p.relative_to(RESULTS.parent)) if p.is_relative_to(RESULTS.parent)
                                            else str(p) for p in paths], env=_env_line(df))
    if wrote:
        md += "\nPlots: " + ", ".join(f"[{p.name}]({p.name})" for p in wrote) + "\n"
    (out / "summary.md").write_text(md)
    print(f"# summary.md: wrote {out / 'summary.md'} ({len(s)} configurations from {len(df)} measured updates)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
