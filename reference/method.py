"""The method interface every weight-transfer method implements, and the reference method.

A *method* has three sides, one per kind of process of a trial:

- :class:`ControllerSide` runs once in the controller after metadata is collected
  (``setup``: e.g. compute and publish the static schedule);
- :class:`TrainerSide` runs in each training rank: ``setup`` once (after its parameters
  exist), ``transfer(step)`` on every "go" (weights of ``step`` are already in the
  parameters), ``teardown``;
- :class:`InferenceSide` runs in each inference rank: ``setup`` once (after its engine
  exists; returns the payload published as ``meta/infer/{rank}``), ``receive(step)`` on every
  "go" if the method is ``active`` on the inference side (the baselines: the inference rank
  takes part in the update and runs ``load_weights``), ``teardown``.

The trial runner, the timing and the verification do not know which method runs: an update
is complete when every training rank (and, for active methods, every inference rank) reported
done; only then is the version published. The reference is passive on the inference side:
``setup`` registers the engine's memory once and publishes the descriptor; nothing runs there
per step.
"""
from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from .options import TransferOptions
from .types import InferenceLayout


@runtime_checkable
class UpdateStats(Protocol):
    """What a trainer side's :meth:`TrainerSide.transfer` returns for one update, whatever the
    method: the trial's rows and the report read only these. Implemented by
    :class:`weight_transfer.executor.StepStats` and ``weight_transfer.baselines.common.BaselineStats``.

    Byte counts are bytes, ``seconds`` wall seconds of this rank's part of the update."""

    rank: int
    """Training rank."""
    bytes_sent: int
    """Bytes that landed in inference memory from this rank (the row's ``bytes`` is the sum)."""
    wire_bytes: int
    """Payload bytes this rank's part moved over the wire (= ``bytes_sent`` for one-sided writes)."""
    n_writes: int
    """Writes (one-sided writes, broadcast buckets or RPCs) issued."""
    seconds: float
    """Wall seconds of this rank's part of the update."""
    peak_temp_bytes: int
    """Peak planned temporary bytes (gathered sources, outputs, buckets) in flight."""
    peak_alloc_bytes: int
    """Peak bytes actually allocated by tasks in flight (0 where the method does not measure it)."""
    records: list
    """Per-task records (timelines); may be empty."""

    def stage_busy(self) -> dict[str, float]:
        """Seconds each stage was busy (empty for methods without stages)."""
        ...


@dataclass(kw_only=True)
class TrainerContext:
    """What a training rank hands its method. ``params``: checkpoint name -> DTensor (this
    rank's shards); ``store``: the control-plane TCPStore; ``transfer``: the transfer options;
    ``method_options``: the method's own options object, if it has one (the baselines'
    ``weight_transfer.baselines.options.BaselineOptions``; None for the reference)."""

    rank: int
    n_train: int
    n_infer: int
    params: dict
    store: Any
    transfer: TransferOptions
    method_options: Any = None
    model_config: Any
    layout: InferenceLayout
    log: Callable[[str], None] = print
    group_barrier: Callable[[], None] | None = None


@dataclass(kw_only=True)
class InferenceContext:
    """What an inference rank hands its method: its engine (parameters in vLLM layout)."""

    rank: int
    n_train: int
    n_infer: int
    engine: Any
    store: Any
    transfer: TransferOptions
    method_options: Any = None
    model_config: Any
    layout: InferenceLayout
    log: Callable[[str], None] = print


@dataclass(kw_only=True)
class ControllerContext:
    """What the controller hands its method once metadata is in."""

    store: Any
    transfer: TransferOptions
    method_options: Any = None
    model_config: Any
    layout: InferenceLayout
    train_metas: dict
    infer_payloads: dict
    extra: dict = field(default_factory=dict)


class ControllerSide(abc.ABC):
    @abc.abstractmethod
    def setup(self, ctx: ControllerContext) -> str:
        """Once, before the first update. Returns a one-line plan summary for the table."""


class TrainerSide(abc.ABC):
    @abc.abstractmethod
    def setup(self, ctx: TrainerContext) -> None: ...

    @abc.abstractmethod
    def transfer(self, step: int) -> UpdateStats:
        """Move the weights of ``step``; return this rank's :class:`UpdateStats`."""

    def teardown(self) -> None:
        pass


class InferenceSide(abc.ABC):
    active: bool = False
    """True when the inference rank takes part in each update (``receive``)."""

    @abc.abstractmethod
    def setup(self, ctx: InferenceContext) -> Any:
        """Once; return the payload the controller receives for this rank."""

    def receive(self, step: int) -> dict:
        """Active methods: take part in update ``step``; return stats (e.g. bytes received)."""
        return {}

    def teardown(self) -> None:
        pass


# --------------------------------------------------------------------------------------------
# the reference: one-sided writes, static schedule


RUNTIME_KEY = "meta/infer_runtime/{rank}"
"""Store key under which an inference rank may publish its engine's runtime layout (an object
with ``targets`` / ``refused``, see :mod:`weight_transfer.retarget`; e.g. a live vLLM,
``experiments/vllm_side.py``)."""


def runtime_layouts(store, infer_payloads: dict) -> dict:
    """Inference rank -> published runtime layout, for the ranks that published one ({} when
    none did: the engine's load layout is its runtime layout)."""
    from . import control

    keys = {i: RUNTIME_KEY.format(rank=i) for i in infer_payloads}
    return {i: control.get(store, k) for i, k in keys.items() if store.check([k])}


class ReferenceController(ControllerSide):
    """Builds the recipes, computes the schedule once, hands each training rank its part."""

    def setup(self, ctx: ControllerContext) -> str:
        from . import control
        from .plan import build_recipes, gc_paused, plan

        sources = {m.name: m.dtype for ms in ctx.train_metas.values() for m in ms}
        with gc_paused():  # the controller's own process: its GC to pause, its checks to fork (auto)
            recipes = build_recipes(ctx.model_config, ctx.layout, source_dtypes=sources)
            runtime = runtime_layouts(ctx.store, ctx.infer_payloads)
            if runtime:  # a live engine reported what it computes with: aim there, or refuse (C20)
                from .retarget import retarget

                recipes = retarget(recipes, runtime)
            sched = plan(recipes, ctx.train_metas, {i: metas for i, (_, metas) in ctx.infer_payloads.items()},
                         max_chunk_bytes=ctx.transfer.plan.max_chunk_bytes, local_writes=ctx.transfer.plan.local_writes,
                         local_min_bytes=ctx.transfer.plan.local_min_bytes, parallel_checks=None)
        descriptors = {i: desc for i, (desc, _) in ctx.infer_payloads.items()}
        # an engine with staged targets (e.g. a vLLM layer kept in an opaque kernel handle) commits
        # each update: its own post-processing runs on the staged bytes before the version is published
        ctx.extra["commit_ranks"] = tuple(sorted(i for i, lay in runtime.items() if getattr(lay, "needs_commit", False)))
        ctx.extra["bytes_staged"] = sum(getattr(lay, "staged_bytes", 0) for lay in runtime.values())
        for r, rp in sched.rank_plans.items():
            control.put(ctx.store, f"plan/{r}", (rp, descriptors))
        ctx.extra["schedule"] = sched
        return sched.summary()


class ReferenceTrainer(TrainerSide):
    """Runs this rank's :class:`~weight_transfer.types.RankPlan` with the executor."""

    def setup(self, ctx: TrainerContext) -> None:
        from . import control
        from .executor import Executor
        from .transport import lease, make_transport

        client = control.TrainerClient(ctx.store, ctx.rank, timeout=max(ctx.transfer.control.timeout, 600.0))
        plan, descriptors = client.get_plan()
        self.transport = make_transport(ctx.transfer.transport.name)
        lease.attach(self.transport, ctx.store)  # receivers' deregister waits for our batch in flight (C17)
        self.transport.connect(list(descriptors.values()))
        self.executor = Executor(plan, ctx.params, self.transport, descriptors, options=ctx.transfer.executor,
                                 group_barrier=ctx.group_barrier)
        ctx.log(f"plan: {len(plan.tasks)} tasks, {plan.n_writes} writes, {plan.send_bytes / 1e9:.3f} GB to send")

    def transfer(self, step: int):
        return self.executor.run()

    def teardown(self) -> None:
        self.transport.close()


class ReferenceInference(InferenceSide):
    """Registers the engine's parameter memory once and publishes (descriptor, tensor metas).
    Passive: nothing runs here per step."""

    active = False

    def setup(self, ctx: InferenceContext):
        from .transport import make_transport

        self.transport = make_transport(ctx.transfer.transport.name)
        self.region = self.transport.register(ctx.engine.arena)
        return (self.region.descriptor(), ctx.engine.tensor_metas())

    def teardown(self) -> None:
        self.transport.close()
