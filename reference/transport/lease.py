"""Regions with a lifetime: epochs, revocation and leases (field case C17).

The problem
-----------
A one-sided write needs no code on the receiver, so nothing on the receiver stops a sender
that still holds a descriptor of memory the receiver has since deregistered, freed, or reused
for another tensor (C17: CMA wrote 10 bytes after deregistration and 64 KiB into an unrelated
buffer at a reused address). The key was checked only against what the *sender* had connected.

The protocol
------------
- **Epoch table.** Every transport that publishes descriptors owns an :class:`EpochTable`: a
  small int64 array in its own CPU memory (12 KiB: 1,537 int64 words). Publishing a region (its first
  ``descriptor()``) takes a slot and writes a fresh epoch there (a random 62-bit base + a
  counter: unique across runs, increasing within one); the descriptor carries the epoch
  (``RegionDescriptor.epoch``) and ``extra["epochs"] = (table address, slot, table id)``.
- **Revocation.** ``deregister`` writes 0 into the slot *before* anything is released.
- **The check, before each batch, in one place** (:meth:`.base.Transport.write`): the sender
  reads the receiver's published epoch of every remote region of the batch (the back end's
  ``_published_epochs``: CMA and CUDA IPC read the receiver's table with ``process_vm_readv``,
  one syscall per receiving process) and refuses the batch, naming the region, when one differs
  from its descriptor's (:class:`~.base.StaleRegionError`): deregistered (0), or re-registered
  (another epoch; the slot may have been reused). So the epoch is checked against the
  *receiver's* state, not against the sender's own bookkeeping, and a freshly connected sender
  with an old descriptor is refused too. Verbs does not read the table: deregistration closes
  the MRs, so the NIC refuses the old rkey (``IBV_WC_REM_ACCESS_ERR``) before a byte lands.
- **The lease.** The check alone leaves a window: a batch whose check passed just before the
  revocation may still be copying when the receiver frees the memory. To close it, every
  sender holds a lease slot in the receiver's table: ``(pid, seq)`` words it writes with the
  data path (CMA: ``process_vm_writev``). Per batch it makes ``seq`` odd *before* reading the
  epochs and even again after its last byte was copied. ``deregister`` (after writing 0 into
  the epoch slot) scans the lease slots in its own memory and waits until every sender whose
  ``seq`` was odd has moved on (any change of ``seq`` means that batch ended; a later batch
  reads the revoked epoch) or is dead (``kill(pid, 0)`` fails); only then is the memory
  released. A sender stuck past ``lease_timeout`` seconds makes ``deregister`` raise
  :class:`~.base.LeaseTimeoutError` naming its pid, and the region's tensor stays referenced
  by the transport (never freed under a possible writer).

Why these choices
-----------------
The hot path needs no control-plane round trip: the lease and epoch words travel with the same
kernel copy as the data (two extra small syscalls per batch per receiver, a few microseconds).
The control plane is used once per (sender, receiver) pair, to hand out lease slots: unique
slot numbers need an atomic counter, which ``process_vm_writev`` cannot provide and torch's
``TCPStore.add`` can (:func:`attach`). Reading the table through the store instead would cost a
round trip per batch and still leave the window.

Race window, precisely
----------------------
Sender: store ``seq`` odd (a kernel copy into the receiver), then load the epochs (a kernel
copy from the receiver). Receiver: store 0 into the epoch slot, a full fence (a locked
read-modify-write), then load the lease words. Either the sender's epoch load sees 0 (the
batch is refused) or the receiver's load sees the odd ``seq`` (it waits for the batch). This
holds on x86-64 (TSO; every ``process_vm_*`` call takes the mm lock with a locked
instruction). On weaker memory models the fences of both sides are the kernel's and CPython's
lock operations, which order acquire/release only: there the window is not proven closed.
Without a lease (no store attached to the sender, or the table's 256 lease slots taken) the
window is one batch: one already checked when the revocation happened may complete into
released memory. A sender that dies mid-batch leaves ``seq`` odd; its pid no longer exists,
so it is not waited for (a reused pid is waited for until ``lease_timeout``).
"""
from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable

import torch

__all__ = ["EpochTable", "attach", "take_lease_slot", "REGION_SLOTS", "LEASE_SLOTS"]

REGION_SLOTS = 1024
"""Regions one transport can publish at once (slots are reused after deregistration)."""
LEASE_SLOTS = 256
"""Senders that can hold a lease at one receiving transport."""
_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier on x86-64 (the lock's atomic read-modify-write)."""
    with _FENCE:
        pass


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)``; another uid's process counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EpochTable:
    """The epoch and lease words of one transport, in its own CPU memory (int64):
    word 0 unused, words ``1 .. REGION_SLOTS`` the region epochs (0 = free or revoked), then
    ``LEASE_SLOTS`` pairs ``(pid, seq)``. ``addr`` is the table's address, ``ident`` a random
    token naming it in the control plane."""

    def __init__(self):
        self.words = torch.zeros(1 + REGION_SLOTS + 2 * LEASE_SLOTS, dtype=torch.int64)
        self.addr = self.words.data_ptr()
        self.ident = secrets.token_hex(8)
        self._free = list(range(REGION_SLOTS - 1, -1, -1))
        self._next = (secrets.randbits(61) | 1) + (1 << 61)

    @staticmethod
    def epoch_offset(slot: int) -> int:
        """Byte offset of region ``slot``'s epoch word in the table."""
        return 8 * (1 + slot)

    @staticmethod
    def lease_offset(i: int) -> int:
        """Byte offset of lease slot ``i``'s ``pid`` word (``seq`` follows)."""
        return 8 * (1 + REGION_SLOTS + 2 * i)

    def publish(self) -> tuple[int, int]:
        """Take a slot and publish a fresh epoch in it; returns ``(slot, epoch)``. RuntimeError
        when all :data:`REGION_SLOTS` are published."""
        if not self._free:
            raise RuntimeError(f"more than {REGION_SLOTS} regions published by one transport; deregister some")
        slot = self._free.pop()
        epoch = self._next
        self._next += 1
        self.words[1 + slot] = epoch
        return slot, epoch

    def revoke(self, slot: int) -> None:
        """Write 0 into ``slot``'s epoch (every later check refuses its descriptors) and fence.
        The slot is reused only after :meth:`release`."""
        self.words[1 + slot] = 0
        fence()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def busy_senders(self) -> list[tuple[int, int, int]]:
        """``(lease slot, pid, seq)`` of every sender inside a batch (odd ``seq``) now."""
        lw = self.words[1 + REGION_SLOTS:].view(LEASE_SLOTS, 2).tolist()
        return [(i, pid, seq) for i, (pid, seq) in enumerate(lw) if pid and seq & 1]

    def await_senders(self, timeout: float, alive: Callable[[int], bool] = pid_alive) -> list[tuple[int, int]]:
        """Wait until every sender that is inside a batch now has left it (its ``seq``
        changed) or is dead. Returns ``[(pid, seq)]`` of those still inside after ``timeout``
        seconds (empty: every lease acknowledged). Polls every 50 us, then every 1 ms."""
        waiting = {i: (pid, seq) for i, pid, seq in self.busy_senders()}
        t0 = time.monotonic()
        while waiting:
            lw = self.words[1 + REGION_SLOTS:].view(LEASE_SLOTS, 2)
            for i, (pid, seq) in list(waiting.items()):
                p, s = lw[i].tolist()
                if p != pid or s != seq or not alive(pid):
                    del waiting[i]
            if not waiting:
                break
            dt = time.monotonic() - t0
            if dt > timeout:
                return list(waiting.values())
            time.sleep(5e-5 if dt < 0.01 else 1e-3)
        return []


def take_lease_slot(store, ident: str) -> int:
    """A lease slot number at the receiving transport whose table is ``ident``, unique among
    its senders (``TCPStore.add`` on ``wt/transport/lease/<ident>``); may exceed
    :data:`LEASE_SLOTS` (then the sender holds no lease there)."""
    return int(store.add(f"wt/transport/lease/{ident}", 1)) - 1


def attach(transport, store, lease_timeout: float | None = None) -> None:
    """Give ``transport`` the control plane (a ``torch.distributed.TCPStore`` or any store with
    ``add``): as a sender it takes a lease slot at every receiver it connects afterwards, so a
    receiver's ``deregister`` waits for its batch in flight (see the module docstring). Call it
    before ``connect``. ``lease_timeout`` (seconds) bounds a receiver's wait in ``deregister``
    (default 30)."""
    transport._lease_store = store
    if lease_timeout is not None:
        if lease_timeout <= 0:
            raise ValueError(f"lease_timeout {lease_timeout} must be > 0 seconds")
        transport.lease_timeout = float(lease_timeout)
