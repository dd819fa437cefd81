"""The stage loops of :class:`weight_transfer.pipeline.executor.Executor`: how one update's tasks move
through the stage threads (pipelined) or one by one (stage-serialized), the write stage's
batches in flight, and what happens after a stage fails or the update is cancelled -- the rest
of the plan makes its collectives only (C28). :class:`StageLoops` is the executor's base class;
the stages themselves (h2d, prepare, write, release) and the memory they use are the
executor's (:mod:`weight_transfer.pipeline.executor`, whose docstring describes the invariants)."""
from __future__ import annotations

import queue
import threading
import time

import torch
from torch.distributed.tensor import DTensor

from ..types import Task
from .records import StepStats, TaskRecord
from .tasks import WritesInFlight

_POLL_S = 5e-4
"""Seconds the pipelined write stage waits on its input queue between polls of the batches in
flight."""


class _Work:
    """A task on its way through the stages."""

    __slots__ = ("task", "rec", "index", "full", "outputs", "h2d_event", "ready_event", "admitted", "pool_off",
                 "gathered", "in_collective", "barriers_issued")

    def __init__(self, task: Task, index: int):
        self.task, self.index = task, index
        label = task.sources[0] if task.sources else f"task {task.id}"
        if len(task.sources) > 1:
            label += f" +{len(task.sources) - 1}"
        self.rec = TaskRecord(task.id, task.group, temp_bytes=task.temp_bytes, send_bytes=task.send_bytes, label=label)
        self.full = self.outputs = self.h2d_event = self.ready_event = self.pool_off = None
        self.admitted = False
        self.gathered = 0
        """Sources of ``task.sources`` whose ``full_tensor()`` returned (collectives done)."""
        self.in_collective = False
        """True while a ``full_tensor()`` of this task runs (an error then broke the collective)."""
        self.barriers_issued = False


class UpdateCancelled(RuntimeError):
    """The update was cancelled from outside (:meth:`Executor.run`'s ``cancel`` was set: another
    rank failed) before this rank's writes all completed; its collectives ran to the end."""


class _Skip(Exception):
    """Internal: a task that waited at the gate or for pool space when the update stopped."""


_STOP = object()


class StageLoops:
    """The loops that run :class:`weight_transfer.pipeline.executor.Executor`'s stages (a mixin: the
    stage methods, the gate, the pool and the barriers are the executor's)."""

    def _collectives_only(self, w: _Work, st: StepStats) -> None:
        """After the update stopped (this rank failed, or ``cancel``): take part in ``w``'s
        collectives that are still to come -- its ``full_tensor()`` calls not yet made (from
        ``w.gathered`` on) and the group barriers due after it -- without building or writing
        anything, so the other training ranks' collectives complete (C28: no collective left
        waiting). Marks the executor broken instead when a collective itself failed (the
        process group is then unusable: issuing more would only block)."""
        if self._broken:
            return
        task = w.task
        try:
            self._wait_barriers_before(task.group, st)
            with torch.no_grad():
                for name in task.sources[w.gathered:]:
                    p = self.params[name]
                    if isinstance(p, DTensor):
                        w.in_collective = True
                        self._activity["collective"] = (task.id, time.perf_counter())
                        p.full_tensor()
                        self._activity["collective"] = None
                        w.in_collective = False
                    w.gathered += 1
            if self._last_of_group.get(task.group) == w.index and not w.barriers_issued:
                w.barriers_issued = True
                self._issue_barriers_through(task.group)
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            self._say(f"a collective failed after the update stopped; no more collectives this update: {e}")

    def _write_loop(self, q_in, q_out, abort: threading.Event, errors: list, st: StepStats) -> None:
        """The pipelined write stage: post each task's batch as soon as it arrives, with the
        batches of earlier tasks still in flight (:class:`weight_transfer.pipeline.tasks.WritesInFlight`);
        hand a task to release once its batch completed, in plan order. The watermark bounds
        how many are in flight (a task holds its temporary bytes until release). While
        anything is in flight the input queue is polled every ``_POLL_S`` seconds so completed
        batches keep being reaped (the first stage may be waiting at the gate for their
        memory). At the end of the stream every batch is waited for. The first error (a
        refused post, a failed write, a batch past its timeout, counted from its post) fails
        the update; no batch is posted after it, the batches still in flight are waited for
        (each up to its deadline) before their pool chunks are given back. The prepare stage
        goes on to the end of the plan making the collectives only (its ``full_tensor()`` calls
        and group barriers stay in step with the other training ranks, whose writes may not
        have failed: a dead receiver does not hang a trainer, C24, C28); the error is raised
        once it finished. ``abort`` set from outside (a cancel) also ends the posting."""
        fl = self._writes = WritesInFlight(self.transport, self.remote, self.write_timeout)
        failed = threading.Event()  # no batch after a failed one; the other stages go on

        def fail(w: _Work, e: BaseException) -> None:
            errors.append(("write", w.task.id, w.rec.label, e))
            failed.set()
            abort.set()  # prepare makes the remaining collectives only (nothing more is built)
            left = fl.abandon()
            if fl.timed_out:
                self.memory.suspect = True  # a batch may still read the pool: replace it next update
            self._drop(w)
            for p in left:
                q_out.put(p.item)  # release frees its gate bytes

        def reap(block: bool) -> None:
            while True:
                try:
                    got = fl.pop_done(block)
                except BaseException as e:
                    fail(fl.failed.item, e)
                    return
                if got is None:
                    return
                self._write_done(*got, st)
                q_out.put(got[0].item)

        while True:
            try:
                w = q_in.get(timeout=_POLL_S) if len(fl) else q_in.get()
            except queue.Empty:
                w = None
            reap(False)
            if w is None:
                continue
            if w is _STOP:
                while len(fl):
                    reap(True)
                q_out.put(_STOP)
                return
            if abort.is_set() or failed.is_set():
                self._drop(w)
                continue
            try:
                fl.push(self._post_write(w))
            except BaseException as e:
                fail(w, e)
                continue
            reap(False)

    def _stage_failed(self, name: str, w: _Work, e: BaseException, st: StepStats, stop: threading.Event,
                      errors: list) -> None:
        """Stage ``name`` raised ``e`` on ``w``: record the first error, stop the update (no
        write after this), finish ``w``'s share of the collectives (a stage before the writes;
        none when a collective itself raised) and give its memory back."""
        errors.append((name, w.task.id, w.rec.label, e))
        stop.set()
        if name in ("h2d", "prepare"):
            if w.in_collective:
                self._broken = f"{type(e).__name__}: {e}"
            elif name == "prepare" or not w.gathered:
                self._collectives_only(w, st)
        self._drop(w)

    def _run_serial(self, works: list[_Work], fns, st: StepStats, stop: threading.Event, errors: list) -> None:
        """``pipeline=False``: every stage of a task before the next task starts, on the
        caller's thread. After a stop (an error here, or ``stop`` set from outside) the rest of
        the plan runs its collectives only."""
        for w in works:
            if stop.is_set():
                self._collectives_only(w, st)
                continue
            for name, fn in fns:
                if stop.is_set() and name in ("h2d", "prepare", "write"):  # cancelled from outside meanwhile
                    if name != "write":
                        self._collectives_only(w, st)
                    self._drop(w)
                    break
                try:
                    fn(w, stop)
                except _Skip:
                    self._collectives_only(w, st)
                    self._drop(w)
                    break
                except Exception as e:
                    self._stage_failed(name, w, e, st, stop, errors)
                    break
        try:
            if not self._broken:
                self._finish_barriers(st)
        except BaseException as e:
            errors.append(("barrier", -1, "barrier", e))
            stop.set()

    def _run_pipelined(self, works: list[_Work], fns, st: StepStats, stop: threading.Event, errors: list) -> None:
        queues = [queue.SimpleQueue() for _ in fns]

        def loop(i: int) -> None:
            if self.cuda and self.device.index is not None:  # CUDA's current device is per thread
                torch.cuda.set_device(self.device)  # Triton launches, NCCL: this rank's GPU, not GPU 0
            name, fn = fns[i]
            q_in = queues[i]
            q_out = queues[i + 1] if i + 1 < len(fns) else None
            if name == "write":
                return self._write_loop(q_in, q_out, stop, errors, st)
            while True:
                w = q_in.get()
                if w is _STOP:
                    if name == "prepare" and not self._broken:
                        try:
                            self._finish_barriers(st)  # after a stop too: the other ranks' barriers complete
                        except BaseException as e:
                            errors.append((name, -1, "barrier", e))
                            stop.set()
                    if q_out is not None:
                        q_out.put(_STOP)
                    return
                if stop.is_set() and name != "release":
                    if name == "prepare":  # the collectives of every task still run (C28)
                        self._collectives_only(w, st)
                        self._drop(w)
                    elif q_out is not None:
                        q_out.put(w)  # h2d: prepare makes its collectives
                    continue
                try:
                    fn(w, stop)
                except _Skip:  # waited at the gate when the update stopped
                    if name == "prepare":
                        self._collectives_only(w, st)
                        self._drop(w)
                    elif q_out is not None:
                        q_out.put(w)
                    continue
                except BaseException as e:
                    if name == "h2d" and q_out is not None:
                        errors.append((name, w.task.id, w.rec.label, e))
                        stop.set()
                        q_out.put(w)  # prepare makes its collectives
                        continue
                    if name == "release":
                        errors.append((name, w.task.id, w.rec.label, e))
                        stop.set()
                        self._give_back(w)
                        continue
                    self._stage_failed(name, w, e, st, stop, errors)
                    continue
                if q_out is not None:
                    q_out.put(w)

        threads = [threading.Thread(target=loop, args=(i,), name=f"rank{self.plan.rank}-{fns[i][0]}", daemon=True)
                   for i in range(len(fns))]
        for t in threads:
            t.start()
        for w in works:
            queues[0].put(w)
        queues[0].put(_STOP)
        for t in threads:
            t.join()
