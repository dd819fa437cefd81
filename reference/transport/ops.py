"""What a write is and how a batch of them is checked, once for every back end
(:mod:`weight_transfer.transport.base` re-exports all of it; split from there to keep each module
short): the transport errors, :class:`Region` (a registered local range), :class:`Segments`
and :class:`WriteOp`, and :func:`check_batch`, which refuses a batch before any byte moves
(unknown or stale region, out of bounds, a segment outside its local region, an op between the
parts of a region of several allocations) and groups the checked ops by the back end's key
(:class:`Group`, :class:`Batch`).
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from ..types import RegionDescriptor

__all__ = [
    "Batch", "BoundsError", "Group", "PermissionDeniedError", "Region", "RemoteGoneError", "Segments", "TransportError",
    "UnknownRegionError", "WriteOp", "check_batch", "describe_remote", "LeaseRequiredError", "LeaseTimeoutError",
    "StaleRegionError", "parts_bounds",
]

class TransportError(RuntimeError):
    """A write was refused or failed. The message names the op, the regions and the cause."""


class BoundsError(TransportError):
    """A write would leave its local or remote region; nothing of the batch was issued."""


class UnknownRegionError(TransportError):
    """A write names a remote descriptor that was never connected (or a stale key), or a local
    region that was deregistered; nothing of the batch was issued."""


class StaleRegionError(UnknownRegionError):
    """A remote descriptor's epoch is not the one its owner publishes now: the receiver
    deregistered the region (published epoch 0) or registered it again (another epoch). Raised
    before any byte of the batch moved (C17)."""


class LeaseTimeoutError(TransportError):
    """``deregister`` waited ``lease_timeout`` seconds for a sender still inside a batch that
    started before the revocation; the region's memory stays referenced (not released)."""


class LeaseRequiredError(TransportError):
    """This sender holds no lease at a receiver of the batch, so the receiver's ``deregister``
    could not wait for the batch: it is refused before any byte moves (issue 27 item 5). The
    message names the receiver and why no lease could be taken."""


class RemoteGoneError(TransportError):
    """The receiving process no longer exists (CMA: ``ESRCH``)."""


class PermissionDeniedError(TransportError):
    """The kernel refused access to the remote memory (CMA: ``EPERM``); see the message for the
    ptrace / capability requirement."""


class Segments:
    """The local bytes of one write as several segments of its local region, in order: segment
    ``j`` is ``lengths[j]`` bytes at ``local_offset + offsets[j]`` of the region, and the
    segments, concatenated, are the ``length`` bytes that land contiguously at
    ``remote_offset`` (a gather list: the iovecs of one ``process_vm_writev``, the SGEs of one
    RDMA WRITE). What a strided source (a TP column slice of a row-major shard: one segment per
    row) is written as instead of a ``.contiguous()`` copy.

    ``offsets``, ``lengths``: 1-D integer sequences of equal length >= 1 (bytes; offsets >= 0,
    lengths >= 1; local segments may come in any order). Built once (e.g. at setup) and reused
    by every update's ops; a back end sees a segmented op as consecutive pieces of one batch
    (:class:`Group` holds one entry per segment, remote addresses adjacent).
    ValueError for malformed input."""

    __slots__ = ("offsets", "lengths", "starts", "nbytes", "end", "count")

    def __init__(self, offsets, lengths):
        import numpy as np

        off = np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
        ln = np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        if off.shape != ln.shape or off.size == 0:
            raise ValueError(f"Segments: {off.size} offsets and {ln.size} lengths (need the same number, >= 1)")
        if int(off.min()) < 0 or int(ln.min()) < 1:
            raise ValueError("Segments: offsets must be >= 0 and lengths >= 1 (bytes)")
        self.offsets, self.lengths = off, ln
        self.starts = np.cumsum(ln) - ln
        """Byte offset of each segment in the write (remote side)."""
        self.nbytes = int(ln.sum())
        """Total bytes (the op's ``length``)."""
        self.end = int((off + ln).max())
        """One past the last local byte, relative to the op's ``local_offset``."""
        self.count = int(off.size)

    @classmethod
    def strided(cls, sizes, strides, itemsize: int, offset: int = 0) -> Segments | None:
        """The segments of a strided view (``sizes``/``strides`` in elements, as torch reports
        them; ``offset`` bytes): one segment per run of its innermost dimensions that are
        contiguous, in C order. None when the view is contiguous (one plain write does)."""
        import numpy as np

        dims = [(n, s) for n, s in zip(sizes, strides) if n != 1]
        run = 1  # elements per contiguous run (of the trailing dims)
        k = len(dims)
        while k and dims[k - 1][1] == run:
            run *= dims[k - 1][0]
            k -= 1
        if k == 0:
            return None
        offs = np.zeros(1, dtype=np.int64)
        for n, s in dims[:k]:
            offs = (offs[:, None] + np.arange(n, dtype=np.int64)[None, :] * (s * itemsize)).reshape(-1)
        return cls(offs + offset, np.full(offs.size, run * itemsize, dtype=np.int64))

    def __repr__(self) -> str:
        return f"Segments({self.count} segments, {self.nbytes} bytes, local span {self.end})"


class Region:
    """A registered local memory range (the memory region, MR): the tensor (referenced while
    registered, so its memory is not freed), its address and length in bytes, the back end's
    native handle (``native``: NIXL's registration list, the verbs MRs, ...) and the descriptor
    another process needs to write here (built on first :meth:`descriptor` call).

    Built by :meth:`weight_transfer.transport.base.Transport.register` only (``owner``: that
    transport; not imported here, ``base`` imports this module). ``tensor`` is None once
    deregistered.

    A region of several allocations (:meth:`~weight_transfer.transport.base.Transport.register_parts`)
    spans its lowest part's first byte to its highest part's last; :attr:`parts` says which
    bytes of that span are its memory, and ``tensor`` is its lowest part."""

    __slots__ = ("_tensor", "addr", "length", "native", "_desc", "_owner", "_slot", "parts", "_parts")

    def __init__(self, owner, tensor: torch.Tensor):
        self._owner = owner
        self._tensor: torch.Tensor | None = tensor
        self.addr: int = tensor.data_ptr()
        """Start address (bytes, in the owner's address space or device)."""
        self.length: int = tensor.nbytes
        """Length in bytes (>= 1)."""
        self.native = None
        self._desc: RegionDescriptor | None = None
        self._slot: int | None = None  # epoch-table slot once published
        self.parts: tuple[tuple[int, int], ...] | None = None
        """A region of several allocations: ``(offset from addr, length)`` of each, in address
        order (bytes); every write must lie inside one of them. None: one tensor, all its bytes."""
        self._parts: tuple[torch.Tensor, ...] | None = None  # the part tensors (referenced while registered)

    @property
    def tensor(self) -> torch.Tensor | None:
        """The registered tensor (None once deregistered)."""
        return self._tensor

    def descriptor(self) -> RegionDescriptor:
        """Serializable descriptor another process needs to write here. Raises
        :class:`TransportError` when the region was deregistered before a descriptor was built."""
        if self._desc is None:
            if self._tensor is None:
                raise TransportError(f"descriptor: {self!r} was deregistered")
            self._desc = self._owner._describe(self)
        return self._desc

    def __repr__(self) -> str:
        live = "" if self._tensor is not None else ", deregistered"
        parts = f", {len(self.parts)} parts" if self.parts else ""
        return f"Region({self._owner.name}, addr={self.addr:#x}, length={self.length}{parts}{live})"


@dataclass(frozen=True, slots=True)
class WriteOp:
    """Copy ``length`` bytes from ``local`` at ``local_offset`` to ``remote`` at ``remote_offset``
    (all in bytes). With ``segments`` (:class:`Segments`, total ``length``) the local bytes are
    those segments of ``local`` (relative to ``local_offset``), concatenated: one write, several
    local pieces, one contiguous remote range."""

    local: Region
    local_offset: int
    remote: RegionDescriptor
    remote_offset: int
    length: int
    segments: Segments | None = None


# ---------------------------------------------------------------------------------------------
# the op checks (one place for every back end)


class Group:
    """Checked, non-empty ops of a batch that share a back end's group key (a receiving pid, a
    NIXL (agent, memory types), a verbs peer, ...): parallel lists of op index, local address,
    remote address and length (bytes). ``local`` / ``remote`` are the first op's local region and
    connected descriptor (what the key was computed from).

    For a back end with ``segment_arrays`` (CMA) the pieces of ops with :class:`Segments` are
    kept as numpy arrays in ``chunks`` instead: ``(pos, op index, local addresses, remote
    addresses, lengths)``, the chunk coming before list entry ``pos``; :meth:`arrays` gives every
    piece in order as numpy arrays. Every other back end gets them in the lists."""

    __slots__ = ("local", "remote", "idx", "laddr", "raddr", "lens", "chunks")

    def __init__(self, local: Region, remote: RegionDescriptor):
        self.local, self.remote = local, remote
        self.idx: list[int] = []
        self.laddr: list[int] = []
        self.raddr: list[int] = []
        self.lens: list[int] = []
        self.chunks: list = []

    def __len__(self) -> int:
        """Pieces of the group (list entries plus chunked segments)."""
        return len(self.lens) + sum(len(c[4]) for c in self.chunks)

    def arrays(self):
        """(op index, local address, remote address, length) of every piece, in order, as 1-D
        numpy arrays (int64, uint64, uint64, uint64)."""
        import numpy as np

        lists = (self.idx, self.laddr, self.raddr, self.lens)
        if not self.chunks:
            return (np.array(self.idx, dtype=np.int64), *(np.array(x, dtype=np.uint64) for x in lists[1:]))
        parts: list[list] = [[], [], [], []]
        prev = 0
        for pos, i, la, ra, ln in self.chunks:
            for k, x in enumerate(lists):
                if pos > prev:
                    parts[k].append(np.array(x[prev:pos], dtype=np.int64 if k == 0 else np.uint64))
            parts[0].append(np.full(len(ln), i, dtype=np.int64))
            parts[1].append(la.astype(np.uint64))
            parts[2].append(ra.astype(np.uint64))
            parts[3].append(ln.astype(np.uint64))
            prev = pos
        if len(self.lens) > prev:
            for k, x in enumerate(lists):
                parts[k].append(np.array(x[prev:], dtype=np.int64 if k == 0 else np.uint64))
        return tuple(np.concatenate(p) for p in parts)


@dataclass(slots=True)
class Batch:
    """A batch that passed every check: its groups, in first-seen order, its total bytes, and
    its distinct remote regions (lookup key -> (connected descriptor, index of its first op))."""

    groups: dict[Hashable, Group]
    nbytes: int
    remotes: dict[Hashable, tuple[RegionDescriptor, int]]


def describe_remote(d: RegionDescriptor) -> str:
    """``(host h, pid p, addr 0x..., length n)`` (plus ``agent`` for NIXL descriptors)."""
    agent = ""
    if isinstance(d.extra, tuple):
        for kv in d.extra:
            if isinstance(kv, tuple) and len(kv) == 2 and kv[0] == "agent":
                agent = f"agent {kv[1]}, "
    return f"({agent}host {d.host}, pid {d.pid}, addr {d.addr:#x}, length {d.length})"


def check_batch(ops: Sequence[WriteOp], local: dict, remote: dict,
                remote_key: Callable[[RegionDescriptor], Hashable],
                group_key: Callable[[Region, RegionDescriptor, Hashable], Hashable],
                segment_arrays: bool = False, remote_parts: dict | None = None) -> Batch:
    """Check every op of a batch (the rules in the module docstring) and group the non-empty
    ones. ``local``: ``id(region) -> region`` registered here; ``remote``:
    ``remote_key(descriptor) -> descriptor`` connected here; ``remote_parts``: ``remote_key ->
    (starts, ends)`` of the connected remote regions made of several parts (their descriptor's
    ``extra["parts"]``), whose ops must each lie inside one part. Raises
    :class:`UnknownRegionError` / :class:`BoundsError` naming the op index, the regions and the
    bounds; then nothing of the batch may be issued. Regions and descriptors repeated across
    consecutive ops are looked up once (cost per op ~1 us in CPython)."""
    groups: dict[Hashable, Group] = {}
    remotes: dict[Hashable, tuple[RegionDescriptor, int]] = {}
    total = 0
    last_loc = last_rd = None
    llen = laddr = rlen = raddr = 0
    c = rparts = None
    add_i = add_l = add_r = add_n = None
    for i, op in enumerate(ops):
        loc = op.local
        if loc is not last_loc:
            if local.get(id(loc)) is not loc:
                raise UnknownRegionError(
                    f"op {i}: local region {loc!r} is not registered with this transport "
                    "(deregistered, or registered elsewhere); nothing of the batch was issued"
                )
            if getattr(loc, "parts", None) is not None:
                raise UnknownRegionError(f"op {i}: local region {loc!r} is a region of several parts (a receiver's "
                                         "memory); a sender writes from regions of one tensor; nothing of the batch "
                                         "was issued")
            last_loc, llen, laddr = loc, loc.length, loc.addr
            last_rd = None  # the group may depend on the local region
        rd = op.remote
        if rd is not last_rd:
            k = remote_key(rd)
            c = remote.get(k)
            if c is None or (c is not rd and c != rd):
                raise UnknownRegionError(_unknown_msg(i, rd, c))
            last_rd, rlen, raddr = rd, c.length, c.addr
            rparts = remote_parts.get(k) if remote_parts else None
            if k not in remotes:
                remotes[k] = (c, i)
            gk = group_key(loc, c, k)
            g = groups.get(gk)
            if g is None:
                g = groups[gk] = Group(loc, c)
            add_i, add_l, add_r, add_n = g.idx.append, g.laddr.append, g.raddr.append, g.lens.append
        lo, ro, n = op.local_offset, op.remote_offset, op.length
        sg = op.segments
        if sg is not None:
            if sg.nbytes != n:
                raise BoundsError(f"op {i}: its segments hold {sg.nbytes} bytes, the op's length is {n}; "
                                  "nothing of the batch was issued")
            if lo < 0 or ro < 0 or lo + sg.end > llen or ro + n > rlen:
                raise BoundsError(_bounds_msg(i, loc, c, lo, ro, n, span=sg.end))
            if rparts is not None:
                _in_one_part(i, c, rparts, ro, n)
            total += n
            if segment_arrays:  # no Python per segment: the back end takes the arrays
                g.chunks.append((len(g.lens), i, sg.offsets + (laddr + lo), sg.starts + (raddr + ro), sg.lengths))
                continue
            g.idx.extend([i] * sg.count)
            g.laddr.extend((sg.offsets + (laddr + lo)).tolist())
            g.raddr.extend((sg.starts + (raddr + ro)).tolist())
            g.lens.extend(sg.lengths.tolist())
            continue
        if lo < 0 or ro < 0 or n < 0 or lo + n > llen or ro + n > rlen:
            raise BoundsError(_bounds_msg(i, loc, c, lo, ro, n))
        if n and rparts is not None:
            _in_one_part(i, c, rparts, ro, n)
        if n:
            add_i(i)
            add_l(laddr + lo)
            add_r(raddr + ro)
            add_n(n)
            total += n
    if any(not g.lens and not g.chunks for g in groups.values()):  # groups of zero-length ops only
        groups = {k: g for k, g in groups.items() if g.lens or g.chunks}
    return Batch(groups, total, remotes)


def parts_bounds(d: RegionDescriptor) -> tuple[list[int], list[int]] | None:
    """``(starts, ends)`` (bytes from ``d.addr``) of a remote region of several parts, from its
    descriptor's ``extra["parts"]``; None for a region of one tensor. ValueError when the parts
    are malformed (not ``(offset, length)`` int pairs in address order, disjoint, inside
    ``[0, d.length)``, the first at 0 and the last ending at ``d.length``)."""
    parts = dict(d.extra).get("parts") if isinstance(d.extra, tuple) else None
    if parts is None:
        return None
    try:
        starts = [int(o) for o, _ in parts]
        ends = [int(o) + int(n) for o, n in parts]
    except (TypeError, ValueError):
        raise ValueError(f"connect: descriptor {describe_remote(d)} has malformed parts {parts!r}") from None
    ok = (starts and starts[0] == 0 and ends[-1] == d.length and all(a < b for a, b in zip(starts, ends))
          and all(e <= s for e, s in zip(ends, starts[1:])))
    if not ok:
        raise ValueError(f"connect: descriptor {describe_remote(d)} has malformed parts (not disjoint (offset, length) "
                         f"pairs in address order covering [0, {d.length}) end to end): {parts[:4]!r}...")
    return starts, ends


def _in_one_part(i: int, c: RegionDescriptor, parts: tuple[list[int], list[int]], ro: int, n: int) -> None:
    """Raise :class:`BoundsError` unless remote bytes ``[ro, ro + n)`` lie inside one part."""
    starts, ends = parts
    k = bisect_right(starts, ro) - 1
    if k >= 0 and ro + n <= ends[k]:
        return
    near = f"; the part before starts at {starts[k]} and ends at {ends[k]}" if k >= 0 else ""
    raise BoundsError(f"op {i}: remote bytes [{ro}, {ro + n}) of {describe_remote(c)} are not inside one of its "
                      f"{len(starts)} parts (the allocations its owner registered as one region; the bytes between "
                      f"them are not its memory){near}; nothing of the batch was issued")


def _unknown_msg(i, rd: RegionDescriptor, c: RegionDescriptor | None) -> str:
    where = f"op {i}" if isinstance(i, int) else str(i)
    if c is None:
        why = ("was never connected (a descriptor of another process or run; call connect() with the "
               "receiver's descriptors first)")
    elif c.key != rd.key or c.extra != rd.extra:
        why = (f"has key {rd.key:#x} but the connected registration has key {c.key:#x} "
               "(a descriptor from another run or a re-registration)")
    elif c.length != rd.length:
        why = f"has length {rd.length} but the connected one has length {c.length}"
    else:
        why = f"differs from the connected one {c}"
    return f"{where}: remote region {describe_remote(rd)} {why}; nothing of the batch was issued"


def _bounds_msg(i: int, loc: Region, c: RegionDescriptor, lo: int, ro: int, n: int, span: int | None = None) -> str:
    parts = []
    if lo < 0:
        parts.append(f"local_offset {lo} < 0")
    if ro < 0:
        parts.append(f"remote_offset {ro} < 0")
    if n < 0:
        parts.append(f"length {n} < 0")
    if span is not None and lo + span > loc.length:
        parts.append(f"local_offset {lo} + segments' span {span} = {lo + span} > local region length {loc.length} "
                     f"(addr {loc.addr:#x})")
    elif span is None and lo + n > loc.length:
        parts.append(f"local_offset {lo} + length {n} = {lo + n} > local region length {loc.length} "
                     f"(addr {loc.addr:#x})")
    if ro + n > c.length:
        parts.append(f"remote_offset {ro} + length {n} = {ro + n} > remote region length {c.length} "
                     f"(pid {c.pid}, addr {c.addr:#x})")
    return (f"op {i}: out of bounds: {'; '.join(parts)} [local {loc!r}, remote {describe_remote(c)}, "
            f"local_offset {lo}, remote_offset {ro}, length {n}]; nothing of the batch was issued")
