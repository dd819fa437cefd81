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
                           before it: :meth:`weight_transfer.receiver.Receiver.state`)
    plan/epoch             the plan's epoch (ASCII int, absent: epoch 0, the first plan)
    plan/e{k}/{r}          training rank r's part of the plan of epoch k (k >= 1)

A rank is *gone* when it announced leaving, when a launcher's liveness callback or the
heartbeat monitor names it, or when its region's process no longer exists on this host
(:func:`process_gone`: the descriptor's pid, a zombie counts as gone).
"""
from __future__ import annotations

import os
import socket

import torch.distributed as dist

__all__ = ["announce_join", "announce_leave", "new_joins", "left", "process_gone", "member_since", "set_member",
           "drop_member", "plan_key", "EPOCH_KEY"]

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
    ranks = [int(store.get(f"infer/join/{i}").decode()) for i in range(seen, n)
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
    return int(store.get(k).decode()) if store.check([k]) else None


def set_member(store: dist.Store, rank: int, since: int) -> None:
    store.set(f"infer/member/{rank}", str(since).encode())


def drop_member(store: dist.Store, rank: int) -> None:
    if store.check([f"infer/member/{rank}"]):
        store.delete_key(f"infer/member/{rank}")
