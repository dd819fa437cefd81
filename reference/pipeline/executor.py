"""Runs one training rank's part of the schedule for one step: tasks flowing through stages.

Stages, named the same in README, code, logs and timelines (:data:`STAGES`):

- ``h2d``: copy the task's offloaded source shards from host memory (pinned on CUDA hosts)
  into the device buffers ``full_tensor()`` reads (only when the parameters are offloaded,
  see :func:`weight_transfer.plan.metadata.offload_to_host`);
- ``prepare``: ``full_tensor()`` of each source (a collective over the source's DeviceMesh),
  then each assigned recipe's fusion / slicing / cast / FP8 quantization into contiguous
  output buffers;
- ``write``: post every one-sided write of the task as one batch, from memory registered once
  (recorded interval: post -> completion);
- ``release``: drop the task's temporaries (gathered sources and outputs), give its output pool
  chunk back and return its temporary bytes to the watermark.

*Registered once.* The memory the writes read from is registered when the executor is built,
never per update (:mod:`weight_transfer.pipeline.memory`): plain recipes are written from the shards' own
storages (updated in place by the trainer), and so are outputs that are nothing but their
sources' bytes in order (fused ``qkv_proj`` / ``gate_up_proj`` / ``w13_weight`` bands: one
write op per source range; TP slices along dim 1: one op with a segment per row, the iovecs of
one ``process_vm_writev``; copied once, by the write itself; ``WT_DIRECT_WRITES=0`` builds them
in the pool instead, for A/B measurements); everything else (casts, FP8,
runtime layouts, gathered sources) is built by prepare straight into
a slot of a preallocated output pool, taken at admission and given back at release, after the
task's batch completed; a task waits for pool space only while the chunks in flight fill it.
:attr:`Executor.setup_stats` says what registering cost. The records of an update
(:class:`TaskRecord`, :class:`BarrierRecord`, :class:`StepStats`) live in :mod:`weight_transfer.pipeline.records`.

Pipelined execution (the default, ``pipeline=True``): one thread per stage, each with a FIFO
queue. Tasks enter the first stage in plan order; when a stage finishes the task at the head
of its queue, the task moves to the tail of the next stage's queue, so stages of different
tasks overlap (the prepare of task k+1 runs while task k is being written). The write thread
does not wait for a task's batch before it posts the next: it keeps the posted batches in a FIFO
(:class:`weight_transfer.pipeline.tasks.WritesInFlight`), reaps them in order as they complete and only then
hands a task to release, so the writes of several tasks are in flight at once, bounded by the
watermark alone (a task's temporary bytes stay held until its writes completed). This is the
published executor's behaviour (Perplexity, Lequn Chen, 2025-09-17: "No need to wait for RDMA
to finish"). Every transport call of an update (post, poll, wait) stays on the write
thread (transports are not thread-safe; registration happened before any stage thread
existed); each batch's ``write_timeout`` counts from its post.
CMA's writes are synchronous, so on CPU at most one batch is in flight. On a CUDA device
the h2d thread copies on a side stream and records an event that prepare's stream waits on;
prepare records an event the write stage synchronizes before posting (guarded: CPU runs do
plain copies). ``pipeline=False`` runs every stage of a task before the next task starts, waiting for each
batch before the next task (stage-serialized, the baseline the pipeline is measured against).

Invariants:

- *Collective order.* A single prepare thread per rank runs ``full_tensor()`` for tasks in
  plan order, and every rank of a mesh has the same tasks of that mesh in the same order, so
  collectives on one process group are issued from one thread, in one order, on every rank.
- *Watermark.* A task enters its first stage (h2d if offloaded, else prepare) only while the
  temporary bytes of tasks in flight plus its own ``temp_bytes`` stay within ``watermark``
  bytes; a task larger than the watermark is admitted when nothing else is in flight (it runs
  alone, never deadlocks). ``watermark=None`` is unbounded. In flight = from the start of the
  first stage to the end of release. :class:`StepStats` reports the peak of the planned
  temporary bytes in flight (computed from the recorded timestamps, independent of the gate)
  and the peak of bytes the tasks actually allocated (gathered sources + outputs; on CUDA also
  the allocator's own peak).
- *Mesh groups.* Tasks come grouped by mesh group (disjoint meshes of one group run in
  parallel). After this rank's last ``full_tensor()`` of group g, the prepare thread issues an
  asynchronous barrier over all training ranks (``group_barrier(async_op=True)``, Gloo's
  ``dist.barrier``); the first prepare of any later group waits on that handle. It orders the
  groups' collectives only; writes of group g may still be in flight past it. Every rank
  issues exactly ``n_groups - 1`` barriers per step, in the same order, including ranks with
  no task in a group (they issue it when they pass the group). ``n_groups`` is agreed once at
  construction (an all-reduce MAX over the barrier's world) unless given.

Every task records its stage start/end times (``time.perf_counter`` seconds); :class:`StepStats`
carries the matching wall-clock origin so ranks line up. Intervals of one stage may overlap
(``write``), so :meth:`StepStats.stage_busy` counts the union of a stage's intervals.

*Errors.* The first error of any stage (h2d, prepare, write, release, a barrier) fails the
update and is raised naming the stage and the task (a gone receiver: the inference rank), the
original as ``__cause__``. From then on no batch is posted, but the prepare stage goes on to
the end of the plan making the *collectives only* -- the ``full_tensor()`` calls of every task
not yet gathered (a task that failed half-way resumes from its next source) and the barriers
between mesh groups -- without building or writing anything, so the other training ranks'
collectives complete and none is left blocked in one (C24, C28). A ``cancel`` event handed to
:meth:`Executor.run` (another rank failed) stops the update the same way and raises
:class:`UpdateCancelled`. When a collective itself raises (a peer died: the process group is
broken), no further collective is made this update. The batches still in flight are waited for
(each up to its deadline) and their pool chunks given back; a batch that timed out may still
be in flight, so its pool is replaced (registered again, the old buffer kept unused) before the
next update. The lease and epoch checks (C17) are the transport's, per batch, whatever memory
the batch reads. :meth:`run` returns only after every posted batch completed, so a rank's
reported success implies all its writes completed (what the control plane requires of every
rank before it publishes). :meth:`Executor.activity` says, from another thread, which task
prepare and a ``full_tensor()`` are in (the control plane names a rank that holds the others up
from it). With ``trace_dir`` each update is
saved as a Chrome trace per rank (:mod:`weight_transfer.timeline`).
"""
from __future__ import annotations

import inspect
import os
import threading
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..delta.fused import fuse
from ..options import ExecutorOptions
from ..timeline import peak_in_flight
from ..transport.base import Transport
from ..types import RankPlan, RegionDescriptor
from .memory import RegisteredMemory, SetupStats, built_bytes
from .records import BarrierRecord, StepStats, TaskRecord, task_kind  # noqa: F401 -- re-exported (the records of an update)
from .stages import _STOP, StageLoops, UpdateCancelled, _Skip, _Work  # noqa: F401 -- UpdateCancelled: part of this module's API
from .tasks import (
    MemoryGate,
    PostedTask,
    complete_task,
    gather_sources,  # noqa: F401 -- re-exported (the prepare stage's functions, tests/plan)
    iter_sources,
    post_ops,
    prepare_outputs,
    unique_nbytes,
)

STAGES = ("h2d", "prepare", "write", "release")
"""Stage names in pipeline order."""


# --------------------------------------------------------------------------------------------
# the executor



class Executor(StageLoops):
    """Executes a :class:`RankPlan` once per :meth:`run` (see module docstring).

    ``params`` maps checkpoint names to this rank's DTensors (an
    :class:`weight_transfer.plan.metadata.OffloadedParams` when the shards live in host memory: its
    ``host`` dict holds the host copies the trainer updates); ``remote`` maps inference rank
    -> its region descriptor (already connected on ``transport``). ``group_barrier`` is called
    as ``group_barrier(async_op=True)`` between mesh groups (e.g. ``dist.barrier`` of the
    training world; a callable without ``async_op`` is called synchronously).

    ``options`` (:class:`weight_transfer.options.ExecutorOptions`, default all defaults):
    ``pipeline`` (stage threads vs stage-serialized), ``watermark`` (bytes of temporaries in
    flight, None = unbounded), ``offload`` (require host-offloaded params; the h2d stage runs
    whenever ``params`` carries host copies; ValueError when they carry none), ``trace_dir``
    (save each update's timeline as ``step{NNNN}.rank{r}.json``). ``n_groups``: mesh groups of
    the whole schedule (agreed by all-reduce if omitted and a process group is up).

    The constructor registers the write memory with ``transport`` once
    (:class:`weight_transfer.pipeline.memory.RegisteredMemory`; ``pool_bytes``: the output pool's size,
    default sized by the watermark); :meth:`close` deregisters it (``transport.close()`` does too)."""

    def __init__(self, plan: RankPlan, params: dict[str, DTensor], transport: Transport,
                 remote: dict[int, RegionDescriptor], *, options: ExecutorOptions | None = None,
                 group_barrier=None, write_timeout: float | None = 60.0, n_groups: int | None = None, log=None,
                 pool_bytes: int | None = None, landing: dict[int, RegionDescriptor] | None = None, senders: int = 1):
        options = ExecutorOptions() if options is None else options
        self.options = options
        self.plan, self.params, self.transport, self.remote = plan, params, transport, remote
        self.group_barrier = group_barrier
        self.write_timeout = write_timeout
        self.pipeline = options.pipeline
        self.watermark = options.watermark
        offload = options.offload
        self.trace_dir = options.trace_dir
        self.log = log
        self.host: dict[str, torch.Tensor] = dict(getattr(params, "host", None) or {})
        if offload and not self.host:
            raise ValueError("offload=True but the parameters carry no host copies "
                             "(build them with weight_transfer.plan.metadata.offload_to_host)")
        self.offloaded = bool(self.host)
        groups = [t.group for t in plan.tasks]
        if groups != sorted(groups):
            raise ValueError(f"rank {plan.rank}: tasks are not ordered by mesh group: {groups}")
        self.n_groups = self._agree_n_groups(n_groups)
        self._last_of_group = {t.group: i for i, t in enumerate(plan.tasks)}
        self.device = self._device()
        self.cuda = self.device.type == "cuda"
        self._h2d_stream = torch.cuda.Stream(device=self.device) if (self.cuda and self.offloaded) else None
        self._barrier_async = self._accepts_async(group_barrier)
        self._runs = 0
        self._activity: dict = {"prepare": None, "collective": None}
        self.memory = RegisteredMemory(plan.tasks, params, transport, device=self.device, watermark=self.watermark,
                                       pool_bytes=pool_bytes, direct=not options.delta and os.environ.get("WT_DIRECT_WRITES", "1") != "0")
        self.setup_stats: SetupStats = self.memory.stats
        """What registering the write memory once cost (regions, bytes, seconds); see
        :meth:`SetupStats.summary` for the one-line form."""
        self.shift: dict[int, int] = {}
        self.verify = None
        """:class:`weight_transfer.control.fingerprint.VerifyOptions` (set by the sender from the plan):
        each run hashes its selected writes into :attr:`fingerprints`."""
        self.fingerprints = None
        """The last run's :class:`weight_transfer.control.fingerprint.SenderHashes` (None: verify off)."""
        """Inference rank -> bytes added to its planned offsets in the next :meth:`run` (flip
        shadow targets, :mod:`weight_transfer.api.shadow`: the half that is not live); the caller sets
        it per update from the controller's ``step/{v}/shift``."""
        self.delta = None
        """:class:`weight_transfer.delta.runs.DeltaState` with ``options.delta`` (the shadow and the
        full-or-delta decision), else None."""
        self.landing = dict(landing or {})
        """Inference rank -> its landing region's descriptor (packed deltas,
        :mod:`weight_transfer.delta.packed`; connected on ``transport``)."""
        if options.delta:
            self._delta_setup(options, senders)
        self._close = weakref.finalize(self, self.memory.close)  # an executor dropped unclosed: no leak

    def close(self) -> None:
        """Deregister the memory registered at setup (after the last update; also done when the
        executor is garbage-collected, so one built per update leaks nothing, but registers
        every time: build it once)."""
        self._close()
        if self.delta is not None and self.delta.packer is not None:
            self.delta.packer.close()

    # -- setup helpers

    def _delta_setup(self, options: ExecutorOptions, senders: int) -> None:
        """The delta state (:mod:`weight_transfer.delta.runs`): shadow, cost model, and a packer when
        receivers published landing regions and ``delta_mode`` is not ``scattered``."""
        from ..delta.cost import CostModel
        from ..delta.packed import Packer
        from ..delta.runs import DeltaState

        name = getattr(self.transport, "name", "cma")
        cost = CostModel.for_transport(name, mode=options.delta_mode, wire_gbps=options.delta_wire_gbps,
                                       op_cost_bytes=options.delta_op_cost, fmt=options.delta_format)
        packer = None
        if self.landing and options.delta_mode != "scattered" and self.device.type == "cpu":
            packer = Packer(self.landing, self.transport, rank=self.plan.rank, senders=senders, device=self.device)
        names = {(i, j, k): o.tensor for i, t in enumerate(self.plan.tasks) for j, a in enumerate(t.assignments)
                 for k, o in enumerate(a.recipe.outputs)}
        self.delta = DeltaState(self.memory.places, device=self.device, granularity=options.delta_granularity,
                                merge_gap=options.delta_merge_gap, max_bytes=options.delta_max_bytes,
                                rank=self.plan.rank, cost=cost, packer=packer, names=names)
        self.delta.fuse = options.delta_fused
        from ..transport.runs import RunsOp

        self.delta.runs_op = RunsOp
        if packer is not None:
            self.memory.stats.registered_bytes += packer.nbytes
        self._say(f"delta updates: shadow of {self.delta.shadow_bytes / 1e6:.1f} MB (granularity "
                  f"{self.delta.granularity} B, merge gap {options.delta_merge_gap} B, mode {options.delta_mode}, "
                  f"records {self.delta.format}, "
                  f"wire {1e-9 / cost.wire_s_per_byte:.2f} GB/s, run {cost.run_s * 1e9:.0f} ns; packing into "
                  f"{len(packer._at) if packer else 0} landing region(s), {packer.nbytes / 1e6 if packer else 0:.1f} MB)")

    def _agree_n_groups(self, n_groups: int | None) -> int:
        local = max((t.group for t in self.plan.tasks), default=-1) + 1
        if n_groups is None:
            n_groups = self.plan.n_groups
        if n_groups is not None:
            if n_groups < local:
                raise ValueError(f"n_groups={n_groups} but rank {self.plan.rank} has a task in group {local - 1}")
            return n_groups
        if self.group_barrier is not None and dist.is_available() and dist.is_initialized():
            t = torch.tensor([local], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return int(t.item())
        return local

    def _device(self) -> torch.device:
        for p in self.params.values():
            return (p.to_local() if isinstance(p, DTensor) else p).device
        return torch.device("cpu")

    @staticmethod
    def _accepts_async(fn) -> bool:
        if fn is None:
            return False
        try:
            return "async_op" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return False

    def _say(self, msg: str) -> None:
        if self.log is not None:
            self.log(f"[rank {self.plan.rank}] {msg}")

    # -- barriers (called from the prepare stage only)

    def _issue_barriers_through(self, group: int) -> None:
        """Issue the barriers after every group up to and including ``group`` not issued yet
        (never after the last group)."""
        while self._next_barrier <= min(group, self.n_groups - 2):
            g = self._next_barrier
            t = time.perf_counter()
            handle = None
            if self.group_barrier is not None:
                if self._barrier_async:
                    handle = self.group_barrier(async_op=True)
                else:
                    self.group_barrier()
            self._handles.append((handle, BarrierRecord(g, t)))
            self._next_barrier += 1

    def _wait_barriers_before(self, group: int, st: StepStats) -> None:
        """Before the first prepare of ``group``: the barriers after groups < ``group`` are
        issued (for groups this rank had no task in, now) and complete."""
        self._issue_barriers_through(group - 1)
        while self._handles and self._handles[0][1].group < group:
            handle, rec = self._handles.pop(0)
            t0 = time.perf_counter()
            if handle is not None:
                handle.wait()
            rec.waited = (t0, time.perf_counter())
            st.barriers.append(rec)

    def _finish_barriers(self, st: StepStats) -> None:
        self._wait_barriers_before(self.n_groups, st)

    # -- stages

    def _admit(self, w: _Work, abort: threading.Event | None) -> None:
        t0 = time.perf_counter()
        try:
            self._gate.acquire(w.task.temp_bytes, abort)
            w.admitted = True
            w.pool_off = self.memory.acquire(w.index, abort)  # this task's output pool chunk
        except RuntimeError:
            if abort is not None and abort.is_set():  # the update stopped while this task waited
                raise _Skip() from None
            raise
        w.rec.gate_wait = time.perf_counter() - t0

    def _h2d(self, w: _Work, abort=None) -> None:
        self._admit(w, abort)
        t0 = time.perf_counter()
        n = 0
        copies = []
        for name in w.task.sources + w.task.local_sources:
            host = self.host.get(name)
            p = self.params.get(name)
            if host is None or p is None:
                continue
            dev = p.to_local() if isinstance(p, DTensor) else p
            copies.append((dev, host))
            n += host.nbytes
        if self._h2d_stream is not None:
            with torch.no_grad(), torch.cuda.stream(self._h2d_stream):
                for dev, host in copies:
                    dev.copy_(host, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._h2d_stream)
            ev.synchronize()  # the h2d thread has nothing else to do; keeps its timeline honest
            w.h2d_event = ev
        else:
            with torch.no_grad():
                for dev, host in copies:
                    dev.copy_(host)
        w.rec.h2d_bytes = n
        w.rec.stages["h2d"] = (t0, time.perf_counter())

    def activity(self) -> dict[str, tuple[int, float] | None]:
        """What this rank's update is doing now, for naming a rank that holds the others up:
        ``{"prepare": (task id, seconds in it), "collective": (task id, seconds in its
        full_tensor()) or None}`` (a stage not started yet: None). Read from another thread."""
        now = time.perf_counter()
        return {k: (v[0], now - v[1]) if v is not None else None for k, v in dict(self._activity).items()}

    def _prepare(self, w: _Work, st: StepStats, abort=None) -> None:
        self._activity["prepare"] = (w.task.id, time.perf_counter())
        if not w.admitted:
            self._admit(w, abort)
        task = w.task
        self._wait_barriers_before(task.group, st)
        t0 = time.perf_counter()
        if w.h2d_event is not None:
            torch.cuda.current_stream(self.device).wait_event(w.h2d_event)
        with torch.no_grad():
            tg = time.perf_counter()
            full = self._gather(w)
            w.rec.gather_s = time.perf_counter() - tg if w.task.sources else 0.0
            w.rec.kind = task_kind(task)
            if self._last_of_group.get(task.group) == w.index:
                w.barriers_issued = True
                self._issue_barriers_through(task.group)
            into = self.memory.buffers(w.index, w.pool_off)
            fused = fuse(self.delta, task, w.index, full, into)  # delta: cast + compare in one pass
            outs = prepare_outputs(task, full, into=into)
            for ai, o in fused.items():
                outs[ai] = o
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            w.ready_event = ev
        gathered = [full[n] for n in task.sources if isinstance(self.params.get(n), DTensor)]
        w.rec.gather_bytes = unique_nbytes(gathered)
        w.rec.copy_bytes = built_bytes(outs, full)
        w.rec.alloc_bytes = w.rec.gather_bytes + w.rec.copy_bytes
        w.full, w.outputs = full, outs
        t1 = time.perf_counter()
        w.rec.stages["prepare"] = (t0, t1)
        self._activity["prepare"] = None
        with self._lock:
            self._alloc_now += w.rec.alloc_bytes
            self._alloc_peak = max(self._alloc_peak, self._alloc_now)

    def _gather(self, w: _Work) -> dict[str, torch.Tensor]:
        """:func:`weight_transfer.pipeline.tasks.gather_sources` of ``w.task``, counting the collectives
        done in ``w.gathered`` (so a failure later in prepare can finish the task's share of
        them, :meth:`_collectives_only`)."""
        out = {}
        for name, get in iter_sources(w.task, self.params):
            w.in_collective = True
            self._activity["collective"] = (w.task.id, time.perf_counter())
            out[name] = get()
            self._activity["collective"] = None
            w.in_collective = False
            if name in w.task.sources:
                w.gathered += 1
        return out

    def _post_write(self, w: _Work) -> PostedTask:
        """Post ``w``'s batch (after its outputs are ready on the device) from the memory
        registered at setup; do not wait."""
        if w.ready_event is not None:
            w.ready_event.synchronize()
        ops, copied = self.memory.ops(w.index, w.task, w.outputs, w.pool_off, self.remote, self.delta, self.shift)
        w.rec.copy_bytes += copied
        if self.fingerprints is not None:  # the bytes as the plan says they go, before the buffer is reused
            from .hashes import hash_task

            hash_task(self.fingerprints, self.memory, w.index, w.task, w.outputs, w.pool_off)
        packer = self.delta.packer if self.delta is not None else None
        if packer is not None and packer.region is not None:  # packed records: one batch at the end (run())
            recs = [o for o in ops if getattr(o, "local", None) is packer.region]
            if recs:
                self._records.extend(recs)
                ops = [o for o in ops if getattr(o, "local", None) is not packer.region]
        p = post_ops(w.task, ops, self.transport, self.remote, self.write_timeout, item=w)
        p.n_ops -= self.memory.extra_ops  # a planned write from several shard ranges counts once
        return p

    def _write_done(self, p: PostedTask, n: int, st: StepStats) -> None:
        """Account a completed batch: bytes, ops, and the write stage's (post, completion)."""
        st.bytes_sent += n
        st.n_writes += p.n_ops
        p.item.rec.stages["write"] = (p.posted, time.perf_counter())

    def _write(self, w: _Work, st: StepStats) -> None:
        """Stage-serialized write: post the batch and wait for it (the next task waits)."""
        p = self._post_write(w)
        try:
            n = complete_task(p, self.transport, self.remote, block=True)
        except TimeoutError:
            self.memory.suspect = True  # its writes may still read the pool
            raise
        self._write_done(p, n, st)

    def _drop(self, w: _Work) -> None:
        """Skip ``w`` after an abort: give its admitted bytes back to the gate (and its pool
        chunk back), so the first stage waiting there is not left blocked."""
        self._give_back(w)

    def _give_back(self, w: _Work) -> None:
        if w.pool_off is not None:
            self.memory.release(w.index, w.pool_off)
            w.pool_off = None
        if w.admitted:
            self._gate.release(w.task.temp_bytes)
            w.admitted = False

    def _release(self, w: _Work) -> None:
        t0 = time.perf_counter()
        w.full = w.outputs = w.h2d_event = w.ready_event = None
        with self._lock:
            self._alloc_now -= w.rec.alloc_bytes
        w.rec.stages["release"] = (t0, time.perf_counter())  # before the gate opens: intervals stay disjoint
        self._give_back(w)

    # -- running

    def _stage_fns(self, st: StepStats):
        fns = []
        if self.offloaded:
            fns.append(("h2d", lambda w, ab: self._h2d(w, ab)))
        fns += [("prepare", lambda w, ab: self._prepare(w, st, ab)),
                ("write", lambda w, ab: self._write(w, st)),
                ("release", lambda w, ab: self._release(w))]
        return fns

    def run(self, step: int | None = None, *, cancel: threading.Event | None = None) -> StepStats:
        """One update: every task of the plan through every stage. Returns this rank's
        :class:`StepStats`; raises the first stage error (RuntimeError naming stage and task,
        the original as ``__cause__``), or :class:`UpdateCancelled` when ``cancel`` was set
        (by another thread: another rank failed) before the update finished. Either way it
        returns only once this rank took part in every collective of the plan (``full_tensor()``
        and group barriers: the failed or cancelled tasks' collectives are made without building
        or writing anything) and every posted batch completed or timed out; after a stop no
        batch is posted. ``cancel`` is also set by the executor itself at its first error."""
        self._runs += 1
        step = self._runs if step is None else step
        st = StepStats(rank=self.plan.rank, watermark=self.watermark, pipelined=self.pipeline,
                       offloaded=self.offloaded, step=step, full_bytes=self.plan.send_bytes)
        self.fingerprints = None
        if self.verify is not None and self.verify.mode != "off":
            from .hashes import SenderHashes

            self.fingerprints = SenderHashes(self.verify.mode, self.verify.cycle, step, self.verify.algo)
        stop = cancel if cancel is not None else threading.Event()
        if self.delta is not None:
            d = self.delta
            sig = {**self.remote, **{("landing", r): x for r, x in self.landing.items()}}
            st.delta = f"full: {d.reason}" if d.begin(sig, step) else "delta"
            d.fused_s = 0.0
            st.delta_shadow_bytes = d.shadow_bytes
            self._records = []
            try:
                out = self._run(st, step, stop)
                t0 = time.perf_counter()
                recs, self._records = self._records, []
                if recs:  # every packed record of the update in one batch: one round trip, not one per task
                    st.bytes_sent += self.transport.write(recs).wait(self.write_timeout)
                    st.n_writes += len(recs)
                dir_ops = d.packer.finish() if d.packer is not None else []
                if dir_ops:  # the directory entries, once every record landed (the receiver's commit reads them)
                    st.bytes_sent += self.transport.write(dir_ops).wait(self.write_timeout)
                    st.n_writes += len(dir_ops)
            except BaseException:
                d.end(step, ok=False)
                raise
            d.end(step, ok=True)
            st.delta_compare_s, st.delta_whole, st.delta_fused_s = d.seconds, d.whole, d.fused_s
            st.delta_pack_s = d.packer.seconds if d.packer is not None else 0.0
            st.delta_wire_s = st.stage_busy().get("write", 0.0) + (time.perf_counter() - t0)
            st.delta_modes, st.delta_tensors = d.summary(), list(d.tensors)
            return out
        return self._run(st, step, stop)

    def _run(self, st: StepStats, step: int, stop: threading.Event) -> StepStats:
        self._gate = MemoryGate(self.watermark)
        self.memory.reset()
        self._lock = threading.Lock()
        self._alloc_now = self._alloc_peak = 0
        self._next_barrier = 0
        self._handles: list = []
        self._broken: str | None = None
        self._activity = {"prepare": None, "collective": None}
        works = [_Work(t, i) for i, t in enumerate(self.plan.tasks)]
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        st.t_start, st.wall_start = time.perf_counter(), time.time()
        fns = self._stage_fns(st)
        errors: list[tuple[str, int, str, BaseException]] = []
        if self.pipeline:
            self._run_pipelined(works, fns, st, stop, errors)
        else:
            self._run_serial(works, fns, st, stop, errors)
        if errors:
            name, tid, label, e = errors[0]
            raise RuntimeError(f"rank {self.plan.rank}: stage {name} of task {tid} ({label}) failed: "
                               f"{type(e).__name__}: {e}") from e
        if stop.is_set():
            raise UpdateCancelled(f"rank {self.plan.rank}: update {step} cancelled (another rank failed); this "
                                  "rank's collectives ran to the end, it posted no write after the cancel")
        if self.cuda:
            torch.cuda.synchronize(self.device)
            st.peak_device_bytes = torch.cuda.max_memory_allocated(self.device) - base
        st.seconds = time.perf_counter() - st.t_start
        st.records = [w.rec for w in works]
        st.peak_temp_bytes = peak_in_flight((r.start, r.end, r.temp_bytes) for r in st.records if r.stages)
        st.peak_alloc_bytes = self._alloc_peak
        if self.trace_dir:
            from ..timeline import save_rank_trace

            save_rank_trace(self.trace_dir, st)
        return st
