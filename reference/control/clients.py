"""The ranks' sides of the control plane (:mod:`weight_transfer.control.protocol`, which re-exports
them): :class:`TrainerClient` (a training rank: metadata, its plan, ready/done per step) and
:class:`InferenceClient` (an inference rank: its region's metadata, the published weights'
state, commits of staged targets). Keys as the control module's docstring lists them."""
from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from .protocol import (
    ControlError,
    VersionError,
    WeightsState,
    _poll_key,
    backoff,
    can_watch,
    get,
    get_text,
    put,
    read_state,
    wait_keys,
    watch,
)

IDLE_WAKE = 0.1
"""Seconds a reader waiting for a version blocks per round at most when the store wakes it on
every change of the published state (what else it looks at: its deadline, shutdown, a per-rank
view's membership)."""


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
        ok = _poll_key(self.store, f"step/{step}/load", timeout=self.timeout,
                       what=f"[rank {self.rank}] no command for step {step}", poll=0.02)
        return "load" if ok else "shutdown"

    def ready(self, step: int) -> None:
        self.store.set(f"step/{step}/ready/{self.rank}", b"1")

    def wait_go(self, step: int) -> None:
        wait_keys(self.store, {self.rank: f"step/{step}/go"}, timeout=self.timeout, what=f"go {step}", poll=0.001)

    def done(self, step: int, *, ok: bool, error: str = "", stats=None, cancelled: bool = False,
             fingerprints=None) -> None:
        """Report this rank's result of ``step``; ``cancelled``: it stopped because another rank
        failed (named after the root cause: :meth:`Controller.culprits`); ``fingerprints``: the
        :class:`weight_transfer.control.fingerprint.SenderHashes` of the writes (set before the report,
        which the coordinator waits for)."""
        from .wire import tag

        if ok and fingerprints is not None:
            from .fingerprint import TRAIN_KEY

            put(self.store, TRAIN_KEY.format(v=step, r=self.rank), fingerprints.value())
        if not ok:  # first: whoever sees the result sees the flag (one connection, requests in order)
            self.store.set(f"step/{step}/failed", b"1")
        put(self.store, f"step/{step}/done/{self.rank}", {"ok": ok, "error": error, "stats": tag(stats),
                                                          "cancelled": cancelled})


class InferenceClient:
    """An inference rank's side: publish its memory once; read the published weights' state."""

    def __init__(self, store: dist.Store, rank: int, *, timeout: float = 600.0):
        self.store, self.rank, self.timeout = store, rank, timeout

    def publish_meta(self, descriptor, tensor_metas) -> None:
        put(self.store, f"meta/infer/{self.rank}", (descriptor, tensor_metas))

    def version(self) -> int | None:
        """The complete version the weights hold; -1 before any update; None while an update
        is in progress or after a failed one (the bytes are not one version)."""
        s = self.state()
        return s.version if s.state in ("complete", "none") else None

    def wait_go(self, step: int) -> bool:
        """Active methods: block until "go" for ``step`` (True) or shutdown (False)."""
        return _poll_key(self.store, f"step/{step}/go", timeout=self.timeout,
                         what=f"[infer {self.rank}] no go for step {step}", poll=0.001)

    def done(self, step: int, *, ok: bool, error: str = "", stats=None) -> None:
        if not ok:
            self.store.set(f"step/{step}/failed", b"1")
        put(self.store, f"step/{step}/idone/{self.rank}", {"ok": ok, "error": error, "stats": stats})

    def wait_commit(self, step: int, poll: float = 0.001) -> bool:
        """An engine with staged targets: block until the controller asks to commit ``step``
        (every write of the update completed: True) or the job shuts down (False). Waits through
        a failed update (the controller then shuts down or moves on)."""
        wake = (lambda sec: watch(self.store, [f"step/{step}/commit", "shutdown"], sec)) if can_watch(self.store) else None
        for _ in backoff(None, poll, wake=wake):
            if self.store.check([f"step/{step}/commit"]):
                return True
            if self.store.check(["shutdown"]):
                return False

    def committed(self, step: int, *, ok: bool, error: str = "", stats=None) -> None:
        """Report this rank's commit of ``step`` (``stats``: e.g. ``{"seconds", "layers", "bytes"}``)."""
        if not ok:
            self.store.set(f"step/{step}/failed", b"1")
        put(self.store, f"step/{step}/committed/{self.rank}", {"ok": ok, "error": error, "stats": stats})

    def wait_version_after(self, last: int, poll: float = 0.01) -> int | None:
        """Block until a complete version > ``last`` is published (a failed update in between
        is waited through: the next one may restore); None on shutdown."""
        wake = self._state_waker()
        for expired in backoff(self.timeout, poll if wake is None else max(poll, IDLE_WAKE), wake=wake):
            s = self.state()
            if s.complete and s.version > last:
                return s.version
            if self.store.check(["shutdown"]):
                return None
            if expired:
                raise ControlError(f"[infer {self.rank}] no new version after {last} within {self.timeout:.0f} s "
                                   f"(weights: {s})")

    def wait_version(self, version: int, *, timeout: float | None = None, poll: float = 0.01,
                     state: Callable[[], WeightsState] | None = None) -> WeightsState:
        """Block until ``complete version`` is published and return that state. Raises
        VersionError at once if ``version`` was skipped (a later version is being written or
        complete), ControlError if the update to it failed (weights incomplete), on shutdown,
        or after ``timeout`` seconds (default: the client's). ``state``: where to read the
        weights' state (default :meth:`state`; a receiver passes its per-rank view, C24)."""
        timeout = self.timeout if timeout is None else timeout
        state = self.state if state is None else state
        wake = self._state_waker()
        for expired in backoff(timeout, poll if wake is None else max(poll, IDLE_WAKE), wake=wake):
            s = state()
            if s.complete and s.version == version:
                return s
            if s.version > version and s.state != "none":
                raise VersionError(f"[infer {self.rank}] version {version} was skipped: the weights are {s}")
            if s.state == "incomplete" and s.version == version:
                reason = get_text(self.store, "weights/reason") if self.store.check(["weights/reason"]) else ""
                raise ControlError(f"[infer {self.rank}] the update to version {version} failed; weights are "
                                   f"incomplete: {reason}")
            if self.store.check(["shutdown"]):
                raise ControlError(f"[infer {self.rank}] shut down while waiting for version {version} ({s})")
            if expired:
                raise ControlError(f"[infer {self.rank}] version {version} not published within {timeout:.0f} s "
                                   f"(weights: {s})")

    def state(self) -> WeightsState:
        """The published :class:`WeightsState` (pass this method as the ``state`` callable of
        :func:`read_consistent`)."""
        return self._read()

    def _read(self) -> WeightsState:
        raw = self.store.get_nowait("weights") if can_watch(self.store) else None
        self._raw = raw
        return read_state(self.store) if not can_watch(self.store) else (
            WeightsState(0, "none", -1) if raw is None else WeightsState.decode(raw))

    def _state_waker(self):
        """A ``wake`` for :func:`backoff` that blocks at the store until the published state
        differs from the one last read (its bytes) or shutdown is set; None for a store that
        cannot watch (its waiters poll)."""
        if not can_watch(self.store):
            return None

        def wake(sec: float) -> None:
            watch(self.store, ["weights", "shutdown"], sec, [getattr(self, "_raw", None), None])
        return wake

    def report(self, step: int, result: dict) -> None:
        put(self.store, f"step/{step}/verified/{self.rank}", result)


def job_ending(store) -> bool:
    """Whether the controller is ending the job (its ``shutdown`` key, or an ``abort`` it set
    itself, ``controller: ...``), or the store is gone: an error a rank sees then is that end,
    which the controller reports in its own one line, so the rank prints no traceback (a rank
    printing one while the controller stops it would leave a cut-off traceback on the command's
    stderr)."""
    try:
        if store.check(["shutdown"]):
            return True
        return store.check(["abort"]) and get_text(store, "abort").startswith("controller:")
    except Exception:
        return True
