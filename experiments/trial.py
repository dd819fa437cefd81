"""One trial, launched locally: controller in this process, every rank its own OS process.

Flow (DESIGN.md "control plane"): start the control-plane store
(:func:`weight_transfer.serve_store`: it makes the job secret and exports it, so every rank
process spawned afterwards inherits it), spawn ``n_train`` training ranks and
``n_infer`` inference ranks, collect their metadata, build the recipes and the static schedule
once, hand each training rank its part, then per update: "load" (the optimizer-step stand-in),
"go", wait for every completion, publish the version, wait for every inference rank's
verification. One tidy row per update (experiments/columns.py). :func:`run_controller` reads in
that order: :func:`_configure` (metadata, the plan, once), then per update :func:`_before_go`,
:func:`_go`, :func:`_verify` and the update's row.

Failures (docs/FAULTS.md): the controller names the first failed process ("training 1: ...",
"inference 0: ...") as soon as it reports an error, dies or stops beating, publishes the
weights as incomplete, and every rank process is ended (SIGTERM, then SIGKILL) before the
error propagates; locally launched ranks also die with the controller (``PR_SET_PDEATHSIG``)
and leave on their own when its heartbeat stops. ``run_trial(..., restarts=n)`` restarts the
training world after a training-side failure instead, and the run goes on.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from weight_transfer.control import protocol as control
from weight_transfer.control import store as store_api
from weight_transfer.method import ControllerContext

from .columns import update_row
from .config import TrialConfig
from .env import environment, git_sha, measure_memcpy_gbps  # noqa: F401  (git_sha: re-exported)
from .load import LoadMeter
from .methods import get_method
from .worker import inference_main, trainer_main


@dataclass
class TrialResult:
    cfg: TrialConfig
    rows: list[dict[str, Any]]
    schedule_summary: str
    plan_seconds: float
    memcpy_gbps: float | None = None
    env: dict[str, Any] = field(default_factory=dict)
    """As data for another process: :func:`weight_transfer.experiments.data.result_to_bytes`."""


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


_ANNOUNCED: set = set()
"""(model, layout) whose traced-recipe line :func:`preflight` printed in this process."""


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
        if cfg.run.engine != "vllm":  # the stand-in's tensors and oracle come from vLLM's loader: trace it now, once
            from weight_transfer.experiments.traced import recipes_for, trace_cache_dir

            if cfg.run.method != "reference":
                raise ValueError(f"model {mcfg.label}: --method {cfg.run.method} with the stand-in engine: architecture "
                                 f"{mcfg.architecture!r} has no stand-in load_weights (its baselines need vLLM's own "
                                 "loader: --engine vllm)")
            import sys

            if cfg.inference.quant in ("fp8-tensor", "fp8-channel") and mcfg.num_experts:
                raise ValueError(f"--quant {cfg.inference.quant}: model {mcfg.label} has MoE experts, which per-tensor "
                                 "/ per-channel FP8 does not plan; use --quant fp8 (block FP8) or --quant none")
            if (mcfg.label, str(cfg.inference)) not in _ANNOUNCED:  # preflight runs twice in one command
                _ANNOUNCED.add((mcfg.label, str(cfg.inference)))
                print(f"# {mcfg.architecture}: vLLM's loader traced (or read from its cache, {trace_cache_dir()}); "
                      "each update is verified against vLLM's own load_weights in a child process (about 10 s per "
                      "rank)", file=sys.stderr, flush=True)
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
    at the first failure (``error``, ``t_error``, ``fired``, ``state_after_fault``). Every row
    carries the load columns (experiments/load.py): the load average now, before any process of
    the trial, and the other processes' CPU through each update, this process's tree its own."""
    load = LoadMeter()
    preflight(cfg)
    if fault is not None:
        fault.check(cfg)
    stall = cfg.transfer.control.timeout if stall is None else stall
    env = environment()
    memcpy = measure_memcpy_gbps()
    store = store_api.make_store("127.0.0.1", 0, is_master=True, timeout=cfg.transfer.control.timeout)
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

    _add_inference(cfg, procs, ctx, addr, stall=stall, fault=fault, parent=parent)
    spawn_training(0, 1)
    for p in procs.infer.values():
        p.start()
    fleet = _fleet_procs(cfg, procs, ctx, addr, store, stall, parent) if cfg.fleet.active else None
    try:
        result = run_controller(cfg, store, procs.dead_train, procs.dead_infer, progress=progress, env=env,
                                memcpy_gbps=memcpy, stall=stall, restarts=restarts,
                                restart_training=restart_training, fault=fault, probe=probe, fleet=fleet, load=load)
    except BaseException:
        stop_processes(procs.all(), groups=procs.groups())
        raise
    deadline = time.monotonic() + 30
    for p in procs.all():
        p.join(max(0.0, deadline - time.monotonic()))
    stop_processes(procs.all(), groups=procs.groups())
    return result


def _add_inference(cfg: TrialConfig, procs: _Procs, ctx, addr, *, stall: float, fault, parent: int) -> None:
    """The inference processes of a local trial, not yet started: one per vLLM instance (vLLM
    starts its own children, so not a daemon), else one per inference rank the run starts with."""
    if cfg.run.engine == "vllm":
        from .vllm_side import vllm_instance_main

        for d in range(cfg.inference.dp):
            procs.infer[d * cfg.inference.tp] = ctx.Process(target=vllm_instance_main, args=(cfg, d, addr),
                                                   kwargs=dict(parent=parent), name=f"vllm{d}")
    else:
        for i in range(fleet_initial_ranks(cfg)):
            procs.infer[i] = ctx.Process(target=inference_main, args=(cfg, i, addr),
                                         kwargs=dict(stall=stall, fault=fault, parent=parent), name=f"infer{i}",
                                         daemon=True)


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


def run_controller(cfg: TrialConfig, store, liveness_train=None, liveness_infer=None, *, progress=None,
                   env: dict | None = None, memcpy_gbps: float | None = None, stall: float | None = None,
                   restarts: int = 0, restart_training=None, fault=None, probe: dict | None = None,
                   fleet=None, load: LoadMeter | None = None) -> TrialResult:
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
    row (``outcome`` ``failed``, the named error) and the run goes on with the survivors.
    ``load``: the rows' load columns (:class:`weight_transfer.experiments.load.LoadMeter`, its
    window around each update's go; default: the load average now, no own process tree, the ranks
    not being this process's children). Shuts the ranks down on success and on error."""
    from weight_transfer.experiments.inject import install_watcher

    env = env if env is not None else environment()
    load = load if load is not None else LoadMeter(root=None)
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
    try:
        plan = _configure(cfg, ctl, store, fleet)
        plan.load = load
        gen, step = 0, 1
        while step <= cfg.run.warmup + cfg.run.steps:
            try:
                _before_go(cfg, ctl, store, plan, step, liveness_infer)
                t_go = time.perf_counter()
                seconds, results = _go(cfg, ctl, store, plan, step)
            except control.ControlError as e:
                _note_failure(probe, e, ctl, store)
                culprit = ctl.last_culprit or ""
                lost = _lost_engines(plan.driver, step)
                if lost:  # the update lost an engine: a row naming it, then the survivors' next update
                    row = plan.driver.failed_row(step, e, t_go, base=_failed_base(cfg, env, run_id, plan, step),
                                                 lost=lost)
                    _emit(rows, row, progress)
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
            ver, ok = _verify(cfg, ctl, plan.driver, step)
            row = update_row(cfg, run_id=run_id, env=env, mcfg=plan.mcfg, step=step, seconds=seconds,
                             write_seconds=ctl.last_write_seconds, results=results, ver=ver, ok=ok,
                             plan_s=plan.plan_s, recv_bytes=plan.recv_bytes, bytes_staged=plan.bytes_staged,
                             infer_active=plan.infer_cls.active)
            row.update(plan.load.columns())  # how loaded the machine was through this update
            lv = ctl.last_verify  # --fingerprints: the reference's end-to-end check (docs/VERIFY.md)
            if lv["mode"] != "off":
                row.update(fingerprints=lv["mode"], verify_bytes=lv["bytes"], verify_s=lv["seconds"])
            if plan.driver is not None:  # membership, epoch, replan seconds, newcomers, trainers' pids
                row.update(plan.driver.columns(step), outcome="complete")
            _emit(rows, row, progress)
            step += 1
        ctl.shutdown()
    except BaseException as e:
        _note_failure(probe, e, ctl, store)
        ctl.shutdown(reason=f"controller: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise
    finally:
        beat.stop()
    return TrialResult(cfg, rows, plan.summary, plan.plan_s, memcpy_gbps, env)


@dataclass
class _Plan:
    """What the controller set up once, before the first update (:func:`_configure`)."""

    mcfg: object
    """The model config (:class:`weight_transfer.model_config.ModelConfig`)."""
    infer_cls: type
    """The method's inference side (``.active``: it takes part in each update)."""
    summary: str
    """The method's one-line plan summary (the report's ``# plan:`` line)."""
    plan_s: float
    """Seconds from the collected metadata to the plan (the rows' ``plan_seconds``)."""
    recv_bytes: dict
    """Bytes per inference rank of the schedule (empty without one; replaced at a replan)."""
    commit_ranks: tuple
    """Inference ranks that commit each update before the version is published."""
    bytes_staged: int
    """Bytes per update into staged targets (post-processed by the engine at commit)."""
    driver: object = None
    """The fleet's :class:`weight_transfer.experiments.fleet.FleetDriver` (None: a fixed fleet)."""
    load: LoadMeter | None = None
    """The rows' load columns; its window is each update's :func:`_go`."""


def _configure(cfg: TrialConfig, ctl, store, fleet) -> _Plan:
    """Collect every rank's metadata and plan once: the method's controller side sets up (the
    reference: recipes + static schedule, handed to the training ranks), the fleet's driver
    takes the first membership, and the ranks that commit each update are settled."""
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
    ctl.verifier = cctx.extra.get("verifier")  # --fingerprints: the reference's end-to-end check (C31)
    ctl.verify_after_commit = cfg.transfer.executor.delta and cfg.transfer.executor.delta_mode != "scattered"
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
    return _Plan(mcfg=mcfg, infer_cls=infer_cls, summary=summary, plan_s=time.perf_counter() - t0,
                 recv_bytes=recv_bytes, commit_ranks=commit_ranks, bytes_staged=bytes_staged, driver=driver)


def _before_go(cfg: TrialConfig, ctl, store, plan: _Plan, step: int, liveness_infer) -> None:
    """Update ``step`` up to its go: the fleet's changes before the load, "load" (the
    optimizer-step stand-in), a replan when the members changed, every vLLM instance paused,
    the generation load's update window opened. ControlError on a failed rank."""
    driver = plan.driver
    if driver is not None:
        driver.before_load(step)
    ctl.load(step)
    if driver is not None:  # the members of this update: replanned when they changed
        if driver.replan(step, plan.mcfg) is not None:
            plan.recv_bytes = dict(driver.schedule.recv_bytes)
        driver.arm(step)
    if cfg.run.engine == "vllm":  # generation paused in every instance before the first write
        from .vllm_side import KEY_PAUSED

        control.wait_keys(store, {d * cfg.inference.tp: KEY_PAUSED.format(step=step, instance=d)
                                  for d in range(cfg.inference.dp)},
                          timeout=cfg.transfer.control.timeout, what=f"vLLM paused for step {step}", liveness=liveness_infer)
    if cfg.serve.active:  # the update window's start; the pause-based update pauses the engines
        from .serving import before_update

        before_update(store, cfg.serve, step, cfg.n_infer, cfg.transfer.control.timeout, liveness_infer)


def _go(cfg: TrialConfig, ctl, store, plan: _Plan, step: int) -> tuple[float, dict]:
    """Send "go" for update ``step``, wait for every completion and commit, publish the
    version: ``(seconds, {rank: result})``; the generation load's update window closes
    either way. ControlError on a failed rank. ``plan.load`` measures the window."""
    plan.load.start()
    try:
        return ctl.transfer(step, inference_active=plan.infer_cls.active, commit_ranks=plan.commit_ranks)
    finally:
        plan.load.stop()
        if cfg.serve.active:
            from .serving import after_update

            after_update(store, cfg.serve, step)


def _verify(cfg: TrialConfig, ctl, driver, step: int) -> tuple[dict, bool | None]:
    """The inference ranks' verification of update ``step`` (in an elastic fleet: exactly the
    engines in it): ``({rank: result}, all ok)``; ``({}, None)`` without ``cfg.run.verify``."""
    if driver is not None:
        driver.disarm(step)
    ver = (driver.verified(step) if driver is not None else ctl.verified(step)) if cfg.run.verify else {}
    ok = all(v.get("ok") for v in ver.values()) if cfg.run.verify else None
    return ver, ok


def _lost_engines(driver, step: int) -> list[int]:
    """Inference ranks update ``step`` lost (killed, gone) in an elastic fleet; [] without one."""
    if driver is None:
        return []
    driver.disarm()
    return driver.lost_in(step)


def _failed_base(cfg: TrialConfig, env: dict, run_id: str, plan: _Plan, step: int) -> dict:
    """The trial's common columns of a failed update's row (:meth:`FleetDriver.failed_row`)."""
    return {"run_id": run_id, "git_sha": env["git_sha"], "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "host": env["host"], "method": cfg.run.method, "model": plan.mcfg.label,
            "dtype": cfg.inference.quant or "bfloat16", "train_dtype": cfg.train.dtype,
            "n_train": cfg.train.n_train, "layout": cfg.inference.describe(),
            "transport": cfg.transport, "device": cfg.run.device, "engine": cfg.run.engine,
            "warmup": step <= cfg.run.warmup, "plan_seconds": plan.plan_s, **plan.load.columns()}


def _emit(rows: list[dict], row: dict, progress) -> None:
    """Keep ``row`` and hand it to ``progress`` (if given) as soon as its update is done."""
    rows.append(row)
    if progress:
        progress(row)


def _note_failure(probe: dict, e: BaseException, ctl, store) -> None:
    """Record the first failure in ``probe``: ``error`` (named), ``t_error``, the weights'
    state after it, and when the injected fault fired (``fired``, if it did)."""
    if "error" in probe:
        return
    msg = str(e).splitlines()[0] if str(e) else ""
    if not isinstance(e, control.ControlError):  # the controller's own error
        msg = f"controller: {type(e).__name__}: {msg}"
    probe.update(error=msg, t_error=time.time(),
                 state_after_fault=_short_state(ctl.state()))
    if store.check(["fault/fired"]):
        probe["fired"] = fired_time(store)


def fired_time(store) -> float:
    """When the injected fault fired (``fault/fired``: wall-clock seconds as ASCII, set by
    experiments/inject.py or the fleet's kill). ControlError naming the key for anything else."""
    text = control.get_text(store, "fault/fired", limit=64)
    try:
        return float(text)
    except ValueError:
        raise control.ControlError("store key 'fault/fired': refused a value that is not a time") from None


def _short_state(s) -> str:
    return f"{s.state} v{s.version}"


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

    The controller hosts the store on ``(store_host, store_port)`` (``0``: a free port;
    ``publish(host, port)`` is then called so the other tasks can find it) and returns the
    TrialResult; the ranks connect to it and return None. No process handles exist across
    tasks, so a dead rank is seen through the abort key its setup writes, or ``cfg.timeout``.

    Every task needs the job secret in its environment (``WEIGHT_TRANSFER_SECRET`` or
    ``WEIGHT_TRANSFER_SECRET_FILE``), set by whoever started the job before it started
    (:func:`weight_transfer.experiments.sweep.submit_with_secret`; scripts/netns_trial.py): the
    controller does not make one, since no other task could learn it.
    :class:`weight_transfer.security.secret.AuthenticationError` naming how to pass it otherwise
    (unless ``WEIGHT_TRANSFER_INSECURE=1``)."""
    role, rank = task_role(cfg, global_rank)
    if role == "controller":
        from weight_transfer.security.secret import insecure_requested, resolve_secret

        if not insecure_requested():
            resolve_secret(where=f"trial task 0 (the controller of a {world_size(cfg)}-task job)")
        env = environment()
        memcpy = measure_memcpy_gbps()
        store = store_api.make_store(store_host, store_port, is_master=True, timeout=cfg.transfer.control.timeout)
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
            store_api.make_store(store_host, store_port, is_master=False, timeout=10.0).set(f"task_exit/{global_rank}", b"1")
        except Exception:
            pass
    return None
