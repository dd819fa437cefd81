"""Pipeline benchmarks of the reference executor (not tests), on the README's main job.

Three measurements, each from real trials (controller + training ranks + inference ranks,
every update verified bit-exact):

1. *Pipelined vs stage-serialized*: the same trial with the executor's stage threads and with
   every stage of a task run before the next task starts; ratio = serialized / pipelined
   update time (p50 over measured updates).
2. *Overlap efficiency*: per rank and update, the busiest stage's busy time (the union of its
   tasks' intervals, from the recorded timeline: several tasks' writes overlap, a sum would
   count that time twice) over the rank's update time. 1.0 means the update
   takes exactly as long as its bottleneck stage: everything else is hidden behind it.
3. *Watermark sweep*: update time and measured peak temporary bytes (planned bytes of tasks in
   flight, and bytes the tasks actually allocated) per watermark value.

Prints nccl-tests-style tables, writes ``results/pipeline_bench.csv`` (one row per trial and
measured update; raw seconds and bytes) and ``results/timeline.png`` (the Gantt chart of the
last pipelined update; its Chrome trace next to it as ``results/timeline.json``).

    weight-transfer bench-pipeline                       # the main job's model, 2 train ranks, TP=2
    weight-transfer bench-pipeline --steps 2 --watermarks-mb 256,64,0 --offload
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from weight_transfer.timeline import union_seconds

from ..config import TrialConfig
from ..paths import project_dir
from ..trial import run_trial

ROOT = project_dir()
STAGE_NAMES = ("h2d", "prepare", "write", "release")


def _trace_stats(trace: dict) -> dict[int, dict]:
    """Per rank: update time and per-stage busy seconds (the union of the stage's intervals),
    from a merged Chrome trace."""
    out: dict[int, dict] = {}
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") != "X":
            continue
        r = out.setdefault(e["pid"], {"update_s": 0.0, **{f"busy_{s}": 0.0 for s in STAGE_NAMES}})
        if e["cat"] == "update":
            r["update_s"] = e["dur"] / 1e6
            r["peak_temp_bytes"] = e["args"].get("peak_temp_bytes")
            r["peak_alloc_bytes"] = e["args"].get("peak_alloc_bytes")
        elif e["cat"] in STAGE_NAMES:
            spans.setdefault((e["pid"], e["cat"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for (pid, stage), iv in spans.items():  # union, not sum: several tasks' writes overlap
        out[pid][f"busy_{stage}"] = union_seconds(iv) / 1e6
    for r in out.values():
        busy = {s: r[f"busy_{s}"] for s in STAGE_NAMES}
        r["busiest_stage"] = max(busy, key=busy.get)
        r["busiest_s"] = busy[r["busiest_stage"]]
        r["overlap_eff"] = r["busiest_s"] / r["update_s"] if r["update_s"] else float("nan")
    return out


def run_one(label: str, cfg_kw: dict, trace_root: Path) -> tuple[list[dict], dict[int, dict]]:
    """One trial; returns its CSV rows (measured updates) and the traces by step."""
    import json

    from weight_transfer.timeline import merge_step_traces

    tdir = trace_root / label
    tdir.mkdir(parents=True, exist_ok=True)
    cfg = TrialConfig.from_flat(trace_dir=str(tdir), **cfg_kw)
    t0 = time.perf_counter()
    res = run_trial(cfg)
    merged = {int(p.stem[4:]): p for p in merge_step_traces(tdir, remove_parts=True)}
    rows = []
    for r in res.rows:
        if r["warmup"]:
            continue
        tr = json.loads(merged[r["step"]].read_text())
        ranks = _trace_stats(tr)
        worst = max(ranks.values(), key=lambda x: x["update_s"])
        rows.append({
            "bench": label, "git_sha": r["git_sha"], "host": r["host"], "model": r["model"], "n_train": r["n_train"],
            "n_infer": r["n_infer"], "pipeline": cfg.transfer.executor.pipeline, "offload": cfg.transfer.executor.offload, "watermark": cfg.transfer.executor.watermark,
            "step": r["step"], "bytes": r["bytes"], "seconds": r["seconds"], "verified": r["verified"],
            "peak_temp_bytes": r["peak_temp_bytes"], "peak_alloc_bytes": r.get("peak_alloc_bytes"),
            "rank_update_s": worst["update_s"],
            **{f"busy_{s}_s": max(x[f"busy_{s}"] for x in ranks.values()) for s in STAGE_NAMES},
            "busiest_stage": worst["busiest_stage"],
            "overlap_eff": statistics.mean(x["overlap_eff"] for x in ranks.values()),
            "trace": str(merged[r["step"]]),
        })
    print(f"# {label}: {len(res.rows)} updates in {time.perf_counter() - t0:.0f} s "
          f"(verified {sum(1 for r in res.rows if r['verified'])}/{len(res.rows)})", file=sys.stderr, flush=True)
    return rows, merged


def _p50(rows, key="seconds"):
    return statistics.median(r[key] for r in rows)


def _mb(x):
    return "-" if x is None else f"{x / 1e6:.1f}"


@dataclass(kw_only=True, slots=True)
class PipelineBenchConfig:
    """Options of ``weight-transfer bench-pipeline``."""

    model: str | None = None
    """Catalog model; default: the main job's (Qwen3-30B-A3B architecture, FP8, see README)."""
    quant: str | None = None
    """``fp8`` or ``none``; default: the model's base config (the main job: fp8)."""
    override: tuple[str, ...] = ()
    """HF-config overrides ``KEY=VALUE``, comma-separated (on top of the main job's)."""
    n_train: int = 2
    """Training ranks."""
    tp: int = 2
    """Inference tensor-parallel size."""
    steps: int = 2
    """Measured updates per trial."""
    warmup: int = 1
    """Updates before the measured ones, per trial."""
    watermarks_mb: tuple[float, ...] = (256, 64, 0)
    """Watermark sweep (MiB, comma-separated; the unbounded run is always included)."""
    offload: bool = False
    """Also measure pipelined with host-offloaded shards."""
    out: str = str(ROOT / "results" / "pipeline_bench.csv")
    """CSV of one row per trial and measured update (overwritten)."""
    png: str = str(ROOT / "results" / "timeline.png")
    """Gantt chart of the last pipelined update (its Chrome trace beside it, ``.json``)."""

    def __post_init__(self):
        if self.quant not in (None, "fp8", "none"):
            raise ValueError(f"quant={self.quant!r}: fp8 or none")
        for kv in self.override:
            if "=" not in kv:
                raise ValueError(f"override {kv!r}: wants KEY=VALUE")


def base_trial(args: PipelineBenchConfig) -> dict:
    """The flat trial options every trial of the bench shares (``TrialConfig.from_flat``
    keywords): the model and its overrides (the main job's when ``args.model`` is None, with
    ``args.override`` on top), quantization, world sizes and update counts."""
    from ..cli import key_value

    overrides = dict(key_value(kv) for kv in args.override)
    base = dict(model=args.model, overrides=overrides, n_train=args.n_train, tp=args.tp, steps=args.steps,
                warmup=args.warmup)
    if args.model is None:  # the main job's default, with the given overrides on top
        from ..config import main_job_default

        d = main_job_default()
        base.update(model=d.model.name, overrides={**d.model.overrides, **overrides}, quant=d.inference.quant)
    if args.quant is not None:
        base["quant"] = None if args.quant == "none" else args.quant
    return base


def main(args: PipelineBenchConfig) -> int:
    """Run the trials, print the tables, write ``args.out`` and ``args.png``."""
    base = base_trial(args)
    trace_root = Path(tempfile.mkdtemp(prefix="pipeline_bench_", dir=ROOT / "results" / "runs"
                                       if (ROOT / "results" / "runs").exists() else None))
    t_all = time.perf_counter()
    rows: list[dict] = []
    runs = {}
    plan = [("pipelined", dict(pipeline=True)), ("serialized", dict(pipeline=False))]
    if args.offload:
        plan.append(("pipelined+offload", dict(pipeline=True, offload=True)))
    wms = [int(float(x) * (1 << 20)) for x in args.watermarks_mb]
    plan += [(f"watermark={w}", dict(pipeline=True, watermark=w)) for w in wms]
    for label, kw in plan:
        r, merged = run_one(label, {**base, **kw}, trace_root)
        rows += r
        runs[label] = (r, merged)

    from weight_transfer.testing.catalog import load_config

    mcfg = load_config(base["model"], **base["overrides"])
    first = rows[0]
    hdr = [
        "# pipeline benchmark: reference executor (stage threads, FIFO queues, watermark gate)",
        f"# host: {first['host']}  git: {first['git_sha']}  model: {mcfg.label}  "
        f"training: {args.n_train} FSDP2 ranks  inference: TP={args.tp} {base.get('quant') or 'bf16'}  "
        f"transport: {TrialConfig.from_flat(**base).transport}",
        f"# bytes per update: {first['bytes']} ({first['bytes'] / 1e9:.3f} GB); {args.steps} measured update(s) per "
        f"trial after {args.warmup} warmup; times are p50 over measured updates",
        "#",
    ]
    out = list(hdr)
    # 1. pipelined vs serialized
    out += ["# [1] pipelined vs stage-serialized",
            f"{'mode':>20} {'time':>9} {'algbw':>8} {'busiest':>9} {'busy':>8} {'overlap':>8} {'peak_tmp':>9}",
            f"{'':>20} {'(s)':>9} {'(GB/s)':>8} {'stage':>9} {'(s)':>8} {'eff':>8} {'(MB)':>9}"]
    for label in [p[0] for p in plan if not p[0].startswith("watermark")]:
        rs = runs[label][0]
        t = _p50(rs)
        out.append(f"{label:>20} {t:>9.4f} {rs[0]['bytes'] / t / 1e9:>8.3f} {rs[-1]['busiest_stage']:>9} "
                   f"{max(rs[-1][f'busy_{s}_s'] for s in STAGE_NAMES):>8.3f} {_p50(rs, 'overlap_eff'):>8.3f} "
                   f"{_mb(max(r['peak_temp_bytes'] for r in rs)):>9}")
    ratio = _p50(runs["serialized"][0]) / _p50(runs["pipelined"][0])
    out.append(f"# speedup (serialized / pipelined update time): {ratio:.3f}x")
    # 2. overlap efficiency, per stage
    rs = runs["pipelined"][0]
    out += ["#", "# [2] pipelined: stage busy time vs update time (busiest rank per column)",
            f"{'step':>6} {'update':>9} " + " ".join(f"{s:>9}" for s in STAGE_NAMES) + f" {'overlap':>8}",
            f"{'':>6} {'(s)':>9} " + " ".join(f"{'(s)':>9}" for _ in STAGE_NAMES) + f" {'eff':>8}"]
    for r in rs:
        out.append(f"{r['step']:>6} {r['rank_update_s']:>9.4f} "
                   + " ".join(f"{r[f'busy_{s}_s']:>9.4f}" for s in STAGE_NAMES) + f" {r['overlap_eff']:>8.3f}")
    out.append("# overlap eff = busiest stage busy / rank update time (mean over ranks); 1.0 = fully hidden")
    # 3. watermark sweep
    out += ["#", "# [3] watermark sweep (pipelined)",
            f"{'watermark':>12} {'time':>9} {'algbw':>8} {'peak_tmp':>9} {'peak_alloc':>10} {'verified':>9}",
            f"{'(MiB)':>12} {'(s)':>9} {'(GB/s)':>8} {'(MB)':>9} {'(MB)':>10} {'':>9}"]
    for label in ["pipelined"] + [f"watermark={w}" for w in wms]:
        rs = runs[label][0]
        wm = rs[0]["watermark"]
        t = _p50(rs)
        out.append(f"{'unbounded' if wm is None else f'{wm / 2**20:g}':>12} {t:>9.4f} {rs[0]['bytes'] / t / 1e9:>8.3f} "
                   f"{_mb(max(r['peak_temp_bytes'] for r in rs)):>9} "
                   f"{_mb(max((r['peak_alloc_bytes'] or 0) for r in rs)):>10} "
                   f"{'yes' if all(r['verified'] for r in rs) else 'NO':>9}")
    n_ok = sum(1 for r in rows if r["verified"])
    out += ["#", f"# verified bit-exact against the engine's load_weights: {n_ok}/{len(rows)} measured updates"
            + ("" if n_ok == len(rows) else "  <-- FAILED"),
            f"# wall time of the benchmark: {time.perf_counter() - t_all:.0f} s"]
    print("\n".join(out))

    outp = Path(args.out)
    outp.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{k: v for k, v in r.items() if k != "trace"} for r in rows]).to_csv(outp, index=False)
    print(f"# rows written to {outp}")
    # the plot is analysis/'s job: it reads the trace file, nothing else
    last = runs["pipelined"][1]
    step = max(last)
    trace = Path(args.png).with_suffix(".json")
    shutil.copy(last[step], trace)
    title = f"{mcfg.label}: one pipelined update ({args.n_train} training ranks -> TP={args.tp}), step {step}"
    subprocess.run([sys.executable, "-m", "weight_transfer.analysis.timeline", str(trace), "-o", args.png, "--title", title],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    if trace.stat().st_size > 2 << 20:
        trace.unlink()
    print(f"# timeline: {args.png}" + (f" (Chrome trace: {trace})" if trace.exists() else ""))
    return 0 if n_ok == len(rows) else 1

