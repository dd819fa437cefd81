"""Control plane over torch's ``TCPStore``: metadata once, a plan once, then per step "go",
completions, and the published weight version.

Keys (values in the library's data-only encoding, :mod:`weight_transfer.control.wire`, with the schema
:mod:`weight_transfer.control.keys` gives each, unless noted; every value sealed and authenticated by the
store, :mod:`weight_transfer.security.secure_store`)::

    meta/train/{r}          training rank r's [ParamMeta]
    meta/infer/{i}          inference rank i's (RegionDescriptor, [DestTensorMeta])
    plan/{r}                (RankPlan, {inference rank: RegionDescriptor}) for training rank r
    step/{s}/load           controller -> trainers: make the weights of step s (optimizer step)
    step/{s}/ready/{r}      trainer r has them
    step/{s}/go             controller -> trainers: transfer now
    step/{s}/done/{r}       trainer r's result: {"ok": bool, "error": str, "stats": StepStats}
    step/{s}/idone/{i}      inference rank i's result, for methods active on the inference side
    step/{s}/commit         controller -> engines with staged targets: every write of s completed, commit
    step/{s}/committed/{i}  inference rank i's commit result (``{"ok", "error", "stats"}``)
    step/{s}/failed         set by any rank that reported ``ok=False`` for step s (fail fast)
    weights                 the published state of the inference weights (ASCII, see WeightsState)
    weights/reason          why the last update failed (ASCII), after a failure
    weights/attempted       the highest version any update began (ASCII int): versions only increase
    weights/shadow          the version being written into shadow targets (ASCII int; C27)
    step/{s}/shift          controller -> trainers: {inference rank: bytes, or (lo, hi, bytes) for the
                            planned offsets in [lo, hi)} added to the planned offsets of ranks with
                            flip shadow targets (the half not live)
    version                 the complete version held (ASCII int); -1 while none is complete
    step/{s}/verified/{i}   inference rank i's verification result (harness only)
    hb/{name}               heartbeat counter of a process (``controller``, ``train{r}``, ``infer{i}``)
    abort                   a reason; every waiting party stops

Version protocol (what readers can rely on, :class:`WeightsState`): before the "go" of an
update to version ``v`` the controller publishes ``writing v`` (and ``version = -1``); only
after every write of every rank completed (and every engine with staged targets committed) does
it publish ``complete v`` (then ``version =
v``); after any failure it publishes ``incomplete v`` (the bytes are a mix: no complete version
is present) until a later update completes. Every transition increments a sequence number, and
versions only increase (:class:`VersionError` otherwise), so a reader that sees the same
``complete v`` state before and after reading saw no write in between (a seqlock:
:func:`read_consistent`). A waiter for a version that was skipped or whose
update failed gets :class:`VersionError` / :class:`ControlError`, not a hang.

With shadow targets (:attr:`Controller.shadow`, case C27) the writes land in shadows the
engines do not compute with: the state stays ``complete`` at the version being served while
an update writes (``weights/shadow`` names the one written), the engines' go-live is the commit,
and only then ``complete v`` is published; a failure before any go-live leaves ``complete`` at
the previous version (nothing live was touched), a failure during the go-live publishes
``incomplete v``.

Liveness: waits take a timeout and name the ranks that did not answer; a ``liveness`` callback
names ranks whose process died; :class:`Heartbeat` threads (one per process) let the controller
name a rank that stopped making progress (SIGSTOP, a hung interpreter) and let ranks leave on
their own when the controller stops answering (a TCPStore call to a stopped server blocks past
the store's timeout, so the watchdog does not rely on it).

Why a key-value store: ``check``/``set``/``add``/``compare_set`` on keys are exactly the control
flow here, and it is the interface torch.distributed already uses for rendezvous. The store is
:class:`weight_transfer.security.secure_store.SecureStore` (torch's ``TCPStore`` interface behind mutual
TLS, values sealed with the job's key: docs/SECURITY.md); torch's plain ``TCPStore`` only with
the explicit, warned opt-out. The poll loop is hand-written once (:func:`backoff`) because a
store's blocking ``wait`` cannot be interrupted to look at liveness.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import (  # noqa: F401 -- part of this module's API (control.ControlError, ...)
    WAKE_SLICE,
    ControlError,
    GoLiveNotStarted,
    VersionError,
    any_exists,
    backoff,
    decode_error,
    encode_error,
    wait_all,
    watch,
)
from .heartbeat import Heartbeat, HeartbeatMonitor  # noqa: F401 -- part of this module's API (control.Heartbeat)
from .keys import SHADOW_KEY
from .wire import TEXT_LIMIT, get, get_int, get_text, parse_int, put  # noqa: F401 -- the encoding of the values

FAILURE_CHECK_S = 0.02
"""Seconds between two failure checks of :func:`wait_keys`, however often it polls its keys."""


def role_name(rank) -> str:
    """``"training r"`` for a training rank ``r`` (an int), ``"inference i"`` for ``("infer", i)``."""
    return f"inference {rank[1]}" if isinstance(rank, tuple) else f"training {rank}"


def wait_keys(store: dist.Store, keys: dict[int, str], *, timeout: float, what: str,
              liveness: Callable[[], dict[int, str]] | None = None, poll: float = 0.02,
              failure: Callable[[], str | None] | None = None, stall: float | None = None,
              check_every: float = FAILURE_CHECK_S) -> None:
    """Wait until every ``keys[rank]`` exists. Raises ControlError naming the ranks still
    missing after ``timeout`` seconds, at once naming dead ranks (``liveness`` returns
    ``{rank: reason}`` for ranks known dead), the abort reason, or the culprit ``failure()``
    returns (a one-line "role rank: cause", None while nothing failed). With ``stall``, a gap
    of more than ``stall`` seconds between two of its own polls (this process was stopped or
    starved, so what it waits on may be stale) raises naming the controller. Each poll asks
    for the keys in one store call; the failure checks (several calls) run every
    ``check_every`` seconds, first poll and expiry included: on the 2-core VM, checks at every
    1 ms poll of the transfer took a core from the senders (``run --quant none``, 24 updates
    each: median 0.1416 s against 0.1323 s with a check every 20 ms). A store that can
    (:func:`wait_all`) blocks at its server between two polls and wakes when the keys are
    there: no polling traffic."""
    allkeys = list(keys.values())
    last = time.monotonic()
    checked = float("-inf")
    wake = (lambda s: wait_all(store, allkeys, min(s, check_every))) if can_watch(store) else None
    for expired in backoff(timeout, poll, wake=wake):
        now = time.monotonic()
        if stall is not None and now - last > stall:
            raise ControlError(f"{what}: controller: no progress for {now - last:.1f} s (this process was stopped "
                               "or starved)")
        last = now
        if store.check(allkeys):
            return
        if now - checked < check_every and not expired:
            continue
        checked = now
        culprit = failure() if failure is not None else None
        if culprit:
            err = ControlError(f"{what}: {culprit}")
            err.culprit = culprit
            raise err
        aborted = store.check(["abort"])
        dead = {r: why for r, why in liveness().items() if r in keys} if liveness is not None else {}
        if expired or aborted or dead:
            pending = sorted(r for r, k in keys.items() if not store.check([k]))
            if not pending:
                return
            if aborted:
                raise ControlError(f"{what}: aborted: {get_text(store, 'abort')}")
            dead = {r: w for r, w in dead.items() if r in pending}
            if dead:
                raise ControlError(f"{what}: rank(s) died: " + "; ".join(f"{r}: {w}" for r, w in sorted(dead.items())))
            if expired:
                raise ControlError(f"{what}: no answer within {timeout:.0f} s from rank(s) {pending}")


def can_watch(store) -> bool:
    """Whether ``store`` wakes a waiter at its server (:func:`watch`; the job's authenticated
    store does, torch's ``TCPStore`` of the opt-out does not: its waiters poll)."""
    return getattr(store, "watch", None) is not None


def _poll_key(store: dist.Store, key: str, *, timeout: float, what: str, poll: float) -> bool:
    """True once ``key`` exists, False on ``shutdown``; ControlError after ``timeout``."""
    wake = (lambda s: watch(store, [key, "shutdown"], s)) if can_watch(store) else None
    for expired in backoff(timeout, poll, wake=wake):
        if store.check([key]):
            return True
        if store.check(["shutdown"]):
            return False
        if expired:
            raise ControlError(f"{what} within {timeout:.0f} s")


# --------------------------------------------------------------------------------------------
# the published state of the weights


@dataclass(frozen=True, slots=True)
class WeightsState:
    """What the inference weights are, as published under the ``weights`` key
    (``"{seq} {state} {version}"``, ASCII).

    ``state``: ``"none"`` (no update yet), ``"writing"`` (version ``version`` is being written:
    bytes may be mixed), ``"complete"`` (every byte is version ``version``), ``"incomplete"``
    (the update to ``version`` failed: bytes are mixed until a later update completes).
    ``seq`` increases at every transition, so two equal states read at two times mean no
    transition happened in between (the seqlock check)."""

    seq: int
    state: str
    version: int

    STATES = ("none", "writing", "complete", "incomplete")

    @property
    def complete(self) -> bool:
        return self.state == "complete"

    def encode(self) -> bytes:
        return f"{self.seq} {self.state} {self.version}".encode()

    @classmethod
    def decode(cls, raw: bytes, key: str = "weights") -> WeightsState:
        """The state written by :meth:`encode`. ControlError naming ``key`` for anything else."""
        parts = raw.split()
        if len(parts) != 3 or parts[1].decode("ascii", "replace") not in cls.STATES:
            raise ControlError(f"store key {key!r}: refused a value that is not a weights state")
        return cls(parse_int(parts[0], key), parts[1].decode(), parse_int(parts[2], key))

    def __str__(self) -> str:
        return {"none": "no version yet", "writing": f"writing version {self.version} (update in progress)",
                "complete": f"complete version {self.version}",
                "incomplete": f"incomplete (the update to version {self.version} failed)"}[self.state]


def read_state(store: dist.Store) -> WeightsState:
    """The published :class:`WeightsState` (``none`` before the controller's first write)."""
    get_nowait = getattr(store, "get_nowait", None)
    raw = get_nowait("weights") if get_nowait is not None else store.get("weights") if store.check(["weights"]) else None
    return WeightsState(0, "none", -1) if raw is None else WeightsState.decode(raw)


def report_fatal(store: dist.Store, name: str, cause: str) -> None:
    """A rank's last word before its process ends on an error: ``fatal/{name}`` (``train{r}``
    / ``infer{i}``) holds the cause, which the controller names instead of a bare exit code."""
    store.set(f"fatal/{name}", f"{cause} (fatal)".encode())
    store.set("fatal", b"1")


# --------------------------------------------------------------------------------------------
# consistent reads of weights written in place


class UpdateInProgress(RuntimeError):
    """No complete version of the weights could be read: an update is being written, or the
    last one failed (the bytes are a mix). ``state`` is the last state seen."""

    def __init__(self, state, msg: str):
        super().__init__(msg)
        self.state = state


def read_consistent(state: Callable[[], object], read: Callable[[], object], *, wait: bool = True,
                    timeout: float = 30.0, poll: float = 0.005):
    """A seqlock read of weights that are written in place by one-sided writes.

    ``state()`` returns the published state of the weights (e.g.
    ``:meth:`weight_transfer.control.clients.InferenceClient.state```: anything with a ``complete`` attribute whose
    equality means "no transition in between": the control plane's ``WeightsState`` carries a
    sequence number that moves at every transition). ``read()`` reads the bytes (copies them,
    or runs a forward pass). The read counts only if the state was complete before it and is
    the same after it: the writers publish "writing" before their first byte and "complete"
    only after their last, so no byte changed in between. Otherwise it is retried; while the
    state is not complete, ``wait=False`` raises :class:`UpdateInProgress` at once, ``wait=True``
    polls every ``poll`` seconds up to ``timeout``. Returns ``(state, read())``.

    This is the pause side of pause/resume: readers wait (or report "update in progress")
    while an update writes in place; memory cost nothing. A serving engine (the stand-in here,
    a vLLM worker extension) brackets each forward step with the same two ``state()`` reads and
    discards a step whose states differ. A double-buffered option (two weight sets, writes to
    the inactive one, flipped at publish) would let readers run during an update at the cost
    of a second copy of every parameter (2x the arena bytes per inference rank); it is not
    built here."""
    deadline = time.monotonic() + timeout
    while True:
        s0 = state()
        if getattr(s0, "complete", False):
            out = read()
            s1 = state()
            if s1 == s0:
                return s0, out
            s0 = s1
        if not wait or time.monotonic() >= deadline:
            raise UpdateInProgress(s0, f"no complete version to read (weights: {s0})"
                                       + ("" if not wait else f" within {timeout:.0f} s"))
        time.sleep(poll)


# --------------------------------------------------------------------------------------------
# the controller


class Controller:
    """The controller's side: collect metadata once, drive steps, publish the weights' state.

    ``liveness_train`` / ``liveness_infer`` return ``{rank: reason}`` for ranks whose process
    is known dead; ``stall`` (seconds) enables the heartbeat monitor: a rank whose ``hb/``
    counter stops moving for that long is named as stalled (None: no monitor). Any failure is
    reported as ``"training r: cause"`` / ``"inference i: cause"``, the root cause first (a
    dead or stalled process before the ranks that failed because of it)."""

    def __init__(self, store: dist.Store, n_train: int, n_infer: int, *, timeout: float = 120.0,
                 liveness_train: Callable[[], dict[int, str]] | None = None,
                 liveness_infer: Callable[[], dict[int, str]] | None = None, stall: float | None = None):
        self.store, self.n_train, self.n_infer, self.timeout = store, n_train, n_infer, timeout
        self.live_t, self.live_i = liveness_train, liveness_infer
        self.monitor, self.stall = None, stall
        self.last_culprit: str | None = None
        """The root cause of the last failure ("training 1: ..."), once one was seen."""
        self.last_write_seconds: float | None = None
        """Seconds from "go" to the last trainer completion of the last :meth:`transfer`."""
        self.shadow: dict[int, dict] = {}
        self.verifier = None
        self._verified: int | None = None
        self.verify_after_commit = False
        """Check after the commits even with shadow targets: packed delta records are applied by
        the receivers' commit (go-live), so the shadow holds the version only after it."""
        """The coordinator's :class:`weight_transfer.control.fingerprint.Verifier` (set at plan), or None."""
        self.last_verify: dict = {"mode": "off", "bytes": 0, "seconds": 0.0}
        """The last update's check: ``{"mode", "bytes" checked, "seconds"}``."""
        """Inference rank -> its shadow targets' info (:meth:`weight_transfer.api.shadow.Shadow.info`,
        published under :data:`weight_transfer.control.store.SHADOW_KEY`), set after planning; every
        rank has one or none does. Non-empty: :meth:`transfer` follows the shadow protocol (see
        the module docstring); the shadow ranks must be among its ``commit_ranks``."""
        if stall is not None:
            names = {r: f"train{r}" for r in range(n_train)}
            names.update({("infer", i): f"infer{i}" for i in range(n_infer)})
            self.monitor = HeartbeatMonitor(store, names, stall=stall)
        if not store.check(["weights"]):
            store.set("weights", WeightsState(0, "none", -1).encode())
            store.set("version", b"-1")
        self._state = read_state(store)
        """The published state as this controller last wrote it: the controller is the only
        writer of ``weights``, so it never acts on what the store holds there after it started
        (a value no member wrote is overwritten at the next transition; readers refuse it)."""

    # -- failures

    def culprits(self, step: int | None = None) -> list[str]:
        """Every known failure, root causes first: dead processes, stalled processes, then
        ranks that reported an error for ``step``."""
        out = []
        if self.store.check(["fatal"]):
            for k in [r for r in range(self.n_train)] + [("infer", i) for i in range(self.n_infer)]:
                key = f"fatal/{'infer' + str(k[1]) if isinstance(k, tuple) else 'train' + str(k)}"
                if self.store.check([key]):
                    out.append(f"{role_name(k)}: {get_text(self.store, key)}")
        for live, key in ((self.live_t, lambda r: r), (self.live_i, lambda i: ("infer", i))):
            if live is not None:
                out += [f"{role_name(key(r))}: {why}" for r, why in sorted(live().items())]
        if self.monitor is not None:
            out += [f"{role_name(k)}: {why}" for k, why in sorted(self.monitor.stalled().items(), key=lambda x: str(x))]
        if step is not None and self.store.check([f"step/{step}/failed"]):
            echoes = []  # ranks that stopped because another one failed: after the root causes
            for r in range(self.n_train):
                k = f"step/{step}/done/{r}"
                if self.store.check([k]) and not (res := get(self.store, k))["ok"]:
                    (echoes if res.get("cancelled") else out).append(f"training {r}: {res['error']}")
            for i in range(self.n_infer):
                k = f"step/{step}/idone/{i}"
                if self.store.check([k]) and not (res := get(self.store, k))["ok"]:
                    out.append(f"inference {i}: {res['error']}")
                k = f"step/{step}/committed/{i}"
                if self.store.check([k]) and not (res := get(self.store, k))["ok"]:
                    out.append(f"inference {i}: commit failed: {res['error']}")
            out += echoes
        return out

    def training_restarted(self) -> None:
        """The training world was replaced: forget its ranks' last words and heartbeats."""
        for r in range(self.n_train):
            if self.store.check([f"fatal/train{r}"]):
                self.store.delete_key(f"fatal/train{r}")
        if self.monitor is not None:
            self.monitor.reset(list(range(self.n_train)))

    def _failure(self, step: int | None = None, grace: float = 0.3) -> Callable[[], str | None]:
        def check() -> str | None:
            found = self.culprits(step)
            if not found:
                return None
            def rooted(fs):
                return any(": process" in c or "no heartbeat" in c or "(fatal)" in c for c in fs)
            # a reported error is often the echo of a death: look again for ``grace`` seconds,
            # up to 2 s when it says a peer is gone (a killed process takes a while to be reaped)
            until = time.monotonic() + (max(grace, 2.0) if any(" is gone" in c for c in found) else grace)
            while not rooted(found) and time.monotonic() < until:
                time.sleep(0.05)
                found = self.culprits(step) or found
            self.last_culprit = found[0]
            return found[0] + (f" (also: {'; '.join(found[1:3])})" if len(found) > 1 else "")
        return check

    def _wait(self, keys: dict, what: str, step: int | None = None, poll: float = 0.02) -> None:
        wait_keys(self.store, keys, timeout=self.timeout, what=what, poll=poll, failure=self._failure(step),
                  stall=self.stall)

    # -- setup

    def collect(self):
        """Block until every rank published its metadata; return (train, infer) dicts."""
        self._wait({r: f"meta/train/{r}" for r in range(self.n_train)}, "training metadata")
        self._wait({i: f"meta/infer/{i}" for i in range(self.n_infer)}, "inference metadata")
        train = {r: get(self.store, f"meta/train/{r}") for r in range(self.n_train)}
        infer = {i: get(self.store, f"meta/infer/{i}") for i in range(self.n_infer)}
        return train, infer

    # -- the weights' state

    def state(self) -> WeightsState:
        """The published :class:`WeightsState` (this controller's own record of what it published)."""
        return self._state

    def _set_state(self, state: str, version: int) -> WeightsState:
        new = WeightsState(self._state.seq + 1, state, version)
        if state != "complete":
            self.store.set("version", b"-1")
        self.store.set("weights", new.encode())
        self._state = new
        if state == "complete":
            self.store.set("version", str(version).encode())
            self.store.set(f"complete/{version}", b"1")  # persistent: delta senders check it (C26)
        return new

    def attempted(self) -> int:
        """The highest version any update began (-1 before the first)."""
        return get_int(self.store, "weights/attempted") if self.store.check(["weights/attempted"]) else -1

    def begin(self, version: int) -> WeightsState:
        """Publish ``writing version`` (before any byte of the update moves); with shadow
        targets (:attr:`shadow`) the state stays as it is and ``weights/shadow`` names the
        version written into the shadows. Raises VersionError unless ``version`` is above every
        version named so far (written, published or failed): versions only increase, a failed
        one is not reused."""
        cur = self.state()
        top = max(cur.version, self.attempted())
        if version <= top:
            why = f"the weights are {cur}" + (f", version {top} was attempted" if top > cur.version else "")
            raise VersionError(f"version {version} refused: {why}; versions only increase")
        self.store.set("weights/attempted", str(version).encode())
        if self.shadow:
            self.store.set("weights/shadow", str(version).encode())
            return cur
        return self._set_state("writing", version)

    def publish(self, version: int) -> WeightsState:
        """Publish ``complete version``: call only once every write of every rank of the update
        begun with :meth:`begin` completed (with shadow targets: every engine's go-live too).
        Raises VersionError for any other version (one lower than the current: versions never
        move back)."""
        cur = self.state()
        if self.shadow:
            ok = self.store.check(["weights/shadow"]) and get_int(self.store, "weights/shadow") == version
            if not ok or cur.version >= version:
                raise VersionError(f"version {version} refused: the weights are {cur}; only the version written "
                                   "into the shadows can be published, and versions only increase")
            return self._set_state("complete", version)
        if cur.state != "writing" or cur.version != version:
            raise VersionError(f"version {version} refused: the weights are {cur}; only the version being written "
                               "can be published, and versions only increase")
        return self._set_state("complete", version)

    def mark_incomplete(self, version: int, reason: str) -> WeightsState:
        """After a failed update to ``version``: the weights are a mix; say so."""
        self.store.set("weights/reason", reason.encode())
        return self._set_state("incomplete", version)

    # -- steps

    def load(self, step: int) -> None:
        """Ask every trainer to produce step ``step``'s weights and wait until they have."""
        self.store.set(f"step/{step}/load", b"1")
        self._wait({r: f"step/{step}/ready/{r}" for r in range(self.n_train)}, f"step {step} weights")

    def transfer(self, step: int, *, inference_active: bool = False,
                 commit_ranks: tuple[int, ...] = (),
                 commit: Callable[[int], object] | None = None,
                 claim: Callable[[], str | None] | None = None) -> tuple[float, dict[int, dict]]:
        """Publish ``writing step``, send "go", wait for every trainer's completion (and every
        inference rank's, for methods active on the inference side), then, if ``commit_ranks``
        is not empty, ask those inference ranks to commit (``step/{step}/commit``: an engine
        with staged targets re-runs its own post-processing on the bytes that just landed) and
        wait for each one's ``committed`` report, then publish ``complete step``. Returns
        (seconds from go to the last completion or commit, per-rank results; inference ranks
        keyed ``("infer", i)``, commits ``("commit", i)``; :attr:`last_write_seconds` holds go to
        the last trainer completion). ``commit`` (a callable of the step), if given, runs after
        that, once every write completed: a commit driven from here instead of through the store
        (the vLLM backend's ``update_weights`` call); its return value is kept as
        ``results[("commit", "call")]`` and an exception it raises fails the update like a
        rank's; one that does not return within the timeout fails it too (the call is left
        running in its thread: the library cannot stop a caller's code). ``claim`` (optional)
        is asked last, once everything succeeded: it returns None to let ``complete step`` be
        published, or the reason it may not be (e.g. a training rank that gave up waiting
        claimed the update's outcome first: every rank must reach the same decision), which
        then fails the update like any error. If any rank fails, dies or stalls, raises
        ControlError at once naming it ("training 1: ...", "inference 0: commit failed: ...")
        and publishes ``incomplete step``: the version is never published over bytes a commit
        did not finish."""
        before = self.begin(step)
        golive = False  # with shadow targets: whether any engine may have gone live
        flips = {i: info for i, info in self.shadow.items() if info.get("mode") == "flip"}
        shifts: dict = {}
        if flips:  # the half each flip receiver does not compute with (it moves at each go-live)
            shifts = {i: get(self.store, SHADOW_KEY.format(rank=i))["shift"] for i in flips}
            put(self.store, f"step/{step}/shift", shifts)
        vf = self.verifier if self.verifier is not None and self.verifier.on else None
        self.last_verify = {"mode": vf.options.mode if vf else "off", "bytes": 0, "seconds": 0.0}
        self._verifying = (step, vf, shifts)  # a commit callable may verify itself (verify_now), before its label
        # fingerprints before any go-live (shadow targets) or when nothing commits; else after the commit
        verify_first = vf is not None and (bool(self.shadow) and not self.verify_after_commit
                                           or not (commit_ranks or commit is not None))
        t0 = time.perf_counter()
        self.store.set(f"step/{step}/go", b"1")
        try:
            self._wait({r: f"step/{step}/done/{r}" for r in range(self.n_train)}, f"step {step} transfer", step,
                       poll=0.001)
            if inference_active:
                self._wait({i: f"step/{step}/idone/{i}" for i in range(self.n_infer)}, f"step {step} inference side",
                           step, poll=0.001)
            write_seconds = time.perf_counter() - t0
            results = {r: get(self.store, f"step/{step}/done/{r}") for r in range(self.n_train)}
            if inference_active:
                results.update({("infer", i): get(self.store, f"step/{step}/idone/{i}") for i in range(self.n_infer)})
            failed = {r: res["error"] for r, res in results.items() if not res["ok"]}
            if not failed and verify_first:
                self._verify(vf, step, shifts)
            if not failed and commit_ranks:
                golive = True
                self.store.set(f"step/{step}/commit", b"1")
                what = (f"step {step} go-live (shadow targets: a receiver goes live in Receiver.serve_go_live or "
                        "Receiver.go_live)" if self.shadow else f"step {step} commit")
                self._wait({i: f"step/{step}/committed/{i}" for i in commit_ranks}, what, step, poll=0.001)
                results.update({("commit", i): get(self.store, f"step/{step}/committed/{i}") for i in commit_ranks})
                failed = {r: res["error"] for r, res in results.items() if not res["ok"]}
            if not failed and commit is not None:
                golive = True
                results[("commit", "call")] = {"ok": True, "error": "", "stats": self._commit(commit, step)}
            if not failed and vf is not None and not verify_first and self._verified != step:
                self._verify(vf, step, shifts)
            if not failed and claim is not None and (why := claim()) is not None:
                raise ControlError(why)
            seconds = time.perf_counter() - t0
            self.last_write_seconds = write_seconds
            if failed:  # root cause first (a dead process before the ranks that echo it)
                raise ControlError(self._failure(step)() or "; ".join(
                    f"{role_name(r[1] if isinstance(r, tuple) and r[0] == 'commit' else r)}: "
                    f"{'commit failed: ' if isinstance(r, tuple) and r[0] == 'commit' else ''}{e}"
                    for r, e in sorted(failed.items(), key=lambda x: str(x[0]))))
        except BaseException as e:
            # the culprit, whether the wait saw step/N/failed or every rank had reported
            first = getattr(e, "culprit", None) or (str(e).splitlines()[0] if str(e) else type(e).__name__)
            cause = e.__cause__ if isinstance(e, ControlError) else e
            if self.shadow and (not golive or isinstance(cause, GoLiveNotStarted)):
                # nothing live was touched: the served version stays complete
                self.store.set("weights/reason", first.encode())
                if isinstance(e, ControlError):
                    raise ControlError(f"step {step}: update failed before any go-live, nothing live was touched "
                                       f"({before} keeps serving): {first}") from e
                raise
            self.mark_incomplete(step, first)
            if isinstance(e, ControlError):
                raise ControlError(f"step {step}: update failed, weights marked incomplete: {first}") from e
            raise
        self.publish(step)
        return seconds, results

    def verify_now(self, step: int) -> dict:
        """For a commit callable (``transfer(commit=...)``) that labels the version itself: run
        the end-to-end check of ``step`` now, after its commit and before its label (the vLLM
        backend calls it between ``update_weights`` and ``finish_weight_update``), so that no
        reader sees the label over bytes that fail it; the transfer then does not check again.
        Returns :attr:`last_verify`; ControlError as :meth:`transfer`'s check. A no-op outside
        a transfer of ``step`` or with verify off."""
        st, vf, shifts = getattr(self, "_verifying", (None, None, None))
        if st == step and vf is not None and self._verified != step:
            self._verify(vf, step, shifts)
        return self.last_verify

    def _verify(self, vf, step: int, shifts: dict) -> None:
        """The end-to-end check of ``step`` (:meth:`weight_transfer.control.fingerprint.Verifier.check`);
        sets :attr:`last_verify`, raises its ControlError."""
        self._verified = step
        self.last_verify = {"mode": vf.options.mode, "bytes": 0, "seconds": 0.0}
        self.last_verify = vf.check(self.store, step, shifts, self.n_train,
                                    wait=lambda keys, what: self._wait(keys, what, step, poll=0.001))

    def _commit(self, commit: Callable[[int], object], step: int):
        """``commit(step)`` in a thread of its own, waited for up to the timeout. ControlError
        "commit failed: ..." (the call's exception as ``__cause__``) or "commit ... did not
        return within T s" (the call is left running: a caller's code cannot be stopped)."""
        import threading

        box: dict = {}

        def call():
            try:
                box["out"] = commit(step)
            except BaseException as e:  # handed to the waiting thread
                box["err"] = e

        th = threading.Thread(target=call, name=f"wt-commit-{step}", daemon=True)
        th.start()
        th.join(self.timeout)
        if th.is_alive():
            raise ControlError(f"commit of step {step} did not return within {self.timeout:.0f} s (left running)")
        if "err" in box:
            e = box["err"]
            raise ControlError(f"commit failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        return box.get("out")

    def verified(self, step: int) -> dict[int, dict]:
        self._wait({i: f"step/{step}/verified/{i}" for i in range(self.n_infer)}, f"step {step} verification")
        return {i: get(self.store, f"step/{step}/verified/{i}") for i in range(self.n_infer)}

    def shutdown(self, reason: str | None = None) -> None:
        if reason:
            self.store.set("abort", reason.encode())
        self.store.set("shutdown", b"1")
