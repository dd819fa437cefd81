"""The inference side of the public API (:mod:`weight_transfer.api`): :class:`Receiver`, for
any engine's named tensors -- register once, publish, read versions.

One receiver owns an inference rank at a time. Ownership is the store key :data:`OWNER_KEY`,
holding the owner's token ``host:pid:uuid4``, changed only with ``compare_set`` (TCPStore's
``compare_set(key, expected, desired)`` sets ``desired`` and returns it when the key holds
``expected`` -- or is missing and ``expected`` is ``""`` --, and otherwise returns the current
value, or ``expected`` itself for a missing key: checked with torch 2.13). A second receiver for
a rank whose owner lives is refused, unless ``replace=True``; an owner whose process is gone
(:func:`weight_transfer.control.membership.process_gone`) or that announced leaving is replaced freely
(an engine restarting, C24). A receiver that was replaced reads no version as complete."""
from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import torch

from ..args import check_bool, check_int, check_seconds, check_type
from ..control import clients, membership
from ..control import protocol as control
from ..control.store import RUNTIME_KEY, connect_store
from ..transport.views import span_view, storage_parts
from ..types import DestTensorMeta, RegionDescriptor, dtype_name

__all__ = ["Receiver", "span_view", "storage_parts", "OWNER_KEY"]

OWNER_KEY = "infer/owner/{rank}"
"""Store key: the token (``host:pid:uuid4``) of the :class:`Receiver` that owns inference rank
``rank``; ``left:{token}`` once that receiver closed (the rank is free)."""


def _holder(token: str) -> tuple[str, int]:
    """``(host, pid)`` of an owner token (``left:`` prefix or not)."""
    host, pid, _ = token.removeprefix("left:").rsplit(":", 2)
    return host, int(pid)


def _token_text(raw: bytes, key: str) -> str:
    """An owner token read from ``key``: ``[left:]host:pid:hex``; ControlError naming the key otherwise."""
    try:
        t = raw.decode()
        if t:
            _holder(t)
        return t
    except (UnicodeDecodeError, ValueError):
        raise control.ControlError(f"store key {key!r}: refused a value that is not an owner token") from None


def _take_ownership(store, rank: int, token: str, *, replace: bool) -> str | None:
    """Make ``token`` the owner of inference ``rank`` (atomically, ``compare_set``); returns the
    previous owner's token it replaced (a live one with ``replace``, one whose process is gone or
    that announced leaving), None when the rank was free. Raises ValueError naming the rank and
    the live owner (host, pid) when one holds it and ``replace`` is False."""
    key, expected = OWNER_KEY.format(rank=rank), ""
    for _ in range(1000):  # each round loses only to another receiver that changed the key meanwhile
        got = _token_text(store.compare_set(key, expected, token), key)
        if got == token:
            return None if expected.startswith("left:") or not expected else expected
        if got == expected:  # the key is missing (compare_set then answers ``expected``): take it as free
            expected = ""
            continue
        host, pid = _holder(got)
        if not (got.startswith("left:") or replace or store.check([f"infer/leave/{rank}"])
                or membership.process_gone(SimpleNamespace(host=host, pid=pid))):
            raise ValueError(f"Receiver: inference rank {rank} is already registered by a live receiver (host {host}, "
                             f"pid {pid}); close that one first, or pass replace=True to replace it")
        expected = got
    raise control.ControlError(f"Receiver: inference rank {rank}: ownership contended by other receivers")


class Receiver:
    """One inference rank's side, for any engine's named tensors: register their memory once,
    publish the region descriptor and the tensors' metadata, then read versions. Passive:
    nothing runs here per update, except, when the coordinator runs ``verify="sample"`` or
    ``"full"``, a thread that hashes the ranges it asks for (:mod:`weight_transfer.control.fingerprint`).

    ``tensors``: ``{inference-side name: tensor}`` -- the engine's parameters as it computes
    with them (contiguous, distinct, non-overlapping, on one device the transport registers:
    the CPU for ``cma``, a GPU for ``cuda_ipc``). One region spans them all, from the lowest
    ``data_ptr`` to the highest end, made of one part per allocation they live in
    (:func:`storage_parts`): writes are planned only into the tensors, and the transport
    refuses any write outside the region's parts. ``region`` / ``metas``: an arena the caller
    allocated (a tensor, or its parts: a list of tensors on one device, the region spanning
    them) and its tensors' :class:`~weight_transfer.types.DestTensorMeta` (offsets from the
    region's lowest byte).
    ``rank``: this inference rank; ``store``: see :func:`connect_store`; ``transport``: the
    back end's name (``cma``, ``verbs``, ``cuda_ipc``, ...); ``runtime``: a runtime layout to
    plan against instead of ``tensors``' own (see :mod:`weight_transfer.plan.retarget`); ``publish``:
    publish now (False: call :meth:`publish` later); ``timeout``: seconds (> 0) that connecting
    to the store, a store call and :meth:`wait_version` may take; ``replace``: take ``rank`` over
    from a live receiver that holds it (that one then reads no version: :meth:`state`).
    ``shadow``: ``"flip"`` or ``"copy"`` (None: off) -- shadow targets (C27,
    :mod:`weight_transfer.api.shadow`): the writes land in a shadow the engine does not compute
    with, and :meth:`go_live`, called between two engine steps once the coordinator asks for the
    commit (:meth:`serve_go_live` waits for that in a thread), makes them live; the engine keeps
    serving the last complete version meanwhile, and after a failed update. ``adopt``: with
    ``"flip"``, how the engine re-points its tensors at the live half: ``adopt(arena)`` for
    ``region=`` (an arena engine: one ``uint8`` tensor), ``adopt({name: tensor})`` for
    ``tensors=``; called once here and at each go-live.

    Raises, before anything is published: TypeError for a wrong type (``rank`` not an int -- a
    ``str`` from ``os.environ`` included --, ``timeout`` not a number, ``transport`` not a str,
    ``tensors`` not a mapping, ``region`` not a tensor, ``publish``/``replace`` not a bool);
    ValueError for ``rank`` < 0, ``timeout`` not > 0, no tensors, a tensor that is empty,
    non-contiguous or overlaps another (named), tensors on several devices, ``region=`` without
    ``metas=``, an unknown transport or one that cannot register the tensors' memory (the
    transport's own message: a CUDA tensor for ``cma``, several GPU allocations for a transport
    without :attr:`~weight_transfer.transport.base.Transport.parts_devices` ``cuda``), a
    malformed ``store`` address, and for ``rank`` already held by a live receiver
    (naming its host and pid) without ``replace=True``;
    :class:`weight_transfer.control.protocol.ControlError` naming ``host:port`` when no store answers
    within ``timeout`` seconds. ValueError for an unknown ``shadow`` mode, ``"flip"`` without
    ``adopt``, or ``shadow`` with a region of several parts."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None, *, rank: int, store,
                 transport: str = "cma", timeout: float = 600.0, runtime=None, publish: bool = True,
                 region: torch.Tensor | None = None, metas: list[DestTensorMeta] | None = None,
                 replace: bool = False, shadow: str | None = None, adopt: Callable | None = None):
        from ..transport import make_transport
        from .shadow import Shadow, check_mode

        w = "Receiver"  # every argument and tensor is checked before the store is reached
        rank, timeout = check_int(rank, "rank", where=w, lo=0), check_seconds(timeout, "timeout", where=w)
        check_type(transport, "transport", str, where=w)
        check_type(tensors, "tensors", Mapping, where=w, allow_none=True, what="a mapping name -> tensor")
        check_type(region, "region", (torch.Tensor, list, tuple), where=w, allow_none=True,
                   what="a tensor or a list of tensors (its parts)")
        check_bool(publish, "publish", where=w)
        check_bool(replace, "replace", where=w)
        self.rank, self.timeout, self._token = rank, timeout, None
        self.transport = None
        if region is not None:  # an arena the caller allocated, with its tensors' metadata
            if metas is None:
                raise ValueError("Receiver: region= needs metas=")
            self.metas, view = list(metas), region
        else:
            if not tensors:
                raise ValueError("Receiver: no tensors to register")
            self.metas, view = self._span(tensors)
        shadow = check_mode(shadow, where="Receiver")
        transport = make_transport(transport)  # ValueError naming an unknown transport
        self.shadow = None
        """The :class:`weight_transfer.api.shadow.Shadow` with ``shadow=``, else None."""
        self.live_version = -1
        """With shadow targets: the version the engine computes with (its last go-live)."""
        self._server = None
        self._fingerprints = None
        """The :class:`weight_transfer.control.fingerprint.FingerprintServer` answering the coordinator's
        fingerprint requests (``verify=``; its thread ends at once when the plan has it off)."""
        if shadow is not None:
            alloc = transport.allocate if getattr(transport, "publishes_allocated_only", False) else None
            try:
                if region is not None:
                    if not isinstance(region, torch.Tensor):
                        raise ValueError("Receiver: shadow= with a region of several parts; pass one arena tensor "
                                         "or tensors=")
                    self.shadow = Shadow.of_arena(shadow, region, self.metas, allocate=alloc, adopt=adopt)
                else:
                    self.shadow = Shadow.of_tensors(shadow, tensors, rank=rank, allocate=alloc, adopt=adopt)
                    self.metas = self.shadow.metas
            except BaseException:
                transport.close()
                raise
            view = self.shadow.region
        try:
            self.store = connect_store(store, timeout=timeout)
            token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex}"
            self.replaced = _take_ownership(self.store, rank, token, replace=replace)
            """The token (``host:pid:uuid4``) of the previous owner this one replaced (alive with
            ``replace=True``, or gone), None when the rank was free."""
            self._token = token
            self.region = transport.register(view) if isinstance(view, torch.Tensor) else transport.register_parts(view)
        except BaseException:
            try:
                if self._token is not None:  # registering failed: the rank is free again
                    self._release()
            finally:
                transport.close()
            raise
        self.transport = transport
        self.runtime = runtime
        if self.shadow is not None:  # before the metadata: the plan reads it (also when the caller publishes)
            control.put(self.store, control.SHADOW_KEY.format(rank=self.rank), self.shadow.info())
        self.client = clients.InferenceClient(self.store, rank, timeout=timeout)
        from ..control.fingerprint import FingerprintServer, region_bytes

        self._fingerprints = FingerprintServer(self.store, self.rank, lambda off, n: region_bytes(self.region, off, n))
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
        devs = {str(t.device) for *_, t in spans}
        if len(devs) != 1:
            raise ValueError(f"Receiver: tensors on several devices {sorted(devs)}; one region per device")
        metas = [DestTensorMeta(rank=self.rank, name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype),
                                offset=a - base, nbytes=n) for a, n, name, t in spans]
        parts = storage_parts(t for *_, t in spans)  # one per allocation; the region spans them
        return metas, parts[0] if len(parts) == 1 else parts

    def _owner(self) -> str | None:
        """The token of the receiver that replaced this one; None while this one owns its rank
        (or released it by :meth:`close`)."""
        key = OWNER_KEY.format(rank=self.rank)
        cur = _token_text(self.store.get(key), key) if self.store.check([key]) else ""
        return None if cur in ("", self._token, f"left:{self._token}") else cur

    def _release(self) -> None:
        """Give the rank up (``left:{token}``), unless another receiver owns it by now."""
        self.store.compare_set(OWNER_KEY.format(rank=self.rank), self._token, f"left:{self._token}")

    def _check_owner(self) -> None:
        """Raise ControlError naming the replacement (host, pid) once another receiver took this rank."""
        by = self._owner()
        if by is not None:
            host, pid = _holder(by)
            raise control.ControlError(f"Receiver: inference rank {self.rank} was taken over by another receiver "
                                       f"(host {host}, pid {pid}); this one reads no version")

    def _owned_state(self) -> control.WeightsState:
        """:meth:`state`, raising ControlError once this receiver was replaced (:meth:`_check_owner`)."""
        self._check_owner()
        return self.state()

    def publish(self) -> None:
        """Publish ``(descriptor, metas)`` under ``meta/infer/{rank}`` (and the runtime layout,
        when one was given), once; the coordinator plans against it. Raises ControlError when
        this receiver was replaced meanwhile (the rank is another's)."""
        self._check_owner()
        if self.runtime is not None:
            from ..control.wire import tag

            control.put(self.store, RUNTIME_KEY.format(rank=self.rank), tag(self.runtime))
        self.client.publish_meta(self.descriptor, self.metas)
        membership.announce_join(self.store, self.rank)  # a rank that joins later is planned in before its first go

    @property
    def fingerprint_server(self):
        """The :class:`weight_transfer.control.fingerprint.FingerprintServer` answering this rank's
        fingerprint requests (None once closed)."""
        return self._fingerprints

    @property
    def descriptor(self) -> RegionDescriptor:
        """The registered region's descriptor (host, address, length, key, epoch)."""
        return self.region.descriptor()

    def state(self) -> control.WeightsState:
        """The published :class:`weight_transfer.control.protocol.WeightsState` (``writing``, ``complete``,
        ``incomplete`` with the version and a sequence number) as this rank holds it: ``none``
        while the rank is not in the plan or the published version predates the first update
        that included it (a rank that joined later never reads a version it did not receive,
        C24), and for good once another receiver replaced this one (``replace=True``)."""
        s = self.client.state()
        if self._owner() is not None:
            return control.WeightsState(s.seq, "none", -1)
        since = membership.member_since(self.store, self.rank)
        if since is None and not self.store.check(["meta/world"]):
            return s  # no Coordinator keeps the membership (e.g. the harness's own controller): the global state
        if since is None or s.version < since:
            return control.WeightsState(s.seq, "none", -1)
        return s

    def version(self) -> int | None:
        """The complete version these tensors hold; -1 before this rank's first update; None
        while one is written or after a failed one. With shadow targets: the version of the
        last go-live (-1 before the first), whatever is being written."""
        if self.shadow is not None:
            return self.live_version
        s = self.state()
        return s.version if s.state in ("complete", "none") else None

    def wait_version(self, version: int, *, timeout: float | None = None) -> control.WeightsState:
        """Block until this rank holds ``complete version`` and return that state. Raises
        VersionError when ``version`` was skipped (a later one is written or complete),
        ControlError when the update to it failed, on shutdown, after ``timeout`` seconds
        (default: the receiver's), or when another receiver replaced this one (naming it)."""
        timeout = self.timeout if timeout is None else check_seconds(timeout, "timeout", where="Receiver.wait_version")
        return self.client.wait_version(version, timeout=timeout, state=self._owned_state)

    def read_consistent(self, read: Callable[[], Any], *, wait: bool = True, timeout: float = 30.0):
        """``(state, read())`` where no write happened during ``read`` and ``state`` is
        complete (a seqlock over the published state: :func:`weight_transfer.control.protocol.read_consistent`).
        Raises :class:`weight_transfer.control.protocol.UpdateInProgress` when no complete version can be
        read (at once with ``wait=False``, after ``timeout`` seconds otherwise), ControlError
        naming the replacement when another receiver replaced this one."""
        return control.read_consistent(self._owned_state, read, wait=wait, timeout=timeout)

    # ------------------------------------------------------------------ shadow targets (C27)
    def go_live(self, version: int, then: Callable[[int, dict], None] | None = None) -> dict:
        """Make version ``version``, written into the shadow, the live one (call between two
        engine steps, once the coordinator asked for the commit: :meth:`commit_requested`),
        call ``then(version, stats)`` (e.g. the engine's version label, in the same window), and
        report it committed. Returns :meth:`weight_transfer.api.shadow.Shadow.go_live`'s stats
        (``{"mode", "seconds", "bytes"}``). RuntimeError without shadow targets; an exception
        of the go-live or of ``then`` is reported as this rank's failed commit and raised."""
        if self.shadow is None:
            raise RuntimeError(f"Receiver (inference rank {self.rank}): go_live without shadow targets")
        try:
            stats = self.shadow.go_live()
            self.live_version = int(version)
            if then is not None:
                then(int(version), stats)
            control.put(self.store, control.SHADOW_KEY.format(rank=self.rank), self.shadow.info())
        except BaseException as e:
            self.client.committed(version, ok=False, error=f"go-live failed: {type(e).__name__}: {e}")
            raise
        self.client.committed(version, ok=True, stats=stats)
        return stats

    def commit_requested(self) -> int | None:
        """The version whose go-live the coordinator asks for now (every write of it completed),
        if it is above :attr:`live_version`; else None."""
        key = "weights/shadow"
        if not self.store.check([key]):
            return None
        v = control.get_int(self.store, key)
        return v if v > self.live_version and self.store.check([f"step/{v}/commit"]) else None

    def serve_go_live(self, lock=None, on_live: Callable[[int, dict], None] | None = None, poll: float = 0.002):
        """Start a thread that waits for each commit request and runs :meth:`go_live` holding
        ``lock`` (the engine holds it around each step, so the go-live falls between two steps),
        then ``on_live(version, stats)`` still holding it (the engine changes its version label
        in the same window). Returns the :class:`weight_transfer.api.shadow.GoLiveServer` (stopped by
        :meth:`close`)."""
        from .shadow import GoLiveServer

        if self._server is None:
            self._server = GoLiveServer(self, lock, on_live, poll=poll)
        return self._server

    def close(self) -> None:
        """Announce leaving (the coordinator plans without this rank from its next update) and
        give the rank up (another receiver may register it), deregister the region (waits for
        any sender's batch in flight, C17) and release the transport. A receiver that was
        replaced announces nothing: the rank is its replacement's."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        if self._fingerprints is not None:
            self._fingerprints.stop()
            self._fingerprints = None
        if self.transport is not None:
            try:
                if self._owner() is None:
                    membership.announce_leave(self.store, self.rank)
                    self._release()
            except Exception:  # the store may be gone at the end of a job
                pass
            self.transport.close()
            self.transport = None
