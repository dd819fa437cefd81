"""The memory a training rank's writes read from, registered with the transport once.

The published design registers memory once at initialization and replays a static plan; a
registration per update costs an ``ibv_reg_mr`` per buffer per NIC on verbs (pinning pages,
milliseconds per GiB), a registration with UCX on NIXL, a handle export on CUDA IPC.
:class:`RegisteredMemory` does it once, when the executor is built, for every byte its plan's
writes read:

- outputs that are *views of a shard* (plain recipes of local tasks,
  :func:`weight_transfer.convert.transforms.output_view`) are written from the shard's own storage,
  registered whole (one region per distinct storage; the trainer updates it in place);
- every other output (fused bands, casts, FP8 weight and scales, runtime layouts, slices of
  gathered sources) is built by prepare straight into a slot of the :class:`OutputPool`: one
  preallocated buffer, one region, reused across updates, sized by the watermark.

:class:`SetupStats` says what it cost (regions, bytes, seconds). Units: bytes, seconds.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from ..convert.transforms import output_nbytes, output_view
from ..transport.base import Region, Segments, WriteOp
from ..types import RegionDescriptor, Task
from .tasks import DIRECT

__all__ = ["POOL_ALIGN", "POOL_DEFAULT", "OutputPool", "RegisteredMemory", "SetupStats", "built_bytes"]

POOL_ALIGN = 64
"""Byte alignment of every output slot in the pool (a cache line; any dtype view of a slot is
aligned)."""
POOL_DEFAULT = 256 << 20
"""Pool bytes without a watermark (at least the largest task's, at most what the plan pools)."""


def _align(n: int) -> int:
    return -(-n // POOL_ALIGN) * POOL_ALIGN


class OutputPool:
    """Preallocated output buffers: one buffer of ``nbytes`` bytes (registered once as one
    region), handed out as contiguous chunks, one per task, in the order tasks are admitted, and
    taken back when the task is released (after its batch completed), as a ring: a chunk goes at
    the head, or at the start when it does not fit before the end; a chunk given back out of
    order (after an abort) is reclaimed once every earlier one is. :meth:`acquire` waits while
    the chunk does not fit; a chunk as large as the whole pool fits once nothing else is held,
    so a task larger than the rest of the pool waits for the earlier tasks, never for a later one
    (no deadlock: releases come from later stages, which never wait on admission)."""

    def __init__(self, buffer: torch.Tensor, region: Region | None):
        self.buffer, self.region = buffer, region
        self.nbytes = buffer.numel()
        self._held: deque[list] = deque()  # [offset, nbytes, live] in acquisition order
        self._cond = threading.Condition()
        self.in_use = 0
        """Bytes of the chunks held now."""
        self.peak = 0
        """Most bytes held at once (since the last :meth:`reset`)."""

    def _fit(self, n: int) -> int | None:
        if not self._held:
            return 0 if n <= self.nbytes else None
        first, last = self._held[0], self._held[-1]
        tail, head = first[0], last[0] + last[1]
        if last[0] >= first[0]:  # not wrapped: free are [head, end) and [0, tail)
            if head + n <= self.nbytes:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None  # wrapped: free is [head, tail)

    def acquire(self, n: int, abort: threading.Event | None = None) -> int:
        """A chunk of ``n`` bytes: its offset in :attr:`buffer` (0 for ``n == 0``, nothing held).
        Blocks until it fits; RuntimeError when ``abort`` is set while waiting or ``n`` exceeds
        the pool."""
        if n <= 0:
            return 0
        if n > self.nbytes:
            raise RuntimeError(f"output pool: a task needs {n} bytes, the pool holds {self.nbytes}")
        with self._cond:
            while (off := self._fit(n)) is None:
                if abort is not None and abort.is_set():
                    raise RuntimeError("aborted while waiting for output pool space")
                self._cond.wait(0.05)
            self._held.append([off, n, True])
            self.in_use += n
            self.peak = max(self.peak, self.in_use)
            return off

    def release(self, off: int, n: int) -> None:
        """Give back the chunk of ``n`` bytes at ``off`` (``n == 0``: nothing)."""
        if n <= 0:
            return
        with self._cond:
            for e in self._held:
                if e[0] == off and e[2]:
                    e[2] = False
                    break
            else:
                raise RuntimeError(f"output pool: no chunk held at offset {off}")
            self.in_use -= n
            while self._held and not self._held[0][2]:
                self._held.popleft()
            self._cond.notify_all()

    def reset(self) -> None:
        """Forget every chunk (at the start of an update: the previous one has ended)."""
        with self._cond:
            self._held.clear()
            self.in_use = self.peak = 0


@dataclass(slots=True)
class SetupStats:
    """What registering a rank's write memory once cost (:class:`RegisteredMemory`): regions,
    bytes and seconds, per transport. ``register_seconds`` is the time inside
    ``transport.register`` (pinning pages on verbs, a registration with UCX on NIXL, a handle
    export on CUDA IPC; bookkeeping only on CMA); ``allocate_seconds`` is the time to allocate
    and touch the pool."""

    transport: str = "?"
    """The transport's name."""
    n_regions: int = 0
    """Regions registered: :attr:`source_regions` + 1 for the pool (0 when nothing is pooled)."""
    registered_bytes: int = 0
    """Bytes registered: shard storages + the pool."""
    register_seconds: float = 0.0
    """Seconds spent in ``transport.register`` at setup."""
    source_regions: int = 0
    """Parameter shard storages registered (outputs that are views of a shard are written from them)."""
    source_bytes: int = 0
    """Bytes of those storages."""
    pool_bytes: int = 0
    """Bytes of the output pool (fused, cast, quantized and gathered outputs are built there)."""
    pooled_bytes: int = 0
    """Bytes of outputs built in the pool per update (the plan's; each output once)."""
    direct_bytes: int = 0
    """Bytes of outputs that are not a view of one shard but are written straight from the
    shards anyway, as several pieces or :class:`~weight_transfer.transport.base.Segments` (fused
    bands, TP slices along dim 1): nothing is built for them."""
    allocate_seconds: float = 0.0
    """Seconds to allocate and touch the pool."""
    pool_replaced: int = 0
    """Times the pool was replaced by a new one (registered again) because a batch reading from
    it timed out and may still be in flight (a failed update; never otherwise)."""

    def summary(self) -> str:
        """One line: ``registered once (cma): 3 regions, 0.962 GB (2 shard storages 0.700 GB +
        pool 0.262 GB) in 0.0001 s; per update 0.001 GB built in the pool, 0.340 GB of fused or
        strided outputs written from the shards in pieces``."""
        return (f"registered once ({self.transport}): {self.n_regions} regions, {self.registered_bytes / 1e9:.3f} GB "
                f"({self.source_regions} shard storages {self.source_bytes / 1e9:.3f} GB + pool "
                f"{self.pool_bytes / 1e9:.3f} GB) in {self.register_seconds:.4f} s; per update "
                f"{self.pooled_bytes / 1e9:.3f} GB built in the pool, {self.direct_bytes / 1e9:.3f} GB of fused or "
                "strided outputs written from the shards in pieces")


class _Src:
    """An output written from a registered shard storage (its region and base address)."""

    __slots__ = ("region", "base", "nbytes")

    def __init__(self, region: Region, base: int, nbytes: int):
        self.region, self.base, self.nbytes = region, base, nbytes


class _Parts:
    """An output written straight from the shards' storages as one or more write pieces: a
    fused band (``qkv_proj``: its q, k, v rows), a TP slice along dim 1 (a column slice of
    row-major rows), or both; nothing is built. ``parts``: (region, local offset, output offset,
    bytes, :class:`~weight_transfer.transport.base.Segments` or None), in output order, tiling
    the output; ``sources``: (name, storage address at setup) of every shard read."""

    __slots__ = ("parts", "nbytes", "sources")

    def __init__(self, parts, nbytes: int, sources):
        self.parts, self.nbytes, self.sources = parts, nbytes, sources


class _Slot:
    """An output built in the pool, ``rel`` bytes into its task's chunk."""

    __slots__ = ("rel", "nbytes", "build")

    def __init__(self, rel: int, nbytes: int, build: bool):
        self.rel, self.nbytes, self.build = rel, nbytes, build


def _local(p) -> torch.Tensor:
    """The rank's local shard of ``p`` (``p`` itself for a plain tensor). Under ``no_grad``:
    :meth:`DTensor.to_local` with autograd on goes through an autograd Function (~80 us a call;
    the write thread, where :meth:`RegisteredMemory.ops` checks every shard's storage each
    update, does not inherit the prepare thread's ``no_grad``), without it returns the local
    tensor itself."""
    if not isinstance(p, DTensor):
        return p
    with torch.no_grad():
        return p.to_local()


def direct_runs(recipe, get) -> list[tuple[torch.Tensor, int, int, int]] | None:
    """Where every byte of a ``"copy"`` recipe's one output lives, when the output is nothing but
    its sources' bytes in order (same dtype, identity layout, no zero fill: a fused band, a
    strided TP slice) and so can be written without building it: (source view's storage owner,
    storage byte offset, output byte offset, bytes) per contiguous run, in output order, adjacent
    runs of one storage merged. None when the output must be built (a cast, another layout,
    FP8, zero pieces, pieces that do not tile the output exactly). ``get(name)``: the source
    tensor the recipe's ``src_box`` indexes (a rank's ``to_local()`` shard)."""
    import numpy as np

    from ..convert.layouts import IDENTITY
    from ..types import torch_dtype

    if recipe.transform != "copy" or len(recipe.outputs) != 1:
        return None
    o = recipe.outputs[0]
    if o.layout != IDENTITY or o.dtype != recipe.assembled_dtype:
        return None
    dt = torch_dtype(recipe.assembled_dtype)
    isz = dt.itemsize
    shape = tuple(recipe.shape)
    cstride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        cstride[d] = cstride[d + 1] * shape[d + 1]
    runs = []  # (output offset, storage key, storage offset, bytes, tensor)
    for p in recipe.pieces:
        if p.source is None:
            return None
        try:
            v = get(p.source)[tuple(slice(a, b) for a, b in p.src_box)]
        except (KeyError, IndexError, RuntimeError, ValueError):
            return None
        if v.dtype != dt:
            return None
        box = p.dst_box
        sizes = [b - a for a, b in box]
        if v.dim() < len(sizes):
            if any(n != 1 for n in sizes[:len(sizes) - v.dim()]):
                return None
            vsz, vst = [1] * (len(sizes) - v.dim()) + list(v.shape), [0] * (len(sizes) - v.dim()) + list(v.stride())
        else:
            vsz, vst = list(v.shape), list(v.stride())
        if vsz != sizes or 0 in sizes:
            return None
        dims = [(n, ds, ss) for n, ds, ss in zip(sizes, cstride, vst) if n != 1]
        run, k = 1, len(dims)
        while k and dims[k - 1][1] == run and dims[k - 1][2] == run:
            run *= dims[k - 1][0]
            k -= 1
        doff = np.array([sum(a * st for (a, _), st in zip(box, cstride))], dtype=np.int64)
        soff = np.array([v.storage_offset()], dtype=np.int64)
        for n, ds, ss in dims[:k]:
            ar = np.arange(n, dtype=np.int64)
            doff = (doff[:, None] + ar[None, :] * ds).reshape(-1)
            soff = (soff[:, None] + ar[None, :] * ss).reshape(-1)
        key = v.untyped_storage().data_ptr()
        for a, b in zip((doff * isz).tolist(), (soff * isz).tolist()):
            runs.append((a, key, b, run * isz, v))
    runs.sort(key=lambda r: r[0])
    total = math.prod(shape) * isz
    out, at = [], 0
    for a, key, b, n, v in runs:
        if a != at:
            return None  # a gap or an overlap: the pieces do not tile the output
        at = a + n
        if out and out[-1][4] == key and out[-1][1] + out[-1][3] == b:
            out[-1][3] += n
        else:
            out.append([v, b, a, n, key])
    if at != total:
        return None
    return [(v, b, a, n) for v, b, a, n, _ in out]


class RegisteredMemory:
    """Every byte the writes of one rank's plan read from, registered with ``transport`` once,
    here (never per update).

    For each output that a write reads (per task, assignment, output index):

    - a *view of a shard* (a plain recipe of a local task: :func:`~weight_transfer.convert.transforms.output_view`
      of the rank's own ``to_local()`` shards): the write reads the shard's storage, registered
      whole as one region (one per distinct storage; the trainer updates it in place, so the
      region stays valid across updates);
    - anything else (fused bands, casts, FP8 weight and scales, runtime layouts, slices of
      gathered sources): the output is built in a slot of the :class:`OutputPool`, one buffer
      registered once. A task's slots form one chunk (each slot :data:`POOL_ALIGN`-aligned),
      held from admission to release.

    Pool size (bytes): ``pool_bytes`` when given (at least the largest task's chunk), else with
    a ``watermark`` the watermark plus the largest chunk (the gate keeps the chunks in flight
    within the watermark, plus one task admitted alone), without one :data:`POOL_DEFAULT`, never
    more than the plan's total nor less than the largest chunk. A task waits for pool space
    (:meth:`OutputPool.acquire`) only when the chunks in flight fill it.

    The pool is memory of this rank's device, touched once here so no update pays its page
    faults (it is only read by the writes: any memory a back end registers will do). :attr:`stats` says what the
    registration cost. ``transport`` None (fakes without writes): nothing is registered."""

    def __init__(self, tasks, params, transport, *, device: torch.device, watermark: int | None,
                 pool_bytes: int | None = None, direct: bool = True):
        self.transport = transport
        self._params = params
        self.direct = direct
        """Outputs that are their sources' bytes in order (fused bands, strided TP slices) are
        written straight from the shards (:class:`_Parts`), else built in the pool."""
        self.extra_ops = 0
        """Ops the last :meth:`ops` call added beyond one per planned write (the pieces of
        outputs written from several shard ranges)."""
        self.stats = SetupStats(transport=getattr(transport, "name", type(transport).__name__))
        self._src: dict[tuple, tuple[Region, int]] = {}
        self.places: list[list[list]] = []
        self.chunk: list[int] = []
        for task in tasks:
            get = None
            if not task.sources and task.local_sources:
                get = lambda n: _local(params[n])  # noqa: E731
            per_a, rel = [], 0
            for a in task.assignments:
                sizes: dict[int, int] = {}
                for w in a.writes:
                    if w.length:
                        sizes.setdefault(w.output, w.length)
                n_out = max([len(a.recipe.outputs), *(k + 1 for k in sizes)])
                places: list = [None] * n_out
                view = None
                if get is not None and 0 in sizes:
                    try:
                        view = output_view(a.recipe, get)
                    except (KeyError, IndexError, RuntimeError, ValueError):
                        view = None  # the update names the problem
                try:
                    made = output_nbytes(a.recipe)
                except Exception:
                    made = []
                for k, n in sorted(sizes.items()):
                    parts = None
                    if k == 0 and view is None and get is not None and direct:
                        parts = self._parts(a.recipe, get, n, device)
                    if k == 0 and view is not None:
                        region, base = self._source_region(view)
                        places[k] = _Src(region, base, n)
                    elif parts is not None:
                        places[k] = parts
                        self.stats.direct_bytes += n
                    else:
                        places[k] = _Slot(rel, n, k < len(made) and made[k] == n)
                        rel += _align(n)
                        self.stats.pooled_bytes += n
                per_a.append(places)
            self.places.append(per_a)
            self.chunk.append(rel)
        self.pool: OutputPool | None = None
        self._device, self._watermark, self._pool_bytes = device, watermark, pool_bytes
        self._retired: list[torch.Tensor] = []  # pools replaced after a timeout: never reused
        self.suspect = False
        """A batch reading from the pool timed out (its writes may be in flight): :meth:`reset`
        replaces the pool before the next update."""
        if any(self.chunk):
            self.pool = self._make_pool()

    # -- setup

    def _register(self, t: torch.Tensor) -> Region | None:
        if self.transport is None:
            return None
        t0 = time.perf_counter()
        region = self.transport.register(t)
        self.stats.register_seconds += time.perf_counter() - t0
        self.stats.n_regions += 1
        self.stats.registered_bytes += t.nbytes
        return region

    def _source_region(self, view: torch.Tensor) -> tuple[Region, int]:
        """The region of the storage behind ``view`` (registered whole, once) and its base address."""
        st = view.untyped_storage()
        key = (view.device, st.data_ptr())
        got = self._src.get(key)
        if got is None:
            whole = torch.empty(0, dtype=torch.uint8, device=view.device).set_(st)
            got = self._src[key] = (self._register(whole), st.data_ptr())
            self.stats.source_regions += 1
            self.stats.source_bytes += whole.nbytes
        return got

    def _parts(self, recipe, get, nbytes: int, device: torch.device) -> _Parts | None:
        """The :class:`_Parts` of an output written from the shards (:func:`direct_runs`), or
        None: it is built in the pool. Consecutive runs of one storage are one op, with
        :class:`Segments` when they are several (CPU only: on a GPU a strided slice is one copy
        kernel into the pool, not a copy per row)."""
        try:
            runs = direct_runs(recipe, get)
        except Exception:
            runs = None
        if not runs or sum(r[3] for r in runs) != nbytes:
            return None
        groups: list[list] = []
        for v, b, a, n in runs:
            key = v.untyped_storage().data_ptr()
            if groups and groups[-1][0] == key:
                groups[-1][2].append((b, n))
            else:
                groups.append([key, v, [(b, n)], a])
        if device.type != "cpu" and any(len(g[2]) > 1 for g in groups):
            return None
        parts, sources = [], {}
        for _key, v, segs, a in groups:
            region, _ = self._source_region(v)
            n = sum(m for _, m in segs)
            if len(segs) == 1:
                parts.append((region, segs[0][0], a, n, None))
            else:
                lo = min(b for b, _ in segs)
                parts.append((region, lo, a, n, Segments([b - lo for b, _ in segs], [m for _, m in segs])))
        for pc in recipe.pieces:
            sources[pc.source] = get(pc.source).untyped_storage().data_ptr()
        return _Parts(parts, nbytes, tuple(sources.items()))

    def _size(self) -> int:
        most, total = max(self.chunk), sum(self.chunk)
        if self._pool_bytes is not None:
            if self._pool_bytes < most:
                raise ValueError(f"pool_bytes={self._pool_bytes}: a task needs {most} bytes of output pool")
            return self._pool_bytes
        want = self._watermark + most if self._watermark is not None else POOL_DEFAULT
        return max(most, min(total, want))

    def _make_pool(self) -> OutputPool:
        n = self._size()
        t0 = time.perf_counter()
        buf = torch.empty(n, dtype=torch.uint8, device=self._device)
        buf.zero_()  # touch every page now, not in the first update
        self.stats.allocate_seconds += time.perf_counter() - t0
        self.stats.pool_bytes = n
        return OutputPool(buf, self._register(buf))

    # -- per update

    def reset(self) -> None:
        """Before an update: an empty pool; a new one (registered again, the old buffer kept
        and never reused) when a batch reading from it timed out in an earlier update."""
        if self.pool is None:
            return
        if self.suspect:
            self._retired.append(self.pool.buffer)
            self.pool = self._make_pool()
            self.stats.pool_replaced += 1
            self.suspect = False
        self.pool.reset()

    def acquire(self, index: int, abort: threading.Event | None = None) -> int:
        """Task ``index``'s pool chunk: its offset (0 when it pools nothing). Blocks for space."""
        n = self.chunk[index] if index < len(self.chunk) else 0
        return self.pool.acquire(n, abort) if n else 0

    def release(self, index: int, off: int) -> None:
        """Give back task ``index``'s chunk at ``off`` (its batch completed, or it never posted)."""
        n = self.chunk[index] if index < len(self.chunk) else 0
        if n:
            self.pool.release(off, n)

    def buffers(self, index: int, off: int) -> list[list[torch.Tensor | None] | None]:
        """Per assignment of task ``index``, the flat ``uint8`` pool slot each output is built in
        (None: a view of a shard, an output no write reads, or one whose size differs from the
        plan's writes -- the post then names it); ``off``: the task's chunk (:meth:`acquire`)."""
        out = []
        for places in self.places[index]:
            if any(isinstance(p, _Parts) for p in places) and all(p is None or isinstance(p, _Parts) for p in places):
                out.append(DIRECT)  # nothing to build: the writes read the shards
                continue
            bufs = [self.pool.buffer[off + p.rel:off + p.rel + p.nbytes] if isinstance(p, _Slot) and p.build else None
                    for p in places]
            out.append(bufs if any(b is not None for b in bufs) else None)
        return out

    def ops(self, index: int, task: Task, outputs: list[list[torch.Tensor]], off: int,
            remote: dict[int, RegionDescriptor], delta=None,
            shift: dict[int, int] | None = None) -> tuple[list[WriteOp], int]:
        """The batch of task ``index`` (``off``: its pool chunk): every write as a
        :class:`WriteOp` from the registered memory holding its output. An output the plan pools
        but which was built elsewhere (a caller's own prepare) is copied into its slot first.
        Returns (ops, bytes copied so). RuntimeError when an output's size differs from the
        plan's writes, or a view-of-shard output is not inside the storage registered for it (the
        shard was re-allocated since setup: shards must be updated in place). ``delta``
        (:class:`weight_transfer.delta.runs.DeltaState`): each output's writes carry only what
        changed since the last update (none when nothing did), as its cost model chooses per
        output and receiver: one :class:`weight_transfer.transport.runs.RunsOp`, one packed
        record into the receiver's landing region, or the whole output. ``shift``
        (inference rank -> bytes): added to every planned remote offset of that rank (a receiver
        with flip shadow targets: the half that is not live, :mod:`weight_transfer.api.shadow`), or
        ``(lo, hi, delta)``: ``delta`` added to the writes whose planned offset is in ``[lo, hi)``
        (a flip buffer that is one part of a larger region, e.g. beside a vLLM worker's staging)."""
        ops: list[WriteOp] = []
        shift = shift or {}
        copied = extra = 0
        for ai, (a, outs, places) in enumerate(zip(task.assignments, outputs, self.places[index])):
            locs, runs = [], []
            for k, p in enumerate(places):
                runs.append(None)
                if p is None:
                    locs.append(None)
                    continue
                if isinstance(p, _Parts):
                    for name, ptr in p.sources:
                        now = _local(self._params[name]).untyped_storage().data_ptr()
                        if now != ptr:
                            raise RuntimeError(
                                f"task {task.id}: {a.recipe.name}: its output is written from the storage of {name} "
                                f"registered at setup ({ptr:#x}), which is now {now:#x}: the parameter's storage "
                                "changed since the executor was built; update shards in place (copy_, optimizer "
                                "steps), or build a new executor")
                    locs.append(p)
                    continue
                o = outs[k]
                if o.nbytes != p.nbytes:
                    raise RuntimeError(f"task {task.id}: {a.recipe.name} output {k} is {o.nbytes} bytes, "
                                       f"the plan writes {p.nbytes}")
                if isinstance(p, _Src):
                    lo = o.data_ptr() - p.base
                    if lo < 0 or lo + p.nbytes > p.region.length:
                        raise RuntimeError(
                            f"task {task.id}: {a.recipe.name}: its output (a view of a shard) is not inside the shard "
                            f"storage registered at setup (addr {o.data_ptr():#x}, storage {p.base:#x}, "
                            f"{p.region.length} bytes): the parameter's storage changed since the executor was "
                            "built; update shards in place (copy_, optimizer steps), or build a new executor")
                    locs.append((p.region, lo))
                    if delta is not None and o.is_contiguous():
                        runs[k] = delta.runs((index, ai, k), o.view(-1).view(torch.uint8))
                else:
                    lo = off + p.rel
                    slot = self.pool.buffer[lo:lo + p.nbytes]
                    if o.data_ptr() != slot.data_ptr():
                        slot.copy_(o.contiguous().view(-1).view(torch.uint8))
                        copied += p.nbytes
                    locs.append((self.pool.region, lo))
                    if delta is not None:
                        runs[k] = delta.runs((index, ai, k), slot)
            for w in a.writes:
                if w.length:
                    d = remote.get(w.dst_rank)
                    if d is None:
                        raise RuntimeError(f"task {task.id}: {a.recipe.name} writes to inference rank {w.dst_rank}, "
                                           f"which has no region descriptor here (known: {sorted(remote)})")
                    loc = locs[w.output]
                    sh = shift.get(w.dst_rank, 0)
                    ro = w.remote_offset + (sh if isinstance(sh, int) else sh[2] if sh[0] <= w.remote_offset < sh[1] else 0)
                    if isinstance(loc, _Parts):  # one op per shard range, Segments for a strided one
                        ops += [WriteOp(reg, lo, d, ro + at, n, sg) for reg, lo, at, n, sg in loc.parts]
                        extra += len(loc.parts) - 1
                        continue
                    reg, lo = loc
                    if delta is not None:  # whole, runs (RunsOp) or a packed record: the cost model's choice
                        ops += delta.ops((index, ai, w.output), runs[w.output], reg, lo, d, ro, w.length, w.dst_rank)
                    else:
                        ops.append(WriteOp(reg, lo, d, ro, w.length))
        self.extra_ops = extra
        return ops, copied

    def close(self) -> None:
        """Deregister every region (the transport waits for nothing: no batch of ours is in flight)."""
        if self.transport is None:
            return
        regions = [r for r, _ in self._src.values()]
        if self.pool is not None and self.pool.region is not None:
            regions.append(self.pool.region)
        self._src.clear()
        for r in regions:
            self.transport.deregister(r)


def built_bytes(outs: list[list[torch.Tensor]], full: dict[str, torch.Tensor]) -> int:
    """Bytes of the outputs that are not views of a source in ``full`` (this rank's shards or
    the gathered sources): each distinct output once, by its own bytes (pool slots share one
    storage)."""
    have = {t.untyped_storage().data_ptr() for t in full.values() if t.numel()}
    seen, n = set(), 0
    for os_ in outs:
        for o in os_:
            if o.numel() and o.untyped_storage().data_ptr() not in have and o.data_ptr() not in seen:
                seen.add(o.data_ptr())
                n += o.nbytes
    return n
