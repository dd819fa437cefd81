"""Inference engines that come and go between updates (case C24): the control-plane keys and
checks of an elastic inference fleet.

One-sided writes into registered memory have no communicator to rebuild: when the set of
receivers changes, the coordinator recomputes the static schedule for the new membership, the
senders reconnect to the new set of regions, and the trainers keep training. Keys::

    infer/joins            counter of join announcements (TCPStore ``add``)
    infer/join/{n}         the inference rank of the n-th announcement (ASCII): a receiver that
                           (re)published ``meta/infer/{rank}``, a newcomer or a restarted engine
                           with fresh memory
    infer/leave/{rank}     a receiver that closed (its region is being released)
    infer/member/{rank}    the first version this rank holds completely (ASCII): set by the
                           coordinator before the "go" of the update that includes it; absent
                           while the rank is not in the plan (a newcomer reads no version
                           before it: :meth:`weight_transfer.api.receiver.Receiver.state`)
    plan/epoch             the plan's epoch (ASCII int, absent: epoch 0, the first plan)
    plan/e{k}/{r}          training rank r's part of the plan of epoch k (k >= 1)

A rank is *gone* when it announced leaving, when a launcher's liveness callback or the
heartbeat monitor names it, or when its region's process no longer exists on this host
(:func:`process_gone`: the descriptor's pid, a zombie counts as gone).
"""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from . import protocol as control

__all__ = ["announce_join", "announce_leave", "new_joins", "left", "process_gone", "member_since", "set_member",
           "drop_member", "plan_key", "EPOCH_KEY", "Change", "change_members"]

EPOCH_KEY = "plan/epoch"


def plan_key(epoch: int, rank: int) -> str:
    """Store key of training rank ``rank``'s plan part in epoch ``epoch`` (``plan/{r}`` for 0)."""
    return f"plan/{rank}" if epoch == 0 else f"plan/e{epoch}/{rank}"


def announce_join(store: dist.Store, rank: int) -> None:
    """Say that inference rank ``rank`` (re)published its region and metadata."""
    n = store.add("infer/joins", 1) - 1
    store.set(f"infer/join/{n}", str(rank).encode())
    if store.check([f"infer/leave/{rank}"]):
        store.delete_key(f"infer/leave/{rank}")


def announce_leave(store: dist.Store, rank: int) -> None:
    """Say that inference rank ``rank`` is releasing its region (a receiver's close)."""
    store.set(f"infer/leave/{rank}", b"1")


def new_joins(store: dist.Store, seen: int) -> tuple[list[int], int]:
    """(ranks announced after the first ``seen`` announcements, in order; the new count)."""
    n = int(store.add("infer/joins", 0))
    ranks = [control.get_int(store, f"infer/join/{i}") for i in range(seen, n)
             if store.check([f"infer/join/{i}"])]
    return ranks, n


def left(store: dist.Store, ranks) -> set[int]:
    """The ranks among ``ranks`` that announced leaving."""
    return {r for r in ranks if store.check([f"infer/leave/{r}"])}


def process_gone(descriptor) -> bool:
    """True when ``descriptor``'s process is on this host and no longer runs (no such pid, or a
    zombie); False when it runs or lives on another host (the heartbeat or a launcher says)."""
    host, pid = getattr(descriptor, "host", None), getattr(descriptor, "pid", 0)
    if not pid or host not in (socket.gethostname(), "localhost", "127.0.0.1"):
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("State:"):
                    return "Z" in line.split()[1]
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def member_since(store: dist.Store, rank: int) -> int | None:
    """The first version inference rank ``rank`` holds completely, None while it is not in the plan."""
    k = f"infer/member/{rank}"
    return control.get_int(store, k) if store.check([k]) else None


def set_member(store: dist.Store, rank: int, since: int) -> None:
    store.set(f"infer/member/{rank}", str(since).encode())


def drop_member(store: dist.Store, rank: int) -> None:
    if store.check([f"infer/member/{rank}"]):
        store.delete_key(f"infer/member/{rank}")


@dataclass(frozen=True)
class Change:
    """A membership change :func:`change_members` applied: the new ``members`` (inference
    ranks), their ``payloads`` (``{rank: (descriptor, metas)}``), the ``schedule`` and ``extra``
    the planning step returned for them, the new plan ``epoch``, the ranks ``dropped`` (gone and
    not re-added) and ``seconds`` (wall-clock time of the planning step alone)."""

    members: set[int]
    payloads: dict
    schedule: Any
    extra: Any
    epoch: int
    dropped: set[int]
    seconds: float


def change_members(store: dist.Store, ctl, *, members: set[int], payloads: dict, gone: set[int], added: dict,
                   plan: Callable[[dict, int], tuple[Any, Any]], epoch: int, version: int, where: str) -> Change:
    """Apply a membership change before the "go" of ``version``: the new members are
    ``(members - gone) | added``; ``plan(new_payloads, epoch + 1)`` recomputes the schedule for
    them (e.g. :func:`weight_transfer.api.plan_against`, which publishes each training rank's
    part under :func:`plan_key`); then each rank gone and not re-added stops being a member
    (:func:`drop_member`), each added rank is a member from ``version`` on (:func:`set_member`),
    :data:`EPOCH_KEY` says the new epoch and ``ctl.n_infer`` grows to cover the highest member.

    ``members``/``payloads``: the current members and their ``{rank: (descriptor, metas)}``;
    ``gone``: ranks to drop; ``added``: ``{rank: payload}`` of ranks to take (a re-registered
    member's fresh payload replaces its old one); ``epoch``: the current plan epoch; ``where``:
    the caller's name for the update in the error (``"version 3"``). Returns the
    :class:`Change`. Raises ControlError ``"{where}: no inference rank left (gone: [...])"``
    when no member would be left, before anything is planned or written; whatever ``plan``
    raises, before any key changes."""
    new = (members - gone) | set(added)
    if not new:
        raise control.ControlError(f"{where}: no inference rank left (gone: {sorted(gone)})")
    new_payloads = {r: added.get(r) or payloads[r] for r in new}
    t0 = time.perf_counter()
    schedule, extra = plan(new_payloads, epoch + 1)
    seconds = time.perf_counter() - t0
    dropped = gone - set(added)
    for r in dropped:
        drop_member(store, r)
    for r in added:
        set_member(store, r, version)
    store.set(EPOCH_KEY, str(epoch + 1).encode())
    ctl.n_infer = max(ctl.n_infer, max(new) + 1)
    return Change(members=new, payloads=new_payloads, schedule=schedule, extra=extra, epoch=epoch + 1,
                  dropped=dropped, seconds=seconds)
