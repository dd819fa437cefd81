"""Data plane: the :class:`Transport` interface and its back ends.

``make_transport("cma")`` builds a back end by name; see :mod:`.base` for the interface and
the safety rules every back end enforces, and :mod:`.cma` for cross-memory attach (one-sided
``process_vm_writev`` writes between processes of one host).
"""
from __future__ import annotations

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
from .cma import CmaRegion, CmaTransport

TRANSPORTS: dict[str, type[Transport]] = {"cma": CmaTransport}
"""Back ends known to :func:`make_transport`, by name."""


def make_transport(name: str, **kw) -> Transport:
    """Build the back end called ``name`` with keyword arguments ``kw``
    (``make_transport("cma", host=None)``). Raises ValueError naming an unknown transport
    and listing the known ones."""
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {sorted(TRANSPORTS)}") from None
    return cls(**kw)


__all__ = [
    "BoundsError",
    "CmaRegion",
    "CmaTransport",
    "PermissionDeniedError",
    "Region",
    "RemoteGoneError",
    "TRANSPORTS",
    "Transport",
    "TransportError",
    "UnknownRegionError",
    "WriteHandle",
    "WriteOp",
    "make_transport",
]
