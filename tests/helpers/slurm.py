"""A real SLURM cluster for the ``slurm``-marked tests (``scripts/slurm_local.sh start``):
what squeue says, the CLI run as a subprocess, and a trial function whose task 1 dies.

Trial functions here are pickled by reference (module ``tests.helpers.slurm``): the job's
tasks import them from the checkout, which the sweep puts on ``PYTHONPATH``."""
from __future__ import annotations

import os
import subprocess
import sys
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
