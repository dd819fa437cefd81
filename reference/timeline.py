"""The timeline of one update as a Chrome trace (JSON; open it in https://ui.perfetto.dev or
chrome://tracing).

Layout: one *process* per training rank (``pid`` = rank, named ``train rank r``), one *thread*
per stage (``update``, ``h2d``, ``prepare``, ``write``, ``release``, ``barrier``; the writes of
several tasks are in flight at once, so a ``write`` event that overlaps an earlier one goes on an
extra thread ``write (2)``, ``write (3)``, ... after the last track), one complete
event (``"ph": "X"``) per task and stage with ``ts`` / ``dur`` in microseconds. ``ts`` is wall
clock (microseconds since the epoch) so the files of several ranks line up when merged. Each
event's ``args`` carry the task id, mesh group, planned temporary bytes, allocated bytes and
bytes sent. The ``update`` thread has one event spanning the whole update; the ``barrier``
thread one event per mesh-group barrier, from its issue to the end of its wait.

Files: :func:`save_rank_trace` writes ``step{NNNN}.rank{r}.json`` (one rank, written by that
rank's executor); :func:`merge_step_traces` merges them into ``step{NNNN}.json`` (all ranks).
``analysis/timeline.py`` draws either as a per-rank Gantt chart.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

TRACKS = ("update", "h2d", "prepare", "write", "release", "barrier")
"""Thread rows of each rank's process, top to bottom (``tid`` = index)."""

_RANK_FILE = re.compile(r"step(\d+)\.rank(\d+)\.json$")


def union_seconds(intervals) -> float:
    """Length (seconds) of the union of ``(start, end)`` intervals."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def peak_in_flight(intervals) -> int:
    """Peak of the sum of ``nbytes`` over ``(start, end, nbytes)`` intervals (an interval that
    ends at the instant another starts does not overlap it)."""
    ev = []
    for a, b, n in intervals:
        ev.append((a, 1, n))
        ev.append((b, 0, -n))
    cur = peak = 0
    for _, _, d in sorted(ev):
        cur += d
        peak = max(peak, cur)
    return peak


def _write_lanes(records) -> dict[int, int]:
    """Task -> lane of its ``write`` event: 0 (the ``write`` thread) unless it overlaps an
    earlier task's write still in flight, then the first free extra lane (thread ``write (2)``,
    ...), so no thread carries partially overlapping events (trace viewers need them nested)."""
    ends: list[float] = []
    out = {}
    for r in sorted((r for r in records if "write" in r.stages), key=lambda r: r.stages["write"]):
        a, b = r.stages["write"]
        j = next((i for i, e in enumerate(ends) if e <= a), len(ends))
        if j == len(ends):
            ends.append(b)
        else:
            ends[j] = b
        out[r.task] = j
    return out


def _us(stats, t: float) -> float:
    return round(stats.wall(t) * 1e6, 3)


def rank_events(stats) -> list[dict]:
    """Trace events of one rank's :class:`weight_transfer.pipeline.executor.StepStats`."""
    pid = stats.rank
    ev: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": f"train rank {pid}"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for tid, name in enumerate(TRACKS):
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    ev.append({"ph": "X", "name": f"update {stats.step}", "cat": "update", "pid": pid, "tid": 0,
               "ts": _us(stats, stats.t_start), "dur": round(stats.seconds * 1e6, 3),
               "args": {"step": stats.step, "bytes_sent": stats.bytes_sent, "n_writes": stats.n_writes,
                        "pipelined": stats.pipelined, "watermark": stats.watermark, "offloaded": stats.offloaded,
                        "peak_temp_bytes": stats.peak_temp_bytes, "peak_alloc_bytes": stats.peak_alloc_bytes}})
    lanes = _write_lanes(stats.records)
    for j in range(1, max(lanes.values(), default=0) + 1):
        tid = len(TRACKS) + j - 1
        ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": f"write ({j + 1})"}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                   "args": {"sort_index": TRACKS.index("write")}})
    for r in stats.records:
        for stage, (a, b) in r.stages.items():
            lane = lanes.get(r.task, 0) if stage == "write" else 0
            tid = TRACKS.index(stage) if lane == 0 else len(TRACKS) + lane - 1
            ev.append({"ph": "X", "name": r.label or f"task {r.task}", "cat": stage, "pid": pid,
                       "tid": tid, "ts": _us(stats, a), "dur": round((b - a) * 1e6, 3),
                       "args": {"task": r.task, "group": r.group, "temp_bytes": r.temp_bytes,
                                "alloc_bytes": r.alloc_bytes, "send_bytes": r.send_bytes,
                                "h2d_bytes": r.h2d_bytes, "gate_wait_us": round(r.gate_wait * 1e6, 3)}})
    for b in stats.barriers:
        end = b.waited[1] if b.waited else b.issued
        ev.append({"ph": "X", "name": f"barrier after group {b.group}", "cat": "barrier", "pid": pid,
                   "tid": TRACKS.index("barrier"), "ts": _us(stats, b.issued), "dur": round((end - b.issued) * 1e6, 3),
                   "args": {"group": b.group,
                            "wait_us": round((b.waited[1] - b.waited[0]) * 1e6, 3) if b.waited else None}})
    return ev


def chrome_trace(stats_list, *, meta: dict | None = None) -> dict:
    """A Chrome trace (JSON object form) of one update over the given ranks' StepStats."""
    events = [e for s in sorted(stats_list, key=lambda s: s.rank) for e in rank_events(s)]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(meta or {})}


def save_trace(path, stats_list, *, meta: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(chrome_trace(stats_list, meta=meta)))
    tmp.replace(path)
    return path


def save_rank_trace(trace_dir, stats) -> Path:
    """``trace_dir/step{NNNN}.rank{r}.json`` for one rank's update."""
    return save_trace(Path(trace_dir) / f"step{stats.step:04d}.rank{stats.rank}.json", [stats],
                      meta={"step": stats.step, "ranks": [stats.rank]})


def merge_traces(paths, out) -> Path:
    """Concatenate the events of several trace files into ``out``."""
    events, ranks, steps = [], [], set()
    for p in paths:
        d = json.loads(Path(p).read_text())
        events += d["traceEvents"]
        other = d.get("otherData", {})
        ranks += other.get("ranks", [])
        if "step" in other:
            steps.add(other["step"])
    out = Path(out)
    meta = {"ranks": sorted(ranks)}
    if len(steps) == 1:
        meta["step"] = steps.pop()
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta}))
    return out


def merge_step_traces(trace_dir, *, remove_parts: bool = False) -> list[Path]:
    """Merge every ``step{N}.rank{r}.json`` of ``trace_dir`` into ``step{N}.json``; returns the
    merged files in step order."""
    parts: dict[int, list[Path]] = defaultdict(list)
    for p in Path(trace_dir).glob("step*.rank*.json"):
        m = _RANK_FILE.search(p.name)
        if m:
            parts[int(m.group(1))].append(p)
    out = []
    for step in sorted(parts):
        files = sorted(parts[step], key=lambda p: int(_RANK_FILE.search(p.name).group(2)))
        out.append(merge_traces(files, Path(trace_dir) / f"step{step:04d}.json"))
        if remove_parts:
            for f in files:
                f.unlink()
    return out


def load_trace(path) -> dict:
    return json.loads(Path(path).read_text())


def task_stages(trace: dict) -> dict[tuple[int, int], list[tuple[str, float, float]]]:
    """``{(rank, task): [(stage, ts, end), ...]}`` sorted by start, from a trace's X events."""
    out: dict[tuple[int, int], list] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("h2d", "prepare", "write", "release"):
            out[(e["pid"], e["args"]["task"])].append((e["cat"], e["ts"], e["ts"] + e["dur"]))
    for v in out.values():
        v.sort(key=lambda x: (x[1], ("h2d", "prepare", "write", "release").index(x[0])))
    return dict(out)
