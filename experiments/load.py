"""How loaded the machine was while a measurement ran: the load columns of every result row.

The CPU machines this harness runs on are shared: another job on the same cores slows every
method, and not equally, so a row measured under load bends the ratios quoted from it. Every
row of ``weight-transfer run`` (each method of ``--method all``, ``--engine vllm``),
``bench-peers`` and ``bench-trl`` carries four columns (docs/PERFORMANCE.md "Load").

Why ``/proc`` is read here and not through ``psutil`` (whose ``cpu_times`` and
``Process.children(recursive=True)`` give the same figures): ``psutil`` is not a dependency of the
project's own install (only vLLM's and the peers' extras pull it), and the two reads it would
replace are a few dozen lines; where ``/proc`` is missing the columns are empty, as they would be.

The columns:

- ``load_avg_1m``: ``os.getloadavg()[0]``, the machine's 1-minute load average (runnable plus
  uninterruptible tasks, exponentially averaged by the kernel), sampled right before the
  measured work starts: before a trial spawns its ranks, before a peer's row, before a TRL job.
  It counts every task on the machine, this harness's own included: a trial started right after
  another one (the second method of ``--method all``) inherits the first one's load for about a
  minute. NaN where the platform has no load average.
- ``cpus``: the CPUs the load is a fraction of: those this process may run on (its affinity),
  as ``/proc/stat`` lists them; ``os.cpu_count()`` where there is no ``/proc/stat``.
- ``other_cpu``: the fraction of those CPUs (0..1) that processes *outside* the measurement's
  own process tree kept busy during the measured window: (busy CPU seconds of those CPUs in
  ``/proc/stat``: user + nice + system + irq + softirq, steal and idle / iowait left out) minus
  (CPU seconds of the own tree: the controller and every live descendant, each one's
  ``utime + stime + cutime + cstime`` from ``/proc/<pid>/stat``, so a descendant that exited and
  was reaped inside the tree stays counted through its parent), over wall seconds x ``cpus``;
  clamped to 0..1. The window is one update for ``weight-transfer run`` (from just before its
  "go" to its completion), a whole row for ``bench-peers`` (start to end of that peer's
  processes, warm-up and set-up included) and a whole job for ``bench-trl`` (start to end of
  the job's process).
- ``own_cpu``: the own tree's CPU seconds over the same window, as the same fraction.

Limits of ``other_cpu``: ``/proc/stat`` is sampled per clock tick (``1 / SC_CLK_TCK`` s, 10 ms)
and each process's seconds are truncated to a tick, so a window of a quarter second on 2 CPUs
(50 ticks) is good to a few hundredths and one of 10 ms says next to nothing; the report weights
each update by its seconds. Kernel threads working for the trial (``ksoftirqd`` for loopback
TCP, kworkers) count as other;
a descendant that leaves the tree (a daemon re-parented to init, a child reaped without
``wait``) takes its seconds out of the own tree, which then overstates the others; where
``/proc/stat`` counts a tick's irq time separately from the interrupted task's ``stime`` the two
do not match exactly (hence the clamp at 0). Inside a container with a CPU quota rather than a
cpuset, another tenant's work on the same CPUs counts as other (it does slow the measurement).
Without ``/proc`` (not Linux), or when the own tree is not this machine's processes (a trial's
ranks started as separate tasks by submitit or SLURM), ``other_cpu`` and ``own_cpu`` are NaN.

:func:`judge` says whether a row's load bent it (:data:`LOADED_OTHER_CPU`,
:data:`LOADED_LOAD_PER_CPU`); ``weight-transfer report`` shows it in the README's table.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

NAN = float("nan")
COLUMNS = ("load_avg_1m", "cpus", "other_cpu", "own_cpu")
"""The load columns of a result row (module docstring)."""
LOADED_OTHER_CPU = 0.10
"""A row was measured under load when other processes kept more than this fraction of the CPUs
busy during its window (0.10: a fifth of one core on 2 CPUs), averaged over the measured updates
(:func:`judge`)."""
LOADED_LOAD_PER_CPU = 0.5
"""Where ``other_cpu`` was not recorded but the load average was: measured under load when
``load_avg_1m`` before it was above this many runnable tasks per CPU (it counts the harness's own
recent processes too, hence only a fallback)."""
PROC = "/proc"


def load_avg_1m() -> float:
    """``os.getloadavg()[0]`` (runnable tasks, 1-minute average); NaN where there is none."""
    try:
        return float(os.getloadavg()[0])
    except (OSError, AttributeError):
        return NAN


def _allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def machine_busy(proc: str = PROC, cpus: set[int] | None = None) -> tuple[float, int] | None:
    """``(busy CPU seconds since boot, CPUs counted)`` over the CPUs in ``cpus`` (default: this
    process's affinity) from ``<proc>/stat``'s per-CPU lines: user + nice + system + irq +
    softirq (guest time is inside user / nice; steal, idle and iowait are not busy here). None
    without a readable ``<proc>/stat``."""
    hz = _clock_ticks()
    want = _allowed_cpus() if cpus is None else cpus
    try:
        with open(os.path.join(proc, "stat")) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy, n = 0, 0
    for line in lines:
        parts = line.split()
        if not parts or not parts[0].startswith("cpu") or parts[0] == "cpu":
            continue
        if want is not None and int(parts[0][3:]) not in want:
            continue
        user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in parts[1:8])
        busy += user + nice + system + irq + softirq
        n += 1
    return (busy / hz, n) if n and hz else None


def tree_cpu_seconds(root: int, proc: str = PROC) -> float | None:
    """CPU seconds of process ``root`` and every live descendant (``utime + stime + cutime +
    cstime`` of each from ``<proc>/<pid>/stat``: threads included, and the children each has
    reaped), found through the parent pids of ``<proc>``'s processes. None when ``root`` is not
    there (or no ``<proc>``)."""
    hz = _clock_ticks()
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    try:
        names = os.listdir(proc)
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(os.path.join(proc, name, "stat"), "rb") as f:
                data = f.read()
            rest = data[data.rindex(b")") + 2:].split()  # the command may hold spaces and ')'
            parent[int(name)] = int(rest[1])  # field 4: ppid; 14..17: utime stime cutime cstime
            ticks[int(name)] = sum(int(x) for x in rest[11:15])
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not a process's stat
            continue
    if root not in ticks or not hz:
        return None
    children: dict[int, list[int]] = {}
    for pid, pp in parent.items():
        children.setdefault(pp, []).append(pid)
    total, todo, seen = 0, [root], {root}
    while todo:
        pid = todo.pop()
        total += ticks[pid]
        for c in children.get(pid, ()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return total / hz


def _clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):
        return 0


@dataclass(frozen=True, slots=True)
class CpuSample:
    """One reading: ``t`` (``time.monotonic()`` s), the CPUs' busy seconds since boot, how many
    CPUs, and the own tree's CPU seconds (None: not known)."""

    t: float
    busy_s: float
    cpus: int
    own_s: float | None


def sample(root: int | None, proc: str = PROC) -> CpuSample | None:
    """A :class:`CpuSample` now, the own tree rooted at pid ``root`` (None: no own tree); None
    without ``/proc/stat``."""
    m = machine_busy(proc)
    if m is None:
        return None
    own = tree_cpu_seconds(root, proc) if root is not None else None
    return CpuSample(t=time.monotonic(), busy_s=m[0], cpus=m[1], own_s=own)


def fractions(a: CpuSample | None, b: CpuSample | None) -> tuple[float, float]:
    """``(other_cpu, own_cpu)`` between samples ``a`` and ``b``: the others' and the own tree's
    CPU seconds over wall seconds x CPUs, each clamped to 0..1 (module docstring); NaN for
    what the samples do not say."""
    if a is None or b is None or b.t <= a.t or a.cpus != b.cpus or not a.cpus:
        return NAN, NAN
    cap = (b.t - a.t) * a.cpus
    if a.own_s is None or b.own_s is None:
        return NAN, NAN
    own = b.own_s - a.own_s
    other = (b.busy_s - a.busy_s) - own
    return min(1.0, max(0.0, other / cap)), min(1.0, max(0.0, own / cap))


@dataclass(slots=True)
class LoadMeter:
    """The load columns of one measurement (module docstring): the load average when made,
    then :meth:`start` / :meth:`stop` around each measured window; :meth:`columns` the row's.
    ``root``: the pid whose process tree is the measurement's own (default: this process and
    its descendants); None when the measurement's processes are not this machine's descendants
    of one process (then ``other_cpu`` is NaN)."""

    root: int | None = field(default_factory=os.getpid)
    load_avg_1m: float = field(default_factory=load_avg_1m)
    proc: str = PROC
    cpus: int | None = None
    other_cpu: float = NAN
    own_cpu: float = NAN
    _start: CpuSample | None = None

    def __post_init__(self):
        if self.cpus is None:
            m = machine_busy(self.proc)
            self.cpus = m[1] if m else os.cpu_count()

    def start(self) -> None:
        """Begin a window (the previous window's fractions are kept until :meth:`stop`)."""
        self._start = sample(self.root, self.proc) if self.root is not None else None

    def stop(self) -> None:
        """End the window begun by :meth:`start`: ``other_cpu`` / ``own_cpu`` over it."""
        end = sample(self.root, self.proc) if self._start is not None else None
        self.other_cpu, self.own_cpu = fractions(self._start, end)
        self._start = None

    def columns(self) -> dict:
        """``{load_avg_1m, cpus, other_cpu, own_cpu}`` of the last window (NaN: not known)."""
        return {"load_avg_1m": round(self.load_avg_1m, 2) if self.load_avg_1m == self.load_avg_1m else NAN,
                "cpus": self.cpus, "other_cpu": _round(self.other_cpu), "own_cpu": _round(self.own_cpu)}


def _round(x: float) -> float:
    return round(x, 4) if x == x else NAN


# ------------------------------------------------------------------------------ judging rows


def _finite(xs: Iterable) -> list[float]:
    out = []
    for x in xs:
        try:
            v = float(x)
        except (TypeError, ValueError):
            continue
        if math.isfinite(v):
            out.append(v)
    return out


@dataclass(frozen=True, slots=True)
class Load:
    """The load of one table row (several CSV rows: one per measured update): ``other_cpu``
    averaged over them, the first finite load average and CPU count; NaN / None: not recorded.
    ``state``: ``loaded``, ``quiet`` or ``not recorded`` (:func:`judge`)."""

    other_cpu: float
    load_avg_1m: float
    cpus: int | None
    state: str


def judge(other_cpu: Iterable = (), load_avg: Iterable = (), cpus: Iterable = (), weights: Iterable | None = None) -> Load:
    """Whether the rows a table row summarizes were measured under load: ``loaded`` when the mean
    of their finite ``other_cpu`` (weighted by ``weights``, each row's window in seconds, where
    given: the others' CPU seconds over the capacity of all the windows together, so that a long
    window counts more than a short, tick-noisy one) is above :data:`LOADED_OTHER_CPU`; with no
    ``other_cpu``, when the load average before them over the CPUs is above
    :data:`LOADED_LOAD_PER_CPU`; else ``quiet``; ``not recorded`` when neither is known (rows of a
    CSV without the load columns, a platform without them, a load average without its CPU count)."""
    oc = list(other_cpu)
    ws = list(weights) if weights is not None else [1.0] * len(oc)
    pairs = [(o[0], w[0]) for o, w in zip((_finite([x]) for x in oc), (_finite([x]) for x in ws)) if o and w and w[0] > 0]
    la, nc = _finite(load_avg), _finite(cpus)
    o = sum(x * w for x, w in pairs) / sum(w for _, w in pairs) if pairs else NAN
    a = la[0] if la else NAN
    n = int(nc[0]) if nc and nc[0] > 0 else None
    if pairs:
        state = "loaded" if o > LOADED_OTHER_CPU else "quiet"
    elif la and n:
        state = "loaded" if a / n > LOADED_LOAD_PER_CPU else "quiet"
    else:
        state = "not recorded"
    return Load(other_cpu=o, load_avg_1m=a, cpus=n, state=state)


def cell(load: Load) -> str:
    """The table's text for ``load``: ``0.03 (loadavg 0.21)`` (other processes' share of the
    CPUs, the 1-minute load average before the run in parentheses where it was kept), ``loadavg
    0.40 / 2 CPUs`` when only that is known, ``not recorded``; ``**... loaded**`` when loaded."""
    if load.other_cpu == load.other_cpu:
        text = f"{load.other_cpu:.2f}"
        if load.load_avg_1m == load.load_avg_1m:
            text += f" (loadavg {load.load_avg_1m:.2f})"
    elif load.state != "not recorded":
        text = f"loadavg {load.load_avg_1m:.2f} / {load.cpus} CPUs"
    else:
        return "not recorded" + (f" (loadavg {load.load_avg_1m:.2f})" if load.load_avg_1m == load.load_avg_1m else "")
    return f"**{text} loaded**" if load.state == "loaded" else text


def summary_line(rows: list[dict], what: str = "", window: str = "the measured updates") -> str:
    """The footer line of a run's load (``rows``: the rows measured in ``window``, weighted by
    their ``seconds`` where they have them); ``what`` names the run (`` [rpc]``)."""
    ld = judge([r.get("other_cpu") for r in rows], [r.get("load_avg_1m") for r in rows], [r.get("cpus") for r in rows],
               [r.get("seconds", 1.0) for r in rows])
    if ld.state == "not recorded":
        return f"# load{what}: not recorded"
    oc = (f"other processes kept {100 * ld.other_cpu:.0f}% of the {ld.cpus or '?'} CPU(s) busy during {window}"
          if ld.other_cpu == ld.other_cpu else "other processes' CPU not recorded")
    la = f"load average {ld.load_avg_1m:.2f} before" if ld.load_avg_1m == ld.load_avg_1m else "no load average"
    flag = ("  <-- LOADED: rerun on a quiet machine for ratios not bent by load" if ld.state == "loaded" else "")
    return f"# load{what}: {oc}; {la}{flag}"
