"""Shared-memory back end: a one-sided write is a ``memcpy`` into the receiver's memory, which
each sender mapped once (the CPU analogue of CUDA IPC).

What it is
----------
A receiver whose memory we allocate (the stand-in engine's arena, a staging buffer) allocates it
through :meth:`ShmTransport.allocate`: an anonymous shared-memory file (``memfd_create``),
mapped into the receiver, returned as a flat ``uint8`` tensor. It registers (a view of) that
tensor and publishes the descriptor as with any transport: besides the address and length it
names the segment (``extra["seg"]``: the receiver's file descriptor number, the file's inode and
device, its size; ``extra["offset"]``: the region's offset in it) and the segment holding the
receiver's epoch table (``extra["epoch_seg"]``). Each sender, once, in :meth:`connect`, opens
the receiver's file through ``/proc/<pid>/fd/<fd>`` (checking inode, device, size and seals) and
maps it (``MAP_SHARED | MAP_POPULATE``: the page tables are filled at connect, not in the first
update). A write is then a ``memcpy`` (``ctypes.memmove``, which releases the GIL) from the
sender's local region into its mapping of the receiver's region. The receiver runs no code per
update, not even a syscall: the kernel is not involved in the copy at all.

Why ``memfd_create`` (and not ``multiprocessing.shared_memory`` or torch's shared tensors)
-----------------------------------------------------------------------------------------
- *Nothing leaks.* A memfd has no name: its memory is freed when the last descriptor and the
  last mapping are gone, so a receiver killed with SIGKILL leaves nothing behind. A named segment
  in ``/dev/shm`` (``multiprocessing.shared_memory``, torch's ``file_system`` strategy) stays
  until someone unlinks it, holding its memory; ``multiprocessing``'s resource tracker adds a
  process of its own and unlinks (or warns) at exit.
- *No size cap of its own.* ``/dev/shm`` is a tmpfs mount with its own size limit (Docker's
  default is 64 MiB, too small for one arena); memfds are accounted like anonymous memory.
- *No socket, no receiver code.* A sender opens the receiver's descriptor by path
  (``/proc/<pid>/fd/<n>``, which needs the same access as reading the receiver's
  ``/proc/<pid>/mem``: same uid, the receiver dumpable; Yama's ``ptrace_scope`` does not
  restrict it). Passing the descriptor with ``SCM_RIGHTS`` or ``pidfd_getfd`` would need a
  listening receiver or ptrace-attach rights (what CMA needs).
- *A sender cannot be crashed by the receiver.* The segment is sealed against shrinking
  (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``): a receiver cannot truncate it under a
  sender's mapping (which would turn the sender's ``memcpy`` into a SIGBUS); connect refuses a
  segment without those seals.
- torch's ``share_memory_()`` (``file_descriptor`` strategy) also creates its file in
  ``/dev/shm`` (unlinked at once, but under that mount's cap) and moves a tensor's storage to a
  new address, which an engine's own tensors cannot tolerate.

Semantics
---------
- The contract of :mod:`.base`: every op checked before any byte moves (local region registered,
  descriptor connected with the same key, bounds), zero-length ops skipped, one bad op refuses the
  batch. :meth:`ShmTransport.write` is synchronous (the handle is complete when it returns).
  Units are bytes.
- **Only memory from** :meth:`ShmTransport.allocate` **can be published**
  (``publishes_allocated_only``): ``descriptor()`` of a region outside every segment this
  process allocated raises ValueError saying to allocate through the transport. Any CPU tensor
  can be registered as a *local* (source) region: senders only read it.
- Epochs and leases (C17, :mod:`.lease`): the receiver's epoch table lives in a shared segment
  too, which senders map at connect; the epoch check before each batch is a load from it (no
  syscall), the lease words are stores into it, ordered by a full fence (:func:`.lease.fence`)
  between the lease store and the epoch loads (x86-64; the same argument as CMA's, with plain
  stores and loads in place of kernel copies; the lease is :mod:`.base`'s, taken in ``connect``
  for every back end). So a receiver's ``deregister`` revokes the epoch and waits for a sender
  inside a batch, and a stale or revoked descriptor is refused before any byte moves.
- A receiver that exited is detected before each batch (a ``pidfd`` per receiving process,
  polled once: no pid reuse) and raises :class:`RemoteGoneError`; nothing is copied. A batch
  that was copying when the receiver died completes into memory no process reads any more (the
  sender's mapping keeps the pages until it disconnects): never into another process's memory.
  Unlike CMA, a write can never land in memory the receiver freed and reused for something else
  outside a segment: the sender maps the segment, not an address range.
- Not thread-safe: one writer thread per transport. CPU memory only, one host (descriptors of
  another host are refused at connect).

Requirements: Linux >= 5.3 (``memfd_create``, seals, ``pidfd_open``; without ``pidfd_open`` the
receiver's liveness is checked with ``kill(pid, 0)``), ``/proc`` of the receiver visible to the
sender (same pid namespace), same uid.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import secrets
import select
from collections.abc import Sequence

import torch

from ..types import RegionDescriptor
from .base import (
    Batch,
    CompletedWrite,
    PermissionDeniedError,
    Region,
    RemoteGoneError,
    Transport,
    TransportError,
    WriteOp,
    describe_remote,
)
from .lease import EpochTable, pid_alive
from .segment import _F_GET_SEALS, _SEALS, _allocate, allocated_segment

__all__ = ["ShmTransport", "allocated_segment"]

# Linux's values (fcntl has the names on Linux only; the module must import everywhere)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0x8000)
_memmove = ctypes.memmove


def _memcpy(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to ``dst`` (module level so tests can patch it)."""
    _memmove(dst, src, n)


_MEMCPY = _memcpy


# --------------------------------------------------------------------------------------------
# the transport


def _seg_field(d: RegionDescriptor, name: str):
    for k, v in d.extra:
        if k == name:
            return v
    return None


class _Map:
    """A sender's mapping of one receiver segment (``base``: its address here, ``size`` bytes)."""

    __slots__ = ("base", "size")

    def __init__(self, base: int, size: int):
        self.base, self.size = base, size


class ShmTransport(Transport):
    """One process's shared-memory endpoint (see the module docstring). ``host`` defaults to
    ``socket.gethostname()``; descriptors are only accepted from the same host."""

    name = "shm"
    publishes_allocated_only = True
    segment_arrays = True  # the pieces of a segmented op reach _post as arrays: one C loop copies them

    def __init__(self, host: str | None = None):
        super().__init__(host)
        self._maps: dict[tuple, _Map] = {}  # (pid, fd, ino, dev) -> this sender's mapping
        self._dst: dict[tuple, int] = {}  # remote key -> address here of the region's first byte
        self._tables: dict[str, int] = {}  # receiver's table id -> address here of its epoch words
        self._pidfds: dict[int, int] = {}  # receiving pid -> pidfd (-1: use kill(pid, 0))

    # ---- memory a receiver publishes ----------------------------------------------------------

    @classmethod
    def allocate(cls, nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """``nbytes`` bytes (>= 1) of shared memory: a flat ``uint8`` CPU tensor in a fresh,
        sealed memfd segment of this process (rounded up to whole pages), zero-filled. Register
        it (or a view of it) and publish its descriptor; the segment is unmapped and its file
        closed when the last tensor using it is gone (senders' mappings keep their pages until
        they disconnect). ValueError for ``nbytes < 1`` or a device other than the CPU."""
        if nbytes < 1:
            raise ValueError(f"ShmTransport.allocate: nbytes={nbytes}, need >= 1")
        if torch.device(device).type != "cpu":
            raise ValueError(f"ShmTransport.allocate: CPU memory only, not {device} (use cuda_ipc for GPU memory)")
        return _allocate(nbytes)

    # ---- hooks of the contract ----------------------------------------------------------------

    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"ShmTransport.register needs a CPU tensor, got device {tensor.device} "
                "(shared memory is host memory; use the CUDA IPC or verbs transport for GPU memory)"
            )

    def _describe(self, region: Region) -> RegionDescriptor:
        seg = allocated_segment(region.addr, region.length)
        if seg is None:
            raise ValueError(
                f"ShmTransport: cannot publish {region!r}: its memory is not in a segment ShmTransport.allocate() "
                "made, so no sender can map it. A shm receiver allocates the memory it publishes through the "
                "transport: buf = transport.allocate(nbytes), then registers buf or a view of it (the stand-in "
                "engine: Engine(..., allocate=transport.allocate)); or use the cma transport for memory you did "
                "not allocate. Senders may register any CPU tensor as a local source region."
            )
        table = self._epoch_table()
        tseg = allocated_segment(table.addr, table.words.nbytes)
        extra = (("seg", (seg.fd, seg.ino, seg.dev, seg.size)), ("offset", region.addr - seg.addr),
                 ("epoch_seg", (tseg.fd, tseg.ino, tseg.dev, tseg.size, table.addr - tseg.addr)))
        return self._descriptor(region, key=secrets.randbits(64), extra=extra)

    def _check_descriptor(self, d: RegionDescriptor) -> None:
        if d.host != self.host:
            raise ValueError(
                f"connect: descriptor {describe_remote(d)} is on host {d.host!r}, this is {self.host!r}; "
                "shared memory only writes between processes of one host"
            )
        if d.pid <= 0:
            raise ValueError(f"connect: malformed descriptor {d}")
        if d.epoch <= 0 or not isinstance(_seg_field(d, "epochs"), tuple):
            raise ValueError(
                f"connect: descriptor {describe_remote(d)} carries no epoch (extra['epochs']): "
                "writes into it could not be checked against its owner's registration"
            )
        seg, off, tseg = _seg_field(d, "seg"), _seg_field(d, "offset"), _seg_field(d, "epoch_seg")
        if not (isinstance(seg, tuple) and isinstance(off, int) and isinstance(tseg, tuple)):
            raise ValueError(f"connect: descriptor {describe_remote(d)} names no shared segment (extra['seg'])")
        if off < 0 or off + d.length > seg[3]:
            raise ValueError(f"connect: descriptor {describe_remote(d)}: offset {off} + length {d.length} "
                             f"outside its segment of {seg[3]} bytes")

    def _map(self, pid: int, fd: int, ino: int, dev: int, size: int, what: str) -> _Map:
        """This sender's mapping of receiver ``pid``'s segment (opened and mapped once)."""
        key = (pid, fd, ino, dev)
        m = self._maps.get(key)
        if m is not None:
            return m
        path = f"/proc/{pid}/fd/{fd}"
        try:
            f = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise RemoteGoneError(f"connect: {what}: {path} does not exist: receiver pid {pid} is gone or closed "
                                  "the segment") from None
        except PermissionError as e:
            raise PermissionDeniedError(
                f"connect: {what}: opening {path} refused ({e.strerror}): the shm transport needs the same uid "
                "as the receiver and a dumpable receiver process (access to /proc/<pid>/fd)") from None
        try:
            st = os.fstat(f)
            if (st.st_ino, st.st_dev) != (ino, dev):
                raise TransportError(f"connect: {what}: {path} is another file (inode {st.st_ino}, the descriptor "
                                     f"names {ino}): the receiver closed the segment; nothing was mapped")
            if st.st_size < size:
                raise TransportError(f"connect: {what}: the segment is {st.st_size} bytes, the descriptor says {size}")
            seals = fcntl.fcntl(f, _F_GET_SEALS)
            if seals & _SEALS != _SEALS:
                raise TransportError(f"connect: {what}: the segment is not sealed against shrinking "
                                     f"(seals {seals:#x}): a receiver could truncate it under this sender's writes")
            base = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_POPULATE, f, 0)
            if base in (None, _MAP_FAILED):
                e = ctypes.get_errno()
                raise TransportError(f"connect: {what}: mmap of {size} bytes failed: {os.strerror(e)}")
        finally:
            os.close(f)
        m = self._maps[key] = _Map(base, size)
        return m

    def _connect(self, d: RegionDescriptor):
        """Map the descriptor's segment and its owner's epoch table (once per segment / table),
        and open a pidfd of the receiver (the lease is taken by :meth:`.base.Transport.connect`)."""
        what = describe_remote(d)
        fd, ino, dev, size = _seg_field(d, "seg")
        m = self._map(d.pid, fd, ino, dev, size, what)
        table, _, ident = _seg_field(d, "epochs")
        if ident not in self._tables:
            tfd, tino, tdev, tsize, toff = _seg_field(d, "epoch_seg")
            self._tables[ident] = self._map(d.pid, tfd, tino, tdev, tsize, what + " epoch table").base + toff
        if d.pid not in self._pidfds:
            try:
                self._pidfds[d.pid] = os.pidfd_open(d.pid)
            except (AttributeError, OSError):
                self._pidfds[d.pid] = -1
            _pieces_lib()  # built (or loaded from its cache) now, at setup, not inside the first update
        k = self._remote_key(d)
        self._dst[k] = m.base + _seg_field(d, "offset")
        return k

    def _disconnect(self) -> None:
        """Unmap every segment, close the pidfds."""
        maps, self._maps = self._maps, {}
        for m in maps.values():
            _libc.munmap(m.base, m.size)
        self._dst.clear()
        self._tables.clear()
        for fd in self._pidfds.values():
            if fd >= 0:
                os.close(fd)
        self._pidfds.clear()

    def _group_key(self, loc: Region, remote: RegionDescriptor, key):
        """Per remote region: each group's ops copy into one mapping."""
        return key

    def _published_epochs(self, remotes: list[RegionDescriptor]) -> list[int]:
        out = []
        for d in remotes:
            _, slot, ident = _seg_field(d, "epochs")
            base = self._tables.get(ident)
            out.append(0 if base is None else ctypes.c_int64.from_address(base + EpochTable.epoch_offset(slot)).value)
        return out

    def _check_alive(self, pid: int) -> None:
        fd = self._pidfds.get(pid, -1)
        gone = (bool(select.select([fd], [], [], 0)[0]) if fd >= 0 else not pid_alive(pid))
        if gone:
            raise RemoteGoneError(f"receiver pid {pid} no longer exists (its pidfd says it exited); "
                                  "nothing of the batch was issued")

    def _post(self, batch: Batch, ops: Sequence[WriteOp]) -> CompletedWrite:
        """Check that every receiving process is alive, then ``memcpy`` every op into this
        sender's mapping of its region. Returns a completed handle with the bytes written.

        With the native delta kernel (``reference/native/_delta.c``; ctypes releases the GIL for the
        call) every piece of a group is copied by one C loop, ``wt_copy_pieces``: streaming
        stores from 256 B (no read-for-ownership of the receiver's lines; glibc's memcpy streams
        only above ~3/4 of the last-level cache) and one store fence at the end. Ops with
        :class:`~.ops.Segments` (the rows of a strided TP slice: ~200k pieces per sender per
        update on the BF16 default) reach it as arrays (``segment_arrays``), with no Python per
        piece; one ``ctypes.memmove`` per piece from Python costs ~1 us, the time a 4 KiB piece
        takes to copy. Without the kernel (no C compiler) every piece is copied from Python.
        """
        for pid in {g.remote.pid for g in batch.groups.values()}:
            self._check_alive(pid)
        done = 0
        cp = _memcpy
        lib = _pieces_lib()
        for key, g in batch.groups.items():
            delta = self._dst[key] - g.remote.addr
            _, la, ra, ln = g.arrays()
            if lib is not None:
                done += lib.wt_copy_pieces(delta, la.ctypes.data, ra.ctypes.data, ln.ctypes.data, len(ln))
                continue
            for la_, ra_, n in zip(la.tolist(), ra.tolist(), ln.tolist()):
                cp(ra_ + delta, la_, n)
                done += n
        return CompletedWrite(done)


def _pieces_lib():
    """The native delta kernel (its ``wt_copy_pieces``), or None without a C compiler or when
    ``_memcpy`` is patched (tests that count or fail copies see every piece)."""
    if _memcpy is not _MEMCPY:
        return None
    from ..native.delta import KERNEL

    return KERNEL.lib()
