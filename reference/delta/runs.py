"""Delta updates: each sender writes only the byte runs of its outputs that differ from what it
last wrote there (``ExecutorOptions(delta=True)``, ``weight-transfer run --delta``).

The plan stays static: every write of the schedule still names one whole output and one
receiver. Per update, for every output a write reads (a view of a shard, or a slot the prepare
stage built in the output pool), the sender compares the output's bytes exactly with its
*shadow* -- a copy of what it wrote there last time -- at ``granularity`` bytes (blocks counted
from the output's first byte), coalesces changed blocks into runs (adjacent ones, and ones
separated by fewer than ``merge_gap`` unchanged bytes: writing those is cheaper than another
op), posts one op per run and receiver instead of one op per output and receiver, and copies
the changed blocks into the shadow. The receiver is passive as before (it holds exactly what
the sender wrote last, so unchanged bytes are already right) and the version protocol is the
control plane's, unchanged: ``writing v`` before the first byte, ``complete v`` after the last.

Memory on the trainer: one shadow byte per byte of every distinct output this rank writes (an
output written to several receivers, e.g. DP replicas, is compared and shadowed once), in one
buffer on the executor's device, allocated when the executor is built:
:attr:`DeltaState.shadow_bytes` (the log line and the run's ``delta_shadow_bytes`` column say
it). ``max_bytes`` bounds it: an executor whose plan needs more is refused at construction,
naming both numbers (``--delta-max-mb``).

When the receiver may not hold what the shadow says (case C26), the next update is **full**
(every output written whole, the shadow refreshed):

- the first update of an executor (a new plan, a new membership, a new receiver: every
  replan builds a new executor, so a newcomer's first update is full for every sender);
- after any update of this executor that failed or was aborted (``run`` raised);
- after an update that did not end ``complete`` in the control plane (another rank failed, a
  commit failed): :func:`check_published` reads the persistent ``complete/{v}`` key the
  coordinator sets when it publishes (checked by :class:`weight_transfer.api.Sender` before
  every update);
- when a receiver's descriptor changed since the last update (another epoch, key or address:
  the region was re-registered);
- :meth:`DeltaState.invalidate` (a caller that knows better).

Granularity and merge gap (``granularity`` 8 bytes for a delta that never packs, 1 byte for one
that may: :func:`default_granularity`; ``merge_gap`` 0; chosen from the RL loop's measured
change fractions, docs/DELTA.md). A real RL step at lr 1e-6 changes ~1.2-1.3% of the bf16
elements and ~0.11% of the FP8 ones, uniformly scattered; a block of ``g`` bytes then changes with
probability ``1 - (1 - p)^(g / element size)``, and that is the fraction of bytes a delta writes:

=========  ===================  ======================  ==========================
block (B)  bf16 bytes, p=1.28%   FP8 bytes, p=0.11%      runs per MB (bf16, gap 0)
=========  ===================  ======================  ==========================
2          1.3%                 (0.2%)                  ~6300
8          5.0%                 0.9%                    ~5900
16         9.8%                 1.7%                    ~5500
128        56%                  13%                     ~1900
=========  ===================  ======================  ==========================

So the 128-byte rows of issue 26's first delta carried ~55% of a bf16 update; 16 bytes sits at
the 10% line, 8 bytes (4 bf16 or 8 FP8 elements, one 64-bit word) halves it while the number of
runs -- about one per changed element either way -- barely moves: for scattered runs, which
cost a remote segment each, 8 is the default. A packed run costs its bytes plus ~2 bytes of
index, so a delta that may pack compares bytes (most bf16 elements of a small step change only
in their low byte: 3.6% of the bytes in records at 1-byte blocks, 4.5% at 2, 10.7% at 8, on the
lr 1e-6 steps). The comparison is native code (``_delta.c``, :func:`changed_runs_native`): one
pass over the output and its shadow, whole 64-byte chunks skipped at once when equal, blocks of
1, 2, 4 or 8 bytes found a 64-bit word at a time (a lane mask, one bit scan per changed block:
as fast at 1 byte as at 8), the shadow updated in the same pass, the runs written
into int64 start/length arrays (no Python per run); the transports post such arrays as one op
(:class:`weight_transfer.transport.base.RunsOp`: ``process_vm_writev`` with 1024 iovecs per
call from C for cma, a C loop of memcpy into the receiver's mapping for shm).

**How each changed output is written** is the per-output cost model's choice
(:mod:`weight_transfer.delta.cost`, ``delta_mode``): ``scattered`` runs (one ``RunsOp``, a remote
segment per run: cma ~300 ns each, the kernel pins the remote pages of every iovec), one
``packed`` record (the runs' index and bytes in one contiguous write into the receiver's landing
region, scattered by its commit: :mod:`weight_transfer.delta.packed`), or the ``full`` output,
from the measured per-run cost, the wire's cost per byte (``delta_wire_gbps``) and the pack and
apply costs. A packed record carries the runs (format 2) or, where the wire is fast, the changed
64-byte chunks' byte masks (format 3: :class:`Masks`, :func:`changed_masks`; packed or whole,
never scattered), as the cost model chooses once per executor (``delta_format``,
:attr:`DeltaState.format`). The comparison stops as soon as no delta mode can beat the whole output
(:meth:`~weight_transfer.delta.cost.CostModel.max_runs`). ``delta_op_cost`` (bytes at the wire
per run) overrides the run cost; ``0`` makes runs free (scattered always, the fewest bytes).
Where an output is a plain fp32 -> bf16 cast, the comparison is fused into the prepare stage's
cast (:mod:`weight_transfer.delta.fused`). Every write's mode is recorded per tensor
(:attr:`DeltaState.tensors`, the step record's ``delta_modes`` / ``delta_tensors``).

"""
from __future__ import annotations

import ctypes
import time

import torch

from ..native.delta import KERNEL
from .masks import Masks, changed_masks

__all__ = ["DeltaState", "Masks", "changed_masks", "changed_runs", "changed_runs_native", "check_published", "native_status",
           "default_granularity", "index_size", "COMPLETE_KEY"]

COMPLETE_KEY = "complete/{version}"
"""Control-plane key the coordinator sets when it publishes ``complete version`` (persistent:
later states overwrite ``weights``, not this)."""


def native_status() -> str:
    """``"ok"`` when the native kernel is loaded, else why not."""
    return KERNEL.status()


class Runs:
    """Byte runs of one output as two int64 CPU tensors ``starts`` and ``lens`` (bytes from the
    output's first byte; ascending, disjoint, non-empty). Iterates as ``(start, length)`` pairs
    and compares equal to such a list (for tests); ``nbytes``: bytes the runs cover."""

    __slots__ = ("starts", "lens", "nbytes", "mode", "data", "index", "vals")

    def __init__(self, starts: torch.Tensor, lens: torch.Tensor, nbytes: int | None = None):
        self.starts, self.lens = starts, lens
        self.nbytes = int(lens.sum()) if nbytes is None else nbytes
        self.mode = "scattered"
        """How the cost model writes them: ``"scattered"`` or ``"packed"``."""
        self.data = None
        """The output's bytes (flat uint8) the runs index, for packing."""
        self.index = None
        """``(asked unit, unit, index bytes)`` of their packed record, once the cost model sized it
        (:func:`index_size`) or the native comparison counted it."""
        self.vals = None
        """int64 per run: the bytes of each run of at most 8 bytes as the native comparison took
        them (little-endian, zero-padded), so that packing does not read the output again; None
        when not taken."""

    def __len__(self) -> int:
        return self.starts.numel()

    def __iter__(self):
        return iter(zip(self.starts.tolist(), self.lens.tolist()))

    def __eq__(self, other) -> bool:
        if isinstance(other, Runs):
            other = list(other)
        return list(self) == list(other)

    def __repr__(self) -> str:
        return f"Runs({len(self)} runs, {self.nbytes} bytes)"


_EMPTY = torch.empty(0, dtype=torch.int64)


def _words(t: torch.Tensor, g: int) -> torch.Tensor:
    """``t`` (flat uint8, whole ``g``-byte blocks) viewed as the widest integers that divide a
    block and that its address allows."""
    for dt, k in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if g % k == 0 and t.numel() % k == 0 and t.data_ptr() % k == 0:
            return t.view(dt)
    return t


def changed_blocks(new: torch.Tensor, old: torch.Tensor, granularity: int) -> torch.Tensor:
    """Bool per ``granularity``-byte block of flat uint8 ``new`` (the last one may be short):
    True where any byte differs from ``old``."""
    n = new.numel()
    g = granularity
    body = (n // g) * g
    parts = []
    if body:
        a, b = _words(new[:body], g), _words(old[:body], g)
        parts.append((a != b).view(n // g, -1).any(1))
    if body < n:
        parts.append(torch.ne(new[body:], old[body:]).any().view(1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def changed_runs(new: torch.Tensor, old: torch.Tensor, granularity: int = 128,
                 merge_gap: int = 0) -> list[tuple[int, int]]:
    """Byte runs ``[(start, length)]`` of flat uint8 ``new`` that differ from ``old`` at
    ``granularity``-byte blocks (a run covers whole blocks, the last one clipped to the end),
    adjacent changed blocks coalesced, runs separated by at most ``merge_gap`` unchanged bytes
    merged. Empty when nothing changed."""
    n = new.numel()
    if n == 0:
        return []
    m = changed_blocks(new, old, granularity)
    idx = m.nonzero().flatten()
    if idx.numel() == 0:
        return []
    gap_blocks = max(0, merge_gap // granularity)
    brk = ((idx[1:] - idx[:-1]) > gap_blocks + 1).nonzero().flatten()
    starts = torch.cat([idx[:1], idx[brk + 1]])
    ends = torch.cat([idx[brk], idx[-1:]]) + 1
    s = (starts * granularity).tolist()
    e = (ends * granularity).clamp_(max=n).tolist()
    return [(a, b - a) for a, b in zip(s, e)]


def changed_runs_native(new: torch.Tensor, old: torch.Tensor, granularity: int = 8, merge_gap: int = 0, *,
                     update: bool = True, max_runs: int | None = None, inline: bool = False) -> Runs | None:
    """The runs of :func:`changed_runs` as :class:`Runs` (vectorized: the native kernel, else
    torch), and with ``update`` the shadow ``old`` made equal to ``new`` (flat uint8 CPU tensors of
    one length). ``max_runs``: None (returned) when there would be more runs than that (then
    ``old`` is refreshed whole when ``update``). The native kernel also counts the runs' packed
    index (:attr:`Runs.index`, in units of ``granularity``) and, with ``inline``, takes the bytes
    of every run of at most 8 bytes (:attr:`Runs.vals`) for packing."""
    n = new.numel()
    if n == 0:
        return Runs(_EMPTY, _EMPTY, 0)
    lib = KERNEL.lib() if new.device.type == "cpu" and update else None
    cap = (n + granularity - 1) // granularity // 2 + 1 + (merge_gap == 0)
    if max_runs is not None:
        cap = min(cap, max_runs)
    if lib is not None:
        st = torch.empty(cap, dtype=torch.int64)
        ln = torch.empty(cap, dtype=torch.int64)
        vals = torch.empty(cap, dtype=torch.int64) if inline else None
        tot, ixb = ctypes.c_int64(0), ctypes.c_int64(0)
        m = lib.wt_delta_runs(new.data_ptr(), old.data_ptr(), n, granularity, merge_gap, st.data_ptr(),
                              ln.data_ptr(), cap, ctypes.byref(tot), None if vals is None else vals.data_ptr(),
                              ctypes.byref(ixb))
        if m < 0:
            old.copy_(new)
            return None
        return _native_runs(st, ln, vals, m, tot.value, granularity, ixb.value)
    m = changed_blocks(new, old, granularity)
    idx = m.nonzero().flatten()
    if idx.numel() == 0:
        return Runs(_EMPTY, _EMPTY, 0)
    gap_blocks = max(0, merge_gap // granularity)
    brk = ((idx[1:] - idx[:-1]) > gap_blocks + 1).nonzero().flatten()
    starts = torch.cat([idx[:1], idx[brk + 1]]) * granularity
    ends = ((torch.cat([idx[brk], idx[-1:]]) + 1) * granularity).clamp_(max=n)
    if update:
        old.copy_(new)
    if max_runs is not None and starts.numel() > max_runs:
        return None
    return Runs(starts.cpu(), (ends - starts).cpu())


def _native_runs(st: torch.Tensor, ln: torch.Tensor, vals: torch.Tensor | None, m: int, nbytes: int, unit: int,
                 ixb: int) -> Runs:
    """The first ``m`` runs a native comparison wrote, with the packed index bytes it counted
    (in units of ``unit``, the compare block) and the run values it took (``vals``, or None)."""
    r = Runs(st[:m], ln[:m], nbytes)
    r.index = (unit, unit, ixb)
    r.vals = None if vals is None else vals[:m]
    return r


class DeltaState:
    """One executor's delta bookkeeping: the shadow of every output its writes read, whether
    the next update must be full (the module docstring), and per output the cost model's choice
    (:class:`weight_transfer.delta.cost.CostModel`: scattered runs, a packed record, or whole).
    ``places``: the executor's :attr:`weight_transfer.pipeline.memory.RegisteredMemory.places` (per task,
    per assignment, per output: None or an object with ``nbytes``). ``cost``: the cost model
    (default: scattered only, ``op_cost_bytes`` per run at 1 byte/s, the first delta's rule
    ``runs x op_cost_bytes + changed >= size`` -> whole); ``packer``: a
    :class:`weight_transfer.delta.packed.Packer` (None: nothing is packed); ``names``: key ->
    destination tensor name, for the per-tensor record. Raises ValueError when the shadow would
    exceed ``max_bytes``."""

    def __init__(self, places, *, device, granularity: int | None = 8, merge_gap: int = 0,
                 max_bytes: int | None = None, rank: int = 0, op_cost_bytes: int = 0, cost=None, packer=None,
                 names: dict | None = None):
        from .cost import CostModel

        if granularity is None:
            granularity = default_granularity(packer is not None and getattr(cost, "mode", "scattered") != "scattered")
        if granularity < 1 or merge_gap < 0 or op_cost_bytes < 0:
            raise ValueError(f"delta: granularity={granularity} (bytes >= 1), merge_gap={merge_gap} (bytes >= 0), "
                             f"op_cost_bytes={op_cost_bytes} (bytes >= 0)")
        self.granularity, self.merge_gap, self.op_cost_bytes = granularity, merge_gap, op_cost_bytes
        self.cost = cost if cost is not None else CostModel(wire_s_per_byte=1.0, run_s=float(op_cost_bytes),
                                                            mode="scattered")
        self.packer = packer
        self.names = names or {}
        self.seconds = 0.0
        """Seconds this update spent comparing, building runs and updating the shadow (reset by
        :meth:`begin`)."""
        self.whole = 0
        """Outputs of this update written whole by the cost model (reset by :meth:`begin`)."""
        self.tensors: list[tuple[str, str, str, int, int, int]] = []
        """This update's writes: ``(tensor, kind, mode, output bytes, bytes written, runs)``,
        mode ``full``, ``scattered`` (or ``unchanged``: nothing written) or ``packed`` (bytes
        written: the record's)."""
        self.runs_op = None
        """:class:`weight_transfer.transport.runs.RunsOp` (set by the executor: that module imports
        this one's kernel)."""
        self.fused: dict = {}
        """key -> :class:`Runs` the prepare stage's fused cast + compare found this update
        (:mod:`weight_transfer.delta.fused`; the shadow is already updated)."""
        self._at: dict[tuple[int, int, int], tuple[int, int]] = {}
        off = 0
        for i, per_a in enumerate(places):
            for j, outs in enumerate(per_a):
                for k, p in enumerate(outs):
                    if p is not None and p.nbytes:
                        self._at[(i, j, k)] = (off, p.nbytes)
                        off += p.nbytes
        self.shadow_bytes = off
        """Bytes of the shadow (one per byte of every distinct output this rank writes)."""
        if max_bytes is not None and off > max_bytes:
            raise ValueError(
                f"rank {rank}: delta updates need a shadow of {off} bytes ({off / 2**20:.1f} MiB: a copy of every "
                f"output this rank writes) but delta_max_bytes is {max_bytes} ({max_bytes / 2**20:.1f} MiB); raise "
                "--delta-max-mb, train on more ranks (smaller shares), or run without --delta")
        self.shadow = torch.empty(off, dtype=torch.uint8, device=device)
        self.format = (self.cost.pack_format() if packer is not None and getattr(packer, "nbytes", 0) > 0
                       and self.cost.mode != "scattered" and KERNEL.lib() is not None else "runs")
        """The packed records' format this executor writes: ``"masks"`` (format 3: every changed
        output packed or whole, compared in 64-byte chunks at 1-byte granularity) or ``"runs"``
        (format 2, and scattered runs; always without a packer or the native kernel)."""
        self.full_reason: str | None = "first update"
        """Why the next update is full (None: it is a delta)."""
        self.last_version: int | None = None
        """The version of the last update this executor completed (its writes all landed)."""
        self._sig = None
        self.full = True
        """Whether the update in progress is full."""

    def invalidate(self, reason: str) -> None:
        """Make the next update full (``reason`` says why; the first reason wins)."""
        if self.full_reason is None:
            self.full_reason = reason

    def begin(self, remote: dict, version: int = 0) -> bool:
        """Before update ``version``: decide full or delta (returns True for full). ``remote``:
        the executor's inference rank -> descriptor, landing regions included (a changed
        descriptor forces full)."""
        sig = {r: (d.pid, d.addr, d.length, d.key, d.epoch) for r, d in remote.items()}
        if self._sig is not None and sig != self._sig:
            changed = sorted(r for r in set(sig) | set(self._sig) if sig.get(r) != self._sig.get(r))
            self.invalidate(f"receiver region(s) of inference rank(s) {changed} re-registered or new")
        self._sig = sig
        self.full = self.full_reason is not None
        self.reason = self.full_reason
        self.seconds, self.whole, self.tensors, self.fused = 0.0, 0, [], {}
        if self.packer is not None:
            self.packer.begin(version)
        self.full_reason = "an update in progress did not finish"  # cleared by end(ok=True)
        return self.full

    def end(self, version: int | None, ok: bool) -> None:
        """After an update: ``ok`` False (it raised) makes the next one full."""
        if ok:
            self.full_reason = None
            self.last_version = version
        else:
            self.full_reason = f"the update to version {version} failed"

    def runs(self, key: tuple[int, int, int], data: torch.Tensor) -> Runs | None:
        """The runs of output ``key`` (task index, assignment, output) to write now, its bytes
        ``data`` (flat uint8, ``nbytes`` of the plan): None for the whole output (a full update,
        or the cost model prefers it), else the changed runs as :class:`Runs` (possibly none)
        with :attr:`Runs.mode` the cost model's choice. The shadow takes ``data``'s changed bytes
        (all of them in a full update)."""
        at = self._at.get(key)
        if at is None:
            return None
        t0 = time.perf_counter()
        try:
            off, n = at
            old = self.shadow[off:off + n]
            if self.full:
                old.copy_(data)
                return None
            packable = self.packer is not None and self.packer.nbytes > 0 and data.device.type == "cpu"
            seg = self.fused.pop(key, None)
            packs = packable and self.cost.mode != "scattered"
            if self.format == "masks" and packs:
                if seg is None:
                    seg = changed_masks(data, old, max_chunks=self.cost.max_chunks(n))
                elif seg is False:
                    seg = None
                mode = ("full" if seg is None else self.cost.choose_masks(n, len(seg), seg.nbytes, True)
                        if len(seg) else "packed")
                if mode == "full":
                    if seg is not None:
                        seg.fill()
                    self.whole += 1
                    return None
                seg.mode, seg.data = mode, data
                return seg
            if seg is None:
                seg = changed_runs_native(data, old, self.granularity, self.merge_gap,
                                          max_runs=self.cost.max_runs(n, packable), inline=packs)
            elif seg is False:
                seg = None  # the fused pass found too many runs (the shadow is refreshed)
            ix = None
            if seg is not None and len(seg) and packs:
                if seg.index is None or seg.index[0] != self.granularity:
                    q, ix = index_size(seg, n, self.granularity)
                    seg.index = (self.granularity, q, ix)
                ix = seg.index[2]
            mode = ("full" if seg is None else self.cost.choose(n, len(seg), seg.nbytes, packable, index_bytes=ix)
                    if len(seg) else "scattered")
            if mode == "full":
                self.whole += 1
                return None
            seg.mode, seg.data = mode, data
            return seg
        finally:
            self.seconds += time.perf_counter() - t0

    def ops(self, key, r: Runs | None, region, local_offset: int, remote, remote_offset: int, length: int,
            dst: int) -> list:
        """The ops of one planned write of output ``key`` (``r``: what :meth:`runs` returned):
        a :class:`~weight_transfer.transport.base.WriteOp` of the whole output, a
        :class:`~weight_transfer.transport.runs.RunsOp` of its runs, or the packed record's
        write into inference rank ``dst``'s landing region (a record that does not fit goes
        scattered or whole, whichever costs less); none when nothing changed."""
        from ..transport.base import WriteOp

        RunsOp = self.runs_op
        name = self.names.get(key, "?")
        if r is None:
            self.tensors.append((name, _kind(name), "full", length, length, 0))
            return [WriteOp(region, local_offset, remote, remote_offset, length)]
        if not len(r):
            self.tensors.append((name, _kind(name), "unchanged", length, 0, 0))
            return []
        masks = isinstance(r, Masks)
        mode = r.mode
        if mode == "packed":
            op = (self.packer.pack_masks(dst, r, remote_offset, length) if masks
                  else self.packer.pack(dst, r.data, r, remote_offset, length, unit=self.granularity))
            if op is not None:
                self.tensors.append((name, _kind(name), "packed", length, op.length, r.runs if masks else len(r)))
                return [op]
            # did not fit: format 3 (no scattered mode) whole, format 2 runs or whole
            mode = "full" if masks else self.cost.choose(length, len(r), r.nbytes, False)
        if mode == "full":
            if masks:
                r.fill()  # the fused pass left the pool slot unwritten
            self.whole += 1
            self.tensors.append((name, _kind(name), "full", length, length, 0))
            return [WriteOp(region, local_offset, remote, remote_offset, length)]
        self.tensors.append((name, _kind(name), "scattered", length, r.nbytes, len(r)))
        return [RunsOp(region, local_offset, remote, remote_offset, length, r.starts, r.lens)]

    def summary(self) -> dict[str, dict[str, list[int]]]:
        """This update's writes per mode and tensor kind: ``{mode: {kind: [writes, bytes written,
        output bytes]}}``."""
        out: dict[str, dict[str, list[int]]] = {}
        for _name, kind, mode, n, wrote, _runs in self.tensors:
            e = out.setdefault(mode, {}).setdefault(kind, [0, 0, 0])
            e[0] += 1
            e[1] += wrote
            e[2] += n
        return out


def _vlen(v: torch.Tensor) -> torch.Tensor:
    """LEB128 bytes of each value of int64 ``v`` (>= 0)."""
    n = torch.ones_like(v)
    for k in range(1, 9):
        n += (v >= (1 << (7 * k))).to(v.dtype)
    return n


def _units(starts: torch.Tensor, lens: torch.Tensor, span: int, unit: int) -> torch.Tensor | None:
    """The varint values of runs (int64 tensors) in units of ``unit``: ``[gap0, len0, gap1, ...]``,
    or None when a run is not whole units (the last may end at ``span``) or the runs are not
    ascending, non-empty and inside ``[0, span)``."""
    ends = starts + lens
    gaps = starts - torch.cat([torch.zeros(1, dtype=torch.int64), ends[:-1]])
    ok = (gaps >= 0) & (lens > 0) & (ends <= span) & (gaps % unit == 0) & ((lens % unit == 0) | (ends == span))
    if not bool(ok.all()):
        return None
    return torch.stack([gaps // unit, (lens + unit - 1) // unit], 1).flatten()


def index_size(runs, span: int, unit: int) -> tuple[int, int]:
    """``(unit, index bytes)`` of ``runs`` (:class:`Runs`) in a packed record of ``span`` bytes
    (:mod:`weight_transfer.delta.packed`, format 2; C ``wt_index_bytes``, else torch): in units
    of ``unit`` bytes when every run is whole units, else of 1 byte. ValueError when the runs
    are not ascending, non-empty and inside the span."""
    lib = KERNEL.lib()
    m = len(runs)
    for q in ((unit, 1) if unit > 1 else (1,)):
        if not m:
            return q, 0
        if lib is not None:
            ix = lib.wt_index_bytes(runs.starts.data_ptr(), runs.lens.data_ptr(), m, span, q)
        else:
            v = _units(runs.starts, runs.lens, span, q)
            ix = -1 if v is None else int(_vlen(v).sum())
        if ix >= 0:
            return q, ix
    raise ValueError(f"packed record: {m} runs are not ascending, non-empty and inside a span of {span} bytes")


PACKED_GRANULARITY = 1
"""Default compare block of a delta that may pack (``delta_mode`` packed or auto with a landing
region; bytes). A packed run costs its bytes plus ~2 bytes of varint index whatever its length,
and a small RL step changes only the low byte of most bf16 elements: on the RL loop's lr 1e-6
steps 1-byte blocks put 3.6% of a full bf16 update in the records, 2-byte (the element) 4.5%,
8-byte 10.7% (docs/DELTA.md, "Packed delta and the fused compare"); FP8's element is 1 byte."""
SCATTERED_GRANULARITY = 8
"""Default compare block of a delta that never packs (bytes): a scattered run costs a remote
segment whatever its length, so one 64-bit word per block (issue 26's measurement)."""


def default_granularity(packs: bool) -> int:
    """The compare block (bytes) when ``delta_granularity`` is not given: :data:`PACKED_GRANULARITY`
    when the delta may pack, else :data:`SCATTERED_GRANULARITY`."""
    return PACKED_GRANULARITY if packs else SCATTERED_GRANULARITY


def _kind(name: str) -> str:
    from .changes import tensor_kind

    return tensor_kind(name)


def check_published(executor, store) -> None:
    """Before an update (:class:`weight_transfer.api.Sender`): when ``executor`` runs delta
    updates and the version it last wrote was not published complete (``complete/{v}`` unset:
    another rank or a commit failed, C26), make its next update full. A no-op otherwise."""
    d = getattr(executor, "delta", None)
    if d is None or d.last_version is None or d.full_reason is not None:
        return
    if not store.check([COMPLETE_KEY.format(version=d.last_version)]):
        d.invalidate(f"version {d.last_version} was not published complete")
