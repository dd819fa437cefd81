"""Guard bytes: the bytes just outside a registered region, checked after an update.

Issue 15 (8): "gap bytes unchanged" checks nothing when an arena has no gaps, and nothing read
the bytes just outside each registered region, where an off-by-one in a plan or a transport
would land. :class:`Guard` snapshots ``nbytes`` before and after a CPU region of this process
and :meth:`Guard.check` raises :class:`~.base.TransportError` naming every changed byte's
offset (relative to the region start: ``-1`` is the byte just before it, ``length`` the byte
just after).

Bytes outside a tensor may not be mapped (a region at the start or end of an allocation), so
they are read with ``process_vm_readv`` on this very process, which reports an unmapped page as
``EFAULT`` instead of crashing; such a side is recorded as unreadable (``None``) and skipped,
and the check says how many guard bytes it covered. Python offers no safe read of arbitrary
addresses otherwise (``ctypes.string_at`` would segfault on an unmapped page).
"""
from __future__ import annotations

import ctypes
import os

import torch

from .base import Region, TransportError

__all__ = ["Guard"]


def _read_own(addr: int, n: int) -> bytes | None:
    """``n`` bytes at ``addr`` of this process, or None when (part of) the range is unmapped."""
    from .cma import _iov, _process_vm_readv

    if addr <= 0 or n <= 0:
        return None
    buf = ctypes.create_string_buffer(n)
    li, ri = _iov([ctypes.addressof(buf)], [n]), _iov([addr], [n])
    try:
        got = _process_vm_readv(os.getpid(), li.buffer_info()[0], 1, ri.buffer_info()[0], 1)
    except OSError:
        return None
    return buf.raw if got == n else None


class Guard:
    """The ``nbytes`` bytes just before and just after a registered region (or a contiguous CPU
    tensor) of this process, snapshotted now. ``covered`` is how many of the ``2 * nbytes``
    could be read (unmapped sides are skipped)."""

    def __init__(self, region: Region | torch.Tensor, nbytes: int = 64):
        if nbytes <= 0:
            raise ValueError(f"Guard: nbytes {nbytes} must be > 0")
        if isinstance(region, torch.Tensor):
            if region.device.type != "cpu" or not region.is_contiguous():
                raise ValueError(f"Guard: needs a contiguous CPU tensor, got {region.device}")
            self.addr, self.length = region.data_ptr(), region.nbytes
        else:
            if region.tensor is None or region.tensor.device.type != "cpu":
                raise ValueError(f"Guard: needs a registered CPU region, got {region!r}")
            self.addr, self.length = region.addr, region.length
        self.nbytes = nbytes
        self.before = _read_own(self.addr - nbytes, nbytes)
        self.after = _read_own(self.addr + self.length, nbytes)
        self.covered = (len(self.before) if self.before else 0) + (len(self.after) if self.after else 0)

    def check(self, what: str = "") -> int:
        """Raise :class:`TransportError` when a guard byte changed since the snapshot, naming
        up to 16 offsets (relative to the region start) with old -> new values. Returns the
        number of guard bytes checked."""
        bad = []
        for start, old in ((-self.nbytes, self.before), (self.length, self.after)):
            if old is None:
                continue
            now = _read_own(self.addr + start, len(old))
            if now is None:
                raise TransportError(f"{what or 'guard'}: the bytes at offsets [{start}, {start + len(old)}) of the "
                                     f"region at {self.addr:#x} were unmapped since the snapshot")
            bad += [(start + i, a, b) for i, (a, b) in enumerate(zip(old, now)) if a != b]
        if bad:
            shown = ", ".join(f"{o}: {a:#04x} -> {b:#04x}" for o, a, b in bad[:16])
            raise TransportError(
                f"{what or 'guard'}: {len(bad)} byte(s) just outside the region at {self.addr:#x} "
                f"(length {self.length}) changed (offset: old -> new): {shown}"
            )
        return self.covered
