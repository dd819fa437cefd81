"""The task-level functions the executor's stages call, usable alone: gather a task's sources,
prepare its outputs, post its writes, and the write stage's queue of batches in flight.

- :func:`gather_sources` / :func:`prepare_outputs`: the ``prepare`` stage (``into=``: build the
  outputs in given buffers, e.g. slots of the registered output pool, :mod:`weight_transfer.pipeline.memory`);
- :func:`post_ops` posts a task's batch of ops from memory registered once (the executor's
  :class:`weight_transfer.pipeline.memory.RegisteredMemory`; returns a :class:`PostedTask`);
  :func:`complete_task` waits for it and raises its failure; :func:`post_outputs` /
  :func:`write_outputs` are the one-off variants that register a task's outputs for one batch
  and deregister them after it (for callers without a registered memory; the executor never
  registers per update);
- :class:`MemoryGate`: the watermark gate that admits tasks by temporary bytes;
- :class:`WritesInFlight`: the pipelined write stage's FIFO of posted batches. The published
  executor (Perplexity, Lequn Chen, 2025-09-17: "No need to wait for RDMA to finish") posts a
  task's RDMA WRITEs as soon as its GPU work is done, with earlier tasks' writes still in
  flight, bounded only by the temporary-memory watermark; this queue is how the write thread
  does the same while touching the transport from that one thread only (transports are not
  thread-safe: posting, polling and waiting happen on the caller's thread; the executor's
  registrations happen before any write thread exists).

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

from ..convert.transforms import DIRECT, recipe_outputs
from ..transport.base import CompletedWrite, Region, RemoteGoneError, Transport, WriteHandle, WriteOp
from ..types import RegionDescriptor, Task

__all__ = ["DIRECT", "MemoryGate", "PostedTask", "WritesInFlight", "complete_task", "gather_sources", "iter_sources", "post_ops", "post_outputs",
           "prepare_outputs", "unique_nbytes", "write_outputs"]



def iter_sources(task: Task, params: dict[str, DTensor]):
    """``(name, get)`` for every source of ``task`` in the task's order: ``get()`` returns the
    ``full_tensor()`` of each of ``task.sources`` (a collective over the source's DeviceMesh:
    every rank of the mesh calls them in this order) and then the rank's own shard
    (``to_local()``, no communication) of each of ``task.local_sources``."""
    for name in task.sources:
        p = params[name]
        yield name, (p.full_tensor if isinstance(p, DTensor) else (lambda p=p: p))
    for name in task.local_sources:
        p = params[name]
        yield name, (p.to_local if isinstance(p, DTensor) else (lambda p=p: p))


def gather_sources(task: Task, params: dict[str, DTensor]) -> dict[str, torch.Tensor]:
    """``full_tensor()`` of every source of ``task``, in the task's order (collective); the
    rank's own shard (``to_local()``, no communication) of every local source."""
    return {name: get() for name, get in iter_sources(task, params)}


def prepare_outputs(task: Task, full: dict[str, torch.Tensor],
                    into: list[list[torch.Tensor | None] | None] | None = None) -> list[list[torch.Tensor]]:
    """Outputs of every recipe assigned to this rank, contiguous, in assignment order.

    ``into`` (optional): per assignment, one flat ``uint8`` buffer per output to build it in
    (:func:`weight_transfer.convert.transforms.recipe_outputs` ``out=``; None: allocate, or hand out the
    view of a source for a plain recipe; :data:`DIRECT`: build nothing, ``[]``), e.g.
    :meth:`weight_transfer.pipeline.memory.RegisteredMemory.buffers`."""
    get = full.__getitem__
    if into is None:
        return [[o.contiguous() for o in recipe_outputs(a.recipe, get)] for a in task.assignments]
    return [[] if bufs is DIRECT else [o.contiguous() for o in recipe_outputs(a.recipe, get, out=bufs)]
            for a, bufs in zip(task.assignments, into)]


@dataclass(slots=True)
class PostedTask:
    """One task's posted batch: its completion ``handle``, the local ``regions`` to deregister
    once it completed (empty for batches from memory registered once, which stays registered),
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
    :meth:`weight_transfer.pipeline.memory.RegisteredMemory.ops`; delta runs as
    :class:`weight_transfer.transport.runs.RunsOp`, counted one write per run) as one batch; do
    not wait. The batch's timeout (seconds) counts from now. Raises the transport's error (a :class:`RemoteGoneError` names the
    inference rank); nothing of a refused batch was issued
    (:meth:`weight_transfer.transport.base.Transport.write`)."""
    from ..transport import runs

    t0 = time.perf_counter()
    try:
        handle = runs.write(transport, ops) if ops else CompletedWrite(0)
    except RemoteGoneError as e:
        raise _name_gone(task, remote, e) from e
    return PostedTask(task, handle, [], runs.op_count(ops), t0, None if timeout is None else t0 + timeout, item,
                      timeout)


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

