"""``weight-transfer bench-trl`` (experiments/bench/trl.py): its pure functions on hand-made step
logs and sync windows (no server, no TRL job), options refused, the CSV appended row by row."""
import csv
import math

import pytest

from weight_transfer.experiments.bench.trl import (
    COLUMNS,
    TrlBenchConfig,
    append_row,
    busy_seconds,
    dropped_stale,
    format_table,
    inside_mask,
    job_metrics,
    measured_syncs,
    merged,
    parse_overrides,
    rollout_stats,
    step_seconds,
    union_seconds,
)


def _steady(t0: float, t1: float, dt: float = 0.1, busy: float = 0.05, tokens: int = 8) -> list[tuple]:
    """An engine stepping every ``dt`` seconds from ``t0`` to ``t1``, each forward ``busy`` s."""
    n = int(round((t1 - t0 - busy) / dt)) + 1
    return [(round(t0 + i * dt, 9), round(t0 + i * dt + busy, 9), tokens) for i in range(n)]


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="modes="):
        TrlBenchConfig(modes=("off", "pause"))
    with pytest.raises(ValueError, match="ranks="):
        TrlBenchConfig(ranks=(0,))
    with pytest.raises(ValueError, match="warmup=6"):
        TrlBenchConfig(steps=6, warmup=6)
    with pytest.raises(ValueError, match="override 'x'"):
        TrlBenchConfig(override=("x",))
    assert parse_overrides(("hidden_size=1024", "rope_type=x")) == {"hidden_size": 1024, "rope_type": "x"}


def test_windows_union_and_busy_time():
    assert merged([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0.0, 2.0), (3.0, 4.0)]
    assert union_seconds([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    steps = [(0.0, 0.5, 8), (0.9, 1.2, 8), (1.5, 1.6, 8)]
    assert busy_seconds(steps, [(0.25, 1.0), (1.0, 1.1)]) == pytest.approx(0.25 + 0.2)
    assert inside_mask(steps, [(0.2, 1.0)]).tolist() == [True, False, False]  # midpoints 0.25, 1.05, 1.55


def test_measured_syncs_leave_out_train_begin_and_warmup():
    syncs = [{"t0": i * 10.0, "t1": i * 10.0 + 1} for i in range(5)]
    got, lo = measured_syncs(syncs, warmup=1)
    assert got == syncs[2:] and lo == 11.0
    assert measured_syncs(syncs[:2], warmup=1) == ([], None)
    assert step_seconds([10, 12, 15, 19], warmup=1) == [2, 3, 4]
    assert step_seconds([10, 12, 15, 19], warmup=2) == [3, 4]
    assert dropped_stale([{"sample/dropped_stale_total": 2.0}, {"reward": 1}, {"sample/dropped_stale_total": None}]) == 2


def test_pause_based_sync_generates_nothing_and_its_gap_is_the_sync():
    """The engine stops for the 1-second window: 0 tokens/s during it, the gap is the window."""
    steps = _steady(0.0, 10.0)
    steps = [s for s in steps if not (4.0 < s[1] and s[0] < 5.0)]  # nothing overlaps [4, 5]
    r = rollout_stats(steps, [(4.0, 5.0)], (0.0, 10.0))
    assert r["tok_s_during"] == 0 and r["steps_during"] == 0 and r["during_over_between"] == 0
    assert r["tok_s_between"] == pytest.approx(80.0, rel=0.03)  # 8 tokens per 0.1 s
    assert r["max_gap_sync_s"] == pytest.approx(1.05, abs=1e-6) and r["max_gap_s"] == r["max_gap_sync_s"]
    assert r["busy_during"] == 0 and r["busy_between"] == pytest.approx(0.5, rel=0.03)
    assert r["p50_gap_between_s"] == pytest.approx(0.1)


def test_shadow_sync_keeps_generating():
    """The engine steps through the windows (one go-live gap of 20 ms in each): the ratio ~1."""
    steps = [s for s in _steady(0.0, 10.0) if not (2.5 <= s[0] < 2.52)]
    r = rollout_stats(steps, [(2.0, 3.0), (6.0, 7.0)], (0.0, 10.0))
    assert r["tokens_during"] == 8 * 20 - 8 and r["steps_during"] == 19
    assert r["tok_s_during"] == pytest.approx(76.0) and r["during_over_between"] == pytest.approx(76 / 80, rel=0.03)
    assert r["max_gap_sync_s"] == pytest.approx(0.15) and r["max_gap_s"] == pytest.approx(0.15)
    # steps outside the span are not counted
    r2 = rollout_stats(steps + [(20.0, 20.05, 1000)], [(2.0, 3.0), (6.0, 7.0)], (0.0, 10.0))
    assert r2["tok_s_between"] == r["tok_s_between"]


def test_no_steps_give_nan_not_errors():
    r = rollout_stats([], [(1.0, 2.0)], (0.0, 3.0))
    assert r["tok_s_during"] == 0 and math.isnan(r["tok_s_between"]) and math.isnan(r["max_gap_s"])


def test_job_metrics_from_a_report_and_a_clock():
    syncs = [{"t0": 0.0, "t1": 0.5, "version": 1}, {"t0": 3.0, "t1": 3.4, "version": 2},
             {"t0": 6.0, "t1": 6.4, "version": 3, "update_s": 0.3, "update_bytes": 1000},
             {"t0": 9.0, "t1": 9.6, "version": 4, "update_s": 0.5, "update_bytes": 1000}]
    report = {"syncs": syncs, "step_ends": [3.4, 6.4, 9.6], "http_calls": ["pause", "resume"] * 4,
              "log_history": [{"reward": 0.4}, {"reward": 0.6, "sample/dropped_stale_total": 3.0}]}
    clock = {"steps": _steady(0.6, 12.0), "marks": [("go_live", 6.3, 6.31, {"version": 3}),
                                                    ("go_live", 1.0, 1.01, {"version": 1})]}
    m = job_metrics(report, clock, warmup=1)
    assert m["syncs_measured"] == 2 and m["sync_s_p50"] == pytest.approx(0.5) and m["update_s_p50"] == 0.4
    assert m["step_s_p50"] == pytest.approx(3.1) and m["update_bytes"] == 1000 and m["go_lives"] == 1
    assert m["paused"] is True and m["http_routes"] == "pause resume" and m["dropped_stale"] == 3
    assert m["reward_last"] == 0.6 and m["during_over_between"] == pytest.approx(1.0, abs=0.1)


def test_rows_are_appended_as_they_come(tmp_path):
    out = tmp_path / "trl.csv"
    append_row(str(out), {"ranks": 1, "mode": "off", "tok_s_during": 0.0, "tok_s_between": float("nan")})
    append_row(str(out), {"ranks": 1, "mode": "auto", "error": "RuntimeError: x", "extra": 1})
    rows = list(csv.DictReader(open(out)))
    assert list(rows[0]) == list(COLUMNS) and [r["mode"] for r in rows] == ["off", "auto"]
    assert rows[0]["tok_s_during"] == "0" and rows[0]["tok_s_between"] == "" and rows[1]["error"] == "RuntimeError: x"
    text = format_table([{"ranks": 1, "mode": "auto", "error": "RuntimeError: x"}], ["a note"])
    assert "FAILED: RuntimeError: x" in text and "# a note" in text


def test_a_csv_without_the_load_columns_is_widened_before_a_row_is_appended(tmp_path):
    out = tmp_path / "trl.csv"
    old_cols = [c for c in COLUMNS if c not in ("load_avg_1m", "cpus", "other_cpu", "own_cpu")]
    out.write_text(",".join(old_cols) + "\n" + ",".join("1.50" if c == "load1_start" else "off" if c == "mode" else ""
                                                         for c in old_cols) + "\n")
    append_row(str(out), {"ranks": 1, "mode": "auto", "load_avg_1m": 0.25, "cpus": 2, "other_cpu": 0.031,
                          "own_cpu": 0.9})
    rows = list(csv.DictReader(open(out)))
    assert list(rows[0]) == list(COLUMNS) and [r["mode"] for r in rows] == ["off", "auto"]
    assert rows[0]["load1_start"] == "1.50" and rows[0]["other_cpu"] == ""  # the old row's cells as written
    assert rows[1]["other_cpu"] == "0.031" and rows[1]["cpus"] == "2"
    assert "# load [1 rank(s), shadow=auto]: other processes kept 3% of the 2 CPU(s) busy during the job" in \
        format_table([{"ranks": 1, "mode": "auto", "error": "x", "other_cpu": 0.031, "cpus": 2, "load_avg_1m": 0.25}], [])
