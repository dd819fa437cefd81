"""Cross-memory attach (CMA) back end: one-sided writes into another process's CPU memory.

What it is
----------
``process_vm_writev(2)`` asks the kernel to copy bytes from this process's address space
straight into another process's address space. The receiver runs no code at all: it only
registered its memory once and published :class:`~reference.types.RegionDescriptor` s (pid,
virtual address, length, key). That makes CMA a real one-sided write with the same shape as an
RDMA WRITE, limited to one host and to CPU memory; it works on any Linux box and in CI, which
is why it is the reference data plane for tests and single-host runs.

Semantics
---------
- Units are bytes everywhere (offsets, lengths, return values).
- :meth:`CmaTransport.write` is synchronous: when it returns, every byte is in the remote
  process's memory, and the returned :class:`WriteHandle` is already complete
  (``wait()`` returns the bytes written). Ordering between ops of one batch is op order per
  receiving pid; receivers are served one after the other.
- Every op of a batch is checked before any byte is issued: the local region is registered
  here, the remote descriptor was :meth:`~CmaTransport.connect` ed with the same key, offsets
  and lengths are >= 0 and both ranges lie inside their regions. Zero-length ops are skipped.
- Ops are grouped per remote pid into iovec batches of at most ``IOV_MAX`` (1024) entries,
  one local + one remote iovec per op. The kernel may copy fewer bytes than asked (it caps one
  call at ~2 GiB, and stops at the first remote page it cannot access); the loop resumes at the
  exact iovec and offset where the kernel stopped.
- Zero-byte tensors cannot be registered (ValueError): a region is at least one byte, so that
  ``(pid, addr)`` identifies it. Register one buffer per rank and skip empty shards.
- The region keeps a reference to its tensor, so its memory is not freed while registered.
  It is the caller's job not to resize or re-point the tensor's storage.
- Descriptor keys are random 64-bit tokens (``secrets``). The receiver runs no code per write,
  so the key is checked against what the sender connected: a descriptor from another run (same
  pid and address, different key) is refused. Connecting a descriptor for a ``(pid, addr)``
  already connected with another key replaces it (the newer registration wins).
- Not thread-safe: one writer thread per transport.

Requirements
------------
Linux >= 3.2, and the right to ptrace the receiver: same uid with ``kernel.yama.ptrace_scope``
0 (or the receiver a descendant, or ``CAP_SYS_PTRACE``), and a container seccomp profile that
allows ``process_vm_writev`` / ``process_vm_readv`` (Docker's default allows them only with
``CAP_SYS_PTRACE``). Sender and receiver must be on the same host (descriptors naming another
host are refused at connect time).

Errors
------
All derive from :class:`TransportError`:
:class:`BoundsError` (an op leaves a region; names op index, region pid/addr, offsets, length,
bounds), :class:`UnknownRegionError` (remote descriptor not connected or stale key; local region
not registered), :class:`PermissionDeniedError` (``EPERM``/``EACCES``, with the ptrace hint),
:class:`RemoteGoneError` (``ESRCH``: the receiver exited), and :class:`TransportError` for
``EFAULT`` (a remote address is not mapped: names the first op not completed) and any other
errno (``os.strerror``). A failure after bytes were issued says how many bytes of the batch
had completed.

Why ctypes
----------
Python's standard library does not expose ``process_vm_writev``, and no maintained package
wraps it (the few PyPI wrappers are unmaintained single-author projects); the call is one libc
function with a trivial ABI, so it is bound here with :mod:`ctypes` (``use_errno=True``). The
iovec arrays are built in one go per batch as flat ``array('L')`` buffers
(``[base0, len0, base1, len1, ...]``, the exact ``struct iovec`` layout on Linux, where
``unsigned long``, ``size_t`` and pointers have the same width).

Measured
--------
On a shared 2-core CI VM (Linux 6.18, no hugepages; 3 runs, best of 5 timed repeats each, the
destination pages already touched): one 256 MiB op into another process 3.6-4.4 GB/s, against
2.9-9.2 GB/s for a same-process ``torch`` ``copy_`` of the same size in the same runs (torch may
use both cores; the box is noisy). Many ops into one receiver: 4096 x 64 KiB 2.5-3.6 GB/s,
65536 x 4 KiB 1.2-1.7 GB/s. Python cost per op (validation + iovec building) is ~1.3 us.

Usage::

    # receiver (inference rank), once
    t = CmaTransport(); region = t.register(params_buffer); publish(region.descriptor())
    # sender (training rank)
    t = CmaTransport(); src = t.register(staging); t.connect(descriptors)
    t.write([WriteOp(src, 0, descriptors[0], 4096, n)]).wait()
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import os
import secrets
import socket
from array import array
from typing import Sequence

import torch

from ..types import RegionDescriptor
from .base import (
    BoundsError,
    PermissionDeniedError,
    Region,
    RemoteGoneError,
    Transport,
    TransportError,
    UnknownRegionError,
    WriteHandle,
    WriteOp,
)

__all__ = ["CmaTransport", "CmaRegion", "CmaWriteHandle", "IOV_MAX"]

IOV_MAX = 1024
"""Most iovec entries per ``process_vm_writev`` call (Linux ``UIO_MAXIOV``)."""

# --------------------------------------------------------------------------------------------
# libc binding

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_SYSCALL_ARGTYPES = [
    ctypes.c_int,  # pid_t pid
    ctypes.c_void_p,  # const struct iovec *local_iov
    ctypes.c_ulong,  # unsigned long liovcnt
    ctypes.c_void_p,  # const struct iovec *remote_iov
    ctypes.c_ulong,  # unsigned long riovcnt
    ctypes.c_ulong,  # unsigned long flags (must be 0)
]


def _bind(name: str):
    fn = getattr(_libc, name, None)
    if fn is None:
        return None
    fn.argtypes = _SYSCALL_ARGTYPES
    fn.restype = ctypes.c_ssize_t
    return fn


_writev = _bind("process_vm_writev")
_readv = _bind("process_vm_readv")
# struct iovec == {void *iov_base; size_t iov_len;}: two unsigned longs on Linux.
assert array("L").itemsize == ctypes.sizeof(ctypes.c_void_p) == ctypes.sizeof(ctypes.c_size_t)


def _call(fn, pid: int, liov: int, nl: int, riov: int, nr: int) -> int:
    if fn is None:
        raise TransportError("this libc has no process_vm_writev/readv (needs Linux, glibc >= 2.15)")
    n = fn(pid, liov, nl, riov, nr, 0)
    if n < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return n


def _process_vm_writev(pid: int, liov: int, nl: int, riov: int, nr: int) -> int:
    """One ``process_vm_writev`` call on iovec arrays at addresses ``liov`` / ``riov``.
    Returns bytes written (possibly fewer than asked); raises OSError with the errno.
    Module-level so tests can monkeypatch it."""
    return _call(_writev, pid, liov, nl, riov, nr)


def _process_vm_readv(pid: int, liov: int, nl: int, riov: int, nr: int) -> int:
    """One ``process_vm_readv`` call; same contract as :func:`_process_vm_writev`."""
    return _call(_readv, pid, liov, nl, riov, nr)


def _iov(bases: list[int], lens: list[int]) -> array:
    flat = [0] * (2 * len(bases))
    flat[0::2] = bases
    flat[1::2] = lens
    return array("L", flat)


# --------------------------------------------------------------------------------------------
# regions and handles


class CmaRegion(Region):
    """A registered contiguous CPU tensor. Holds a reference to the tensor while registered."""

    __slots__ = ("_tensor", "_addr", "_length", "_desc")

    def __init__(self, tensor: torch.Tensor, desc: RegionDescriptor):
        self._tensor = tensor
        self._addr = desc.addr
        self._length = desc.length
        self._desc = desc

    @property
    def addr(self) -> int:
        return self._addr

    @property
    def length(self) -> int:
        return self._length

    @property
    def tensor(self) -> torch.Tensor | None:
        """The registered tensor (None once deregistered)."""
        return self._tensor

    def descriptor(self) -> RegionDescriptor:
        return self._desc

    def __repr__(self) -> str:
        live = "" if self._tensor is not None else ", deregistered"
        return f"CmaRegion(addr={self._addr:#x}, length={self._length}{live})"


class CmaWriteHandle(WriteHandle):
    """Completion of a CMA batch; CMA is synchronous, so it is complete on creation."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def wait(self, timeout: float | None = None) -> int:
        return self.nbytes

    def done(self) -> bool:
        return True


# --------------------------------------------------------------------------------------------
# transport

_PTRACE_HINT = (
    "CMA needs ptrace access to the receiver: run sender and receiver as the same uid with "
    "kernel.yama.ptrace_scope=0 (sysctl kernel.yama.ptrace_scope), or give the sender "
    "CAP_SYS_PTRACE; in a container, the seccomp profile must allow process_vm_writev "
    "(e.g. docker run --cap-add SYS_PTRACE)"
)


class CmaTransport(Transport):
    """One process's CMA endpoint. ``host`` defaults to ``socket.gethostname()``; descriptors
    are only accepted from the same host."""

    name = "cma"

    def __init__(self, host: str | None = None):
        self.host = host if host is not None else socket.gethostname()
        self.pid = os.getpid()
        self._local: dict[int, CmaRegion] = {}  # id(region) -> region
        self._remote: dict[tuple[int, int], RegionDescriptor] = {}  # (pid, addr) -> desc

    # ---- registration -----------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> CmaRegion:
        """Register a contiguous CPU tensor of >= 1 byte; ValueError otherwise."""
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"CmaTransport.register needs a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(
                f"CmaTransport.register needs a CPU tensor, got device {tensor.device} "
                "(CMA copies between process address spaces; use the CUDA IPC or verbs transport for GPU memory)"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"CmaTransport.register needs a contiguous tensor (shape {tuple(tensor.shape)}, "
                f"stride {tensor.stride()}); register the base buffer or .contiguous() it"
            )
        if tensor.nbytes == 0:
            raise ValueError(
                f"CmaTransport.register refuses a zero-byte tensor (shape {tuple(tensor.shape)}): "
                "a region must be at least one byte; skip empty shards"
            )
        desc = RegionDescriptor(
            transport="cma",
            host=self.host,
            pid=self.pid,
            addr=tensor.data_ptr(),
            length=tensor.nbytes,
            key=secrets.randbits(64),
        )
        region = CmaRegion(tensor, desc)
        self._local[id(region)] = region
        return region

    def deregister(self, region: Region) -> None:
        """Forget a local region; later writes from it raise UnknownRegionError. Idempotent."""
        if self._local.pop(id(region), None) is not None:
            region._tensor = None  # type: ignore[attr-defined]

    def connect(self, descriptors: Sequence[RegionDescriptor]) -> None:
        """Accept remote regions as write targets. All are checked before any is accepted:
        ValueError for another transport, another host, or a malformed descriptor."""
        for d in descriptors:
            if not isinstance(d, RegionDescriptor):
                raise ValueError(f"connect: expected RegionDescriptor, got {type(d).__name__}")
            if d.transport != "cma":
                raise ValueError(f"connect: descriptor {_name(d)} is for transport {d.transport!r}, not 'cma'")
            if d.host != self.host:
                raise ValueError(
                    f"connect: descriptor {_name(d)} is on host {d.host!r}, this is {self.host!r}; "
                    "CMA only writes between processes of one host"
                )
            if d.pid <= 0 or d.addr <= 0 or d.length <= 0:
                raise ValueError(f"connect: malformed descriptor {d}")
        for d in descriptors:
            self._remote[(d.pid, d.addr)] = d

    def close(self) -> None:
        for r in list(self._local.values()):
            self.deregister(r)
        self._remote.clear()

    # ---- data path --------------------------------------------------------------------------

    def write(self, ops: Sequence[WriteOp]) -> CmaWriteHandle:
        """Validate every op, then copy them all (grouped per remote pid, <= IOV_MAX iovecs per
        syscall, resuming partial copies). Returns a completed handle with the bytes written."""
        local = self._local
        remote = self._remote
        # pid -> ([local addrs], [remote addrs], [lengths], [op indices])
        groups: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
        total = 0
        # ops of a batch mostly share their region objects: validate each one once
        last_loc = last_rd = None
        llen = laddr = rlen = raddr = 0
        g = None
        for i, op in enumerate(ops):
            loc = op.local
            if loc is not last_loc:
                if local.get(id(loc)) is not loc:
                    raise UnknownRegionError(
                        f"op {i}: local region {loc!r} is not registered with this transport "
                        "(deregistered, or registered elsewhere); nothing of the batch was issued"
                    )
                last_loc, llen, laddr = loc, loc._length, loc._addr
            rd = op.remote
            if rd is not last_rd:
                c = remote.get((rd.pid, rd.addr))
                if c is None or c.key != rd.key or c.length != rd.length:
                    raise UnknownRegionError(_unknown_msg(i, rd, c))
                last_rd, rlen, raddr = rd, c.length, c.addr
                g = groups.get(rd.pid)
                if g is None:
                    g = groups[rd.pid] = ([], [], [], [])
            lo, ro, n = op.local_offset, op.remote_offset, op.length
            if lo < 0 or ro < 0 or n < 0 or lo + n > llen or ro + n > rlen:
                raise BoundsError(_bounds_msg(i, loc, remote[(rd.pid, rd.addr)], lo, ro, n))
            if n:
                g[0].append(laddr + lo)
                g[1].append(raddr + ro)
                g[2].append(n)
                g[3].append(i)
                total += n

        done = 0
        for pid, (las, ras, lens, idxs) in groups.items():
            for s in range(0, len(lens), IOV_MAX):
                e = s + IOV_MAX
                done = self._send(
                    _process_vm_writev, pid, las[s:e], ras[s:e], lens[s:e], idxs[s:e], done, total, ops
                )
        return CmaWriteHandle(done)

    def read(self, remote: RegionDescriptor, offset: int = 0, length: int | None = None) -> bytes:
        """Copy ``length`` bytes (default: to the end) of a connected remote region at
        ``offset`` into a new ``bytes`` with ``process_vm_readv``. Same checks as write.
        For tests and verification, not the hot path."""
        c = self._remote.get((remote.pid, remote.addr))
        if c is None or c.key != remote.key or c.length != remote.length:
            raise UnknownRegionError(_unknown_msg(None, remote, c))
        if length is None:
            length = c.length - offset
        if offset < 0 or length < 0 or offset + length > c.length:
            raise BoundsError(
                f"read: offset {offset} + length {length} outside remote region {_name(c)} "
                f"[0, {c.length})"
            )
        if length == 0:
            return b""
        buf = ctypes.create_string_buffer(length)
        self._send(
            _process_vm_readv, remote.pid, [ctypes.addressof(buf)], [remote.addr + offset],
            [length], [0], 0, length, None,
        )
        return buf.raw

    def _send(self, call, pid, las, ras, lens, idxs, done, total, ops) -> int:
        """Issue one iovec batch (<= IOV_MAX ops) to ``pid``, resuming partial copies.
        ``done`` is the byte count of the whole write so far; returns it updated."""
        want = sum(lens)
        liov, riov = _iov(las, lens), _iov(ras, lens)
        while True:
            m = len(lens)
            try:
                k = call(pid, liov.buffer_info()[0], m, riov.buffer_info()[0], m)
            except OSError as ex:
                # the batch lists start at the first op not completed
                raise _errno_error(ex.errno, pid, idxs[0], ops, done, total) from None
            done += k
            want -= k
            if want <= 0:
                return done
            if k <= 0:
                raise TransportError(
                    f"{_opname(idxs[0], ops)}: process_vm_{'writev' if ops is not None else 'readv'} "
                    f"to pid {pid} made no progress ({done} of {total} bytes of the batch done)"
                )
            # partial copy: find the first unfinished iovec and the offset into it, and restart
            # the batch there
            i = off = 0
            while k > 0:
                rest = lens[i] - off
                if k >= rest:
                    k -= rest
                    i += 1
                    off = 0
                else:
                    off += k
                    k = 0
            la, ra, ln = las[i:], ras[i:], lens[i:]
            la[0] += off
            ra[0] += off
            ln[0] -= off
            las, ras, lens, idxs = la, ra, ln, idxs[i:]
            liov, riov = _iov(las, lens), _iov(ras, lens)


# --------------------------------------------------------------------------------------------
# messages


def _name(d: RegionDescriptor) -> str:
    return f"(pid {d.pid}, addr {d.addr:#x}, length {d.length})"


def _opname(i: int, ops) -> str:
    if ops is None:
        return "read"
    op = ops[i]
    return (
        f"op {i} (local_offset {op.local_offset}, remote {_name(op.remote)}, "
        f"remote_offset {op.remote_offset}, length {op.length})"
    )


def _unknown_msg(i, rd: RegionDescriptor, c: RegionDescriptor | None) -> str:
    where = f"op {i}" if i is not None else "read"
    if c is None:
        why = "was never connected (call connect() with the receiver's descriptors first)"
    elif c.key != rd.key:
        why = (
            f"has key {rd.key:#x} but the connected registration has key {c.key:#x} "
            "(a descriptor from another run or a re-registration)"
        )
    else:
        why = f"has length {rd.length} but the connected one has length {c.length}"
    return f"{where}: remote region {_name(rd)} {why}; nothing of the batch was issued"


def _bounds_msg(i: int, loc: CmaRegion, c: RegionDescriptor, lo: int, ro: int, n: int) -> str:
    parts = []
    if lo < 0:
        parts.append(f"local_offset {lo} < 0")
    if ro < 0:
        parts.append(f"remote_offset {ro} < 0")
    if n < 0:
        parts.append(f"length {n} < 0")
    if lo + n > loc.length:
        parts.append(
            f"local_offset {lo} + length {n} = {lo + n} > local region length {loc.length} "
            f"(addr {loc.addr:#x})"
        )
    if ro + n > c.length:
        parts.append(
            f"remote_offset {ro} + length {n} = {ro + n} > remote region length {c.length} "
            f"(pid {c.pid}, addr {c.addr:#x})"
        )
    return (
        f"op {i}: out of bounds: {'; '.join(parts)} [local (addr {loc.addr:#x}, length {loc.length}), "
        f"remote {_name(c)}, local_offset {lo}, remote_offset {ro}, length {n}]; "
        "nothing of the batch was issued"
    )


def _errno_error(err: int, pid: int, i: int, ops, done: int, total: int) -> TransportError:
    what = _opname(i, ops)
    progress = f"{done} of {total} bytes of the batch had completed"
    if err in (_errno.EPERM, _errno.EACCES):
        return PermissionDeniedError(
            f"{what}: the kernel refused access to pid {pid} ({os.strerror(err)}); {_PTRACE_HINT}; {progress}"
        )
    if err == _errno.ESRCH:
        return RemoteGoneError(f"{what}: receiver pid {pid} no longer exists (ESRCH); {progress}")
    if err == _errno.EFAULT:
        return TransportError(
            f"{what}: address not mapped in pid {pid} or here (EFAULT): the receiver freed or "
            f"unmapped its registered memory; {progress}"
        )
    return TransportError(f"{what}: process_vm_writev/readv to pid {pid} failed: "
                          f"{os.strerror(err)} (errno {err}); {progress}")
