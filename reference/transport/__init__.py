"""Data plane: the :class:`Transport` interface and its back ends.

``make_transport("cma")`` builds a back end by name; see :mod:`.base` for the contract: the
one region type, and the op checks every back end runs (written once there); a back end only
posts and waits. Back ends (docs/TRANSPORTS.md has install notes):

- ``cma``: cross-memory attach (:mod:`.cma`), one-sided ``process_vm_writev`` between
  processes of one host, CPU memory; no dependency.
- ``nixl``: NVIDIA NIXL agents over UCX (:mod:`.nixl`): CMA/TCP on one box, RDMA on clusters.
- ``verbs``: pyverbs RC queue pairs with RDMA WRITE (:mod:`.verbs`); needs an RDMA device.
- ``cuda_ipc``: CUDA IPC handles, device-to-device copies between GPUs of one host
  (:mod:`.cuda_ipc`).
- ``shm``: shared memory (:mod:`.shm`), a ``memcpy`` into the receiver's memory mapped once by
  each sender, CPU memory of one host; the receiver allocates what it publishes through
  ``ShmTransport.allocate`` (``publishes_allocated_only``); no dependency.

The modules import their optional libraries only when a transport is built, so
``make_transport`` raises an ImportError that says what to install when one is missing.

Beside the back ends: :mod:`.ops` (what a write is, the batch checks) and :mod:`.runs` (byte runs),
:mod:`.segment` (the ``shm`` back end's sealed segments), :mod:`.guard` (guard bytes around
regions), :mod:`.lease` (epochs, revocation, leases), :mod:`.verbs_plan` (the verbs back end's pure
parts) and :mod:`.views` (this process's memory as ``uint8`` tensors).

Imports: ``types``, ``native``.
"""
from __future__ import annotations

from . import lease
from .base import (
    Batch,
    BoundsError,
    CompletedWrite,
    LeaseRequiredError,
    LeaseTimeoutError,
    PermissionDeniedError,
    Region,
    RemoteGoneError,
    StaleRegionError,
    Transport,
    TransportError,
    UnknownRegionError,
    WriteHandle,
    WriteOp,
    check_batch,
)
from .cma import CmaRegion, CmaTransport
from .cuda_ipc import CudaIpcTransport
from .nixl import NixlTransport
from .shm import ShmTransport
from .verbs import VerbsTransport

TRANSPORTS: dict[str, type[Transport]] = {
    "cma": CmaTransport,
    "nixl": NixlTransport,
    "verbs": VerbsTransport,
    "cuda_ipc": CudaIpcTransport,
    "shm": ShmTransport,
}
"""Back ends known to :func:`make_transport`, by name."""


def make_transport(name: str, **kw) -> Transport:
    """Build the back end called ``name`` with keyword arguments ``kw``
    (``make_transport("cma", host=None)``). Raises ValueError naming an unknown transport
    and listing the known ones, and ImportError saying what to install when the back end's
    library is missing (``nixl``: NIXL; ``verbs``: pyverbs; ``cuda_ipc``: a CUDA torch)."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(TRANSPORTS)}") from None
    return cls(**kw)


__all__ = [
    "Batch",
    "BoundsError",
    "CompletedWrite",
    "CmaRegion",
    "CmaTransport",
    "CudaIpcTransport",
    "NixlTransport",
    "ShmTransport",
    "VerbsTransport",
    "PermissionDeniedError",
    "Region",
    "LeaseRequiredError",
    "LeaseTimeoutError",
    "RemoteGoneError",
    "StaleRegionError",
    "TRANSPORTS",
    "Transport",
    "TransportError",
    "UnknownRegionError",
    "WriteHandle",
    "WriteOp",
    "check_batch",
    "lease",
    "make_transport",
]
