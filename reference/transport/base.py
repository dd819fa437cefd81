"""The data-plane interface: register -> descriptor -> write -> completion.

Every back end (cross-memory attach, pyverbs RDMA WRITE, CUDA IPC, NIXL) implements
:class:`Transport`. The receiving side only calls :meth:`Transport.register` once and publishes
``region.descriptor()``; it runs no code per step. The sending side calls
:meth:`Transport.connect` with the descriptors it got from the control plane (once), then posts
batches of :class:`WriteOp` with :meth:`Transport.write` and waits on the returned
:class:`WriteHandle`.

Safety rules every back end enforces *before any byte of a batch is issued*:

- the remote descriptor was connected (same ``key``; a descriptor from another run, or one the
  receiver deregistered, is refused);
- ``remote_offset + length`` lies inside the remote region, ``local_offset + length`` inside the
  local region, offsets and lengths are >= 0;
- the local region is still registered.

Violations raise :class:`TransportError` (or a subclass) naming the op, the region and the bounds.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import torch

from ..types import RegionDescriptor


class TransportError(RuntimeError):
    """A write was refused or failed. The message names the op, the regions and the cause."""


class BoundsError(TransportError):
    """A write would leave its local or remote region; nothing of the batch was issued."""


class UnknownRegionError(TransportError):
    """A write names a remote descriptor that was never connected (or a stale key), or a local
    region that was deregistered; nothing of the batch was issued."""


class RemoteGoneError(TransportError):
    """The receiving process no longer exists (CMA: ``ESRCH``)."""


class PermissionDeniedError(TransportError):
    """The kernel refused access to the remote memory (CMA: ``EPERM``); see the message for the
    ptrace / capability requirement."""


@dataclass(frozen=True, slots=True)
class WriteOp:
    """Copy ``length`` bytes from ``local`` at ``local_offset`` to ``remote`` at ``remote_offset``
    (all in bytes)."""

    local: "Region"
    local_offset: int
    remote: RegionDescriptor
    remote_offset: int
    length: int


class Region(abc.ABC):
    """A registered local memory range (the memory region, MR)."""

    @property
    @abc.abstractmethod
    def addr(self) -> int: ...

    @property
    @abc.abstractmethod
    def length(self) -> int: ...

    @abc.abstractmethod
    def descriptor(self) -> RegionDescriptor:
        """Serializable descriptor another process needs to write here."""


class WriteHandle(abc.ABC):
    """Completion of one posted batch."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> int:
        """Block until every write of the batch completed; return bytes written. Raises
        :class:`TransportError` on failure or ``TimeoutError`` after ``timeout`` seconds."""

    @abc.abstractmethod
    def done(self) -> bool: ...


class Transport(abc.ABC):
    """One process's endpoint of a data plane."""

    name: str = "?"

    @abc.abstractmethod
    def register(self, tensor: torch.Tensor) -> Region:
        """Register a contiguous tensor's memory; the tensor must outlive the region."""

    @abc.abstractmethod
    def deregister(self, region: Region) -> None: ...

    @abc.abstractmethod
    def connect(self, descriptors: Sequence[RegionDescriptor]) -> None:
        """Accept remote regions as write targets (once, from the control plane)."""

    @abc.abstractmethod
    def write(self, ops: Sequence[WriteOp]) -> WriteHandle:
        """Check every op (see module docstring), then post them all; return the completion."""

    def close(self) -> None:
        """Release every registration and connection."""
