"""The errors the control plane hands between ranks, and its one bounded poll loop.

The bottom of the control plane's modules (:mod:`weight_transfer.control` re-exports all of it):
:mod:`weight_transfer.security`, :mod:`weight_transfer.wire` and :mod:`weight_transfer.store`
import it, and it imports none of them."""
from __future__ import annotations

import time
from collections.abc import Iterator

__all__ = ["ControlError", "GoLiveNotStarted", "VersionError", "encode_error", "decode_error", "backoff"]


class ControlError(RuntimeError):
    """A rank failed, died or did not answer in time; the message names role, rank and cause.
    ``culprit``: the "role rank: cause" line :func:`wait_keys` found, without its prefix, or None."""

    culprit: str | None = None


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


def backoff(timeout: float | None, poll: float = 0.02) -> Iterator[bool]:
    """The one poll loop of the control plane: yields ``expired`` (True once ``timeout``
    seconds have passed; never for ``None``), sleeping between iterations from 0.1 ms doubling
    up to ``poll`` seconds. Callers ``return`` or ``raise`` to leave it."""
    deadline = None if timeout is None else time.monotonic() + timeout
    nap = 1e-4
    while True:
        yield deadline is not None and time.monotonic() >= deadline
        time.sleep(nap)
        nap = min(nap * 2, poll)
