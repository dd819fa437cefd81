"""The cost model's event loop (:func:`~weight_transfer.experiments.sim.model.simulate`): every
training rank's tasks through the executor's four FIFO stages, on paper.

A heap of timestamped events, processed in order of time with ties broken by a sequence number,
so the result is deterministic. Five event kinds: ``0`` a rank may arrive at its next prepare
(its h2d copy or a barrier it waits for is over), ``1`` a prepare done, ``2`` a task's writes
done, ``3`` the barrier after a mesh group, ``4`` a task released. After each, the rank (every
rank, after a barrier) moves as far as it can at that time (:meth:`EventLoop.kick`): tasks are
admitted under the watermark and copied to the device, the next one arrives at its prepare (a
``full_tensor()`` collective over the task's mesh, which starts when every rank of the mesh has
arrived), prepared tasks post their writes. The semantics and the costs are those of
``model.py``'s docstring; the costs per task come from ``model._task_costs``.
"""
from __future__ import annotations

import heapq

from .hardware import Hardware

STAGES = ("h2d", "prepare", "write", "release")


class EventLoop:
    """One update of a schedule on paper. ``per_rank``: per training rank, its tasks in plan
    order, each ``(task id, mesh group, temporary bytes, h2d bytes, compute seconds,
    ((destination rank, bytes, writes), ...), mesh)``; ``ag``: per task id, its all-gather
    ``(seconds, over the fabric?, fabric bytes, NVLink bytes)``; ``watermark``: a rank's
    temporary bytes in flight, bytes (``math.inf``: unbounded); ``overlap``: every prepared
    task's writes in flight at once (``writes_in_flight="watermark"``), else one task's at a
    time; ``keep``: the ranks whose stage runs are recorded in :attr:`events`.

    After :meth:`run`: :attr:`busy` (per rank and stage, seconds in it), :attr:`peak` (the
    largest temporary bytes one rank held), :attr:`events` (``(rank, task, stage, start,
    end)``)."""

    def __init__(self, per_rank: dict[int, list[tuple]], ag: dict[int, tuple], hw: Hardware, *,
                 watermark: float, overlap: bool, keep: set[int]):
        self.per_rank, self.ag, self.wm, self.overlap, self.keep = per_rank, ag, watermark, overlap, keep
        self.nic = hw.nic_Bps
        self.msg, self.lat, self.rel_s = hw.rdma_msg_us * 1e-6, hw.rdma_latency_us * 1e-6, hw.release_us * 1e-6
        self.pcie = hw.pcie_gbs * 1e9
        self.barrier_s = hw.barrier_us * 1e-6
        ranks = self.ranks = sorted(per_rank)
        self.n_tasks = {r: len(per_rank[r]) for r in ranks}
        # per-rank state
        self.adm = dict.fromkeys(ranks, 0)          # next task to admit
        self.prep = dict.fromkeys(ranks, 0)         # next task to arrive at prepare
        self.prep_busy = dict.fromkeys(ranks, False)
        self.prepped = dict.fromkeys(ranks, 0)      # tasks whose prepare is done
        self.wr = dict.fromkeys(ranks, 0)           # next task to write
        self.writing = dict.fromkeys(ranks, False)
        self.released = dict.fromkeys(ranks, 0)
        self.h2d_free = dict.fromkeys(ranks, 0.0)
        self.rel_free = dict.fromkeys(ranks, 0.0)
        self.h2d_end: dict[int, list[float]] = {r: [] for r in ranks}
        self.inflight = dict.fromkeys(ranks, 0)
        self.peak = 0
        self.tx_free: dict[int, float] = {}
        self.rx_free: dict[int, float] = {}
        self.busy = {r: dict.fromkeys(STAGES, 0.0) for r in ranks}
        self.events: list[tuple] = []
        # collectives
        self.arrived: dict = {}
        self.arrive_t: dict = {}
        self.pos_of = {(r, t[0]): i for r in ranks for i, t in enumerate(per_rank[r])}
        self._barriers()
        self.heap: list = []
        self.seq = 0
        self.t_end = 0.0

    def _barriers(self) -> None:
        """Per mesh group: how many ranks have still to finish their last prepare of it
        (:attr:`remaining`; :attr:`last_of`: per rank, group -> that task's position) and the
        groups whose barrier its prepares wait for (:attr:`gate`)."""
        ranks, per_rank = self.ranks, self.per_rank
        groups = sorted({t[1] for r in ranks for t in per_rank[r]})
        self.last_of: dict[int, dict[int, int]] = {r: {} for r in ranks}
        self.remaining = dict.fromkeys(groups, 0)
        for r in ranks:
            for i, t in enumerate(per_rank[r]):
                self.last_of[r][t[1]] = i
            for g in self.last_of[r]:
                self.remaining[g] += 1
        self.released_at: dict[int, float] = {}     # barrier after group g
        self.gate = {g: [h for h in groups if h < g] for g in groups}

    def push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        """Queue an event of ``kind`` at time ``t`` (seconds) for rank (or group) ``a``, task position ``b``."""
        self.seq = seq = self.seq + 1
        heapq.heappush(self.heap, (t, seq, kind, a, b))

    def arrive(self, r: int, now: float) -> None:
        """Rank ``r``'s next admitted task arrives at its prepare, if its h2d copy and the
        barriers before its group are over; the last rank of the mesh to arrive starts the
        collective (on the ranks' NICs when it crosses nodes), then each rank's own compute."""
        tasks, prep, gate, released_at = self.per_rank[r], self.prep, self.gate, self.released_at
        i = prep[r]
        if i >= self.adm[r] or self.prep_busy[r]:
            return
        tid, g = tasks[i][0], tasks[i][1]
        for h in gate[g]:
            if h not in released_at:
                return  # the barrier event kicks every rank
        ready = max(self.h2d_end[r][i], max((released_at[h] for h in gate[g]), default=0.0))
        if ready > now:
            self.push(ready, 0, r)
            return
        self.prep_busy[r] = True
        prep[r] += 1
        mesh = tasks[i][6]
        key = tid if len(mesh) > 1 else (tid, r)  # local tasks: one per rank, no collective
        arrived, arrive_t, tx_free = self.arrived, self.arrive_t, self.tx_free
        arrived[key] = arrived.get(key, 0) + 1
        arrive_t[key] = max(arrive_t.get(key, 0.0), now)
        if arrived[key] == len(mesh):
            sec, fab, _, _ = self.ag[tid]
            start = arrive_t[key]
            if fab:
                start = max([start] + [tx_free.get(q, 0.0) for q in mesh])
            end = start + sec
            if fab:
                for q in mesh:
                    tx_free[q] = end
            for q in mesh:
                k = self.pos_of[(q, tid)]
                comp = self.per_rank[q][k][4]
                self.busy[q]["prepare"] += end + comp - start
                if q in self.keep:
                    self.events.append((q, tid, "prepare", start, end + comp))
                self.push(end + comp, 1, q, k)

    def kick(self, r: int, now: float) -> None:
        """Move rank ``r`` as far as it can go at ``now``: admit its next tasks while its
        temporary bytes stay under the watermark (a task alone always), each one's h2d copy
        queued on the rank's PCIe link; arrive at the next prepare (:meth:`arrive`); post the
        writes of prepared tasks (every receiving NIC a FIFO server in order of posting)."""
        tasks, adm, inflight, h2d_free = self.per_rank[r], self.adm, self.inflight, self.h2d_free
        busy, keep, events = self.busy[r], self.keep, self.events
        # 1. admission (watermark) + h2d
        while adm[r] < self.n_tasks[r]:
            tb = tasks[adm[r]][2]
            if inflight[r] and inflight[r] + tb > self.wm:
                break
            inflight[r] += tb
            self.peak = max(self.peak, inflight[r])
            h = tasks[adm[r]][3] / self.pcie
            s = max(now, h2d_free[r])
            h2d_free[r] = s + h
            self.h2d_end[r].append(s + h)
            if h:
                busy["h2d"] += h
                if r in keep:
                    events.append((r, tasks[adm[r]][0], "h2d", s, s + h))
            adm[r] += 1
        # 2. arrive at the next prepare (collective)
        self.arrive(r, now)
        # 3. write stage: "task" -- one task's writes at a time (the next task's are posted
        # when every write of this one completed); "watermark" -- every prepared task's
        # writes are posted now, behind what this rank's NIC already has queued
        wr, writing, tx_free, rx_free, nic, msg = self.wr, self.writing, self.tx_free, self.rx_free, self.nic, self.msg
        while wr[r] < self.prepped[r] and not writing[r]:
            j = wr[r]
            wr[r] += 1
            ws = tasks[j][5]
            writing[r] = not self.overlap
            if not ws:
                self.push(now, 2, r, j)
                continue
            start = max(now, tx_free.get(r, 0.0))
            cur = done = start
            for d, b, n in ws:
                x = b / nic
                cur += n * msg + x
                rs = max(cur - x, rx_free.get(d, 0.0))
                rx_free[d] = rs + x
                if rx_free[d] > done:
                    done = rx_free[d]
            tx_free[r] = cur
            end = max(cur, done) + self.lat
            # busy: "task" -- the stage is held until the batch completes; "watermark" -- the
            # stage is the NIC posting this task's bytes (completions are waited on by nobody)
            busy["write"] += (end - now) if not self.overlap else (cur - start)
            if r in keep:
                events.append((r, tasks[j][0], "write", now, end))
            self.push(end, 2, r, j)

    def run(self) -> float:
        """Process every event from "go" (time 0); returns the time of the last release,
        seconds. Raises RuntimeError when a rank did not release every task (a model bug)."""
        per_rank, kick, push, heap, rel_s = self.per_rank, self.kick, self.push, self.heap, self.rel_s
        rel_free, busy, keep, events = self.rel_free, self.busy, self.keep, self.events
        for r in self.ranks:
            kick(r, 0.0)
        while heap:
            now, _, kind, r, i = heapq.heappop(heap)
            if kind == 1:  # prepare done
                self.prep_busy[r] = False
                self.prepped[r] += 1
                g = per_rank[r][i][1]
                if self.last_of[r][g] == i:
                    self.remaining[g] -= 1
                    if self.remaining[g] == 0:
                        push(now + self.barrier_s, 3, g)
            elif kind == 2:  # write done -> release (FIFO: after the previous release)
                self.writing[r] = False
                rs0 = max(now, rel_free[r])
                rel_free[r] = rs0 + rel_s
                busy[r]["release"] += rel_s
                if r in keep:
                    events.append((r, per_rank[r][i][0], "release", rs0, rs0 + rel_s))
                push(rs0 + rel_s, 4, r, i)
            elif kind == 3:  # barrier after group r released
                self.released_at[r] = now
                for q in self.ranks:
                    kick(q, now)
                continue
            elif kind == 4:  # released
                self.inflight[r] -= per_rank[r][i][2]
                self.released[r] += 1
                self.t_end = max(self.t_end, now)
            kick(r, now)
        self._check_finished()
        return self.t_end

    def _check_finished(self) -> None:
        """Raises RuntimeError naming the first rank that did not release every task."""
        stuck = [r for r in self.ranks if self.released[r] != self.n_tasks[r]]
        if stuck:
            r0 = stuck[0]
            detail = (f"rank {r0}: {self.n_tasks[r0]} tasks, admitted {self.adm[r0]}, arrived at prepare "
                      f"{self.prep[r0]}, prepared {self.prepped[r0]}, writes started {self.wr[r0]}, "
                      f"released {self.released[r0]}")
            raise RuntimeError(f"simulation stalled: ranks {stuck[:8]} did not finish (model bug); {detail}")

    def stage_busy(self) -> dict[str, float]:
        """Per stage, the busiest rank's seconds in it."""
        return {s: max((self.busy[r][s] for r in self.ranks), default=0.0) for s in STAGES}
