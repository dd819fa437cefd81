"""Plots and tables of the RL loop's results (``examples/rl_loop.py``, ``weight-transfer rl``).
Reads CSVs only (never the transfer code).

- :func:`plot_run`: one run's ``rl_<tag>.csv`` -> reward per step and push seconds per version;
- :func:`plot_rewards`: several runs' reward curves in one figure;
- :func:`changes_summary` / :func:`changes_markdown` / :func:`plot_changes`: ``rl_changes.csv``
  (what one step changes, per lr x kind x granularity) -> the median over steps, as a table
  and a plot (docs/DELTA.md).

    python -m weight_transfer.analysis.rl results/rl_changes.csv results/rl_lr*.csv -o results
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

GRAN_ORDER = ["bf16_elems", "bf16_rows", "fp8_elems", "fp8_rows", "fp8_blocks", "scales"]
KIND_ORDER = ["all", "attention", "mlp", "experts", "router", "embeddings", "norms", "other"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_run(csv_path, png_path) -> Path:
    """Reward (mean over the step's samples; chance 0.5) per step, and each push's seconds."""
    import pandas as pd

    plt = _plt()
    df = pd.read_csv(csv_path)
    tr = df[df["step"] > 0]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(tr["step"], tr["reward_mean"], marker="o", ms=3, label="reward (mean of the step's samples)")
    if len(tr) >= 5:
        a.plot(tr["step"], tr["reward_mean"].rolling(5, min_periods=1).mean(), lw=2, label="5-step mean")
    a.axhline(0.5, color="grey", ls=":", label="random policy")
    a.set_xlabel("step (rollout of weight version = step)")
    a.set_ylabel("reward")
    a.set_ylim(0, 1.02)
    a.set_title(f"RL loop ({df['run'].iloc[0]}): reward, lr {df['lr'].iloc[0]:g}")
    a.legend(fontsize=7, loc="lower right")
    b.plot(df["pushed_version"], df["push_seconds"], marker="o", ms=3, label="push (go -> complete)")
    if "push_call_seconds" in df:
        b.plot(df["pushed_version"], df["push_call_seconds"], marker=".", ms=3, label="send_weights call")
    b.set_xlabel("weight version pushed")
    b.set_ylabel("seconds")
    b.set_ylim(bottom=0)
    mb = df["push_bytes"].median() / 1e6
    ok = df["verified"].astype(str).eq("True").sum()
    b.set_title(f"{mb:.1f} MB per push; {ok}/{len(df)} verified against the oracle")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)


def plot_rewards(csvs, png_path) -> Path:
    """The reward curves of several runs (one line per CSV, 5-step rolling mean)."""
    import pandas as pd

    plt = _plt()
    fig, a = plt.subplots(figsize=(6, 3.6))
    for c in csvs:
        df = pd.read_csv(c)
        tr = df[df["step"] > 0]
        a.plot(tr["step"], tr["reward_mean"].rolling(5, min_periods=1).mean(), label=f"lr {df['lr'].iloc[0]:g}")
    a.axhline(0.5, color="grey", ls=":", label="random policy")
    a.set_xlabel("step")
    a.set_ylabel("reward (5-step mean)")
    a.set_ylim(0, 1.02)
    a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)


def changes_summary(csv_path):
    """``rl_changes.csv`` -> one row per lr x kind x granularity: steps, median / min / max
    fraction changed over steps, median delta bytes over full bytes."""
    import pandas as pd

    df = pd.read_csv(csv_path)
    df["delta_ratio"] = pd.to_numeric(df["delta_bytes"], errors="coerce") / df["full_bytes"]
    g = df.groupby(["lr", "kind", "granularity"])
    out = g.agg(steps=("step", "nunique"), fraction_median=("fraction", "median"), fraction_min=("fraction", "min"),
                fraction_max=("fraction", "max"), delta_ratio_median=("delta_ratio", "median"),
                total=("total", "first")).reset_index()
    out["kind"] = pd.Categorical(out["kind"], [k for k in KIND_ORDER if k in set(out["kind"])], ordered=True)
    out["granularity"] = pd.Categorical(out["granularity"], GRAN_ORDER, ordered=True)
    return out.sort_values(["lr", "kind", "granularity"]).reset_index(drop=True)


def _pct(x) -> str:
    if x != x:  # NaN
        return "-"
    if x == 0:
        return "0"
    return f"{100 * x:.3g}%"


def changes_markdown(csv_path) -> str:
    """The median fraction changed per step, a table per lr (rows: kinds; columns:
    granularities), and the median delta bytes / full bytes of each granularity (all tensors)."""
    s = changes_summary(csv_path)
    lines = []
    for lr, d in s.groupby("lr"):
        steps = int(d["steps"].max())
        lines.append(f"**lr {lr:g}** (median over {steps} steps; fraction of units that changed in one step)\n")
        cols = [c for c in GRAN_ORDER if c in set(d["granularity"].astype(str))]
        lines.append("| kind | " + " | ".join(cols) + " |")
        lines.append("|---|" + "---:|" * len(cols))
        for kind, dk in d.groupby("kind", observed=True):
            m = {str(r.granularity): (r.fraction_median if r.total else float("nan")) for r in dk.itertuples()}
            lines.append(f"| {kind} | " + " | ".join(_pct(m.get(c, float("nan"))) for c in cols) + " |")
        da = d[d["kind"].astype(str) == "all"]
        m = {str(r.granularity): r.delta_ratio_median for r in da.itertuples()}
        lines.append("| delta bytes / full (all) | " + " | ".join(_pct(m.get(c, float("nan"))) for c in cols) + " |")
        lines.append("")
    return "\n".join(lines)


def plot_changes(csv_path, png_path) -> Path:
    """Per step, the fraction changed of every granularity (all tensors), one panel per lr, log scale."""
    import pandas as pd

    plt = _plt()
    df = pd.read_csv(csv_path)
    df = df[df["kind"] == "all"]
    lrs = sorted(df["lr"].unique())
    fig, axes = plt.subplots(1, len(lrs), figsize=(5 * len(lrs), 3.8), squeeze=False, sharey=True)
    for a, lr in zip(axes[0], lrs):
        d = df[df["lr"] == lr]
        for g in GRAN_ORDER:
            dg = d[d["granularity"] == g].sort_values("step")
            if len(dg):
                a.plot(dg["step"], dg["fraction"].clip(lower=1e-7), marker=".", label=g)
        a.set_yscale("log")
        a.set_title(f"lr {lr:g}: fraction changed by one step (all tensors)")
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of units changed")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return Path(png_path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m weight_transfer.analysis.rl", description=__doc__.split("\n")[0])
    ap.add_argument("csvs", nargs="+", help="rl_changes.csv and/or rl_<tag>.csv files")
    ap.add_argument("-o", "--out", default="results", help="output directory")
    a = ap.parse_args(argv)
    out = Path(a.out)
    runs = [c for c in a.csvs if not c.endswith("rl_changes.csv")]
    for c in a.csvs:
        if c.endswith("rl_changes.csv"):
            print(changes_markdown(c))
            print(f"# {plot_changes(c, out / 'rl_changes.png')}")
    for c in runs:
        print(f"# {plot_run(c, Path(c).with_suffix('.png'))}")
    if len(runs) > 1:
        print(f"# {plot_rewards(runs, out / 'rl_rewards.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
