"""CUDA IPC back end: one-sided device-to-device copies between GPUs of one host.

What it is
----------
The receiving (inference) process exports its parameter memory once: for a registered CUDA
tensor, ``tensor.untyped_storage()._share_cuda_()`` returns the ``cudaIpcMemHandle_t`` of the
caching allocator's block that holds it (plus the block size, the storage's offset inside the
block and torch's cross-process reference-counter handle). Those bytes travel in the
:class:`~reference.types.RegionDescriptor`'s ``extra`` (``handle``: the tuple
``_share_cuda_`` returned; ``offset``: the tensor's byte offset inside its storage; ``dev``:
device index; ``uuid``: the GPU's UUID). The sending (training) process opens each handle once
in :meth:`CudaIpcTransport.connect` (``torch.UntypedStorage._new_shared_cuda``, i.e.
``cudaIpcOpenMemHandle``), which maps the receiver's memory into its own address space, and
each write is a ``copy_`` into that mapping on the sender's stream: NVLink/PCIe peer-to-peer
when the GPUs can reach each other, staged by the driver otherwise. The receiver runs nothing.

Semantics
---------
- :meth:`CudaIpcTransport.write` validates every op first (local region registered, remote
  descriptor connected with the same key and length, bounds), then enqueues the copies on
  ``stream`` (default: a dedicated stream of the local device) and records an event; the
  returned handle's ``wait`` synchronizes that event. Local regions may be CUDA tensors or
  (pinned) CPU tensors (then the copy is host-to-device).
- The receiver must keep its tensors (and its process) alive while senders hold the mapping;
  torch's IPC reference counter keeps the block from being freed by the receiver's caching
  allocator while a sender has it open.
- Descriptor keys are random 64-bit tokens checked like CMA's; the ``uuid`` names the physical
  GPU so a descriptor from another host is refused when its ``host`` differs.

Requirements: a CUDA build of torch, GPUs of one host, same user, no container isolation of
``/dev/nvidia*`` between the two processes. Tests: ``tests/test_transport_cuda_ipc.py``, marked
``gpu`` and skipped without CUDA.
"""
from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Sequence

import torch

from ..types import RegionDescriptor
from .base import BoundsError, Region, Transport, TransportError, UnknownRegionError, WriteHandle, WriteOp

__all__ = ["CudaIpcTransport", "CudaIpcRegion", "CudaIpcWriteHandle", "INSTALL_HINT", "cuda_available"]

INSTALL_HINT = (
    "the 'cuda_ipc' transport needs a CUDA build of torch and a visible GPU "
    "(torch.cuda.is_available() is False here); install torch from the CUDA index, "
    "e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128"
)


def cuda_available() -> bool:
    return torch.cuda.is_available()


class CudaIpcRegion(Region):
    __slots__ = ("_tensor", "_desc")

    def __init__(self, tensor: torch.Tensor, desc: RegionDescriptor):
        self._tensor, self._desc = tensor, desc

    @property
    def addr(self) -> int:
        return self._desc.addr

    @property
    def length(self) -> int:
        return self._desc.length

    @property
    def tensor(self) -> torch.Tensor | None:
        return self._tensor

    def descriptor(self) -> RegionDescriptor:
        return self._desc

    def __repr__(self) -> str:
        live = "" if self._tensor is not None else ", deregistered"
        return f"CudaIpcRegion(addr={self.addr:#x}, length={self.length}{live})"


class CudaIpcWriteHandle(WriteHandle):
    def __init__(self, event: torch.cuda.Event | None, nbytes: int):
        self._event, self.nbytes = event, nbytes

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self, timeout: float | None = None) -> int:
        if self._event is None:
            return self.nbytes
        if timeout is None:
            self._event.synchronize()
            return self.nbytes
        t0 = time.monotonic()
        while not self._event.query():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"CUDA IPC copies not complete after {timeout} s")
            time.sleep(1e-4)
        return self.nbytes


class CudaIpcTransport(Transport):
    """One process's CUDA IPC endpoint. ``stream``: where copies are enqueued (default a new
    stream on the current device)."""

    name = "cuda_ipc"

    def __init__(self, host: str | None = None, *, stream: "torch.cuda.Stream | None" = None):
        if not cuda_available():
            raise ImportError(INSTALL_HINT)
        self.host = host if host is not None else socket.gethostname()
        self.pid = os.getpid()
        self.stream = stream or torch.cuda.Stream()
        self._local: dict[int, CudaIpcRegion] = {}
        self._remote: dict[tuple[int, int], tuple[RegionDescriptor, torch.Tensor]] = {}

    def register(self, tensor: torch.Tensor) -> CudaIpcRegion:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_contiguous():
            raise ValueError("register: expected a contiguous torch.Tensor")
        n = tensor.numel() * tensor.element_size()
        if n == 0:
            raise ValueError("register: cannot register a zero-byte tensor")
        extra: tuple = ()
        if tensor.device.type == "cuda":
            st = tensor.untyped_storage()
            share = st._share_cuda_()
            dev = tensor.device.index
            extra = (("dev", dev), ("handle", tuple(share)),
                     ("offset", tensor.storage_offset() * tensor.element_size()),
                     ("uuid", str(torch.cuda.get_device_properties(dev).uuid)))
        elif tensor.device.type != "cpu":
            raise ValueError(f"register: CUDA or CPU tensors only, got {tensor.device}")
        desc = RegionDescriptor(transport="cuda_ipc", host=self.host, pid=self.pid, addr=tensor.data_ptr(),
                                length=n, key=secrets.randbits(64), extra=extra)
        r = CudaIpcRegion(tensor, desc)
        self._local[id(r)] = r
        return r

    def deregister(self, region: Region) -> None:
        if self._local.pop(id(region), None) is not None:
            region._tensor = None  # type: ignore[attr-defined]

    def connect(self, descriptors: Sequence[RegionDescriptor]) -> None:
        """Open every descriptor's IPC handle (once). ValueError for another transport, another
        host, a CPU-only descriptor or a malformed one; TransportError when CUDA refuses."""
        for d in descriptors:
            if not isinstance(d, RegionDescriptor) or d.transport != "cuda_ipc":
                raise ValueError(f"connect: not a cuda_ipc descriptor: {d!r}")
            if d.host != self.host:
                raise ValueError(f"connect: descriptor on host {d.host!r}, this is {self.host!r}; CUDA IPC is one host only")
            x = dict(d.extra)
            if "handle" not in x or d.length <= 0:
                raise ValueError(f"connect: descriptor {_name(d)} has no CUDA IPC handle (a CPU region?)")
        for d in descriptors:
            x = dict(d.extra)
            try:
                st = torch.UntypedStorage._new_shared_cuda(*x["handle"])
            except Exception as e:  # noqa: BLE001
                raise TransportError(f"connect: cudaIpcOpenMemHandle failed for {_name(d)}: {e}") from e
            view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{x['dev']}")
            view.set_(st, x["offset"], (d.length,))
            self._remote[(d.pid, d.addr)] = (d, view)

    def write(self, ops: Sequence[WriteOp]) -> CudaIpcWriteHandle:
        plan = []
        total = 0
        for i, op in enumerate(ops):
            loc = op.local
            if self._local.get(id(loc)) is not loc:
                raise UnknownRegionError(f"op {i}: local region {loc!r} is not registered with this transport "
                                         "(deregistered, or registered elsewhere); nothing of the batch was issued")
            rd = op.remote
            got = self._remote.get((rd.pid, rd.addr))
            if got is None or got[0].key != rd.key or got[0].length != rd.length:
                why = ("was never connected" if got is None else
                       f"has key {rd.key:#x} but the connected registration has key {got[0].key:#x} "
                       "(a descriptor from another run or a re-registration)")
                raise UnknownRegionError(f"op {i}: remote region {_name(rd)} {why}; nothing of the batch was issued")
            lo, ro, n = op.local_offset, op.remote_offset, op.length
            if lo < 0 or ro < 0 or n < 0 or lo + n > loc.length or ro + n > rd.length:
                raise BoundsError(f"op {i}: out of bounds: local_offset {lo}, remote_offset {ro}, length {n} against "
                                  f"local length {loc.length} and remote {_name(rd)}; nothing of the batch was issued")
            if n:
                plan.append((loc, lo, got[1], ro, n))
                total += n
        if not plan:
            return CudaIpcWriteHandle(None, 0)
        with torch.cuda.stream(self.stream):
            for loc, lo, dst, ro, n in plan:
                src = loc._tensor.view(-1).view(torch.uint8)[lo:lo + n]
                dst[ro:ro + n].copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return CudaIpcWriteHandle(ev, total)

    def close(self) -> None:
        for r in list(self._local.values()):
            self.deregister(r)
        self._remote.clear()


def _name(d: RegionDescriptor) -> str:
    return f"(host {d.host}, pid {d.pid}, addr {d.addr:#x}, length {d.length})"
