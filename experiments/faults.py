"""The fault matrix: ``weight-transfer faults [--quick]``.

Each row injects one :class:`~weight_transfer.experiments.inject.Fault` (what happens to whom and when, and how
it is triggered, is documented in :mod:`weight_transfer.experiments.inject`) into a small trial.

The matrix runs each row as its own process tree (``python -m weight_transfer.experiments.faults --row SPEC``,
a new session), and prints one nccl-tests style table: seconds from the fault to the error,
the role and rank the error names, the exit status, processes of the row left behind, the
published state of the inference weights after the failure, and whether the next update
restored a complete version bit-exactly (training faults: the trial restarts the training world
once, the inference processes keep their memory; inference and controller faults end the run).

Two more rows (:data:`ELASTIC`, C24) run a trial whose inference engines come and go
(:mod:`weight_transfer.experiments.fleet`): ``engine-dies-replacement-joins`` (2 engines, engine 1
SIGKILLed while update 3 writes, a fresh engine 1 started before update 5) and ``scale-1-3-1``
(1 engine, 3 from update 3, 1 from update 5); each must name the lost engine, go on with the
survivors, verify every completed update on exactly the engines in it (the newcomers' first
updates bit-exact), never restart the trainers, and leave nothing behind.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from .inject import ACTIONS, ROLES, WHENS, Fault, InjectedFault, install_trainer, install_watcher  # noqa: F401

# --------------------------------------------------------------------------------------------
# one row: a trial with the fault, in its own process tree


def small_config(**kw):
    """The matrix's world: Qwen3-0.6B cut to 2 layers and an 8192-token vocabulary, 2 FSDP2
    training ranks, one TP=2 inference instance, CMA; 3 updates (the fault hits update 2). The
    timeout bounds setup (process start on a loaded machine); stalls are ``stall``'s business."""
    from .config import TrialConfig

    base = dict(model="qwen3-0.6b", overrides={"num_hidden_layers": 2, "vocab_size": 8192}, n_train=2, tp=2,
                steps=3, warmup=0, timeout=180.0, transport="cma")
    base.update(kw)
    return TrialConfig.from_flat(**base)


def run_row(fault: Fault, *, stall: float = 5.0, restarts: int = 1, cfg=None) -> dict:
    """Run one trial with ``fault`` in this process (the controller) and return what happened:
    ``{"error", "seconds_to_error", "state", "restored", "rows"}``. Raises nothing for the
    fault's own error."""
    from weight_transfer.control import protocol as control

    from .trial import run_trial

    cfg = cfg or small_config()
    fault.check(cfg)
    seen: list = []
    out = {"fault": fault.spec(), "error": None, "seconds_to_error": None, "state": None, "restored": None}
    probe: dict = {}
    try:
        run_trial(cfg, progress=seen.append, fault=fault, stall=stall, restarts=restarts, probe=probe)
    except (control.ControlError, InjectedFault) as e:
        out["error"] = str(e).splitlines()[0]
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    t_err = probe.get("t_error", time.time())
    out["error"] = probe.get("error") or out["error"]
    fired = probe.get("fired")
    out["seconds_to_error"] = None if fired is None or out["error"] is None else t_err - fired
    out["state"] = probe.get("state_after_fault")
    after = [r for r in seen if r["step"] > fault.step]
    out["restored"] = bool(after) and all(r["verified"] is True for r in after)
    out["rows"] = [(r["step"], r["verified"]) for r in seen]
    return out


# --------------------------------------------------------------------------------------------
# the matrix


def _session_procs(sid: int, *, helpers: bool = True) -> list[int]:
    """Live (not zombie) processes of session ``sid``; ``helpers=False`` leaves out
    multiprocessing's resource tracker (it exits with its parent)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    if not helpers:
                        with open(f"/proc/{d}/cmdline", "rb") as f:
                            if b"resource_tracker" in f.read():
                                continue
                    out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _state_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def matrix_row(fault: Fault, *, stall: float, limit: float) -> dict:
    """Run ``fault`` as ``python -m weight_transfer.experiments.faults --row`` in a new session; returns the
    row's result plus ``exit`` (status; negative: signal), ``left`` (processes of the session
    alive after it exited) and ``wall`` (seconds). A stopped controller is resumed (SIGCONT)
    once its ranks have left or after ``stall + 10`` s: the operator's part."""
    cmd = [sys.executable, "-m", "weight_transfer.experiments.faults", "--row", fault.spec(), "--stall", str(stall)]
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    resumed = False
    stopped_at = exited_at = cleaned_at = None
    while time.monotonic() - t0 < limit:
        time.sleep(0.05)
        if p.poll() is not None:
            exited_at = exited_at or time.monotonic()
            if not _session_procs(p.pid) or time.monotonic() - exited_at > stall + 10:
                cleaned_at = time.monotonic()
                break
            continue
        if _state_of(p.pid) == "T" and not resumed:
            stopped_at = stopped_at or time.monotonic()
            others = [q for q in _session_procs(p.pid, helpers=False) if q != p.pid]
            if not others or time.monotonic() - stopped_at > stall + 10:
                os.kill(p.pid, signal.SIGCONT)
                resumed = True
    timed_out = p.poll() is None
    if timed_out:
        os.killpg(p.pid, signal.SIGKILL)
    out_s, err_s = p.communicate()
    wall = time.monotonic() - t0
    left = _session_procs(p.pid)
    for q in left:
        try:
            os.kill(q, signal.SIGKILL)
        except OSError:
            pass
    res = {}
    for line in out_s.splitlines():
        if line.startswith("{"):
            res = json.loads(line)
    if not res:
        res = {"fault": fault.spec(), "error": None, "seconds_to_error": None, "state": None, "restored": False}
        errs = [ln for ln in err_s.splitlines() if "error" in ln.lower() or "Error" in ln]
        res["error"] = (errs[-1] if errs else "(no error line)")
    if fault.role == "controller" and fault.action == "kill":  # nobody is left to say more
        res.update(error=f"controller: killed (exit {p.returncode}); its ranks followed (PR_SET_PDEATHSIG)",
                   seconds_to_error=None if cleaned_at is None else cleaned_at - exited_at, state="- (all gone)")
    res.update(exit=p.returncode, left=len(left), wall=wall, timed_out=timed_out, stderr_tail=err_s[-2000:])
    return res


def named(fault: Fault, res: dict) -> str:
    """The role and rank the row's error names first (``"training 1"``, ``"inference 0"``,
    ``"controller"``), ``"-"`` if none."""
    err = res.get("error") or ""
    cands = [f"{role} {r}:" for role in ("training", "inference") for r in range(8)] + ["controller"]
    found = [(err.find(c), c.rstrip(":")) for c in cands if c in err]
    return min(found)[1] if found else "-"


QUICK = ("raise:train:1:middle:2", "kill:infer:0:middle:2", "stop:train:1:middle:2")


# --------------------------------------------------------------------------------------------
# elastic rows (C24): engines killed, restarted and scaled while the trainers keep training

ELASTIC = {
    "engine-dies-replacement-joins": dict(tp=1, dp=2, steps=6, kill_engine=((3, 1, "during"),),
                                          restart_engine=((5, 1),)),
    "scale-1-3-1": dict(tp=1, dp=3, steps=6, engines_at=((1, 1), (3, 3), (5, 1))),
}
"""The elastic rows: name -> the trial's fleet options (on :func:`small_config`'s world, TP=1
engines, 6 updates)."""


@dataclass(frozen=True)
class ElasticRow:
    """An elastic row of the matrix (what :func:`matrix_row` needs of a row)."""

    spec_name: str
    role = "fleet"
    action = "fleet"

    def spec(self) -> str:
        return self.spec_name

    @property
    def name(self) -> str:
        """The rank the row's error must name: the killed engine's first rank, ``-`` without a kill."""
        kills = ELASTIC[self.spec_name].get("kill_engine", ())
        return f"inference {kills[0][1]}" if kills else "-"


def run_elastic_row(name: str, *, stall: float = 5.0) -> dict:
    """Run elastic row ``name`` in this process and check it: ``{"fault", "error" (the failed
    update's named error, None without one), "seconds_to_error" (kill -> named error), "state"
    (the weights after the failed update), "restored" (every completed update verified on every
    engine in it, the newcomers' first ones included, and each update's members as planned),
    "replan" (the largest replan seconds), "members" (per update), "pids_same", "ok"}``."""
    from .fleet import planned_members
    from .trial import run_trial

    cfg = small_config(**ELASTIC[name])
    seen: list = []
    out = {"fault": name, "error": None, "seconds_to_error": None, "state": None, "restored": False, "ok": False}
    try:
        run_trial(cfg, progress=seen.append, stall=stall)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out["run_failed"] = True
    want = planned_members(cfg)
    failed = [r for r in seen if r.get("outcome") == "failed"]
    done = [r for r in seen if r.get("outcome") != "failed"]
    members = {r["step"]: r.get("members") for r in seen}
    if failed:
        out.update(error=failed[0]["error"], seconds_to_error=failed[0].get("seconds_to_error"),
                   state=failed[0].get("weights_after"))
    kill_steps = {s for s, _, w in cfg.fleet.kill_engine if w == "during"}
    out["restored"] = (not out.get("run_failed") and [r["step"] for r in seen] == list(want)
                       and members == want and {r["step"] for r in failed} == kill_steps
                       and all(r["verified"] is True for r in done))
    out["replan"] = max((r.get("replan_seconds") or 0.0 for r in seen), default=0.0)
    out["members"] = " ".join(f"{r['step']}:{r.get('members')}" + ("(failed)" if r.get("outcome") == "failed" else "")
                              for r in seen)
    out["pids_same"] = len({r.get("train_pids") for r in seen}) == 1 and "?" not in (seen[0].get("train_pids") or "?")
    out["ok"] = bool(out["restored"] and out["pids_same"])
    out["rows"] = [(r["step"], r.get("members"), r.get("outcome"), r["verified"]) for r in seen]
    return out


def format_elastic(rows: list[tuple[ElasticRow, dict]]) -> str:
    """The elastic rows' table (beneath the fault matrix's)."""
    lines = ["# elastic fleet (C24): the same model and 2 training ranks -> TP=1 engines, CMA; 6 updates; "
             "members = inference ranks in each update",
             f"#{'row':>30} {'to_error':>9} {'named':>12} {'exit':>5} {'left':>5} {'weights after fault':>20} "
             f"{'restored':>9} {'replan':>7} {'pids':>5} {'ok':>4}  members per update",
             f"#{'':>30} {'(s)':>9} {'':>12} {'':>5} {'':>5} {'':>20} {'':>9} {'(s)':>7}"]
    for f, r in rows:
        ste = "-" if r.get("seconds_to_error") is None else f"{r['seconds_to_error']:.2f}"
        who = named(f, r)
        lines.append(f"{f.spec():>31} {ste:>9} {who:>12} {r['exit']:>5} {r['left']:>5} {r.get('state') or '-':>20} "
                     f"{'yes' if r.get('restored') else 'no':>9} {r.get('replan') or 0.0:>7.4f} "
                     f"{'same' if r.get('pids_same') else 'NEW':>5} {'yes' if row_ok(f, r) else 'NO':>4}  "
                     f"{r.get('members', '')}")
    return "\n".join(lines)


def row_ok(f, r: dict) -> bool:
    """A row is good when it names the faulted rank, ends and leaves nothing behind (elastic
    rows: also exit 0, every update as planned and verified, the trainers' pids unchanged)."""
    base = named(f, r) == f.name and r["left"] == 0 and not r.get("timed_out")
    if isinstance(f, ElasticRow):
        return base and r.get("exit") == 0 and bool(r.get("ok"))
    return base


def all_faults() -> list:
    """The 27 injected faults, then the :data:`ELASTIC` rows."""
    rank = {"train": 1, "infer": 0, "controller": 0}
    return [Fault(a, r, rank[r], w, 2) for r in ROLES for a in ACTIONS for w in WHENS] + [ElasticRow(n) for n in ELASTIC]


def parse_row(spec: str):
    """A matrix row from its spec: an :data:`ELASTIC` name or ``ACTION:ROLE:RANK:WHEN:STEP``."""
    return ElasticRow(spec) if spec in ELASTIC else Fault.parse(spec)


def format_matrix(rows: list[tuple[Fault, dict]], *, stall: float) -> str:
    lines = ["# fault matrix: qwen3-0.6b (2 layers, vocab 8192), 2 FSDP2 training ranks -> TP=2, CMA; fault in update 2 of 3",
             f"# stall deadline {stall:.0f} s; training faults restart the training world once (inference keeps its memory)",
             f"#{'fault':>27} {'to_error':>9} {'named':>12} {'exit':>5} {'left':>5} {'weights after fault':>20} "
             f"{'restored':>9} {'ok':>4}",
             f"#{'':>27} {'(s)':>9}"]
    elastic = [(f, r) for f, r in rows if isinstance(f, ElasticRow)]
    rows = [(f, r) for f, r in rows if not isinstance(f, ElasticRow)]
    if not rows:  # only elastic rows (--only): their own table
        lines = [lines[1]]
    for f, r in rows:
        ste = "-" if r.get("seconds_to_error") is None else f"{r['seconds_to_error']:.2f}"
        who = named(f, r)
        ok = who == f.name and r["left"] == 0 and not r.get("timed_out")
        state = r.get("state") or "-"
        restored = "yes" if r.get("restored") else ("n/a" if f.role != "train" else "no")
        lines.append(f"{f.spec():>28} {ste:>9} {who:>12} {r['exit']:>5} {r['left']:>5} {state:>20} {restored:>9} "
                     f"{'yes' if ok else 'NO':>4}")
    if elastic:
        lines.append(format_elastic(elastic))
    rows = rows + elastic
    bad = [f.spec() for f, r in rows if not row_ok(f, r)]
    lines.append(f"# rows named, bounded and clean: {len(rows) - len(bad)}/{len(rows)}" + (f"; not: {bad}" if bad else ""))
    return "\n".join(lines)


def main(args) -> int:
    """``weight-transfer faults``: run the matrix (or ``--quick``'s 3 rows, or ``--only``)
    and print the table."""
    faults = ([parse_row(s) for s in args.only] if args.only else
              [Fault.parse(s) for s in QUICK] if args.quick else all_faults())
    rows = []
    for f in faults:
        r = matrix_row(f, stall=args.stall, limit=args.limit)
        rows.append((f, r))
        print(f"# {f.spec()}: {r.get('error')}", file=sys.stderr, flush=True)
        if args.verbose:
            print(r["stderr_tail"], file=sys.stderr)
    print(format_matrix(rows, stall=args.stall))
    return 0 if all(row_ok(f, r) for f, r in rows) else 1


@dataclass(kw_only=True, slots=True)
class FaultsOptions:
    """Options of ``weight-transfer faults``: which rows, and their deadlines."""

    quick: bool = False
    """Run 3 rows only (a training rank raising, an inference rank killed, a training rank stopped)."""
    only: tuple[str, ...] = field(default=(), metadata={"metavar": "SPEC,..."})
    """Run these faults, ``action:role:rank:when:step`` each, or an elastic row's name
    (``engine-dies-replacement-joins``, ``scale-1-3-1``), comma-separated (e.g. ``stop:controller:0:late:2``)."""
    stall: float = field(default=5.0, metadata={"unit": "s"})
    """Seconds without a heartbeat before a rank is named."""
    limit: float = field(default=180.0, metadata={"unit": "s"})
    """Seconds a row may take before it is killed."""
    verbose: bool = False
    """Print each row's stderr tail."""


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """``weight-transfer faults``'s options, generated from :class:`FaultsOptions`."""
    from .cli import add_dataclass_options

    add_dataclass_options(ap, FaultsOptions, namespace_defaults=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m weight_transfer.experiments.faults")
    ap.add_argument("--row", default=None, help="run one row in this process and print it as JSON")
    add_arguments(ap)
    a = ap.parse_args()
    if a.row in ELASTIC:  # an elastic row: exit 0 when it went as planned (its failed update is expected)
        res = run_elastic_row(a.row, stall=a.stall)
        print(json.dumps(res), flush=True)
        sys.exit(0 if res["ok"] else 1)
    if a.row:
        res = run_row(Fault.parse(a.row), stall=a.stall)
        print(json.dumps(res), flush=True)
        sys.exit(1 if res["error"] else 0)
    sys.exit(main(a))
