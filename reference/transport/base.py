"""The data-plane contract: register -> descriptor -> connect -> write -> completion.

Every back end (cross-memory attach, pyverbs RDMA WRITE, CUDA IPC, NIXL) is a
:class:`Transport`. The shape follows pplx-garden's fabric-lib: the receiving side calls
:meth:`Transport.register` once and publishes ``region.descriptor()``; it runs no code per step.
The sending side calls :meth:`Transport.connect` with the descriptors it got from the control
plane (once), then posts batches of :class:`WriteOp` with :meth:`Transport.write` and waits on
the returned :class:`WriteHandle`.

What lives here, written once for every back end
------------------------------------------------
- :class:`Region`, the one region type (a registered tensor, its address and length in bytes,
  the back end's native handle, and its descriptor);
- the tensor checks of :meth:`Transport.register` (a contiguous tensor of >= 1 byte; the back
  end adds its device check), the descriptor checks of :meth:`Transport.connect` (type,
  transport name, address and length > 0; the back end adds its own), the bookkeeping of
  registered and connected regions, :meth:`Transport.deregister` and :meth:`Transport.close`;
- the op checks of :meth:`Transport.write` (:func:`check_batch`, with :class:`WriteOp`,
  :class:`Segments` and the errors in :mod:`.ops`, re-exported here), which run *before any byte of
  a batch is issued*:

  - the local region is registered with this transport (not deregistered, not another
    transport's) -> :class:`UnknownRegionError`;
  - the remote descriptor was connected and equals the connected one (same key, length and
    back-end fields; a descriptor from another run, or one the receiver re-registered, is
    refused) -> :class:`UnknownRegionError`;
  - offsets and lengths are >= 0, ``local_offset + length`` lies inside the local region and
    ``remote_offset + length`` inside the remote one -> :class:`BoundsError`; an op with
    :class:`Segments` (one write gathered from several local pieces) holds ``length`` bytes
    and every segment lies inside the local region; into a remote region of several
    allocations (:meth:`Transport.register_parts`: its descriptor's ``extra["parts"]``) every op
    lies inside one of them -> :class:`BoundsError`.

  One bad op refuses the whole batch: nothing of it is posted. Zero-length ops are skipped.
- the epoch check (:meth:`Transport.check_epochs`, field case C17): every descriptor carries
  its registration's epoch; its owner publishes the epoch while the region is registered and
  revokes it in ``deregister``; before each batch the owner's *published* epoch of every remote
  region is read (the back end's ``_published_epochs``: CMA and CUDA IPC with
  ``process_vm_readv``, NIXL with a READ; verbs leaves it to the NIC, which refuses the rkey of
  a closed MR) and a region whose epoch differs is refused -> :class:`StaleRegionError`, before
  any byte moves. ``deregister`` releases memory only after every sender holding a lease there
  left the batch it was in (:mod:`.lease`: the protocol and its race window).
- the lease (:mod:`.lease`): ``connect`` takes one at every receiving transport through the
  descriptor's own lease channel (nothing for the caller to do); ``write`` refuses a batch to a
  receiver where it holds none (:class:`LeaseRequiredError`) and holds it from before the epoch
  check until the bytes were copied. Verbs (``revocation = "nic"``) needs none.

Memory a receiver publishes
---------------------------
:meth:`Transport.allocate` returns a flat ``uint8`` tensor of memory this back end can register
*and publish*. For most back ends any tensor on a device they handle can be published (the
default allocates with ``torch.empty``), so an engine may register the tensors it already has.
A back end that can only publish memory it allocated itself says so with
``publishes_allocated_only = True`` (``shm``: a shared segment the senders map; an arbitrary
tensor of the receiver's heap cannot be mapped by another process): a receiver (an engine's
arena, a staging buffer) must then allocate through :meth:`Transport.allocate` and register a
view of it, and ``descriptor()`` of any other region raises ValueError saying so. Senders
register any tensor as a *local* source region on every back end (their memory is only read).

An engine whose tensors are several allocations that no one tensor spans (a CUDA module's
parameters: one caching-allocator block each) registers them as one region of several parts
(:meth:`Transport.register_parts`): one descriptor per receiver as before, offsets counted from
the lowest part, every write held inside one part (:attr:`Transport.parts_devices` says where a
back end can).

What a back end implements (the hooks, all prefixed ``_``): ``_check_device`` (which tensors it
registers), ``_register`` / ``_deregister`` (native registration), ``_describe`` (the
descriptor's key and ``extra``), ``_check_descriptor`` / ``_connect`` / ``_disconnect``
(opening remote regions), ``_remote_key`` (how a descriptor is looked up), ``_group_key`` (how
the checked ops are batched) and ``_post`` (issue one checked :class:`Batch`, return its
:class:`WriteHandle`). Posting and waiting are the only back-end-specific parts of a write.
"""
from __future__ import annotations

import abc
import os
import socket
import time
from collections.abc import Hashable, Sequence

import torch

from ..types import RegionDescriptor
from . import lease
from .ops import (  # noqa: F401  (re-exported: the contract's names stay importable from base)
    Batch,
    BoundsError,
    Group,
    LeaseRequiredError,
    LeaseTimeoutError,
    PermissionDeniedError,
    Region,
    RemoteGoneError,
    Segments,
    StaleRegionError,
    TransportError,
    UnknownRegionError,
    WriteOp,
    _bounds_msg,
    _unknown_msg,
    check_batch,
    describe_remote,
    parts_bounds,
)

__all__ = [
    "Batch", "BoundsError", "CompletedWrite", "Group", "PermissionDeniedError", "Region", "RemoteGoneError", "Segments",
    "Transport", "TransportError", "UnknownRegionError", "WriteHandle", "WriteOp", "check_batch",
    "describe_remote", "LeaseRequiredError", "LeaseTimeoutError", "StaleRegionError",
]


class WriteHandle(abc.ABC):
    """Completion of one posted batch. A back end implements :meth:`done` (poll once) and may
    refine the waiting through ``_idle`` (between polls), ``_raise_failure`` (after the last
    poll) and ``_timeout_message``."""

    nbytes: int = 0
    """Bytes of the batch."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Poll once; True when no write of the batch is in flight any more."""

    def wait(self, timeout: float | None = None) -> int:
        """Block until every write of the batch completed; return bytes written. Raises
        :class:`TransportError` on failure or ``TimeoutError`` after ``timeout`` seconds."""
        t0 = time.monotonic()
        while not self.done():
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise TimeoutError(self._timeout_message(timeout))
            self._idle()
        self._raise_failure()
        return self.nbytes

    def _idle(self) -> None:
        """Between two polls of :meth:`wait` (default: poll again at once)."""

    def _raise_failure(self) -> None:
        """Raise :class:`TransportError` when a write of the finished batch failed."""

    def _timeout_message(self, timeout: float) -> str:
        return f"{type(self).__name__}: batch not complete after {timeout} s"


WriteHandle.register(lease.LeasedHandle)

class CompletedWrite(WriteHandle):
    """A batch that was complete when :meth:`Transport.write` returned (CMA is synchronous; an
    all-empty batch moves nothing). ``wait`` returns ``nbytes`` at once."""

    __slots__ = ("nbytes",)

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def wait(self, timeout: float | None = None) -> int:
        return self.nbytes

    def done(self) -> bool:
        return True


# ---------------------------------------------------------------------------------------------
# the transport


class Transport(abc.ABC):
    """One process's endpoint of a data plane (``host``: ``socket.gethostname()``). Not thread-safe."""

    name: str = "?"
    revocation: str = "lease"
    """How ``deregister`` stops writes: ``"lease"`` (epoch check + lease; none: refused) or ``"nic"``."""
    segment_arrays: bool = False
    """True when :meth:`_post` takes the pieces of :class:`Segments` ops as numpy arrays
    (:attr:`Group.chunks`, :meth:`Group.arrays`) rather than one list entry per segment."""
    publishes_allocated_only: bool = False
    """True when only memory from :meth:`allocate` can be published (its ``descriptor()``); see
    "Memory a receiver publishes" in the module docstring."""
    parts_devices: tuple[str, ...] = ("cpu",)
    """Device types on which :meth:`register_parts` registers several allocations as one region.
    Host memory is one address space: a back end whose registration is an address range (CMA,
    shm, verbs) registers the parts' span, and the op checks hold every write to the parts. A
    back end that opens each allocation itself (CUDA IPC: one IPC handle per allocation; NIXL:
    one registration entry per part) can list ``"cuda"``."""

    @classmethod
    def allocate(cls, nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
        """A flat ``uint8`` tensor of ``nbytes`` bytes (>= 1) on ``device`` that this back end can
        register and publish: what a receiver's engine allocates its arena (or staging buffers)
        with, and the executor its output pool. The default is ``torch.empty`` (any memory can be
        published); back ends with ``publishes_allocated_only`` return their own (shared) memory.
        Its contents are undefined. ValueError for ``nbytes < 1`` or a device the back end
        cannot publish from."""
        if nbytes < 1:
            raise ValueError(f"{cls.__name__}.allocate: nbytes={nbytes}, need >= 1")
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def __init__(self, host: str | None = None):
        self.host = host if host is not None else socket.gethostname()
        self.pid = os.getpid()
        self._local: dict[int, Region] = {}  # id(region) -> region
        self._remote: dict[Hashable, RegionDescriptor] = {}  # _remote_key(desc) -> desc
        self._parted: dict[Hashable, tuple[list[int], list[int]]] = {}  # key -> parts of a remote region of several
        self._epochs = None  # EpochTable, made on the first published descriptor
        self._leases: dict = {}  # receiver's table id -> lease.HostLease, or lease.LeaseUnavailable
        self.lease_timeout = 30.0
        """Seconds ``deregister`` waits for senders inside a batch (:mod:`.lease`)."""
        self._held: list[torch.Tensor] = []  # memory not released after a lease timeout

    # ---- registration -----------------------------------------------------------------------
    def register(self, tensor: torch.Tensor) -> Region:
        """Register a contiguous tensor of >= 1 byte on a device this back end handles; the
        tensor must outlive the region (the region references it) and keep its storage.
        ValueError naming the shape, stride or device otherwise."""
        self._check_tensor(tensor, f"{type(self).__name__}.register")
        region = Region(self, tensor)
        region.native = self._register(region)
        self._local[id(region)] = region
        return region

    def _check_tensor(self, tensor, who: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{who} needs a torch.Tensor, got {type(tensor).__name__}")
        self._check_device(tensor)
        if not tensor.is_contiguous():
            raise ValueError(
                f"{who} needs a contiguous tensor (shape {tuple(tensor.shape)}, stride {tensor.stride()}); "
                "register the base buffer or .contiguous() it"
            )
        if tensor.nbytes == 0:
            raise ValueError(
                f"{who} refuses a zero-byte tensor (shape {tuple(tensor.shape)}): a region must be at "
                "least one byte; skip empty shards"
            )

    def register_parts(self, parts: Sequence[torch.Tensor]) -> Region:
        """Register several tensors of one device -- separate allocations, e.g. the storages of
        a CUDA module's parameters, which no one tensor can span -- as **one** region: it spans
        the lowest part's first byte to the highest part's last (``addr``, ``length``; a plan's
        offsets count from ``addr`` as for a region of one tensor), but only the parts are its
        memory: ``region.parts`` lists them as ``(offset, length)``, the descriptor carries them
        (``extra["parts"]``) and every write must lie inside one part, checked with the other op
        checks before any byte of a batch moves (:class:`BoundsError`). One part: :meth:`register`
        of it. For a receiver's memory (a sender's local regions are single tensors).

        ValueError for no parts, a part :meth:`register` would refuse (device, not contiguous,
        empty), parts on several devices or overlapping, or a device on which this back end does
        not register several allocations (:attr:`parts_devices`)."""
        who = f"{type(self).__name__}.register_parts"
        if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence) or not parts:
            raise ValueError(f"{who} needs a non-empty sequence of tensors, got {type(parts).__name__}")
        devs = sorted({str(p.device) for p in parts if isinstance(p, torch.Tensor)})
        if len(devs) > 1:
            raise ValueError(f"{who}: parts on several devices {devs}; one region is on one device")
        for p in parts:
            self._check_tensor(p, who)
        if len(parts) == 1:
            return self.register(parts[0])
        if parts[0].device.type not in self.parts_devices:
            raise ValueError(f"{who}: the {self.name} transport does not register several allocations on "
                             f"{devs[0]} as one region (it does on: {', '.join(self.parts_devices) or 'none'})")
        ordered = sorted(parts, key=lambda p: p.data_ptr())
        for a, b in zip(ordered, ordered[1:]):
            if a.data_ptr() + a.nbytes > b.data_ptr():
                raise ValueError(f"{who}: parts {a.data_ptr():#x}+{a.nbytes} and {b.data_ptr():#x}+{b.nbytes} overlap")
        region = Region(self, ordered[0])
        lo = region.addr
        region.length = max(p.data_ptr() + p.nbytes for p in ordered) - lo
        region.parts = tuple((p.data_ptr() - lo, p.nbytes) for p in ordered)
        region._parts = tuple(ordered)
        region.native = self._register(region)
        self._local[id(region)] = region
        return region

    def deregister(self, region: Region) -> None:
        """Forget a local region (and release its native registration); later writes from it
        raise :class:`UnknownRegionError`. Idempotent.

        A published region (its descriptor was built) is revoked first: its epoch becomes 0,
        so every later write with its descriptor, from any sender, is refused; then this waits
        until every sender holding a lease here has left the batch it was in (:mod:`.lease`);
        only then is the memory released. Raises :class:`LeaseTimeoutError` naming the senders
        still inside a batch after ``lease_timeout`` seconds; the memory then stays referenced
        by this transport (never released under a possible writer)."""
        if self._local.pop(id(region), None) is None:
            return
        if region._slot is not None:
            table = self._epochs
            table.revoke(region._slot)
            stuck = table.await_senders(self.lease_timeout)
            if stuck:
                self._held.append(region._parts or region._tensor)
                region._tensor = region._parts = None
                raise LeaseTimeoutError(
                    f"deregister: {region!r} revoked, but senders (pid, seq) {stuck} are still inside a "
                    f"batch that started before the revocation after {self.lease_timeout} s; the memory "
                    "stays held by this transport (not released)"
                )
            table.release(region._slot)
        try:
            self._deregister(region)
        finally:
            region._tensor = region._parts = None

    def connect(self, descriptors: Sequence[RegionDescriptor]) -> None:
        """Accept remote regions as write targets (once, from the control plane). Every
        descriptor is checked before any is accepted: ValueError for another transport or a
        malformed descriptor (and the back end's own checks). A newer registration of a connected
        region replaces it. Takes this sender's lease at each receiving transport (:mod:`.lease`)."""
        for d in descriptors:
            if not isinstance(d, RegionDescriptor):
                raise ValueError(f"connect: expected RegionDescriptor, got {type(d).__name__}")
            if d.transport != self.name:
                raise ValueError(
                    f"connect: descriptor {describe_remote(d)} is for transport {d.transport!r}, not {self.name!r}"
                )
            self._check_descriptor(d)
            if d.addr <= 0 or d.length <= 0:
                raise ValueError(f"connect: malformed descriptor {d}")
        parts = [parts_bounds(d) for d in descriptors]  # ValueError for malformed parts, before any is accepted
        for d, pb in zip(descriptors, parts):
            k = self._connect(d)
            self._remote[k] = d
            if pb is None:
                self._parted.pop(k, None)
            else:
                self._parted[k] = pb
            if self.revocation == "lease":
                lease.take(self, d)

    def close(self) -> None:
        """Release every registration, lease and connection."""
        for r in list(self._local.values()):
            self.deregister(r)
        lease.release_all(self)
        self._disconnect()
        self._remote.clear()
        self._parted.clear()

    # ---- data path --------------------------------------------------------------------------
    def check(self, ops: Sequence[WriteOp]) -> Batch:
        """The checks of :meth:`write` alone (:func:`check_batch` over this transport's regions)."""
        return check_batch(ops, self._local, self._remote, self._remote_key, self._group_key, self.segment_arrays,
                           self._parted)

    def write(self, ops: Sequence[WriteOp]) -> WriteHandle:
        """Check every op (see the module docstring), then post them all; return the completion.
        Raises :class:`UnknownRegionError` / :class:`BoundsError` with nothing of the batch
        issued, or the back end's :class:`TransportError` when posting fails."""
        batch = self.check(ops)
        if not batch.groups:
            return CompletedWrite(0)
        held = self._lease_enter(batch)  # before the epochs are read; left once the bytes are copied
        try:
            self.check_epochs(batch.remotes.values())
            h = self._post(batch, ops)
        except BaseException:
            lease.leave(held)
            raise
        if not held or h.done():
            lease.leave(held)
            return h
        return lease.LeasedHandle(h, held)

    def _lease_enter(self, batch: Batch) -> list:
        """Enter this sender's leases at the batch's receivers, then fence (:mod:`.lease`). Raises
        :class:`LeaseRequiredError` (or the cause's type) naming a receiver where it holds none."""
        if self.revocation != "lease":
            return []
        held = []
        for d, i in batch.remotes.values():
            x = self._leases.get(lease.table_ident(d)) if d.epoch else False
            if x is False:
                continue
            if x is None or isinstance(x, Exception):
                why = x.args[0] if x is not None else "it was never connected through connect()"
                cls = globals()[getattr(x, "cls", None) or "LeaseRequiredError"]
                raise cls(
                    f"{'op ' + str(i) if isinstance(i, int) else i}: no lease at the receiver of {describe_remote(d)}: "
                    f"{why}. Without one its deregister could not wait for this batch, so nothing of the batch was "
                    "issued (a lease is taken in connect(); reconnect after freeing a slot)")
            if x not in held:
                held.append(x)
        return lease.enter(held)

    def check_epochs(self, remotes) -> None:
        """Refuse remote regions whose owner no longer publishes their descriptor's epoch: the
        one place every back end checks C17. ``remotes``: ``(descriptor, op index)`` pairs.
        The back end reads the owners' published epochs (``_published_epochs``; None: its
        hardware enforces the registration itself, e.g. an invalidated rkey). Raises
        :class:`StaleRegionError` naming the op and the region; nothing was issued."""
        remotes = [(d, i) for d, i in remotes if d.epoch]
        if not remotes:
            return
        got = self._published_epochs([d for d, _ in remotes])
        if got is None:
            return
        for (d, i), e in zip(remotes, got):
            if e != d.epoch:
                why = ("0: the receiver deregistered it" if e == 0 else
                       f"{e:#x}: another registration of that memory")
                raise StaleRegionError(
                    f"{'op ' + str(i) if isinstance(i, int) else i}: remote region {describe_remote(d)} has epoch "
                    f"{d.epoch:#x} but its owner publishes {why} (revoked; the memory may be freed or "
                    "reused); nothing of the batch was issued"
                )

    # ---- back-end hooks ---------------------------------------------------------------------

    def _check_device(self, tensor: torch.Tensor) -> None:
        """Raise ValueError when this back end cannot register memory on ``tensor.device``."""

    def _register(self, region: Region):
        """Register ``region`` natively; return the handle kept in ``region.native``."""
        return None

    def _deregister(self, region: Region) -> None:
        """Release ``region.native``."""

    @abc.abstractmethod
    def _describe(self, region: Region) -> RegionDescriptor:
        """The descriptor of ``region`` (use :meth:`_descriptor`)."""

    def _descriptor(self, region: Region, key: int, extra: tuple = ()) -> RegionDescriptor:
        """A descriptor of ``region`` with a freshly published epoch (:mod:`.lease`):
        ``epoch`` and ``extra["epochs"] = (table address, slot, table id)``; for a region of
        several allocations also ``extra["parts"]`` (:meth:`register_parts`)."""
        slot, epoch = self._epoch_table().publish()
        region._slot = slot
        extra = tuple(extra) + (("epochs", (self._epochs.addr, slot, self._epochs.ident)),)
        if region.parts:
            extra += (("parts", region.parts),)
        chan = lease.lease_channel(self._epochs)
        if chan is not None:
            extra += (("lease", chan),)
        return RegionDescriptor(transport=self.name, host=self.host, pid=self.pid, addr=region.addr,
                                length=region.length, key=key, extra=extra, epoch=epoch)

    def _epoch_table(self):
        """This transport's :class:`~.lease.EpochTable` (made on first use)."""
        if self._epochs is None:
            self._epochs = lease.EpochTable()
        return self._epochs

    def _check_descriptor(self, d: RegionDescriptor) -> None:
        """Back-end checks of a descriptor at connect time (ValueError)."""

    def _connect(self, d: RegionDescriptor) -> Hashable:
        """Open ``d`` natively (load metadata, open a handle, handshake); return its lookup key."""
        return self._remote_key(d)

    def _disconnect(self) -> None:
        """Close every native connection (called by :meth:`close`)."""

    def _remote_key(self, d: RegionDescriptor) -> Hashable:
        """How a descriptor is looked up among the connected ones (default ``(pid, addr)``)."""
        return (d.pid, d.addr)

    def _group_key(self, loc: Region, remote: RegionDescriptor, key: Hashable) -> Hashable:
        """Ops with one group key are posted together (default: per receiving pid)."""
        return remote.pid

    @abc.abstractmethod
    def _post(self, batch: Batch, ops: Sequence[WriteOp]) -> WriteHandle:
        """Issue every write of a checked, non-empty batch; return its completion."""

    def _published_epochs(self, remotes: list[RegionDescriptor]) -> list[int] | None:
        """The epochs the owners of ``remotes`` publish now, in order (read from their memory);
        None when the back end's hardware enforces revocation itself."""
        return None


