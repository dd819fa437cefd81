"""The task-level functions the executor's stages call, usable alone: gather a task's sources,
prepare its outputs, post its writes, the write stage's queue of batches in flight, and the
memory the writes read from, registered once.

- :func:`gather_sources` / :func:`prepare_outputs`: the ``prepare`` stage (``into=``: build the
  outputs in given buffers, e.g. slots of the registered output pool);
- :class:`RegisteredMemory`: every byte the writes of a rank's plan read from, registered with
  the transport once, when it is built (never per update): the parameter shards' own storages
  for outputs that are views of a shard (plain recipes), and an :class:`OutputPool` of
  preallocated output buffers, reused across updates, for outputs that are built (fused, cast,
  quantized, or made from gathered sources). :meth:`RegisteredMemory.ops` turns a prepared
  task's outputs into the :class:`WriteOp` s of its batch; :class:`SetupStats` is what the
  registration cost (bytes, regions, seconds);
- :func:`post_ops` posts a task's batch of such ops (returns a :class:`PostedTask`);
  :func:`complete_task` waits for it and raises its failure; :func:`post_outputs` /
  :func:`write_outputs` are the one-off variants that register a task's outputs for one batch
  and deregister them after it (for callers without a :class:`RegisteredMemory`; the executor
  never registers per update);
- :class:`MemoryGate`: the watermark gate that admits tasks by temporary bytes;
- :class:`WritesInFlight`: the pipelined write stage's FIFO of posted batches. The published
  executor (Perplexity, Lequn Chen, 2025-09-17: "No need to wait for RDMA to finish") posts a
  task's RDMA WRITEs as soon as its GPU work is done, with earlier tasks' writes still in
  flight, bounded only by the temporary-memory watermark; this queue is how the write thread
  does the same while touching the transport from that one thread only (transports are not
  thread-safe: posting, polling and waiting happen on the caller's thread; the registrations of
  :class:`RegisteredMemory` happen before any write thread exists).

Hand-written rather than built on a library: completion is the transport's own
:class:`~weight_transfer.transport.base.WriteHandle` (``done()`` polls once), which no executor
library (concurrent.futures, asyncio) can wait on without a second thread touching the
transport.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from .transforms import output_nbytes, output_view, recipe_outputs
from .transport.base import CompletedWrite, Region, RemoteGoneError, Transport, WriteHandle, WriteOp
from .types import RegionDescriptor, Task

__all__ = ["MemoryGate", "OutputPool", "PostedTask", "RegisteredMemory", "SetupStats", "WritesInFlight",
           "complete_task", "gather_sources", "post_ops", "post_outputs", "prepare_outputs", "unique_nbytes",
           "write_outputs"]

def gather_sources(task: Task, params: dict[str, DTensor]) -> dict[str, torch.Tensor]:
    """``full_tensor()`` of every source of ``task``, in the task's order (collective); the
    rank's own shard (``to_local()``, no communication) of every local source."""
    out = {}
    for name in task.sources:
        p = params[name]
        out[name] = p.full_tensor() if isinstance(p, DTensor) else p
    for name in task.local_sources:
        p = params[name]
        out[name] = p.to_local() if isinstance(p, DTensor) else p
    return out


def prepare_outputs(task: Task, full: dict[str, torch.Tensor],
                    into: list[list[torch.Tensor | None] | None] | None = None) -> list[list[torch.Tensor]]:
    """Outputs of every recipe assigned to this rank, contiguous, in assignment order.

    ``into`` (optional): per assignment, one flat ``uint8`` buffer per output to build it in
    (:func:`weight_transfer.transforms.recipe_outputs` ``out=``; None: allocate, or hand out the
    view of a source for a plain recipe), e.g. :meth:`RegisteredMemory.buffers`."""
    get = full.__getitem__
    if into is None:
        return [[o.contiguous() for o in recipe_outputs(a.recipe, get)] for a in task.assignments]
    return [[o.contiguous() for o in recipe_outputs(a.recipe, get, out=bufs)]
            for a, bufs in zip(task.assignments, into)]


@dataclass(slots=True)
class PostedTask:
    """One task's posted batch: its completion ``handle``, the local ``regions`` to deregister
    once it completed (empty for batches from :class:`RegisteredMemory`: registered once, kept),
    the number of write ops, the ``perf_counter`` time it was posted at and its ``deadline``
    (``perf_counter`` seconds; None = no timeout). ``item`` is the caller's object (the
    executor's work item); ``timeout`` the batch's timeout in seconds (for the error message);
    ``timed_out``: its completion raised ``TimeoutError`` (the writes may still be in flight)."""

    task: Task
    handle: WriteHandle
    regions: list[Region]
    n_ops: int
    posted: float
    deadline: float | None
    item: object = None
    timeout: float | None = None
    timed_out: bool = False


def post_ops(task: Task, ops: list[WriteOp], transport: Transport, remote: dict[int, RegionDescriptor],
             timeout: float | None = None, item=None) -> PostedTask:
    """Post ``ops`` (every write of ``task``, from memory already registered, e.g.
    :meth:`RegisteredMemory.ops`) as one batch; do not wait. The batch's timeout (seconds)
    counts from now. Raises the transport's error (a :class:`RemoteGoneError` names the
    inference rank); nothing of a refused batch was issued
    (:meth:`weight_transfer.transport.base.Transport.write`)."""
    t0 = time.perf_counter()
    try:
        handle = transport.write(ops) if ops else CompletedWrite(0)
    except RemoteGoneError as e:
        raise _name_gone(task, remote, e) from e
    return PostedTask(task, handle, [], len(ops), t0, None if timeout is None else t0 + timeout, item, timeout)


def post_outputs(task: Task, outputs: list[list[torch.Tensor]], transport: Transport,
                 remote: dict[int, RegionDescriptor], timeout: float | None = None, item=None) -> PostedTask:
    """Register ``outputs`` and post every write of ``task`` as one batch; do not wait (the
    one-off variant: :func:`complete_task` deregisters them; the executor instead posts from a
    :class:`RegisteredMemory` with :func:`post_ops`). The batch's timeout (seconds) counts from now. On any error (a length that does not match
    the plan, a refused batch) the regions registered so far are deregistered and the error is
    raised (a :class:`RemoteGoneError` names the inference rank); nothing of a refused batch
    was issued (:meth:`weight_transfer.transport.base.Transport.write`)."""
    t0 = time.perf_counter()
    ops: list[WriteOp] = []
    regions: list[Region] = []
    try:
        for a, outs in zip(task.assignments, outputs):
            regs = []
            for o in outs:
                reg = transport.register(o.view(-1).view(torch.uint8) if o.numel() else o)
                regions.append(reg)
                regs.append(reg)
            for w in a.writes:
                if w.length != regs[w.output].length:
                    raise RuntimeError(f"task {task.id}: {a.recipe.name} output {w.output} is "
                                       f"{regs[w.output].length} bytes, the plan writes {w.length}")
                ops.append(WriteOp(regs[w.output], 0, remote[w.dst_rank], w.remote_offset, w.length))
        handle = transport.write(ops) if ops else CompletedWrite(0)
    except BaseException as e:
        for reg in regions:
            try:
                transport.deregister(reg)
            except BaseException:  # the posting error is the one to report
                pass
        if isinstance(e, RemoteGoneError):
            raise _name_gone(task, remote, e) from e
        raise
    return PostedTask(task, handle, regions, len(ops), t0,
                      None if timeout is None else t0 + timeout, item, timeout)


def complete_task(p: PostedTask, transport: Transport, remote: dict[int, RegionDescriptor],
                  block: bool = True) -> int | None:
    """Finish a posted batch: with ``block`` wait until it completes (at most until its
    deadline), else poll once and return None while it is in flight and before its deadline.
    When it finished (or failed, or passed its deadline) deregister its regions and return the
    bytes written, or raise: ``TimeoutError`` past the deadline, the transport's error on a
    failed write (a :class:`RemoteGoneError` names the inference rank)."""
    try:
        if not block and not p.handle.done():
            if p.deadline is not None and time.perf_counter() > p.deadline:
                p.timed_out = True
                raise TimeoutError(p.handle._timeout_message(p.timeout))
            return None
        left = None if p.deadline is None else max(0.0, p.deadline - time.perf_counter())
        try:
            n = p.handle.wait(left)
        except TimeoutError:  # say the batch's timeout (counted from its post), not what was left
            p.timed_out = True
            raise TimeoutError(p.handle._timeout_message(p.timeout)) from None
    except RemoteGoneError as e:
        _deregister_all(p, transport, quiet=True)
        raise _name_gone(p.task, remote, e) from e
    except BaseException:
        _deregister_all(p, transport, quiet=True)
        raise
    _deregister_all(p, transport)
    return n


def _deregister_all(p: PostedTask, transport: Transport, quiet: bool = False) -> None:
    """Deregister every region of ``p`` (all of them, even after one fails; the first
    failure is raised at the end unless ``quiet``: a write's own error is being raised)."""
    regions, p.regions = p.regions, []
    first = None
    for reg in regions:
        try:
            transport.deregister(reg)
        except BaseException as e:
            first = first or e
    if first is not None and not quiet:
        raise first


def _name_gone(task: Task, remote: dict[int, RegionDescriptor], e: RemoteGoneError) -> RemoteGoneError:
    """The same error naming the inference rank, not only a pid (when one matches)."""
    gone = sorted({w.dst_rank for a in task.assignments for w in a.writes
                   if f"pid {remote[w.dst_rank].pid} " in str(e)})
    if gone:
        return RemoteGoneError(f"inference {gone[0]} (pid {remote[gone[0]].pid}) is gone: {e}")
    return e


def write_outputs(task: Task, outputs: list[list[torch.Tensor]], transport: Transport,
                  remote: dict[int, RegionDescriptor], timeout: float | None = None) -> tuple[int, int]:
    """Post every write of ``task`` as one batch and wait (``timeout`` seconds), then
    deregister. Returns (bytes, number of writes). Raises the transport's error; a
    RemoteGoneError names the inference rank that is gone."""
    p = post_outputs(task, outputs, transport, remote, timeout)
    return complete_task(p, transport, remote, block=True), p.n_ops


class WritesInFlight:
    """The write stage's FIFO of posted batches (one :class:`PostedTask` per task, plan order).

    Every call must come from the one thread that owns ``transport``. :meth:`post` posts a
    task's batch and appends it; :meth:`reap` finishes the batches at the head that completed
    (in order: a batch is handed on only after every earlier one) and returns them;
    :meth:`drain` waits for all; :meth:`abandon` (after an error) waits for what is left up to
    each batch's deadline, deregisters every region and swallows their errors, so no memory is
    freed under a write still in flight. :attr:`timed_out` says whether some batch ended by its
    timeout (its writes may still be in flight: the memory they read must not be reused)."""

    def __init__(self, transport: Transport, remote: dict[int, RegionDescriptor], timeout: float | None):
        self.transport, self.remote, self.timeout = transport, remote, timeout
        self._q: deque[PostedTask] = deque()
        self.max_in_flight = 0
        """Most batches in flight at once (observed)."""
        self.failed: PostedTask | None = None
        """The batch whose completion raised in :meth:`pop_done`."""
        self.timed_out = False
        """Some batch's completion raised ``TimeoutError`` (in :meth:`pop_done` or :meth:`abandon`)."""

    def __len__(self) -> int:
        return len(self._q)

    def post(self, task: Task, outputs, item=None) -> PostedTask:
        """Post ``task``'s batch (:func:`post_outputs`) and append it."""
        return self.push(post_outputs(task, outputs, self.transport, self.remote, self.timeout, item))

    def push(self, p: PostedTask) -> PostedTask:
        """Append a batch already posted on this transport."""
        self._q.append(p)
        self.max_in_flight = max(self.max_in_flight, len(self._q))
        return p

    def pop_done(self, block: bool = False) -> tuple[PostedTask, int] | None:
        """The head batch, as (posted, bytes written), once it completed (its regions are
        deregistered); None while it is in flight (``block=False``) or nothing is. With
        ``block`` wait for it (up to its deadline). Raises the head batch's error (it is
        removed from the queue and kept in :attr:`failed`; its regions are deregistered)."""
        if not self._q:
            return None
        p = self._q[0]
        try:
            n = complete_task(p, self.transport, self.remote, block=block)
        except BaseException:
            self._q.popleft()
            self.failed = p
            self.timed_out |= p.timed_out
            raise
        if n is None:
            return None
        self._q.popleft()
        return p, n

    def abandon(self) -> list[PostedTask]:
        """After an error: wait for each remaining batch (up to its deadline), deregister its
        regions, ignore its outcome; return the abandoned batches."""
        left = list(self._q)
        self._q.clear()
        for p in left:
            try:
                complete_task(p, self.transport, self.remote, block=True)
            except BaseException:  # the first error is already reported
                self.timed_out |= p.timed_out
        return left


def unique_nbytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once;
    None and empty tensors count 0)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


# --------------------------------------------------------------------------------------------
# the watermark gate


class MemoryGate:
    """Admits tasks (in the order they ask) while the temporary bytes in flight plus the
    task's own stay within ``watermark``; a task larger than the watermark is admitted once
    nothing is in flight. ``watermark=None``: always admit."""

    def __init__(self, watermark: int | None):
        if watermark is not None and watermark < 0:
            raise ValueError(f"watermark={watermark}: must be >= 0 bytes or None")
        self.watermark = watermark
        self.in_flight = 0
        self.n_in_flight = 0
        self.peak = 0
        self._cond = threading.Condition()

    def admits(self, nbytes: int) -> bool:
        return self.watermark is None or self.n_in_flight == 0 or self.in_flight + nbytes <= self.watermark

    def acquire(self, nbytes: int, abort: threading.Event | None = None) -> float:
        """Block until the task may enter; returns seconds waited. Raises RuntimeError if
        ``abort`` is set while waiting (another stage failed)."""
        t0 = time.perf_counter()
        with self._cond:
            while not self.admits(nbytes):
                if abort is not None and abort.is_set():
                    raise RuntimeError("aborted while waiting at the watermark gate")
                self._cond.wait(0.05)
            self.in_flight += nbytes
            self.n_in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        return time.perf_counter() - t0

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.in_flight -= nbytes
            self.n_in_flight -= 1
            self._cond.notify_all()


# --------------------------------------------------------------------------------------------
# the memory the writes read from, registered once

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
    allocate_seconds: float = 0.0
    """Seconds to allocate and touch the pool."""
    pool_replaced: int = 0
    """Times the pool was replaced by a new one (registered again) because a batch reading from
    it timed out and may still be in flight (a failed update; never otherwise)."""

    def summary(self) -> str:
        """One line: ``registered once (cma): 3 regions, 0.962 GB (2 shard storages 0.700 GB +
        pool 0.262 GB) in 0.0001 s``."""
        return (f"registered once ({self.transport}): {self.n_regions} regions, {self.registered_bytes / 1e9:.3f} GB "
                f"({self.source_regions} shard storages {self.source_bytes / 1e9:.3f} GB + pool "
                f"{self.pool_bytes / 1e9:.3f} GB) in {self.register_seconds:.4f} s")


class _Src:
    """An output written from a registered shard storage (its region and base address)."""

    __slots__ = ("region", "base", "nbytes")

    def __init__(self, region: Region, base: int, nbytes: int):
        self.region, self.base, self.nbytes = region, base, nbytes


class _Slot:
    """An output built in the pool, ``rel`` bytes into its task's chunk."""

    __slots__ = ("rel", "nbytes", "build")

    def __init__(self, rel: int, nbytes: int, build: bool):
        self.rel, self.nbytes, self.build = rel, nbytes, build


def _local(p) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class RegisteredMemory:
    """Every byte the writes of one rank's plan read from, registered with ``transport`` once,
    here (never per update).

    For each output that a write reads (per task, assignment, output index):

    - a *view of a shard* (a plain recipe of a local task: :func:`~weight_transfer.transforms.output_view`
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
                 pool_bytes: int | None = None):
        self.transport = transport
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
                    if k == 0 and view is not None:
                        region, base = self._source_region(view)
                        places[k] = _Src(region, base, n)
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
            bufs = [self.pool.buffer[off + p.rel:off + p.rel + p.nbytes] if isinstance(p, _Slot) and p.build else None
                    for p in places]
            out.append(bufs if any(b is not None for b in bufs) else None)
        return out

    def ops(self, index: int, task: Task, outputs: list[list[torch.Tensor]], off: int,
            remote: dict[int, RegionDescriptor]) -> tuple[list[WriteOp], int]:
        """The batch of task ``index`` (``off``: its pool chunk): every write as a
        :class:`WriteOp` from the registered memory holding its output. An output the plan pools
        but which was built elsewhere (a caller's own prepare) is copied into its slot first.
        Returns (ops, bytes copied so). RuntimeError when an output's size differs from the
        plan's writes, or a view-of-shard output is not inside the storage registered for it (the
        shard was re-allocated since setup: shards must be updated in place)."""
        ops: list[WriteOp] = []
        copied = 0
        for a, outs, places in zip(task.assignments, outputs, self.places[index]):
            locs = []
            for k, p in enumerate(places):
                if p is None:
                    locs.append(None)
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
                else:
                    lo = off + p.rel
                    slot = self.pool.buffer[lo:lo + p.nbytes]
                    if o.data_ptr() != slot.data_ptr():
                        slot.copy_(o.contiguous().view(-1).view(torch.uint8))
                        copied += p.nbytes
                    locs.append((self.pool.region, lo))
            for w in a.writes:
                if w.length:
                    reg, lo = locs[w.output]
                    d = remote.get(w.dst_rank)
                    if d is None:
                        raise RuntimeError(f"task {task.id}: {a.recipe.name} writes to inference rank {w.dst_rank}, "
                                           f"which has no region descriptor here (known: {sorted(remote)})")
                    ops.append(WriteOp(reg, lo, d, w.remote_offset, w.length))
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
