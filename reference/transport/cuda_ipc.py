"""CUDA IPC back end: one-sided device-to-device copies between GPUs of one host.

What it is
----------
The receiving (inference) process exports its parameter memory once: for a registered CUDA
tensor, ``tensor.untyped_storage()._share_cuda_()`` returns the ``cudaIpcMemHandle_t`` of the
caching allocator's block that holds it (plus the block size, the storage's offset inside the
block and torch's cross-process reference-counter handle). Those bytes travel in the
:class:`~weight_transfer.types.RegionDescriptor`'s ``extra`` (``handle``: the tuple
``_share_cuda_`` returned; ``offset``: the tensor's byte offset inside its storage; ``dev``:
device index; ``uuid``: the GPU's UUID; a region of several allocations,
:meth:`~weight_transfer.transport.base.Transport.register_parts`, has ``handles`` instead: one
``(offset in the region, length, handle, offset inside its storage)`` per part, since one IPC
handle maps one allocation). The sending (training) process opens each handle once
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
``/dev/nvidia*`` between the two processes. Tests: ``tests/transport/test_cuda_ipc.py``, marked
``gpu`` and skipped without CUDA.
"""
from __future__ import annotations

import secrets
import time
from bisect import bisect_right
from collections.abc import Sequence

import torch

from ..types import RegionDescriptor
from .base import Batch, Region, Transport, TransportError, WriteHandle, WriteOp, describe_remote

__all__ = ["CudaIpcTransport", "CudaIpcRegion", "CudaIpcWriteHandle", "INSTALL_HINT", "cuda_available"]

INSTALL_HINT = (
    "the 'cuda_ipc' transport needs a CUDA build of torch and a visible GPU "
    "(torch.cuda.is_available() is False here); install torch from the CUDA index, "
    "e.g. pip install torch --index-url https://download.pytorch.org/whl/cu128"
)


def cuda_available() -> bool:
    return torch.cuda.is_available()


CudaIpcRegion = Region
"""The region type (:class:`~weight_transfer.transport.base.Region`). Name kept for imports."""


class CudaIpcWriteHandle(WriteHandle):
    def __init__(self, event: torch.cuda.Event | None, nbytes: int):
        self._event, self.nbytes = event, nbytes

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None and self._event is not None:
            self._event.synchronize()
        return super().wait(timeout)

    def _idle(self) -> None:
        time.sleep(1e-4)

    def _timeout_message(self, timeout: float) -> str:
        return f"CUDA IPC copies not complete after {timeout} s"


class _PartViews:
    """The mapped views of a remote region of several parts: ``starts`` (offsets in the region)
    and one ``uint8`` view per part."""

    __slots__ = ("starts", "views")

    def __init__(self, starts: list[int], views: list[torch.Tensor]):
        self.starts, self.views = starts, views

    def at(self, offset: int) -> tuple[torch.Tensor, int]:
        """The view holding region byte ``offset`` and the offset inside it (the op checks put
        every write inside one part)."""
        k = bisect_right(self.starts, offset) - 1
        return self.views[k], offset - self.starts[k]


class CudaIpcTransport(Transport):
    """One process's CUDA IPC endpoint. ``stream``: where copies are enqueued (default a new
    stream on the current device)."""

    name = "cuda_ipc"
    parts_devices = ("cuda",)  # one IPC handle per allocation (``handles``); CPU memory is a sender's only

    def __init__(self, host: str | None = None, *, stream: torch.cuda.Stream | None = None):
        if not cuda_available():
            raise ImportError(INSTALL_HINT)
        super().__init__(host)
        self.stream = stream or torch.cuda.Stream()
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # remote key -> mapped uint8 view

    # ---- hooks of the contract ----------------------------------------------------------------

    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device.type not in ("cuda", "cpu"):
            raise ValueError(f"register: CUDA or CPU tensors only, got {tensor.device}")

    def _describe(self, region: Region) -> RegionDescriptor:
        tensor = region.tensor
        extra: tuple = ()
        if tensor.device.type == "cuda" and region.parts:
            dev = tensor.device.index
            handles = tuple((off, n, tuple(p.untyped_storage()._share_cuda_()), p.storage_offset() * p.element_size())
                            for (off, n), p in zip(region.parts, region._parts))
            extra = (("dev", dev), ("handles", handles), ("uuid", str(torch.cuda.get_device_properties(dev).uuid)))
        elif tensor.device.type == "cuda":
            share = tensor.untyped_storage()._share_cuda_()
            dev = tensor.device.index
            extra = (("dev", dev), ("handle", tuple(share)),
                     ("offset", tensor.storage_offset() * tensor.element_size()),
                     ("uuid", str(torch.cuda.get_device_properties(dev).uuid)))
        return self._descriptor(region, key=secrets.randbits(64), extra=extra)

    def _check_descriptor(self, d: RegionDescriptor) -> None:
        if d.host != self.host:
            raise ValueError(f"connect: descriptor on host {d.host!r}, this is {self.host!r}; CUDA IPC is one host only")
        if "handle" not in dict(d.extra) and "handles" not in dict(d.extra):
            raise ValueError(f"connect: descriptor {describe_remote(d)} has no CUDA IPC handle (a CPU region?)")
        if d.epoch <= 0 or "epochs" not in dict(d.extra):
            raise ValueError(f"connect: descriptor {describe_remote(d)} carries no epoch (extra['epochs'])")

    def _published_epochs(self, remotes: list[RegionDescriptor]) -> list[int]:
        """The owners' epoch tables are CPU memory of the same host: read with
        ``process_vm_readv`` like CMA (:func:`.cma.read_published_epochs`). No lease: torch's
        IPC reference counter keeps the receiver's block from being freed or reused while this
        process has it open, so only writes into a deregistered (still allocated) tensor are at
        stake, and those are refused here."""
        from .cma import read_published_epochs

        return read_published_epochs(remotes)

    def _connect(self, d: RegionDescriptor):
        """Open the descriptor's IPC handle(s) (``cudaIpcOpenMemHandle``; torch maps a handle
        opened twice once); TransportError when CUDA refuses."""
        x = dict(d.extra)

        def view_of(share, offset: int, length: int) -> torch.Tensor:
            try:
                st = torch.UntypedStorage._new_shared_cuda(*share)
            except Exception as e:
                raise TransportError(f"connect: cudaIpcOpenMemHandle failed for {describe_remote(d)}: {e}") from e
            view = torch.empty(0, dtype=torch.uint8, device=f"cuda:{x['dev']}")
            return view.set_(st, offset, (length,))

        k = self._remote_key(d)
        if "handles" in x:
            parts = sorted(x["handles"], key=lambda h: h[0])
            self._views[k] = _PartViews([off for off, *_ in parts], [view_of(sh, so, n) for _, n, sh, so in parts])
        else:
            self._views[k] = view_of(x["handle"], x["offset"], d.length)
        return k

    def _disconnect(self) -> None:
        self._views.clear()

    def _group_key(self, loc: Region, remote: RegionDescriptor, key):
        """Per (local region, remote region): each group is copies from one tensor into one view."""
        return (id(loc), key)

    def _post(self, batch: Batch, ops: Sequence[WriteOp]) -> CudaIpcWriteHandle:
        """Enqueue every copy on ``stream`` and record an event; the handle waits on it."""
        with torch.cuda.stream(self.stream):
            for (_, key), g in batch.groups.items():
                src_all = g.local.tensor.view(-1).view(torch.uint8)
                dst_all = self._views[key]
                lbase, rbase = g.local.addr, g.remote.addr
                for la, ra, n in zip(g.laddr, g.raddr, g.lens):
                    lo, ro = la - lbase, ra - rbase
                    dst = dst_all
                    if isinstance(dst_all, _PartViews):  # the op checks put every write inside one part
                        dst, ro = dst_all.at(ro)
                    dst[ro:ro + n].copy_(src_all[lo:lo + n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return CudaIpcWriteHandle(ev, batch.nbytes)
