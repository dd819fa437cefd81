"""Inference engines killed, restarted and scaled during one ``weight-transfer run`` (C24).

The options (:class:`weight_transfer.experiments.engine_options.FleetOptions`: ``--kill-engine``,
``--restart-engine``, ``--engines-at``; parsed there) are checked here before any process starts
(:func:`check_fleet`: one ``ValueError`` naming the option), and turned into what happens at each
update (:func:`plan_fleet`). An *engine* is one instance of the inference layout: engine ``E``
is inference ranks ``E*tp .. E*tp+tp-1``; the layout (``--dp``) is the room the fleet has.

During the run (:class:`FleetDriver`, in the controller's process; the local launcher hands it
the process handles, :class:`FleetProcs`):

- before update ``S``'s "load": engines killed ``:before`` are SIGKILLed (and reaped); engines
  scaled away are asked to leave (``fleet/leave/{rank}``: the rank's receiver announces
  leaving, deregisters its region and the process exits 0); restarted and added engines are
  started as fresh processes (fresh, poisoned memory) and waited for until each registered
  (a join announcement, :func:`weight_transfer.control.membership.announce_join`);
- after "load", before "go": the members that are gone (killed, left, process no longer
  running) are dropped and the newcomers taken; when the membership changed the schedule is
  recomputed for the new members only (:func:`weight_transfer.api.plan_against` with a new plan
  epoch; timed: the row's ``replan_seconds``), each newcomer is made a member from ``S`` on (it
  verifies no version before ``S``: the version it holds is its own,
  :func:`weight_transfer.control.membership.member_since`) and the training ranks follow the new epoch
  after the go (:meth:`weight_transfer.api.Sender._follow_plan`); the trainers' processes never
  restart;
- a kill while update ``S`` writes: training rank 0 stops half-way through its write tasks of
  ``S`` (``fleet/fire/{S}``), the controller SIGKILLs the engine's processes and reaps them
  (``fleet/killed/{S}``), the trainer goes on and its next write into the dead process fails:
  the update fails named (``inference i: process P exited with code -9 (SIGKILL)``), the
  weights are ``incomplete``, the lost ranks are dropped at once, and the run goes on with the
  next update on the survivors.

Every completed update is verified against the oracle on exactly the engines in it; each row
says the update's members, its plan epoch, the replan time, who joined and who was gone, the
trainers' pids, and for a failed update the named error (``outcome`` ``failed``).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from .engine_options import text_of


@dataclass
class StepEvents:
    """What happens to the fleet at one update (engines by index)."""

    kill_before: list[int] = field(default_factory=list)
    """SIGKILLed before the update's load."""
    leave: list[int] = field(default_factory=list)
    """Asked to leave (scaled down) before the update's load."""
    start: list[int] = field(default_factory=list)
    """Started fresh (restarted or scaled up) before the update's load."""
    kill_during: list[int] = field(default_factory=list)
    """SIGKILLed while the update writes."""
    members: tuple[int, ...] = ()
    """Engines in the update's plan."""


def plan_fleet(opts, n_updates: int, dp: int) -> tuple[tuple[int, ...], dict[int, StepEvents]]:
    """``(engines at the first update, {update: StepEvents})`` for :class:`FleetOptions`
    ``opts`` in a run of ``n_updates`` updates (warm-up included, numbered 1..n) whose layout
    has room for ``dp`` engines. Order at one update: kills ``:before``, restarts, scaling,
    then the update (with a kill ``during`` it). ValueError naming the option when an update is
    outside the run, an engine does not exist, a killed engine is not running, a restarted one
    was not killed at an earlier update, or no engine (or no survivor) would be left."""
    def in_run(flag, s, item):
        if not 1 <= s <= n_updates:
            raise ValueError(f"{flag} {item}: update {s} is outside the run (updates 1..{n_updates}: "
                             f"--warmup + --steps)")

    def exists(flag, e, item):
        if not 0 <= e < dp:
            raise ValueError(f"{flag} {item}: no engine {e} (the layout has room for dp={dp} engine(s): "
                             f"0..{dp - 1}; raise --dp)")

    for s, e, w in opts.kill_engine:
        item = text_of([(s, e, w)])
        in_run("--kill-engine", s, item)
        exists("--kill-engine", e, item)
        if w == "before" and s == 1:
            raise ValueError(f"--kill-engine {item}: the engines start with the run; kill before update 2 or later "
                             "(or during update 1: 1:E)")
    for s, e in opts.restart_engine:
        in_run("--restart-engine", s, f"{s}:{e}")
        exists("--restart-engine", e, f"{s}:{e}")
    for s, n in opts.engines_at:
        in_run("--engines-at", s, f"{s}:{n}")
        if n > dp:
            raise ValueError(f"--engines-at {s}:{n}: the layout has room for dp={dp} engine(s); raise --dp to {n}")
    scale = dict(opts.engines_at)
    initial = tuple(range(scale.get(1, dp)))
    running = set(initial)
    killed: dict[int, int] = {}  # engine -> update it was killed at
    events: dict[int, StepEvents] = {}
    for s in range(1, n_updates + 1):
        ev = StepEvents()
        for ks, e, w in opts.kill_engine:
            if ks == s and w == "before":
                if e not in running:
                    raise ValueError(f"--kill-engine {s}:{e}:before: engine {e} is not running before update {s} "
                                     f"(running: {sorted(running)})")
                running.discard(e)
                killed[e] = s
                ev.kill_before.append(e)
        for rs, e in opts.restart_engine:
            if rs != s:
                continue
            if e in running:
                raise ValueError(f"--restart-engine {s}:{e}: engine {e} is running before update {s}; restart an engine "
                                 "that --kill-engine killed at an earlier update")
            if e not in killed or killed[e] >= s:
                raise ValueError(f"--restart-engine {s}:{e}: engine {e} was not killed before update {s} (restart an "
                                 f"engine --kill-engine killed at an earlier update; --engines-at scales)")
            del killed[e]
            running.add(e)
            ev.start.append(e)
        if s in scale and s > 1:
            n = scale[s]
            while len(running) > n:
                e = max(running)
                running.discard(e)
                ev.leave.append(e)
            free = [e for e in range(dp) if e not in running]
            while len(running) < n:
                e = free.pop(0)
                killed.pop(e, None)
                running.add(e)
                ev.start.append(e)
        if not running:
            raise ValueError(f"--kill-engine/--engines-at: no engine left for update {s}")
        ev.members = tuple(sorted(running))
        for ks, e, w in opts.kill_engine:
            if ks == s and w == "during":
                if e not in running:
                    raise ValueError(f"--kill-engine {s}:{e}: engine {e} is not running at update {s} "
                                     f"(running: {sorted(running)})")
                running.discard(e)
                killed[e] = s
                ev.kill_during.append(e)
        if not running and s < n_updates:
            raise ValueError(f"--kill-engine: no engine would survive update {s} (updates up to {n_updates} remain)")
        if ev.kill_before or ev.leave or ev.start or ev.kill_during:
            events[s] = ev
    return initial, events


def planned_members(cfg) -> dict[int, str]:
    """``{update: inference ranks in its plan}`` (``"0,1"``) of trial ``cfg`` as its fleet
    options say (what the rows' ``members`` must be)."""
    initial, events = plan_fleet(cfg.fleet, cfg.run.warmup + cfg.run.steps, cfg.inference.dp)
    want, cur = {}, set(initial)
    for s in range(1, cfg.run.warmup + cfg.run.steps + 1):
        if s in events:
            cur = set(events[s].members)
        want[s] = members_text(r for e in cur for r in engine_ranks(e, cfg.inference.tp))
        if s in events:
            cur -= set(events[s].kill_during)
    return want


def check_fleet(cfg) -> None:
    """Before any process starts: the fleet options of trial ``cfg`` make sense (:func:`plan_fleet`)
    and the trial can carry them out: the reference method (its plan is recomputed for each
    membership), the stand-in engine (vLLM instances joining mid-run are the vLLM backend's),
    no expert parallelism (an engine's experts are not replicated elsewhere), CPU memory over
    ``cma`` (a write into a dead process fails at once, ``ESRCH``). ValueError naming the option."""
    opts = "--kill-engine/--restart-engine/--engines-at"
    run, inf = cfg.run, cfg.inference
    if run.method != "reference":
        raise ValueError(f"{opts} with --method {run.method}: engines that come and go are the reference method's "
                         "(its plan is recomputed for each membership)")
    if run.engine != "stand-in":
        raise ValueError(f"{opts} with --engine {run.engine}: wired for the stand-in engine")
    if inf.ep:
        raise ValueError(f"{opts} with --ep: an engine's experts live on its ranks only; use --dp replicas")
    if run.device != "cpu" or cfg.transport != "cma":
        raise ValueError(f"{opts}: wired for --device cpu --transport cma (got {run.device}, "
                         f"{cfg.transport})")
    plan_fleet(cfg.fleet, run.warmup + run.steps, inf.dp)


def engine_ranks(engine: int, tp: int) -> list[int]:
    """Inference ranks of engine ``engine`` (instance ``engine`` of ``tp`` ranks)."""
    return list(range(engine * tp, engine * tp + tp))


# --------------------------------------------------------------------------------------------
# the training side: training rank 0 stops half-way through an update while its engine is killed


def install_trainer_hook(cfg, rank: int, side, store, log=print) -> None:
    """Training rank 0 of a trial with ``--kill-engine STEP:E`` (during): at half of its write
    tasks of update ``STEP`` set ``fleet/fire/{STEP}`` and wait (at most the control timeout)
    for ``fleet/killed/{STEP}``, so the engine dies with the update half-written (no-op
    elsewhere)."""
    steps = {s for s, _, w in cfg.fleet.kill_engine if w == "during"}
    if rank != 0 or not steps:
        return
    orig = side.transfer

    def transfer(step):
        if step not in steps:
            return orig(step)
        side.sender._follow_plan()  # this update's plan: the executor the writes go through
        ex = side.sender.executor
        post = ex._post_write
        n = len(ex.plan.tasks)
        count = [0]

        def hooked(w):
            if count[0] == n // 2:
                store.set(f"fleet/fire/{step}", repr(time.time()).encode())
                log(f"fleet: update {step}: half-way (write task {count[0]} of {n}); waiting for the kill")
                deadline = time.monotonic() + cfg.transfer.control.timeout
                while not store.check([f"fleet/killed/{step}"]) and time.monotonic() < deadline:
                    time.sleep(0.005)
            count[0] += 1
            return post(w)

        ex._post_write = hooked
        try:
            return orig(step)
        finally:
            ex._post_write = post
    side.transfer = transfer


# --------------------------------------------------------------------------------------------
# the controller side


@dataclass
class FleetProcs:
    """What the local launcher lets the fleet do to inference processes (by inference rank):
    ``start(rank)`` a fresh process; ``kill(rank)`` SIGKILL it and reap it; ``leave(rank)`` ask
    it to leave and reap it; ``pid(rank)`` its pid (None if none)."""

    start: object
    kill: object
    leave: object
    pid: object
    dead: object
    """``() -> {rank: reason}`` of inference processes that exited (the launcher's view)."""


def members_text(ranks) -> str:
    """``[0, 2]`` -> ``"0,2"`` (a row's column)."""
    return ",".join(str(r) for r in sorted(ranks))


class FleetDriver:
    """The controller's side of an elastic fleet (see the module docstring): ``ctl`` the
    trial's :class:`weight_transfer.control.protocol.Controller` (its liveness and heartbeat views are
    kept to the members), ``procs`` the launcher's :class:`FleetProcs`."""

    def __init__(self, cfg, store, ctl, procs: FleetProcs, log=None):
        self.cfg, self.store, self.ctl, self.procs = cfg, store, ctl, procs
        self.tp = cfg.inference.tp
        self.initial, self.events = plan_fleet(cfg.fleet, cfg.run.warmup + cfg.run.steps, cfg.inference.dp)
        self.members: set[int] = {r for e in self.initial for r in engine_ranks(e, self.tp)}
        """Inference ranks in the current plan."""
        self.lost: set[int] = set()
        """Ranks killed or gone, dropped from the liveness and heartbeat views, not yet replanned without."""
        self.started: dict[int, float] = {}
        """Ranks started for the next update -> seconds until each registered."""
        self.epoch = 0
        self.change: dict | None = None
        """The membership change before the current update (None: none)."""
        self.kill_time: float | None = None
        self.log = log or (lambda m: None)
        self._joins_seen = 0
        self._train_metas: dict = {}
        self._payloads: dict = {}
        self.schedule = None
        """The schedule of the current plan epoch, after a replan (None: the first plan's)."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        ctl.live_i = self.liveness

    @property
    def n_initial(self) -> int:
        """Inference ranks at the start (the lowest-numbered: engines ``0..N-1``)."""
        return len(self.members)

    # -- views kept to the members

    def liveness(self) -> dict:
        """``{rank: reason}`` of members whose process exited (the launcher's view)."""
        return {r: why for r, why in self.procs.dead().items() if r in self.members and r not in self.lost}

    def _unwatch(self, ranks) -> None:
        """Drop ``ranks`` from the heartbeat view and from the membership keys (a newcomer with
        the same rank reads no version before its own first update)."""
        from weight_transfer.control import membership

        mon = self.ctl.monitor
        for r in ranks:
            self.lost.add(r)
            membership.drop_member(self.store, r)
            if mon is not None:
                mon.names.pop(("infer", r), None)

    def _watch(self, ranks) -> None:
        mon = self.ctl.monitor
        if mon is not None:
            for r in ranks:
                mon.names[("infer", r)] = f"infer{r}"
            mon.reset([("infer", r) for r in ranks])

    # -- the run

    def setup(self, train_metas: dict, infer_payloads: dict) -> None:
        """After the first plan: remember what it was made from; the first members hold
        every version from the first on."""
        from weight_transfer.control import membership

        self._train_metas, self._payloads = train_metas, dict(infer_payloads)
        _, self._joins_seen = membership.new_joins(self.store, 0)
        for r in infer_payloads:
            membership.set_member(self.store, r, 0)

    def before_load(self, step: int) -> None:
        """Kills ``:before``, leaves and starts of ``step``; returns once every started rank
        registered (ControlError naming it when it died or did not within the timeout)."""
        from weight_transfer.control import membership
        from weight_transfer.control import protocol as control

        ev = self.events.get(step)
        self.change = None
        if ev is None:
            return
        for e in ev.kill_before:
            ranks = engine_ranks(e, self.tp)
            self._unwatch(ranks)
            for r in ranks:
                self.procs.kill(r)
            self.log(f"fleet: engine {e} (ranks {ranks}) SIGKILLed before update {step}")
        for e in ev.leave:
            ranks = engine_ranks(e, self.tp)
            self._unwatch(ranks)
            for r in ranks:
                self.procs.leave(r)
            self.log(f"fleet: engine {e} (ranks {ranks}) left before update {step}")
        t0 = time.perf_counter()
        new = [r for e in ev.start for r in engine_ranks(e, self.tp)]
        for r in new:
            if self.store.check([f"fatal/infer{r}"]):
                self.store.delete_key(f"fatal/infer{r}")
            if self.store.check([f"fleet/leave/{r}"]):
                self.store.delete_key(f"fleet/leave/{r}")
            self.procs.start(r)
        waiting = set(new)
        deadline = time.monotonic() + self.cfg.transfer.control.timeout
        for _ in control.backoff(None, 0.02):
            if not waiting:
                break
            joins, n = membership.new_joins(self.store, self._joins_seen)
            for r in joins:
                if r in waiting and self.procs.pid(r) == control.get(self.store, f"meta/infer/{r}")[0].pid:
                    waiting.discard(r)
                    self.started[r] = time.perf_counter() - t0
            self._joins_seen = n
            dead = {r: why for r, why in self.procs.dead().items() if r in waiting}
            if dead:
                r = min(dead)
                raise control.ControlError(f"inference {r}: {dead[r]} before registering (started for update {step})")
            if self.store.check(["abort"]):
                raise control.ControlError(control.get_text(self.store, "abort"))
            if time.monotonic() > deadline:
                raise control.ControlError(f"inference {min(waiting)}: started for update {step}, not registered within "
                                           f"{self.cfg.transfer.control.timeout:.0f} s")
        self._watch(new)

    def replan(self, step: int, model_config) -> dict | None:
        """After ``step``'s load, before its go: drop the members that are gone, take the
        ranks that registered, recompute the plan for that membership (a new epoch) and make
        each newcomer a member from ``step``. Returns the change (``{"step", "epoch",
        "members", "gone", "joined", "seconds", "join_seconds"}``) or None."""
        from weight_transfer.api import plan_against
        from weight_transfer.control import membership
        from weight_transfer.control import protocol as control

        gone = set(self.lost) & self.members
        gone |= membership.left(self.store, self.members)
        gone |= {r for r in self.members if membership.process_gone(self._payloads[r][0])}
        added = {r: control.get(self.store, f"meta/infer/{r}") for r in self.started}
        if not gone and not added:
            return None
        ch = membership.change_members(
            self.store, self.ctl, members=self.members, payloads=self._payloads, gone=gone, added=added,
            plan=lambda payloads, epoch: plan_against(self.store, model_config, self.cfg.inference, self._train_metas,
                                                      payloads, self.cfg.resolved_transfer, epoch=epoch),
            epoch=self.epoch, version=step, where=f"update {step}")
        self.epoch, self.schedule, self.members, self._payloads = ch.epoch, ch.schedule, ch.members, ch.payloads
        self.lost -= set(added) | gone
        self.change = {"step": step, "epoch": self.epoch, "members": sorted(ch.members), "gone": sorted(ch.dropped),
                       "joined": sorted(added), "seconds": ch.seconds,
                       "join_seconds": max(self.started.values(), default=0.0)}
        self.started = {}
        self.log(f"fleet: update {step}: members {sorted(ch.members)} (gone {self.change['gone']}, joined "
                 f"{self.change['joined']}); replanned in {ch.seconds:.4f} s (epoch {self.epoch})")
        return self.change

    def arm(self, step: int) -> None:
        """Before ``step``'s go: if an engine dies during it, a thread waits for training rank
        0's ``fleet/fire/{step}``, SIGKILLs the engine's processes, reaps them and says
        ``fleet/killed/{step}`` (the kill's wall-clock time is ``fault/fired``, what the fault
        matrix times the named error from)."""
        ev = self.events.get(step)
        self.kill_time = None
        if ev is None or not ev.kill_during:
            return
        ranks = [r for e in ev.kill_during for r in engine_ranks(e, self.tp)]
        self._stop.clear()

        def kill():
            while not self.store.check([f"fleet/fire/{step}"]):
                if self._stop.wait(0.002):
                    return
            self.kill_time = time.time()
            self.store.set("fault/fired", repr(self.kill_time).encode())
            for r in ranks:
                self.procs.kill(r)
            self.store.set(f"fleet/killed/{step}", b"1")
            self.log(f"fleet: ranks {ranks} SIGKILLed while update {step} writes")

        self._thread = threading.Thread(target=kill, name=f"fleet-kill-{step}", daemon=True)
        self._thread.start()

    def disarm(self, step: int | None = None) -> None:
        """After the update: stop the kill thread. ``step`` (the update completed): an engine
        planned to die during it that was not killed (training rank 0 never reached half-way)
        is killed now, so the run's membership stays the one the options say."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(30)
            self._thread = None
        ev = self.events.get(step) if step is not None else None
        if ev is not None and ev.kill_during and self.kill_time is None:
            ranks = [r for e in ev.kill_during for r in engine_ranks(e, self.tp)]
            self._unwatch(ranks)
            for r in ranks:
                self.procs.kill(r)
            self.log(f"fleet: ranks {ranks} SIGKILLed after update {step} (it completed before the kill)")

    def lost_in(self, step: int) -> list[int]:
        """After update ``step`` failed: the members whose processes are gone (killed by
        ``--kill-engine`` or otherwise), now dropped from every view (the next update is planned
        without them); [] when none is, or none would be left (the failure is not the fleet's)."""
        from weight_transfer.control import membership

        dead = set(self.procs.dead()) | {r for r in self.members if membership.process_gone(self._payloads[r][0])}
        ev = self.events.get(step)
        if ev is not None and self.kill_time is not None:  # killed by --kill-engine while the update wrote
            dead |= {r for e in ev.kill_during for r in engine_ranks(e, self.tp)}
        lost = sorted((dead & self.members) - self.lost)
        if not lost or not (self.members - self.lost - set(lost)):
            return []
        self._unwatch(lost)
        return lost

    def failed_row(self, step: int, error: BaseException, t_go: float, *, base: dict, lost: list[int]) -> dict:
        """The row of update ``step`` that failed because ranks ``lost`` were lost: ``outcome``
        ``failed``, ``error`` (the named cause, first line), ``lost`` (ranks), ``seconds`` from the
        go to the error, ``seconds_to_error`` from the kill to the error (None when nothing was
        killed by the run), no bytes, ``verified`` None (nothing to verify: the weights are
        ``incomplete``); ``base``: the trial's common columns."""
        from weight_transfer.control import protocol as control

        msg = str(error).splitlines()[0] if str(error) else type(error).__name__
        now = time.time()
        row = {**base, "step": step, "bytes": 0, "seconds": time.perf_counter() - t_go, "delta_bytes": 0,
               "verified": None, "peak_temp_bytes": 0, "peak_alloc_bytes": 0, "wire_bytes": 0, "n_writes": 0,
               "outcome": "failed", "error": msg, "lost": members_text(lost),
               "weights_after": f"{control.read_state(self.store).state} v{control.read_state(self.store).version}",
               "seconds_to_error": None if self.kill_time is None else now - self.kill_time}
        row.update(self.columns(step))
        return row

    def verified(self, step: int) -> dict[int, dict]:
        """Wait for every member's verification of ``step`` (but those lost after it completed);
        ``{rank: result}``."""
        from weight_transfer.control import protocol as control

        ranks = sorted(self.members - self.lost)
        self.ctl._wait({i: f"step/{step}/verified/{i}" for i in ranks}, f"step {step} verification")
        return {i: control.get(self.store, f"step/{step}/verified/{i}") for i in ranks}

    def columns(self, step: int) -> dict:
        """The row's fleet columns for ``step``: ``members`` (inference ranks in the update),
        ``n_infer`` (their count), ``epoch``, ``replan_seconds`` (the plan recomputed before
        this update; 0.0 without a change), ``join_seconds`` (the slowest newcomer's start to
        registration), ``joined`` / ``gone`` (ranks), ``newcomer_first`` (ranks whose first
        update this is), ``train_pids`` (every training rank's pid at this update), the
        fleet options' text."""
        from weight_transfer.control import protocol as control

        c = self.change or {}
        fo = self.cfg.fleet
        pids = []
        for r in range(self.cfg.train.n_train):
            k = f"step/{step}/pid/{r}"
            pids.append(str(control.get_int(self.store, k)) if self.store.check([k]) else "?")
        return {"members": members_text(self.members), "n_infer": len(self.members), "epoch": self.epoch,
                "replan_seconds": c.get("seconds", 0.0), "join_seconds": c.get("join_seconds", 0.0),
                "joined": members_text(c.get("joined", ())), "gone": members_text(c.get("gone", ())),
                "newcomer_first": members_text(c.get("joined", ())), "train_pids": ",".join(pids),
                "kill_engine": text_of(fo.kill_engine), "restart_engine": text_of(fo.restart_engine),
                "engines_at": text_of(fo.engines_at)}


def record_pid(store, step: int, rank: int) -> None:
    """A training rank says its pid at ``step`` (``step/{step}/pid/{rank}``): the rows show the
    trainers never restarted."""
    store.set(f"step/{step}/pid/{rank}", str(os.getpid()).encode())


def wait_version_or_leave(store, rank: int, last: int, *, timeout: float, poll: float = 0.01) -> int | None:
    """An inference rank of an elastic fleet: block until a complete version > ``last`` this
    rank holds is published (a version before its first update, :func:`membership.member_since`,
    is passed over), or the job shuts down, or this rank is asked to leave (``fleet/leave/{rank}``):
    None for both. ControlError after ``timeout`` seconds without one."""
    from weight_transfer.control import membership
    from weight_transfer.control import protocol as control

    for expired in control.backoff(timeout, poll):
        s = control.read_state(store)
        if s.complete and s.version > last:
            since = membership.member_since(store, rank)
            if since is not None and s.version >= since:
                return s.version
        if store.check(["shutdown"]) or store.check([f"fleet/leave/{rank}"]):
            return None
        if expired:
            raise control.ControlError(f"[infer {rank}] no new version after {last} within {timeout:.0f} s (weights: {s})")


def kill_process(p, timeout: float = 10.0) -> None:
    """SIGKILL ``p`` (a ``multiprocessing.Process``) and reap it."""
    if p.pid is not None and p.exitcode is None:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.join(timeout)
