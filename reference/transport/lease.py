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
  sender holds a lease slot in the receiver's table: ``(pid, seq)`` words it writes through its
  own mapping of the table. Per batch it makes ``seq`` odd *before* reading the epochs and even
  again after its last byte was copied (for a back end whose copies complete after ``write``
  returned, CUDA IPC or NIXL, when its handle reports them complete). ``deregister`` (after
  writing 0 into the epoch slot) scans the lease slots in its own memory and waits until every
  sender whose ``seq`` was odd has moved on (any change of ``seq`` means that batch ended; a
  later batch reads the revoked epoch) or is dead (``kill(pid, 0)`` fails); only then is the
  memory released. A sender stuck past ``lease_timeout`` seconds makes ``deregister`` raise
  :class:`~.base.LeaseTimeoutError` naming its pid, and the region's tensor stays referenced
  by the transport (never freed under a possible writer).
- **The lease is part of the transport** (issue 27 item 5: "the safe path is the only path").
  The table lives in a sealed shared-memory segment (``memfd``) and every descriptor names it
  (``extra["lease"] = (fd, inode, device, size, table offset)``: its own lease channel). A
  sender's :meth:`~.base.Transport.connect` opens the receiver's segment through
  ``/proc/<pid>/fd/<fd>`` (same uid: what CMA's ptrace right and shm's mapping need anyway),
  maps it and claims a slot under ``flock`` on that file (the atomic step the data path cannot
  give: two senders claiming at once are serialized by the kernel; a slot is free when its pid
  word is 0 or names a dead process, so slots of exited senders are reused), once per
  receiving transport, with no control plane. :meth:`~.base.Transport.write` refuses a batch
  to a receiver where this sender holds no lease (:class:`~.base.LeaseRequiredError`, naming
  why: all :data:`LEASE_SLOTS` slots held by live senders, the segment could not be opened, a
  receiver on another host): one place, :mod:`.base`, for every back end whose revocation is
  checked in software (cma, shm, cuda_ipc, nixl). Verbs is the exception: deregistration closes
  the MRs and the NIC refuses the old rkey, so no window exists to close.

Why these choices
-----------------
The hot path needs no control-plane round trip: the lease and epoch words travel with the same
kernel copy as the data (two extra small syscalls per batch per receiver, a few microseconds).
Claiming a slot needs one atomic step, which neither ``process_vm_writev`` nor a plain store
gives; ``flock`` on the receiver's table segment does, on the same host, without a control
plane (an earlier version took slot numbers from ``TCPStore.add`` in :func:`attach`: a caller
who did not attach a store held no lease, and in 25 of 50 runs a batch landed after
``deregister`` returned). Reading the table through a store instead would cost a round trip
per batch and still leave the window.

Race window, precisely
----------------------
Sender: store ``seq`` odd (a store into its mapping of the receiver's table), a full fence,
then load the epochs (a kernel copy from the receiver for CMA, a load from the mapping for shm). Receiver: store 0 into the epoch slot, a full fence (a locked
read-modify-write), then load the lease words. Either the sender's epoch load sees 0 (the
batch is refused) or the receiver's load sees the odd ``seq`` (it waits for the batch). This
holds on x86-64 (TSO; every ``process_vm_*`` call takes the mm lock with a locked
instruction). On weaker memory models the fences of both sides are the kernel's and CPython's
lock operations, which order acquire/release only: there the window is not proven closed.
There is no write without a lease: a sender that cannot hold one at a receiver (the table's
256 slots all held by live senders, a receiver on another host over NIXL) has its batches to
that receiver refused before any byte moves. A sender that dies mid-batch leaves ``seq`` odd; its pid no longer exists,
so it is not waited for (a reused pid is waited for until ``lease_timeout``).
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable

import torch

from .segment import _F_GET_SEALS, _SEALS, _allocate, allocated_segment

__all__ = ["EpochTable", "HostLease", "LeasedHandle", "LeaseUnavailable", "attach", "claim_host_lease",
           "REGION_SLOTS", "LEASE_SLOTS"]

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
        n = 1 + REGION_SLOTS + 2 * LEASE_SLOTS
        try:  # a sealed memfd segment: senders map it to hold their leases (the module docstring)
            self.words = _allocate(8 * n).view(torch.int64)
            self.words.zero_()
        except OSError:  # no memfd on this system: no sender can hold a lease here
            self.words = torch.zeros(n, dtype=torch.int64)
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


def lease_channel(table: EpochTable) -> tuple | None:
    """What a descriptor carries so that a sender can take a lease at ``table``:
    ``(fd, inode, device, size, offset of the table in the segment)``, or None when the table
    is not in a shared segment (no ``memfd`` on this system)."""
    seg = allocated_segment(table.addr, table.words.nbytes)
    return None if seg is None else (seg.fd, seg.ino, seg.dev, seg.size, table.addr - seg.addr)


class LeaseUnavailable(Exception):
    """Why a sender holds no lease at a receiver: ``args[0]`` the reason, ``cls`` the name of
    the :mod:`.base` error a write there raises (default ``LeaseRequiredError``)."""

    def __init__(self, reason: str, cls: str | None = None):
        super().__init__(reason)
        self.cls = cls


class HostLease:
    """This sender's lease slot at one receiving transport of this host: its mapping of the
    receiver's table segment and the ``(pid, seq)`` words of its slot. ``enter`` / ``exit``
    bracket a batch (nested batches in flight keep ``seq`` odd until the last one ended)."""

    __slots__ = ("owner", "slot", "_mm", "_pid", "_seq", "depth", "__weakref__")

    def __init__(self, owner: int, slot: int, mm: mmap.mmap, off: int):
        self.owner, self.slot, self._mm, self.depth = owner, slot, mm, 0
        at = off + EpochTable.lease_offset(slot)
        self._pid = ctypes.c_int64.from_buffer(mm, at)
        self._seq = ctypes.c_int64.from_buffer(mm, at + 8)

    def enter(self) -> None:
        """Mark a batch in flight (``seq`` odd) before the epochs are read; the caller fences."""
        if self.depth == 0:
            self._seq.value += 1
        self.depth += 1

    def exit(self) -> None:
        """The batch's bytes were all copied: ``seq`` even again when no batch is in flight."""
        self.depth -= 1
        if self.depth == 0:
            self._seq.value += 1

    def release(self) -> None:
        """Give the slot back (``(0, 0)``) and unmap; idempotent."""
        if self._mm is None:
            return
        self._seq.value = 0
        self._pid.value = 0
        self._pid = self._seq = None
        mm, self._mm = self._mm, None
        try:
            mm.close()
        except BufferError:  # a ctypes view still exported (interpreter shutdown): let GC unmap it
            pass


def claim_host_lease(desc, me: int) -> HostLease:
    """Take a lease slot at the receiving transport that published ``desc`` (a descriptor with
    ``extra["lease"]``, its owner on this host): open the owner's table segment through
    ``/proc/<pid>/fd/<fd>``, check it is the file the descriptor names and sealed, map it, and
    under ``flock`` on it take the first slot whose pid word is 0 or names a dead process, then
    write ``(me, seq=0)`` there. Raises :class:`LeaseUnavailable` saying why not."""
    chan = None
    for k, v in desc.extra:
        if k == "lease":
            chan = v
    if not (isinstance(chan, tuple) and len(chan) == 5):
        raise LeaseUnavailable("its descriptor names no lease channel (extra['lease']): a descriptor from an "
                               "older build, or its owner's system has no memfd")
    fd, ino, dev, size, off = chan
    path = f"/proc/{desc.pid}/fd/{fd}"
    try:
        f = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise LeaseUnavailable(f"{path} does not exist: receiver pid {desc.pid} is gone or on another host "
                               "(a lease needs the receiver on this host)", "RemoteGoneError") from None
    except PermissionError as e:
        raise LeaseUnavailable(f"opening {path} refused ({e.strerror}): a lease needs the receiver's uid and a "
                               "dumpable receiver process", "PermissionDeniedError") from None
    try:
        st = os.fstat(f)
        if (st.st_ino, st.st_dev) != (ino, dev) or st.st_size < size:
            raise LeaseUnavailable(f"{path} is another file than the descriptor's lease segment (inode "
                                   f"{st.st_ino}, the descriptor names {ino}): the receiver is gone or on "
                                   "another host", "RemoteGoneError")
        if fcntl.fcntl(f, _F_GET_SEALS) & _SEALS != _SEALS:
            raise LeaseUnavailable(f"{path} is not sealed against shrinking: a receiver could truncate it under "
                                   "this sender's lease words")
        mm = mmap.mmap(f, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        fcntl.flock(f, fcntl.LOCK_EX)  # one claim at a time among this receiver's senders
        try:
            words = (ctypes.c_int64 * (2 * LEASE_SLOTS)).from_buffer(mm, off + EpochTable.lease_offset(0))
            try:
                for i in range(LEASE_SLOTS):
                    pid = words[2 * i]
                    if pid == 0 or not pid_alive(pid):
                        words[2 * i + 1] = 0  # seq first: a dead sender's odd seq is never read as ours
                        words[2 * i] = me
                        break
                else:
                    held = sorted({words[2 * j] for j in range(LEASE_SLOTS)})
                    raise LeaseUnavailable(
                        f"all {LEASE_SLOTS} lease slots of its table are held by live senders (pids "
                        f"{held[:8]}{'...' if len(held) > 8 else ''}); close a sender's transport to free one")
            finally:
                del words
        except BaseException:
            mm.close()
            raise
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
    finally:
        os.close(f)
    return HostLease(desc.pid, i, mm, off)


def take(transport, d) -> None:
    """``transport`` (a sender) holds a lease at the transport that published ``d`` (once
    per receiving transport); on failure it remembers why (a write there is refused with it)."""
    ident = table_ident(d)
    if ident is None or ident in transport._leases:
        return
    if d.host != transport.host:
        transport._leases[ident] = LeaseUnavailable(
            f"the receiver is on host {d.host!r}, this is {transport.host!r}: a lease is taken through the "
            "receiver's shared table segment, on one host only")
        return
    try:
        transport._leases[ident] = claim_host_lease(d, transport.pid)
    except LeaseUnavailable as e:
        transport._leases[ident] = e


def enter(held: list) -> list:
    """Mark a batch in flight at every lease of ``held``, then a full fence (the lease stores
    before the epoch loads: the race window above); returns ``held``."""
    for x in held:
        x.enter()
    fence()
    return held


def leave(held: list) -> None:
    """The batch's bytes were all copied (or it failed): leave every lease of ``held``."""
    for x in held:
        x.exit()


def release_all(transport) -> None:
    """Give back every lease ``transport`` holds."""
    leases, transport._leases = transport._leases, {}
    for x in leases.values():
        if not isinstance(x, Exception):
            x.release()


def table_ident(d) -> str | None:
    """The id of the epoch table (receiving transport) that published ``d``, or None."""
    if isinstance(d.extra, tuple):
        for kv in d.extra:
            if isinstance(kv, tuple) and len(kv) == 2 and kv[0] == "epochs" and isinstance(kv[1], tuple):
                return kv[1][2] if len(kv[1]) == 3 else None
    return None


class LeasedHandle:
    """The handle of a batch still in flight when ``write`` returned (CUDA IPC, NIXL): leaves
    the batch's leases once it reports completion (or failure), so a receiver's
    ``deregister`` waits for the copies, not only for their posting. A
    :class:`~.base.WriteHandle` (registered there; this module imports nothing of base)."""

    __slots__ = ("_h", "_held", "nbytes")

    def __init__(self, h, held: list):
        self._h, self._held, self.nbytes = h, held, h.nbytes

    def _leave(self) -> None:
        held, self._held = self._held, None
        if held:
            leave(held)

    def done(self) -> bool:
        try:
            d = self._h.done()
        except BaseException:
            self._leave()
            raise
        if d:
            self._leave()
        return d

    def wait(self, timeout: float | None = None) -> int:
        try:
            n = self._h.wait(timeout)
        except TimeoutError:
            raise  # still in flight: the lease stays held
        except BaseException:
            self._leave()
            raise
        self._leave()
        return n


def attach(transport, store=None, lease_timeout: float | None = None) -> None:
    """Set ``transport.lease_timeout`` (seconds a receiver's ``deregister`` waits for a sender
    inside a batch; default 30). A sender needs nothing else: it takes its lease at every
    receiver it connects through the descriptor's own lease channel (the module docstring).
    ``store`` is accepted for callers of the earlier API, which took lease slots from a
    TCPStore, and not used."""
    del store
    if lease_timeout is not None:
        if lease_timeout <= 0:
            raise ValueError(f"lease_timeout {lease_timeout} must be > 0 seconds")
        transport.lease_timeout = float(lease_timeout)
