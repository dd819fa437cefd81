"""Runs one training rank's part of the schedule for one step.

Stages, named the same in README, code and logs:

- ``h2d``: copy an offloaded (host) shard to the device buffer (only when offloaded);
- ``prepare``: ``full_tensor()`` of each source (collective over the source's DeviceMesh, same
  order on every rank), then each assigned recipe's fusion / slicing / cast / FP8 quantization
  into contiguous output buffers;
- ``write``: register the outputs, post every one-sided write of the task as one batch,
  wait for completion;
- ``release``: drop the temporaries.

This module runs the stages in sequence per task (``mode="serial"``); the pipelined executor
(stage queues, watermark) builds on the same task functions. Every task records its stage
start/end times (``time.perf_counter`` seconds) for timelines.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .planner import RankPlan, Task
from .transforms import recipe_outputs
from .transport.base import Transport, WriteOp
from .types import RegionDescriptor


@dataclass
class TaskRecord:
    """Stage timestamps of one task on one rank (perf_counter seconds)."""

    task: int
    group: int
    stages: dict[str, tuple[float, float]] = field(default_factory=dict)
    temp_bytes: int = 0
    send_bytes: int = 0


@dataclass
class StepStats:
    """What one rank did in one update."""

    rank: int
    bytes_sent: int = 0
    n_writes: int = 0
    seconds: float = 0.0
    peak_temp_bytes: int = 0
    records: list[TaskRecord] = field(default_factory=list)

    def stage_busy(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in self.records:
            for s, (a, b) in r.stages.items():
                out[s] = out.get(s, 0.0) + (b - a)
        return out


def gather_sources(task: Task, params: dict[str, DTensor]) -> dict[str, torch.Tensor]:
    """``full_tensor()`` of every source of ``task``, in the task's order (collective)."""
    out = {}
    for name in task.sources:
        p = params[name]
        out[name] = p.full_tensor() if isinstance(p, DTensor) else p
    return out


def prepare_outputs(task: Task, full: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """Outputs of every recipe assigned to this rank, contiguous, in assignment order."""
    return [[o.contiguous() for o in recipe_outputs(a.recipe, full.__getitem__)] for a in task.assignments]


def write_outputs(task: Task, outputs: list[list[torch.Tensor]], transport: Transport,
                  remote: dict[int, RegionDescriptor], timeout: float | None = None) -> tuple[int, int]:
    """Post every write of ``task`` as one batch and wait. Returns (bytes, number of writes)."""
    ops: list[WriteOp] = []
    regions = []
    for a, outs in zip(task.assignments, outputs):
        regs = []
        for o in outs:
            reg = transport.register(o.view(-1).view(torch.uint8) if o.numel() else o)
            regions.append(reg)
            regs.append(reg)
        for w in a.writes:
            if w.length != regs[w.output].length:
                raise RuntimeError(f"task {task.id}: {a.recipe.name} output {w.output} is {regs[w.output].length} bytes, "
                                   f"the plan writes {w.length}")
            ops.append(WriteOp(regs[w.output], 0, remote[w.dst_rank], w.remote_offset, w.length))
    try:
        n = transport.write(ops).wait(timeout) if ops else 0
    finally:
        for reg in regions:
            transport.deregister(reg)
    return n, len(ops)


class Executor:
    """Executes a :class:`RankPlan` (see module docstring). ``params`` maps checkpoint names to
    this rank's DTensors; ``remote`` maps inference rank -> its region descriptor (already
    connected on ``transport``)."""

    def __init__(self, plan: RankPlan, params: dict[str, DTensor], transport: Transport,
                 remote: dict[int, RegionDescriptor], *, group_barrier=None, write_timeout: float | None = 60.0):
        self.plan, self.params, self.transport, self.remote = plan, params, transport, remote
        self.group_barrier = group_barrier
        self.write_timeout = write_timeout

    def run(self) -> StepStats:
        st = StepStats(rank=self.plan.rank)
        t_start = time.perf_counter()
        cur_group = None
        for task in self.plan.tasks:
            if cur_group is not None and task.group != cur_group and self.group_barrier is not None:
                self.group_barrier()
            cur_group = task.group
            rec = TaskRecord(task.id, task.group, temp_bytes=task.temp_bytes, send_bytes=task.send_bytes)
            t0 = time.perf_counter()
            full = gather_sources(task, self.params)
            outs = prepare_outputs(task, full)
            t1 = time.perf_counter()
            rec.stages["prepare"] = (t0, t1)
            n, k = write_outputs(task, outs, self.transport, self.remote, self.write_timeout)
            t2 = time.perf_counter()
            rec.stages["write"] = (t1, t2)
            del full, outs
            rec.stages["release"] = (t2, time.perf_counter())
            st.bytes_sent += n
            st.n_writes += k
            st.peak_temp_bytes = max(st.peak_temp_bytes, task.temp_bytes)
            st.records.append(rec)
        st.seconds = time.perf_counter() - t_start
        return st
