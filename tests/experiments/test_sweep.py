"""Sweeps: named configs, trial keys, task roles, submitit parameters (SLURM without a
cluster: the sbatch script and a faked JobEnvironment), results and reruns, progress."""
from __future__ import annotations

import io
import os

import pandas as pd
import pytest

from weight_transfer.experiments import configs as C
from weight_transfer.experiments import sweep as S
from weight_transfer.experiments.config import TrialConfig
from weight_transfer.experiments.trial import TrialResult, run_controller, run_task, task_role, world_size


def tiny(**kw) -> TrialConfig:
    kw.setdefault("steps", 1)
    return TrialConfig.from_flat(model="qwen3-0.6b", overrides={"num_hidden_layers": 1, "vocab_size": 1024}, n_train=1, tp=1, **kw)


# ---------------------------------------------------------------- configs


def test_every_named_config_and_sweep_is_valid():
    for name, f in C.CONFIGS.items():
        cfg = f()
        assert isinstance(cfg, TrialConfig), name
        cfg.model_config()
    for name, f in C.SWEEPS.items():
        sw = f()
        assert sw.name == name and len(sw) >= 1
        keys = [S.trial_key(t) for t in sw.trials]
        assert len(set(keys)) == len(keys), f"{name}: duplicate trials"
        for t in sw.trials:
            t.model_config()
    assert {t.run.method for t in C.ci_cpu_regression().trials} == set(C.METHODS)
    assert {t.transfer.executor.watermark for t in C.qwen3_cpu_watermark().trials} >= {None, 4 << 20}
    assert len({(t.train.n_train, t.n_infer) for t in C.qwen3_cpu_world().trials}) >= 4


def test_get_sweep_accepts_config_names_and_names_unknown():
    assert len(C.get_sweep("qwen3_0_6b_cpu_tiny")) == 1
    with pytest.raises(ValueError, match="qwen3_cpu_small"):
        C.get_sweep("nope")


def test_list_cli(capsys):
    from weight_transfer.experiments.command import main

    assert main(["sweep", "--list"]) == 0
    out = capsys.readouterr().out
    for name in list(C.SWEEPS) + list(C.CONFIGS):
        assert name in out


def test_trial_key_is_stable_and_ignores_timeout():
    a = tiny()
    assert S.trial_key(a) == S.trial_key(tiny()) and len(S.trial_key(a)) == 12
    assert S.trial_key(a) == S.trial_key(a.replace(timeout=5.0))
    assert S.trial_key(a) != S.trial_key(a.replace(method="rpc"))
    assert S.trial_key(a) != S.trial_key(a.replace(watermark=1 << 20))


# ---------------------------------------------------------------- tasks of a trial job


def test_task_roles():
    cfg = TrialConfig.from_flat(n_train=2, tp=2, dp=2)
    assert world_size(cfg) == 7
    roles = [task_role(cfg, g) for g in range(7)]
    assert roles == [("controller", 0), ("train", 0), ("train", 1), ("infer", 0), ("infer", 1), ("infer", 2),
                     ("infer", 3)]
    with pytest.raises(ValueError, match="7 tasks"):
        task_role(cfg, 7)


SLURM_ENV = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "18", "SLURM_JOB_NUM_NODES": "2",
             "SLURM_NODEID": "1", "SLURM_PROCID": "12", "SLURM_LOCALID": "3", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_task_env_from_a_faked_slurm_job_environment(monkeypatch):
    """Tasks of a 2-node x 9-task SLURM job for Qwen3-8B 8 -> TP8 (1 + 8 + 8 = 17 tasks; the
    18th idles), read from SLURM's variables by submitit's own JobEnvironment."""
    import submitit

    for k, v in SLURM_ENV.items():
        monkeypatch.setenv(k, v)
    env = submitit.JobEnvironment()
    assert env.cluster == "slurm"
    cfg = TrialConfig.from_flat(model="qwen3-8b", n_train=8, tp=8)
    te = S.task_env(cfg, env)
    assert te["role"] == "infer" and te["rank"] == 3  # 12 = 1 + 8 + 3
    assert te["job_id"] == "4242" and te["node"] == 1 and te["local_rank"] == 3
    assert te["hostnames"] == ["gpu07", "gpu08"] and te["num_nodes"] == 2
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert S.task_env(cfg, submitit.JobEnvironment())["role"] == "controller"
    monkeypatch.setenv("SLURM_PROCID", "17")
    assert S.task_env(cfg, submitit.JobEnvironment())["role"] == "idle"
    with pytest.raises(ValueError, match="at least 33"):
        S.task_env(TrialConfig.from_flat(n_train=16, tp=8, dp=2), submitit.JobEnvironment())


def test_store_address_is_published_in_the_job_folder(tmp_path):
    path = S.store_file(tmp_path, "4242")
    S.publish_store(path, "gpu07", 29511)
    assert path.parent.name == "4242"
    assert S.read_store(path, timeout=1) == ("gpu07", 29511)
    with pytest.raises(TimeoutError, match="task 0"):
        S.read_store(tmp_path / "x" / "store.json", timeout=0.2, poll=0.05)


def test_slurm_parameters_and_sbatch_script(tmp_path):
    """A 2-node job for Qwen3-8B 8 -> TP8 (17 tasks as 2 x 9), partition, GPUs, time: check the
    parameters given to update_parameters, the SlurmExecutor's and the generated sbatch text,
    with slurm mocked by submitit's own test helper (no cluster)."""
    from submitit.slurm.test_slurm import mocked_slurm

    cfg = TrialConfig.from_flat(model="qwen3-8b", n_train=8, tp=8)
    opt = S.LaunchOptions(cluster="slurm", folder=tmp_path, nodes=2, gpus_per_node=8, partition="h100",
                          time_min=20, cpus_per_task=10, slurm_extra={"account": "rl"})
    p = S.executor_parameters(cfg, opt)
    assert p["nodes"] == 2 and p["tasks_per_node"] == 9 and p["gpus_per_node"] == 8
    assert p["slurm_partition"] == "h100" and p["timeout_min"] == 20 and p["cpus_per_task"] == 10
    with mocked_slurm():
        ex = S.make_executor(cfg, opt)
        sp = ex._executor.parameters
        assert sp["partition"] == "h100" and sp["nodes"] == 2 and sp["ntasks_per_node"] == 9
        assert sp["gpus_per_node"] == 8 and sp["time"] == 20
        job = ex.submit(S.trial_job, cfg, str(tmp_path))
        text = job.paths.submission_file.read_text()
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=9", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=h100", "#SBATCH --time=20", "#SBATCH --cpus-per-task=10", "#SBATCH --account=rl"):
        assert line in text, line
    assert "srun" in text


def test_bad_placement_is_refused():
    cfg = TrialConfig.from_flat(n_train=2, tp=2)  # 5 tasks
    with pytest.raises(ValueError, match="needs 5 tasks"):
        S.executor_parameters(cfg, S.LaunchOptions(cluster="slurm", nodes=2, tasks_per_node=2))
    with pytest.raises(ValueError, match="every node"):
        S.executor_parameters(cfg, S.LaunchOptions(cluster="slurm", nodes=2, tasks_per_node=5))
    assert S.executor_parameters(cfg, S.LaunchOptions(cluster="slurm", nodes=2))["tasks_per_node"] == 3
    with pytest.raises(ValueError, match="one node"):
        S.LaunchOptions(cluster="local", nodes=2)
    assert S.executor_parameters(cfg, S.LaunchOptions(cluster="local"))["tasks_per_node"] == 5
    assert S.executor_parameters(cfg, S.LaunchOptions(cluster="debug"))["tasks_per_node"] == 1


# ---------------------------------------------------------------- sweeps end to end (debug executor, faked trials)


def _fake_result(cfg: TrialConfig, *, verified=True) -> TrialResult:
    rows = [{"run_id": "r", "method": cfg.run.method, "model": "m", "n_train": cfg.train.n_train, "n_infer": cfg.n_infer,
             "layout": cfg.inference.describe(), "watermark": cfg.transfer.executor.watermark, "step": s, "warmup": s == 1,
             "bytes": 1000, "seconds": 0.5, "verified": verified, "peak_temp_bytes": 10} for s in (1, 2)]
    return TrialResult(cfg, rows, "plan", 0.0, 1.0, {})


def test_sweep_writes_rows_reports_failures_and_skips_on_rerun(tmp_path, monkeypatch):
    trials = [tiny(method="reference"), tiny(method="rank0_funnel"), tiny(method="rpc")]
    sweep = C.Sweep(name="t", trials=trials)
    calls = []

    def fake(cfg, folder):
        calls.append(cfg.run.method)
        if cfg.run.method == "rpc":
            raise RuntimeError("rpc worker died")
        return _fake_result(cfg)

    monkeypatch.setattr(S, "trial_job", fake)
    from rich.console import Console

    buf = io.StringIO()
    opt = S.LaunchOptions(cluster="debug", folder=tmp_path / "jobs")
    s = S.run_sweep(sweep, opt, results_dir=tmp_path, console=Console(file=buf, width=200), poll=0.01)
    out = buf.getvalue()
    assert calls == ["reference", "rank0_funnel", "rpc"]
    assert len(s.failed) == 1 and "rpc worker died" in s.failed[0].error and s.failed[0].log
    assert "FAILED" in out and "log:" in out and "done 2" in out and "failed 1" in out
    df = pd.read_csv(tmp_path / "t.csv")
    assert len(df) == 4 and set(df["method"]) == {"reference", "rank0_funnel"}
    assert set(df["trial_key"]) == {S.trial_key(trials[0]), S.trial_key(trials[1])}
    for col in ("sweep", "job_id", "cluster", "memcpy_gbps"):
        assert df[col].notna().all(), col
    summary = S.format_summary(s)
    assert "FAILED" in summary
    # the per-trial table: cold update apart, warm p50/p95/max, phases, slowest sender, verified
    assert "cold" in summary and "p95" in summary and "slowest sender" in summary
    trial_lines = [line for line in summary.splitlines() if line.startswith("  ")]
    assert len(trial_lines) == 2 and all(line.split()[-1] == "yes" for line in trial_lines)
    # rerun: the two trials in the CSV are skipped, the failed one runs again
    calls.clear()
    s2 = S.run_sweep(sweep, opt, results_dir=tmp_path, progress=False, poll=0.01)
    assert calls == ["rpc"] and s2.skipped == 2


def test_sweep_cli_exit_status_and_bad_options(tmp_path, monkeypatch, capsys):
    from weight_transfer.experiments.command import main

    assert main(["sweep", "qwen3_cpu_small", "--cluster", "slurm", "--nodes", "2", "--tasks-per-node", "1"]) == 2
    assert "needs" in capsys.readouterr().err
    monkeypatch.setattr(S, "trial_job", lambda cfg, folder: _fake_result(cfg, verified=False))
    rc = main(["sweep", "qwen3_0_6b_cpu_tiny", "--cluster", "debug", "--results-dir", str(tmp_path),
               "--folder", str(tmp_path / "jobs"), "--no-progress"])
    assert rc == 1 and "verification failed" in capsys.readouterr().out


# ---------------------------------------------------------------- the real thing: submitit local executor


def _record_secrets(monkeypatch) -> list[str]:
    """The hex of every job secret made from now on (JobSecret.generate recorded), with no
    secret in this process's environment to start with."""
    from weight_transfer.security.secret import ENV_SECRET, ENV_SECRET_FILE, JobSecret

    monkeypatch.delenv(ENV_SECRET, raising=False)
    monkeypatch.delenv(ENV_SECRET_FILE, raising=False)
    made, real = [], JobSecret.generate.__func__

    def generate(cls):
        sec = real(cls)
        made.append(sec.hex())
        return sec
    monkeypatch.setattr(JobSecret, "generate", classmethod(generate))
    return made


def test_each_trial_job_is_submitted_with_a_fresh_secret_in_its_environment(monkeypatch):
    """The controller is one of the job's tasks, so the secret exists before the job: each
    submission sees a fresh one in the environment its tasks inherit, and the sweep's own
    environment is left as it was; a secret the user set is used as is."""
    from weight_transfer.security.secret import ENV_SECRET, JobSecret

    made = _record_secrets(monkeypatch)

    class Executor:
        seen: list = []

        def submit(self, fn, *args):
            self.seen.append(os.environ.get(ENV_SECRET))
            return fn(*args)

    ex = Executor()
    assert S.submit_with_secret(ex, lambda a, b: a + b, 1, 2) == 3
    S.submit_with_secret(ex, lambda: None)
    assert ex.seen == made and len(set(made)) == 2 and all(JobSecret.parse(h).hex() == h for h in made)
    assert ENV_SECRET not in os.environ
    mine = JobSecret.generate().hex()
    monkeypatch.setenv(ENV_SECRET, mine)
    S.submit_with_secret(ex, lambda: None, fresh=False)
    S.submit_with_secret(ex, lambda: None)  # fresh for this job, the user's restored after
    assert ex.seen[2] == mine and ex.seen[3] not in (mine, None) and os.environ[ENV_SECRET] == mine


def test_the_secret_is_not_in_the_sbatch_script(tmp_path, monkeypatch):
    """SLURM: the secret reaches the tasks through sbatch's exported environment, never the
    submission file (a file in the job folder others may read)."""
    from submitit.slurm.test_slurm import mocked_slurm

    made = _record_secrets(monkeypatch)
    cfg = TrialConfig.from_flat(n_train=2, tp=2)
    opt = S.LaunchOptions(cluster="slurm", folder=tmp_path, nodes=1)
    with mocked_slurm():
        job = S.submit_with_secret(S.make_executor(cfg, opt), S.trial_job, cfg, str(tmp_path))
        text = job.paths.submission_file.read_text()
    assert len(made) == 1 and made[0] not in text


@pytest.mark.multiproc
def test_local_executor_runs_a_trial_as_one_job_with_one_task_per_rank(tmp_path, monkeypatch):
    """Controller + 1 training + 1 inference rank as the 3 tasks of one local submitit job;
    the store address travels through the job folder, the job secret through the tasks'
    environment (made by the sweep, in no file of the job folder); every update verified."""
    from weight_transfer.security.secret import ENV_SECRET

    made = _record_secrets(monkeypatch)
    cfg = tiny(steps=1, warmup=1, timeout=90.0)
    opt = S.LaunchOptions(cluster="local", folder=tmp_path / "jobs", time_min=5)
    s = S.run_sweep(C.Sweep(name="local", trials=[cfg]), opt, results_dir=tmp_path, progress=False)
    assert not s.failed, s.failed and s.failed[0].error + " " + s.failed[0].log
    df = pd.read_csv(tmp_path / "local.csv")
    assert len(df) == 2 and df["verified"].all() and (df["cluster"] == "local").all()
    job_dir = tmp_path / "jobs" / str(df["job_id"].iloc[0])
    assert (job_dir / "store.json").exists()
    assert len(list(job_dir.glob("*_log.err"))) == 3  # one log per task
    assert len(made) == 1 and ENV_SECRET not in os.environ
    for f in (tmp_path / "jobs").rglob("*"):
        assert not f.is_file() or made[0].encode() not in f.read_bytes(), f


def test_run_controller_and_run_task_exist_with_their_signatures():
    import inspect

    assert list(inspect.signature(run_controller).parameters)[:4] == ["cfg", "store", "liveness_train",
                                                                      "liveness_infer"]
    assert list(inspect.signature(run_task).parameters)[:4] == ["cfg", "global_rank", "store_host", "store_port"]
    assert os.environ.get("SUBMITIT_EXECUTOR") is None


def test_a_task_0_without_the_job_secret_is_refused_before_serving(monkeypatch):
    """run_task's controller does not make a secret the job's other tasks could never learn:
    without one in its environment it refuses at once, naming how to pass it."""
    from weight_transfer.security.secret import AuthenticationError

    _record_secrets(monkeypatch)
    monkeypatch.delenv("WEIGHT_TRANSFER_INSECURE", raising=False)
    with pytest.raises(AuthenticationError, match="trial task 0 .*WEIGHT_TRANSFER_SECRET"):
        run_task(tiny(), 0, "127.0.0.1", 0)
