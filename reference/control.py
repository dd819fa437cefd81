"""Control plane over torch's ``TCPStore``: metadata once, a plan once, then per step "go",
completions, and the published weight version.

Keys (values are pickled Python objects unless noted)::

    meta/train/{r}          training rank r's [ParamMeta]
    meta/infer/{i}          inference rank i's (RegionDescriptor, [DestTensorMeta])
    plan/{r}                (RankPlan, {inference rank: RegionDescriptor}) for training rank r
    step/{s}/load           controller -> trainers: make the weights of step s (optimizer step)
    step/{s}/ready/{r}      trainer r has them
    step/{s}/go             controller -> trainers: transfer now
    step/{s}/done/{r}       trainer r's result: {"ok": bool, "error": str, "stats": StepStats}
    step/{s}/idone/{i}      inference rank i's result, for methods active on the inference side
    version                 last published step (ASCII int); -1 before the first
    step/{s}/verified/{i}   inference rank i's verification result (harness only)
    abort                   a reason; every waiting party stops

The inference side only ever reads ``version``; the controller writes it after every training
rank reported its writes of that step complete, so a version whose writes did not all complete
is never visible. Waits take a timeout and name the ranks that did not answer; a ``liveness``
callback lets the controller fail fast when a rank's process died.

Why TCPStore: it is what torch.distributed already uses for rendezvous, needs no extra service,
and blocking ``wait`` on keys is exactly the control flow here.
"""
from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist


class ControlError(RuntimeError):
    """A rank failed, died or did not answer in time; the message names the ranks."""


def make_store(host: str, port: int, *, is_master: bool, world_size: int | None = None,
               timeout: float = 300.0) -> dist.TCPStore:
    """A TCPStore; the controller is the master (``port=0`` picks a free port: read
    ``store.port``)."""
    return dist.TCPStore(host, port, world_size, is_master, timedelta(seconds=timeout), wait_for_workers=False)


def put(store: dist.Store, key: str, obj) -> None:
    store.set(key, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def get(store: dist.Store, key: str):
    return pickle.loads(store.get(key))


def wait_keys(store: dist.Store, keys: dict[int, str], *, timeout: float, what: str,
              liveness: Callable[[], dict[int, str]] | None = None, poll: float = 0.02) -> None:
    """Wait until every ``keys[rank]`` exists. Raises ControlError naming the ranks still
    missing after ``timeout`` seconds, or at once naming dead ranks (``liveness`` returns
    ``{rank: reason}`` for ranks known dead), or the abort reason.

    Polls with ``store.check`` (one round trip for all keys), sleeping from 0.1 ms up to
    ``poll`` seconds between checks; TCPStore's own blocking ``wait`` cannot be interrupted
    to look at liveness and logs a warning on every timed-out slice."""
    deadline = time.monotonic() + timeout
    allkeys = list(keys.values())
    nap = 1e-4
    while True:
        if store.check(allkeys):
            return
        expired = time.monotonic() >= deadline
        aborted = store.check(["abort"])
        dead = {r: why for r, why in liveness().items() if r in keys} if liveness is not None else {}
        if expired or aborted or dead:
            pending = sorted(r for r, k in keys.items() if not store.check([k]))
            if not pending:
                return
            if aborted:
                raise ControlError(f"{what}: aborted: {store.get('abort').decode()}")
            dead = {r: w for r, w in dead.items() if r in pending}
            if dead:
                raise ControlError(f"{what}: rank(s) died: " + "; ".join(f"{r}: {w}" for r, w in sorted(dead.items())))
            if expired:
                raise ControlError(f"{what}: no answer within {timeout:.0f} s from rank(s) {pending}")
        time.sleep(nap)
        nap = min(nap * 2, poll)


class Controller:
    """The controller's side: collect metadata once, publish the plan once, drive steps."""

    def __init__(self, store: dist.Store, n_train: int, n_infer: int, *, timeout: float = 120.0,
                 liveness_train: Callable[[], dict[int, str]] | None = None,
                 liveness_infer: Callable[[], dict[int, str]] | None = None):
        self.store, self.n_train, self.n_infer, self.timeout = store, n_train, n_infer, timeout
        self.live_t, self.live_i = liveness_train, liveness_infer
        store.set("version", b"-1")

    def collect(self):
        """Block until every rank published its metadata; return (train, infer) dicts."""
        wait_keys(self.store, {r: f"meta/train/{r}" for r in range(self.n_train)}, timeout=self.timeout,
                  what="training metadata", liveness=self.live_t)
        wait_keys(self.store, {i: f"meta/infer/{i}" for i in range(self.n_infer)}, timeout=self.timeout,
                  what="inference metadata", liveness=self.live_i)
        train = {r: get(self.store, f"meta/train/{r}") for r in range(self.n_train)}
        infer = {i: get(self.store, f"meta/infer/{i}") for i in range(self.n_infer)}
        return train, infer

    def publish_plan(self, schedule, descriptors: dict) -> None:
        for r, rp in schedule.rank_plans.items():
            put(self.store, f"plan/{r}", (rp, descriptors))

    def load(self, step: int) -> None:
        """Ask every trainer to produce step ``step``'s weights and wait until they have."""
        self.store.set(f"step/{step}/load", b"1")
        wait_keys(self.store, {r: f"step/{step}/ready/{r}" for r in range(self.n_train)}, timeout=self.timeout,
                  what=f"step {step} weights", liveness=self.live_t)

    def transfer(self, step: int, *, inference_active: bool = False) -> tuple[float, dict[int, dict]]:
        """Send "go", wait for every trainer's completion (and every inference rank's, for
        methods active on the inference side), then publish ``version = step``. Returns
        (seconds from go to the last completion, per-rank results; inference ranks keyed
        ``("infer", i)``). Raises ControlError (version unchanged) if any rank failed, died or
        timed out."""
        t0 = time.perf_counter()
        self.store.set(f"step/{step}/go", b"1")
        wait_keys(self.store, {r: f"step/{step}/done/{r}" for r in range(self.n_train)}, timeout=self.timeout,
                  what=f"step {step} transfer", liveness=self.live_t, poll=0.001)
        if inference_active:
            wait_keys(self.store, {i: f"step/{step}/idone/{i}" for i in range(self.n_infer)}, timeout=self.timeout,
                      what=f"step {step} inference side", liveness=self.live_i, poll=0.001)
        seconds = time.perf_counter() - t0
        results = {r: get(self.store, f"step/{step}/done/{r}") for r in range(self.n_train)}
        if inference_active:
            results.update({("infer", i): get(self.store, f"step/{step}/idone/{i}") for i in range(self.n_infer)})
        failed = {r: res["error"] for r, res in results.items() if not res["ok"]}
        if failed:
            raise ControlError(f"step {step}: version not published; rank(s) failed: "
                               + "; ".join(f"{'inference ' + str(r[1]) if isinstance(r, tuple) else 'training ' + str(r)}: {e}"
                                           for r, e in sorted(failed.items(), key=lambda x: str(x[0]))))
        self.store.set("version", str(step).encode())
        return seconds, results

    def verified(self, step: int) -> dict[int, dict]:
        wait_keys(self.store, {i: f"step/{step}/verified/{i}" for i in range(self.n_infer)}, timeout=self.timeout,
                  what=f"step {step} verification", liveness=self.live_i)
        return {i: get(self.store, f"step/{step}/verified/{i}") for i in range(self.n_infer)}

    def shutdown(self, reason: str | None = None) -> None:
        if reason:
            self.store.set("abort", reason.encode())
        self.store.set("shutdown", b"1")


class TrainerClient:
    """A training rank's side of the control plane."""

    def __init__(self, store: dist.Store, rank: int, *, timeout: float = 600.0):
        self.store, self.rank, self.timeout = store, rank, timeout

    def publish_meta(self, metas) -> None:
        put(self.store, f"meta/train/{self.rank}", metas)

    def get_plan(self):
        wait_keys(self.store, {self.rank: f"plan/{self.rank}"}, timeout=self.timeout, what="plan")
        return get(self.store, f"plan/{self.rank}")

    def next_command(self, step: int) -> str:
        """Block until the controller asks for ``step`` (returns "load") or shuts down."""
        key = f"step/{step}/load"
        deadline = time.monotonic() + self.timeout
        nap = 1e-4
        while time.monotonic() < deadline:
            if self.store.check([key]):
                return "load"
            if self.store.check(["shutdown"]):
                return "shutdown"
            time.sleep(nap)
            nap = min(2 * nap, 0.02)
        raise ControlError(f"[rank {self.rank}] no command for step {step} within {self.timeout:.0f} s")

    def ready(self, step: int) -> None:
        self.store.set(f"step/{step}/ready/{self.rank}", b"1")

    def wait_go(self, step: int) -> None:
        wait_keys(self.store, {self.rank: f"step/{step}/go"}, timeout=self.timeout, what=f"go {step}", poll=0.001)

    def done(self, step: int, *, ok: bool, error: str = "", stats=None) -> None:
        put(self.store, f"step/{step}/done/{self.rank}", {"ok": ok, "error": error, "stats": stats})


class InferenceClient:
    """An inference rank's side: publish its memory once; read the published version."""

    def __init__(self, store: dist.Store, rank: int, *, timeout: float = 600.0):
        self.store, self.rank, self.timeout = store, rank, timeout

    def publish_meta(self, descriptor, tensor_metas) -> None:
        put(self.store, f"meta/infer/{self.rank}", (descriptor, tensor_metas))

    def version(self) -> int:
        return int(self.store.get("version"))

    def wait_go(self, step: int) -> bool:
        """Active methods: block until "go" for ``step`` (True) or shutdown (False)."""
        key = f"step/{step}/go"
        deadline = time.monotonic() + self.timeout
        nap = 1e-4
        while time.monotonic() < deadline:
            if self.store.check([key]):
                return True
            if self.store.check(["shutdown"]):
                return False
            time.sleep(nap)
            nap = min(2 * nap, 0.001)
        raise ControlError(f"[infer {self.rank}] no go for step {step} within {self.timeout:.0f} s")

    def done(self, step: int, *, ok: bool, error: str = "", stats=None) -> None:
        put(self.store, f"step/{step}/idone/{self.rank}", {"ok": ok, "error": error, "stats": stats})

    def wait_version_after(self, last: int, poll: float = 0.01) -> int | None:
        """Block until ``version`` > ``last``; None on shutdown."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            v = self.version()
            if v > last:
                return v
            if self.store.check(["shutdown"]):
                return None
            time.sleep(poll)
        raise ControlError(f"[infer {self.rank}] no new version after {last} within {self.timeout:.0f} s")

    def report(self, step: int, result: dict) -> None:
        put(self.store, f"step/{step}/verified/{self.rank}", result)
