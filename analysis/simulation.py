"""Plots of the at-scale simulation, from results/simulated.csv only (no transfer code).

``python -m analysis.simulation [results/simulated.csv]`` writes, per simulated config (the
latest row of each method):

- ``results/sim_<config>_methods.png``: predicted update time of every method next to its
  physical floor and the published figure, log scale, seconds;
- ``results/sim_<config>_stages.png``: each method's per-stage busy time (seconds; the busiest
  rank's for the reference, summed over tensors for the baselines).

Column meanings: docs/PERFORMANCE.md and docs/SIMULATION.md.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CSV = ROOT / "results" / "simulated.csv"


def latest(df: pd.DataFrame) -> pd.DataFrame:
    """The last row of every (config, method)."""
    return df.groupby(["config", "method"], sort=False).tail(1)


def plot_simulation(csv: str | Path = CSV, out_dir: str | Path | None = None) -> list[Path]:
    """Draw the two figures per config; returns the files written."""
    df = pd.read_csv(csv)
    df = latest(df[df["simulated"].astype(str) == "True"])
    out_dir = Path(out_dir) if out_dir else Path(csv).resolve().parent
    written = []
    busy_cols = [c for c in df.columns if c.startswith("busy_") and c.endswith("_seconds")]
    for cfg, d in df.groupby("config", sort=False):
        d = d.reset_index(drop=True)
        head = f"{cfg}\n{d.model[0]}: {d.n_train[0]} training -> {d.n_infer[0]} inference GPUs ({d.layout[0]}), simulated"
        # methods side by side
        fig, ax = plt.subplots(figsize=(10, 4.6))
        x = range(len(d))
        w = 0.27
        ax.bar([i - w for i in x], d.seconds, w, label="predicted")
        ax.bar(list(x), d.floor_seconds, w, label="physical floor (busiest link)")
        if "published_seconds" in d:
            ax.bar([i + w for i in x], d.published_seconds.fillna(0), w, label="published")
        ax.set_yscale("log")
        ax.set_xticks(list(x), d.method, rotation=15)
        ax.set_ylabel("update time (s, log scale)")
        ax.set_title(head, fontsize=9)
        ax.legend(fontsize=8)
        for i, s in zip(x, d.seconds):
            ax.annotate(f"{s:.2f} s", (i - w, s), ha="center", va="bottom", fontsize=7)
        fig.tight_layout()
        p = out_dir / f"sim_{cfg}_methods.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
        # per-stage breakdown
        fig, ax = plt.subplots(figsize=(10, 4.6))
        stages = [c for c in busy_cols if d[c].notna().any()]
        w = 0.8 / max(len(stages), 1)
        for k, c in enumerate(stages):
            ax.bar([i - 0.4 + (k + 0.5) * w for i in x], d[c].fillna(0), w, label=c[5:-8])
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xticks(list(x), d.method, rotation=15)
        ax.set_ylabel("stage busy time (s)")
        ax.set_title(head + " -- per-stage busy time", fontsize=9)
        ax.legend(fontsize=7, ncol=4)
        fig.tight_layout()
        p = out_dir / f"sim_{cfg}_stages.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


if __name__ == "__main__":
    for p in plot_simulation(*(sys.argv[1:2] or [CSV])):
        print(p)
