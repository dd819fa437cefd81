"""The **stall** of weight updates, from an engine's step log (pure functions, no processes).

An RL fleet pays for a weight update in the time its inference engines do not generate. The
engine side records a step log (``weight_transfer.engines.generate.GenerationLoad``): one entry
``(t_start, t_end, label, n_tokens)`` per engine step, ``time.time()`` seconds; the update side
records one window per update ``(version, t_begin, t_golive_start, t_golive_end, t_end)``:

- ``t_begin``: the first byte of the engine's weights may move (pause-based: the pause begins);
- ``[t_golive_start, t_golive_end]``: the go-live that makes ``version`` live between two steps
  (shadow targets: the flip or the shadow-to-live copy under the engine's step lock;
  pause-based: the resume, both ends the resume time). NaN or None when there was none;
- ``t_end``: ``version`` is published (the update is over).

Definitions (the log is sorted by ``t_start``; step ``i`` runs ``[s_i, e_i]``):

- an **idle gap** is ``[e_i, s_{i+1}]`` between consecutive steps, of length
  ``max(0, s_{i+1} - e_i)``; before the first and after the last step there is none (a window
  the log does not reach on both sides has ``covered`` False);
- a **start-to-start interval** is ``[s_i, s_{i+1}]`` (a step plus the gap after it);
- a gap or interval ``[a, b]`` **overlaps** a window ``[t_begin, t_end]`` when ``b > t_begin``
  and ``a < t_end``; a step belongs to a window when its midpoint ``(s + e) / 2`` lies in
  ``[t_begin, t_end)``; "between updates" means overlapping / belonging to no window.

Per update (:func:`update_stall`):

- ``stall_s``: the longest idle gap overlapping the window (0 if none): for a pause-based
  update about the whole transfer, for a shadow update the gap around the go-live;
- ``golive_gap_s``: the longest idle gap intersecting the go-live window, closed intervals
  (``e_i <= t_golive_end`` and ``s_{i+1} >= t_golive_start``), 0 if none or no go-live;
- ``max_gap_during_s``: the longest start-to-start interval overlapping the window (0 if none);
- ``tok_s_during``: tokens of the window's steps / ``(t_end - t_begin)`` (tokens/s);
- ``steps_during``, ``tokens_during``: the window's steps and their tokens.

Between updates (:func:`between_stats`, the same for every update of one log):

- ``p50_gap_between_s``, ``max_gap_between_s``: median and longest start-to-start interval
  overlapping no window (NaN if none);
- ``tok_s_between``: tokens of steps belonging to no window / the seconds of the log's span
  ``[s_0, e_last]`` outside every window (tokens/s; NaN if none).

:func:`label_errors` checks what each step served; :func:`stall_rows` makes tidy rows.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

COLUMNS = ("version", "t_begin", "t_golive_start", "t_golive_end", "t_end", "window_s", "golive_s", "stall_s",
           "golive_gap_s", "max_gap_during_s", "max_gap_between_s", "p50_gap_between_s", "tok_s_during",
           "tok_s_between", "steps_during", "tokens_during", "covered", "label_errors")
"""The columns of :func:`stall_rows` (then any ``extra`` columns)."""


class _Log:
    """A step log as sorted numpy arrays: starts, ends (seconds), tokens; labels as a list."""

    def __init__(self, step_log: Sequence):
        steps = sorted((tuple(s) for s in step_log), key=lambda s: s[0])
        self.s = np.array([float(x[0]) for x in steps], dtype=np.float64)
        self.e = np.array([float(x[1]) for x in steps], dtype=np.float64)
        self.n = np.array([int(x[3]) for x in steps], dtype=np.int64)
        self.labels = [x[2] for x in steps]
        self.mid = (self.s + self.e) / 2
        self.gap_a, self.gap_b = self.e[:-1], self.s[1:]          # idle gaps [e_i, s_{i+1}]
        self.gap = np.clip(self.gap_b - self.gap_a, 0.0, None)
        self.iv_a, self.iv_b = self.s[:-1], self.s[1:]            # start-to-start intervals
        self.iv = self.iv_b - self.iv_a

    def __len__(self) -> int:
        return len(self.s)


def _window(w) -> tuple:
    """``(version, t_begin, g0, g1, t_end)`` with the go-live ends as floats (NaN if none)."""
    v, b, g0, g1, e = w
    nan = float("nan")
    return v, float(b), nan if g0 is None else float(g0), nan if g1 is None else float(g1), float(e)


def _max(x: np.ndarray) -> float:
    return float(x.max()) if len(x) else 0.0


def _outside(a: np.ndarray, b: np.ndarray, windows: Sequence) -> np.ndarray:
    """Mask of intervals ``[a, b]`` that overlap no window."""
    keep = np.ones(len(a), dtype=bool)
    for w in windows:
        _, tb, _, _, te = _window(w)
        keep &= ~((b > tb) & (a < te))
    return keep


def update_stall(step_log, window, *, log: _Log | None = None) -> dict:
    """The per-update metrics of one window (module docstring): ``stall_s``, ``golive_gap_s``,
    ``max_gap_during_s`` (seconds), ``tok_s_during`` (tokens/s), ``steps_during``,
    ``tokens_during``, ``window_s`` / ``golive_s`` (the window's and the go-live's seconds) and
    ``covered`` (steps before ``t_begin`` and after ``t_end`` exist)."""
    L = log or _Log(step_log)
    v, b, g0, g1, e = _window(window)
    over = (L.gap_b > b) & (L.gap_a < e)
    golive = 0.0
    if not (math.isnan(g0) or math.isnan(g1)):
        golive = _max(L.gap[(L.gap_a <= g1) & (L.gap_b >= g0)])
    inside = (L.mid >= b) & (L.mid < e)
    span = e - b
    tokens = int(L.n[inside].sum())
    return {"version": v, "t_begin": b, "t_golive_start": g0, "t_golive_end": g1, "t_end": e,
            "window_s": span, "golive_s": g1 - g0, "stall_s": _max(L.gap[over]), "golive_gap_s": golive,
            "max_gap_during_s": _max(L.iv[(L.iv_b > b) & (L.iv_a < e)]),
            "tok_s_during": tokens / span if span > 0 else float("nan"),
            "steps_during": int(inside.sum()), "tokens_during": tokens,
            "covered": bool(len(L) and (L.e <= b).any() and (L.s >= e).any())}


def _union_within(windows: Sequence, lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` covered by the union of the windows."""
    spans = sorted((max(lo, _window(w)[1]), min(hi, _window(w)[4])) for w in windows)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            total += 0.0 if cur_b is None else cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    return total + (0.0 if cur_b is None else cur_b - cur_a)


def between_stats(step_log, windows: Sequence, *, log: _Log | None = None) -> dict:
    """The between-updates statistics (module docstring): ``p50_gap_between_s``,
    ``max_gap_between_s`` (seconds; NaN if no interval lies outside the windows),
    ``tok_s_between`` (tokens/s), ``steps_between``, ``seconds_between``."""
    L = log or _Log(step_log)
    nan = float("nan")
    if not len(L):
        return {"p50_gap_between_s": nan, "max_gap_between_s": nan, "tok_s_between": nan,
                "steps_between": 0, "seconds_between": 0.0}
    iv = L.iv[_outside(L.iv_a, L.iv_b, windows)]
    out = np.ones(len(L), dtype=bool)
    for w in windows:
        _, b, _, _, e = _window(w)
        out &= ~((L.mid >= b) & (L.mid < e))
    lo, hi = float(L.s[0]), float(L.e.max())
    seconds = (hi - lo) - _union_within(windows, lo, hi)
    return {"p50_gap_between_s": float(np.median(iv)) if len(iv) else nan,
            "max_gap_between_s": float(iv.max()) if len(iv) else nan,
            "tok_s_between": float(L.n[out].sum()) / seconds if seconds > 0 else nan,
            "steps_between": int(out.sum()), "seconds_between": seconds}


def _older(label, version) -> bool:
    """``label`` is an older version than ``version`` (None: before any version)."""
    return label is None or label < version


def label_errors(step_log, windows: Sequence) -> list[dict]:
    """Steps whose label contradicts the go-live times. For each window of ``version`` with a
    go-live ``[g0, g1]``:

    - ``"stale"``: the step started at or after ``g1`` (the go-live ended) but carries an older
      label (``label < version``, or None);
    - ``"early"``: the step ended at or before ``g0`` (before the go-live began) but carries
      ``version`` or a later one (``label >= version``).

    Labels and versions must be mutually comparable (a label None counts as older than every
    version). Steps straddling a go-live (impossible under the step lock) are not judged.
    Returns ``[{index, t_start, t_end, label, n_tokens, version, reason}]``, ``index`` in the
    log sorted by ``t_start``; one entry per (step, window) contradiction."""
    L = _Log(step_log)
    numeric = all(x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)) for x in L.labels)
    lab = np.array([-np.inf if x is None else x for x in L.labels], dtype=np.float64) if numeric else None
    bad = []
    for w in windows:
        v, _, g0, g1, _ = _window(w)
        if math.isnan(g0) or math.isnan(g1):
            continue
        if lab is not None and isinstance(v, (int, float)):  # vectorised: numeric labels
            stale, early = np.nonzero((L.s >= g1) & (lab < v))[0], np.nonzero((L.e <= g0) & (lab >= v))[0]
        else:
            stale = [i for i in np.nonzero(L.s >= g1)[0] if _older(L.labels[i], v)]
            early = [i for i in np.nonzero(L.e <= g0)[0] if not _older(L.labels[i], v)]
        bad += [_bad(L, int(i), v, "stale") for i in stale] + [_bad(L, int(i), v, "early") for i in early]
    return sorted(bad, key=lambda d: (d["index"], str(d["version"])))


def _bad(L: _Log, i: int, version, reason: str) -> dict:
    return {"index": i, "t_start": float(L.s[i]), "t_end": float(L.e[i]), "label": L.labels[i],
            "n_tokens": int(L.n[i]), "version": version, "reason": reason}


def stall_rows(step_log, windows: Sequence, **extra) -> list[dict]:
    """One tidy row per update window: the :data:`COLUMNS` (``label_errors``: how many
    contradictions :func:`label_errors` finds for that update's version), then ``extra``
    (e.g. ``mode="shadow flip"``, ``engine=0``) in every row."""
    L = _Log(step_log)
    between = between_stats(step_log, windows, log=L)
    errors = label_errors(step_log, windows)
    rows = []
    for w in windows:
        r = update_stall(step_log, w, log=L)
        r.update({k: between[k] for k in ("max_gap_between_s", "p50_gap_between_s", "tok_s_between")})
        r["label_errors"] = sum(1 for x in errors if x["version"] == r["version"])
        rows.append({**{c: r[c] for c in COLUMNS}, **extra})
    return rows
