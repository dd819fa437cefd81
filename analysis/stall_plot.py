"""Tokens/s over time while weights update: what the stall costs an engine, mode by mode.

Reads the records of a generation load (step logs ``[(t_start, t_end, label, n_tokens)]``,
``time.time()`` seconds) and the update windows ``[(version, t_begin, t_golive_start,
t_golive_end, t_end)]`` (as ``experiments/stall.py`` defines them); imports no transfer code.

- ``stall_tokens_per_s.png``: one subplot per mode (e.g. ``"pause"``, ``"shadow flip"``,
  ``"shadow copy"``), shared y axis: tokens/s in ``bin_s`` bins (each step's tokens counted in
  the bin of its midpoint), each update's window shaded, each go-live marked by a red line
  (and span, when it is long enough to see).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from .plots import _plt, _save

WINDOW_COLOR = "#4c72b0"
GOLIVE_COLOR = "#c44e52"
LINE_COLOR = "#55a868"


def tokens_per_s(step_log, *, t0: float, bin_s: float = 0.1, t_stop: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(bin left edges in seconds since t0, tokens/s per bin)``: each step's ``n_tokens``
    counted in the bin of its midpoint, divided by ``bin_s`` (seconds). Bins cover ``t0`` to
    ``t_stop`` (default: the last step's end)."""
    if not len(step_log):
        return np.zeros(0), np.zeros(0)
    mid = np.array([(float(s[0]) + float(s[1])) / 2 for s in step_log]) - t0
    n = np.array([float(s[3]) for s in step_log])
    stop = (max(float(s[1]) for s in step_log) if t_stop is None else t_stop) - t0
    edges = np.arange(0.0, max(stop, bin_s) + bin_s, bin_s)
    counts, _ = np.histogram(mid, bins=edges, weights=n)
    return edges[:-1], counts / bin_s


def _golive(w) -> tuple[float, float] | None:
    g0, g1 = w[2], w[3]
    if g0 is None or g1 is None or math.isnan(float(g0)) or math.isnan(float(g1)):
        return None
    return float(g0), float(g1)


def plot_tokens_per_s(step_logs: dict, windows: dict, path, *, bin_s: float = 0.1,
                      title_note: str = "") -> Path | None:
    """Tokens/s over time per mode (``step_logs``: mode -> step log; ``windows``: mode ->
    update windows, may lack a mode), one subplot each with a shared y axis; x is seconds since
    the mode's first step (or window). Writes ``path``; None when no mode has a step."""
    modes = [m for m, log in step_logs.items() if len(log)]
    if not modes:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(modes), 1, figsize=(9.6, 2.4 * len(modes) + 0.8), sharey=True, squeeze=False)
    for ax, mode in zip(axes[:, 0], modes):
        log, wins = step_logs[mode], list(windows.get(mode, ()))
        t0 = min([float(s[0]) for s in log] + [float(w[1]) for w in wins])
        t_stop = max([float(s[1]) for s in log] + [float(w[4]) for w in wins])
        x, y = tokens_per_s(log, t0=t0, bin_s=bin_s, t_stop=t_stop)
        ax.stairs(y, np.append(x, x[-1] + bin_s) if len(x) else [0.0], color=LINE_COLOR, linewidth=1.0,
                  label=f"tokens/s ({bin_s * 1e3:g} ms bins)")
        for k, w in enumerate(wins):
            ax.axvspan(float(w[1]) - t0, float(w[4]) - t0, color=WINDOW_COLOR, alpha=0.15,
                       label="update window (t_begin..t_end)" if k == 0 else None)
            g = _golive(w)
            if g is not None:
                ax.axvline(g[0] - t0, color=GOLIVE_COLOR, linewidth=0.9, label="go-live" if k == 0 else None)
                if g[1] > g[0]:
                    ax.axvspan(g[0] - t0, g[1] - t0, color=GOLIVE_COLOR, alpha=0.5)
        ax.set_title(f"{mode}: {len(wins)} update(s), {len(log)} steps", fontsize=9)
        ax.set_ylabel("tokens/s")
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="best")
    axes[-1, 0].set_xlabel("seconds since the first step")
    fig.suptitle(f"Generation during weight updates{title_note}", fontsize=10)
    return _save(plt, fig, path)
