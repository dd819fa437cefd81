"""Sweeps on a real SLURM cluster (``bash scripts/slurm_local.sh start``: one node, this host):
real sbatch, real srun tasks that find their role from SLURM_* variables, rows like a local
run's, nothing left in the queue. Skipped (tests/conftest.py) without sbatch or an idle node."""
from __future__ import annotations

import os
import subprocess
import time

import pandas as pd
import pytest

from tests.helpers import slurm as H
from weight_transfer.experiments import configs as C
from weight_transfer.experiments import sweep as S

pytestmark = pytest.mark.slurm


def test_ci_sweep_runs_through_sbatch_and_srun(tmp_path):
    """``weight-transfer sweep ci_cpu_regression --cluster slurm``: 3 trials (one job each, 5
    tasks: controller + 2 training + 2 inference ranks), every row verified, the columns of a
    local run (one tiny local trial), one log per task, the queue empty afterwards."""
    p, wall = H.sweep_cli("ci_cpu_regression", "slurm", tmp_path / "rows", tmp_path / "jobs")
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "3 ran ok, 0 failed" in p.stdout, p.stdout
    df = pd.read_csv(tmp_path / "rows" / "ci_cpu_regression.csv")
    assert df["trial_key"].nunique() == 3 and set(df["method"]) == set(C.METHODS)
    assert df["verified"].all() and (df["cluster"] == "slurm").all()
    job_ids = sorted(df["job_id"].astype(str).unique())
    assert len(job_ids) == 3
    for j in job_ids:  # submitit's sbatch script, srun's one log per task, the store address
        d = tmp_path / "jobs" / j
        script = (d / f"{j}_submission.sh").read_text()
        assert "#SBATCH --ntasks-per-node=5" in script and "srun " in script
        assert len(list(d.glob(f"{j}_*_log.err"))) == 5 and (d / "store.json").exists()
        # task 3 is inference rank 0, by SLURM_PROCID
        assert "[task 3] infer 0" in (d / f"{j}_3_log.err").read_text()
    assert H.queued(job_ids) == []  # the sweep returns once its jobs have left the queue

    lp, _ = H.sweep_cli("qwen3_0_6b_cpu_tiny", "local", tmp_path / "local", tmp_path / "local_jobs")
    assert lp.returncode == 0, lp.stdout + lp.stderr[-3000:]
    local = pd.read_csv(tmp_path / "local" / "qwen3_0_6b_cpu_tiny.csv")
    assert set(df.columns) == set(local.columns)
    print(f"slurm sweep: {wall:.0f} s")


def test_a_task_that_dies_without_a_result_fails_its_trial_and_the_sweep_goes_on(tmp_path, monkeypatch):
    """Without accounting storage (sacct does not answer) submitit alone would wait forever for
    task 1's result; the sweep sees the job leave the queue and reports the trial failed."""
    monkeypatch.setattr(S, "trial_job", H.task_1_dies)
    monkeypatch.setattr(S, "RESULT_GRACE_S", 1.0)  # the result files are local: no need to wait 15 s
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # run_sweep adds the checkout; restored after
    cfg = C.get_sweep("qwen3_0_6b_cpu_tiny").trials[0]  # 3 tasks
    opt = S.LaunchOptions(cluster="slurm", folder=tmp_path / "jobs", time_min=5)
    s = S.run_sweep(C.Sweep(name="dies", trials=[cfg, cfg.replace(method="rpc")]), opt, results_dir=tmp_path,
                    progress=False, poll=0.2)
    assert len(s.outcomes) == 2 and len(s.failed) == 2, s.outcomes
    for o in s.failed:
        assert "without a result from task(s) 1" in o.error, o.error
    assert H.queued([o.job_id for o in s.outcomes]) == []
    assert not (tmp_path / "dies.csv").exists()


# ---------------------------------------------------------------- failures under SLURM (docs/SWEEPS.md)
# Each: a sweep of [the trial that fails, a tiny real trial] in a thread; the fault; the sweep's
# named FAILED line within a bound (the time it took printed: docs/SWEEPS.md's table); the next
# trial ran ok; no process of the failed job left on this host; a rerun starts exactly the
# failed trial again. The trial that fails in (b) and (c) is H.slow_trial's (every task sleeps:
# no CPU for a minute or two); the trial cancelled in (a) and every next trial are real.


def _tiny():
    return C.get_sweep("qwen3_0_6b_cpu_tiny").trials[0]  # 3 tasks: controller, 1 training, 1 inference


def _after(s, failed, ok, job, tmp_path, name, sweep, opt, state):
    """The checks every failure shares, once the sweep has returned."""
    assert [o.key for o in s.outcomes] == [S.trial_key(failed), S.trial_key(ok)], s.outcomes
    bad, good = s.outcomes
    assert not bad.ok and bad.slurm_state == state and bad.job_id == job and not bad.rows, bad
    assert good.ok and good.rows, good
    assert H.wait_no_job_processes(job, 30) == []
    assert H.queued([bad.job_id, good.job_id]) == []
    df = pd.read_csv(tmp_path / f"{name}.csv")
    assert set(df["trial_key"].astype(str)) == {S.trial_key(ok)}
    again = H.rerun(sweep, opt, tmp_path)  # resumes exactly the trial that did not complete
    assert again.skipped == 1 and [o.key for o in again.outcomes] == [S.trial_key(failed)], again.outcomes


def test_scancel_of_a_running_trial_is_named_cancelled_and_the_sweep_goes_on(tmp_path, monkeypatch, request):
    """(a) ``scancel`` of a running (real) trial's job: SLURM sends SIGTERM (submitit's tasks
    log and bypass it), SIGKILL after KillWait; the job leaves the queue CANCELLED and the
    sweep says so at once ("cancelled: ..."), then runs the next trial."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    failed, ok = _tiny().replace(steps=100_000), _tiny()
    sweep = C.Sweep(name="cancel", trials=[failed, ok])
    request.addfinalizer(lambda: H.cancel_trial(S.trial_key(failed)))
    opt = S.LaunchOptions(cluster="slurm", folder=tmp_path / "jobs", time_min=5)
    th = H.SweepThread(sweep, opt, tmp_path)
    th.start()
    job = H.wait_started(S.trial_key(failed), opt.folder, 3)
    time.sleep(3)  # the controller is driving its updates
    t0 = time.time()
    subprocess.run(["scancel", job], check=True)
    t, line = th.lines.wait_for("FAILED", timeout=60)
    assert f"cancelled: job {job} was cancelled (scancel)" in line and "SLURM state CANCELLED" in line, line
    assert t - t0 < 45, (t - t0, line)
    s = th.result(timeout=300)
    _after(s, failed, ok, job, tmp_path, "cancel", sweep, opt, "CANCELLED")
    print(f"{line}\nscancel -> named line: {t - t0:.1f} s")


@pytest.mark.long
def test_a_trial_past_its_time_limit_is_named_time_limit_and_the_sweep_goes_on(tmp_path, monkeypatch, request):
    """(b) ``--time 1`` and a trial that runs on: SLURM ends the job at its limit (its
    periodic check: up to ~30 s late, then KillWait) in state TIMEOUT; the sweep says "time
    limit: ..." and runs the next trial (a real one, within the same minute). No USR2 warning
    kills a task at start (the sweep submits with a signal delay of 0)."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(S, "trial_job", H.slow_trial)
    failed, ok = _tiny().replace(steps=H.SLOW_STEPS), _tiny()
    sweep = C.Sweep(name="timeout", trials=[failed, ok])
    request.addfinalizer(lambda: H.cancel_trial(S.trial_key(failed)))
    opt = S.LaunchOptions(cluster="slurm", folder=tmp_path / "jobs", time_min=1)
    th = H.SweepThread(sweep, opt, tmp_path)
    th.start()
    job = H.wait_started(S.trial_key(failed), opt.folder, 3)
    start = H.job_start(job)
    t, line = th.lines.wait_for("FAILED", timeout=240)
    assert f"time limit: job {job} ran past its time limit (--time 1 min) and SLURM ended it" in line, line
    assert "SLURM state TIMEOUT" in line, line
    assert 60 <= t - start < 150, (t - start, line)
    s = th.result(timeout=300)
    _after(s, failed, ok, job, tmp_path, "timeout", sweep, opt, "TIMEOUT")
    log = (opt.folder / job / f"{job}_0_log.err").read_text()
    assert "DUE TO TIME LIMIT" in log and "SIGUSR2" not in log
    print(f"{line}\njob start -> named line: {t - start:.1f} s ({t - start - 60:.1f} s past the 1 min limit)")


@pytest.mark.long
def test_slurmd_stopped_under_a_running_trial_is_named_node_lost_and_the_sweep_goes_on(tmp_path, monkeypatch,
                                                                                        request):
    """(c) slurmd stopped (its pid file) under a running trial: the tasks keep running (slurmstepd
    needs no slurmd); SLURM declares the node down after SlurmdTimeout (30 s here) and ends the
    job NODE_FAIL (not requeued: --no-requeue); the sweep says "node lost: ..." and goes on; the
    next trial waits in the queue until slurmd is back (``slurm_local.sh start``), and then SLURM
    ends the lost job's processes (SIGTERM, KillWait, SIGKILL) and runs the next trial."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(S, "trial_job", H.slow_trial)
    failed, ok = _tiny().replace(steps=H.SLOW_STEPS), _tiny()
    sweep = C.Sweep(name="nodelost", trials=[failed, ok])
    request.addfinalizer(lambda: H.cancel_trial(S.trial_key(failed)))
    opt = S.LaunchOptions(cluster="slurm", folder=tmp_path / "jobs", time_min=10)
    th = H.SweepThread(sweep, opt, tmp_path)
    th.start()
    job = H.wait_started(S.trial_key(failed), opt.folder, 3)
    if others := H.wait_alone(job):
        subprocess.run(["scancel", job])
        pytest.skip(f"other jobs run on the cluster; not stopping its slurmd under them: {others}")
    request.addfinalizer(H.start_cluster)  # the cluster is left up, whatever happens
    t0 = time.time()
    H.stop_slurmd()
    t, line = th.lines.wait_for("FAILED", timeout=240)
    assert f"node lost: job {job} lost its node" in line and "SLURM state NODE_FAIL" in line, line
    assert t - t0 < 180, (t - t0, line)
    assert H.job_processes(job), "the lost job's tasks kept running while slurmd was away"
    p = H.start_cluster()
    assert p.returncode == 0, p.stderr
    t_back = time.time()
    assert H.wait_no_job_processes(job, 60) == []
    t_gone = time.time()
    s = th.result(timeout=300)
    _after(s, failed, ok, job, tmp_path, "nodelost", sweep, opt, "NODE_FAIL")
    print(f"{line}\nslurmd stopped -> named line: {t - t0:.1f} s; slurmd back -> the lost job's processes gone: "
          f"{t_gone - t_back:.1f} s")


def test_a_job_slurm_does_not_end_is_cancelled_at_the_sweeps_deadline(tmp_path, monkeypatch, request):
    """The sweep's own bound, for a job SLURM has lost track of (slurmctld or slurmd not
    answering, a job stuck completing): ``--time`` + SLURM_DEADLINE_MARGIN_S after it was seen
    running, the sweep cancels it and names it "no end from SLURM"; here the margin is made
    negative so that a job well inside its 1 min limit is past that deadline 15 s in (and set
    back once the line is there: the next trial, a real one, takes about that long)."""
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr(S, "trial_job", H.slow_trial)
    monkeypatch.setattr(S, "SLURM_DEADLINE_MARGIN_S", -45.0)
    failed, ok = _tiny().replace(steps=H.SLOW_STEPS), _tiny()
    sweep = C.Sweep(name="overdue", trials=[failed, ok])
    request.addfinalizer(lambda: H.cancel_trial(S.trial_key(failed)))
    opt = S.LaunchOptions(cluster="slurm", folder=tmp_path / "jobs", time_min=1)
    th = H.SweepThread(sweep, opt, tmp_path)
    th.start()
    job = H.wait_started(S.trial_key(failed), opt.folder, 3)
    start = H.job_start(job)
    t, line = th.lines.wait_for("FAILED", timeout=120)
    monkeypatch.setattr(S, "SLURM_DEADLINE_MARGIN_S", 120.0)  # not for the next trial (read at each check)
    assert f"no end from SLURM: job {job} was still RUNNING" in line and "the sweep cancelled it" in line, line
    assert 14 <= t - start < 30, (t - start, line)
    s = th.result(timeout=300)
    _after(s, failed, ok, job, tmp_path, "overdue", sweep, opt, "OVERDUE")
    print(f"{line}\njob start -> named line: {t - start:.1f} s (deadline 15 s)")
