"""A real SLURM cluster for the ``slurm``-marked tests (``scripts/slurm_local.sh start``):
what squeue says, the CLI run as a subprocess, a trial function whose task 1 dies; for the
failures under SLURM (docs/SWEEPS.md): a slow trial, a job's processes on this host, a sweep in
a thread with its output lines timed, and slurmd stopped and started again.

Trial functions here are pickled by reference (module ``tests.helpers.slurm``): the job's
tasks import them from the checkout, which the sweep puts on ``PYTHONPATH``."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import ROOT


def queued(job_ids) -> list[str]:
    """The lines of ``squeue -h`` (``JOBID NAME STATE``) for the given job ids."""
    ids = {str(j) for j in job_ids}
    out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, check=True).stdout
    return [ln for ln in out.splitlines() if ln.split() and ln.split()[0] in ids]


def sweep_cli(name: str, cluster: str, results: Path, folder: Path, *extra: str,
              timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    """``weight-transfer sweep NAME --cluster CLUSTER --no-progress`` as a subprocess, its own
    environment (run_sweep sets PYTHONPATH); returns (the finished process, its wall time)."""
    cmd = [sys.executable, "-m", "weight_transfer.experiments", "sweep", name, "--cluster", cluster, "--no-progress",
           "--results-dir", str(results), "--folder", str(folder), *extra]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def task_1_dies(cfg, folder):
    """Stands in for ``sweep.trial_job``: task 1 exits hard (no result file, as when a rank is
    killed or runs out of memory), the other tasks return None at once."""
    import submitit

    if submitit.JobEnvironment().global_rank == 1:
        os._exit(3)
    return None


# ---------------------------------------------------------------- failures under SLURM

SLOW_STEPS = 987_654
"""A trial with this many steps is :func:`slow_trial`'s slow one (a key of its own)."""


def slow_trial(cfg, folder):
    """Stands in for ``sweep.trial_job``: the trial with ``steps=SLOW_STEPS`` is a trial that
    runs long, every task of its job sleeping (a job SLURM cancels, times out or loses the
    node of, without the CPU of a real trial beside the other work on a small box); any other
    trial runs the real ``trial_job``."""
    import submitit

    from weight_transfer.experiments import sweep

    if cfg.run.steps != SLOW_STEPS:
        return sweep.trial_job(cfg, folder)
    env = submitit.JobEnvironment()
    print(f"[task {env.global_rank}] slow trial (job {env.job_id})", file=sys.stderr, flush=True)
    time.sleep(3600)
    return None


def no_trial(cfg, folder):
    """Stands in for ``sweep.trial_job`` in a rerun: every task returns at once (the trial
    fails with "task 0 returned no result"); the rerun shows which trials it started."""
    return None


def job_processes(job_id) -> list[tuple[int, str]]:
    """(pid, command line) of this host's live processes of SLURM job ``job_id``: those whose
    environment has ``SLURM_JOB_ID=<id>`` (the batch script, srun, every task and what it
    started) and its ``slurmstepd: [<id>.<step>]`` processes. Zombies are skipped."""
    tag, stepd = f"SLURM_JOB_ID={job_id}".encode(), f"slurmstepd: [{job_id}."
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            if cmd.startswith(stepd) or tag in (d / "environ").read_bytes().split(b"\0"):
                out.append((int(d.name), cmd))
        except (OSError, IndexError):
            continue
    return out


def wait_no_job_processes(job_id, seconds: float = 30.0) -> list[tuple[int, str]]:
    """:func:`job_processes` once none are left, or what is left after ``seconds``."""
    deadline = time.monotonic() + seconds
    while (left := job_processes(job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def job_of(key: str) -> tuple[str, str] | None:
    """(job id, state) of the queued job of trial ``key`` (the sweep names it ``wt-<method>-<key>``)."""
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i %j %T"], capture_output=True, text=True).stdout
    for ln in out.splitlines():
        f = ln.split()
        if len(f) == 3 and f[1].endswith(f"-{key}") and f[2] not in ("COMPLETED", "CANCELLED", "TIMEOUT",
                                                                      "NODE_FAIL", "FAILED"):
            return f[0], f[2]
    return None


def wait_started(key: str, folder: Path, tasks: int, timeout: float = 180.0) -> str:
    """Wait until the job of trial ``key`` runs and each of its ``tasks`` tasks has logged its
    ``[task N]`` line (the trial function is running in every task); its job id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        j = job_of(key)
        if j and j[1] == "RUNNING":
            logs = [folder / j[0] / f"{j[0]}_{t}_log.err" for t in range(tasks)]
            if all(p.exists() and f"[task {t}]" in p.read_text(errors="replace") for t, p in enumerate(logs)):
                return j[0]
        time.sleep(0.5)
    raise TimeoutError(f"the job of trial {key} did not start its {tasks} tasks in {timeout:.0f} s: {queued_all()}")


def queued_all() -> str:
    return subprocess.run(["squeue"], capture_output=True, text=True).stdout


class Lines:
    """A file for rich's Console that keeps every write with its time (time.time()), so a test
    can wait for the sweep's line about a trial and know when it came."""

    def __init__(self):
        self.writes: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.writes.append((time.time(), text))
        return len(text)

    def flush(self) -> None:
        pass

    def text(self) -> str:
        with self._lock:
            return "".join(t for _, t in self.writes)

    def wait_for(self, needle: str, timeout: float) -> tuple[float, str]:
        """(time written (time.time()), line) of the first line containing ``needle``; TimeoutError after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                writes = list(self.writes)
            text, starts = "", []
            for t, s in writes:
                starts.append((len(text), t))
                text += s
            i = text.find(needle)
            if i >= 0:
                end = text.find("\n", i)
                return (max(t for off, t in starts if off <= i),
                        text[text.rfind("\n", 0, i) + 1:len(text) if end < 0 else end])
            if time.monotonic() > deadline:
                raise TimeoutError(f"no line with {needle!r} in the sweep's output after {timeout:.0f} s:\n{text}")
            time.sleep(0.2)


class SweepThread(threading.Thread):
    """``sweep.run_sweep`` in a thread (no progress bar), its console lines in :attr:`lines`;
    :attr:`summary` (or :attr:`error`) once it returns."""

    def __init__(self, sweep, opt, results_dir: Path):
        super().__init__(daemon=True)
        from rich.console import Console

        self.lines = Lines()
        self.console = Console(file=self.lines, width=400, force_terminal=False, color_system=None)
        self.args = (sweep, opt, results_dir)
        self.summary = self.error = None

    def run(self) -> None:
        from weight_transfer.experiments import sweep as S

        sweep, opt, results_dir = self.args
        try:
            self.summary = S.run_sweep(sweep, opt, results_dir=results_dir, progress=False, console=self.console,
                                       poll=0.5)
        except BaseException as e:  # handed to the test (result)
            self.error = e

    def result(self, timeout: float):
        self.join(timeout)
        assert not self.is_alive(), f"the sweep did not return in {timeout:.0f} s:\n{self.lines.text()}\n{queued_all()}"
        if self.error is not None:
            raise self.error
        return self.summary


WT_SLURM_DIR = Path(os.environ.get("WT_SLURM_DIR", "/var/lib/wt-slurm"))


def stop_slurmd(timeout: float = 20.0) -> int:
    """Stop this host's slurmd alone (SIGTERM to the pid in scripts/slurm_local.sh's pid file;
    the job steps' slurmstepd processes stay); its pid, once it has exited."""
    pid = int((WT_SLURM_DIR / "run" / "slurmd.pid").read_text().split()[0])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if Path(f"/proc/{pid}").exists():
        raise RuntimeError(f"slurmd ({pid}) did not exit {timeout:.0f} s after SIGTERM")
    return pid


def start_cluster() -> subprocess.CompletedProcess:
    """``bash scripts/slurm_local.sh start`` (idempotent: starts what is not running, waits
    until the node is idle)."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "slurm_local.sh"), "start"], capture_output=True, text=True,
                          timeout=180)


def job_start(job_id) -> float:
    """When SLURM started job ``job_id`` (``scontrol show job``'s StartTime, epoch seconds)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                         check=True).stdout
    start = next(f.split("=", 1)[1] for f in out.split() if f.startswith("StartTime="))
    return time.mktime(time.strptime(start, "%Y-%m-%dT%H:%M:%S"))


def wait_alone(job_id, timeout: float = 180.0) -> list[str]:
    """Wait until no job but ``job_id`` is running or completing on the cluster (before slurmd
    is stopped under it: another session's job would lose its node too); what still runs
    after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        out = subprocess.run(["squeue", "-h", "-t", "RUNNING,COMPLETING,CONFIGURING", "-o", "%i %j %T"],
                             capture_output=True, text=True).stdout
        others = [ln for ln in out.splitlines() if ln.split() and ln.split()[0] != str(job_id)]
        if not others or time.monotonic() > deadline:
            return others
        time.sleep(1.0)


def rerun(sweep, opt, results_dir: Path):
    """The same sweep again, each trial job running :func:`no_trial` (a few seconds each): the
    summary shows what a rerun skips (already in the CSV) and which trials it starts again."""
    from weight_transfer.experiments import sweep as S

    real, S.trial_job = S.trial_job, no_trial
    try:
        return S.run_sweep(sweep, opt, results_dir=results_dir, progress=False, poll=0.5)
    finally:
        S.trial_job = real


def cancel_trial(key: str) -> None:
    """``scancel`` the queued job of trial ``key``, if any (a test's cleanup: a slow trial's job
    would otherwise sleep on until its time limit)."""
    if (j := job_of(key)) is not None:
        subprocess.run(["scancel", j[0]], capture_output=True)
