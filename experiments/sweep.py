"""Sweeps with submitit: one trial = one job whose tasks are the trial's ranks.

    weight-transfer sweep --list
    weight-transfer sweep qwen3_cpu_small --cluster local            # this box
    weight-transfer sweep qwen3_8b_h100_world --cluster slurm --partition gpu \\
        --nodes 2 --tasks-per-node 9 --gpus-per-node 8 --time 30           # a cluster
    weight-transfer sweep ci_cpu_regression --cluster debug          # in-process (tests, pdb)

A trial job has ``1 + n_train + n_infer`` tasks (:func:`weight_transfer.experiments.trial.task_role`): task 0
is the controller, which hosts the control-plane store on its node on a free port and publishes
``host:port`` in ``<folder>/<job id>/store.json`` (the job folder is shared by every task:
submitit itself needs that); tasks ``1..n_train`` are the training ranks, then the inference
ranks, each connecting to that address; when ``nodes x tasks_per_node`` rounds the task count
up (17 tasks on 2 nodes x 9), the surplus tasks exit at once. The same function runs under the local executor and
under SLURM; submitit's ``JobEnvironment`` gives the global rank, the task count and the nodes.
A job with a single task (the debug executor, or ``--single-task``) runs the whole trial in it
with :func:`weight_transfer.experiments.trial.run_trial` (ranks spawned as local processes).

The job secret (docs/SECURITY.md): only processes holding it can connect to the controller's
store, and the controller is one of the job's tasks, so the secret must exist before the job
does. The sweep makes a fresh one for every trial job and submits the job with it in its
environment (:func:`submit_with_secret`: ``WEIGHT_TRANSFER_SECRET``, which submitit's local
executor hands to every task it starts and ``sbatch`` exports to every task of the job --
SLURM's default ``--export=ALL``; never on a command line, in the job folder or in the
store). A secret already in the sweep's environment (``WEIGHT_TRANSFER_SECRET`` or
``WEIGHT_TRANSFER_SECRET_FILE``, e.g. ``weight-transfer secret --out PATH`` on a shared home)
is used as is for every job instead.

Named configs and sweeps are in ``experiments/configs.py``; this module runs any
:class:`~weight_transfer.experiments.config.Sweep` and does not import them (the CLI, ``experiments/command.py``,
looks names up there).

Results: every trial's rows, plus ``trial_key`` (hash of the config), ``sweep``, ``job_id``,
``cluster`` and the executor options, are appended to ``results/<sweep>.csv``. A rerun skips
trials whose key is already there. A failed trial prints its log path and the sweep goes on.
On SLURM, a job that ends without every task's result fails its trial with the way SLURM ended
it first (``cancelled: ...``, ``time limit: ...``, ``node lost: ...``; a job SLURM does not end
is cancelled at the sweep's own deadline: ``no end from SLURM: ...``): docs/SWEEPS.md,
"Failures under SLURM". What SLURM says of a job (squeue's states, how it ended) is read in
``experiments/slurm_state.py``; this module watches the jobs and collects their results.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .config import KEY_EXCLUDE, Sweep, TrialConfig, trial_key  # noqa: F401  (re-exported)
from .paths import project_dir
from .slurm_state import (  # noqa: F401  (re-exported)
    SLURM_END_NAMES,
    SLURM_ENDED,
    SlurmJob,
    slurm_end,
    slurm_log_end,
    slurm_states,
)

ROOT = project_dir()
RESULTS_DIR = ROOT / "results"
JOBS_DIR = ROOT / "results" / "runs" / "jobs"
"""submitit job folders (pickles, logs, store addresses); git-ignored."""

def describe(cfg: TrialConfig) -> str:
    """One short line naming a trial: method, model, world, options."""
    ov = ",".join(f"{k}={v}" for k, v in cfg.model.overrides.items())
    extra = "" if cfg.transfer.executor.watermark is None else f" wm={cfg.transfer.executor.watermark >> 20}MiB"
    return f"{cfg.run.method} {cfg.model.name}[{ov}] {cfg.train.n_train}->{cfg.inference.describe()}{extra}"


def done_keys(csv: Path) -> set[str]:
    """Trial keys already present in a results CSV."""
    if not csv.exists() or csv.stat().st_size == 0:
        return set()
    import pandas as pd

    df = pd.read_csv(csv)
    return set(df["trial_key"].dropna().astype(str)) if "trial_key" in df else set()


# ---------------------------------------------------------------- inside a job


def task_env(cfg: TrialConfig, job_env) -> dict:
    """What task ``job_env.global_rank`` of a trial job is: role and rank (controller, training
    or inference), the job's shape and nodes. ``job_env`` is submitit's JobEnvironment (or
    anything with its attributes). Raises ValueError if the job has the wrong task count."""
    from .trial import task_role, world_size

    n = job_env.num_tasks
    if n != 1 and n < world_size(cfg):
        raise ValueError(f"job {job_env.job_id} has {n} tasks; this trial needs 1 (local spawn) or at least "
                         f"{world_size(cfg)} (controller + {cfg.train.n_train} training + {cfg.n_infer} inference)")
    if n == 1:
        role, rank = "trial", 0
    elif job_env.global_rank >= world_size(cfg):  # nodes x tasks_per_node rounded the task count up
        role, rank = "idle", 0
    else:
        role, rank = task_role(cfg, job_env.global_rank)
    return {"job_id": str(job_env.job_id), "global_rank": job_env.global_rank, "num_tasks": n,
            "role": role, "rank": rank, "node": job_env.node, "num_nodes": job_env.num_nodes,
            "local_rank": job_env.local_rank, "hostnames": list(job_env.hostnames),
            "hostname": job_env.hostname}


def store_file(folder: str | Path, job_id: str) -> Path:
    """Where task 0 publishes the store address: ``<folder>/<job id>/store.json``, beside the
    job's own submitit files."""
    return Path(folder) / str(job_id) / "store.json"


def publish_store(path: Path, host: str, port: int) -> None:
    """Atomically write the controller's store address for the job's other tasks."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"host": host, "port": port}))
    tmp.replace(path)


def read_store(path: Path, timeout: float, poll: float = 0.1) -> tuple[str, int]:
    """Wait (up to ``timeout`` s) for the controller to publish its store address."""
    deadline = time.monotonic() + timeout
    while True:
        if path.exists():
            d = json.loads(path.read_text())
            return d["host"], int(d["port"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"no store address in {path} after {timeout:.0f} s: did task 0 (controller) start?")
        time.sleep(poll)


def submit_with_secret(executor, fn, *args, fresh: bool = True):
    """``executor.submit(fn, *args)`` with a fresh job secret in the environment the job's tasks
    inherit (``fresh``; else the environment as it is: a secret the user set, or the debug
    executor's in-process job). The sweep's own environment is restored afterwards, so no two
    trial jobs share a secret."""
    if not fresh:
        return executor.submit(fn, *args)
    from weight_transfer.security.secret import ENV_SECRET, JobSecret

    old = os.environ.get(ENV_SECRET)
    os.environ[ENV_SECRET] = JobSecret.generate().hex()
    try:
        return executor.submit(fn, *args)  # local: Popen(env=os.environ); SLURM: sbatch exports it
    finally:
        if old is None:
            os.environ.pop(ENV_SECRET, None)
        else:
            os.environ[ENV_SECRET] = old


def trial_job(cfg: TrialConfig, folder: str):
    """The function every task of a trial job runs (pickled by submitit). Task 0 returns the
    TrialResult, the others None."""
    import submitit

    from .trial import run_task, run_trial

    te = task_env(cfg, submitit.JobEnvironment())
    print(f"[task {te['global_rank']}] {te['role']} {te['rank']} on {te['hostname']} "
          f"(job {te['job_id']}, {te['num_tasks']} tasks on {te['num_nodes']} node(s))", file=sys.stderr, flush=True)
    if te["role"] == "trial":
        return run_trial(cfg)
    if te["role"] == "idle":
        return None
    path = store_file(folder, te["job_id"])
    if te["role"] == "controller":
        host = "127.0.0.1" if te["num_nodes"] == 1 else socket.gethostname()
        return run_task(cfg, 0, host, 0, publish=lambda h, p: publish_store(path, h, p))
    host, port = read_store(path, timeout=max(cfg.transfer.control.timeout, 300.0))
    return run_task(cfg, te["global_rank"], host, port)


def _debug_trial_job(cfg: TrialConfig, folder: str):
    """Debug executor: exceptions are returned, not raised (submitit's DebugJob would open pdb)."""
    try:
        return trial_job(cfg, folder)
    except Exception as e:
        return _Failure(f"{type(e).__name__}: {e}", traceback.format_exc())


@dataclass
class _Failure:
    error: str
    traceback: str


# ---------------------------------------------------------------- submitting


@dataclass(kw_only=True, slots=True)
class LaunchOptions:
    """How each trial job is placed (``weight-transfer sweep`` options)."""

    cluster: str = field(default="local", metadata={"choices": ("local", "slurm", "debug")})
    """``local`` (processes on this machine), ``slurm`` (sbatch), or ``debug`` (in-process, one task)."""
    folder: Path = field(default=JOBS_DIR, metadata={"metavar": "DIR"})
    """submitit folder: job pickles, logs (``%j_%t_log.out/err``), store addresses."""
    nodes: int = 1
    """Nodes per trial job."""
    tasks_per_node: int | None = None
    """Tasks per node; default: the trial's ``1 + n_train + n_infer`` over ``nodes``."""
    gpus_per_node: int = 0
    """GPUs per node (SLURM ``--gpus-per-node``)."""
    cpus_per_task: int | None = None
    """CPUs per task (SLURM ``--cpus-per-task``)."""
    partition: str | None = None
    """SLURM partition."""
    time_min: int = field(default=30, metadata={"flag": "--time", "unit": "minutes"})
    """Time limit per trial job (minutes)."""
    parallel: int = 1
    """Trial jobs in flight at once (1 on a small box; more on a cluster)."""
    single_task: bool = False
    """Run each trial as one task that spawns its ranks locally (like the debug executor)."""
    slurm_extra: dict = field(default_factory=dict, metadata={"append": True, "parse": lambda s: tuple(s.split("=", 1))})
    """Extra sbatch options, ``KEY=VALUE`` each (e.g. ``account=rl``; ``{"account": "rl"}``)."""

    def __post_init__(self):
        if self.cluster not in ("local", "slurm", "debug"):
            raise ValueError(f"cluster={self.cluster!r}: local, slurm or debug")
        if self.cluster == "local" and self.nodes != 1:
            raise ValueError("the local executor runs on one node: --nodes 1")
        if self.nodes < 1 or self.parallel < 1:
            raise ValueError("nodes and parallel must be >= 1")


def executor_parameters(cfg: TrialConfig, opt: LaunchOptions) -> dict:
    """submitit AutoExecutor parameters for ``cfg``'s job (generic names; ``slurm_*`` ones only
    for SLURM). Raises ValueError if the tasks do not fit ``nodes x tasks_per_node`` exactly."""
    from .trial import world_size

    n = 1 if (opt.single_task or opt.cluster == "debug") else world_size(cfg)
    tpn = opt.tasks_per_node or -(-n // opt.nodes)
    if n > 1 and not (opt.nodes * tpn >= n > (opt.nodes - 1) * tpn):
        raise ValueError(f"trial needs {n} tasks (controller + {cfg.train.n_train} training + {cfg.n_infer} inference); "
                         f"--nodes {opt.nodes} x --tasks-per-node {tpn} = {opt.nodes * tpn} "
                         f"(surplus tasks idle, but every node must run one of the trial's tasks)")
    p = {"name": f"wt-{cfg.run.method}-{trial_key(cfg)}", "timeout_min": opt.time_min, "nodes": opt.nodes,
         "tasks_per_node": tpn}
    if opt.gpus_per_node:
        p["gpus_per_node"] = opt.gpus_per_node
    if opt.cpus_per_task:
        p["cpus_per_task"] = opt.cpus_per_task
    if opt.cluster == "slurm":
        if opt.partition:
            p["slurm_partition"] = opt.partition
        # No early warning signal: submitit asks for USR2 90 s before the time limit
        # (`--signal=USR2@90`); SLURM sends it up to a minute earlier still, so with a short
        # --time it reaches tasks that have not yet installed submitit's handler (USR2's default
        # action kills them: every trial of `--time 1` died of it at start), and otherwise only
        # task 0 acts on it (a trial is not checkpointable: it raises "timed-out and not
        # checkpointable" and the ranks wait for a controller that is gone). With a delay of 0
        # SLURM sends nothing: a trial runs to its limit and SLURM ends it (state TIMEOUT).
        p["slurm_signal_delay_s"] = 0
        # Not requeued (node failure, preemption): a requeued job would start over in the same
        # job folder, its ranks finding the first run's store.json; the trial fails with the
        # SLURM state named instead (NODE_FAIL, PREEMPTED) and a rerun of the sweep runs it again.
        p["slurm_additional_parameters"] = {"no_requeue": True, **dict(opt.slurm_extra)}
    return p


def make_executor(cfg: TrialConfig, opt: LaunchOptions):
    """A submitit AutoExecutor for ``cfg``'s job (its parameters set)."""
    import submitit

    ex = submitit.AutoExecutor(folder=str(opt.folder / "%j"), cluster=opt.cluster)
    ex.update_parameters(**executor_parameters(cfg, opt))
    return ex


@dataclass
class TrialOutcome:
    cfg: TrialConfig
    key: str
    job_id: str = ""
    rows: list = field(default_factory=list)
    error: str = ""
    log: str = ""
    seconds: float = 0.0
    slurm_state: str = ""
    """SLURM: the job's state when the sweep last saw it (COMPLETED, CANCELLED, TIMEOUT, NODE_FAIL,
    ...; OVERDUE: cancelled by the sweep at its deadline); '' elsewhere or when not known."""

    @property
    def ok(self) -> bool:
        return not self.error and all(r.get("verified") in (True, None) for r in self.rows)


@dataclass
class SweepSummary:
    sweep: str
    csv: Path
    total: int
    skipped: int = 0
    outcomes: list[TrialOutcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> list[TrialOutcome]:
        return [o for o in self.outcomes if not o.ok]


SLURM_DEADLINE_MARGIN_S = 120.0
"""The sweep's own deadline for a SLURM job: ``--time`` plus this many seconds after the sweep
first saw it running. SLURM ends a job at its limit itself, up to ~30 s late (its periodic
check) plus ``KillWait`` (30 s by default, 10 s on scripts/slurm_local.sh's cluster); a job
still listed past this deadline is one SLURM has lost track of (slurmctld or the node's
slurmd not answering): the sweep cancels it and fails the trial ("no end from SLURM")."""

ENDED_GRACE_S = 2.0
"""The result grace (:data:`RESULT_GRACE_S`) for a job SLURM says it ended (cancelled, time
limit, node lost, ...): its killed tasks write no result, so there is little to wait for."""


class SlurmWatch:
    """The sweep's SLURM jobs, one ``squeue`` per poll for all of them (:func:`next_finished`),
    with a deadline per job of ``time_min`` + :data:`SLURM_DEADLINE_MARGIN_S` after it was
    first seen running (None: no deadline)."""

    def __init__(self, time_min: float | None = None, margin: float | None = None):
        self.time_min = time_min
        self._margin = margin
        self.jobs: dict[str, SlurmJob] = {}

    @property
    def margin(self) -> float:
        """Seconds past ``time_min`` (default: :data:`SLURM_DEADLINE_MARGIN_S`, read at each check)."""
        return SLURM_DEADLINE_MARGIN_S if self._margin is None else self._margin

    def add(self, job) -> SlurmJob:
        return self.jobs.setdefault(str(job.job_id), SlurmJob(str(job.job_id), time.monotonic()))

    def get(self, job) -> SlurmJob | None:
        return self.jobs.get(str(job.job_id))

    def poll(self, jobs) -> bool:
        """Update every job of ``jobs`` from one squeue; False when squeue did not answer."""
        states = slurm_states([j.job_id for j in jobs])
        if states is None:
            return False
        now = time.monotonic()
        for j in jobs:
            s = self.add(j)
            if str(j.job_id) not in states:
                s.gone = True
                continue
            s.state, s.reason, nodes = states[str(j.job_id)]
            s.nodes = nodes or s.nodes
            if s.started is None and s.state not in SLURM_ENDED and s.state not in ("PENDING", "CONFIGURING"):
                s.started = now
        return True

    def overdue(self, s: SlurmJob) -> bool:
        """Past its deadline (counted from when it was first seen running; from its submission
        if squeue never answered about it): cancel it (``scancel``, best effort) and say so."""
        if self.time_min is None or s.overdue:
            return bool(s.overdue)
        start = s.started if s.started is not None else (s.submitted if not s.state else None)
        if start is None or time.monotonic() < start + self.time_min * 60 + self.margin:
            return False
        s.overdue, s.deadline_s = s.state or "unknown to squeue", self.time_min * 60 + self.margin
        try:
            subprocess.run(["scancel", s.job_id], capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            pass
        return True


def next_finished(jobs: list, cluster: str, poll: float, watch: SlurmWatch | None = None):
    """The first of ``jobs`` to finish. SLURM: the first to leave the queue (``squeue``: gone,
    or in an ended state, :data:`SLURM_ENDED`), so a trial's tasks have all exited before the
    next trial starts and a job that died without results is seen too; submitit's own check
    needs ``sacct``, which a cluster without accounting storage (scripts/slurm_local.sh's) does
    not answer, and would wait forever for a task that was killed before writing its result
    (a poll where squeue does not answer asks submitit). Or the first past its deadline
    (``watch``: :meth:`SlurmWatch.overdue`; it is cancelled). ``watch`` keeps what squeue
    showed, to name how a job ended (:func:`slurm_end`). Elsewhere:
    ``submitit.helpers.as_completed``. Checked every ``poll`` s (SLURM: at least 1 s, to spare
    the controller)."""
    import submitit.helpers

    if cluster != "slurm":
        return next(submitit.helpers.as_completed(jobs, poll_frequency=poll))
    watch = watch if watch is not None else SlurmWatch()
    while True:
        answered = watch.poll(jobs)
        for j in jobs:
            s = watch.add(j)
            if (s.gone or s.state in SLURM_ENDED) if answered else j.done():
                return j
            if watch.overdue(s):
                return j
        time.sleep(max(poll, 1.0))


RESULT_GRACE_S = 15.0
"""How long a SLURM job that has left the queue may still lack a task's result file (a shared
file system's caching) before the trial fails."""

class SlurmTrialError(RuntimeError):
    """A SLURM job without every task's result; ``state``: how SLURM ended it (:func:`slurm_end`; '' if not known)."""

    def __init__(self, message: str, state: str = ""):
        super().__init__(message)
        self.state = state


def slurm_results(job, grace: float | None = None, watched: SlurmJob | None = None,
                  time_min: float | None = None) -> list:
    """Every task's result of a SLURM job that has left the queue, like ``job.results()`` but
    without its wait (see :func:`next_finished`): a task without a result file after
    ``grace`` s (default :data:`RESULT_GRACE_S`; :data:`ENDED_GRACE_S` when squeue showed it
    ended other than COMPLETED, 0 when the sweep cancelled it at its deadline) is a
    :class:`SlurmTrialError` naming how SLURM ended the job (:func:`slurm_end`), the tasks
    and the first one's log."""
    tasks = [job.task(i) for i in range(job.num_tasks)]
    g = RESULT_GRACE_S if grace is None else grace
    if watched is not None and watched.overdue:
        g = 0.0
    elif watched is not None and watched.state in SLURM_ENDED and watched.state != "COMPLETED":
        g = min(g, ENDED_GRACE_S)
    deadline = time.monotonic() + g
    while missing := [i for i, t in enumerate(tasks) if not t.paths.result_pickle.exists()]:
        if time.monotonic() > deadline:
            state, words = slurm_end(job, watched, time_min)
            what = (f"{words}, without a result from task(s) " if words else
                    f"job {job.job_id} left the queue without a result from task(s) ")
            raise SlurmTrialError(f"{what}{', '.join(map(str, missing))}"
                                  f"{'' if words else ' (killed? time limit?)'}; log: {tasks[missing[0]].paths.stderr}",
                                  state)
        time.sleep(0.5)
    return [t.result() for t in tasks]


def _collect(job, cfg, key, opt, sweep_name, t0, watch: SlurmWatch | None = None) -> TrialOutcome:
    out = TrialOutcome(cfg=cfg, key=key, job_id=str(job.job_id), seconds=time.monotonic() - t0)
    try:
        out.log = str(job.paths.stderr)
    except Exception:
        pass
    watched = watch.get(job) if watch is not None else None
    if watched is not None:
        out.slurm_state = "OVERDUE" if watched.overdue else watched.state
    try:
        res = (slurm_results(job, watched=watched, time_min=opt.time_min) if opt.cluster == "slurm"
               else job.results())[0]
    except Exception as e:
        if isinstance(e, SlurmTrialError) and e.state:
            out.slurm_state = e.state
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        out.error = lines[-1] if lines else type(e).__name__
        return out
    if isinstance(res, _Failure):
        out.error = res.error.splitlines()[0] if res.error else "failed"
        return out
    if res is None:
        out.error = "task 0 returned no result"
        return out
    extra = {"trial_key": key, "sweep": sweep_name, "job_id": out.job_id, "cluster": opt.cluster,
             "train_layout": cfg.train.layout, "pipeline": cfg.transfer.executor.pipeline, "offload": cfg.transfer.executor.offload,
             "memcpy_gbps": res.memcpy_gbps}
    out.rows = [{**row, **extra} for row in res.rows]
    if not all(r.get("verified") in (True, None) for r in out.rows):
        out.error = "verification failed: " + "; ".join(r.get("verify_error", "") for r in out.rows
                                                        if r.get("verified") is False)[:200]
    return out


def run_sweep(sweep: Sweep, opt: LaunchOptions | None = None, *, results_dir: Path = RESULTS_DIR,
              progress: bool = True, console=None, poll: float = 0.5) -> SweepSummary:
    """Run every trial of ``sweep`` not yet in ``results_dir/<sweep>.csv``, ``opt.parallel`` jobs
    at a time, with a rich progress bar (trials done / failed, elapsed). Rows are appended as
    each trial finishes, so an interrupted sweep keeps what it measured. Completion is waited
    for with :func:`next_finished` (checked every ``poll`` seconds; on SLURM until the job has
    left the queue)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .report import append_csv

    opt = opt or LaunchOptions()
    console = console or Console(stderr=True)
    csv = Path(results_dir) / f"{sweep.name}.csv"
    have = done_keys(csv)
    pending, seen = [], set()
    for cfg in sweep.trials:
        k = trial_key(cfg)
        if k not in have and k not in seen:
            pending.append((cfg, k))
        seen.add(k)
    summary = SweepSummary(sweep=sweep.name, csv=csv, total=len(seen), skipped=len(seen) - len(pending))
    for cfg, _ in pending:  # refuse a bad placement before anything runs
        executor_parameters(cfg, opt)
        if opt.cluster != "slurm":  # the ranks start on this machine: the same checks as `run` (C18)
            cfg.preflight(local=True)
    fn = _debug_trial_job if opt.cluster == "debug" else trial_job
    from weight_transfer.security.secret import JobSecret

    fresh = opt.cluster in ("local", "slurm") and JobSecret.from_env() is None  # one secret per trial job
    if opt.cluster in ("local", "slurm"):  # tasks import this project (sbatch exports the environment)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    t_start = time.monotonic()
    columns = [TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("done [green]{task.fields[done]}[/] failed [red]{task.fields[failed]}[/] "
                          "skipped {task.fields[skipped]}"), TimeElapsedColumn(), TextColumn("{task.fields[now]}")]
    with Progress(*columns, console=console, disable=not progress, transient=False) as bar:
        tid = bar.add_task(sweep.name, total=summary.total, completed=summary.skipped, done=0, failed=0,
                           skipped=summary.skipped, now="")
        running: list = []  # (job, cfg, key, t0), at most opt.parallel
        watch = SlurmWatch(opt.time_min) if opt.cluster == "slurm" else None
        while pending or running:
            while pending and len(running) < opt.parallel:
                cfg, k = pending.pop(0)
                bar.update(tid, now=describe(cfg))
                job = submit_with_secret(make_executor(cfg, opt), fn, cfg, str(opt.folder), fresh=fresh)
                running.append((job, cfg, k, time.monotonic()))
                if watch is not None:
                    watch.add(job)
            done = next_finished([r[0] for r in running], opt.cluster, poll, watch)
            i = next(i for i, r in enumerate(running) if r[0] is done)
            job, cfg, k, t0 = running.pop(i)
            out = _collect(job, cfg, k, opt, sweep.name, t0, watch)
            if watch is not None:
                watch.jobs.pop(str(job.job_id), None)
            summary.outcomes.append(out)
            if out.rows:
                append_csv(out.rows, csv)
            if out.ok:
                bar.console.print(f"[green]ok[/]     {describe(cfg)}  ({out.seconds:.0f} s, job {out.job_id})")
            else:
                bar.console.print(f"[red]FAILED[/] {describe(cfg)}: {out.error}\n       log: {out.log}")
            bar.update(tid, advance=1, done=sum(o.ok for o in summary.outcomes), failed=len(summary.failed))
        bar.update(tid, now="")
    summary.seconds = time.monotonic() - t_start
    return summary


def format_summary(s: SweepSummary) -> str:
    ok = len(s.outcomes) - len(s.failed)
    lines = [f"# sweep {s.sweep}: {s.total} trials: {ok} ran ok, {len(s.failed)} failed, {s.skipped} skipped "
             f"(already in {s.csv}); {s.seconds:.0f} s"]
    table = trials_table([o for o in s.outcomes if o.rows])
    if table:
        lines += table
    for o in s.failed:
        lines.append(f"#   FAILED {describe(o.cfg)} [{o.key}]: {o.error}; log: {o.log}")
    return "\n".join(lines)


def trials_table(outcomes: list[TrialOutcome]) -> list[str]:
    """The sweep's per-trial table (the report benchmark users compare, docs/PERFORMANCE.md):
    the cold first update apart, p50 / p95 / max over the warm ones, algbw at p50, the p50 of
    the prepare and write phases, the slowest sender with its GB/s, and whether every update
    verified. One line per trial that produced rows; [] when none did."""
    import statistics

    from .report import percentile

    if not outcomes:
        return []
    out = ["#", f"# {'trial':<44} {'cold':>7} {'p50':>7} {'p95':>7} {'max':>7} {'algbw':>7} {'prep':>7} {'write':>7} "
                f"{'slowest sender':>16} {'verified':>9}",
           f"# {'':<44} {'(s)':>7} {'(s)':>7} {'(s)':>7} {'(s)':>7} {'(GB/s)':>7} {'(s)':>7} {'(s)':>7} "
           f"{'(rank, GB/s)':>16} {'':>9}"]
    for o in outcomes:
        warm = [r for r in o.rows if not r.get("warmup")] or o.rows
        cold = next((r for r in o.rows if r.get("warmup")), None)
        secs = [r["seconds"] for r in warm]
        p50 = statistics.median(secs)

        def med(k, warm=warm):
            vals = [r[k] for r in warm if r.get(k) is not None]
            return statistics.median(vals) if vals else float("nan")
        slow = max(warm, key=lambda r: r["seconds"])
        snd = (f"{slow['slowest_sender']}, {slow['sender_gbps_min']:.3f}" if slow.get("sender_gbps_min") is not None
               else "-")
        ver = all(r.get("verified") for r in o.rows)
        out.append(f"  {describe(o.cfg)[:44]:<44} {cold['seconds'] if cold else float('nan'):>7.3f} {p50:>7.3f} "
                   f"{percentile(secs, 95):>7.3f} {max(secs):>7.3f} {warm[0]['bytes'] / p50 / 1e9:>7.3f} "
                   f"{med('phase_prepare_s'):>7.3f} {med('phase_write_s'):>7.3f} {snd:>16} {'yes' if ver else 'NO':>9}")
    return out
