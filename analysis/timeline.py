"""Draw the pipeline timeline of one update as a per-rank Gantt chart (PNG).

Reads Chrome trace JSON only (the files ``reference/timeline.py`` writes: one process per
rank, one thread per stage, "X" events with ``ts`` / ``dur`` in microseconds); it imports
nothing from the transfer code. Several per-rank files of one update can be given at once.

    weight-transfer timeline results/runs/trace/step0002.json -o results/timeline.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STAGE_COLORS = {
    "h2d": "#8c6bb1",
    "prepare": "#4c72b0",
    "write": "#dd8452",
    "release": "#55a868",
    "barrier": "#c44e52",
    "update": "#b0b0b0",
}
ROW_ORDER = ("update", "h2d", "prepare", "write", "release", "barrier")


def load_events(paths) -> list[dict]:
    """All trace events of the given files (JSON object or bare array form)."""
    events = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        events += d["traceEvents"] if isinstance(d, dict) else d
    return events


def gantt_rows(events: list[dict]) -> list[tuple[int, str, list[tuple[float, float, dict]]]]:
    """``[(rank, stage, [(start_ms, dur_ms, event), ...])]`` for every (rank, stage) that has
    events, ranks ascending, stages in pipeline order; times relative to the earliest event."""
    xs = [e for e in events if e.get("ph") == "X"]
    if not xs:
        return []
    t0 = min(e["ts"] for e in xs)
    rows: dict[tuple[int, str], list] = {}
    for e in xs:
        stage = e.get("cat", "?")
        rows.setdefault((e["pid"], stage), []).append(((e["ts"] - t0) / 1e3, e["dur"] / 1e3, e))
    order = {s: i for i, s in enumerate(ROW_ORDER)}
    return [(r, s, sorted(v, key=lambda x: x[0])) for (r, s), v in
            sorted(rows.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], 99)))]


def plot_timeline(paths, out, *, title: str | None = None) -> Path:
    """Gantt chart of the trace(s) in ``paths`` written to ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    rows = gantt_rows(load_events(paths))
    if not rows:
        raise ValueError(f"no complete ('X') events in {', '.join(map(str, paths))}")
    fig, ax = plt.subplots(figsize=(12, 0.38 * len(rows) + 1.6))
    labels, prev_rank = [], None
    for y, (rank, stage, bars) in enumerate(rows):
        color = STAGE_COLORS.get(stage, "#777777")
        for i, (a, d, _e) in enumerate(bars):
            alpha = 0.55 if stage == "update" else (0.95 if i % 2 == 0 else 0.7)
            ax.broken_barh([(a, max(d, 1e-3))], (y - 0.4, 0.8), facecolors=color, alpha=alpha, edgecolor="none")
        labels.append(f"rank {rank}  {stage}")
        if prev_rank is not None and rank != prev_rank:
            ax.axhline(y - 0.5, color="#444444", lw=0.6)
        prev_rank = rank
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("time since the first event (ms)")
    upd = [e for _, s, bars in rows if s == "update" for _, _, e in bars]
    sub = ""
    if upd:
        a = upd[0].get("args", {})
        mode = "pipelined" if a.get("pipelined", True) else "stage-serialized"
        wm = a.get("watermark")
        sub = f"{mode}, watermark {'unbounded' if wm is None else f'{wm / 2**20:.0f} MiB'}" + \
              (", offloaded" if a.get("offloaded") else "")
    ax.set_title(title or f"pipeline timeline of one update ({sub})", fontsize=10, loc="left")
    ax.grid(axis="x", color="#dddddd", lw=0.5)
    handles = [plt.Rectangle((0, 0), 1, 1, color=STAGE_COLORS[s]) for s in ROW_ORDER
               if any(st == s for _, st, _ in rows)]
    ax.legend(handles, [s for s in ROW_ORDER if any(st == s for _, st, _ in rows)], loc="upper right",
              fontsize=7, ncol=6, frameon=False, bbox_to_anchor=(1.0, -0.09), borderaxespad=0.2)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="weight-transfer timeline", description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="Chrome trace JSON file(s) of one update")
    ap.add_argument("-o", "--out", default="results/timeline.png")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    print(plot_timeline(args.traces, args.out, title=args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
