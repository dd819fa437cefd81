"""Packed delta updates: an output's changed runs packed into one payload, written with one
contiguous one-sided write into a *landing region* the receiver registered once, and scattered
into place by the receiver's commit (``delta_mode`` ``packed`` / ``auto``, :mod:`weight_transfer.delta.runs`).

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

**A record** (one output written to one receiver; format 2), 64-byte aligned: a 64-byte header
of eight int64 ``[magic, target offset, span, runs, data bytes, index bytes, version, unit]``
(the target offset counts from the receiver's registered target region, shadow shift
included; the span is the planned write's length, at most :data:`MAX_SPAN`; the unit ``q``,
1..:data:`MAX_UNIT` bytes, is the compare granularity the runs are whole multiples of); then
the index, **two LEB128 varints per run** in units of ``q``: the gap since the previous run's
end (the first from the span's first byte) and the run's length (the last run may end inside
its last unit: its end is clipped to the span), each minimal and at most 9 bytes; then the
changed bytes back to back. Byte cost: ``64 + index + changed`` rounded up to 64
(:func:`record_size`), the index ~2-2.3 bytes per run on a real RL step (a 1-byte gap below 128
units, a 1-byte length). At 1-byte units -- the default block of packed deltas: a small step
changes only the low byte of most bf16 elements -- a packed delta of an lr 1e-6 step is ~3.6% of
a full bf16 update (docs/DELTA.md). A format-1 record (its magic; two uint32 per run) is refused
by name, any other magic as malformed.

**A format-3 record** (``ExecutorOptions.delta_format`` ``masks``; :mod:`weight_transfer.delta.masks`):
the same header with its own magic, ``runs`` the number ``m`` of changed 64-byte chunks, unit 64;
then ``m`` int64 byte masks, ``m`` uint32 chunk indices, padding to 8, and the changed bytes.
Checked like format 2 before any byte moves; scattered with a vector expand per chunk, or
during the commit's own copy of those bytes (:meth:`Landing.copy_in`).

**Posting.** The executor holds back every record write of an update and posts them as one
batch after its last task (one round trip per update on a transport that pays one per batch,
NIXL's epoch READ and completion among them, instead of one per task), then, once that batch
completed, the directory entries.

**Fit and fallback.** A record that does not fit what is left of the sender's area in that
receiver is not packed: the output goes scattered or whole, whichever the cost model prefers
(:meth:`weight_transfer.delta.runs.DeltaState.ops`); nothing is ever written outside the landing
region (each record is a :class:`~weight_transfer.transport.base.WriteOp` bounds-checked like
any other).

**Commit** (:meth:`Landing.apply`, the receiver's commit of version ``v``): read the directory;
for every entry of version ``v``, check the entry (magic, check word, area, used bytes), then
every record (magic, version, sizes, unit, the span inside one part of the target region, every
varint whole and minimal, every run non-empty and inside its span, the index consumed exactly,
the data bytes equal to the runs' sum) -- **all records of all
entries before any byte is scattered**; a malformed one raises :class:`PackedError` and nothing
is scattered. Then one C loop per record copies the runs into place. A failed apply fails the
commit, so the version is not published complete and every sender's next update is full (C26).
Units: bytes, seconds.
"""
from __future__ import annotations

import ctypes
import os
import time

import torch

from ..transport.base import WriteOp
from .index import WHY, _byte_index, check_index, encode_index
from .masks import _mask_positions, check_masks, masks_index_bytes
from .runs import index_size

__all__ = ["DIR_SLOTS", "DIR_BYTES", "HEADER", "LANDING_KEY", "MIN_LANDING", "MAX_SPAN", "MAX_UNIT", "Landing",
           "MAX_SPAN_MASKS", "Packer", "PackedError", "area", "record_size", "index_size", "encode_index", "check_index", "apply_landing"]

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
MAGIC_REC = 0x3243524450545700  # "\0WTPDRC2": format 2 (varint index)
MAGIC_REC3 = 0x3343524450545700  # "\0WTPDRC3": format 3 (chunk masks)
MAGIC_REC_V1 = 0x3143524450545700  # "\0WTPDRC1": format 1 (two uint32 per run), refused by name
MAGIC_DIR = 0x3152494450545700  # "\0WTPDIR1"
MAX_SPAN = 1 << 48
"""Largest span of one record (bytes)."""
MAX_SPAN_MASKS = 1 << 38
"""Largest span of one format-3 record (bytes: 2^32 chunks of 64 bytes)."""
MAX_UNIT = 1 << 16
"""Largest unit of a record's index (bytes)."""
class PackedError(ValueError):
    """A malformed packed payload or directory, refused before any byte was scattered."""


def _lib():
    from .runs import KERNEL

    return KERNEL.lib()


def record_size(index_bytes: int, changed: int) -> int:
    """Bytes of a packed record with ``index_bytes`` of index carrying ``changed`` bytes (64-byte
    aligned)."""
    return -(-(HEADER + index_bytes + changed) // 64) * 64


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

    def pack(self, dst: int, data: torch.Tensor, runs, target_offset: int, span: int, unit: int = 1) -> WriteOp | None:
        """Pack ``runs`` (:class:`weight_transfer.delta.runs.Runs` of flat uint8 CPU ``data``) as a
        record for inference rank ``dst``'s span ``[target_offset, target_offset + span)``, its
        index in units of ``unit`` bytes (the compare granularity; 1 when the runs are not whole
        units), and return the :class:`WriteOp` that writes it into the landing region; None
        when it does not fit (nothing changed) or the span is larger than :data:`MAX_SPAN`."""
        m, c = len(runs), runs.nbytes
        at = self._at.get(dst)
        if at is None or span > MAX_SPAN or data.device.type != "cpu" or not 1 <= unit <= MAX_UNIT:
            return None
        t0 = time.perf_counter()
        got = getattr(runs, "index", None)
        q, ix = got[1:] if got is not None and got[0] == unit else index_size(runs, span, unit)
        size = record_size(ix, c)
        lo = self._reserve(dst, size, t0)
        if lo is None:
            return None
        rec = self.buffer[lo:lo + size]
        rec[:HEADER].view(torch.int64).copy_(torch.tensor(
            [MAGIC_REC, target_offset, span, m, c, ix, self.version, q], dtype=torch.int64))
        idx = rec[HEADER:HEADER + ix]
        body = rec[HEADER + ix:HEADER + ix + c]
        lib = _lib()
        vals = getattr(runs, "vals", None)
        if lib is not None and m:
            lib.wt_pack_runs_v(data.data_ptr(), runs.starts.data_ptr(), runs.lens.data_ptr(),
                               None if vals is None else vals.data_ptr(), m, q, idx.data_ptr(), body.data_ptr())
        elif m:
            st, ln = runs.starts, runs.lens
            idx.copy_(encode_index(st, ln, span, q))
            body.copy_(data[_byte_index(st, ln)])
        return self._placed(dst, lo, size, t0)

    def _reserve(self, dst: int, size: int, t0: float) -> int | None:
        """Pack buffer offset of a ``size``-byte record for ``dst``; None when it does not fit."""
        if size > self.room(dst):
            self.seconds += time.perf_counter() - t0
            return None
        return self._at[dst][0] + self.pos.get(dst, 0)

    def _placed(self, dst: int, lo: int, size: int, t0: float) -> WriteOp:
        """Account the record laid out at pack buffer offset ``lo``; its write."""
        base, ao, _ = self._at[dst]
        pos = lo - base
        self.pos[dst] = pos + size
        self.records[dst] = self.records.get(dst, 0) + 1
        self.seconds += time.perf_counter() - t0
        return WriteOp(self.region, lo, self.landing[dst], ao + pos, size)

    def pack_masks(self, dst: int, masks, target_offset: int, span: int) -> WriteOp | None:
        """Pack :class:`weight_transfer.delta.masks.Masks` ``masks`` as a format-3 record for
        inference rank ``dst``'s span ``[target_offset, target_offset + span)`` (bytes) and return
        the :class:`WriteOp` that writes it; None (nothing packed) when ``dst`` has no landing
        area here, the record does not fit what is left of it, or the span is larger than
        :data:`MAX_SPAN_MASKS`."""
        at = self._at.get(dst)
        if at is None or span > MAX_SPAN_MASKS:
            return None
        t0 = time.perf_counter()
        m, c = len(masks), masks.nbytes
        ix = masks_index_bytes(m)
        size = record_size(ix, c)
        lo = self._reserve(dst, size, t0)
        if lo is None:
            return None
        rec = self.buffer[lo:lo + size]
        hdr = [MAGIC_REC3, target_offset, span, m, c, ix, self.version, 64]
        lib = _lib()
        if lib is not None:
            ctypes.memmove(rec.data_ptr(), (ctypes.c_int64 * 8)(*hdr), HEADER)
            if m:
                lib.wt_pack_masks(rec.data_ptr() + HEADER, masks.masks.data_ptr(), masks.chunks.data_ptr(), m,
                                  masks.vals.data_ptr(), c)
        else:
            rec[:HEADER].view(torch.int64).copy_(torch.tensor(hdr, dtype=torch.int64))
            if m:
                rec[HEADER:HEADER + 8 * m].view(torch.int64).copy_(masks.masks)
                rec[HEADER + 8 * m:HEADER + 12 * m].view(torch.int32).copy_(masks.chunks)
                rec[HEADER + 12 * m:HEADER + ix].zero_()
                rec[HEADER + ix:HEADER + ix + c].copy_(masks.vals)
        return self._placed(dst, lo, size, t0)

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


class Landing:
    """A receiver's landing region: ``nbytes`` zeroed bytes of CPU memory registered once with
    ``transport`` (the receiver's own transport object, e.g. ``Receiver.transport``). Publish its
    :attr:`descriptor` (the receiving side puts it in the store at :data:`LANDING_KEY`); commit a version with :meth:`apply`."""

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
        self.deferred: list = []
        """Checked format-3 records of the version being committed whose scatter :meth:`apply`
        left to :meth:`copy_in` (``defer``); empty after :meth:`flush`."""
        self.patch_s = 0.0
        """Seconds :meth:`copy_in` spent copying with records applied (since the last :meth:`apply`)."""

    @staticmethod
    def size_for(target_bytes: int, fraction: float) -> int:
        """Landing bytes for ``target_bytes`` of targets at ``fraction`` (at least :data:`MIN_LANDING`)."""
        return max(MIN_LANDING, DIR_BYTES + int(target_bytes * fraction) // 64 * 64)

    def close(self) -> None:
        """Deregister the landing region."""
        if self.region is not None:
            self.transport.deregister(self.region)
            self.region = None

    def apply(self, version: int, base: int, parts, defer=()) -> dict:
        """The commit's scatter: :func:`apply_landing` of this region's buffer. ``defer``: target
        ranges ``[(lo, hi)]`` (offsets from ``base``) whose format-3 records are checked with the
        rest but not scattered now: the commit copies those bytes anyway (a staged layer's
        staging tensor into the tensor vLLM's post-processing reads), and :meth:`copy_in` applies
        them during that copy; :meth:`flush` scatters whatever is left."""
        self.deferred, self.patch_s = [], 0.0
        self.last = apply_landing(self.buffer, version, base, parts, defer=defer, deferred=self.deferred)
        return self.last

    def copy_in(self, dst: torch.Tensor, src: torch.Tensor, base: int) -> bool:
        """Copy ``src`` (a tensor of the target region at address ``base``: a staging tensor) into
        ``dst``, applying the deferred records inside ``src`` to both on the way
        (``wt_copy_unpack_masks``: one pass); records only overlapping ``src`` are scattered
        first. False (every record touching ``src`` scattered into it) when there is nothing to
        fuse or ``dst`` takes no plain byte copy (dtype, size, layout, device, no native kernel).
        ``base``: the region's byte 0 as an address of this process. RuntimeError when a
        record's scatter disagrees with its check (a bug)."""
        if not self.deferred:
            return False
        lo, n = src.data_ptr() - base, src.numel() * src.element_size()
        hi = lo + n
        mine = [r for r in self.deferred if r[1] < hi and r[1] + r[2] > lo]
        if not mine:
            return False
        self.deferred = [r for r in self.deferred if not (r[1] < hi and r[1] + r[2] > lo)]
        t0 = time.perf_counter()
        lib = _lib()
        inside = [r for r in mine if lo <= r[1] and r[1] + r[2] <= hi]
        fuse = (lib is not None and dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous()
                and dst.device.type == "cpu" and src.device.type == "cpu" and dst.numel() * dst.element_size() == n)
        rest = [r for r in mine if not fuse or r not in inside]
        _scatter_records(self.buffer, base, rest)
        if not fuse or not inside:
            self.patch_s += time.perf_counter() - t0
            return False
        d8, s8 = (t.reshape(-1).view(torch.uint8) for t in (dst, src))
        at = 0
        for rec in sorted(inside, key=lambda r: r[1]):
            a, to, span, m, c, ix = rec[:6]
            off = to - lo
            if off > at:
                d8[at:off].copy_(s8[at:off])
            idx = self.buffer[a + HEADER:a + HEADER + ix]
            data = self.buffer[a + HEADER + ix:a + HEADER + ix + c]
            got = lib.wt_copy_unpack_masks(d8[off:].data_ptr(), ctypes.c_void_p(base + to),
                                           idx[:8 * m].data_ptr(), idx[8 * m:12 * m].data_ptr(), m,
                                           data.data_ptr(), c, span)
            if got != c:
                raise RuntimeError(f"packed record at {a}: the copy's scatter disagrees with its check (a bug)")
            at = off + span
        if at < n:
            d8[at:n].copy_(s8[at:n])
        self.patch_s += time.perf_counter() - t0
        return True

    def flush(self, base: int) -> int:
        """Scatter every deferred record :meth:`copy_in` did not take into the region at address
        ``base``; returns how many. RuntimeError as :meth:`copy_in`."""
        left, self.deferred = self.deferred, []
        _scatter_records(self.buffer, base, left)
        return len(left)


APPLY_THREADS = max(1, min(4, int(os.environ.get("WT_APPLY_THREADS", 0)) or (os.cpu_count() or 1) - 1))
"""Threads that check and scatter a commit's records (at most 4, at most the host's CPUs but
one; ``WT_APPLY_THREADS`` sets it, 1: in the calling thread). One CPU is left because during
``update_weights`` vLLM's EngineCore busy-polls its reply queue (``sched_yield`` for 1 s after a
read, ``shm_broadcast.py``): on the 2-core VM a second apply thread only shares a core with it
(the RL loop's commit apply p50 8.9 ms with 2 threads, 7.5 ms with 1; alone, with nothing else
running, 2 threads are 1.45x faster: results/delta_apply.md). Why threads and not one C loop: the
records of an update are independent (disjoint spans), the native check and scatter release
the GIL, and a vLLM worker's calling thread is usually pinned to one core by its OpenMP binding
while the others idle during ``update_weights``; the pool's threads are let onto every CPU
the process may use."""
_POOL = None


def _pool():
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor

        _POOL = ThreadPoolExecutor(APPLY_THREADS, thread_name_prefix="wt-apply", initializer=_unpin)
    return _POOL


def _unpin() -> None:
    """Let a pool thread run on every CPU of the process's cpuset (it inherits the creating
    thread's affinity, which an OpenMP binding may have narrowed to one core)."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError, ValueError):
        pass


def _parallel(fn, items: list) -> list:
    """``[fn(x) for x in items]`` in order, on :data:`APPLY_THREADS` threads when there are
    several items. An exception of ``fn`` is raised here."""
    if APPLY_THREADS == 1 or len(items) < 2:
        return [fn(x) for x in items]
    return list(_pool().map(fn, items))


def _records(buf: torch.Tensor, version: int, parts) -> list[tuple]:
    """Every record of ``version`` in landing ``buf``, checked: (record offset, target offset,
    span, runs or chunks, data bytes, index bytes, unit, format 3). Raises :class:`PackedError`
    for a malformed entry or record, or two records whose spans overlap (their scatters would
    race, and a format-3 scatter rewrites whole 64-byte lines of its span)."""
    n = buf.numel()
    d = buf[:DIR_BYTES].view(torch.int64).view(DIR_SLOTS, 8).tolist()
    out, where = [], []
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
            magic, to, span, m, c, ix, ver, q = h
            if magic == MAGIC_REC_V1:
                raise PackedError(f"landing entry {r}: record {k} at {at} is packed format 1 (an 8-byte index per run, "
                                  "an older sender); this receiver reads format 2 (varint index): update the "
                                  "trainer's weight_transfer; nothing scattered")
            size = record_size(ix, c) if ix >= 0 and c >= 0 else -1
            fmt3 = magic == MAGIC_REC3
            if fmt3 and (q != 64 or m < 0 or ix != masks_index_bytes(m) or span > MAX_SPAN_MASKS):
                size = -1
            if magic not in (MAGIC_REC, MAGIC_REC3) or ver != version or m < 0 or c < 0 or ix < 0 or size < 0 \
                    or at + size > ao + used or not 0 < span <= MAX_SPAN or not 1 <= q <= MAX_UNIT:
                raise PackedError(f"landing entry {r}: record {k} at {at} is malformed (magic {magic:#x}, version "
                                  f"{ver}, span {span}, runs {m}, data {c}, index {ix}, unit {q}); nothing scattered")
            if not any(lo <= to and to + span <= hi for lo, hi in parts):
                raise PackedError(f"landing entry {r}: record {k} targets [{to}, {to + span}), outside every part of "
                                  "the registered target region; nothing scattered")
            out.append((at, to, span, m, c, ix, q, fmt3))
            where.append((r, k))
            at += size

    def check(rec):  # one record's index (native: the GIL released, records checked in parallel)
        at, to, span, m, c, ix, q, fmt3 = rec
        idx = buf[at + HEADER:at + HEADER + ix]
        if fmt3:
            masks, chunks = idx[:8 * m].view(torch.int64), idx[8 * m:12 * m].view(torch.int32)
            if lib is not None:
                tot, why = ctypes.c_int64(0), ctypes.c_int64(0)
                bad = lib.wt_check_masks(masks.data_ptr(), chunks.data_ptr(), m, span, ctypes.byref(tot),
                                         ctypes.byref(why))
                return bad, why.value, tot.value
            return check_masks(masks, chunks, span)
        if lib is not None:
            tot, why = ctypes.c_int64(0), ctypes.c_int64(0)
            bad = lib.wt_check_packed(idx.data_ptr(), ix, m, span, q, ctypes.byref(tot), ctypes.byref(why))
            return bad, why.value, tot.value
        bad, why, _, ln = check_index(idx, m, span, q)
        return bad, why, int(ln.sum()) if bad < 0 else 0

    for (r, k), rec, (bad, why, got) in zip(where, out, _parallel(check, out)):
        m, c, ix, span, q, fmt3 = rec[3], rec[4], rec[5], rec[2], rec[6], rec[7]
        what = "chunk" if fmt3 else "run"
        if bad >= 0:
            raise PackedError(f"landing entry {r}: record {k}: {what} {bad} of {m}: {WHY.get(why, why)} (span "
                              f"{span} bytes, unit {q}, index {ix} bytes); nothing scattered")
        if got != c:
            raise PackedError(f"landing entry {r}: record {k}: {what}s carry {got} bytes, header says {c}; "
                              "nothing scattered")
    spans = sorted((rec[1], rec[1] + rec[2], w) for rec, w in zip(out, where))
    for (_a0, a1, wa), (b0, _b1, wb) in zip(spans, spans[1:]):
        if b0 < a1:
            raise PackedError(f"landing records {wa} and {wb} (entry, record) overlap at target bytes [{b0}, "
                              f"{a1}); nothing scattered")
    return out


def apply_landing(buf: torch.Tensor, version: int, base: int, parts, defer=(), deferred: list | None = None) -> dict:
    """Scatter every record of ``version`` in landing buffer ``buf`` (flat uint8 CPU) into the
    target region whose byte 0 is at address ``base`` of this process; ``parts``: the region's
    parts as ``[(lo, hi)]`` offsets from ``base`` (a record's span must lie inside one). Every
    record is checked before any byte is scattered (:class:`PackedError`). With ``defer``
    (``[(lo, hi)]`` offsets) and a ``deferred`` list, format-3 records whose span lies inside one
    of those ranges are appended to ``deferred`` instead of scattered (:meth:`Landing.copy_in`).
    Returns ``{"delta_apply_s", "delta_records", "delta_runs", "delta_bytes", "delta_deferred"}``
    (seconds, counts -- runs or chunks --, bytes, records deferred)."""
    t0 = time.perf_counter()
    recs = _records(buf, version, parts)
    now = recs
    if defer and deferred is not None:
        later = [r for r in recs if r[7] and any(lo <= r[1] and r[1] + r[2] <= hi for lo, hi in defer)]
        deferred.extend(later)
        now = [r for r in recs if r not in later]
    _scatter_records(buf, base, now)
    runs, nbytes = sum(r[3] for r in recs), sum(r[4] for r in recs)
    return {"delta_apply_s": time.perf_counter() - t0, "delta_records": len(recs), "delta_runs": runs,
            "delta_bytes": nbytes, "delta_deferred": len(recs) - len(now)}


def _scatter_records(buf: torch.Tensor, base: int, recs: list) -> None:
    """Scatter checked records ``recs`` (:func:`_records`' tuples) of landing ``buf`` into the
    target region at address ``base``, on :data:`APPLY_THREADS` threads."""
    from ..transport.views import span_view

    lib = _lib()

    def scatter(rec):  # records have disjoint spans: scattered in parallel (native: the GIL released)
        at, to, span, m, c, ix, q, fmt3 = rec
        idx = buf[at + HEADER:at + HEADER + ix]
        data = buf[at + HEADER + ix:at + HEADER + ix + c]
        if fmt3:
            masks, chunks = idx[:8 * m].view(torch.int64), idx[8 * m:12 * m].view(torch.int32)
            if lib is not None:
                return lib.wt_unpack_masks(ctypes.c_void_p(base + to), masks.data_ptr(), chunks.data_ptr(), m,
                                           data.data_ptr(), c, span) == c
            if m:
                span_view(base + to, span)[_mask_positions(masks, chunks)] = data
            return True
        if lib is not None:
            return lib.wt_unpack(ctypes.c_void_p(base + to), idx.data_ptr(), ix, data.data_ptr(), m, span, q) == c
        if m:
            _, _, st, ln = check_index(idx, m, span, q)
            span_view(base + to, span)[_byte_index(st, ln)] = data
        return True

    for rec, ok in zip(recs, _parallel(scatter, recs)):
        if not ok:
            raise RuntimeError(f"packed record at {rec[0]}: the scatter disagrees with its check (a bug)")
