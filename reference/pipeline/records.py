"""What one training rank did in one update: per-task stage records, mesh-group barriers and
the update's totals (:class:`StepStats`, what :meth:`weight_transfer.pipeline.executor.Executor.run`
returns; re-exported by :mod:`weight_transfer.pipeline.executor`). Times are ``time.perf_counter``
seconds, sizes bytes."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..timeline import union_seconds

__all__ = ["BarrierRecord", "StepStats", "TaskRecord", "task_kind", "prepare_by_kind"]


@dataclass
class TaskRecord:
    """Stage timestamps of one task on one rank (``time.perf_counter`` seconds)."""

    task: int
    group: int
    stages: dict[str, tuple[float, float]] = field(default_factory=dict)
    temp_bytes: int = 0
    """Planned temporary bytes (:attr:`weight_transfer.types.Task.temp_bytes`)."""
    send_bytes: int = 0
    alloc_bytes: int = 0
    """Bytes of tensors this task actually allocated (gathered sources and outputs)."""
    gather_bytes: int = 0
    """Bytes ``full_tensor()`` gathered into new buffers on this rank for this task."""
    copy_bytes: int = 0
    """Bytes of this task's outputs built in buffers of their own (output pool slots: a cast,
    a quantization, a fused ``cat``, a ``.contiguous()`` of a strided slice, a slice of a
    gathered source copied into its slot): outputs that are views of this rank's shards cost no
    copy."""
    h2d_bytes: int = 0
    label: str = ""
    gate_wait: float = 0.0
    """Seconds the task waited at the watermark gate (and for output pool space) before its
    first stage."""
    gather_s: float = 0.0
    """Seconds of the prepare stage spent in ``full_tensor()`` (0 for a local task); the rest of
    prepare is building the outputs (assembly, cast, quantization, runtime layout)."""
    kind: str = ""
    """What the task builds (:func:`task_kind`): the destination tensor kind of its first
    recipe, e.g. ``"w13_weight [blocked:16x1]"`` or ``"qkv_proj.weight:staging"``, and
    ``"local"`` / ``"gathered"``."""

    @property
    def start(self) -> float:
        return min(a for a, _ in self.stages.values())

    @property
    def end(self) -> float:
        return max(b for _, b in self.stages.values())


@dataclass
class BarrierRecord:
    """One mesh-group barrier on this rank: issued after group ``group``'s last
    ``full_tensor()``; ``waited`` is the (start, end) of the wait before the next group's first
    prepare (None if no later task of this rank needed it; then it was waited at step end)."""

    group: int
    issued: float
    waited: tuple[float, float] | None = None


@dataclass
class StepStats:
    """What one rank did in one update (implements :class:`weight_transfer.method.UpdateStats`)."""

    rank: int
    bytes_sent: int = 0
    n_writes: int = 0
    seconds: float = 0.0
    peak_temp_bytes: int = 0
    """Peak of planned temporary bytes of tasks in flight (first stage start .. release end)."""
    peak_alloc_bytes: int = 0
    """Peak of bytes actually allocated by tasks in flight (prepare end .. release end)."""
    peak_device_bytes: int | None = None
    """CUDA only: ``max_memory_allocated`` above the level at step start."""
    watermark: int | None = None
    pipelined: bool = True
    offloaded: bool = False
    step: int = 0
    t_start: float = 0.0
    """``perf_counter`` at the start of the update; stage times are on the same clock."""
    wall_start: float = 0.0
    """``time.time()`` at ``t_start``: converts stage times to wall clock (:meth:`wall`)."""
    records: list[TaskRecord] = field(default_factory=list)
    barriers: list[BarrierRecord] = field(default_factory=list)
    full_bytes: int = 0
    """Bytes a full update of this rank writes (the plan's); ``bytes_sent`` is what was written
    (less with delta updates)."""
    delta: str = ""
    """Delta updates (:mod:`weight_transfer.delta.runs`): ``""`` off, ``"delta"``, or ``"full: <why>"``
    (the first update, after a failed one, a re-registered receiver, ...)."""
    delta_shadow_bytes: int = 0
    """Bytes of this rank's shadow copy of its last-written outputs (0 without delta updates)."""
    delta_compare_s: float = 0.0
    """Seconds of this update spent comparing outputs with the shadow, building the runs and
    updating the shadow (inside the write stage; 0 without delta updates)."""
    delta_whole: int = 0
    """Outputs of a delta update written whole because their runs would cost more (the cost
    model of :mod:`weight_transfer.delta.runs`)."""
    delta_fused_s: float = 0.0
    """Seconds of the prepare stage's fused cast + compare passes (:mod:`weight_transfer.delta.fused`;
    they replace the cast and the separate comparison of those outputs)."""
    delta_pack_s: float = 0.0
    """Seconds spent packing records (:mod:`weight_transfer.delta.packed`, inside the write stage)."""
    delta_wire_s: float = 0.0
    """Seconds the write stage was busy (union of post -> completion; the directory write included)."""
    delta_apply_s: float = 0.0
    """Seconds the receivers' commits spent scattering packed records (the slowest receiver;
    filled in by the caller from the commit reports, 0 here)."""
    delta_modes: dict = field(default_factory=dict)
    """This update's writes per mode and kind (:meth:`weight_transfer.delta.runs.DeltaState.summary`):
    ``{mode: {kind: [writes, bytes written, output bytes]}}``, modes ``full``, ``scattered``,
    ``packed``, ``unchanged``."""
    delta_tensors: list = field(default_factory=list)
    """Per write: ``(tensor, kind, mode, output bytes, bytes written, runs)``."""

    @property
    def wire_bytes(self) -> int:
        """Payload bytes moved: one-sided writes move exactly what lands (``bytes_sent``)."""
        return self.bytes_sent

    @property
    def gather_bytes(self) -> int:
        """Bytes ``full_tensor()`` gathered into new buffers on this rank this update."""
        return sum(r.gather_bytes for r in self.records)

    @property
    def copy_bytes(self) -> int:
        """Bytes of outputs this rank built in buffers of their own this update (see
        :attr:`TaskRecord.copy_bytes`); with :attr:`gather_bytes`, what the trainer copies
        outside the writes themselves."""
        return sum(r.copy_bytes for r in self.records)

    def wall(self, t: float) -> float:
        """Wall-clock seconds of a ``perf_counter`` time ``t`` of this rank."""
        return self.wall_start + (t - self.t_start)

    def stage_busy(self) -> dict[str, float]:
        """Seconds each stage was busy: the length of the *union* of its tasks' intervals, not
        their sum (the ``write`` intervals of different tasks overlap when several tasks'
        writes are in flight; a sum would count that time twice)."""
        per: dict[str, list[tuple[float, float]]] = {}
        for r in self.records:
            for s, ab in r.stages.items():
                per.setdefault(s, []).append(ab)
        return {s: union_seconds(iv) for s, iv in per.items()}


def task_kind(task) -> str:
    """A short label of what ``task`` (a :class:`~weight_transfer.types.Task`) builds, for the
    per-kind breakdown of prepare (:func:`prepare_by_kind`): the first recipe's first output's
    destination tensor without its module path (``"mlp.experts.w13_weight"`` ->
    ``"experts.w13_weight"``), its runtime layout when not identity, and whether the task's
    sources are gathered with ``full_tensor()`` or read from this rank's shards, e.g.
    ``"mlp.experts.w13_weight [blocked:16x1] (local)"``."""
    if not task.assignments:
        return "(full_tensor() only: nothing to send)"
    rec = task.assignments[0].recipe
    o = rec.outputs[0]
    name = o.tensor.split(".layers.")[-1]
    name = name.split(".", 1)[1] if name[:1].isdigit() and "." in name else name
    name = name.replace("model.", "", 1) if name.startswith("model.") else name
    lay = f" [{o.layout}]" if o.layout != "identity" else ""
    return f"{name}{lay} ({'gathered' if task.sources else 'local'})"


def prepare_by_kind(records) -> dict[str, list]:
    """Per :attr:`TaskRecord.kind`: ``[tasks, gather seconds, build seconds, gathered bytes,
    built bytes]`` over ``records`` (one rank's :class:`TaskRecord` s of one update). Seconds are
    stage time (wall, not CPU); build = prepare minus ``full_tensor()``."""
    out: dict[str, list] = {}
    for r in records:
        a, b = r.stages.get("prepare", (0.0, 0.0))
        k = out.setdefault(r.kind or "?", [0, 0.0, 0.0, 0, 0])
        k[0] += 1
        k[1] += r.gather_s
        k[2] += max(0.0, (b - a) - r.gather_s)
        k[3] += r.gather_bytes
        k[4] += r.copy_bytes
    return out
