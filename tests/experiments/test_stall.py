"""Stall metrics (experiments/stall.py) on synthetic step logs with known answers, label checks,
the tidy rows, one live generation load measured end to end, and the tokens/s figure
(analysis/stall_plot.py)."""
from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from weight_transfer.analysis.stall_plot import plot_tokens_per_s, tokens_per_s
from weight_transfer.engines.generate import GenerationLoad
from weight_transfer.experiments.stall import (
    COLUMNS,
    between_stats,
    label_errors,
    stall_rows,
    update_stall,
)

STEP, IDLE, TOK = 0.001, 0.001, 4
"""Synthetic engine: 1 ms steps, 1 ms apart, 4 tokens each: 2000 tokens/s between updates."""
PAUSE = (1, 3.0, 5.0, 5.0, 5.0)
"""Version 1, pause-based: paused 3.0 .. 5.0 s, the resume (go-live) and publish at 5.0 s."""
SHADOW = (2, 7.0, 8.001, 8.004, 9.0)
"""Version 2, shadow: the update runs 7.0 .. 9.0 s, a 3 ms go-live 8.001 .. 8.004 s."""


def synthetic_log(t_stop: float = 10.0) -> list[tuple[float, float, int, int]]:
    """Steps every 2 ms from 0 s; none while paused (3.0 .. 5.0 s); the step that ends at
    8.001 s is followed by the 3 ms go-live; labels: 0, then 1 from the resume, 2 after the go-live."""
    steps, t, label = [], 0.0, 0
    while t < t_stop:
        if 3.0 <= t < 5.0:
            t, label = 5.0, 1
        steps.append((t, round(t + STEP, 9), label, TOK))
        t = round(t + STEP + IDLE, 9)  # exact grid: no float drift across 3.0 s
        if abs(steps[-1][1] - 8.001) < 1e-9:
            t, label = 8.004, 2
    return steps


def test_pause_stall_is_the_pause():
    r = update_stall(synthetic_log(), PAUSE)
    assert r["stall_s"] == pytest.approx(2.0, abs=0.003)          # last step ends 2.999, next starts 5.0
    assert r["golive_gap_s"] == pytest.approx(r["stall_s"])       # the resume lies in that gap
    assert r["max_gap_during_s"] == pytest.approx(2.002, abs=0.003)
    assert r["steps_during"] == 0 and r["tok_s_during"] == 0.0 and r["covered"]
    assert r["window_s"] == 2.0 and r["golive_s"] == 0.0


def test_shadow_stall_is_the_go_live():
    r = update_stall(synthetic_log(), SHADOW)
    assert r["stall_s"] == pytest.approx(0.003, abs=1e-6)
    assert r["golive_gap_s"] == pytest.approx(0.003, abs=1e-6)
    assert r["golive_s"] == pytest.approx(0.003)
    assert r["max_gap_during_s"] == pytest.approx(0.004, abs=1e-6)
    assert r["tok_s_during"] == pytest.approx(2000, rel=0.01)     # serving went on
    assert r["steps_during"] == pytest.approx(999, abs=2)


def test_between_updates():
    b = between_stats(synthetic_log(), [PAUSE, SHADOW])
    assert b["p50_gap_between_s"] == pytest.approx(0.002) and b["max_gap_between_s"] == pytest.approx(0.002)
    assert b["tok_s_between"] == pytest.approx(2000, rel=0.01)
    assert b["seconds_between"] == pytest.approx(10.0 - 2.0 - 2.0, abs=0.003)


def test_no_window_gap_and_an_uncovered_window():
    log = synthetic_log(1.0)
    r = update_stall(log, (3, 0.5, None, None, 0.5005))  # inside one step
    assert r["stall_s"] == 0.0 and r["golive_gap_s"] == 0.0 and math.isnan(r["golive_s"])
    assert not update_stall(log, (3, 0.9, 0.95, 0.95, 1.5))["covered"]  # the log ends first
    assert math.isnan(between_stats([], [PAUSE])["max_gap_between_s"])


def test_label_errors_find_injected_labels():
    log = synthetic_log()
    windows = [PAUSE, SHADOW]
    assert label_errors(log, windows) == []
    stale = next(i for i, s in enumerate(log) if s[0] >= 8.5)
    early = next(i for i, s in enumerate(log) if s[0] >= 2.0)
    log[stale] = (*log[stale][:2], 1, TOK)   # after version 2 went live, still version 1
    log[early] = (*log[early][:2], 1, TOK)   # before version 1's resume, already version 1
    got = label_errors(log, windows)
    assert [(g["index"], g["version"], g["reason"]) for g in got] == [(early, 1, "early"), (stale, 2, "stale")]
    assert got[1]["label"] == 1 and got[1]["t_start"] == log[stale][0]
    # labels that are not numbers take the general path, None counts as older than any version
    named = [(a, b, None if lab == 0 else f"v{lab}", n) for a, b, lab, n in synthetic_log()]
    assert label_errors(named, [("v1", *PAUSE[1:]), ("v2", *SHADOW[1:])]) == []


def test_rows_are_tidy():
    rows = stall_rows(synthetic_log(), [PAUSE, SHADOW], mode="mixed", engine=0)
    assert [list(r) for r in rows] == [[*COLUMNS, "mode", "engine"]] * 2
    assert [r["version"] for r in rows] == [1, 2] and all(r["label_errors"] == 0 for r in rows)
    assert rows[0]["stall_s"] > 1.9 and rows[1]["stall_s"] < 0.01
    assert rows[0]["tok_s_between"] == rows[1]["tok_s_between"]


def test_a_live_load_measures_its_pause_and_go_live():
    """End to end with a real generation load: a 0.3 s pause, then a 30 ms go-live under the lock."""
    p = {"model.embed_tokens.weight": torch.randn(256, 64).to(torch.bfloat16),
         "model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    lock, ver = threading.Lock(), [0]
    load = GenerationLoad(lambda: p, lock, label=lambda: ver[0]).start()
    time.sleep(0.05)
    b1 = load.pause()
    time.sleep(0.3)
    ver[0] = 1
    r1 = load.resume()
    time.sleep(0.05)
    b2 = time.time()
    with lock:
        g0 = time.time()
        time.sleep(0.03)
        ver[0] = 2
        g1 = time.time()
    time.sleep(0.05)
    e2 = time.time()
    load.stop()
    log = load.snapshot()["steps"]
    rows = stall_rows(log, [(1, b1, r1, r1, r1), (2, b2, g0, g1, e2)])
    assert 0.3 <= rows[0]["stall_s"] < 0.5 and rows[0]["golive_gap_s"] == rows[0]["stall_s"]
    assert 0.03 <= rows[1]["golive_gap_s"] == rows[1]["stall_s"] < 0.2
    assert label_errors(log, [(1, b1, r1, r1, r1), (2, b2, g0, g1, e2)]) == []


def test_plot_tokens_per_s(tmp_path):
    log = synthetic_log()
    x, y = tokens_per_s(log, t0=0.0, bin_s=0.1)
    assert len(x) == len(y) == 100 and y[0] == pytest.approx(2000) and y[40] == 0.0
    out = plot_tokens_per_s({"pause": log, "shadow flip": log, "empty": []},
                            {"pause": [PAUSE], "shadow flip": [SHADOW]}, tmp_path / "tok.png")
    assert out is not None and out.stat().st_size > 1000
    assert plot_tokens_per_s({"pause": []}, {}, tmp_path / "none.png") is None
