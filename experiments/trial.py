"""One trial, launched locally: controller in this process, every rank its own OS process.

Flow (DESIGN.md "control plane"): start the TCPStore, spawn ``n_train`` training ranks and
``n_infer`` inference ranks, collect their metadata, build the recipes and the static schedule
once, hand each training rank its part, then per update: "load" (the optimizer-step stand-in),
"go", wait for every completion, publish the version, wait for every inference rank's
verification. One tidy row per update.

Failures (docs/FAULTS.md): the controller names the first failed process ("training 1: ...",
"inference 0: ...") as soon as it reports an error, dies or stops beating, publishes the
weights as incomplete, and every rank process is ended (SIGTERM, then SIGKILL) before the
error propagates; locally launched ranks also die with the controller (``PR_SET_PDEATHSIG``)
and leave on their own when its heartbeat stops. ``run_trial(..., restarts=n)`` restarts the
training world after a training-side failure instead, and the run goes on.
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field

from weight_transfer import control
from weight_transfer.method import ControllerContext, UpdateStats

from .config import TrialConfig
from .env import environment, git_sha, measure_memcpy_gbps  # noqa: F401  (git_sha: re-exported)
from .methods import get_method
from .worker import inference_main, trainer_main


@dataclass
class TrialResult:
    cfg: TrialConfig
    rows: list[dict]
    schedule_summary: str
    plan_seconds: float
    memcpy_gbps: float | None = None
    env: dict = field(default_factory=dict)


class _Procs:
    def __init__(self):
        self.train: dict[int, mp.Process] = {}
        self.infer: dict[int, mp.Process] = {}

    @staticmethod
    def _dead(ps: dict[int, mp.Process]) -> dict[int, str]:
        out = {}
        for r, p in ps.items():
            code = p.exitcode
            if code is not None and code != 0:
                sig = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
                out[r] = f"process {p.pid} exited with code {code}{sig}"
        return out

    def dead_train(self):
        return self._dead(self.train)

    def dead_infer(self):
        return self._dead(self.infer)

    def all(self):
        return list(self.train.values()) + list(self.infer.values())

    def groups(self) -> list[int]:
        """Process groups led by inference processes (vLLM instances, :func:`weight_transfer.experiments.vllm_side.own_process_group`)."""
        return [p.pid for p in self.infer.values() if p.name.startswith("vllm") and p.pid is not None]



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

def stop_processes(ps, grace: float = 0.5, groups=()) -> None:
    """End every process of ``ps`` and reap it: SIGTERM, ``grace`` seconds, then SIGKILL (a
    stopped process keeps SIGTERM pending; SIGKILL ends it). Returns once none is left; then
    every process group of ``groups`` (the pids of processes that lead one: vLLM instances and
    the EngineCore / workers they started) is SIGKILLed, so an instance killed before it could
    end its children leaves none behind."""
    ps = [p for p in ps if p.pid is not None]
    try:
        _stop(ps, grace)
    finally:
        from .vllm_side import kill_group

        for g in groups:
            if g is not None:
                kill_group(g)


def _stop(ps, grace: float) -> None:
    for p in ps:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in ps:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in ps:
        if p.is_alive():
            p.kill()
            p.join(10)


def preflight(cfg: TrialConfig) -> None:
    """Refuse a world that cannot work before any process starts: the model config loads, the
    method exists, and the inference layout divides every tensor (the recipes and the engine's
    own layout are both built, without allocating weights). Raises ValueError / PlanError with
    a one-line cause naming the tensor and sizes."""
    from weight_transfer.engines.engine import engine_tensor_metas
    from weight_transfer.plan import build_recipes

    cfg.preflight(local=True)  # transport importable, trace dir writable, process count (C18)
    mcfg = cfg.model_config()
    get_method(cfg.run.method)
    if not mcfg.hand_written:  # planned from the recipes traced from vLLM's loader (C29)
        if cfg.inference.quant is not None:
            raise ValueError(f"model {mcfg.label}: --quant {cfg.inference.quant} with architecture "
                             f"{mcfg.architecture!r}: recipes traced from vLLM's loader are the BF16 load layout "
                             "(--quant none)")
        if cfg.run.engine != "vllm":  # the stand-in's tensors and oracle come from vLLM's loader: trace it now, once
            from weight_transfer.experiments.traced import recipes_for, trace_cache_dir

            if cfg.run.method != "reference":
                raise ValueError(f"model {mcfg.label}: --method {cfg.run.method} with the stand-in engine: architecture "
                                 f"{mcfg.architecture!r} has no stand-in load_weights (its baselines need vLLM's own "
                                 "loader: --engine vllm)")
            import sys

            print(f"# {mcfg.architecture}: tracing vLLM's loader (cached in {trace_cache_dir()}); each update is "
                  "verified against vLLM's own load_weights in a child process (about 10 s per rank)",
                  file=sys.stderr, flush=True)
            recipes_for(mcfg, cfg.inference)  # PlanError naming what vLLM's loader computes; cached for the ranks
            for rank in range(min(cfg.n_infer, cfg.inference.tp)):
                engine_tensor_metas(mcfg, cfg.inference, rank)
    else:
        build_recipes(mcfg, cfg.inference)
        for rank in range(min(cfg.n_infer, cfg.inference.tp)):
            engine_tensor_metas(mcfg, cfg.inference, rank)
    if cfg.run.engine == "vllm":
        from weight_transfer.engines.vllm import vllm_available

        if not vllm_available():
            raise ValueError("engine=vllm: vllm is not installed (make vllm)")


def run_trial(cfg: TrialConfig, *, progress=None, fault=None, stall: float | None = None, restarts: int = 0,
              probe: dict | None = None) -> TrialResult:
    """Run one trial locally; raises PlanError / ControlError with a one-line cause first.

    = :func:`preflight`, then spawn every rank as a local OS process + :func:`run_controller`
    in this process. The ranks die with this process (``PR_SET_PDEATHSIG``); on any error they
    are all ended (SIGTERM, then SIGKILL) before it propagates, so nothing is left behind.

    ``stall``: seconds without a heartbeat before a rank (or, seen from the ranks, the
    controller) is declared stopped (default ``cfg.timeout``). ``restarts``: times the training
    world may be restarted after an update failed on the training side (the inference ranks
    keep their memory; the next update must restore a complete version). ``fault``
    (:class:`weight_transfer.experiments.inject.Fault`) is injected; ``probe`` (a dict) receives what happened
    at the first failure (``error``, ``t_error``, ``fired``, ``state_after_fault``)."""
    preflight(cfg)
    if fault is not None:
        fault.check(cfg)
    stall = cfg.transfer.control.timeout if stall is None else stall
    env = environment()
    memcpy = measure_memcpy_gbps()
    store = control.make_store("127.0.0.1", 0, is_master=True, timeout=cfg.transfer.control.timeout)
    addr = ("127.0.0.1", store.port)
    ctx = mp.get_context("spawn")
    procs = _Procs()
    parent = os.getpid()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    def spawn_training(gen: int, first_step: int) -> None:
        for r in range(cfg.train.n_train):
            kw = dict(gen=gen, first_step=first_step, stall=stall, fault=fault if gen == 0 else None, parent=parent)
            procs.train[r] = ctx.Process(target=trainer_main, args=(cfg, r, addr), kwargs=kw,
                                         name=f"train{r}" + (f".{gen}" if gen else ""), daemon=True)
            procs.train[r].start()

    def restart_training(gen: int, first_step: int) -> None:
        stop_processes(procs.train.values())
        spawn_training(gen, first_step)

    if cfg.run.engine == "vllm":  # one process per vLLM instance; vLLM starts its own children (not a daemon)
        from .vllm_side import vllm_instance_main

        for d in range(cfg.inference.dp):
            procs.infer[d * cfg.inference.tp] = ctx.Process(target=vllm_instance_main, args=(cfg, d, addr),
                                                   kwargs=dict(parent=parent), name=f"vllm{d}")
    else:
        for i in range(fleet_initial_ranks(cfg)):
            procs.infer[i] = ctx.Process(target=inference_main, args=(cfg, i, addr),
                                         kwargs=dict(stall=stall, fault=fault, parent=parent), name=f"infer{i}",
                                         daemon=True)
    spawn_training(0, 1)
    for p in procs.infer.values():
        p.start()
    fleet = _fleet_procs(cfg, procs, ctx, addr, store, stall, parent) if cfg.fleet.active else None
    try:
        result = run_controller(cfg, store, procs.dead_train, procs.dead_infer, progress=progress, env=env,
                                memcpy_gbps=memcpy, stall=stall, restarts=restarts,
                                restart_training=restart_training, fault=fault, probe=probe, fleet=fleet)
    except BaseException:
        stop_processes(procs.all(), groups=procs.groups())
        raise
    deadline = time.monotonic() + 30
    for p in procs.all():
        p.join(max(0.0, deadline - time.monotonic()))
    stop_processes(procs.all(), groups=procs.groups())
    return result


def fleet_initial_ranks(cfg: TrialConfig) -> int:
    """Inference ranks started with the run: every rank of the layout, or with ``--engines-at
    1:N`` the first ``N`` engines' (C24, experiments/fleet.py)."""
    if not cfg.fleet.active:
        return cfg.n_infer
    from .fleet import plan_fleet

    return len(plan_fleet(cfg.fleet, cfg.run.warmup + cfg.run.steps, cfg.inference.dp)[0]) * cfg.inference.tp


def _fleet_procs(cfg: TrialConfig, procs: _Procs, ctx, addr, store, stall: float, parent: int):
    """What the fleet may do to this launcher's inference processes (C24): start a fresh one
    for a rank, SIGKILL and reap one, ask one to leave and reap it."""
    from .fleet import FleetProcs, kill_process

    def start(i: int) -> None:
        p = ctx.Process(target=inference_main, args=(cfg, i, addr), kwargs=dict(stall=stall, parent=parent),
                        name=f"infer{i}", daemon=True)
        procs.infer[i] = p
        p.start()

    def leave(i: int) -> None:
        store.set(f"fleet/leave/{i}", b"1")
        p = procs.infer[i]
        p.join(cfg.transfer.control.timeout)
        if p.exitcode is None:
            kill_process(p)

    def pid(i: int):
        p = procs.infer.get(i)
        return None if p is None else p.pid

    return FleetProcs(start=start, kill=lambda i: kill_process(procs.infer[i]), leave=leave, pid=pid,
                      dead=procs.dead_infer)


def _short_state(s) -> str:
    return f"{s.state} v{s.version}"


def run_controller(cfg: TrialConfig, store, liveness_train=None, liveness_infer=None, *, progress=None,
                   env: dict | None = None, memcpy_gbps: float | None = None, stall: float | None = None,
                   restarts: int = 0, restart_training=None, fault=None, probe: dict | None = None,
                   fleet=None) -> TrialResult:
    """The controller's part of a trial, on its own: whoever started the ranks (this module's
    :func:`run_trial`, a submitit job's tasks, SLURM) hands over the master ``store`` they
    connect to. Collects metadata, plans once, drives warmup + measured updates, returns
    the tidy rows. ``liveness_*`` return ``{rank: reason}`` for ranks known dead (None: rely
    on the abort key, heartbeats and ``cfg.timeout``). ``stall`` (default ``cfg.timeout``):
    heartbeat deadline. After an update that failed on the training side,
    ``restart_training(gen, first_step)`` (if given, at most ``restarts`` times) replaces the
    training world and the run continues with the next step. ``fleet``: the launcher's
    :class:`weight_transfer.experiments.fleet.FleetProcs` for a trial whose engines are killed,
    restarted or scaled (C24; ``--kill-engine`` ...): a failed update that lost an engine is a
    row (``outcome`` ``failed``, the named error) and the run goes on with the survivors. Shuts
    the ranks down on success and on error."""
    from weight_transfer.experiments.inject import install_watcher

    env = env if env is not None else environment()
    stall = cfg.transfer.control.timeout if stall is None else stall
    if cfg.fleet.active and fleet is None:
        raise ValueError("--kill-engine/--restart-engine/--engines-at: only the local launcher (weight-transfer run) "
                         "starts and kills engine processes")
    ctl = control.Controller(store, cfg.train.n_train, fleet_initial_ranks(cfg), timeout=cfg.transfer.control.timeout,
                             liveness_train=liveness_train, liveness_infer=liveness_infer, stall=stall)
    addr = (getattr(store, "host", "127.0.0.1"), store.port)
    beat = control.Heartbeat(addr, "controller")
    install_watcher(fault, ("controller", 0), addr)
    run_id = uuid.uuid4().hex[:12]
    rows: list[dict] = []
    probe = probe if probe is not None else {}

    def note_failure(e: BaseException) -> None:
        if "error" in probe:
            return
        msg = str(e).splitlines()[0] if str(e) else ""
        if not isinstance(e, control.ControlError):  # the controller's own error
            msg = f"controller: {type(e).__name__}: {msg}"
        probe.update(error=msg, t_error=time.time(),
                     state_after_fault=_short_state(ctl.state()))
        if store.check(["fault/fired"]):
            probe["fired"] = float(store.get("fault/fired").decode())

    try:
        train_metas, infer = ctl.collect()
        t0 = time.perf_counter()
        mcfg = cfg.model_config()
        ctl_cls, _, infer_cls = get_method(cfg.run.method)
        cctx = ControllerContext(store=store, transfer=cfg.resolved_transfer, method_options=cfg.baseline, model_config=mcfg,
                                 layout=cfg.inference, train_metas=train_metas, infer_payloads=infer)
        summary = ctl_cls().setup(cctx)
        driver = None
        if fleet is not None:  # engines come and go (C24): membership, replans, kills (experiments/fleet.py)
            from .fleet import FleetDriver

            driver = FleetDriver(cfg, store, ctl, fleet, log=lambda m: print(f"# {m}", file=sys.stderr, flush=True))
            driver.setup(train_metas, infer)
        sched = cctx.extra.get("schedule")  # the reference's static schedule (None for the baselines)
        recv_bytes = dict(sched.recv_bytes) if sched is not None else {}
        commit_ranks = tuple(cctx.extra.get("commit_ranks", ()))
        ctl.shadow = dict(cctx.extra.get("shadow") or {})  # shadow targets: go-live at the commit (C27)
        if cfg.run.engine == "vllm" and not infer_cls.active:
            # vLLM's one_sided backend (experiments/vllm_side.py): every worker's update_weights
            # checks the update and commits it (staged layers or not) before the version is published
            from weight_transfer.api import WORLD_KEY

            control.put(store, WORLD_KEY, {"n_train": cfg.train.n_train, "n_infer": cfg.n_infer})
            commit_ranks = tuple(range(cfg.n_infer))
        if cfg.run.engine != "vllm" and cfg.run.method == "reference":
            # stand-in ranks with a landing region scatter packed delta records at each commit (experiments/landing.py)
            from .landing import landing_ranks, wants_landing

            packed = landing_ranks(store, cfg.n_infer)
            commit_ranks = tuple(sorted(set(commit_ranks) | set(packed)))
            if wants_landing(cfg.resolved_transfer):
                print(f"# delta ({cfg.transfer.executor.delta_mode}): landing regions for packed records on inference "
                      f"rank(s) {list(packed)} of {cfg.n_infer}", file=sys.stderr, flush=True)
        bytes_staged = int(cctx.extra.get("bytes_staged", 0))
        plan_s = time.perf_counter() - t0
        gen, step = 0, 1
        while step <= cfg.run.warmup + cfg.run.steps:
            try:
                if driver is not None:
                    driver.before_load(step)
                ctl.load(step)
                if driver is not None:  # the members of this update: replanned when they changed
                    if driver.replan(step, mcfg) is not None:
                        recv_bytes = dict(driver.schedule.recv_bytes)
                    driver.arm(step)
                if cfg.run.engine == "vllm":  # generation paused in every instance before the first write
                    from .vllm_side import KEY_PAUSED

                    control.wait_keys(store, {d * cfg.inference.tp: KEY_PAUSED.format(step=step, instance=d)
                                              for d in range(cfg.inference.dp)},
                                      timeout=cfg.transfer.control.timeout, what=f"vLLM paused for step {step}", liveness=liveness_infer)
                if cfg.serve.active:  # the update window's start; the pause-based update pauses the engines
                    from .serving import before_update

                    before_update(store, cfg.serve, step, cfg.n_infer, cfg.transfer.control.timeout, liveness_infer)
                t_go = time.perf_counter()
                try:
                    seconds, results = ctl.transfer(step, inference_active=infer_cls.active, commit_ranks=commit_ranks)
                finally:
                    if cfg.serve.active:
                        from .serving import after_update

                        after_update(store, cfg.serve, step)
            except control.ControlError as e:
                note_failure(e)
                culprit = ctl.last_culprit or ""
                if driver is not None:
                    driver.disarm()
                    lost = driver.lost_in(step)
                    if lost:  # the update lost an engine: a row naming it, then the survivors' next update
                        row = driver.failed_row(step, e, t_go, base={
                            "run_id": run_id, "git_sha": env["git_sha"], "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "host": env["host"], "method": cfg.run.method, "model": mcfg.label,
                            "dtype": cfg.inference.quant or "bfloat16", "train_dtype": cfg.train.dtype,
                            "n_train": cfg.train.n_train, "layout": cfg.inference.describe(),
                            "transport": cfg.transport, "device": cfg.run.device, "engine": cfg.run.engine,
                            "warmup": step <= cfg.run.warmup, "plan_seconds": plan_s}, lost=lost)
                        rows.append(row)
                        if progress:
                            progress(row)
                        step += 1
                        continue
                if restart_training is None or gen >= restarts or not culprit.startswith("training"):
                    raise
                print(f"# step {step}: {str(e).splitlines()[0]}; restarting the training world", file=sys.stderr,
                      flush=True)
                gen += 1
                restart_training(gen, step + 1)
                ctl.training_restarted()
                step += 1
                continue
            if driver is not None:
                driver.disarm(step)
            ver = (driver.verified(step) if driver is not None else ctl.verified(step)) if cfg.run.verify else {}
            ok = all(v.get("ok") for v in ver.values()) if cfg.run.verify else None
            stats: list[UpdateStats] = [res["stats"] for r, res in results.items() if not isinstance(r, tuple)]
            row = {
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
                "write_seconds": ctl.last_write_seconds,
            }
            row.update(phase_columns(stats, seconds, ctl.last_write_seconds, results, recv_bytes, bytes_staged,
                                     cfg.n_infer))
            row.update(delta_mode_columns(stats))  # writes and bytes per delta mode (cost model)
            for k, val in delta_phase_columns(stats).items():  # delta_<phase>_s the executor reports (slowest rank)
                row.setdefault(k, val)
            if cfg.run.delta_pairs or cfg.run.replay:  # which push of a pair, and which weights (docs/DELTA.md)
                row["pair_mode"] = cfg.run.push_mode(step) or ""
                row["source_step"] = cfg.run.source_step(step) + (cfg.run.replay_start - 1 if cfg.run.replay else 0)
            kinds = _prepare_kinds(stats)
            if kinds:  # the reference's prepare per tensor kind, summed over training ranks (issue 43)
                row["prepare_by_kind"] = kinds
            if cfg.run.engine == "vllm":  # which path vLLM took: its targets and the ISA its workers were shown
                from weight_transfer.engines.vllm.extension import HIDE_AMX_ENV

                row["vllm_targets"] = cfg.run.vllm_targets if cfg.run.method == "reference" else "direct"
                # how the bytes reach vLLM: its weight-transfer API with the one_sided backend, or its reload path
                row["vllm_path"] = "one_sided" if not infer_cls.active else "reload"
                row["vllm_hide_amx"] = os.environ.get(HIDE_AMX_ENV, "") in ("1", "true", "yes")
            if cfg.run.method == "reference":  # bytes into staged targets (post-processed by the engine at commit)
                row["bytes_staged"] = bytes_staged
                row["bytes_direct"] = row["bytes"] - bytes_staged
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
            if driver is not None:  # membership, epoch, replan seconds, newcomers, trainers' pids
                row.update(driver.columns(step), outcome="complete")
            rows.append(row)
            if progress:
                progress(row)
            step += 1
        ctl.shutdown()
    except BaseException as e:
        note_failure(e)
        ctl.shutdown(reason=f"controller: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        beat.stop()
    return TrialResult(cfg, rows, summary, plan_s, memcpy_gbps, env)


def _prepare_kinds(stats: list) -> str:
    """JSON ``{kind: [tasks, gather_s, build_s, gathered_bytes, built_bytes]}`` summed over the
    training ranks' task records (:func:`weight_transfer.records.prepare_by_kind`); ``""`` for a
    method without task records (the baselines)."""
    from weight_transfer.records import prepare_by_kind

    tot: dict[str, list] = {}
    for s in stats:
        for k, v in prepare_by_kind(getattr(s, "records", None) or []).items():
            t = tot.setdefault(k, [0, 0.0, 0.0, 0, 0])
            for i, x in enumerate(v):
                t[i] += x
    return json.dumps({k: [v[0], round(v[1], 6), round(v[2], 6), v[3], v[4]] for k, v in sorted(tot.items())}) if tot else ""


PHASES = ("h2d", "prepare", "write", "release", "barrier", "commit", "publish")
"""The per-phase columns of a row (``phase_<name>_s``, docs/PERFORMANCE.md)."""


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
    per output and receiver, :attr:`weight_transfer.records.StepStats.delta_modes`), summed over
    training ranks: ``delta_n_<mode>`` writes and ``delta_bytes_<mode>`` bytes written (a packed
    record's bytes for ``packed``). Empty without delta updates."""
    out: dict = {}
    for s in stats:
        for m, kinds in (getattr(s, "delta_modes", None) or {}).items():
            for n, wrote, _size in kinds.values():
                out[f"delta_n_{m}"] = out.get(f"delta_n_{m}", 0) + n
                out[f"delta_bytes_{m}"] = out.get(f"delta_bytes_{m}", 0) + wrote
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


def world_size(cfg: TrialConfig) -> int:
    """Tasks of one trial run as a job: the controller + every training and inference rank."""
    return 1 + cfg.train.n_train + cfg.n_infer


def task_role(cfg: TrialConfig, global_rank: int) -> tuple[str, int]:
    """``("controller", 0)``, ``("train", r)`` or ``("infer", i)`` for task ``global_rank`` of
    a trial job: task 0 is the controller, tasks ``1..n_train`` the training ranks, then the
    inference ranks."""
    if global_rank == 0:
        return "controller", 0
    if 1 <= global_rank <= cfg.train.n_train:
        return "train", global_rank - 1
    if global_rank < world_size(cfg):
        return "infer", global_rank - 1 - cfg.train.n_train
    raise ValueError(f"task {global_rank}: a trial with n_train={cfg.train.n_train}, n_infer={cfg.n_infer} "
                     f"has {world_size(cfg)} tasks (controller + ranks)")


def run_task(cfg: TrialConfig, global_rank: int, store_host: str, store_port: int, *, publish=None,
             progress=None) -> TrialResult | None:
    """One task of a trial run as a job (submitit local executor, SLURM): see :func:`task_role`.

    The controller hosts the TCPStore on ``(store_host, store_port)`` (``0``: a free port;
    ``publish(host, port)`` is then called so the other tasks can find it) and returns the
    TrialResult; the ranks connect to it and return None. No process handles exist across
    tasks, so a dead rank is seen through the abort key its setup writes, or ``cfg.timeout``."""
    role, rank = task_role(cfg, global_rank)
    if role == "controller":
        env = environment()
        memcpy = measure_memcpy_gbps()
        store = control.make_store(store_host, store_port, is_master=True, timeout=cfg.transfer.control.timeout)
        if publish is not None:
            publish(store_host, store.port)
        try:
            return run_controller(cfg, store, progress=progress, env=env, memcpy_gbps=memcpy)
        finally:  # the store lives in this task: keep it up until every rank has let go of it
            try:
                control.wait_keys(store, {g: f"task_exit/{g}" for g in range(1, world_size(cfg))},
                                  timeout=min(cfg.transfer.control.timeout, 60.0), what="ranks exiting")
            except control.ControlError:
                pass
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        if role == "infer" and cfg.run.engine == "vllm":  # one task per vLLM instance runs it; its TP peers idle
            if rank % cfg.inference.tp == 0:
                from .vllm_side import vllm_instance_main

                vllm_instance_main(cfg, rank // cfg.inference.tp, (store_host, store_port))
        else:
            from .worker import local_rank_from_env

            (trainer_main if role == "train" else inference_main)(cfg, rank, (store_host, store_port),
                                                                   local_rank=local_rank_from_env())
    finally:
        try:
            control.make_store(store_host, store_port, is_master=False, timeout=10.0).set(f"task_exit/{global_rank}", b"1")
        except Exception:
            pass
    return None
