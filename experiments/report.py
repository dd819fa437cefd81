"""Tables in the nccl-tests shape and tidy CSV rows.

Table: ``#`` header lines with the environment and world shape, a column-name row and a units
row, fixed-width rows (one per update), and a footer with the summary and correctness.
Columns are defined in docs/PERFORMANCE.md. Only raw ``bytes`` and ``seconds`` are stored in
the CSV; GB/s in the table is ``bytes / seconds / 1e9``.
"""
from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path

import pandas as pd

from .load import summary_line as load_summary


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); numpy's default method."""
    import numpy as np

    return float(np.percentile(xs, q)) if xs else float("nan")


def _engine_text(cfg) -> str:
    if cfg.run.engine == "vllm":
        from weight_transfer.engines.vllm import vllm_version

        return f"{vllm_version() or 'vllm'} (unmodified; runtime layout reported by the engine; verified vs a fresh vLLM)"
    return "stand-in (engines/engine.py, vLLM 0.32 layouts)"


def train_layout_text(cfg) -> str:
    if cfg.train.layout == "fsdp":
        return f"FSDP2 fully_shard, Shard(0) on DeviceMesh({cfg.train.n_train},)"
    a, b = cfg.train.mesh[:2]
    if cfg.train.layout == "two_group":
        w = cfg.train.mesh[2] if len(cfg.train.mesh) > 2 else a
        return (f"two mesh groups on a {a}x{b} mesh: non-experts (Replicate, Shard(0)) within a node, "
                f"experts Shard(0) across {w} node(s) (MoE mesh width {w})")
    return f"[Shard(0), Shard(0)] on DeviceMesh({a}, {b})"


def coverage_line(rows: list[dict]) -> str | None:
    """The footer line saying which fraction of the engine's bytes each check covered (rows of
    a vLLM trial carry ``check_direct`` / ``check_staged`` / ``check_outputs_only``), or None."""
    rs = [r for r in rows if r.get("check_direct") is not None and r.get("check_direct") == r.get("check_direct")]
    if not rs:
        return None
    d = min(r["check_direct"] for r in rs)
    st = min(r.get("check_staged", 0.0) for r in rs)
    o = max(r.get("check_outputs_only", 0.0) for r in rs)
    return (f"# byte check covered {100 * d:.1f}% of the engine's weight bytes (compared with a fresh vLLM); "
            f"{100 * st:.1f}% is opaque kernel state (oneDNN/zentorch handles) checked through the staged bytes it is "
            f"made from (vs the checkpoint's load layout) and through outputs; {100 * o:.1f}% through outputs only")


def format_table(result) -> str:
    """The table of one trial (:class:`weight_transfer.experiments.trial.TrialResult`), in the
    nccl-tests shape: ``#`` lines with the environment and the plan, a header and a units row,
    one fixed-width row per update (bytes, seconds, GB/s, phase seconds, writes, peak temporary
    MB, verified), then a footer: the warm statistics, the per-phase and per-kind lines, and
    what each update was verified against."""
    rows = result.rows
    staged = any(r.get("bytes_staged") for r in rows)
    delta = any(r.get("delta") for r in rows)  # --delta: bytes actually written beside the update's bytes
    fleet = any("members" in r for r in rows)  # engines that come and go (C24): each update's members, replan time
    done = [r for r in rows if r.get("outcome") != "failed"]
    meas = [r for r in done if not r["warmup"]]
    lines = _header_lines(result) + _update_lines(rows, staged=staged, delta=delta, fleet=fleet)
    lines += _warm_lines(result, meas, staged=staged, delta=delta)
    lines += _verified_lines(result, done, fleet=fleet)
    return "\n".join(lines)


def _header_lines(result) -> list[str]:
    """The ``#`` lines above the table: method, host, model, both worlds, the plan."""
    cfg, env = result.cfg, result.env
    mcfg = cfg.model_config()
    return [
        f"# weight-transfer trial: method={cfg.run.method} transport={cfg.transport}"
        + (f" device={cfg.run.device}" if cfg.run.device != "cpu" else ""),
        f"# host: {env['host']}  cpus: {env['cpus']}  torch: {env['torch']}  python: {env['python']}  git: {env['git_sha']}",
        f"# model: {mcfg.label} ({mcfg.architecture}; source {mcfg.source})",
        f"# training: {cfg.train.n_train} rank(s), {train_layout_text(cfg)}, {cfg.train.dtype}",
        f"# inference: {cfg.n_infer} rank(s), {cfg.inference.describe()} ({cfg.inference.quant or cfg.inference.dtype}), "
        f"engine {_engine_text(cfg)}",
        f"# plan: {result.schedule_summary}; computed once in {result.plan_seconds:.3f} s",
        *_draft_lines(cfg, mcfg),
        "#",
    ]


def _draft_lines(cfg, mcfg) -> list[str]:
    """``--draft mtp``: what the draft adds to every update (its destination bytes, all inference
    ranks) and which MTP tensors it shares with the target (written once, as the target's)."""
    if not cfg.inference.draft:
        return []
    from weight_transfer.engines.engine import engine_tensor_metas
    from weight_transfer.plan.rules.mtp import shared_sources

    metas = [m for r in range(cfg.n_infer) for m in engine_tensor_metas(mcfg, cfg.inference, r)]
    draft = sum(m.nbytes for m in metas if m.name.startswith("draft."))
    total = sum(m.nbytes for m in metas)
    shared = ", ".join(f"{s} -> {t}" for s, t in shared_sources(mcfg).items())
    return [f"# draft ({cfg.inference.draft}{', frozen' if cfg.run.draft_frozen else ''}): {draft} B of the {total} B "
            f"every update writes ({100 * draft / max(1, total):.1f}%); shared with the target, written once as its: {shared}"]


def _update_lines(rows: list[dict], *, staged: bool, delta: bool, fleet: bool) -> list[str]:
    """The header, the units row and one fixed-width row per update (a failed one named);
    ``staged``, ``delta`` and ``fleet`` add their columns."""
    st_h = (f" {'staged':>12} {'commit':>8}", f" {'(B)':>12} {'(s)':>8}") if staged else ("", "")
    if delta:
        st_h = (f" {'delta_bytes':>14}" + st_h[0], f" {'(B)':>14}" + st_h[1])
    fl_h = (f" {'members':>9} {'epoch':>5} {'replan':>8}", f" {'(ranks)':>9} {'':>5} {'(s)':>8}") if fleet else ("", "")
    lines = [
        f"{'step':>6} {'bytes':>14}{st_h[0]} {'time':>10} {'algbw':>8} {'prepare':>8} {'write':>8} {'publish':>8} "
        f"{'writes':>7} {'peak_tmp':>9} {'verified':>9}{fl_h[0]}",
        f"{'':>6} {'(B)':>14}{st_h[1]} {'(s)':>10} {'(GB/s)':>8} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'':>7} {'(MB)':>9} "
        f"{'':>9}{fl_h[1]}",
    ]
    for r in rows:
        fl = (f" {r.get('members', ''):>9} {r.get('epoch', 0):>5} {r.get('replan_seconds', 0.0):>8.4f}"
              if fleet else "")
        if r.get("outcome") == "failed":  # an update that lost an engine: named, weights incomplete, the run went on
            lines.append(f"{r['step']:>6} {'FAILED':>14} {r['seconds']:>10.4f} {'':>8} {'':>8} {'':>8} {'':>8} {'':>7} "
                         f"{'':>9} {'-':>9}{fl}  ({str(r.get('error', '')).split(' (also: ')[0]})")
            continue
        v = {True: "yes", False: "NO", None: "-"}[r["verified"]]
        note = "  (cold)" if r["step"] == rows[0]["step"] and r["warmup"] else "  (warmup)" if r["warmup"] else ""
        st = f" {r.get('bytes_staged', 0):>12} {r.get('commit_seconds', 0.0):>8.4f}" if staged else ""
        if delta:
            st = f" {r.get('delta_bytes', r['bytes']):>14}" + st
            if r.get("delta", "delta") != "delta":
                note += f"  ({r['delta']})"
        lines.append(f"{r['step']:>6} {r['bytes']:>14}{st} {r['seconds']:>10.4f} {r['bytes'] / r['seconds'] / 1e9:>8.3f} "
                     f"{r.get('phase_prepare_s', 0.0):>8.4f} {r.get('phase_write_s', 0.0):>8.4f} "
                     f"{r.get('phase_publish_s', 0.0):>8.4f} "
                     f"{r['n_writes']:>7} {r['peak_temp_bytes'] / 1e6:>9.1f} {v:>9}{fl}{note}")
    return lines


def _warm_lines(result, meas: list[dict], *, staged: bool, delta: bool) -> list[str]:
    """The footer's statistics: the cold first update, the warm updates' seconds (p50, p95,
    p99, min, max) and GB/s, the per-phase and per-kind lines, the delta updates, the
    trainers' copies and the staged bytes."""
    rows = result.rows
    secs = [r["seconds"] for r in meas]
    lines: list[str] = []
    if rows and rows[0]["warmup"] and rows[0].get("outcome") != "failed":
        c = rows[0]
        lines += ["#", f"# cold first update (step {c['step']}, reported, not in the warm statistics): {c['seconds']:.4f} s "
                       f"({c['bytes'] / c['seconds'] / 1e9:.3f} GB/s)"]
    if meas:
        med = statistics.median(secs)
        lines += [
            "#",
            f"# measured (warm) updates: {len(meas)}; seconds p50 {med:.4f}  p95 {percentile(secs, 95):.4f}  "
            f"p99 {percentile(secs, 99):.4f}  min {min(secs):.4f}  max {max(secs):.4f}",
            f"# bytes per update: {meas[0]['bytes']} ({meas[0]['bytes'] / 1e9:.3f} GB); algbw at p50: "
            f"{meas[0]['bytes'] / med / 1e9:.3f} GB/s"
            + (f" = {100 * meas[0]['bytes'] / med / 1e9 / result.memcpy_gbps:.0f}% of memcpy "
               f"(same run, 1 thread: {result.memcpy_gbps:.2f} GB/s)" if result.memcpy_gbps else ""),
        ]
        lines += phase_lines(meas, result.memcpy_gbps)
        lines += kind_lines(meas)
        if delta:
            db = [r.get("delta_bytes", r["bytes"]) for r in meas]
            lines.append(f"# delta updates: bytes written p50 {statistics.median(db):.0f} "
                         f"({100 * statistics.median(db) / max(1, meas[0]['bytes']):.2f}% of the update's bytes); "
                         f"shadow on the trainers {meas[0].get('delta_shadow_bytes', 0) / 1e6:.1f} MB; full updates at "
                         f"steps {[r['step'] for r in rows if r.get('delta', 'delta') != 'delta']}")
            modes = [m for m in ("full", "scattered", "packed") if any(f"delta_n_{m}" in r for r in meas)]
            if modes:  # the cost model's choice per output (reference/delta/cost.py): writes per mode, p50
                per = ", ".join(f"{m} {statistics.median(int(r.get(f'delta_n_{m}', 0) or 0) for r in meas):.0f}"
                                for m in modes)
                rec = statistics.median(int(r.get("delta_records", 0) or 0) for r in meas)
                lines.append(f"# delta modes (p50 per update, outputs written each way): {per}; packed records "
                             f"scattered by the receivers' commit: {rec:.0f}"
                             + ("" if rec else " (none: no receiver offered a landing region, or none fit)"))
            dm = [m for m in ("full", "scattered", "packed", "unchanged") if any(f"delta_draft_n_{m}" in r for r in meas)]
            if dm:  # --draft mtp: the draft model's outputs on their own (a frozen draft: all unchanged)
                per = ", ".join(f"{m} {statistics.median(int(r.get(f'delta_draft_n_{m}', 0) or 0) for r in meas):.0f}"
                                for m in dm)
                dbytes = statistics.median(sum(int(r.get(f"delta_draft_bytes_{m}", 0) or 0) for m in dm) for r in meas)
                lines.append(f"# draft model (draft.*) outputs per update, p50: {per}; bytes written {dbytes:.0f}")
    if meas and meas[-1].get("trainer_copy_bytes") is not None:
        c = meas[-1]["trainer_copy_bytes"]
        lines.append(f"# trainers copied outside the writes: {c} B per update ({100 * c / max(1, meas[-1]['bytes']):.1f}% "
                     "of the bytes written: full_tensor() gathers, plus outputs built in buffers of their own -- "
                     "casts, FP8 quantization, fused bands, .contiguous() of strided TP slices; 0 = every write "
                     "straight from a shard)")
    if staged and meas:
        b, bs = meas[0]["bytes"], meas[0]["bytes_staged"]
        cs = [r.get("commit_seconds", 0.0) for r in meas]
        lines.append(f"# bytes per update: {b - bs} direct (where vLLM computes with them) + {bs} staged "
                     f"(checkpoint layout; vLLM re-runs process_weights_after_loading for those layers at commit, "
                     f"receiver-side p50 {statistics.median(cs):.4f} s, included in time)")
    return lines


def _verified_lines(result, done: list[dict], *, fleet: bool) -> list[str]:
    """The footer's last lines: memcpy, the checks' coverage, what every update was verified
    against and how many were, the fleet's and the serving engines' lines, what failed."""
    rows = result.rows
    n_ok = sum(1 for r in done if r["verified"])
    lines: list[str] = []
    if result.memcpy_gbps:
        lines.append(f"# memcpy on this machine (same run, 1 thread, 256 MiB): {result.memcpy_gbps:.2f} GB/s")
    lines.append(load_summary([r for r in done if not r.get("warmup")] or done))  # experiments/load.py
    cov = coverage_line(rows)
    if cov:
        lines.append(cov)
    against = ("a fresh vLLM from the step's checkpoint (every addressable runtime byte, staged bytes vs the "
               "checkpoint; greedy tokens identical, logprobs within 8 float32 ulps)"
               if result.cfg.run.engine == "vllm" else "the engine's load_weights"
               if result.cfg.model_config().hand_written else
               "vLLM's own load_weights of the step's " + ({"fp8": "block-FP8 ", "fp8-tensor": "per-tensor FP8 ",
                                                    "fp8-channel": "per-channel FP8 "}.get(result.cfg.inference.quant, ""))
               + "checkpoint (a CPU skeleton in a child process" + (", of the target and of its MTP draft"
                                                                      if result.cfg.inference.draft else "")
               + "; the stand-in engine's tensors are what vLLM's traced loader fills" + ("; each weight quantized whole by the torch reference" if
                                        result.cfg.inference.quant else "") + ")")
    lines.append(f"# verified bit-exact against {against}: {n_ok}/{len(done)} updates"
                 + (f" (every engine in each; {len(rows) - len(done)} failed update(s) above, named)" if fleet else "")
                 + ("" if n_ok == len(done) else "  <-- FAILED"))
    fp = [r for r in done if r.get("fingerprints")]
    if fp:  # --fingerprints: the reference's own end-to-end check, beside the harness's
        vb, vs = sorted(r["verify_bytes"] for r in fp), sorted(r["verify_s"] for r in fp)
        lines.append(f"# fingerprints ({fp[0]['fingerprints']}): {len(fp)}/{len(done)} updates matched end to end; "
                     f"checked p50 {vb[len(vb) // 2] / 1e6:.1f} MB of {fp[0]['bytes'] / 1e6:.1f} MB per update, "
                     f"{vs[len(vs) // 2] * 1e3:.1f} ms p50 (request to comparison)")
    if fleet:
        lines += fleet_lines(rows)
    if result.cfg.serve.active:  # the engines' stall through the updates (C27)
        from .serving import serve_lines

        lines += serve_lines(rows)
    for r in rows:
        if r.get("verify_error"):
            lines.append(f"#   step {r['step']}: {r['verify_error']}")
    return lines


def fleet_lines(rows: list[dict]) -> list[str]:
    """Footer lines of a run whose engines were killed, restarted or scaled (C24; rows with a
    ``members`` column): the options, every membership change with its replan time, every
    failed update with its named error, the newcomers' first updates, the trainers' pids."""
    r0 = rows[0]
    opts = " ".join(f"--{k.replace('_', '-')} {r0[k]}" for k in ("kill_engine", "restart_engine", "engines_at")
                    if r0.get(k))
    out = [f"# fleet (C24): {opts}; members = inference ranks in each update's plan"]
    for r in rows:
        if r.get("joined") or r.get("gone"):
            what = ", ".join(x for x in (f"gone {r['gone']}" if r.get("gone") else "",
                                         f"joined {r['joined']} (registered {r.get('join_seconds', 0.0):.2f} s after "
                                         "its start)" if r.get("joined") else "") if x)
            out.append(f"# before update {r['step']}: members {r['members']} ({what}); plan recomputed for them in "
                       f"{r.get('replan_seconds', 0.0):.4f} s (epoch {r.get('epoch')})")
        if r.get("outcome") == "failed":
            ste = r.get("seconds_to_error")
            out.append(f"# update {r['step']} failed: {str(r.get('error')).split(' (also: ')[0]}"
                       + (f"; named {ste:.2f} s after the kill" if ste is not None else "")
                       + f"; weights {r.get('weights_after', 'incomplete')}; planned without rank(s) {r.get('lost')} from "
                         "the next update")
    firsts = [(r["step"], r["newcomer_first"], r["verified"]) for r in rows
              if r.get("newcomer_first") and r.get("outcome") != "failed"]
    for step, ranks, ok in firsts:
        out.append(f"# newcomer rank(s) {ranks}: first update {step} complete, verified bit-exact: "
                   f"{'yes' if ok else 'NO'}")
    pids = {r.get("train_pids") for r in rows}
    if pids:
        same = len(pids) == 1
        out.append(f"# training ranks' pids: {', '.join(sorted(str(p) for p in pids))} at every update "
                   + ("(unchanged: the trainers never restarted)" if same else "<-- CHANGED"))
    return out


def _layer_kind(module: str) -> str:
    """``"model.layers.3.self_attn.qkv_proj"`` -> ``"self_attn.qkv_proj"`` (the layer index dropped)."""
    return re.sub(r"^(?:.*?\.)?layers\.\d+\.", "", module)


def kind_lines(meas: list[dict]) -> list[str]:
    """The reference's prepare and the engine's commit per tensor kind (issue 43), from the warm
    rows' ``prepare_by_kind`` (JSON per kind: tasks, ``full_tensor()`` seconds, build seconds,
    gathered and built bytes, summed over training ranks) and ``commit_by_layer`` (the slowest
    worker's seconds per staged layer, summed here over the layers of one kind): p50 over the
    rows of each figure. [] when the rows have neither."""
    pk = [json.loads(r["prepare_by_kind"]) for r in meas if r.get("prepare_by_kind")]
    cl = [json.loads(r["commit_by_layer"]) for r in meas if r.get("commit_by_layer")]
    if not pk and not cl:
        return []
    out = []
    if pk:
        out += ["#", "# prepare per kind (p50 over warm updates; seconds summed over training ranks, stages overlap):",
                f"#   {'kind':<66} {'tasks':>5} {'gather':>8} {'build':>8} {'gathered':>10} {'built':>10}",
                f"#   {'':<66} {'':>5} {'(s)':>8} {'(s)':>8} {'(MB)':>10} {'(MB)':>10}"]
        for k in sorted({k for d in pk for k in d}, key=lambda k: -statistics.median(
                [d.get(k, [0, 0, 0])[1] + d.get(k, [0, 0, 0])[2] for d in pk])):
            v = [d.get(k, [0, 0.0, 0.0, 0, 0]) for d in pk]
            med = [statistics.median(x[i] for x in v) for i in range(5)]
            out.append(f"#   {k[:66]:<66} {med[0]:>5.0f} {med[1]:>8.4f} {med[2]:>8.4f} {med[3] / 1e6:>10.1f} "
                       f"{med[4] / 1e6:>10.1f}")
    if cl:
        by = [{} for _ in cl]
        for d, b in zip(cl, by):
            for m, t in d.items():
                k = _layer_kind(m)
                b[k] = b.get(k, 0.0) + t
        out += ["#", "# engine commit per staged layer kind (p50 over warm updates, the slowest worker, summed over layers):"]
        for k in sorted({k for b in by for k in b}):
            n = sum(1 for m in cl[0] if _layer_kind(m) == k)
            out.append(f"#   {k:<66} {n:>3} layer(s) {statistics.median(b.get(k, 0.0) for b in by):>8.4f} s")
    return out


def phase_lines(meas: list[dict], memcpy_gbps: float | None) -> list[str]:
    """Footer lines from the per-phase columns of the warm rows (``experiments.columns.phase_columns``):
    the p50 busy seconds of each phase, the slowest sender and receiver with their GB/s against
    the same-run memcpy, and the extra memory per side. [] when the rows have no phase columns."""
    if not meas or "phase_write_s" not in meas[0]:
        return []
    med = {p: statistics.median(r.get(f"phase_{p}_s", 0.0) or 0.0 for r in meas)
           for p in ("h2d", "prepare", "write", "release", "barrier", "commit", "publish")}
    out = ["# phases, p50 busy seconds (largest over ranks; stages overlap in the pipeline, so they do not add up): "
           + "  ".join(f"{p} {v:.4f}" for p, v in med.items())]
    slow = max(meas, key=lambda r: r["seconds"])
    ref = f" = {100 * slow['sender_gbps_min'] / memcpy_gbps:.0f}% of memcpy" if memcpy_gbps and slow.get("sender_gbps_min") else ""
    line = (f"# slowest sender (slowest update): training {slow['slowest_sender']}, {slow['slowest_sender_s']:.4f} s"
            + (f", lowest per-sender {slow['sender_gbps_min']:.3f} GB/s{ref}" if slow.get("sender_gbps_min") else ""))
    if slow.get("slowest_receiver") is not None:
        line += (f"; busiest receiver: inference {slow['slowest_receiver']}, {slow['receiver_gbps_min']:.3f} GB/s"
                 + (f" = {100 * slow['receiver_gbps_min'] / memcpy_gbps:.0f}% of memcpy" if memcpy_gbps else ""))
    out.append(line)
    te = max(r.get("train_extra_bytes", 0) or 0 for r in meas)
    ie = max(r.get("infer_extra_bytes", 0) or 0 for r in meas)
    sh = max(r.get("shadow_extra_bytes", 0) or 0 for r in meas)
    where = ("its shadow targets: the writes land in the shadow, the go-live makes them live" if sh else
             "staging for staged targets; one-sided writes land in place")
    out.append(f"# extra memory per process: training peak {te / 1e6:.1f} MB (gathered sources + outputs of tasks in "
               f"flight); inference {(ie + sh) / 1e6:.1f} MB ({where})")
    return out


MIN_FREE_BYTES = 1 << 20
"""An output path is refused before any work when its file system has less free space than
this (1 MiB: a few thousand result rows)."""


def check_output_file(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before any process starts, a results file that could not be written (C25):
    ValueError naming ``what`` (the option) and the path when it is not a regular file (a
    directory, ``/dev/full``, a FIFO), cannot be created or appended to, or its file system has
    less than :data:`MIN_FREE_BYTES` free. Creates the parent directories; the file itself is
    opened for append and closed (nothing is written). Returns the path."""
    p = Path(path)
    if p.exists() and not p.is_file():
        kind = "a directory" if p.is_dir() else "not a regular file"
        raise ValueError(f"{what} {str(p)!r} is {kind}; give a file path (rows are appended to it)")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {str(p)!r} cannot be written: {e.strerror or e}") from None
    _check_free(p.parent, what, p)
    return p


def check_output_dir(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before any process starts, an output directory that could not be written:
    ValueError naming ``what`` and the path when it is a file, cannot be created, a file cannot
    be created in it, or it has less than :data:`MIN_FREE_BYTES` free. Returns the path."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
        import tempfile

        with tempfile.TemporaryFile(dir=p):
            pass
    except OSError as e:
        raise ValueError(f"{what} {str(p)!r} cannot be written: {e.strerror or e}") from None
    _check_free(p, what, p)
    return p


def _check_free(d: Path, what: str, p: Path) -> None:
    st = os.statvfs(d)
    free = st.f_bavail * st.f_frsize
    if free < MIN_FREE_BYTES:
        raise ValueError(f"{what} {str(p)!r}: only {free} bytes free on its file system "
                         f"(at least {MIN_FREE_BYTES} wanted)")


def append_csv(rows: list[dict], path: str | os.PathLike) -> Path:
    """Append tidy rows to ``path`` (created with a header if absent; columns unioned), never
    losing a row already there (C25):

    - rows whose columns are the file's (the common case) are appended in place as one write,
      flushed and fsynced; a write that fails (a full disk) is truncated back so the file ends
      at its last complete row;
    - rows with a column the file lacks rewrite the file into a temporary sibling, fsynced, then
      renamed over it (:func:`os.replace`, atomic): if that fails the old file stays whole.

    Raises OSError naming the path and how many rows it holds. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(rows)
    if not rows:
        return path
    if path.exists() and path.stat().st_size > 0:
        with open(path, newline="") as f:
            header = f.readline().rstrip("\r\n").split(",")
        if set(df.columns) <= set(header) and header == list(dict.fromkeys(header)):
            text = df.reindex(columns=header).to_csv(index=False, header=False)
            _append_text(path, text)
            return path
        old = pd.read_csv(path)
        df = pd.concat([old, df], ignore_index=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with _signals_held():
        _replace_whole(df, tmp, path, len(rows))
    return path


def _replace_whole(df, tmp: Path, path: Path, n_rows: int) -> None:
    """Write ``df`` to ``tmp``, fsync, rename over ``path``; OSError names the path."""
    try:
        with open(tmp, "w", newline="") as f:
            df.to_csv(f, index=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"appending {n_rows} row(s) to {path} failed ({e.strerror or e}); "
                      f"the rows written before are intact in {path}") from e


def _signals_held():
    """SIGINT and SIGTERM held back (delivered when the block ends) while a row is written, so
    an interrupt never tears a row (a no-op outside the main thread, where Python delivers no
    signal handlers anyway)."""
    import contextlib
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def held():
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
    return held()


def _append_text(path: Path, text: str) -> None:
    """Append ``text`` (unbuffered, every byte or none), fsynced; on failure truncate back to
    the previous end and raise OSError naming the path."""
    with _signals_held():
        _append_bytes(path, text.encode())


def _append_bytes(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        end = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        except OSError as e:
            try:
                os.ftruncate(fd, end)
            except OSError:
                pass
            raise OSError(e.errno, f"appending a row to {path} failed ({e.strerror or e}); "
                          f"the rows written before are intact in {path}") from e
    finally:
        os.close(fd)
