"""Heartbeats of the control plane (:mod:`weight_transfer.control.protocol`): each process shows it is making
progress, the controller names one that stopped (SIGSTOP, a hung interpreter), and ranks leave
on their own when the controller stops answering. A store call to a stopped server blocks up to
the store's timeout, so the watchdog checks in a thread that does no I/O."""
from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["Heartbeat", "HeartbeatMonitor"]




class Heartbeat:
    """A daemon thread that shows this process is making progress and watches a peer.

    Every ``period`` seconds it increments ``hb/{name}`` over its own store connection
    (:func:`weight_transfer.connect_store` of ``addr``, a ``(host, port)``, with this process's
    job secret; or ``addr.clone()`` of a store handle). If
    ``watch`` names a peer (a rank watches ``"controller"``), and that peer's counter has not
    moved, or the store did not answer, for ``stall`` seconds, ``on_stall(message)`` runs (the
    default prints ``[name] ...`` to stderr and ends this process with ``os._exit(3)``: a rank
    whose controller stopped or vanished must not linger). A store call to a stopped server
    blocks, so the check runs in a second thread that does no I/O."""

    def __init__(self, addr: tuple[str, int], name: str, *, period: float = 0.5, watch: str | None = None,
                 stall: float = 60.0, on_stall: Callable[[str], None] | None = None):
        self.addr, self.name, self.period, self.watch, self.stall = addr, name, period, watch, stall
        self.on_stall = on_stall or self._exit
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._peer = (None, time.monotonic())
        self._threads = [threading.Thread(target=self._beat, name=f"hb-{name}", daemon=True)]
        if watch is not None:
            self._threads.append(threading.Thread(target=self._guard, name=f"hb-guard-{name}", daemon=True))
        for t in self._threads:
            t.start()

    def _exit(self, msg: str) -> None:
        print(f"[{self.name}] {msg}; exiting", file=sys.stderr, flush=True)
        os._exit(3)

    def _beat(self) -> None:
        try:
            if isinstance(self.addr, dist.Store):
                store = self.addr.clone()
            else:
                from .store import connect_store

                store = connect_store(tuple(self.addr), timeout=max(self.stall, 5.0))
        except Exception:
            return
        while not self._stop.is_set():
            try:
                store.add(f"hb/{self.name}", 1)
                if self.watch is not None:
                    key = f"hb/{self.watch}"
                    v = store.get(key) if store.check([key]) else None
                    if v != self._peer[0]:
                        self._peer = (v, time.monotonic())
                self._last_ok = time.monotonic()
            except Exception:
                if self._stop.is_set():
                    return
            self._stop.wait(self.period)

    def _guard(self) -> None:
        while not self._stop.wait(min(self.period, 1.0)):
            now = time.monotonic()
            silent = now - self._last_ok
            still = now - self._peer[1]
            if silent > self.stall:
                return self.on_stall(f"the control plane did not answer for {silent:.1f} s "
                                     f"({self.watch} stopped or gone)")
            if still > self.stall:
                return self.on_stall(f"{self.watch}: no heartbeat for {still:.1f} s (stopped or hung)")

    def stop(self) -> None:
        self._stop.set()


class HeartbeatMonitor:
    """The controller's view of the ranks' heartbeats: :meth:`stalled` names every process
    whose ``hb/{name}`` counter has not moved for ``stall`` seconds (checked at most every
    ``every`` seconds; a process that never beat counts from the monitor's start or the last
    :meth:`reset`)."""

    def __init__(self, store: dist.Store, names: dict, *, stall: float, every: float = 0.2):
        self.store, self.names, self.stall, self.every = store, dict(names), stall, every
        self._seen: dict = {}
        self._checked = 0.0
        self._cached: dict = {}
        self.reset()

    def reset(self, keys=None) -> None:
        """Forget what was seen of ``keys`` (default: all), e.g. for a restarted rank."""
        now = time.monotonic()
        for k in (self.names if keys is None else keys):
            self._seen[k] = (self._value(self.names[k]), now, False)

    def _value(self, name: str):
        key = f"hb/{name}"
        return self.store.get(key) if self.store.check([key]) else None

    def stalled(self) -> dict:
        """``{key: "no heartbeat for X s (stopped or hung)"}``. A process is watched from its
        first beat after the start or :meth:`reset` (one that never started is the business of
        the wait's timeout)."""
        now = time.monotonic()
        if now - self._checked < self.every:
            return self._cached
        self._checked = now
        out = {}
        for k, name in self.names.items():
            v = self._value(name)
            last, t, armed = self._seen[k]
            if v != last:
                self._seen[k] = (v, now, True)
            elif armed and now - t > self.stall:
                out[k] = f"no heartbeat for {now - t:.1f} s (stopped or hung)"
        self._cached = out
        return out
