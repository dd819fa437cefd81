"""The reference and the baselines side by side: one invocation, one model, one world.

``weight-transfer run --method all [options]`` runs :data:`COMPARE_METHODS` one after
another with the same :class:`~weight_transfer.experiments.config.TrialConfig` (only ``method`` differs), each
a full trial (fresh processes, warmup, timed updates, every update verified bit-exact), and
prints one nccl-tests style table with a row per method; every update's tidy row is appended
to the results CSV. Column definitions: docs/PERFORMANCE.md ("Comparison table").

Example::

    weight-transfer run --method all --override num_hidden_layers=2 --steps 3
"""
from __future__ import annotations

import statistics
import sys

from .load import summary_line as load_summary
from .report import append_csv, coverage_line, kind_lines, percentile, train_layout_text

COMPARE_METHODS = ("reference", "rank0_funnel", "rpc")


def run_compare(cfg, methods=COMPARE_METHODS, *, progress=None) -> list[tuple[str, object]]:
    """Run one trial per method (``cfg`` with ``method`` replaced). Returns ``[(method, result)]``
    where result is a TrialResult, or the exception that stopped that method's trial (the
    others still run). With ``--engine vllm`` the trials share a fresh-engine oracle cache
    (:class:`_VllmOracleDir`)."""
    from .trial import run_trial

    out = []
    oracle = _VllmOracleDir() if cfg.run.engine == "vllm" else None
    try:
        if oracle is not None:  # every version's fresh engine now, before any live engine and trainers exist
            from .vllm_side import prefill_oracle

            if progress:
                progress(f"# vLLM oracle: a fresh engine per version 1..{cfg.run.warmup + cfg.run.steps}, before the trials ...")
            prefill_oracle(cfg)
        for m in methods:
            out.append(_run_one(cfg, m, progress, run_trial))
    finally:
        if oracle is not None:
            oracle.close()
    return out


class _VllmOracleDir:
    """With ``--engine vllm``: a temporary directory, named in ``WT_VLLM_ORACLE_DIR`` for the
    trials of this comparison, where each step's fresh-engine snapshot is kept and reused by
    the other methods (``experiments/vllm_side.py``); removed afterwards. When the caller already
    names a directory there, that one is used and kept (snapshots are keyed by model, step, seed,
    TP, vLLM version and host path, so a later run of the same trial reuses them)."""

    def __init__(self):
        import os
        import tempfile

        from .vllm_side import ORACLE_DIR_ENV

        self.env, self.prev = ORACLE_DIR_ENV, os.environ.get(ORACLE_DIR_ENV)
        self.keep = bool(self.prev)
        self.dir = self.prev if self.keep else tempfile.mkdtemp(prefix="wt-vllm-oracle-")
        os.environ[self.env] = self.dir

    def close(self):
        import os
        import shutil

        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        if self.prev is None:
            os.environ.pop(self.env, None)
        else:
            os.environ[self.env] = self.prev


def _run_one(cfg, m, progress, run_trial) -> tuple[str, object]:
    """One method's trial: (method, TrialResult or the exception that stopped it)."""
    from weight_transfer.control.protocol import ControlError
    from weight_transfer.types import PlanError

    mcfg = cfg.replace(method=m)
    if progress:
        progress(f"# {m}: starting {cfg.train.n_train} training + {cfg.n_infer} inference processes ...")
    try:
        res = run_trial(mcfg, progress=(lambda r, m=m: progress(
            f"# {m} step {r['step']}: {r['seconds']:.3f} s, verified={r['verified']}")) if progress else None)
    except (ValueError, PlanError, ControlError, RuntimeError) as e:
        res = e
    return m, res


def _summary(res) -> dict:
    meas = [r for r in res.rows if not r["warmup"]] or res.rows
    secs = [r["seconds"] for r in meas]
    p50 = statistics.median(secs)
    return {
        "bytes": meas[0]["bytes"], "wire": meas[0].get("wire_bytes", meas[0]["bytes"]), "p50": p50,
        "p95": percentile(secs, 95), "p99": percentile(secs, 99), "gbps": meas[0]["bytes"] / p50 / 1e9, "n": len(meas),
        "ok": sum(1 for r in res.rows if r["verified"]), "all": len(res.rows),
        "peak": max(r["peak_temp_bytes"] for r in res.rows),
        "staged": meas[0].get("bytes_staged"), "commit": statistics.median(
            [r.get("commit_seconds", 0.0) for r in meas]) if meas[0].get("bytes_staged") is not None else None,
    }


def format_comparison(cfg, runs: list[tuple[str, object]]) -> str:
    """One table, a row per method (see module docstring)."""
    first = next((r for _, r in runs if not isinstance(r, BaseException)), None)
    env = first.env if first is not None else {}
    mcfg = cfg.model_config()
    lines = [
        f"# weight-transfer comparison: {' vs '.join(m for m, _ in runs)} (same model, same worlds, one invocation)",
        f"# host: {env.get('host', '?')}  cpus: {env.get('cpus', '?')}  torch: {env.get('torch', '?')}  "
        f"python: {env.get('python', '?')}  git: {env.get('git_sha', '?')}",
        f"# model: {mcfg.label} ({mcfg.architecture}; source {mcfg.source})",
        f"# training: {cfg.train.n_train} rank(s), {train_layout_text(cfg)}, {cfg.train.dtype}",
        f"# inference: {cfg.n_infer} rank(s), {cfg.inference.describe()} ({cfg.inference.quant or cfg.inference.dtype}); "
        f"reference transport: {cfg.transport}",
        f"# updates per method: {cfg.run.warmup} warmup + {cfg.run.steps} measured, every one verified",
    ]
    for m, r in runs:
        lines.append(f"# plan[{m}]: " + (r.schedule_summary if not isinstance(r, BaseException) else "-"))
    lines += [
        "#",
        f"{'method':>14} {'bytes':>13} {'direct':>12} {'staged':>12} {'wire_bytes':>13} {'p50':>9} {'commit':>8} "
        f"{'p95':>9} {'p99':>9} {'algbw':>8} {'x_ref':>8} {'peak_tmp':>9} {'verified':>9}",
        f"{'':>14} {'(B)':>13} {'(B)':>12} {'(B)':>12} {'(B)':>13} {'(s)':>9} {'(s)':>8} {'(s)':>9} {'(s)':>9} {'(GB/s)':>8} "
        f"{'(slower)':>8} {'(MB)':>9} {'':>9}",
    ]
    sums = {m: _summary(r) for m, r in runs if not isinstance(r, BaseException)}
    ref = sums.get("reference")
    for m, r in runs:
        if isinstance(r, BaseException):
            msg = str(r).splitlines()[0] if str(r) else type(r).__name__
            lines.append(f"{m:>14} FAILED: {type(r).__name__}: {msg}")
            continue
        s = sums[m]
        x = f"{s['p50'] / ref['p50']:8.2f}" if ref else f"{'-':>8}"
        d, st = ((s["bytes"] - s["staged"], s["staged"]) if s["staged"] is not None else ("-", "-"))
        c = f"{s['commit']:>8.4f}" if s["commit"] is not None else f"{'-':>8}"
        lines.append(f"{m:>14} {s['bytes']:>13} {d:>12} {st:>12} {s['wire']:>13} {s['p50']:>9.4f} {c} {s['p95']:>9.4f} {s['p99']:>9.4f} "
                     f"{s['gbps']:>8.3f} {x} {s['peak'] / 1e6:>9.1f} {str(s['ok']) + '/' + str(s['all']):>9}")
    lines += [
        "#",
        "# bytes: landed in inference memory per update (sum over inference ranks of the engine's tensor bytes,",
        "#        the same quantity for every method, except that the reference's also counts its staged bytes);",
        "#        wire_bytes: what the method moved between and inside the jobs",
        "# direct / staged (reference): bytes written where the engine computes with them / into checkpoint-layout",
        "#        staging that the engine's own post-processing turns into its kernel state at commit (commit: its",
        "#        receiver-side seconds, p50, inside p50); the baselines load everything through the engine's loader",
        "# x_ref = method p50 / reference p50: how many times slower than the reference (reference = 1.00)",
    ]
    if ref:
        for m, s in sums.items():
            if m != "reference":
                lines.append(f"# {m} p50 / reference p50 = {s['p50']:.4f} s / {ref['p50']:.4f} s = "
                             f"{s['p50'] / ref['p50']:.2f} (p99: {s['p99'] / ref['p99']:.2f}); > 1: the reference is faster")
    if first is not None and first.memcpy_gbps:
        lines.append(f"# memcpy on this machine (1 thread, 256 MiB): {first.memcpy_gbps:.2f} GB/s")
    for m, r in runs:  # how loaded the machine was through each method's measured updates (experiments/load.py)
        if not isinstance(r, BaseException):
            lines.append(load_summary([x for x in r.rows if not x.get("warmup")] or r.rows, f" [{m}]"))
    n_ok = sum(s["ok"] for s in sums.values())
    n_all = sum(s["all"] for s in sums.values())
    failed = [m for m, r in runs if isinstance(r, BaseException)]
    good = n_ok == n_all and not failed
    if cfg.run.engine == "vllm":
        lines.append("# vLLM: the reference goes through vLLM's weight-transfer API with the one_sided backend "
                     "(start_weight_update, one-sided writes, update_weights, finish_weight_update); the baselines "
                     "load through vLLM's own in-place reload over collective_rpc (initialize_layerwise_reload, "
                     "model.load_weights, finalize_layerwise_reload); times: go -> last write complete and every "
                     "worker's update_weights committed (reference), go -> reload finished (baselines)")
    for m, r in runs:
        cov = None if isinstance(r, BaseException) else coverage_line(r.rows)
        if cov:
            lines.append(f"# [{m}] " + cov[2:])
    for m, r in runs:  # the reference's prepare per tensor kind and commit per staged layer (issue 43)
        if m == "reference" and not isinstance(r, BaseException):
            kinds = kind_lines([x for x in r.rows if not x.get("warmup") and x.get("outcome") != "failed"])
            lines += [ln.replace("# prepare per kind", "# [reference] prepare per kind", 1)
                      .replace("# engine commit per", "# [reference] engine commit per", 1) for ln in kinds]
    against = ("a fresh vLLM from the step's checkpoint (every addressable runtime byte, staged bytes vs the "
               "checkpoint; greedy tokens identical, logprobs within 8 float32 ulps)" if cfg.run.engine == "vllm" else "the engine's load_weights")
    lines.append(f"# verified bit-exact against {against}: {n_ok}/{n_all} updates over "
                 f"{len(sums)} method(s)" + ("" if good else "  <-- FAILED" + (f" ({', '.join(failed)} did not run)" if failed else "")))
    return "\n".join(lines)


def run_all(cfg, *, results_path, methods=COMPARE_METHODS) -> int:
    """The ``--method all`` command: run, print the table, append every row. Exit status 0
    only if every method ran and every update verified. Every method's
    :func:`~weight_transfer.experiments.trial.preflight` runs first: ValueError / PlanError
    (the command's exit status 2) before any process starts."""
    import dataclasses

    from .trial import preflight

    for m in methods:  # every method refused now, before the first one starts (not after the reference ran)
        preflight(dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, method=m)))
    runs = run_compare(cfg, methods, progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_comparison(cfg, runs))
    rows = [row for _, r in runs if not isinstance(r, BaseException) for row in r.rows]
    if rows:
        print(f"# rows appended to {append_csv(rows, results_path)}")
    ok = all(not isinstance(r, BaseException) and all(row["verified"] in (True, None) for row in r.rows)
             for _, r in runs)
    return 0 if ok else 1
