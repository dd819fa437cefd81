"""What shadow targets buy inside TRL's asynchronous GRPO: rollout generation during weight syncs.

TRL 1.16's ``AsyncGRPOTrainer`` generates rollouts on a vLLM server all the time, in a process of
its own, and syncs the weights after every optimizer step. ``OneSidedWeightTransfer(url,
shadow="off")`` pauses the server for each sync (``POST /pause?mode=keep`` ... ``/resume``): no
token is generated while the bytes move. ``shadow="auto"`` never pauses: the writes land in a
shadow copy while vLLM keeps generating, and the go-live is one engine-core call between two
engine steps (engines/vllm/trl/trainer.py, engines/vllm/backend/recover.py ``go_live_http``). This benchmark runs
both inside real TRL jobs and reads, from the vLLM worker's own step clock
(engines/vllm/worker/steps.py), how much generation the syncs cost.

One server (:class:`weight_transfer.experiments.vllm_server.VLLMServer`) for the whole benchmark;
for each ``ranks`` value (1: one training process; 2: two under ``torch.distributed.run``,
accelerate's FSDP2 over gloo), one job per mode, one after the other against the same server
(each job's ``destroy`` releases the server; the next starts at weight version 1). A job is
:mod:`weight_transfer.experiments.trl_bench_job`: ``steps`` GRPO steps, a weight sync after
each (and TRL's own at train begin).

**The model** (default ``override``): TRL's tiny Qwen3 (:data:`weight_transfer.testing.tiny.TINY_QWEN3`:
``qwen3-0.6b``'s architecture, byte-level vocabulary of 1024) widened to hidden 1024, FFN 4096,
4 layers, 16 query / 4 KV heads of 64: 61.9 M parameters, 123.8 MB per update in bf16. Chosen so
that a sync takes long enough to measure (0.2-0.4 s here) while a two-rank job of 6 steps ends
in about 1.5 minutes on 2 cores (the 2-layer, 2.9 MB tiny model syncs in ~0.07 s: mostly
control-plane round trips).

**Measured syncs.** TRL's train-begin sync (version 1) runs before its rollout worker starts
(nothing generates) and the first ``warmup`` syncs after it (the rollout worker's start-up) are
left out; the measured span runs from the end of the last left-out sync to the end of the
last sync. Per (ranks, mode), from the engine's step records ``[t_start, t_end, n_tokens]``
(``time.time()`` seconds) and the sync windows (rank 0's ``_sync_weight`` start and end):

- ``tok_s_during``: tokens of the engine steps inside the union of the measured sync windows /
  the union's seconds (a step is inside when its midpoint is: experiments/stall.py's rule);
- ``tok_s_between``: tokens of the span's other steps / the span's seconds outside every window
  (:func:`weight_transfer.experiments.stall.between_stats`); ``during_over_between`` their ratio;
- ``busy_during`` / ``busy_between``: the fraction of those seconds the engine spent in a forward
  (prefill tokens are cheap per token: a step that re-prefills the running requests after a
  go-live's prefix-cache reset carries hundreds of tokens, so tokens/s alone favours the spans
  holding such steps);
- ``max_gap_sync_s``: the longest idle gap between two engine steps that overlaps a measured
  sync; ``max_gap_s``: the longest in the whole span; ``p50_gap_between_s``: the median
  start-to-start interval between syncs (one engine step);
- ``sync_s_p50``: the sync window's seconds (p50; TRL's ``perf/weight_sync_s``), ``update_s_p50``:
  the backend's own update call; ``step_s_p50``: one GRPO step's wall time (step end to step
  end, its sync included); ``dropped_stale``: samples TRL dropped as too stale
  (``sample/dropped_stale_total``, summed over the job); ``paused``: whether ``/pause`` was called;
- ``verified``: after the job, the server's greedy tokens and logprobs for two fixed prompts (one
  over two KV blocks, cached under the weights before the job) equal a fresh vLLM's loaded from
  the job's final weights (:mod:`weight_transfer.engines.vllm.oracle`); ``server_version``: vLLM's
  weight version then (the job's last sync);
- ``load1_start`` ... ``load15_end``: ``os.getloadavg()`` at the job's start and end (this
  machine is shared: a busy neighbour shows here);
- ``load_avg_1m``, ``cpus``, ``other_cpu``, ``own_cpu``: the load columns of every result row
  (:mod:`weight_transfer.experiments.load`): the load average right before the job, and the
  fraction of the CPUs that processes outside this command's process tree (the server, the job,
  the verification are in it) kept busy through the job's process.

The issue's target, reported and not asserted: the shadow run's ``tok_s_during`` is at least 50%
of its ``tok_s_between`` (``target_met``), where the pause-based run's is 0.

CPUs: the server's worker computes on one CPU (``VLLM_CPU_OMP_THREADS_BIND``, the lowest allowed
one); with ``pin`` the training processes and TRL's rollout worker run on the others (on 2 cores:
both ranks share the second); the server's API process is unpinned.

Prints a table; appends one row per (ranks, mode) to ``out`` as each job ends (with its
``run_id``: ``weight-transfer report`` shows the latest run).

    weight-transfer bench-trl                                   # ranks 1 and 2, off and auto
    weight-transfer bench-trl --ranks 1 --steps 3 --override num_hidden_layers=2
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..load import LoadMeter, summary_line
from ..paths import project_dir

ROOT = project_dir()
MODES = ("off", "auto", "copy", "flip")
MODEL_OVERRIDES = ("hidden_size=1024", "intermediate_size=4096", "num_hidden_layers=4", "num_attention_heads=16",
                   "num_key_value_heads=4")
"""The benchmark's model on top of TINY_QWEN3 (module docstring): 61.9 M parameters, 123.8 MB bf16."""
MAX_TOKENS = 6
"""Greedy tokens per fixed prompt in the verification."""
COLUMNS = ("run_id", "timestamp", "git_sha", "ranks", "mode", "model", "update_bytes", "steps", "syncs_measured",
           "sync_s_p50", "update_s_p50", "step_s_p50", "tok_s_during", "tok_s_between", "during_over_between",
           "target_met", "busy_during", "busy_between", "steps_during", "tokens_during", "max_gap_sync_s", "max_gap_s", "p50_gap_between_s",
           "go_lives", "dropped_stale", "paused", "http_routes", "reward_last", "verified", "verify_ulps",
           "server_version", "job_s", "load1_start", "load5_start", "load15_start", "load1_end", "load5_end",
           "load15_end", "load_avg_1m", "cpus", "other_cpu", "own_cpu", "trainer_cpus", "error")
"""The CSV's columns, in order (module docstring for their meaning; seconds, tokens/s, bytes)."""


@dataclass(kw_only=True, slots=True)
class TrlBenchConfig:
    """Options of ``weight-transfer bench-trl``."""

    ranks: tuple[int, ...] = (1, 2)
    """Training-process counts, in run order (comma-separated): 1, or several under torch.distributed.run (FSDP2)."""
    modes: tuple[str, ...] = ("off", "auto")
    """OneSidedWeightTransfer shadow modes per ranks value, in run order: off (pause-based), auto, copy, flip."""
    steps: int = 6
    """GRPO optimizer steps per job (one weight sync after each, besides TRL's at train begin)."""
    warmup: int = 1
    """Syncs after TRL's train-begin one left out of the measurement (the rollout worker's start-up)."""
    override: tuple[str, ...] = MODEL_OVERRIDES
    """HF-config overrides KEY=VALUE, comma-separated, on top of TINY_QWEN3's (module docstring)."""
    completion_tokens: int = 32
    """TRL's max_completion_length (tokens per rollout)."""
    batch: int = 8
    """TRL's per_device_train_batch_size (samples per rank and step)."""
    generations: int = 4
    """TRL's num_generations (completions per prompt)."""
    lr: float = 1e-3
    """Learning rate."""
    max_num_seqs: int = 8
    """The server's requests per engine step."""
    pin: bool = True
    """Run the training processes off the server worker's CPU (when there is another)."""
    verify: bool = True
    """Compare the server's greedy outputs after each job with a fresh vLLM's on the job's final weights."""
    job_timeout: float = 1200.0
    """Seconds one job may run."""
    workdir: str = ""
    """Where checkpoints, logs and job reports go (empty: a new temporary directory, kept)."""
    out: str = str(ROOT / "results" / "trl_bench.csv")
    """CSV the rows are appended to, one per (ranks, mode) as each job ends; empty: none."""

    def __post_init__(self):
        bad = [m for m in self.modes if m not in MODES]
        if not self.modes or bad:
            raise ValueError(f"modes={self.modes}: each one of {', '.join(MODES)}")
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise ValueError(f"ranks={self.ranks}: each >= 1")
        for name in ("steps", "completion_tokens", "batch", "generations", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: >= 1")
        if self.warmup < 0 or self.warmup >= self.steps:
            raise ValueError(f"warmup={self.warmup}: >= 0 and < steps={self.steps} (at least one measured sync)")
        for kv in self.override:
            if "=" not in kv:
                raise ValueError(f"override {kv!r}: wants KEY=VALUE")


# ------------------------------------------------------------------------------ pure functions


def parse_overrides(items) -> dict:
    """``("k=v", ...)`` -> ``{k: int(v) or v}`` (integers as ints, the rest as given)."""
    out = {}
    for kv in items:
        k, v = kv.split("=", 1)
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    return out


def measured_syncs(syncs: list[dict], warmup: int) -> tuple[list[dict], float | None]:
    """The syncs measured (module docstring): those after TRL's train-begin sync and ``warmup``
    more, and the span's start (the end of the last one left out; None when none is left)."""
    skip = 1 + warmup
    if len(syncs) <= skip:
        return [], None
    return syncs[skip:], float(syncs[skip - 1]["t1"])


def merged(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``[(t0, t1), ...]`` as disjoint sorted intervals (empty ones dropped)."""
    out: list[list[float]] = []
    for a, b in sorted((float(a), float(b)) for a, b in windows if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def union_seconds(windows: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of ``[(t0, t1), ...]`` (overlaps counted once)."""
    return sum(b - a for a, b in merged(windows))


def busy_seconds(steps, windows: list[tuple[float, float]]) -> float:
    """Seconds of the engine's forwards (steps ``(t_start, t_end, ...)``) inside the union of
    ``windows``: each step's overlap with it."""
    win = merged(windows)
    return sum(max(0.0, min(float(s[1]), b) - max(float(s[0]), a)) for s in steps for a, b in win)


def inside_mask(steps, windows: list[tuple[float, float]]) -> np.ndarray:
    """Per step ``(t_start, t_end, n_tokens)``: whether its midpoint lies in a window ``[t0, t1)``."""
    mid = np.array([(float(s[0]) + float(s[1])) / 2 for s in steps], dtype=np.float64)
    mask = np.zeros(len(mid), dtype=bool)
    for a, b in windows:
        mask |= (mid >= a) & (mid < b)
    return mask


def rollout_stats(steps, windows: list[tuple[float, float]], span: tuple[float, float]) -> dict:
    """Generation during and between the sync ``windows`` (``[(t0, t1)]``, seconds) from the
    engine's step records ``[(t_start, t_end, n_tokens)]`` whose midpoint lies in ``span``
    (module docstring): ``tok_s_during``, ``tok_s_between`` (tokens/s), ``during_over_between``,
    ``steps_during``, ``tokens_during``, ``max_gap_sync_s``, ``max_gap_s``, ``p50_gap_between_s``
    (seconds), ``busy_during`` / ``busy_between`` (the fraction of those seconds the engine spent
    in a forward). NaN where a quantity has no data."""
    from ..stall import between_stats, update_stall

    nan = float("nan")
    lo, hi = span
    sel = [tuple(s) for s in sorted(steps) if lo <= (float(s[0]) + float(s[1])) / 2 <= hi]
    log = [(s[0], s[1], None, int(s[2])) for s in sel]
    wins = [(i, a, None, None, b) for i, (a, b) in enumerate(windows)]
    mask = inside_mask(sel, windows)
    tokens = int(sum(int(s[2]) for s, m in zip(sel, mask) if m))
    during_s = union_seconds(windows)
    between = between_stats(log, wins) if log else {"tok_s_between": nan, "p50_gap_between_s": nan}
    stalls = [update_stall(log, w)["stall_s"] for w in wins] if log else []
    idle = [max(0.0, b[0] - a[1]) for a, b in zip(sel, sel[1:])]
    during = tokens / during_s if during_s > 0 else nan
    tb = between["tok_s_between"]
    out_s = (hi - lo) - union_seconds([(max(a, lo), min(b, hi)) for a, b in windows])
    busy_out = busy_seconds(sel, [(lo, hi)]) - busy_seconds(sel, windows)
    return {"busy_during": busy_seconds(sel, windows) / during_s if during_s > 0 else nan,
            "busy_between": busy_out / out_s if out_s > 0 else nan,"tok_s_during": during, "tok_s_between": tb,
            "during_over_between": during / tb if tb == tb and tb > 0 and during == during else nan,
            "steps_during": int(mask.sum()), "tokens_during": tokens,
            "max_gap_sync_s": max(stalls) if stalls else nan, "max_gap_s": max(idle) if idle else nan,
            "p50_gap_between_s": between["p50_gap_between_s"]}


def step_seconds(step_ends: list[float], warmup: int) -> list[float]:
    """GRPO step wall times (seconds, its sync included): step end to step end, the first
    ``warmup`` steps' ends used only as the start of the next."""
    ends = [float(t) for t in step_ends]
    return [b - a for a, b in list(zip(ends, ends[1:]))[max(0, warmup - 1):]]


def dropped_stale(log_history: list[dict]) -> int:
    """Samples TRL dropped as too stale over the job: ``sample/dropped_stale_total`` summed over
    its log entries (TRL sums it per logging window; absent when none was dropped)."""
    return int(sum(float(h.get("sample/dropped_stale_total") or 0.0) for h in log_history))


def p50(xs) -> float:
    xs = [float(x) for x in xs if x is not None]
    return float(np.median(xs)) if xs else float("nan")


def job_metrics(report: dict, clock: dict, warmup: int) -> dict:
    """The measured columns of one job from rank 0's report (experiments/trl_bench_job.py) and
    the server's step clock (:meth:`VLLMServer.steps`)."""
    syncs, lo = measured_syncs(report["syncs"], warmup)
    windows = [(float(s["t0"]), float(s["t1"])) for s in syncs]
    row = rollout_stats(clock["steps"], windows, (lo, windows[-1][1])) if syncs else {}
    lives = [m for m in clock.get("marks", ()) if m[0] == "go_live" and syncs and lo <= m[1] <= windows[-1][1]]
    rewards = [h["reward"] for h in report["log_history"] if "reward" in h]
    row.update(syncs_measured=len(syncs), sync_s_p50=p50(b - a for a, b in windows),
               update_s_p50=p50(s.get("update_s") for s in syncs),
               step_s_p50=p50(step_seconds(report["step_ends"], warmup)),
               update_bytes=next((s.get("update_bytes") for s in report["syncs"] if s.get("update_bytes")), None),
               go_lives=len(lives), dropped_stale=dropped_stale(report["log_history"]),
               paused="pause" in report["http_calls"], http_routes=" ".join(dict.fromkeys(report["http_calls"])),
               reward_last=rewards[-1] if rewards else None)
    return row


# ------------------------------------------------------------------------------ running it


def _checkpoint(c: TrlBenchConfig, root: Path) -> tuple[str, object]:
    """The model at step 0 (synthetic weights) with the byte-level tokenizer: (dir, ModelConfig)."""
    from weight_transfer.engines.vllm import write_checkpoint
    from weight_transfer.engines.vllm.trl.cpu import write_tokenizer
    from weight_transfer.testing.catalog import load_config
    from weight_transfer.testing.tiny import TINY_QWEN3

    cfg = load_config(TINY_QWEN3[0], **{**dict(TINY_QWEN3[1]), **parse_overrides(c.override)})
    path = write_checkpoint(cfg, root / "checkpoint", step=0, seed=0)
    return write_tokenizer(path, cfg.vocab_size), cfg


def _trainer_cpus(c: TrlBenchConfig, server_cpu: int) -> str:
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    rest = [x for x in cpus if x != server_cpu]
    return ",".join(map(str, rest)) if c.pin and rest else ""


def _job_cmd(c: TrlBenchConfig, url: str, model: str, out: Path, ranks: int, mode: str, cpus: str) -> list[str]:
    from ..vllm_server import free_port

    job = ["-m", "weight_transfer.experiments.trl_bench_job", "--url", url, "--model", model, "--out", str(out),
           "--shadow", mode, "--steps", str(c.steps), "--lr", str(c.lr), "--batch", str(c.batch),
           "--generations", str(c.generations), "--completion-tokens", str(c.completion_tokens), "--cpus", cpus]
    if ranks == 1:
        return [sys.executable, *job]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(ranks),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *job]


def _verify(c: TrlBenchConfig, out: Path, prompts, after) -> tuple[bool | None, float | None]:
    """The server's outputs after the job against a fresh vLLM on the job's final weights."""
    from weight_transfer.engines.vllm.oracle import fresh_snapshots_subprocess
    from weight_transfer.engines.vllm.verify import outputs_equal

    if not c.verify:
        return None, None
    fresh = fresh_snapshots_subprocess({"final": {"dir": str(out / "final"), "prompts": prompts, "hide_amx": True}},
                                       out / "fresh.pt", max_tokens=MAX_TOKENS, omp_threads=1)["final"]
    same, ulps = outputs_equal(after, fresh["outputs"])
    return bool(same), float(ulps)


def run_job(c: TrlBenchConfig, srv, model: str, root: Path, ranks: int, mode: str, cpus: str, prompts) -> dict:
    """One job against ``srv`` (:class:`VLLMServer`), measured and verified: its row (without
    the run's columns); ``prompts``: the fixed prompts of the verification. A failed job gives a row with ``error`` (and the server released)."""
    from weight_transfer.engines.vllm.backend.recover import recover_http

    out, n = root / f"ranks{ranks}-{mode}", 1
    while out.exists():  # a (ranks, mode) run twice
        out, n = root / f"ranks{ranks}-{mode}-{n + 1}", n + 1
    out.mkdir(parents=True)
    before = srv.generate(prompts, MAX_TOKENS)  # caches the long prompt's blocks under the weights before (C21)
    load0 = os.getloadavg()
    meter = LoadMeter()  # the load average now; the others' CPU through the job's process
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    t0 = time.time()
    row = {"ranks": ranks, "mode": mode, "trainer_cpus": cpus or "any",
           **{f"load{k}_start": round(x, 2) for k, x in zip((1, 5, 15), load0)}}
    try:
        meter.start()
        with open(out / "job.log", "w") as log:
            p = subprocess.run(_job_cmd(c, srv.url, model, out, ranks, mode, cpus), stdout=log,
                               stderr=subprocess.STDOUT, env=env, cwd=out, timeout=c.job_timeout)
        meter.stop()
        row["job_s"] = time.time() - t0
        row.update({f"load{k}_end": round(x, 2) for k, x in zip((1, 5, 15), os.getloadavg())})
        if p.returncode != 0:
            tail = (out / "job.log").read_text(errors="replace").splitlines()[-15:]
            raise RuntimeError(f"job exited {p.returncode} (log {out / 'job.log'}): " + " | ".join(tail))
        clock = srv.steps(since=t0)
        (out / "clock.json").write_text(json.dumps(clock))
        report = json.loads((out / "rank0.json").read_text())
        row.update(job_metrics(report, clock, c.warmup))
        after, row["server_version"] = srv.generate(prompts, MAX_TOKENS), srv.weight_version()
        (out / "outputs.json").write_text(json.dumps({"prompts": prompts, "before": before, "after": after}))
        row["verified"], row["verify_ulps"] = _verify(c, out, prompts, after)
    except Exception as e:  # the row says it; the next job runs on a released server
        row.setdefault("job_s", time.time() - t0)
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        try:
            recover_http(srv.url, stale_only=False, resume=True, timeout=120)
        except Exception as r:
            row["error"] += f" | recovery: {type(r).__name__}: {r}"[:500]
    row.update(meter.columns())
    if row.get("tok_s_during") is not None and mode != "off":
        r = row.get("during_over_between")
        row["target_met"] = bool(r == r and r >= 0.5)
    return row


def append_row(path: str, row: dict) -> None:
    """Append ``row`` to the CSV at ``path`` in :data:`COLUMNS` order (the header first when new;
    a file written before a column was added is first rewritten with :data:`COLUMNS` as its
    header, its rows' cells unchanged and the new columns empty)."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    new = not p.exists() or p.stat().st_size == 0
    if not new:
        _widen(p)
    with open(p, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow({k: _cell(row.get(k)) for k in COLUMNS})


def _widen(p: Path) -> None:
    """Rewrite the CSV at ``p`` with :data:`COLUMNS` as its header (atomically) when its header
    lacks one of them; its cells stay as written."""
    with open(p, newline="") as f:
        rows = list(csv.DictReader(f))
        f.seek(0)
        header = next(csv.reader(f), [])
    if not set(COLUMNS) - set(header):
        return
    cols = list(COLUMNS) + [h for h in header if h not in COLUMNS]
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    os.replace(tmp, p)


def _cell(x):
    if isinstance(x, float):
        return "" if x != x else f"{x:.6g}"
    return "" if x is None else x


def run(c: TrlBenchConfig) -> tuple[list[dict], list[str]]:
    """Every (ranks, mode) job against one server (module docstring): the rows and notes."""
    from weight_transfer.engines.vllm.verify import fixed_prompts

    from ..env import git_sha
    from ..vllm_server import VLLMServer

    root = Path(c.workdir) if c.workdir else Path(tempfile.mkdtemp(prefix="wt-bench-trl-"))
    root.mkdir(parents=True, exist_ok=True)
    model, mcfg = _checkpoint(c, root)
    run_id, sha = uuid.uuid4().hex[:12], git_sha()
    desc = "tiny qwen3 " + " ".join(c.override)
    rows, notes = [], [f"work directory {root}"]
    with VLLMServer(model, root / "server.log", max_num_seqs=c.max_num_seqs) as srv:
        ready = srv.wait_ready()
        srv.install_step_clock()
        cpus = _trainer_cpus(c, srv.cpu)
        notes.append(f"server ready in {ready:.0f} s; its worker on CPU {srv.cpu}, training processes on "
                     f"CPU {cpus or 'any'}")
        for ranks in c.ranks:
            for mode in c.modes:
                row = run_job(c, srv, model, root, ranks, mode, cpus, fixed_prompts(mcfg.vocab_size))
                row.update(run_id=run_id, git_sha=sha, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"), model=desc,
                           steps=c.steps)
                append_row(c.out, row)
                rows.append(row)
                print(format_row(row), flush=True)
    return rows, notes


# ------------------------------------------------------------------------------ report


def _f(x, spec: str) -> str:
    width = spec.split(".")[0]
    return format("-", ">" + width) if x is None or x != x else format(x, spec)


HEAD = (f"# {'ranks':>5} {'mode':>5} {'sync':>6} {'update':>6} {'step':>6} {'tok/s':>7} {'tok/s':>7} {'ratio':>6} "
        f"{'busy':>9} {'gap sync':>8} {'gap all':>8} {'stale':>5} {'paused':>6} {'verified':>8} {'load':>9}\n"
        f"# {'':>5} {'':>5} {'p50 s':>6} {'p50 s':>6} {'p50 s':>6} {'during':>7} {'between':>7} {'':>6} "
        f"{'dur/betw':>9} {'max s':>8} {'max s':>8} {'drop':>5} {'':>6} {'':>8} {'start/end':>9}")


def format_row(r: dict) -> str:
    """One table line (:data:`HEAD`'s columns)."""
    if r.get("error"):
        return f"  {r['ranks']:>5} {r['mode']:>5}  FAILED: {r['error'][:300]}"
    load = f"{_f(r.get('load1_start'), '4.1f')}/{_f(r.get('load1_end'), '.1f')}"
    busy = f"{_f(r.get('busy_during'), '.2f')}/{_f(r.get('busy_between'), '.2f')}"
    return (f"  {r['ranks']:>5} {r['mode']:>5} {_f(r['sync_s_p50'], '6.3f')} {_f(r['update_s_p50'], '6.3f')} "
            f"{_f(r['step_s_p50'], '6.2f')} {_f(r['tok_s_during'], '7.0f')} {_f(r['tok_s_between'], '7.0f')} "
            f"{_f(r['during_over_between'], '6.2f')} {busy:>9} {_f(r['max_gap_sync_s'], '8.3f')} {_f(r['max_gap_s'], '8.3f')} "
            f"{r['dropped_stale']:>5} {str(r['paused']):>6} {str(r.get('verified')):>8} {load:>9}")


def format_table(rows: list[dict], notes: list[str]) -> str:
    """The table (one line per job), the target per shadow job, the definitions and notes."""
    L = [HEAD, *(format_row(r) for r in rows), "#"]
    for r in rows:
        if r.get("mode") != "off" and not r.get("error"):
            off = next((o for o in rows if o["ranks"] == r["ranks"] and o["mode"] == "off" and not o.get("error")), {})
            L.append(f"# {r['ranks']} rank(s), shadow={r['mode']}: rollout tokens/s during syncs "
                     f"{_f(r['during_over_between'], '.3f')} x between (target >= 0.50: "
                     f"{'met' if r.get('target_met') else 'NOT met'}); pause-based: "
                     f"{_f(off.get('tok_s_during'), '.0f')} tok/s during syncs")
    L += [summary_line([r], f" [{r['ranks']} rank(s), shadow={r['mode']}]", window="the job") for r in rows]
    L.append("# sync: rank 0's _sync_weight window; update: the backend's update call; step: one GRPO step, step end "
             "to step end; tok/s: tokens of the engine's steps (prefill included) inside / outside the measured "
             "syncs; busy: the fraction of that time the engine spent in a forward; gap: the longest idle gap between two engine steps overlapping a sync / anywhere in the span; "
             "stale drop: samples TRL dropped as too stale; load: 1-minute load average at the job's start / end")
    L += [f"# {n}" for n in notes]
    return "\n".join(L)


def main(c: TrlBenchConfig) -> int:
    print(HEAD, flush=True)
    rows, notes = run(c)
    print(format_table(rows, notes))
    if c.out:
        print(f"# rows appended to {c.out}")
    failed = any(r.get("error") or r.get("verified") is False for r in rows)
    return 1 if failed else 0
