"""Timelines: StepStats -> Chrome trace JSON (reference/timeline.py) -> Gantt PNG
(analysis/timeline.py, which reads the JSON only)."""
from __future__ import annotations

import ast
import json

from tests.helpers import ROOT
from weight_transfer.pipeline.executor import BarrierRecord, StepStats, TaskRecord
from weight_transfer.timeline import TRACKS, chrome_trace, merge_step_traces, save_rank_trace, task_stages


def fake_stats(rank: int, wall_start: float = 1_700_000_000.0, offset: float = 0.0) -> StepStats:
    st = StepStats(rank=rank, bytes_sent=300, n_writes=3, seconds=0.5, peak_temp_bytes=40, watermark=64,
                   pipelined=True, offloaded=True, step=2, t_start=10.0 + offset, wall_start=wall_start)
    t = 10.0 + offset
    for i in range(3):
        r = TaskRecord(task=i, group=i // 2, temp_bytes=20, send_bytes=100, label=f"p{i}")
        r.stages["h2d"] = (t + 0.1 * i, t + 0.1 * i + 0.01)
        r.stages["prepare"] = (t + 0.1 * i + 0.01, t + 0.1 * i + 0.05)
        r.stages["write"] = (t + 0.1 * i + 0.05, t + 0.1 * i + 0.09)
        r.stages["release"] = (t + 0.1 * i + 0.09, t + 0.1 * i + 0.095)
        st.records.append(r)
    st.barriers.append(BarrierRecord(0, t + 0.15, (t + 0.2, t + 0.21)))
    return st


def test_chrome_trace_shape():
    tr = chrome_trace([fake_stats(1), fake_stats(0)])
    json.dumps(tr)  # serializable
    ev = tr["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "train rank 0"), (1, "train rank 1")}
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(0, i, n) for i, n in enumerate(TRACKS)} <= threads
    xs = [e for e in ev if e["ph"] == "X"]
    assert all({"name", "ts", "dur", "pid", "tid", "cat"} <= set(e) for e in xs)
    stages = [e for e in xs if e["cat"] in ("h2d", "prepare", "write", "release")]
    assert len(stages) == 2 * 3 * 4
    # microseconds of wall clock: prepare of task 0 starts 10 ms after the update's start
    upd = next(e for e in xs if e["cat"] == "update" and e["pid"] == 0)
    p0 = next(e for e in stages if e["pid"] == 0 and e["cat"] == "prepare" and e["args"]["task"] == 0)
    assert abs(upd["ts"] - 1_700_000_000.0e6) < 1 and abs(p0["ts"] - upd["ts"] - 10_000) < 1
    assert abs(p0["dur"] - 40_000) < 1 and upd["dur"] == 500_000
    assert all(e["tid"] == TRACKS.index(e["cat"]) for e in xs)
    bar = [e for e in xs if e["cat"] == "barrier"]
    assert len(bar) == 2 and abs(bar[0]["dur"] - 60_000) < 1
    order = task_stages(tr)
    assert [s for s, _, _ in order[(0, 1)]] == ["h2d", "prepare", "write", "release"]


def test_rank_files_merge_per_step(tmp_path):
    # ranks' perf_counter origins differ; wall clock lines them up
    save_rank_trace(tmp_path, fake_stats(0, wall_start=1000.0, offset=0.0))
    save_rank_trace(tmp_path, fake_stats(1, wall_start=1000.0, offset=123.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step0002.rank0.json", "step0002.rank1.json"]
    (merged,) = merge_step_traces(tmp_path, remove_parts=True)
    assert merged.name == "step0002.json" and sorted(p.name for p in tmp_path.iterdir()) == ["step0002.json"]
    tr = json.loads(merged.read_text())
    assert tr["otherData"] == {"ranks": [0, 1], "step": 2}
    ups = [e for e in tr["traceEvents"] if e.get("cat") == "update"]
    assert {e["pid"] for e in ups} == {0, 1} and ups[0]["ts"] == ups[1]["ts"]


def test_gantt_png_from_json_only(tmp_path):
    from weight_transfer.analysis.timeline import gantt_rows, load_events, plot_timeline

    p = tmp_path / "t.json"
    p.write_text(json.dumps(chrome_trace([fake_stats(0), fake_stats(1)])))
    rows = gantt_rows(load_events([p]))
    assert [(r, s) for r, s, _ in rows] == [(r, s) for r in (0, 1) for s in TRACKS]
    assert rows[0][2][0][0] == 0.0  # ms since the first event
    out = plot_timeline(p, tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_analysis_imports_no_transfer_code():
    src = (ROOT / "analysis" / "timeline.py").read_text()
    mods = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
    assert not {m for m in mods if m.startswith("weight_transfer") and not m.startswith("weight_transfer.analysis")}, mods


def test_overlapping_writes_get_extra_threads():
    """Writes of several tasks in flight overlap; each thread of the trace carries only
    non-overlapping events (viewers need them nested), and busy time is the union."""
    st = StepStats(rank=0, seconds=1.0, t_start=0.0, wall_start=100.0)
    spans = [(0.0, 0.5), (0.1, 0.6), (0.2, 0.3), (0.55, 0.9)]
    for i, w in enumerate(spans):
        r = TaskRecord(task=i, group=0)
        r.stages["write"] = w
        st.records.append(r)
    ev = chrome_trace([st])["traceEvents"]
    writes = [e for e in ev if e.get("ph") == "X" and e["cat"] == "write"]
    assert len({e["tid"] for e in writes}) == 3 and writes[0]["tid"] == TRACKS.index("write")
    by_tid: dict = {}
    for e in writes:
        by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    for iv in by_tid.values():
        iv.sort()
        assert all(b[0] >= a[1] for a, b in zip(iv, iv[1:]))
    names = {e["tid"]: e["args"]["name"] for e in ev if e.get("ph") == "M" and e["name"] == "thread_name"}
    assert {names[t] for t in by_tid} == {"write", "write (2)", "write (3)"}
    assert abs(st.stage_busy()["write"] - 0.9) < 1e-12
    assert [s for s, _, _ in task_stages(chrome_trace([st]))[(0, 1)]] == ["write"]
