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
    :class:`weight_transfer.pipeline.executor.StepStats` and ``weight_transfer.baselines.common.BaselineStats``.

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
    shadow: str | None = None
    """Shadow targets (``"flip"`` / ``"copy"``, :mod:`weight_transfer.api.shadow`), None: off."""


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


from .control.store import RUNTIME_KEY, runtime_layouts  # noqa: E402,F401 -- part of this module's API


class ReferenceController(ControllerSide):
    """The coordinator's planning step (:func:`weight_transfer.api.plan_against`): recipes,
    retargeting at published runtime layouts, the schedule once, each rank's part."""

    def setup(self, ctx: ControllerContext) -> str:
        from .api import plan_against
        from .control.fingerprint import VERIFY_KEY, Verifier, plan_value
        from .control.wire import put

        v = ctx.transfer.verify  # before the training ranks' parts: they read it with theirs
        put(ctx.store, VERIFY_KEY, plan_value(v, ctx.infer_payloads))
        sched, extra = plan_against(ctx.store, ctx.model_config, ctx.layout, ctx.train_metas, ctx.infer_payloads,
                                    ctx.transfer)
        extra["verifier"] = Verifier(v, sched, {i: p[1] for i, p in ctx.infer_payloads.items()})
        # an engine with staged targets (e.g. a vLLM layer kept in an opaque kernel handle) commits
        # each update: its own post-processing runs on the staged bytes before the version is published
        ctx.extra.update(extra, schedule=sched)
        return sched.summary() + (f"; {extra['recipes']}" if extra.get("recipes") else "")


class ReferenceTrainer(TrainerSide):
    """A :class:`weight_transfer.api.Sender` whose writes the harness's own step loop triggers
    (:meth:`weight_transfer.api.Sender.send`); the harness published the metadata already."""

    def setup(self, ctx: TrainerContext) -> None:
        from .api import Sender

        self.sender = Sender(ctx.params, rank=ctx.rank, world_size=ctx.n_train, store=ctx.store, options=ctx.transfer,
                             group_barrier=ctx.group_barrier, log=ctx.log, publish=False)
        self.sender.plan()

    @property
    def executor(self):
        """The sender's :class:`weight_transfer.pipeline.executor.Executor` (fault injection wraps its stages)."""
        return self.sender.executor

    @property
    def transport(self):
        return self.sender.transport

    def transfer(self, step: int):
        self.sender._follow_plan()  # the receivers changed (C24): this rank's part of the new plan epoch
        return self.sender.send(step)

    def teardown(self) -> None:
        self.sender.close()


class ReferenceInference(InferenceSide):
    """A :class:`weight_transfer.api.Receiver` over the engine's arena: registers the memory
    once and returns (descriptor, tensor metas) for the harness to publish. Passive: nothing
    runs here per step (with shadow targets, ``ctx.shadow``, the receiver registers the shadow
    and the engine's go-live server makes each update live: experiments/serving.py)."""

    active = False

    def setup(self, ctx: InferenceContext):
        from .api import Receiver

        self.receiver = Receiver.from_arena(ctx.engine.arena, ctx.engine.tensor_metas(), rank=ctx.rank, store=ctx.store,
                                            transport=ctx.transfer.transport.name, publish=False, shadow=ctx.shadow,
                                            adopt=getattr(ctx.engine, "rebind", None))
        return (self.receiver.descriptor, self.receiver.metas)

    @property
    def transport(self):
        return self.receiver.transport

    @property
    def region(self):
        return self.receiver.region

    def teardown(self) -> None:
        self.receiver.close()
