"""Plots of the at-scale simulation, from results/simulated.csv only (no transfer code).

``python -m weight_transfer.analysis.simulation [results/simulated.csv]`` writes, per simulated config (the
latest row of each method):

- ``results/sim_<config>_methods.png``: predicted update time of every method next to its
  physical floor and the published figure, log scale, seconds;
- ``results/sim_<config>_stages.png``: each method's per-stage busy time (seconds; the busiest
  rank's for the reference, summed over tensors for the baselines);
- ``results/sim_<config>_gantt.png`` from ``results/sim_<config>_gantt.csv.gz`` (written by
  ``simulate``): the simulated per-stage timeline of a few training ranks, one lane per
  (rank, stage), bars colored by mesh group -- the shape of the published profile;
- ``results/sim_kimi_map.png`` from ``results/sim_kimi_map.csv`` (``simulate --map``):
  Kimi-K2's floor against MoE mesh width x inference layout, cells where the published
  1.2-1.3 s can be reached (floor at most 1.3 s) outlined, full-size predictions from
  ``results/simulated.csv`` printed where they exist.

Column meanings: docs/PERFORMANCE.md and docs/SIMULATION.md.
"""
from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd

from .paths import project_dir

ROOT = project_dir()
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


STAGE_ORDER = ("h2d", "prepare", "write", "release")


def _save(fig, csv: str | Path, out: str | Path | None) -> Path:
    """Write ``fig`` to ``out``, or next to ``csv`` as ``<stem>.png`` (a ``.csv.gz`` loses both
    suffixes), at 110 dpi, and close it. Returns the PNG's path."""
    fig.tight_layout()
    out = Path(out) if out else Path(str(csv).removesuffix(".gz")).with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_gantt(csv: str | Path, out: str | Path | None = None) -> Path:
    """One simulated update of a few training ranks over time: a lane per (rank, stage),
    one bar per task, colored by mesh group (seconds from "go")."""
    df = pd.read_csv(csv)
    cfg = df.config.iloc[0]
    method = "reference"
    if "method" in df:  # one chart: the published executor's semantics where simulated
        method = "overlapped_writes" if (df.method == "overlapped_writes").any() else df.method.iloc[0]
        df = df[df.method == method]
    ranks = sorted(df["rank"].unique())
    stages = [s for s in STAGE_ORDER if s in set(df.stage)]
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(ranks) * len(stages) + 1.6))
    colors = plt.get_cmap("tab10")
    lanes = []
    for i, r in enumerate(ranks):
        for j, st in enumerate(stages):
            y = len(lanes)
            lanes.append(f"rank {r} {st}")
            d = df[(df["rank"] == r) & (df.stage == st)]
            for g, dg in d.groupby("group"):
                ax.broken_barh(list(zip(dg.start, dg.end - dg.start)), (y - 0.4, 0.8), color=colors(int(g) % 10), alpha=0.6,
                               label=f"mesh group {int(g)}" if (i, j) == (0, 1) or (st == "prepare" and i == 0) else None)
    h, lab = ax.get_legend_handles_labels()
    uniq = dict(zip(lab, h))
    ax.legend(uniq.values(), uniq.keys(), fontsize=7, loc="upper right")
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time since go (s), simulated")
    what = ("writes of several tasks in flight (published executor)" if method == "overlapped_writes"
            else "one task's writes in flight (this project's executor)")
    ax.set_title(f"{cfg}: simulated per-stage timeline, {what}\n(cost model, not a measurement; overlapping "
                 f"write bars are tasks in flight together)", fontsize=9)
    return _save(fig, csv, out)


def plot_map(csv: str | Path, out: str | Path | None = None, published=(1.2, 1.3), full: str | Path | None = None) -> Path:
    """Heatmap of the **floor** (seconds; busiest link at line rate, exact at full depth) per
    MoE mesh width (rows) x inference layout (columns); cells whose floor is at most the
    published upper bound -- where the published time *can* be reached -- outlined red;
    layouts whose weights do not fit one GPU hatched. Where ``full`` (results/simulated.csv)
    has a full-size prediction of the same width, layout and hardware, it is printed in the cell."""
    import numpy as np
    from matplotlib.patches import Rectangle

    df = pd.read_csv(csv)
    widths = sorted(df.moe_width.unique())
    layouts = list(dict.fromkeys(df.layout_label))
    fl = np.full((len(widths), len(layouts)), np.nan)
    fits = np.ones_like(fl, dtype=bool)
    preds: dict[tuple[int, int], float] = {}
    sim = None
    if full is not None and Path(full).exists():
        sim = pd.read_csv(full)
        head = "overlapped_writes" if (sim.method == "overlapped_writes").any() else "reference"
        sim = sim[(sim.method == head) & (sim.model == df.model.iloc[0]) & (sim.hardware == df.hardware.iloc[0])]
        if "moe_width" in sim:
            sim = sim[sim.moe_width.notna()]
    for _, r in df.iterrows():
        i, j = widths.index(r.moe_width), layouts.index(r.layout_label)
        fl[i, j] = r.floor_seconds
        fits[i, j] = bool(r.get("fits_memory", True))
        if sim is not None and len(sim):
            m = sim[(sim.moe_width == r.moe_width) & (sim.layout == r.layout) & (sim.n_train == sim.n_train.max())]
            m = m[~m.config.str.contains("_L")]
            if len(m):
                preds[(i, j)] = m.seconds.iloc[-1]
    fig, ax = plt.subplots(figsize=(1.6 * len(layouts) + 2.5, 0.85 * len(widths) + 2.4))
    im = ax.imshow(fl, cmap="viridis_r", aspect="auto")
    for i in range(len(widths)):
        for j in range(len(layouts)):
            if np.isnan(fl[i, j]):
                continue
            txt = f"floor {fl[i, j]:.2f} s"
            if (i, j) in preds:
                txt += f"\npred. {preds[(i, j)]:.2f} s"
            ax.text(j, i, txt, ha="center", va="center", fontsize=7,
                    color="white" if fl[i, j] > np.nanmedian(fl) else "black")
            if fl[i, j] <= published[1]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=2.5))
            if not fits[i, j]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///", edgecolor="grey", lw=0))
    ax.set_xticks(range(len(layouts)), layouts, rotation=20, fontsize=7, ha="right")
    ax.set_yticks(range(len(widths)), [f"MoE width {int(w)}" for w in widths], fontsize=8)
    cb = fig.colorbar(im, ax=ax)
    cb.set_label("floor (s): busiest NIC / PCIe / NVLink at line rate")
    ax.set_title(f"{df.model.iloc[0]}, 256 -> 128 GPUs, {df.hardware.iloc[0]} (simulated)\n"
                 f"red: floor <= {published[1]} s, so the published {published[0]}-{published[1]} s is reachable; "
                 f"pred.: full-size prediction; hatched: weights exceed GPU memory", fontsize=8)
    return _save(fig, csv, out)


if __name__ == "__main__":
    csv = Path(sys.argv[1]) if sys.argv[1:] else CSV
    for p in plot_simulation(csv):
        print(p)
    for g in sorted(csv.resolve().parent.glob("sim_*_gantt.csv.gz")):
        print(plot_gantt(g))
    for m in sorted(csv.resolve().parent.glob("sim_*_map.csv")):
        print(plot_map(m, full=csv))
