"""The columns of a trial's tidy rows: one row per update (DESIGN.md "Results", docs/PERFORMANCE.md).

:func:`update_row` is the row of one completed update, from the controller's view of it (the
training ranks' :class:`weight_transfer.method.UpdateStats`, the engines' commit reports and the
inference ranks' verification results); :func:`phase_columns`, :func:`delta_mode_columns` and
:func:`delta_phase_columns` are its per-phase and per-delta-mode parts. Raw ``bytes`` and
``seconds`` are stored; everything else is derived from them or reported beside them.
"""
from __future__ import annotations

import json
import os
import time

PHASES = ("h2d", "prepare", "write", "release", "barrier", "commit", "publish")
"""The per-phase columns of a row (``phase_<name>_s``, docs/PERFORMANCE.md)."""


def update_row(cfg, *, run_id: str, env: dict, mcfg, step: int, seconds: float, write_seconds: float | None,
               results: dict, ver: dict, ok: bool | None, plan_s: float, recv_bytes: dict, bytes_staged: int,
               infer_active: bool) -> dict:
    """The tidy row of completed update ``step`` (``seconds``: go -> version published;
    ``write_seconds``: go -> the last write done, None when the controller did not see it):
    ``results`` are the ranks' completion reports (``{train rank: {"stats": UpdateStats}}``,
    ``{("commit", i): {"stats": dict}}``), ``ver`` the inference ranks' verification results
    and ``ok`` their verdict (None without verification). ``plan_s``: seconds the plan took;
    ``recv_bytes``: bytes per inference rank of the schedule (empty without one);
    ``bytes_staged``: bytes into staged targets; ``infer_active``: the inference side takes
    part in the update (the baselines)."""
    stats: list = [res["stats"] for r, res in results.items() if not isinstance(r, tuple)]
    row = _base_columns(cfg, run_id, env, mcfg, step, seconds, write_seconds, stats, ok, plan_s)
    row.update(phase_columns(stats, seconds, write_seconds, results, recv_bytes, bytes_staged, cfg.n_infer))
    row.update(delta_mode_columns(stats))  # writes and bytes per delta mode (cost model)
    for k, val in delta_phase_columns(stats).items():  # delta_<phase>_s the executor reports (slowest rank)
        row.setdefault(k, val)
    if cfg.run.delta_pairs or cfg.run.replay:  # which push of a pair, and which weights (docs/DELTA.md)
        row["pair_mode"] = cfg.run.push_mode(step) or ""
        row["source_step"] = cfg.run.source_step(step) + (cfg.run.replay_start - 1 if cfg.run.replay else 0)
    kinds = _prepare_kinds(stats)
    if kinds:  # the reference's prepare per tensor kind, summed over training ranks (issue 43)
        row["prepare_by_kind"] = kinds
    row.update(_engine_columns(cfg, row["bytes"], results, bytes_staged, infer_active))
    row.update(_check_columns(cfg, ver, ok))
    return row


def _base_columns(cfg, run_id: str, env: dict, mcfg, step: int, seconds: float, write_seconds: float | None,
                  stats: list, ok: bool | None, plan_s: float) -> dict:
    """The columns every completed update has: the run, the world, ``bytes`` / ``seconds`` and
    the training ranks' totals (bytes, writes, peak temporary bytes)."""
    return {
        "run_id": run_id, "git_sha": env["git_sha"], "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "host": env["host"], "method": cfg.run.method, "model": mcfg.label, "dtype": cfg.inference.quant or "bfloat16",
        "train_dtype": cfg.train.dtype, "n_train": cfg.train.n_train, "n_infer": cfg.n_infer,
        "layout": cfg.inference.describe(), "watermark": cfg.transfer.executor.watermark, "transport": cfg.transport,
        "device": cfg.run.device, "engine": cfg.run.engine, "step": step,
        "warmup": step <= cfg.run.warmup, "bytes": _update_bytes(stats), "seconds": seconds,
        # bytes actually written (less than ``bytes`` with --delta; equal without it)
        "delta_bytes": sum(s.bytes_sent for s in stats), "delta": _delta_mode(stats),
        "delta_shadow_bytes": sum(getattr(s, "delta_shadow_bytes", 0) for s in stats),
        "delta_compare_s": max((getattr(s, "delta_compare_s", 0.0) for s in stats), default=0.0),
        "verified": ok, "peak_temp_bytes": max(s.peak_temp_bytes for s in stats),
        "peak_alloc_bytes": max(s.peak_alloc_bytes for s in stats),
        "wire_bytes": sum(s.wire_bytes for s in stats),
        "n_writes": sum(s.n_writes for s in stats), "plan_seconds": plan_s,
        # bytes the training ranks copied outside the writes (reference: gathered sources +
        # outputs in buffers of their own; None for methods that do not say)
        "trainer_copy_bytes": (sum(s.gather_bytes + s.copy_bytes for s in stats)
                               if all(hasattr(s, "copy_bytes") for s in stats) else None),
        "write_seconds": write_seconds,
    }


def _engine_columns(cfg, update_bytes: int, results: dict, bytes_staged: int, infer_active: bool) -> dict:
    """How the bytes reached the engine: vLLM's path and targets, staged / direct bytes, and
    the engines' commits (seconds, packed delta records, seconds per staged layer)."""
    row: dict = {}
    if cfg.run.engine == "vllm":  # which path vLLM took: its targets and the ISA its workers were shown
        from weight_transfer.engines.vllm.extension import HIDE_AMX_ENV

        row["vllm_targets"] = cfg.run.vllm_targets if cfg.run.method == "reference" else "direct"
        # how the bytes reach vLLM: its weight-transfer API with the one_sided backend, or its reload path
        row["vllm_path"] = "one_sided" if not infer_active else "reload"
        row["vllm_hide_amx"] = os.environ.get(HIDE_AMX_ENV, "") in ("1", "true", "yes")
    if cfg.run.method == "reference":  # bytes into staged targets (post-processed by the engine at commit)
        row["bytes_staged"] = bytes_staged
        row["bytes_direct"] = update_bytes - bytes_staged
    commits = [res.get("stats") or {} for r, res in results.items() if isinstance(r, tuple) and r[0] == "commit"]
    if commits:
        row["commit_seconds"] = max(c.get("seconds", 0.0) for c in commits)
        if any("delta_records" in c for c in commits):  # packed records scattered at the commit
            row["delta_apply_s"] = max(c.get("delta_apply_s", 0.0) for c in commits)
            row["delta_records"] = sum(c.get("delta_records", 0) for c in commits)
            row["delta_packed_runs"] = sum(c.get("delta_runs", 0) for c in commits)
            row["delta_packed_bytes"] = sum(c.get("delta_bytes", 0) for c in commits)
        layers: dict[str, float] = {}  # the slowest worker's seconds per staged layer (issue 43)
        for c in commits:
            for m, t in (c.get("per_layer") or {}).items():
                layers[m] = max(layers.get(m, 0.0), t)
        if layers:
            row["commit_by_layer"] = json.dumps({m: round(t, 6) for m, t in layers.items()})
    return row


def _check_columns(cfg, ver: dict, ok: bool | None) -> dict:
    """What the verification found beyond ``verified``: the largest logprob difference from a
    fresh vLLM, the fractions of the engine's bytes each check covered, what failed, and the
    engines' stall through the update (a generation load, C27)."""
    row: dict = {}
    ulps = [v["logprob_ulps"] for v in ver.values() if v.get("logprob_ulps") is not None]
    if ulps:  # largest greedy-logprob difference from a fresh vLLM, in float32 ulps (0: bit-identical)
        row["logprob_ulps"] = max(ulps)
    covs = [v["coverage"] for v in ver.values() if v.get("coverage")]
    if covs:  # fractions of the engine's bytes each check covered (experiments/vllm_side.py)
        tot = sum(c["engine_bytes"] for c in covs) or 1
        for k in ("direct", "staged", "outputs_only"):
            row[f"check_{k}"] = sum(c[k] * c["engine_bytes"] for c in covs) / tot
    if cfg.run.verify and not ok:
        bad = {i: v for i, v in ver.items() if not v.get("ok")}
        row["verify_error"] = "; ".join(f"infer {i}: {v.get('mismatches')} gaps={v.get('gaps_written')} "
                                        f"guards={v.get('guards_written')}{_output_diff_text(v)}"
                                        for i, v in sorted(bad.items()))
    if cfg.serve.active:  # the engines' stall through this update (C27)
        from .serving import serve_columns

        row.update(serve_columns(ver))
    return row


def _update_bytes(stats) -> int:
    """The update's bytes: what a full update writes (the plan's, also with ``--delta``: then
    ``delta_bytes`` is what was written); the bytes that landed for methods that do not say."""
    return sum((getattr(s, "full_bytes", 0) or s.bytes_sent) if getattr(s, "delta", "") else s.bytes_sent
               for s in stats)


def _delta_mode(stats) -> str:
    """``""`` without ``--delta``; ``delta`` when every training rank wrote a delta; else the
    first rank's ``full: <why>``."""
    modes = [getattr(s, "delta", "") for s in stats]
    if not any(modes):
        return ""
    return next((m for m in modes if m != "delta"), "delta")


def _prepare_kinds(stats: list) -> str:
    """JSON ``{kind: [tasks, gather_s, build_s, gathered_bytes, built_bytes]}`` summed over the
    training ranks' task records (:func:`weight_transfer.pipeline.records.prepare_by_kind`); ``""`` for a
    method without task records (the baselines)."""
    from weight_transfer.pipeline.records import prepare_by_kind

    tot: dict[str, list] = {}
    for s in stats:
        for k, v in prepare_by_kind(getattr(s, "records", None) or []).items():
            t = tot.setdefault(k, [0, 0.0, 0.0, 0, 0])
            for i, x in enumerate(v):
                t[i] += x
    return json.dumps({k: [v[0], round(v[1], 6), round(v[2], 6), v[3], v[4]] for k, v in sorted(tot.items())}) if tot else ""


def phase_columns(stats: list, seconds: float, write_seconds: float | None, results: dict, recv_bytes: dict,
                  bytes_staged: int, n_infer: int) -> dict:
    """The report's per-phase and per-process columns of one update (seconds, bytes):

    - ``phase_{h2d,prepare,write,release}_s``: busy seconds of that executor stage (the union
      of its tasks' intervals; prepare = ``full_tensor()`` + fusion + cast/quantization), the
      largest over training ranks; ``phase_barrier_s``: seconds a rank waited at mesh-group
      barriers (largest over ranks). Stages overlap in the pipeline: they do not add up to
      ``seconds``. Methods without stages (the baselines) leave them 0.
    - ``phase_commit_s``: the slowest engine commit (staged targets; 0 without);
      ``phase_publish_s``: the rest of the update after the last write and the commit (the
      controller's completion checks and the version publish).
    - ``slowest_sender`` / ``slowest_sender_s`` / ``sender_gbps_min``: the training rank whose
      part took longest, its seconds, and the lowest per-sender GB/s (its bytes over its seconds).
    - ``slowest_receiver`` / ``receiver_gbps_min``: the inference rank receiving the most bytes
      (receivers are passive: their bytes land over the whole update) and its GB/s over the
      update's seconds (None without a schedule).
    - ``train_extra_bytes``: the largest peak of bytes allocated by tasks in flight on a training
      rank; ``infer_extra_bytes``: bytes an inference rank holds beyond the engine's own weights
      for the transfer (the staging of staged targets; 0 for in-place one-sided writes)."""
    busy = [s.stage_busy() for s in stats]
    out = {f"phase_{p}_s": max((b.get(p, 0.0) for b in busy), default=0.0) for p in ("h2d", "prepare", "write", "release")}
    out["phase_barrier_s"] = max((sum(br.waited[1] - br.waited[0] for br in getattr(s, "barriers", []) if br.waited)
                                  for s in stats), default=0.0)
    commits = [res.get("stats") or {} for r, res in results.items() if isinstance(r, tuple) and r[0] == "commit"]
    out["phase_commit_s"] = max((c.get("seconds", 0.0) for c in commits if isinstance(c, dict)), default=0.0)
    ws = write_seconds if write_seconds is not None else seconds
    out["phase_publish_s"] = max(0.0, seconds - ws - out["phase_commit_s"])
    slow = max(stats, key=lambda s: s.seconds)
    out["slowest_sender"], out["slowest_sender_s"] = slow.rank, slow.seconds
    out["sender_gbps_min"] = min((s.bytes_sent / s.seconds / 1e9 for s in stats if s.seconds > 0), default=None)
    if recv_bytes:
        i, b = max(recv_bytes.items(), key=lambda kv: (kv[1], -kv[0]))
        out["slowest_receiver"], out["receiver_gbps_min"] = i, b / seconds / 1e9 if seconds > 0 else None
    else:
        out["slowest_receiver"] = out["receiver_gbps_min"] = None
    out["train_extra_bytes"] = max(s.peak_alloc_bytes for s in stats)
    out["infer_extra_bytes"] = bytes_staged // max(1, n_infer)
    return out


def delta_mode_columns(stats: list) -> dict:
    """Per delta mode (``full``, ``scattered``, ``packed``, ``unchanged``: the cost model's choice
    per output and receiver, :attr:`weight_transfer.pipeline.records.StepStats.delta_modes`), summed over
    training ranks: ``delta_n_<mode>`` writes and ``delta_bytes_<mode>`` bytes written (a packed
    record's bytes for ``packed``). Empty without delta updates. The writes into a draft model's
    tensors (``draft.*``, ``--draft mtp``) are also counted on their own: ``delta_draft_n_<mode>``
    and ``delta_draft_bytes_<mode>`` (a frozen draft: all ``unchanged`` after the first update)."""
    out: dict = {}
    for s in stats:
        for m, kinds in (getattr(s, "delta_modes", None) or {}).items():
            for n, wrote, _size in kinds.values():
                out[f"delta_n_{m}"] = out.get(f"delta_n_{m}", 0) + n
                out[f"delta_bytes_{m}"] = out.get(f"delta_bytes_{m}", 0) + wrote
        for name, _kind, m, _size, wrote, _runs in getattr(s, "delta_tensors", None) or ():
            if name.startswith("draft."):
                out[f"delta_draft_n_{m}"] = out.get(f"delta_draft_n_{m}", 0) + 1
                out[f"delta_draft_bytes_{m}"] = out.get(f"delta_draft_bytes_{m}", 0) + wrote
    return out


def delta_phase_columns(stats: list) -> dict:
    """``delta_<phase>_s`` (seconds: the largest over training ranks) for every such attribute
    the ranks' stats carry (the executor's delta phases: ``delta_compare_s`` and, where the
    executor reports them, pack / wire / apply). Empty for stats without any (full-only methods)."""
    keys = set()
    for s in stats:
        names = list(getattr(s, "__dataclass_fields__", {})) + list(getattr(s, "__dict__", {}))
        keys |= {n for n in names if n.startswith("delta_") and n.endswith("_s")}
    return {k: max((float(getattr(s, k, 0.0) or 0.0) for s in stats), default=0.0) for k in sorted(keys)}


def _output_diff_text(v: dict) -> str:
    """`` outputs: prompt p token t: live (id, logprob) != fresh (id, logprob)`` for the first
    difference of each differing prompt of a vLLM verification result ('' when none)."""
    parts = []
    for d in v.get("output_diffs") or []:
        (lt, ll), (ft, fl) = d["live"], d["fresh"]
        t = next((j for j, (a, b, x, y) in enumerate(zip(lt, ft, ll, fl)) if a != b or x != y), min(len(lt), len(ft)))
        live = (lt[t], ll[t]) if t < len(lt) else None
        fresh = (ft[t], fl[t]) if t < len(ft) else None
        parts.append(f"prompt {d['prompt']} token {t}: live {live} != fresh {fresh}")
    return f" outputs: {'; '.join(parts)}" if parts else ""
