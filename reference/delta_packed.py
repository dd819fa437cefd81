"""Packed delta updates: an output's changed runs packed into one payload, written with one
contiguous one-sided write into a *landing region* the receiver registered once, and scattered
into place by the receiver's commit (``delta_mode`` ``packed`` / ``auto``, :mod:`weight_transfer.delta`).

Why: a scattered delta (:class:`weight_transfer.transport.runs.RunsOp`) costs one remote
segment per run -- ~300 ns of page pinning per iovec on cma, one descriptor or work request per
run on NIXL / verbs -- and a real RL step has about one run per changed element (hundreds of
thousands per push). Packed, the same runs are one write of ``payload`` bytes, and the receiver
scatters them with a C loop of ``memcpy`` at commit (the only per-update work it does, the way
staged targets are post-processed at commit).

**The landing region** (receiver side, :class:`Landing`): one ``uint8`` buffer of
``fraction x`` the inference rank's target bytes (``ExecutorOptions.delta_landing``, default
0.25; at least :data:`MIN_LANDING` bytes), registered once with the receiver's transport next to
its targets, its descriptor published at :data:`LANDING_KEY` (the :class:`weight_transfer.api.Sender`
reads it when it builds its executor; none published: no packed mode for that rank). Layout:

- a directory of :data:`DIR_SLOTS` entries of 64 bytes, one per training rank (a rank >= that
  never packs): eight int64 ``[magic, version, area offset, used bytes, records, senders, check, 0]``,
  written by that rank *after* every record of the update landed (:meth:`Packer.finish`);
- the rest split evenly among the ``senders`` training ranks, 64-byte aligned: rank ``r``'s area
  is ``[DIR + r*A, DIR + (r+1)*A)``, ``A = floor((length - DIR) / senders / 64) * 64``. Records
  are appended from the area's start each update.

**A record** (one output written to one receiver), 64-byte aligned: a 64-byte header of eight
int64 ``[magic, target offset, span, runs, data bytes, record bytes, version, 0]`` (the target
offset counts from the receiver's registered target region, shadow shift included; the span
is the planned write's length); then the index, **8 bytes per run**: two uint32, the gap since
the previous run's end and the run's length (so a span is at most 4 GiB - 1; a larger output is
never packed); then the changed bytes back to back. Byte cost: ``64 + 8 x runs + changed bytes``
rounded up to 64. At 8-byte blocks, where a real step has about one run per changed block, the
index is about as large as the data: a packed delta at lr 1e-6 (~5% of bf16 bytes changed) is
~10% of a full update (docs/DELTA.md).

**Fit and fallback.** A record that does not fit what is left of the sender's area in that
receiver is not packed: the output goes scattered or whole, whichever the cost model prefers
(:meth:`weight_transfer.delta.DeltaState.ops`); nothing is ever written outside the landing
region (each record is a :class:`~weight_transfer.transport.base.WriteOp` bounds-checked like
any other).

**Commit** (:meth:`Landing.apply`, the receiver's commit of version ``v``): read the directory;
for every entry of version ``v``, check the entry (magic, check word, area, used bytes), then
every record (magic, version, sizes, the span inside one part of the target region, every run
non-empty and inside its span, the data bytes equal to the runs' sum) -- **all records of all
entries before any byte is scattered**; a malformed one raises :class:`PackedError` and nothing
is scattered. Then one C loop per record copies the runs into place. A failed apply fails the
commit, so the version is not published complete and every sender's next update is full (C26).
Units: bytes, seconds.
"""
from __future__ import annotations

import ctypes
import time

import torch

from .transport.base import WriteOp

__all__ = ["DIR_SLOTS", "DIR_BYTES", "HEADER", "LANDING_KEY", "MIN_LANDING", "Landing", "Packer", "PackedError",
           "area", "record_bytes", "apply_landing"]

LANDING_KEY = "infer/delta_landing/{rank}"
"""Store key: the :class:`~weight_transfer.types.RegionDescriptor` of inference rank ``rank``'s
landing region (absent: that rank takes no packed deltas)."""
DIR_SLOTS = 64
"""Directory entries (training ranks that may pack into one receiver)."""
HEADER = 64
"""Bytes of a record header and of a directory entry."""
DIR_BYTES = DIR_SLOTS * HEADER
"""Bytes of the directory at the start of a landing region."""
MIN_LANDING = DIR_BYTES + (64 << 10)
"""Smallest landing region (bytes)."""
MAGIC_REC = 0x3143524450545700  # "\0WTPDRC1"
MAGIC_DIR = 0x3152494450545700  # "\0WTPDIR1"
MAX_SPAN = (1 << 32) - 1


class PackedError(ValueError):
    """A malformed packed payload or directory, refused before any byte was scattered."""


def _lib():
    from .delta import KERNEL

    return KERNEL.lib()


def record_bytes(runs: int, changed: int) -> int:
    """Bytes of a packed record of ``runs`` runs carrying ``changed`` bytes (64-byte aligned)."""
    return -(-(HEADER + 8 * runs + changed) // 64) * 64


def area(length: int, senders: int, rank: int) -> tuple[int, int]:
    """``(offset, bytes)`` of training rank ``rank``'s area in a landing region of ``length``
    bytes shared by ``senders`` ranks (bytes 0 when it has none)."""
    if rank >= DIR_SLOTS or senders < 1 or rank >= senders:
        return DIR_BYTES, 0
    a = max(0, (length - DIR_BYTES) // senders // 64 * 64)
    return DIR_BYTES + rank * a, a


class Packer:
    """A training rank's side: one local buffer mirroring its area in every receiver's landing
    region (registered once with ``transport``: ``sum`` of the areas, about ``fraction`` of the
    rank's update bytes), plus one 64-byte directory entry per receiver. ``landing``: inference
    rank -> landing :class:`~weight_transfer.types.RegionDescriptor` (connected on
    ``transport``); ``senders``: training ranks sharing each landing region; ``rank``: this one."""

    def __init__(self, landing: dict, transport, *, rank: int, senders: int, device="cpu"):
        self.landing, self.transport, self.rank, self.senders = dict(landing), transport, rank, senders
        self._at: dict[int, tuple[int, int, int]] = {}  # inference rank -> (local base, remote area offset, bytes)
        off = 0
        for r, d in sorted(self.landing.items()):
            ao, n = area(d.length, senders, rank)
            if n:
                self._at[r] = (off, ao, n)
                off += n
        self._dir = off
        self.nbytes = off + HEADER * len(self._at)
        """Bytes of the local pack buffer (registered once)."""
        self.buffer = torch.zeros(max(self.nbytes, 64), dtype=torch.uint8, device=device)
        self.region = transport.register(self.buffer) if self._at and transport is not None else None
        self.version = 0
        self.pos: dict[int, int] = {}
        self.records: dict[int, int] = {}
        self.seconds = 0.0
        """Seconds this update spent packing (reset by :meth:`begin`)."""

    def close(self) -> None:
        """Deregister the pack buffer."""
        if self.region is not None:
            self.transport.deregister(self.region)
            self.region = None

    def begin(self, version: int) -> None:
        """Start update ``version``: every area empty."""
        self.version, self.pos, self.records, self.seconds = int(version), {}, {}, 0.0

    def room(self, dst: int) -> int:
        """Bytes still free in this rank's area of inference rank ``dst`` (0: none)."""
        at = self._at.get(dst)
        return 0 if at is None else at[2] - self.pos.get(dst, 0)

    def pack(self, dst: int, data: torch.Tensor, runs, target_offset: int, span: int) -> WriteOp | None:
        """Pack ``runs`` (:class:`weight_transfer.delta.Runs` of flat uint8 CPU ``data``) as a
        record for inference rank ``dst``'s span ``[target_offset, target_offset + span)`` and
        return the :class:`WriteOp` that writes it into the landing region; None when it does
        not fit (nothing changed) or the span is too large for the index."""
        m, c = len(runs), runs.nbytes
        size = record_bytes(m, c)
        at = self._at.get(dst)
        if at is None or span > MAX_SPAN or size > self.room(dst) or data.device.type != "cpu":
            return None
        t0 = time.perf_counter()
        base, ao, _ = at
        pos = self.pos.get(dst, 0)
        lo = base + pos
        rec = self.buffer[lo:lo + size]
        rec[:HEADER].view(torch.int64).copy_(torch.tensor(
            [MAGIC_REC, target_offset, span, m, c, size, self.version, 0], dtype=torch.int64))
        idx = rec[HEADER:HEADER + 8 * m]
        body = rec[HEADER + 8 * m:HEADER + 8 * m + c]
        lib = _lib()
        if lib is not None and m:
            lib.wt_pack_runs(data.data_ptr(), runs.starts.data_ptr(), runs.lens.data_ptr(), m, idx.data_ptr(),
                             body.data_ptr())
        elif m:
            st, ln = runs.starts, runs.lens
            prev_end = torch.cat([torch.zeros(1, dtype=torch.int64), (st + ln)[:-1]])
            idx.view(torch.int32).view(m, 2).copy_(torch.stack([st - prev_end, ln], 1).to(torch.int32))
            body.copy_(data[_byte_index(st, ln)])
        self.pos[dst] = pos + size
        self.records[dst] = self.records.get(dst, 0) + 1
        self.seconds += time.perf_counter() - t0
        return WriteOp(self.region, lo, self.landing[dst], ao + pos, size)

    def finish(self) -> list[WriteOp]:
        """The directory entries of this update (one per receiver that got a record), to write
        once every record landed."""
        ops = []
        for k, (dst, n) in enumerate(sorted(self.records.items())):
            _, ao, _ = self._at[dst]
            used = self.pos[dst]
            e = [MAGIC_DIR, self.version, ao, used, n, self.senders]
            e += [_check(e), 0]
            lo = self._dir + HEADER * k
            self.buffer[lo:lo + HEADER].view(torch.int64).copy_(torch.tensor(e, dtype=torch.int64))
            ops.append(WriteOp(self.region, lo, self.landing[dst], HEADER * self.rank, HEADER))
        return ops


def _check(e: list[int]) -> int:
    x = 0x5A5A5A5A5A5A5A5A
    for v in e:
        x ^= v & 0xFFFFFFFFFFFFFFFF
        x = (x * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return x - (1 << 64) if x >= 1 << 63 else x


def _byte_index(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Every byte offset the runs cover (torch fallback)."""
    rep = torch.repeat_interleave(starts - torch.cumsum(lens, 0) + lens, lens)
    return rep + torch.arange(int(lens.sum()), dtype=torch.int64)


class Landing:
    """A receiver's landing region: ``nbytes`` zeroed bytes of CPU memory registered once with
    ``transport`` (the receiver's own transport object, e.g. ``Receiver.transport``). Publish its
    :attr:`descriptor` with :meth:`publish`; commit a version with :meth:`apply`."""

    def __init__(self, nbytes: int, transport):
        nbytes = max(int(nbytes), MIN_LANDING)
        self.transport = transport
        self.buffer = (transport.allocate(nbytes) if getattr(transport, "publishes_allocated_only", False)
                       else torch.zeros(nbytes, dtype=torch.uint8))
        self.buffer.zero_()
        self.region = transport.register(self.buffer)
        self.descriptor = self.region.descriptor()
        self.last: dict = {}
        """Stats of the last :meth:`apply`."""

    @staticmethod
    def size_for(target_bytes: int, fraction: float) -> int:
        """Landing bytes for ``target_bytes`` of targets at ``fraction`` (at least :data:`MIN_LANDING`)."""
        return max(MIN_LANDING, DIR_BYTES + int(target_bytes * fraction) // 64 * 64)

    def publish(self, store, rank: int) -> None:
        """Publish the descriptor at :data:`LANDING_KEY` for inference ``rank``."""
        from . import control

        control.put(store, LANDING_KEY.format(rank=rank), self.descriptor)

    def close(self) -> None:
        """Deregister the landing region."""
        if self.region is not None:
            self.transport.deregister(self.region)
            self.region = None

    def apply(self, version: int, base: int, parts) -> dict:
        """The commit's scatter: :func:`apply_landing` of this region's buffer."""
        self.last = apply_landing(self.buffer, version, base, parts)
        return self.last


def _records(buf: torch.Tensor, version: int, parts) -> list[tuple[int, int, int, int, int]]:
    """Every record of ``version`` in landing ``buf``, checked: (record offset, target offset,
    span, runs, data bytes). Raises :class:`PackedError`."""
    n = buf.numel()
    d = buf[:DIR_BYTES].view(torch.int64).view(DIR_SLOTS, 8).tolist()
    out = []
    lib = _lib()
    for r, e in enumerate(d):
        if e[0] != MAGIC_DIR or e[1] != version:
            continue
        if e[6] != _check(e[:6]):
            raise PackedError(f"landing directory entry {r} (version {version}): bad check word; nothing scattered")
        ao, used, nrec, senders = e[2], e[3], e[4], e[5]
        want_ao, a = area(n, senders, r)
        if ao != want_ao or not 0 <= used <= a or nrec < 0:
            raise PackedError(f"landing directory entry {r} (version {version}): area at {ao} with {used} bytes used "
                              f"does not fit the area of training rank {r} of {senders} ({want_ao}, {a} bytes); "
                              "nothing scattered")
        at = ao
        for k in range(nrec):
            if at + HEADER > ao + used:
                raise PackedError(f"landing entry {r}: record {k} starts past the {used} bytes used; nothing scattered")
            h = buf[at:at + HEADER].view(torch.int64).tolist()
            magic, to, span, m, c, size, ver = h[:7]
            if magic != MAGIC_REC or ver != version or m < 0 or c < 0 or size != record_bytes(m, c) \
                    or at + size > ao + used or not 0 < span <= MAX_SPAN:
                raise PackedError(f"landing entry {r}: record {k} at {at} is malformed (magic {magic:#x}, version "
                                  f"{ver}, span {span}, runs {m}, data {c}, size {size}); nothing scattered")
            if not any(lo <= to and to + span <= hi for lo, hi in parts):
                raise PackedError(f"landing entry {r}: record {k} targets [{to}, {to + span}), outside every part of "
                                  "the registered target region; nothing scattered")
            idx = buf[at + HEADER:at + HEADER + 8 * m]
            if lib is not None:
                tot = ctypes.c_int64(0)
                bad = lib.wt_check_packed(idx.data_ptr(), m, span, ctypes.byref(tot)) if m else -1
                got = tot.value if m else 0
            else:
                st, ln = _decode(idx, m)
                badm = (ln <= 0) | (st > span - ln)
                bad = int(badm.nonzero()[0]) if bool(badm.any()) else -1
                got = int(ln.sum())
            if bad >= 0:
                raise PackedError(f"landing entry {r}: record {k}: run {bad} is empty or leaves its span of {span} "
                                  "bytes; nothing scattered")
            if got != c:
                raise PackedError(f"landing entry {r}: record {k}: runs carry {got} bytes, header says {c}; "
                                  "nothing scattered")
            out.append((at, to, span, m, c))
            at += size
    return out


def _decode(idx: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = idx.view(torch.int32).view(m, 2).to(torch.int64) & 0xFFFFFFFF
    ends = torch.cumsum(g[:, 0] + g[:, 1], 0)
    return ends - g[:, 1], g[:, 1]


def apply_landing(buf: torch.Tensor, version: int, base: int, parts) -> dict:
    """Scatter every record of ``version`` in landing buffer ``buf`` (flat uint8 CPU) into the
    target region whose byte 0 is at address ``base`` of this process; ``parts``: the region's
    parts as ``[(lo, hi)]`` offsets from ``base`` (a record's span must lie inside one). Every
    record is checked before any byte is scattered (:class:`PackedError`). Returns
    ``{"delta_apply_s", "delta_records", "delta_runs", "delta_bytes"}`` (seconds, counts, bytes)."""
    from .receiver import span_view

    t0 = time.perf_counter()
    recs = _records(buf, version, parts)
    lib = _lib()
    runs = nbytes = 0
    for at, to, span, m, c in recs:
        idx = buf[at + HEADER:at + HEADER + 8 * m]
        data = buf[at + HEADER + 8 * m:at + HEADER + 8 * m + c]
        if lib is not None:
            lib.wt_unpack(ctypes.c_void_p(base + to), idx.data_ptr(), data.data_ptr(), m)
        elif m:
            st, ln = _decode(idx, m)
            span_view(base + to, span)[_byte_index(st, ln)] = data
        runs += m
        nbytes += c
    return {"delta_apply_s": time.perf_counter() - t0, "delta_records": len(recs), "delta_runs": runs,
            "delta_bytes": nbytes}
