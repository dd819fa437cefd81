"""The inference side of the public API (:mod:`weight_transfer.api`): :class:`Receiver`, for
any engine's named tensors -- register once, publish, read versions."""
from __future__ import annotations

import ctypes
from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import clients, control, membership
from .store import RUNTIME_KEY, connect_store
from .types import DestTensorMeta, RegionDescriptor, dtype_name

__all__ = ["Receiver", "span_view"]


def span_view(base: int, length: int) -> torch.Tensor:
    """A ``uint8`` CPU tensor viewing ``[base, base + length)`` of this process's memory in
    place (no copy; the caller keeps the memory alive)."""
    import numpy as np

    buf = (ctypes.c_uint8 * length).from_address(base)
    view = torch.from_numpy(np.ctypeslib.as_array(buf))
    view._wt_buffer = buf  # type: ignore[attr-defined] -- keep the ctypes object alive with the view
    return view


class Receiver:
    """One inference rank's side, for any engine's named tensors: register their memory once,
    publish the region descriptor and the tensors' metadata, then read versions. Passive:
    nothing runs here per update.

    ``tensors``: ``{inference-side name: tensor}`` -- the engine's parameters as it computes
    with them (contiguous, distinct, non-overlapping; on the CPU for the ``cma`` transport).
    One region spans them all, from the lowest ``data_ptr`` to the highest end: writes are
    planned only into the tensors, and the transport refuses any write outside the region.
    ``rank``: this inference rank; ``store``: see :func:`connect_store`; ``transport``: the
    back end's name (``cma``, ``verbs``, ``cuda_ipc``, ...); ``runtime``: a runtime layout to
    plan against instead of ``tensors``' own (see :mod:`weight_transfer.retarget`); ``publish``:
    publish now (False: call :meth:`publish` later).

    Raises ValueError naming the tensor that is empty, non-contiguous or overlaps another."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None, *, rank: int, store,
                 transport: str = "cma", timeout: float = 600.0, runtime=None, publish: bool = True,
                 region: torch.Tensor | None = None, metas: list[DestTensorMeta] | None = None):
        from .transport import make_transport

        self.rank, self.timeout = rank, timeout
        if region is not None:  # an arena the caller allocated, with its tensors' metadata
            if metas is None:
                raise ValueError("Receiver: region= needs metas=")
            self.metas, view = list(metas), region
        else:
            if not tensors:
                raise ValueError("Receiver: no tensors to register")
            self.metas, view = self._span(tensors)
        self.transport = make_transport(transport)
        self.region = self.transport.register(view)
        self.runtime = runtime
        self.store = connect_store(store, timeout=max(timeout, 600.0))
        self.client = clients.InferenceClient(self.store, rank, timeout=max(timeout, 600.0))
        if publish:
            self.publish()

    @classmethod
    def from_arena(cls, arena: torch.Tensor, metas: list[DestTensorMeta], **kw) -> Receiver:
        """A receiver for an engine whose tensors are views into one ``uint8`` ``arena``
        (``metas``: their :class:`weight_transfer.types.DestTensorMeta`, offsets into it), e.g.
        :class:`weight_transfer.engines.Engine`."""
        return cls(region=arena, metas=metas, **kw)

    def _span(self, tensors: Mapping[str, torch.Tensor]) -> tuple[list[DestTensorMeta], torch.Tensor]:
        spans = []
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.numel() == 0:
                raise ValueError(f"Receiver: {name!r} is empty or not a tensor")
            if not t.is_contiguous():
                raise ValueError(f"Receiver: {name!r} is not contiguous (stride {tuple(t.stride())}); "
                                 "one-sided writes need its bytes in one run")
            spans.append((t.data_ptr(), t.numel() * t.element_size(), name, t))
        spans.sort(key=lambda s: s[0])
        for (a, n, na, _), (b, _, nb, _) in zip(spans, spans[1:]):
            if a + n > b:
                raise ValueError(f"Receiver: tensors {na!r} and {nb!r} overlap; refusing to register aliased memory")
        base = spans[0][0]
        length = max(a + n for a, n, _, _ in spans) - base
        devs = {str(t.device) for *_, t in spans}
        if len(devs) != 1:
            raise ValueError(f"Receiver: tensors on several devices {sorted(devs)}; one region per device")
        metas = [DestTensorMeta(rank=self.rank, name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype),
                                offset=a - base, nbytes=n) for a, n, name, t in spans]
        storages = {t.untyped_storage().data_ptr() for *_, t in spans}
        if len(storages) == 1:  # one allocation: view its bytes (keeps the storage alive)
            t0 = spans[0][3]
            st = t0.untyped_storage()
            whole = torch.empty(0, dtype=torch.uint8, device=t0.device).set_(st, 0, (st.nbytes(),), (1,))
            start = base - st.data_ptr()
            return metas, whole[start:start + length]
        if devs != {"cpu"}:
            raise ValueError("Receiver: tensors in several allocations must be on the CPU (one address span)")
        self._keep = [t for *_, t in spans]  # the span view does not own the memory
        return metas, span_view(base, length)

    def publish(self) -> None:
        """Publish ``(descriptor, metas)`` under ``meta/infer/{rank}`` (and the runtime layout,
        when one was given), once; the coordinator plans against it."""
        if self.runtime is not None:
            control.put(self.store, RUNTIME_KEY.format(rank=self.rank), self.runtime)
        self.client.publish_meta(self.descriptor, self.metas)
        membership.announce_join(self.store, self.rank)  # a rank that joins later is planned in before its first go

    @property
    def descriptor(self) -> RegionDescriptor:
        """The registered region's descriptor (host, address, length, key, epoch)."""
        return self.region.descriptor()

    def state(self) -> control.WeightsState:
        """The published :class:`weight_transfer.control.WeightsState` (``writing``, ``complete``,
        ``incomplete`` with the version and a sequence number) as this rank holds it: ``none``
        while the rank is not in the plan or the published version predates the first update
        that included it (a rank that joined later never reads a version it did not receive,
        C24)."""
        s = self.client.state()
        since = membership.member_since(self.store, self.rank)
        if since is None and not self.store.check(["meta/world"]):
            return s  # no Coordinator keeps the membership (e.g. the harness's own controller): the global state
        if since is None or s.version < since:
            return control.WeightsState(s.seq, "none", -1)
        return s

    def version(self) -> int | None:
        """The complete version these tensors hold; -1 before this rank's first update; None
        while one is written or after a failed one."""
        s = self.state()
        return s.version if s.state in ("complete", "none") else None

    def wait_version(self, version: int, *, timeout: float | None = None) -> control.WeightsState:
        """Block until this rank holds ``complete version`` and return that state. Raises
        VersionError when ``version`` was skipped (a later one is written or complete),
        ControlError when the update to it failed, on shutdown, or after ``timeout`` seconds
        (default: the receiver's)."""
        return self.client.wait_version(version, timeout=self.timeout if timeout is None else timeout, state=self.state)

    def read_consistent(self, read: Callable[[], Any], *, wait: bool = True, timeout: float = 30.0):
        """``(state, read())`` where no write happened during ``read`` and ``state`` is
        complete (a seqlock over the published state: :func:`weight_transfer.control.read_consistent`).
        Raises :class:`weight_transfer.control.UpdateInProgress` when no complete version can be
        read (at once with ``wait=False``, after ``timeout`` seconds otherwise)."""
        return control.read_consistent(self.state, read, wait=wait, timeout=timeout)

    def close(self) -> None:
        """Announce leaving (the coordinator plans without this rank from its next update),
        deregister the region (waits for any sender's batch in flight, C17) and release the
        transport."""
        if self.transport is not None:
            try:
                membership.announce_leave(self.store, self.rank)
            except Exception:  # the store may be gone at the end of a job
                pass
            self.transport.close()
            self.transport = None
