"""Sweeps on a real SLURM cluster (``bash scripts/slurm_local.sh start``: one node, this host):
real sbatch, real srun tasks that find their role from SLURM_* variables, rows like a local
run's, nothing left in the queue. Skipped (tests/conftest.py) without sbatch or an idle node."""
from __future__ import annotations

import os

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
