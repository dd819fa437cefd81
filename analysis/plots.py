"""Results CSV -> derived figures: summary table and PNG plots.

Reads only the tidy rows the experiments write (raw ``bytes`` and ``seconds`` per update; see
docs/PERFORMANCE.md); derives p50 / p99 update time, algbw = bytes / p50 / 1e9 and speedups
here. Imports nothing from reference/, experiments/, baselines/ or engines/.

Plots (each a function ``plot_*(summary, path) -> path | None``; None when the results hold
no data for it):

- ``latency_vs_size.png``: p50 update time vs bytes per update, a line per method (log-log);
- ``bandwidth_vs_ranks.png``: algbw by world shape (training ranks -> inference layout),
  grouped bars per method;
- ``watermark.png``: the reference's p50 update time and peak temporary memory vs the
  executor watermark.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

GROUP = ["method", "model", "dtype", "train_dtype", "n_train", "n_infer", "layout", "watermark", "transport",
         "train_layout", "pipeline", "offload"]
"""Columns that identify one trial's configuration (those present in the data are used)."""

METHOD_STYLE = {"reference": ("#4c72b0", "o"), "rank0_funnel": ("#dd8452", "s"), "rpc": ("#55a868", "^")}
METHOD_ORDER = ["reference", "rank0_funnel", "rpc"]

REQUIRED = {"method", "bytes", "seconds", "step"}


def is_trial_csv(path: Path) -> bool:
    """A measured-trials CSV (sweep output): has the tidy trial columns and a ``trial_key``."""
    try:
        cols = set(pd.read_csv(path, nrows=0).columns)
    except Exception:
        return False
    return REQUIRED <= cols and "trial_key" in cols


def load(paths) -> pd.DataFrame:
    """Every row of the given CSVs (one per update), with a ``source`` column (file stem);
    warmup and simulated rows dropped."""
    frames = []
    for p in paths:
        df = pd.read_csv(p)
        df["source"] = Path(p).stem
        frames.append(df)
    if not frames:
        return pd.DataFrame()
    df = pd.concat(frames, ignore_index=True)
    if "warmup" in df:
        df = df[~df["warmup"].astype(str).str.lower().eq("true")]
    if "simulated" in df:
        df = df[~df["simulated"].astype(str).str.lower().eq("true")]
    return df.reset_index(drop=True)


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """One row per trial configuration: updates, bytes, p50 / p99 seconds, algbw (GB/s),
    peak temporary bytes, all verified. Several runs of one configuration are pooled."""
    if df.empty:
        return df
    keys = [c for c in GROUP if c in df]
    d = df.copy()
    for c in keys:  # NaN (e.g. unbounded watermark) must not drop a group
        d[c] = d[c].astype(object).where(d[c].notna(), "")
    g = d.groupby(keys, sort=False)
    out = g.agg(updates=("seconds", "size"), bytes=("bytes", "first"), p50_s=("seconds", "median"),
                p99_s=("seconds", lambda s: s.quantile(0.99)), min_s=("seconds", "min"),
                peak_temp_bytes=("peak_temp_bytes", "max") if "peak_temp_bytes" in d else ("bytes", "size"),
                verified=("verified", lambda s: bool(s.astype(str).str.lower().eq("true").all()))).reset_index()
    out["algbw_gbps"] = out["bytes"] / out["p50_s"] / 1e9
    out["watermark"] = pd.to_numeric(out["watermark"], errors="coerce") if "watermark" in out else float("nan")
    return out


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mode(s: pd.Series):
    return s.value_counts().index[0]


def _methods(df) -> list[str]:
    ms = list(dict.fromkeys(df["method"]))
    return sorted(ms, key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else 99, m))


def _world(row) -> str:
    return f"{int(row['n_train'])}->{row['layout']}"


def _save(plt, fig, path) -> Path:
    """Lay out, write (110 dpi) and close ``fig``; the path written."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_latency_vs_size(s: pd.DataFrame, path, *, title_note: str = "") -> Path | None:
    """p50 update time vs bytes per update, per method, in the most common world (training
    ranks, inference layout) with an unbounded watermark. Needs >= 2 sizes."""
    if s.empty:
        return None
    d = s[s["watermark"].isna()] if s["watermark"].isna().any() else s
    world = _mode(d.apply(_world, axis=1))
    d = d[d.apply(_world, axis=1) == world]
    if d["bytes"].nunique() < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for m in _methods(d):
        x = d[d["method"] == m].sort_values("bytes")
        color, marker = METHOD_STYLE.get(m, (None, "x"))
        ax.errorbar(x["bytes"] / 1e6, x["p50_s"], yerr=[[0] * len(x), (x["p99_s"] - x["p50_s"]).clip(lower=0)],
                    label=m, color=color, marker=marker, capsize=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter

    for axis in (ax.xaxis, ax.yaxis):  # plain numbers on log axes (60, 100, 200; 0.1, 0.5, 1)
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "235" else ""))
    ax.set_xlabel("bytes per update (MB, log)")
    ax.set_ylabel("update time p50 (s, log); bar to p99")
    ax.set_title(f"Update latency vs model size, {world}{title_note}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_bandwidth_vs_ranks(s: pd.DataFrame, path, *, title_note: str = "") -> Path | None:
    """algbw by world shape, grouped bars per method, for the model with the most world
    shapes (unbounded watermark). Needs >= 2 world shapes."""
    if s.empty:
        return None
    d = s[s["watermark"].isna()] if s["watermark"].isna().any() else s
    d = d.assign(world=d.apply(_world, axis=1))
    model = max(d["model"].unique(), key=lambda m: d[d["model"] == m]["world"].nunique())
    d = d[d["model"] == model]
    worlds = sorted(d["world"].unique(), key=lambda w: (int(w.split("->")[0]) + int(d[d["world"] == w]["n_infer"].iloc[0]), w))
    if len(worlds) < 2:
        return None
    methods = _methods(d)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6.4, 1.1 * len(worlds) + 2), 4.4))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        xs, ys = [], []
        for i, w in enumerate(worlds):
            row = d[(d["world"] == w) & (d["method"] == m)]
            if len(row):
                xs.append(i + (j - (len(methods) - 1) / 2) * width)
                ys.append(row["algbw_gbps"].iloc[0])
        ax.bar(xs, ys, width=width, label=m, color=METHOD_STYLE.get(m, (None,))[0])
    ax.set_xticks(range(len(worlds)), [w.replace("->", " -> ") for w in worlds])
    ax.set_xlabel("world: training ranks -> inference layout (TP x DP)")
    ax.set_ylabel("algbw at p50 (GB/s = 1e9 B/s)")
    ax.set_title(f"Bandwidth vs rank counts, {model}{title_note}")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend()
    return _save(plt, fig, path)


def plot_watermark(s: pd.DataFrame, path, *, title_note: str = "") -> Path | None:
    """The reference's p50 update time and peak temporary memory vs the watermark, in the
    (model, world) with the most watermark values. Needs >= 2 values (unbounded counts)."""
    d = s[s["method"] == "reference"] if not s.empty else s
    if d.empty:
        return None
    d = d.assign(world=d.apply(lambda r: f"{r['model']} {_world(r)}", axis=1))
    world = max(d["world"].unique(), key=lambda w: d[d["world"] == w]["watermark"].nunique(dropna=False))
    d = d[d["world"] == world]
    if d["watermark"].nunique(dropna=False) < 2:
        return None
    d = d.assign(order=d["watermark"].fillna(float("inf"))).sort_values("order")
    labels = ["unbounded" if pd.isna(w) else f"{w / 2**20:g}" for w in d["watermark"]]
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    xs = range(len(d))
    a1.plot(xs, d["p50_s"], marker="o", color=METHOD_STYLE["reference"][0])
    a1.set_ylabel("update time p50 (s)")
    a2.plot(xs, d["peak_temp_bytes"] / 1e6, marker="s", color="#c44e52")
    a2.set_ylabel("peak temporary memory per training rank (MB)")
    for a in (a1, a2):
        a.set_xticks(list(xs), labels)
        a.set_xlabel("watermark (MiB)")
        a.grid(True, alpha=0.3)
        a.set_ylim(bottom=0)
    fig.suptitle(f"Watermark vs update time and temporary memory (reference)\n{world}{title_note}", fontsize=10)
    return _save(plt, fig, path)


def _fmt_wm(w) -> str:
    return "-" if pd.isna(w) else f"{w / 2**20:g} MiB"


PHASES = ("h2d", "prepare", "write", "release", "barrier", "commit", "publish")
"""The per-phase columns of the results (``phase_<name>_s``, docs/PERFORMANCE.md)."""


def plot_phases(df: pd.DataFrame, path, *, title_note: str = "") -> Path | None:
    """A stacked bar per (method, model): the median over measured updates of each phase's busy
    seconds (``phase_*_s``), beside the median update time (a black tick): stages overlap in
    the pipeline, so the stack can exceed the update time. None when the results carry no
    phase columns (rows recorded before they existed)."""
    cols = [f"phase_{p}_s" for p in PHASES if f"phase_{p}_s" in df]
    if not cols or df[cols].dropna(how="all").empty:
        return None
    d = df.dropna(subset=cols, how="all")
    g = d.groupby(["method", "model"], sort=False)
    med = g[cols].median().fillna(0.0)
    upd = g["seconds"].median()
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(med) + 3), 4.2))
    x = range(len(med))
    bottom = [0.0] * len(med)
    for c in cols:
        vals = med[c].tolist()
        if not any(vals):
            continue
        ax.bar(x, vals, bottom=bottom, label=c.removeprefix("phase_").removesuffix("_s"))
        bottom = [a + b for a, b in zip(bottom, vals)]
    ax.scatter(list(x), upd.tolist(), marker="_", s=400, color="black", zorder=3, label="update time (p50)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{m}\n{mod}" for m, mod in med.index], fontsize=7)
    ax.set_ylabel("seconds (p50 over updates)")
    ax.set_title(f"Per-phase busy seconds{title_note}", fontsize=9)
    ax.legend(fontsize=7)
    return _save(plt, fig, path)


def summary_markdown(s: pd.DataFrame, *, sources: list[str] = (), env: str = "") -> str:
    """A markdown table, a row per trial configuration, plus each world's speedup of the
    reference over the baselines (p50 ratios measured in the same results)."""
    lines = ["# Results summary", ""]
    if env:
        lines += [env, ""]
    if sources:
        lines += ["Sources: " + ", ".join(f"`{x}`" for x in sources) + ". Derived by `weight-transfer analyze`; "
                  "column definitions in docs/PERFORMANCE.md.", ""]
    if s.empty:
        return "\n".join(lines + ["No measured rows."]) + "\n"
    lines += ["| method | model | world | watermark | updates | bytes (MB) | p50 (s) | p99 (s) | algbw (GB/s) "
              "| peak tmp (MB) | verified |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    d = s.assign(world=s.apply(_world, axis=1))
    d = d.sort_values(["model", "bytes", "n_train", "n_infer", "world", "watermark", "method"],
                      key=lambda c: c.map(lambda m: METHOD_ORDER.index(m) if m in METHOD_ORDER else 99)
                      if c.name == "method" else c)
    for _, r in d.iterrows():
        lines.append(f"| {r['method']} | {r['model']} | {r['world']} | {_fmt_wm(r['watermark'])} | {r['updates']} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['p50_s']:.3f} | {r['p99_s']:.3f} | {r['algbw_gbps']:.3f} | "
                     f"{r['peak_temp_bytes'] / 1e6:.1f} | {'yes' if r['verified'] else 'NO'} |")
    sp = speedups(s)
    if not sp.empty:
        lines += ["", "Speedup of the reference (baseline p50 / reference p50, same model and world; > 1: the "
                  "reference is faster):", "", "| model | world | baseline | speedup |", "|---|---|---|---:|"]
        for _, r in sp.iterrows():
            lines.append(f"| {r['model']} | {r['world']} | {r['baseline']} | {r['speedup']:.2f} |")
    return "\n".join(lines) + "\n"


def speedups(s: pd.DataFrame) -> pd.DataFrame:
    """Baseline p50 / reference p50 for every (model, world) with an unbounded watermark that
    has the reference and a baseline."""
    if s.empty:
        return pd.DataFrame()
    d = s[s["watermark"].isna()].assign(world=lambda x: x.apply(_world, axis=1)) if s["watermark"].isna().any() else s.assign(world=s.apply(_world, axis=1))
    rows = []
    for (model, world), g in d.groupby(["model", "world"], sort=False):
        ref = g[g["method"] == "reference"]
        if ref.empty:
            continue
        for m in _methods(g):
            if m != "reference":
                rows.append({"model": model, "world": world, "baseline": m,
                             "speedup": g[g["method"] == m]["p50_s"].iloc[0] / ref["p50_s"].iloc[0]})
    return pd.DataFrame(rows)
