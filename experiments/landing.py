"""Packed delta updates into the harness's stand-in engine (:class:`weight_transfer.engines.Engine`):
the landing region each inference rank registers once, and the commit that scatters the
packed records before the version is published complete (docs/DELTA.md, "Packed delta and
the fused compare"; :mod:`weight_transfer.delta.packed` has the format and the checks).

- :func:`attach` (the inference rank's setup, after its receiver registered the arena and
  before its metadata is published, so every sender finds it when it builds its executor):
  with delta updates that may pack (``--delta``, ``--delta-mode auto|packed``,
  ``--delta-landing F > 0``), allocate ``F x`` the arena's bytes (at least
  :data:`~weight_transfer.delta.packed.MIN_LANDING`), register it with the receiver's own
  transport object (cma, shm, nixl: whatever the trial uses) and publish its descriptor at
  :data:`~weight_transfer.delta.packed.LANDING_KEY`, as the vLLM worker does
  (engines/vllm/worker/delta_apply.py). No landing region where the stand-in cannot scatter (an arena
  on a GPU: the scatter is a host ``memcpy`` loop; shadow targets: the commit is the go-live);
  with ``--delta-mode packed`` that is a ValueError naming why (never a silent fallback),
  with ``auto`` a log line.
- :class:`CommitServer` (a thread of the inference rank): for each version the controller
  asks to commit (``step/{v}/commit``, after every write of ``v`` completed), run
  :meth:`Engine.commit_delta` -- every record checked, then scattered into the arena -- and
  report ``step/{v}/committed/{rank}`` (``ok`` with the apply's stats, or ``ok: False`` with
  the error: the version is then published ``incomplete`` and every sender's next update is
  full, C26). The harness verifies the arena only after ``complete v``, so after the scatter.
- :func:`landing_ranks` (the controller): the inference ranks that published a landing region
  (each is then a commit rank of every update).

Units: bytes, seconds.
"""
from __future__ import annotations

import threading
import time

__all__ = ["attach", "landing_ranks", "CommitServer"]


def wants_landing(transfer) -> bool:
    """Whether ``transfer`` (resolved :class:`weight_transfer.options.TransferOptions`) runs
    delta updates that may pack."""
    ex = transfer.executor
    return bool(ex.delta) and ex.delta_mode != "scattered" and float(ex.delta_landing or 0) > 0


def attach(transfer, engine, receiver, store, rank: int, *, shadow: bool = False, log=print):
    """Register and publish the stand-in inference rank ``rank``'s landing region (see the
    module docstring). ``receiver``: the rank's :class:`weight_transfer.api.Receiver` over
    ``engine.arena``. Returns the :class:`~weight_transfer.delta.packed.Landing` or None;
    ValueError when ``--delta-mode packed`` was asked and this rank cannot take packed records."""
    from weight_transfer.control.wire import put
    from weight_transfer.delta.packed import LANDING_KEY, Landing

    try:
        store.delete_key(LANDING_KEY.format(rank=rank))  # a predecessor's, if any
    except Exception:
        pass
    if not wants_landing(transfer):
        return None
    ex = transfer.executor
    why = None
    if engine.arena.device.type != "cpu":
        why = f"the arena is on {engine.arena.device} (the stand-in scatters with host memcpy)"
    elif shadow:
        why = "shadow targets (the stand-in's commit is the go-live; packed into a shadow is not built)"
    elif getattr(receiver, "transport", None) is None:
        why = "its receiver has no transport object"
    if why is not None:
        msg = f"inference rank {rank}: no landing region for packed deltas: {why}"
        if ex.delta_mode == "packed":
            raise ValueError(f"--delta-mode packed: {msg}")
        log(f"delta: {msg}; outputs go scattered or whole")
        return None
    nbytes = Landing.size_for(engine.arena.numel() * engine.arena.element_size(), float(ex.delta_landing))
    landing = Landing(nbytes, receiver.transport)
    put(store, LANDING_KEY.format(rank=rank), landing.descriptor)  # the senders read it at their executor's build
    landing.rank = rank
    log(f"delta: landing region of {nbytes / 1e6:.1f} MB registered ({receiver.transport.name}, "
        f"{ex.delta_landing} x the arena) for packed records")
    return landing


def landing_ranks(store, n_infer: int) -> tuple[int, ...]:
    """Inference ranks whose landing region is published (read after they published their metadata)."""
    from weight_transfer.delta.packed import LANDING_KEY

    return tuple(i for i in range(n_infer) if store.check([LANDING_KEY.format(rank=i)]))


class CommitServer:
    """A thread that commits every update of the stand-in rank ``rank`` that has a landing
    region: waits for ``step/{v}/commit`` of the version being written, scatters
    (:meth:`weight_transfer.engines.Engine.commit_delta`) and reports the commit. ``store``: a
    store connection of its own (the thread polls it every ``poll`` seconds)."""

    def __init__(self, engine, landing, store, rank: int, *, poll: float = 0.001, log=print):
        self.engine, self.landing, self.store, self.rank, self.poll, self.log = engine, landing, store, rank, poll, log
        self.last = 0
        self.commits = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"wt-commit-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from weight_transfer.control import protocol as control

        while not self._stop.is_set():
            try:
                s = control.read_state(self.store)
                v = s.version
                if s.state == "writing" and v > self.last and self.store.check([f"step/{v}/commit"]):
                    self.commit(v)
            except Exception as e:  # the store went away (shutdown): stop quietly
                if not self._stop.is_set():
                    self.log(f"commit server stopped: {type(e).__name__}: {e}")
                return
            self._stop.wait(self.poll)

    def commit(self, version: int) -> dict | None:
        """Scatter ``version``'s packed records and report this rank's commit; returns the
        stats (``seconds``, ``delta_apply_s``, ``delta_records``, ``delta_runs``,
        ``delta_bytes``) or None when it failed (reported ``ok: False``)."""
        from weight_transfer.control import protocol as control

        self.last = version
        key = f"step/{version}/committed/{self.rank}"
        t0 = time.perf_counter()
        try:
            st = dict(self.engine.commit_delta(self.landing, version))
        except Exception as e:
            why = (f"packed delta of version {version} not applied: {type(e).__name__}: "
                   f"{str(e).splitlines()[0] if str(e) else ''}")
            self.log(why)
            control.put(self.store, key, {"ok": False, "error": why, "stats": None})
            return None
        st["seconds"] = time.perf_counter() - t0
        self.commits += 1
        control.put(self.store, key, {"ok": True, "error": "", "stats": st})
        return st

    def stop(self) -> None:
        """Stop the thread (idempotent)."""
        self._stop.set()
        self._thread.join(timeout=5)
