"""What SLURM says of a sweep's jobs (``experiments/sweep.py`` watches them; docs/SWEEPS.md,
"Failures under SLURM"): the states ``squeue`` lists, and how a job ended when its tasks did not
all return a result, named from squeue's last state, else from slurmstepd's own line in the task
logs, with ``sinfo``'s word on a lost node.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass

SLURM_ENDED = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                         "BOOT_FAIL", "DEADLINE"})
"""``squeue`` states of a job that has ended (``-t all`` lists them for ``MinJobAge`` seconds:
300 by default, 30 on scripts/slurm_local.sh's cluster; then the job is gone from squeue)."""

SLURM_END_NAMES = {"CANCELLED": "cancelled", "TIMEOUT": "time limit", "NODE_FAIL": "node lost",
                   "PREEMPTED": "preempted", "OUT_OF_MEMORY": "out of memory", "BOOT_FAIL": "node failed to boot",
                   "DEADLINE": "deadline", "FAILED": "failed"}
"""The first words of a trial's error when its SLURM job ended in that state without its results."""


@dataclass
class SlurmJob:
    """What the sweep has seen of one SLURM job: the state, reason and nodes ``squeue`` last
    showed, when it was first seen running (monotonic), whether it has left ``squeue -t all``
    altogether, and ``overdue``: the state it was in when the sweep cancelled it at its
    deadline, ``deadline_s`` seconds after it started
    (:meth:`weight_transfer.experiments.sweep.SlurmWatch.overdue`)."""

    job_id: str
    submitted: float
    state: str = ""
    reason: str = ""
    nodes: str = ""
    started: float | None = None
    gone: bool = False
    overdue: str = ""
    deadline_s: float = 0.0


def slurm_states(job_ids) -> dict[str, tuple[str, str, str]] | None:
    """``{job id: (state, reason, nodes)}`` for those of ``job_ids`` that ``squeue -t all`` lists
    (pending, running, completing, and ended ones for ``MinJobAge``); None when squeue does not
    answer."""
    try:
        p = subprocess.run(["squeue", "-h", "--me", "-t", "all", "-o", "%i|%T|%r|%N"], capture_output=True,
                           text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if p.returncode != 0:
        return None
    ids, out = {str(j) for j in job_ids}, {}
    for ln in p.stdout.splitlines():
        f = ln.strip().split("|")
        if len(f) == 4 and f[0] in ids:
            out[f[0]] = (f[1], f[2], f[3])
    return out


_LOG_END = re.compile(r"\*\*\* (?:JOB|STEP) (\d+)(?:\.\S+)? ON (\S+) CANCELLED AT (\S+)(?: DUE TO ([A-Z ]+?))?(?:,[^*]*)? \*\*\*")
_LOG_CAUSE = {None: "CANCELLED", "TIME LIMIT": "TIMEOUT", "NODE FAILURE": "NODE_FAIL", "PREEMPTION": "PREEMPTED"}


def slurm_log_end(job) -> str:
    """How SLURM ended ``job`` by its own line in the task logs (slurmstepd's ``*** JOB 12 ON
    node CANCELLED AT ... [DUE TO TIME LIMIT | NODE FAILURE | PREEMPTION][, ...] ***``): CANCELLED,
    TIMEOUT, NODE_FAIL or PREEMPTED; '' when there is none. For a job squeue no longer lists."""
    for i in range(job.num_tasks):
        try:
            with open(job.task(i).paths.stderr, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - (64 << 10)))
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        for m in _LOG_END.finditer(text):
            if m.group(1) == str(job.job_id):
                return _LOG_CAUSE.get(m.group(4), "CANCELLED")
    return ""


def _node_state(nodes: str) -> str:
    """``sinfo``'s state and reason of ``nodes`` ("down*: Not responding"); '' if it does not answer."""
    try:
        p = subprocess.run(["sinfo", "-h", "-N", "-n", nodes, "-o", "%N %T: %E"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return "; ".join(ln.strip() for ln in p.stdout.splitlines() if ln.strip()) if p.returncode == 0 else ""


def slurm_end(job, s: SlurmJob | None, time_min: float | None = None) -> tuple[str, str]:
    """``(state, words)``: how SLURM ended ``job``, if not by its tasks finishing. The state
    is squeue's last (``s``), else :func:`slurm_log_end`'s ("... , from its log"), or
    ``OVERDUE`` (the sweep cancelled it at its deadline); the words begin with its name
    (:data:`SLURM_END_NAMES`: "cancelled", "time limit", "node lost", ...; "no end from SLURM"
    for OVERDUE). ``("", "")`` when SLURM says it completed or nothing is known."""
    jid = str(job.job_id)
    if s is not None and s.overdue:
        ran = time.monotonic() - (s.started if s.started is not None else s.submitted)
        return "OVERDUE", (f"no end from SLURM: job {jid} was still {s.overdue} {ran:.0f} s after it started, past "
                           f"the sweep's deadline ({s.deadline_s:.0f} s: its time limit + a margin for SLURM to end it); "
                           "the sweep cancelled it (scancel)")
    if s is not None and s.state in SLURM_ENDED:
        state, where = s.state, ""
    else:  # squeue no longer lists it (MinJobAge passed) or did not answer
        state, where = slurm_log_end(job), ", from its log"
    if state in ("", "COMPLETED"):
        return "", ""
    name = SLURM_END_NAMES.get(state, state.lower())
    how = {"CANCELLED": f"job {jid} was cancelled (scancel) before its tasks ended",
           "TIMEOUT": f"job {jid} ran past its time limit" + (f" (--time {time_min:g} min)" if time_min else "")
                      + " and SLURM ended it",
           "NODE_FAIL": f"job {jid} lost its node {s.nodes if s is not None and s.nodes else ''}".rstrip()
                        + " (its slurmd stopped answering); SLURM ends the job's processes there once it is back",
           "FAILED": f"job {jid} ended with a non-zero exit status (a task or the batch script)",
           }.get(state, f"job {jid} ended {state}")
    if state == "NODE_FAIL" and s is not None and s.nodes and (ns := _node_state(s.nodes)):
        how += f"; sinfo: {ns}"
    return state, f"{name}: {how} (SLURM state {state}{where})"
