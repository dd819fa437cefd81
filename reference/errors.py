"""The errors the control plane hands between ranks, and its one bounded poll loop.

The bottom of the control plane's modules (:mod:`weight_transfer.control.protocol` re-exports all of it):
:mod:`weight_transfer.security.secret`, :mod:`weight_transfer.control.wire` and :mod:`weight_transfer.control.store`
import it, and it imports none of them."""
from __future__ import annotations

import time
from collections.abc import Iterator

__all__ = ["ControlError", "GoLiveNotStarted", "VersionError", "encode_error", "decode_error", "backoff", "watch",
           "wait_all", "any_exists", "WAKE_SLICE"]


class ControlError(RuntimeError):
    """A rank failed, died or did not answer in time; the message names role, rank and cause.
    ``culprit``: the "role rank: cause" line :func:`wait_keys` found, without its prefix, or None."""

    culprit: str | None = None
    metrics_kind: str | None = None
    """Its ``kind`` label in :mod:`weight_transfer.metrics` when not the type's name (``kind=``:
    e.g. ``"fingerprint_mismatch"``); None: ``ControlError``."""

    def __init__(self, *args, kind: str | None = None):
        super().__init__(*args)
        if kind is not None:
            self.metrics_kind = kind


class GoLiveNotStarted(RuntimeError):
    """Raised by a commit callable (:meth:`Controller.transfer`) that failed before any engine
    went live (e.g. a shadow's rebuild that did not finish): with shadow targets the update then
    fails with nothing live touched, the served version stays ``complete``."""


class VersionError(ControlError):
    """A version that would move backwards (or repeat a published one), or a waited-for version
    that was skipped."""


def encode_error(e: BaseException) -> tuple[str, str]:
    """``(type name, message)`` of an error, to hand it to other ranks through the store
    (:func:`decode_error` raises it there as the same documented type)."""
    return type(e).__name__, str(e)


def decode_error(kind: str, msg: str) -> BaseException:
    """The error :func:`encode_error` described, as the documented type of that name
    (``ValueError``, ``TypeError``, ``PlanError``, ``VersionError``, ``ControlError``); any
    other type arrives as ControlError (a failure, not a refusal), naming the type."""
    from .types import PlanError

    known = {"ValueError": ValueError, "TypeError": TypeError, "PlanError": PlanError, "VersionError": VersionError,
             "ControlError": ControlError}
    cls = known.get(kind)
    return cls(msg) if cls is not None else ControlError(f"{kind}: {msg}")


WAKE_SLICE = 0.02
"""Seconds a waiter that the store wakes (:func:`watch`) blocks per round at most: it wakes at
once when what it waits for changes, and looks at everything else (liveness, failures, its
deadline) at least this often."""


def backoff(timeout: float | None, poll: float = 0.02, *, wake=None) -> Iterator[bool]:
    """The one poll loop of the control plane: yields ``expired`` (True once ``timeout``
    seconds have passed; never for ``None``), sleeping between iterations from 0.1 ms doubling
    up to ``poll`` seconds. With ``wake`` (a callable of seconds, e.g. :func:`watch` of the keys
    the caller waits for), each round blocks in ``wake(seconds)`` instead, for ``max(poll,
    WAKE_SLICE)`` or what is left of the timeout: the store wakes it when a key changes, so it
    reacts at once and asks once per round. Callers ``return`` or ``raise`` to leave it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    nap = 1e-4
    while True:
        now = time.monotonic()
        yield deadline is not None and now >= deadline
        if wake is None:
            time.sleep(nap)
            nap = min(nap * 2, poll)
            continue
        step = max(poll, WAKE_SLICE)
        wake(max(0.0, min(step, deadline - now)) if deadline is not None else step)


def watch(store, keys, seconds: float, seen=None) -> None:
    """Block up to ``seconds`` until one of ``keys`` holds something other than ``seen`` (a
    list: each key's value as last read, None for absent; default: all absent) -- at the store's
    server when it can (:meth:`weight_transfer.security.secure_store.SecureStore.watch`: no polling, woken
    by the change); another store: sleep ``min(seconds, 1 ms)`` and let the caller look again."""
    w = getattr(store, "watch", None)
    if w is None:
        time.sleep(min(seconds, 1e-3))
        return
    w(list(keys), seen, seconds)


def wait_all(store, keys, seconds: float) -> None:
    """Block up to ``seconds`` until every key of ``keys`` exists (at the server when it can,
    :func:`watch`'s fallback otherwise); the caller looks again."""
    w = getattr(store, "wait_all", None)
    if w is None:
        time.sleep(min(seconds, 1e-3))
        return
    w(list(keys), seconds)


def any_exists(store, keys) -> bool:
    """Whether one of ``keys`` exists: one request to a store that can :func:`watch`, one per key otherwise."""
    w = getattr(store, "watch", None)
    if w is not None:
        return bool(w(list(keys), None, 0.0))
    return any(store.check([k]) for k in keys)
