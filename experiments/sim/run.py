"""``weight-transfer simulate <config>``: synthesize metadata, run the real planner, run
the cost model for each method, print an nccl-tests style table, append rows to
results/simulated.csv (``simulated=True``).

Examples::

    weight-transfer simulate --list
    weight-transfer simulate kimi_k2_256xh100_to_128xh100_fp8
    weight-transfer simulate qwen3_235b_128_to_32 --no-csv
    weight-transfer simulate kimi_k2_256xh100_to_128xh100_fp8 --bench-planner   # time + peak RSS
"""
from __future__ import annotations

import gc
import json
import resource
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from weight_transfer.plan import build_recipes, gc_paused, plan
from weight_transfer.testing.catalog import load_config, param_specs, total_bytes

from ..paths import project_dir
from . import metadata, model
from .configs import CONFIGS, SimConfig, get_config
from .draft import draft_columns, draft_rows, draft_split, format_draft
from .shadow import ShadowSpec, format_shadow, shadow_rows

DEFAULT_CSV = project_dir() / "results" / "simulated.csv"


@dataclass
class SimRun:
    cfg: SimConfig
    results: list[model.SimResult]
    plan_summary: str = ""
    plan_seconds: float = 0.0
    plan_cpu_seconds: float = 0.0
    setup_seconds: float = 0.0
    sim_seconds: float = 0.0
    max_rss_bytes: int = 0
    extra: dict = field(default_factory=dict)


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children (``plan()`` may check in a forked
    child: :data:`weight_transfer.plan.checks.PARALLEL_CHECKS_MIN_RECORDS`)."""
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def build(cfg: SimConfig):
    """(model config, train metas, dest metas, recipes) for ``cfg``."""
    mcfg = load_config(cfg.model, **cfg.overrides)
    tm = metadata.train_metas(mcfg, cfg.train_nodes, cfg.hardware.gpus_per_node, layout=cfg.train_layout,
                              offloaded=cfg.offloaded, moe_width=cfg.moe_width, draft=cfg.layout.draft)
    if not mcfg.hand_written:  # recipes traced from vLLM's loader (C29); the destinations are what they write
        from weight_transfer.experiments.traced import recipes_for
        from weight_transfer.plan.recipes import expected_dests, make_dest_metas

        with gc_paused():
            rs, _ = recipes_for(mcfg, cfg.layout)
        flat = make_dest_metas(expected_dests(rs))
        dm = {r: [m for (rk, _), m in flat.items() if rk == r] for r in range(cfg.layout.world_size)}
        return mcfg, tm, dm, rs
    dm = metadata.dest_metas(mcfg, cfg.layout)
    with gc_paused():  # a planning process of its own (millions of small acyclic objects)
        rs = build_recipes(mcfg, cfg.layout)
    return mcfg, tm, dm, rs


def gantt_ranks(cfg: SimConfig) -> list[int]:
    """Training ranks drawn in the per-stage timeline: the first two GPUs of node 0, the
    first GPU of node 1 and the last rank."""
    g, n = cfg.hardware.gpus_per_node, cfg.n_train
    return sorted({0, min(1, n - 1), min(g, n - 1), n - 1})


def run(cfg: SimConfig, *, log=print, sensitivity: bool = False, delta: DeltaSpec | None = None,
        shadow: ShadowSpec | None = None) -> SimRun:
    """Everything ``simulate`` does except printing and CSV. ``sensitivity``: also re-run the
    cost model on the same schedule with every :data:`~weight_transfer.experiments.sim.hardware.SENSITIVITY`
    parameter and the watermark halved and doubled (``extra["sensitivity"]``: rows of
    parameter, factor, value, seconds). ``delta``: also predict delta updates on the same
    schedule (``extra["delta"]``: :func:`delta_rows`); the config must run ``reference``.
    ``shadow``: also the shadow targets' memory and stalls (``extra["shadow"]``:
    :func:`~weight_transfer.experiments.sim.shadow.shadow_rows`)."""
    t0 = time.perf_counter()
    mcfg = load_config(cfg.model, **cfg.overrides)
    out = SimRun(cfg, [])
    hw = cfg.hardware
    if "reference" in cfg.methods or any(m in cfg.methods for m in ("rank0_funnel", "nccl_broadcast_funnel", "rpc_update_weight",
                                                                    "sglang_pp_broadcast")):
        log(f"# synthesizing metadata: {cfg.n_train} training ranks, {cfg.n_infer} inference ranks ...")
        _, tm, dm, rs = build(cfg)
        split = draft_split(dm) if cfg.layout.draft else None  # the draft's and the scales' bytes
        first = model.first_metas(tm)
        out.setup_seconds = time.perf_counter() - t0
        recv_total = None
        if "reference" in cfg.methods:
            log(f"# planning {len(rs)} recipes ({'hand-written rules' if mcfg.hand_written else 'traced from vLLM loader'}) ...")
            gc.collect()
            c0, w0 = _cpu_seconds(), time.perf_counter()
            sched = plan(rs, tm, dm, max_chunk_bytes=cfg.max_chunk_bytes, local_writes=cfg.local_writes,
                         parallel_checks=None, pause_gc=True)
            out.plan_seconds, out.plan_cpu_seconds = time.perf_counter() - w0, _cpu_seconds() - c0
            out.plan_summary = sched.summary()
            recv_total = sched.total_bytes
            log(f"# simulating {sched.n_writes} writes ...")
            s0 = time.perf_counter()
            res = model.simulate(sched, first, hw, watermark=cfg.watermark, record=gantt_ranks(cfg))
            out.sim_seconds = time.perf_counter() - s0
            out.results.append(res)
            head = res
            if "overlapped_writes" in cfg.methods:
                log("# simulating the published executor's write semantics (writes of several tasks in flight) ...")
                head = model.simulate(sched, first, hw, watermark=cfg.watermark, record=gantt_ranks(cfg),
                                      method="overlapped_writes", writes_in_flight="watermark")
                out.results.append(head)
            if sensitivity:
                out.extra["sensitivity"] = sensitivity_rows(sched, first, cfg, head.seconds, log=log,
                                                            writes_in_flight=WIF[head.method])
            if delta is not None:
                out.extra["delta"] = delta_rows(sched, first, cfg, head, delta, log=log)
            if shadow is not None:
                out.extra["shadow"] = shadow_rows(cfg, head, dm, shadow)
            del sched
        tensors = model.baseline_tensors(first, hw)
        if recv_total is None:
            recv_total = sum(m.nbytes for ms in dm.values() for m in ms)
        for m, fn in (("rank0_funnel", model.rank0_funnel), ("nccl_broadcast_funnel", model.nccl_broadcast_funnel),
                      ("rpc_update_weight", model.rpc_update_weight)):
            if m in cfg.methods:
                out.results.append(fn(tensors, hw, cfg.n_infer, recv_total))
        if "sglang_pp_broadcast" in cfg.methods:
            out.results.append(model.sglang_pp_broadcast(first, hw, cfg.n_infer, recv_total))
        del tm, dm, rs, first
        if split is not None:  # the same config without the draft, predicted after this one's memory is freed
            out.extra["draft"] = draft_rows(cfg, split, out.results, rerun=run, log=log)
    if "ckpt_engine_broadcast" in cfg.methods:
        per_inst = [metadata.region_bytes(ms) for ms in
                    (__import__("weight_transfer.engines.engine", fromlist=["x"]).engine_tensor_metas(mcfg, cfg.layout, t)
                     for t in range(cfg.layout.tp))]
        n_tensors = len(param_specs(mcfg, cfg.layout.draft)) * (2 if cfg.layout.quant else 1)
        out.results.append(model.ckpt_engine_broadcast(sum(per_inst), n_tensors, cfg.n_infer, hw))
    out.max_rss_bytes = _maxrss()
    return out


WIF = {"reference": "task", "overlapped_writes": "watermark"}
"""method -> :func:`model.simulate`'s ``writes_in_flight``."""


@dataclass
class DeltaSpec:
    """What the delta mode predicts (``simulate --delta-...``): every scenario x granularity x
    per-WRITE cost, on the schedule of the full prediction."""

    scenarios: list
    """:class:`~weight_transfer.experiments.sim.delta.Fractions`, one per lr or uniform fraction."""
    granularities: tuple[str, ...] = ("rows",)
    merge_gaps: tuple[int, ...] = (4096,)
    """Bytes."""
    post_us: tuple[float, ...] = ()
    """Per-WRITE costs (us) to predict with besides the hardware's ``rdma_msg_us``."""
    costs_path: str | None = None
    """``--delta-costs``: the measured passes per byte (a CSV); also predict scattered and packed
    at 8-byte blocks with them (:mod:`~weight_transfer.experiments.sim.delta_costs`)."""

    @classmethod
    def from_options(cls, opts) -> DeltaSpec | None:
        """From :class:`~weight_transfer.experiments.sim.options.SimulateOptions` (or the parsed
        arguments: same names); None when no delta option is given."""
        from .delta import check_fractions_csv, load_fractions, uniform_fractions

        path, lrs, fr = getattr(opts, "delta_fractions", None), getattr(opts, "delta_lr", ()), getattr(opts, "delta_fraction", ())
        if not (path or fr):
            return None
        rows = check_fractions_csv(path) if path else None
        sc = [load_fractions(path, lr, rows) for lr in lrs or ()] + [uniform_fractions(f) for f in fr or ()]
        return cls(sc, tuple(getattr(opts, "delta_granularity", ("rows",))),
                   tuple(int(g) for g in getattr(opts, "delta_merge_gap", (4096,))),
                   tuple(getattr(opts, "delta_post_us", ()) or ()), getattr(opts, "delta_costs", None))


def delta_rows(sched, first, cfg: SimConfig, head: model.SimResult, spec: DeltaSpec, *, log=print) -> list[dict]:
    """The cost model re-run on ``sched`` as a delta update (:class:`~weight_transfer.experiments.sim.delta.DeltaModel`)
    for every scenario x granularity x merge gap x per-WRITE cost of ``spec``, with ``head``'s write
    semantics; one row each, beside ``head`` (the full prediction) and its floor."""
    from dataclasses import replace

    from .delta import DeltaModel

    out = []
    for fr in spec.scenarios:
        combos = [(g, gap, us, "scattered", None) for g in spec.granularities for gap in spec.merge_gaps
                  for us in (cfg.hardware.rdma_msg_us, *spec.post_us)]
        if spec.costs_path:  # the measured costs, at the executor's 8-byte blocks, scattered and packed
            from .delta_costs import load_costs

            lr_frac = fr.by_kind.get("all", {}).get("bf16_elems")
            for g, modes, fmt in (("block8", ("scattered", "packed"), "runs"), ("chunk64", ("masks",), "masks")):
                costs = load_costs(spec.costs_path, lr_frac, fmt)  # the row of this format nearest this step's density
                combos += [(g, 0, us, m, costs) for m in modes for us in (cfg.hardware.rdma_msg_us, *spec.post_us)
                           if costs is not None]
        for g, gap, us, mode, costs in combos:
            hw = replace(cfg.hardware, rdma_msg_us=us)
            dm = DeltaModel(fr, hw, granularity=g, merge_gap=gap, mode=mode, costs=costs)
            res = model.simulate(sched, first, hw, watermark=cfg.watermark, writes_in_flight=WIF[head.method],
                                 method=f"{head.method}+delta", delta=dm)
            x = res.extra
            log(f"# delta {fr.label}, {g}, gap {gap} B, {us:g} us per WRITE, {mode}{' (measured costs)' if costs else ''}: "
                f"{res.seconds:.3f} s, {x['wire_bytes'] / 1e9:.3f} GB, {x['ops']:.4g} ops")
            fb = "" if fr.source == "uniform" else "; ".join(f"{a} <- {b}" for a, b in sorted(fr.used_fallbacks))
            out.append({"config": cfg.name, "method": res.method, "fractions": fr.label, "source": fr.source,
                        "granularity": g, "merge_gap": gap, "rdma_msg_us": us, "seconds": res.seconds,
                        "floor_seconds": res.floor_seconds, "full_seconds": head.seconds,
                        "full_floor_seconds": head.floor_seconds, "wire_bytes": x["wire_bytes"],
                        "full_bytes": x["full_bytes"], "wire_fraction": x["wire_bytes"] / x["full_bytes"],
                        "ops": x["ops"], "full_writes": x["full_writes"], "max_sender_ops": x["max_sender_ops"],
                        "max_sender_bytes": x["max_sender_bytes"], "max_receiver_bytes": x["max_receiver_bytes"],
                        "shadow_bytes_max": x["shadow_bytes_max"], "busy_prepare_seconds": res.stage_busy["prepare"],
                        "busy_write_seconds": res.stage_busy["write"], "fallbacks": fb,
                        "mode": mode, "costs": costs.source if costs else "",
                        "compare_passes": costs.compare if costs else None, "pack_passes": costs.pack if costs else None,
                        "apply_passes": costs.apply if costs else None, "apply_seconds": x.get("apply_seconds_max", 0.0),
                        **{f"all_{k}": fr.by_kind.get("all", {}).get(k) for k in ("bf16_elems", "fp8_elems", "fp8_rows",
                                                                                 "fp8_blocks")}})
    return out


def format_delta(sr: SimRun) -> str:
    """The delta mode's table (:func:`delta_rows`), its assumptions and fallbacks."""
    from .delta import assumptions

    rows = sr.extra.get("delta") or []
    if not rows:
        return ""
    r0 = rows[0]
    L = [f"# delta mode (SIMULATED; {r0['method']}: the full prediction's schedule and write semantics): full update "
         f"{r0['full_seconds']:.3f} s, full-model floor {r0['full_floor_seconds']:.3f} s",
         f"{'fractions':>42} {'gran':>6} {'gap':>5} {'us/':>5} {'mode':>10} {'wire':>9} {'of':>7} {'ops':>10} {'ops per':>9} "
         f"{'recv':>7} {'prepare':>8} {'apply':>7} {'time':>7} {'time/':>6} {'time/':>6}",
         f"{'':>42} {'':>6} {'(B)':>5} {'WRITE':>5} {'':>10} {'(GB)':>9} {'full':>7} {'(all)':>10} {'sender':>9} {'(GB)':>7} "
         f"{'(s)':>8} {'(s)':>7} {'(s)':>7} {'full':>6} {'floor':>6}"]
    for r in rows:
        mode = r.get("mode", "scattered") + ("*" if r.get("costs") else "")
        L.append(f"{r['fractions']:>42} {r['granularity']:>6} {r['merge_gap']:>5} {r['rdma_msg_us']:>5g} {mode:>10} "
                 f"{r['wire_bytes'] / 1e9:>9.3f} "
                 f"{r['wire_fraction']:>7.2%} {r['ops']:>10.3g} {r['max_sender_ops']:>9.3g} "
                 f"{r['max_receiver_bytes'] / 1e9:>7.2f} {r['busy_prepare_seconds']:>8.3f} {r.get('apply_seconds', 0.0):>7.3f} "
                 f"{r['seconds']:>7.3f} {r['seconds'] / r['full_seconds']:>6.2f} {r['seconds'] / r['full_floor_seconds']:>6.2f}")
    L.append(f"# (full update: {r0['full_bytes'] / 1e9:.1f} GB in {r0['full_writes']} writes; wire = runs' payload + "
             "headers; ops = RDMA WRITEs, one per run; recv = busiest inference GPU; prepare = busiest rank's prepare "
             "stage, the compare included; time/floor against the full-model floor)")
    L.append(f"# trainer memory: shadow of the largest rank {r0['shadow_bytes_max'] / 1e9:.2f} GB (one byte per distinct "
             "output byte it writes)")
    seen = set()
    for r in rows:
        if r["fractions"] in seen:
            continue
        seen.add(r["fractions"])
        vals = ", ".join(f"{k} {r[f'all_{k}']:.3%}" for k in ("bf16_elems", "fp8_elems", "fp8_rows", "fp8_blocks")
                         if r.get(f"all_{k}") is not None)
        L.append(f"# fractions {r['fractions']} ({r['source']}): all kinds {vals}"
                 + (f"; stand-ins: {r['fallbacks']}" if r["fallbacks"] else ""))
    L += [f"# assumption: {a}" for a in assumptions()]
    if any(r.get("costs") for r in rows):
        from .delta import packed_assumptions
        from .delta_costs import DeltaCosts

        L.append("# *: with the measured costs (--delta-costs); apply = the busiest receiver's commit scatter")
        for src in sorted({r["costs"] for r in rows if r.get("costs")}):
            r = next(x for x in rows if x.get("costs") == src)
            L += [f"# measured: {a}" for a in packed_assumptions(DeltaCosts(r["compare_passes"], r["pack_passes"],
                                                                            r["apply_passes"], src))]
    return "\n".join(L)


def sensitivity_rows(sched, first, cfg: SimConfig, base: float, *, factors=(0.5, 2.0), log=print,
                     writes_in_flight: str = "task") -> list[dict]:
    """The cost model re-run on ``sched`` with each assumption scaled (see :func:`run`), for
    the headline method (``overlapped_writes`` where the config has it, else ``reference``)."""
    from .hardware import SENSITIVITY

    rows = []
    for p in (*SENSITIVITY, "watermark"):
        for f in factors:
            if p == "watermark":
                hw, wm, val = cfg.hardware, None if cfg.watermark is None else int(cfg.watermark * f), cfg.watermark
            else:
                hw, wm, val = cfg.hardware.scaled(p, f), cfg.watermark, getattr(cfg.hardware, p)
            sec = model.simulate(sched, first, hw, watermark=wm, writes_in_flight=writes_in_flight).seconds
            log(f"# sensitivity {p} x{f:g}: {sec:.3f} s")
            rows.append({"config": cfg.name, "writes_in_flight": writes_in_flight, "parameter": p, "value": val, "factor": f, "seconds": sec,
                         "base_seconds": base, "change": sec / base - 1})
    return rows


def format_sensitivity(sr: SimRun) -> str:
    rows = sr.extra.get("sensitivity") or []
    if not rows:
        return ""
    L = [f"# sensitivity of the prediction ({sr.cfg.name}, writes in flight per rank: {rows[0].get('writes_in_flight', 'task')}; "
         f"base {rows[0]['base_seconds']:.3f} s; "
         "same schedule, one parameter scaled at a time):",
         f"{'parameter':>20} {'value':>12} {'x0.5 (s)':>10} {'change':>8} {'x2 (s)':>10} {'change':>8}"]
    by = {}
    for r in rows:
        by.setdefault(r["parameter"], {})[r["factor"]] = r
    for p, d in by.items():
        lo, hi = d.get(0.5), d.get(2.0)
        v = lo["value"] if lo else hi["value"]
        vs = f"{v / 2**30:g} GiB" if p == "watermark" and v else f"{v:g}"
        L.append(f"{p:>20} {vs:>12} {lo['seconds']:>10.3f} {lo['change']:>+8.1%} {hi['seconds']:>10.3f} {hi['change']:>+8.1%}")
    return "\n".join(L)


def byte_table(sr: SimRun) -> str:
    """Per-GPU bytes (min / median / max, GB) of the reference's schedule."""
    ref = next((r for r in sr.results if r.method == "reference"), None)
    if ref is None or not ref.rank_bytes:
        return ""
    L = ["# per-GPU bytes of the reference's schedule (GB = 1e9 B; min / median / max over ranks):",
         f"{'':>36} {'min':>9} {'median':>9} {'max':>9}"]
    for k, what in (("infer_recv", "inference GPU receives (RDMA WRITE)"), ("train_send", "training GPU sends (RDMA WRITE)"),
                    ("train_fabric", "training GPU all-gather over fabric")):
        lo, med, hi = model.spread(ref.rank_bytes.get(k, {}).values())
        L.append(f"{what:>36} {lo / 1e9:>9.2f} {med / 1e9:>9.2f} {hi / 1e9:>9.2f}")
    return "\n".join(L)


def gantt_rows(sr: SimRun) -> list[dict]:
    """The recorded stage runs (:func:`gantt_ranks`) of ``reference`` and ``overlapped_writes``,
    one row each, with the method."""
    return [{"config": sr.cfg.name, "method": res.method, "rank": r, "task": t, "group": res.groups.get(t), "stage": st,
             "start": a, "end": b}
            for res in sr.results if res.method in WIF for r, t, st, a, b in res.events]


# ------------------------------------------------------------------------------ output


def format_table(sr: SimRun) -> str:
    cfg, hw = sr.cfg, sr.cfg.hardware
    mcfg = load_config(cfg.model, **cfg.overrides)
    L = [
        f"# at-scale simulation: {cfg.name}   (SIMULATED: cost model of docs/SIMULATION.md, not a measurement)",
        f"# model: {mcfg.label} ({mcfg.architecture}; {total_bytes(mcfg, cfg.layout.draft) / 1e9:.1f} GB in bf16; source {mcfg.source})",
        f"# label: {cfg.label or '-'}  [{cfg.calibration}]",
        f"# training: {cfg.n_train} GPUs = {cfg.train_nodes} nodes x {hw.gpus_per_node}, FSDP2 layout {cfg.train_layout_text}"
        f"{', offloaded to host' if cfg.offloaded else ''}; prepare: "
        f"{'shard-local where possible' if cfg.local_writes else 'full_tensor() of every source (gather-all)'}",
        f"# inference: {cfg.n_infer} GPUs, {cfg.layout.describe()} ({cfg.layout.dp} instance(s) x {cfg.layout.tp} GPUs)",
        f"# hardware: {hw.name}; NIC {hw.nic_gbps:g} Gb/s achieved ({hw.nic_line_gbps:g} line), PCIe {hw.pcie_gbs:g} GB/s, "
        f"NVLink {hw.nvlink_gbs:g} GB/s achieved ({hw.nvlink_line_gbs:g} line), HBM {hw.hbm_gbs:g} GB/s; watermark "
        f"{'none' if cfg.watermark is None else f'{cfg.watermark / 2**30:g} GiB'}",
    ]
    if sr.plan_summary:
        L.append(f"# plan: {sr.plan_summary}")
        L.append(f"# planner: {sr.plan_seconds:.1f} s wall, {sr.plan_cpu_seconds:.1f} s CPU; metadata {sr.setup_seconds:.1f} s; "
                 f"cost model {sr.sim_seconds:.1f} s; peak RSS of this process {sr.max_rss_bytes / 2**30:.2f} GiB")
    L += ["#",
          f"{'method':>22} {'bytes':>10} {'time':>9} {'floor':>9} {'pred/':>6} {'bound':>7} {'published':>10} {'pred/':>6}",
          f"{'':>22} {'(GB)':>10} {'(s)':>9} {'(s)':>9} {'floor':>6} {'':>7} {'(s)':>10} {'publ.':>6}"]
    for r in sr.results:
        pub = cfg.anchor(r.method)
        bound = max(r.floors, key=r.floors.get) if r.floors else "-"
        ps = f"{pub[0]:>10.1f} {r.seconds / pub[0]:>6.2f}" if pub else f"{'-':>10} {'-':>6}"
        L.append(f"{r.method:>22} {r.bytes / 1e9:>10.1f} {r.seconds:>9.3f} {r.floor_seconds:>9.3f} "
                 f"{r.seconds / r.floor_seconds if r.floor_seconds else float('nan'):>6.2f} {bound:>7} {ps}")
    L.append("#")
    L.append("# per-stage busy time (s; busiest rank for the reference, sums over tensors for baselines):")
    for r in sr.results:
        L.append(f"#   {r.method:>22}: " + "  ".join(f"{k} {v:.3f}" for k, v in r.stage_busy.items()))
    L.append("# floors (s; busiest link's bytes / line rate): " + "; ".join(
        f"{r.method}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.floors.items()) for r in sr.results))
    for r in sr.results:
        if r.method in WIF:
            L.append(f"# {r.method}: {r.n_writes} writes, peak temporary {r.peak_temp_bytes / 2**30:.2f} GiB per rank")
    for m, (sec, src) in cfg.anchors.items():
        L.append(f"# published {m}: {sec} s -- {src}")
    bt = byte_table(sr)
    if bt:
        L.append(bt)
    L.append("# correctness: not applicable (simulated); the planner's schedule is validated (every destination byte once)")
    st = format_sensitivity(sr)
    if st:
        L.append(st)
    dt = format_delta(sr)
    if dt:
        L.append(dt)
    for key, fmt in (("shadow", format_shadow), ("draft", format_draft)):
        if sr.extra.get(key):
            L.append(fmt(sr.extra[key]))
    return "\n".join(L)


def rows(sr: SimRun) -> list[dict]:
    """Tidy rows, docs/PERFORMANCE.md columns plus the simulation's."""
    from weight_transfer.experiments.env import git_sha

    cfg = sr.cfg
    mcfg = load_config(cfg.model, **cfg.overrides)
    run_id = uuid.uuid4().hex[:12]
    out = []
    for r in sr.results:
        row = {"run_id": run_id, "git_sha": git_sha(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "host": "simulated",
               "method": r.method, "model": mcfg.label, "dtype": cfg.layout.quant or cfg.layout.dtype,
               "train_dtype": "bfloat16", "n_train": cfg.n_train, "n_infer": cfg.n_infer, "layout": cfg.layout.describe(),
               "watermark": cfg.watermark, "transport": "sim", "step": 1, "warmup": False, "bytes": r.bytes,
               "seconds": r.seconds, "verified": None, "peak_temp_bytes": r.peak_temp_bytes or None,
               "n_writes": r.n_writes, "plan_seconds": sr.plan_seconds if r.method == "reference" else None,
               "simulated": True, "config": cfg.name, "train_layout": cfg.train_layout, "offloaded": cfg.offloaded,
               "hardware": cfg.hardware.name, "floor_seconds": r.floor_seconds,
               "published_seconds": (cfg.anchor(r.method) or (None,))[0], "label": cfg.label,
               "calibration": cfg.calibration, "moe_width": (cfg.moe_width or cfg.train_nodes) if cfg.train_layout == "two_group" else None,
               "local_writes": cfg.local_writes}
        for k, col in (("infer_recv", "recv"), ("train_send", "send"), ("train_fabric", "fabric")):
            if r.rank_bytes.get(k):
                row[f"{col}_min_bytes"], row[f"{col}_median_bytes"], row[f"{col}_max_bytes"] = model.spread(r.rank_bytes[k].values())
        for k in ("nic", "pcie", "nvlink"):
            row[f"floor_{k}_seconds"] = r.floors.get(k)
        for k, v in r.stage_busy.items():
            row[f"busy_{k}_seconds"] = v
        out.append({**row, **draft_columns(sr.extra.get("draft"), r.method)})
    return out


_CHECKS = {"auto": None, "forked": True, "in-process": False}
"""``--checks`` -> ``plan(parallel_checks=...)``"""


def bench_planner(name: str, *, received: bool = False, checks: str = "auto", without: int = 0) -> dict:
    """Plan ``name`` in a fresh subprocess (so the first-call cost -- fresh memory pages --
    is counted, as in a controller that plans once); wall / CPU seconds of ``plan()`` alone,
    the subprocess's peak RSS (metadata included) and the part added while planning, and the
    peak RSS of the checks' child process if ``plan()`` forked one (it counts the pages it
    shares copy-on-write with the planner too, so the sum of the two overstates the total).
    CPU seconds include the child's. ``checks``: ``"auto"``, ``"forked"`` or ``"in-process"``
    (``plan(parallel_checks=None / True / False)``), to compare the two on the same day.

    ``received=True`` first passes every rank's list through :mod:`weight_transfer.control.wire`, as
    :func:`weight_transfer.control.protocol.put` / ``get`` deliver it to the controller: each rank then holds
    its own copies of shapes and meshes, which the consistency checks compare by value.

    ``without=N``: the replan after a membership change (C24): the last ``N`` inference ranks
    left, so the recipes are restricted to the others (:func:`weight_transfer.api.only_ranks`,
    timed with ``plan()``) and planned for that membership only."""
    code = (
        "import gc, json, resource, time\nfrom weight_transfer.control import wire\n"
        "from weight_transfer.experiments.sim.configs import get_config\n"
        "from weight_transfer.experiments.sim.run import _cpu_seconds, build\n"
        "from weight_transfer.plan import plan\n"
        f"cfg = get_config({name!r})\n"
        "mcfg, tm, dm, rs = build(cfg)\n"
        f"if {received!r}:\n"
        "    tm = {r: wire.decode(wire.encode(ms), f'meta/train/{r}') for r, ms in tm.items()}\n"
        "gc.collect()\n"
        "rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "c0, w0 = _cpu_seconds(), time.perf_counter()\n"
        f"if {without!r}:\n"
        "    from weight_transfer.api import only_ranks\n"
        f"    keep = set(sorted(dm)[:len(dm) - {without!r}])\n"
        "    rs, dm = only_ranks(rs, keep), {k: v for k, v in dm.items() if k in keep}\n"
        f"s = plan(rs, tm, dm, max_chunk_bytes=cfg.max_chunk_bytes, parallel_checks={_CHECKS[checks]!r}, pause_gc=True)\n"
        "w, c = time.perf_counter() - w0, _cpu_seconds() - c0\n"
        "rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024\n"
        "rss_child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(json.dumps(dict(wall_s=w, cpu_s=c, rss_before=rss0, rss_peak=rss1, rss_child=rss_child, n_writes=s.n_writes,"
        " n_tasks=s.n_tasks, n_sources=len({m.name for ms in tm.values() for m in ms}), recipes=len(rs))))\n")
    root = project_dir()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    if p.returncode:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def format_bench(name: str, runs: list[dict], *, received: bool = False, checks: str = "auto") -> str:
    """The planner benchmark's lines: sizes, then min / median / max over the runs (each a
    fresh subprocess; this project's VMs are shared and the same run varies by +-30%)."""
    b = runs[0]
    wall = sorted(r["wall_s"] for r in runs)
    cpu = sorted(r["cpu_s"] for r in runs)
    peak = max(r["rss_peak"] for r in runs)
    before = max(r["rss_before"] for r in runs)
    child = max(r.get("rss_child", 0) for r in runs)
    forked = (f"; checks' child process {child / 2**30:.2f} GiB, sum {(peak + child) / 2**30:.2f} GiB "
              f"(an upper bound: the child shares the planner's pages copy-on-write)") if child else ""
    how = "metadata encoded per rank, as the controller receives it" if received else "synthesized metadata"
    return "\n".join([
        f"# planner benchmark ({name}: training layout {get_config(name).train_layout}, {how}, checks {checks}; "
        f"{len(runs)} fresh subprocess(es)): {b['n_sources']} source tensors, "
        f"{b['recipes']} recipes, {b['n_tasks']} tasks, {b['n_writes']} writes",
        f"# plan() wall s: min {wall[0]:.2f}, median {statistics.median(wall):.2f}, max {wall[-1]:.2f}; "
        f"CPU s (checks' child included): min {cpu[0]:.2f}, median {statistics.median(cpu):.2f}, max {cpu[-1]:.2f}",
        f"# peak RSS {peak / 2**30:.2f} GiB (metadata alone {before / 2**30:.2f} GiB, planning added "
        f"{(peak - before) / 2**30:.2f} GiB){forked}",
    ])


def main(args) -> int:
    """``weight-transfer simulate`` (``--map`` is :func:`weight_transfer.experiments.sim.layout_map.main`,
    which uses this module: the dispatch is in the command, so neither imports the other both ways)."""
    if args.list or not args.config:
        print("# simulation configs (weight-transfer simulate <name>):")
        for n, f in CONFIGS.items():
            print(f"  {n:<48} {(f.__doc__ or '').strip().splitlines()[0]}")
        return 0
    try:
        cfg = get_config(args.config)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.bench_planner and (getattr(args, "layers", None) or getattr(args, "moe_width", None)):
        print("error: --layers / --moe-width with --bench-planner are not supported (the benchmark plans named configs)",
              file=sys.stderr)
        return 2
    if getattr(args, "layers", None):
        from dataclasses import replace

        # a published time is for the whole model: a truncated one is compared with nothing
        cfg = replace(cfg, name=f"{cfg.name}_L{args.layers}", overrides={**cfg.overrides, "num_hidden_layers": args.layers},
                      label=f"{cfg.label} [truncated to {args.layers} layers; no published anchor]", anchors={})
    if getattr(args, "moe_width", None):
        from dataclasses import replace

        cfg = replace(cfg, name=f"{cfg.name}_w{args.moe_width}", moe_width=args.moe_width,
                      label=f"{cfg.label} [MoE width overridden: {args.moe_width}]")
    if getattr(args, "gather_all", False):
        from dataclasses import replace

        cfg = replace(cfg, name=f"{cfg.name}_gather_all", local_writes=False,
                      label=f"{cfg.label} [full_tensor() of every source, as the published executor]")
    if args.bench_planner:
        without = getattr(args, "replan_without", 0) or 0
        runs = [bench_planner(cfg.name, received=args.received, checks=args.checks, without=without)
                for _ in range(max(1, args.repeat))]
        print(format_bench(cfg.name, runs, received=args.received, checks=args.checks))
        if without:
            print(f"# (a replan: {without} inference rank(s) left, the schedule recomputed for the others only, C24)")
        return 0
    try:
        delta = DeltaSpec.from_options(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if delta is not None and "reference" not in cfg.methods:
        print(f"error: delta mode: config {cfg.name} runs no reference schedule (methods: {', '.join(cfg.methods)})",
              file=sys.stderr)
        return 2
    try:
        shadow = ShadowSpec.from_options(args)
        if shadow is not None:
            shadow.check(cfg)  # refused before any planning
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not load_config(cfg.model, **cfg.overrides).hand_written:  # traced recipes (C29): refused now, one line
        from weight_transfer.experiments.traced import recipes_for
        from weight_transfer.types import PlanError

        try:
            recipes_for(load_config(cfg.model, **cfg.overrides), cfg.layout)
        except (PlanError, ValueError, RuntimeError) as e:
            print(f"error: simulation config {cfg.name}: {str(e).splitlines()[0]}", file=sys.stderr)
            return 2
    sr = run(cfg, log=lambda m: print(m, file=sys.stderr, flush=True), sensitivity=getattr(args, "sensitivity", False),
             delta=delta, shadow=shadow)
    print(format_table(sr))
    if not args.no_csv:
        import pandas as pd

        from weight_transfer.experiments.report import append_csv

        path = append_csv(rows(sr), args.csv)
        print(f"# rows appended to {path} (simulated=True)")
        out_dir = Path(args.csv).resolve().parent
        g = gantt_rows(sr)
        if g:
            p = out_dir / f"sim_{cfg.name}_gantt.csv.gz"  # gzip (pandas, from the suffix): 10x smaller
            pd.DataFrame(g).to_csv(p, index=False)
            print(f"# per-stage timeline of ranks {gantt_ranks(cfg)} written to {p}")
        for key in ("sensitivity", "delta", "shadow", "draft"):
            if sr.extra.get(key):
                p = out_dir / f"sim_{cfg.name}_{key}.csv"
                pd.DataFrame(sr.extra[key]).to_csv(p, index=False)
                print(f"# {key} table written to {p}")
    return 0
