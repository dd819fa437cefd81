"""The stage-level cost model: executes a :class:`~weight_transfer.types.Schedule` on paper.

Semantics are the executor's (reference/pipeline/executor.py, DESIGN.md "Pipeline"):

- every training rank runs its tasks in plan order through four FIFO stages, each one task
  at a time: ``h2d`` (host-to-device copy of the rank's shards of the task's sources, only when
  offloaded) -> ``prepare`` (``full_tensor()`` of each source, a collective over the source's
  DeviceMesh that starts when every rank of the mesh has reached it; then this rank's fusion
  and quantization) -> ``write`` (post every one-sided write of the task, wait for all
  completions) -> ``release``; with ``writes_in_flight="watermark"`` (the published
  executor, :data:`WRITES_IN_FLIGHT`) the write stage does not wait: every prepared task's
  writes are posted at once and the task is released when its own writes completed, so the
  writes of several tasks are in flight together, bounded only by the watermark;
- the watermark: a task is admitted (its first stage may start) only while the rank's
  temporary bytes in flight (admitted, not yet released) plus its ``temp_bytes`` stay under
  the watermark; a task larger than the watermark is admitted only when nothing else is in
  flight, so it runs alone and never deadlocks;
- mesh groups are separated by a barrier: no ``prepare`` of group ``g+1`` starts before
  every rank of group ``g`` has finished its last ``prepare`` of ``g`` plus one barrier time
  (the barrier is issued asynchronously after the group's last ``full_tensor()``, so writes
  of group ``g`` overlap it).

Costs (every figure a named field of :class:`~weight_transfer.experiments.sim.hardware.Hardware`):

- ``h2d``: the rank's shard bytes / ``pcie_gbs``;
- ``full_tensor()``: a ring all-gather of ``S`` bytes over the ``n`` ranks that hold shards
  of it: ``(n-1)/n * S / bw + (n-1) * collective_step_us``, over NVLink when those ranks
  share a node, else over the RDMA fabric, where it occupies the ranks' NICs (writes and
  all-gathers on one NIC are serialized);
- fusion + quantization: memory bound, ``(3 * assembled + output bytes) / hbm_gbs`` plus
  two kernel launches per recipe;
- ``write``: the sender's NIC posts the task's writes in order, grouped per receiver:
  ``n * rdma_msg_us + bytes / nic_gbps``; every receiving NIC is a FIFO server at
  ``nic_gbps`` in order of posting, so a write completes when both ends are done, plus
  ``rdma_latency_us``. Both ends of every link are capacity-limited, bytes are conserved.

Why a direct event loop (a heap of timestamped events, no simulation library): the model has
exactly four event kinds (stage ready, collective complete, write done, release), the order
of processing is the order of time with ties broken by a sequence number, so the result is
deterministic and the loop (``loop.py``: :class:`~weight_transfer.experiments.sim.loop.EventLoop`)
is a page of code anyone can check against the executor.

:func:`floors` gives the physical floor next to every prediction: bytes through the busiest
NIC (send or receive, fabric all-gathers included), PCIe link and NVLink link divided by the
line rate. :func:`rank0_funnel`, :func:`nccl_broadcast_funnel`, :func:`rpc_update_weight`
and :func:`ckpt_engine_broadcast` are the baselines, on the same hardware figures.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from weight_transfer.types import ParamMeta, Schedule, itemsize, numel

from .hardware import Hardware
from .loop import STAGES, EventLoop  # noqa: F401  (STAGES re-exported)

WRITES_IN_FLIGHT = ("task", "watermark")
"""How many tasks' writes one training rank has in flight (:func:`simulate`'s
``writes_in_flight``). ``"task"``: one task at a time, as ``reference/pipeline/executor.py`` ran them
before the finding of docs/SIMULATION.md section 3 (and still does with ``pipeline=False``:
a task's writes posted as one batch, every completion waited for before the next task). Its
pipelined write stage now keeps several tasks' batches in flight, i.e. ``"watermark"``. ``"watermark"``: as the published executor runs them (Perplexity,
"Weight Transfer for RL Post-Training in under 2 seconds", 2025-09: a poll loop that starts tasks
while the temporary bytes stay under the watermark and submits a task's RDMA WRITEs as soon as
its GPU ops' CUDA event has completed; the writes of earlier tasks are still in flight; fabric-lib's
transfers are asynchronous, with completions polled per transfer id). See docs/SIMULATION.md, section 3."""


@dataclass
class SimResult:
    """One predicted update. Seconds unless said otherwise."""

    method: str
    seconds: float
    """Predicted update time: "go" to the last release."""
    stage_busy: dict[str, float]
    """Per stage, the busiest rank's total time in it (nccl-tests style: per-rank maxima)."""
    floors: dict[str, float]
    """``nic`` / ``pcie`` / ``nvlink``: busiest link's bytes / its line rate."""
    bytes: int
    """Bytes written into inference memory, all ranks."""
    n_writes: int = 0
    peak_temp_bytes: int = 0
    """Largest temporary bytes one rank held at once."""
    events: list[tuple] = field(default_factory=list)
    """With ``record``: ``(rank, task, stage, start, end)`` per stage run of the recorded ranks."""
    rank_bytes: dict[str, dict[int, int]] = field(default_factory=dict)
    """Per GPU: ``infer_recv`` (bytes written into each inference rank), ``train_send`` (RDMA
    WRITE bytes each training rank posts), ``train_fabric`` (bytes each training NIC receives
    in cross-node all-gathers; sends as many). For the byte table (min / median / max)."""
    groups: dict[int, int] = field(default_factory=dict)
    """Task id -> mesh group (for the Gantt chart)."""
    link_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes through the busiest NIC / PCIe / NVLink link (the floors' numerators)."""
    extra: dict = field(default_factory=dict)
    """A delta update's details (:func:`simulate` with ``delta``): ``wire_bytes``, ``ops``,
    ``max_sender_ops``, ``max_sender_bytes``, ``max_receiver_bytes`` (expected values, floats),
    ``shadow_bytes_max`` (the largest rank's shadow), ``full_bytes``, ``full_writes``."""

    @property
    def floor_seconds(self) -> float:
        return max(self.floors.values()) if self.floors else 0.0


# ------------------------------------------------------------------------------ sources


def _mesh_array(mesh_ranks) -> list:
    return [list(x) if isinstance(x, (tuple, list)) else x for x in mesh_ranks]


def gather_group(meta: ParamMeta) -> tuple[int, ...]:
    """Ranks whose shards one ``full_tensor()`` of ``meta`` assembles: the mesh positions that
    differ only along the sharded mesh dims, taken at index 0 of the replicated dims."""
    mr = meta.mesh_ranks
    nd = 1 if not mr or not isinstance(mr[0], (tuple, list)) else 2
    sharded = [i for i, p in enumerate(meta.placements) if p.startswith("Shard")]
    if nd == 1:
        return tuple(mr) if sharded else (mr[0],)
    if sharded == [0, 1]:
        return tuple(r for row in mr for r in row)
    if sharded == [1]:
        return tuple(mr[0])
    if sharded == [0]:
        return tuple(row[0] for row in mr)
    return (mr[0][0],)


@dataclass(frozen=True, slots=True)
class _Src:
    nbytes: int
    n: int
    fabric: bool
    offloaded: bool


def source_info(first: dict[str, ParamMeta], hw: Hardware) -> dict[str, _Src]:
    """Per source: bytes, shards per ``full_tensor()``, whether the gather crosses nodes."""
    cache: dict[tuple, tuple[int, bool]] = {}
    out = {}
    for name, m in first.items():
        key = (m.mesh_ranks, m.placements)
        got = cache.get(key)
        if got is None:
            grp = gather_group(m)
            got = cache[key] = (len(grp), len({r // hw.gpus_per_node for r in grp}) > 1)
        out[name] = _Src(numel(m.global_shape) * itemsize(m.dtype), got[0], got[1], m.offloaded)
    return out


def first_metas(train_metas: dict[int, list[ParamMeta]]) -> dict[str, ParamMeta]:
    """One ParamMeta per parameter name (the first rank's)."""
    out: dict[str, ParamMeta] = {}
    for r in sorted(train_metas):
        for m in train_metas[r]:
            if m.name not in out:
                out[m.name] = m
    return out


# ------------------------------------------------------------------------------ reference


def _task_costs(sched: Schedule, src: dict[str, _Src], hw: Hardware, delta=None, shadow: dict[int, int] | None = None):
    """Per global task id: (all-gather seconds, fabric?, per-rank fabric / nvlink bytes);
    per (rank, position): h2d s, compute s, [(dst, bytes, n_writes)]. ``delta``: a
    :class:`~weight_transfer.experiments.sim.delta.DeltaModel`: each write's bytes and op count
    are its expected runs' (floats; writes of no expected op dropped), and the compare of each
    output with its shadow is added to the compute; ``shadow`` (a dict) then gets each rank's
    shadow bytes (its distinct output bytes)."""
    ag: dict[int, tuple[float, bool, int, int]] = {}
    per_rank: dict[int, list[tuple]] = {}
    step = hw.collective_step_us * 1e-6
    hbm = hw.hbm_gbs * 1e9
    for r, rp in sched.rank_plans.items():
        lst = []
        for t in rp.tasks:
            if t.id not in ag:
                sec, fab, nvl, fb = 0.0, False, 0, 0
                for s in t.sources:
                    si = src[s]
                    if si.n > 1:
                        moved = si.nbytes * (si.n - 1) // si.n
                        bw = hw.nic_Bps if si.fabric else hw.nvlink_gbs * 1e9
                        sec += moved / bw + (si.n - 1) * step
                        if si.fabric:
                            fab, fb = True, fb + moved
                        else:
                            nvl += moved
                ag[t.id] = (sec, fab, fb, nvl)
            h2d_bytes = sum(src[s].nbytes // src[s].n for s in t.sources + t.local_sources if src[s].offloaded)
            comp = 0.0
            per_dst: dict[int, list[int]] = {}
            for a in t.assignments:
                rec = a.recipe
                asm = numel(rec.shape) * itemsize(rec.assembled_dtype)
                comp += (3 * asm + rec.output_nbytes) / hbm + 2 * hw.kernel_us * 1e-6
                if delta is not None:
                    comp += delta.compare_seconds(rec)
                    if shadow is not None:
                        shadow[r] = shadow.get(r, 0) + rec.output_nbytes
                    for w in a.writes:
                        b, n = delta.write(rec, w.output, w.length)
                        if n <= 0.0:
                            continue
                        x = per_dst.get(w.dst_rank)
                        if x is None:
                            per_dst[w.dst_rank] = [b, n]
                        else:
                            x[0] += b
                            x[1] += n
                    continue
                for w in a.writes:
                    x = per_dst.get(w.dst_rank)
                    if x is None:
                        per_dst[w.dst_rank] = [w.length, 1]
                    else:
                        x[0] += w.length
                        x[1] += 1
            # a local task (no sources: it reads this rank's own shards) is no collective
            lst.append((t.id, t.group, t.temp_bytes, h2d_bytes, comp,
                        tuple((d, b, n) for d, (b, n) in per_dst.items()), t.mesh if t.sources else (r,)))
        per_rank[r] = lst
    return ag, per_rank


def simulate(sched: Schedule, train_metas: dict[int, list[ParamMeta]] | dict[str, ParamMeta], hw: Hardware, *,
             watermark: int | None = None, record: bool | Iterable[int] = False, method: str = "reference",
             writes_in_flight: str = "task", delta=None) -> SimResult:
    """Predict one update of ``sched`` (see module docstring). ``train_metas`` is what the
    training ranks published (or one ParamMeta per name); ``watermark`` bounds a rank's
    temporary bytes (None: unbounded); ``record``: True, or the training ranks whose stage
    runs are kept in ``events`` (a per-stage timeline; all ranks at Kimi-K2 scale is millions
    of tuples). ``writes_in_flight``: :data:`WRITES_IN_FLIGHT` -- ``"task"`` (this project's
    executor's old write stage: one task's writes at a time per rank) or ``"watermark"`` (the published
    executor: every prepared task's writes are posted at once, only the watermark bounds them).
    ``delta``: a :class:`~weight_transfer.experiments.sim.delta.DeltaModel`: the update writes
    only the expected runs of what changed (one op each) after comparing every output with its
    shadow (docs/SIMULATION.md, "Delta mode"); ``bytes`` and ``n_writes`` are then the expected
    wire bytes and ops, ``extra`` holds the details.
    Raises ValueError on an unknown ``writes_in_flight``. Deterministic."""
    if writes_in_flight not in WRITES_IN_FLIGHT:
        raise ValueError(f"writes_in_flight={writes_in_flight!r}: expected one of {', '.join(WRITES_IN_FLIGHT)}")
    first = train_metas if (train_metas and isinstance(next(iter(train_metas)), str)) else first_metas(train_metas)
    src = source_info(first, hw)
    shadow: dict[int, int] = {}
    ag, per_rank = _task_costs(sched, src, hw, delta, shadow)
    keep = set(per_rank) if record is True else set(record or ())
    loop = EventLoop(per_rank, ag, hw, watermark=math.inf if watermark is None else watermark,
                     overlap=writes_in_flight == "watermark", keep=keep)
    t_end = loop.run()
    fl, lb, rb = floors(sched, per_rank, ag, hw, from_writes=delta is not None)
    nbytes, n_writes, extra = sched.total_bytes, sched.n_writes, {}
    if delta is not None:
        nbytes, n_writes, extra = _delta_totals(sched, per_rank, rb, delta, shadow)
        t_end += extra["apply_seconds_max"]  # a packed delta's records are scattered by each receiver's commit, before publishing
    return SimResult(method=method, seconds=t_end, stage_busy=loop.stage_busy(),
                     floors=fl, link_bytes=lb, bytes=nbytes, n_writes=n_writes,
                     peak_temp_bytes=loop.peak, events=loop.events, rank_bytes=rb,
                     groups={t[0]: t[1] for r in keep for t in per_rank[r]}, extra=extra)


def _delta_totals(sched: Schedule, per_rank, rb: dict, delta, shadow: dict[int, int]) -> tuple[float, int, dict]:
    """A delta update's expected wire bytes and ops (all ranks) and :attr:`SimResult.extra`:
    from ``per_rank``'s writes (:func:`_task_costs` with ``delta``), the receivers' bytes
    ``rb`` (:func:`floors`) and each rank's shadow bytes; ``apply_seconds_max``: the slowest
    receiver's scatter of a packed delta's records at commit (0 for a delta without one)."""
    sent = {r: sum(b for t in lst for _, b, _ in t[5]) for r, lst in per_rank.items()}
    ops = {r: sum(n for t in lst for _, _, n in t[5]) for r, lst in per_rank.items()}
    nbytes, n_writes = sum(sent.values()), round(sum(ops.values()))
    apply_s = max((delta.apply_seconds(b) for b in rb["infer_recv"].values()), default=0.0) \
        if hasattr(delta, "apply_seconds") else 0.0
    extra = {"wire_bytes": nbytes, "ops": sum(ops.values()), "max_sender_ops": max(ops.values(), default=0.0),
             "apply_seconds_max": apply_s,
             "max_sender_bytes": max(sent.values(), default=0.0),
             "max_receiver_bytes": max(rb["infer_recv"].values(), default=0.0),
             "shadow_bytes_max": max(shadow.values(), default=0), "full_bytes": sched.total_bytes,
             "full_writes": sched.n_writes}
    return nbytes, n_writes, extra


def floors(sched: Schedule, per_rank, ag, hw: Hardware, *, from_writes: bool = False
           ) -> tuple[dict[str, float], dict[str, int], dict]:
    """Busiest NIC (send or receive; writes plus fabric all-gathers), PCIe and NVLink link:
    bytes and bytes / line rate; and the per-GPU byte counts (:attr:`SimResult.rank_bytes`).
    ``from_writes``: bytes sent and received per GPU from ``per_rank``'s writes (a delta update's),
    not the schedule's."""
    tx: dict[int, int] = {}
    rx_train: dict[int, int] = {}
    pcie: dict[int, int] = {}
    nvl: dict[int, int] = {}
    recv: dict[int, float] = {}
    send: dict[int, float] = {}
    for r, lst in per_rank.items():
        for tid, _, _, h2d, _, ws, _ in lst:
            _, _, fb, nv = ag[tid]
            wb = sum(b for _, b, _ in ws)
            tx[r] = tx.get(r, 0) + fb + wb
            rx_train[r] = rx_train.get(r, 0) + fb
            pcie[r] = pcie.get(r, 0) + h2d
            nvl[r] = nvl.get(r, 0) + nv
            if from_writes:
                send[r] = send.get(r, 0) + wb
                for d, b, _ in ws:
                    recv[d] = recv.get(d, 0) + b
    if not from_writes:
        recv, send = dict(sched.recv_bytes), dict(sched.send_bytes)
    nic_b = max([0, *tx.values(), *rx_train.values(), *recv.values()])
    lb = {"nic": nic_b, "pcie": max(pcie.values(), default=0), "nvlink": max(nvl.values(), default=0)}
    rb = {"infer_recv": recv, "train_send": send, "train_fabric": rx_train}
    return ({"nic": nic_b / hw.nic_line_Bps, "pcie": lb["pcie"] / (hw.pcie_gbs * 1e9),
             "nvlink": lb["nvlink"] / (hw.nvlink_line_gbs * 1e9)}, lb, rb)


def spread(values) -> tuple[int, int, int]:
    """(min, median, max) of a collection of byte counts (empty: zeros)."""
    v = sorted(values)
    if not v:
        return (0, 0, 0)
    return (v[0], v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) // 2, v[-1])


# ------------------------------------------------------------------------------ baselines


@dataclass(frozen=True, slots=True)
class Tensor:
    """One checkpoint tensor as the baselines see it: bytes in the training dtype, the
    ``full_tensor()`` it needs on training rank 0 (seconds, computed like the reference's),
    and whether rank 0 must then fetch it from another GPU of its node over NVLink."""

    name: str
    nbytes: int
    gather_s: float
    forward: bool


def baseline_tensors(first: dict[str, ParamMeta], hw: Hardware) -> list[Tensor]:
    src = source_info(first, hw)
    out = []
    step = hw.collective_step_us * 1e-6
    for name, m in first.items():
        si = src[name]
        sec = 0.0
        if si.n > 1:
            bw = hw.nic_Bps if si.fabric else hw.nvlink_gbs * 1e9
            sec = si.nbytes * (si.n - 1) / si.n / bw + (si.n - 1) * step
        fwd = 0 not in m.mesh_flat
        if fwd:
            sec += si.nbytes / (hw.nvlink_gbs * 1e9)
        out.append(Tensor(name, si.nbytes, sec, fwd))
    return out


def _result(method, stages: dict[str, float], floor_bytes: int, link_Bps: float, nbytes: int, n_writes: int) -> SimResult:
    return SimResult(method=method, seconds=sum(stages.values()), stage_busy=stages,
                     floors={"nic": floor_bytes / link_Bps}, link_bytes={"nic": floor_bytes},
                     bytes=nbytes, n_writes=n_writes)


def rank0_funnel(tensors: list[Tensor], hw: Hardware, n_infer: int, recv_bytes: int) -> SimResult:
    """The rank-0 funnel (the project's baseline), one tensor at a time (no overlap): ``gather``
    on training rank
    0 (the tensor's ``full_tensor()``, plus an NVLink hop when rank 0 is not in its mesh),
    ``send`` over rank 0's one NIC to inference rank 0 (training dtype), ``broadcast`` from
    inference rank 0 to the others (pipelined NCCL ring: bytes / NIC + a call), then
    ``load_weights`` on every worker in parallel (a Python call + the tensor through HBM).
    Floor: every byte through training rank 0's NIC."""
    st = dict.fromkeys(("gather", "send", "broadcast", "load_weights"), 0.0)
    msg, lat = hw.rdma_msg_us * 1e-6, hw.rdma_latency_us * 1e-6
    for t in tensors:
        st["gather"] += t.gather_s
        st["send"] += t.nbytes / hw.nic_Bps + msg + lat
        if n_infer > 1:
            st["broadcast"] += t.nbytes / hw.nic_Bps + hw.nccl_call_us * 1e-6
        st["load_weights"] += hw.python_call_us * 1e-6 + t.nbytes / (hw.hbm_gbs * 1e9)
    total = sum(t.nbytes for t in tensors)
    return _result("rank0_funnel", st, total, hw.nic_line_Bps, recv_bytes, len(tensors))


def nccl_broadcast_funnel(tensors: list[Tensor], hw: Hardware, n_infer: int, recv_bytes: int) -> SimResult:
    """SGLang's ``update_weights_from_distributed``: per tensor, ``gather`` on training rank 0,
    one NCCL ``broadcast`` from it to every inference rank (pipelined ring: bytes / NIC + a
    call), ``load_weights`` on every worker. Floor: every byte through rank 0's NIC."""
    st = dict.fromkeys(("gather", "broadcast", "load_weights"), 0.0)
    for t in tensors:
        st["gather"] += t.gather_s
        st["broadcast"] += t.nbytes / hw.nic_Bps + hw.nccl_call_us * 1e-6
        st["load_weights"] += hw.python_call_us * 1e-6 + t.nbytes / (hw.hbm_gbs * 1e9)
    total = sum(t.nbytes for t in tensors)
    return _result("nccl_broadcast_funnel", st, total, hw.nic_line_Bps, recv_bytes, len(tensors))


def rpc_update_weight(tensors: list[Tensor], hw: Hardware, n_infer: int, recv_bytes: int) -> SimResult:
    """Per-tensor RPC ``update_weight()``: ``gather`` on training rank 0, then one RPC per
    inference worker carrying the tensor (issued concurrently: one ``rpc_us`` round trip, but
    every copy leaves through rank 0's NIC), then ``load_weights`` on every worker. Floor:
    ``n_infer`` copies of every byte through rank 0's NIC."""
    st = dict.fromkeys(("gather", "rpc", "load_weights"), 0.0)
    for t in tensors:
        st["gather"] += t.gather_s
        st["rpc"] += hw.rpc_us * 1e-6 + n_infer * t.nbytes / hw.nic_Bps
        st["load_weights"] += hw.python_call_us * 1e-6 + t.nbytes / (hw.hbm_gbs * 1e9)
    total = sum(t.nbytes for t in tensors) * n_infer
    return _result("rpc_update_weight", st, total, hw.nic_line_Bps, recv_bytes, len(tensors) * n_infer)


CKPT_ENGINE_BUCKET = 8 << 30
"""checkpoint-engine's bucket size, bytes: 8 GiB (its README, as cited in issue #16)."""


def ckpt_engine_broadcast(model_bytes: int, n_tensors: int, n_ranks: int, hw: Hardware, *,
                          bucket_bytes: int = CKPT_ENGINE_BUCKET) -> SimResult:
    """checkpoint-engine's broadcast update: the serving checkpoint (``model_bytes``, e.g. FP8
    with scales) sits in pinned host memory spread over the ``n_ranks`` GPUs; bucket by bucket
    its owner copies it to the GPU (``h2d``), NCCL broadcasts it to every GPU (every node
    receives the whole model over its ``nics_per_node`` NICs), and every worker runs
    ``load_weights`` over every tensor of the bucket. The three stages pipeline over buckets
    (``bucket_bytes``: 8 GiB, the README's), so the slowest stage -- the H2D copy of one
    bucket through one PCIe link -- sets the pace. Floor: the whole model into one node over
    its NICs."""
    B = max(1, math.ceil(model_bytes / bucket_bytes))
    b = model_bytes / B
    node_in = hw.nics_per_node * hw.nic_Bps
    per = {"h2d": b / (hw.pcie_gbs * 1e9),
           "broadcast": b / node_in + hw.nccl_call_us * 1e-6,
           "load_weights": n_tensors / B * hw.python_call_us * 1e-6 + b / (hw.hbm_gbs * 1e9)}
    seconds = sum(per.values()) + (B - 1) * max(per.values())
    st = {k: v * B for k, v in per.items()}
    return SimResult(method="ckpt_engine_broadcast", seconds=seconds, stage_busy=st,
                     floors={"nic": model_bytes / (hw.nics_per_node * hw.nic_line_Bps)},
                     link_bytes={"nic": model_bytes // hw.nics_per_node}, bytes=model_bytes * n_ranks,
                     n_writes=B)


def sglang_pp_broadcast(first: dict[str, ParamMeta], hw: Hardware, n_infer: int, recv_bytes: int, *,
                        pp: int = 8, tp: int = 8, ep: int = 32, bucket_bytes: int = 1 << 30) -> SimResult:
    """SGLang / slime ``update_weights_from_distributed`` from Megatron (lmsys.org blog
    2026-04-29; Jiadong Guo, jd-unleashed.com/blog/rdma-transfer: "NCCL broadcast primitives
    formed between each PP group's head rank and all inference ranks. On the source side, all
    nodes first participate in TP and EP dimension all-gather"): the decoder layers are split
    evenly over ``pp`` pipeline stages (embeddings with the first, final norm and lm_head with
    the last); in each stage, bucket by bucket, every non-expert tensor is all-gathered over
    its ``tp`` ranks (one node, NVLink) and every routed expert over its ``ep`` ranks (across
    nodes, the fabric), then the stage's head rank broadcasts the bucket (training dtype) to
    every inference rank; stages run concurrently, gather and broadcast of one stage do not
    overlap. Every inference rank receives the whole model from the ``pp`` heads over its one
    NIC, so the time is ``max(max over stages of gather + own broadcast, all bytes / NIC)``,
    then ``load_weights`` of every tensor on every worker (per bucket, after it arrives; not
    overlapped with the next broadcast). ``bucket_bytes``: assumption (1 GiB). Floor: the
    whole model through one inference NIC."""
    from weight_transfer.testing.training import is_expert_param

    step = hw.collective_step_us * 1e-6
    layer_of = {}
    n_layers = 1 + max((int(n.split(".")[2]) for n in first if n.startswith("model.layers.")), default=0)
    for n in first:
        if n.startswith("model.layers."):
            layer_of[n] = int(n.split(".")[2]) * pp // n_layers
        else:
            layer_of[n] = 0 if "embed" in n else pp - 1
    gather = [0.0] * pp
    nbytes = [0] * pp
    load = 0.0
    total = 0
    for n, m in first.items():
        b = numel(m.global_shape) * itemsize(m.dtype)
        s = layer_of[n]
        if is_expert_param(n):
            gather[s] += b * (ep - 1) / ep / hw.nic_Bps + (ep - 1) * step
        else:
            gather[s] += b * (tp - 1) / tp / (hw.nvlink_gbs * 1e9) + (tp - 1) * step
        nbytes[s] += b
        total += b
        load += hw.python_call_us * 1e-6 + b / (hw.hbm_gbs * 1e9)
    n_buckets = [max(1, math.ceil(x / bucket_bytes)) for x in nbytes]
    per_stage = [gather[s] + nbytes[s] / hw.nic_Bps + n_buckets[s] * hw.nccl_call_us * 1e-6 for s in range(pp)]
    recv = total / hw.nic_Bps + sum(n_buckets) * hw.nccl_call_us * 1e-6
    bc = max(max(per_stage), recv)
    st = {"gather": max(gather), "broadcast": recv, "load_weights": load}  # busiest stage's gathers; one receiver
    return SimResult(method="sglang_pp_broadcast", seconds=bc + load, stage_busy=st,
                     floors={"nic": total / hw.nic_line_Bps}, link_bytes={"nic": total}, bytes=recv_bytes,
                     n_writes=sum(n_buckets) * n_infer)
