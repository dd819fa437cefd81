"""Fault injection for the fault matrix (:mod:`weight_transfer.experiments.faults`) and the fault tests.

A :class:`Fault` says what happens to whom and when: ``kill`` (SIGKILL), ``raise`` (an
exception on the rank's own code path) or ``stop`` (SIGSTOP, the process stays but makes no
progress) of a ``train`` rank, an ``infer`` rank or the ``controller``, ``early`` (before the
first write of the update), ``middle`` (half-way through a training rank's write tasks) or
``late`` (after a training rank's last write, before it reports done) in update ``step``.

Trigger: the training rank that owns the fault (the target, or training rank 0 when the target
is an inference rank or the controller) counts its write tasks; at the point it sets
``fault/fired`` (wall-clock time) and either acts itself (training targets: raise in its write
stage, or signal itself) or sets ``fault/fire`` and pauses 0.3 s, so that a watcher thread in
the target process (:func:`install_watcher`) acts mid-update: signal itself, or raise
:class:`InjectedFault` in its main thread.

Kept apart from the matrix runner so that the rank processes (:mod:`weight_transfer.experiments.worker`,
:mod:`weight_transfer.experiments.trial`) import it without importing the runner, which imports them.
"""
from __future__ import annotations

import _thread
import os
import signal
import threading
import time
from dataclasses import dataclass

ACTIONS = ("kill", "raise", "stop")
ROLES = ("train", "infer", "controller")
WHENS = ("early", "middle", "late")


class InjectedFault(RuntimeError):
    """The exception a ``raise`` fault throws."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One injected fault (see the module docstring). Spec: ``ACTION:ROLE:RANK:WHEN:STEP``,
    e.g. ``raise:train:1:middle:2``."""

    action: str
    role: str
    rank: int = 0
    when: str = "middle"
    step: int = 2

    def __post_init__(self):
        if self.action not in ACTIONS or self.role not in ROLES or self.when not in WHENS:
            raise ValueError(f"fault {self.spec()!r}: action in {ACTIONS}, role in {ROLES}, when in {WHENS}")
        if self.step < 1 or self.rank < 0:
            raise ValueError(f"fault {self.spec()!r}: step >= 1, rank >= 0")

    @classmethod
    def parse(cls, spec: str) -> Fault:
        parts = spec.split(":")
        if len(parts) != 5:
            raise ValueError(f"fault {spec!r}: want ACTION:ROLE:RANK:WHEN:STEP, e.g. raise:train:1:middle:2")
        a, r, k, w, s = parts
        return cls(a, r, int(k), w, int(s))

    def spec(self) -> str:
        return f"{self.action}:{self.role}:{self.rank}:{self.when}:{self.step}"

    @property
    def name(self) -> str:
        """The process the fault hits, as the control plane names it."""
        return {"train": f"training {self.rank}", "infer": f"inference {self.rank}"}.get(self.role, "controller")

    def check(self, cfg) -> None:
        """ValueError before any process starts if the fault cannot happen in this trial."""
        n = {"train": cfg.train.n_train, "infer": cfg.n_infer, "controller": 1}[self.role]
        if self.rank >= n:
            raise ValueError(f"fault {self.spec()}: no {self.role} rank {self.rank} (the trial has {n})")
        if self.step > cfg.run.warmup + cfg.run.steps:
            raise ValueError(f"fault {self.spec()}: the trial has {cfg.run.warmup + cfg.run.steps} updates")
        if cfg.run.method != "reference":
            raise ValueError(f"fault {self.spec()}: faults are injected into the reference method only")


def _act(fault: Fault, where: str) -> None:
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    else:
        raise InjectedFault(f"injected fault ({fault.spec()}) in {where}")


def install_trainer(fault: Fault | None, rank: int, side, store, log=print) -> None:
    """Training rank ``rank``: wrap the reference trainer's write stage (``Executor._post_write``,
    where every task's batch is posted, pipelined or not) so that the fault fires at its point
    (no-op unless this rank owns the trigger)."""
    if fault is None or rank != (fault.rank if fault.role == "train" else 0):
        return
    ex = side.executor
    n = len(ex.plan.tasks)
    at = {"early": 0, "middle": n // 2, "late": n}[fault.when]
    state = {"step": 0, "count": 0}
    orig_post, orig_transfer = ex._post_write, side.transfer  # posting: both serial and pipelined writes

    def fire(where: str) -> None:
        store.set("fault/fired", repr(time.time()).encode())
        log(f"fault {fault.spec()}: firing {where} (write task {state['count']} of {n})")
        if fault.role == "train":
            _act(fault, where)
        else:
            store.set("fault/fire", b"1")
            time.sleep(0.3)  # let the target act while this update is still moving

    def post(w):
        if state["step"] == fault.step and state["count"] == at and at < n:
            fire(f"training {rank}'s write stage of step {fault.step}")
        state["count"] += 1
        return orig_post(w)

    def transfer(step):
        state.update(step=step, count=0)
        out = orig_transfer(step)
        if step == fault.step and at >= n:
            fire(f"training {rank} after its last write of step {step}")
        return out

    ex._post_write = post
    side.transfer = transfer


def install_watcher(fault: Fault | None, who: tuple[str, int], addr: tuple[str, int]) -> None:
    """In the process ``who`` (``("infer", i)`` or ``("controller", 0)``): if the fault targets
    it, a daemon thread waits for ``fault/fire`` and acts (``raise``: :class:`InjectedFault` in
    the main thread, through a SIGUSR1 handler). Call from the main thread."""
    if fault is None or (fault.role, fault.rank) != who:
        return
    from weight_transfer.control import store as store_api

    where = f"{fault.name}'s main thread"

    def handler(signum, frame):
        raise InjectedFault(f"injected fault ({fault.spec()}) in {where}")

    if fault.action == "raise":
        signal.signal(signal.SIGUSR1, handler)

    def watch():
        store = store_api.make_store(*addr, is_master=False, timeout=60)
        while not store.check(["fault/fire"]):
            time.sleep(0.002)
        if fault.action == "raise":
            _thread.interrupt_main(signal.SIGUSR1)
        else:
            _act(fault, where)

    threading.Thread(target=watch, name="fault-watcher", daemon=True).start()
