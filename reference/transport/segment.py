"""Sealed shared-memory segments (``memfd_create``) this process allocated: what the ``shm``
back end publishes (:meth:`.shm.ShmTransport.allocate`) and where every transport's epoch and
lease table lives (:mod:`.lease`), so that senders of this host can map it. Why ``memfd`` (no
name, nothing leaks, no ``/dev/shm`` cap, sealed against shrinking) is in :mod:`.shm`."""
from __future__ import annotations

import errno as _errno
import fcntl
import mmap
import os
import threading
import weakref

import torch

__all__ = ["allocated_segment"]

# Linux's values (fcntl has the names on Linux only; the module must import everywhere)
_F_ADD_SEALS, _F_GET_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033), getattr(fcntl, "F_GET_SEALS", 1034)
_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 2) | getattr(fcntl, "F_SEAL_GROW", 4) | getattr(fcntl, "F_SEAL_SEAL", 1)
_PAGE = mmap.PAGESIZE


# --------------------------------------------------------------------------------------------
# segments this process allocated


class _Segment:
    """One memfd mapped here: its fd, inode, device, size (bytes) and address."""

    __slots__ = ("fd", "ino", "dev", "size", "addr", "__weakref__")

    def __init__(self, fd: int, size: int, addr: int):
        st = os.fstat(fd)
        self.fd, self.ino, self.dev, self.size, self.addr = fd, st.st_ino, st.st_dev, size, addr


_SEGMENTS: dict[int, _Segment] = {}  # address -> segment (this process's, alive)
_LOCK = threading.Lock()


def _forget(addr: int, fd: int) -> None:
    """The segment's mapping was freed (its last tensor is gone): close the file."""
    with _LOCK:
        _SEGMENTS.pop(addr, None)
    try:
        os.close(fd)
    except OSError:
        pass


def _allocate(nbytes: int) -> torch.Tensor:
    if not hasattr(os, "memfd_create"):
        raise OSError(_errno.ENOSYS, "the shm transport needs Linux (os.memfd_create)")
    size = -(-nbytes // _PAGE) * _PAGE
    fd = os.memfd_create(f"weight_transfer.shm.{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)  # a memfd is created 0777: readable and writable by its owner only (docs/SECURITY.md)
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, _F_ADD_SEALS, _SEALS)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds mm: unmapped when its last view is gone
    addr = whole.data_ptr()
    with _LOCK:
        _SEGMENTS[addr] = _Segment(fd, size, addr)
    weakref.finalize(mm, _forget, addr, fd)
    return whole[:nbytes]


def allocated_segment(addr: int, length: int) -> _Segment | None:
    """The live segment of this process holding ``[addr, addr + length)``, or None."""
    with _LOCK:
        for s in _SEGMENTS.values():
            if s.addr <= addr and addr + length <= s.addr + s.size:
                return s
    return None
