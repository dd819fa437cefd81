"""The schema of every store value the library reads (:mod:`weight_transfer.control.wire`): one line per
key template, the type its values decode into. Imported by :func:`weight_transfer.control.wire.schema_of`
on first use; the vLLM backend, the baselines and the harness register their own keys next to
the code that writes them.

Keys that hold a bare flag (``step/{v}/go``, ``shutdown``: their presence is the message) or an
ASCII field (``weights``, ``version``, ``weights/attempted``, ``infer/member/{r}``, owner tokens,
error text) are not msgpack: they are read with :func:`weight_transfer.control.protocol.get_int` /
:func:`~weight_transfer.control.protocol.get_text` (strict, bounded, naming the key). Every value of
either kind is sealed and authenticated by :class:`weight_transfer.security.secure_store.SecureStore`.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, TypedDict

from typing_extensions import NotRequired  # typing's own from Python 3.11; torch requires typing_extensions

from ..pipeline.records import StepStats
from ..plan.traced import SOURCE_VIEWS_KEY, SOURCES_KEY, TRACE_KEY, LoaderTrace
from ..types import Box, DestTensorMeta, InferenceLayout, ParamMeta, RankPlan, RegionDescriptor
from . import wire

Shift = int | tuple[int, int, int]
"""Bytes added to a flip receiver's planned offsets: all of them (an int), or ``(lo, hi, bytes)``
for the offsets in ``[lo, hi)`` (a vLLM worker's flip shadow: its staging arena does not move)."""


class ShadowInfo(TypedDict):
    """``meta/infer_shadow/{i}``: :meth:`weight_transfer.api.shadow.Shadow.info` (bytes); a vLLM
    worker's adds ``why`` (how its mode was chosen) and may give ``shift`` as ``(lo, hi, bytes)``."""

    mode: str
    stride: int
    shift: Shift
    live_index: int
    extra_bytes: int
    golives: int
    why: NotRequired[str]


class Where(TypedDict):
    """``step/{v}/where/{r}``: :meth:`weight_transfer.pipeline.executor.Executor.activity` plus the wall time."""

    prepare: tuple[int, float] | None
    collective: tuple[int, float] | None
    time: float


class Engine(TypedDict):
    """``meta/engine``: what an inference side that knows the model publishes (the vLLM backend)."""

    hf_config: dict[str, Any]
    layout: InferenceLayout
    name: str
    n_workers: NotRequired[int]
    vllm: NotRequired[str]
    transport: NotRequired[str]


def freeze(x):
    """Nested lists as nested tuples (msgpack has one array type; descriptors and meshes compare as tuples)."""
    return tuple(freeze(v) for v in x) if isinstance(x, (list, tuple)) else x


def fix_descriptor(d: RegionDescriptor) -> RegionDescriptor:
    return replace(d, extra=freeze(d.extra)) if d.extra else d


def fix_metas(metas: list[ParamMeta]) -> list[ParamMeta]:
    for m in metas:
        object.__setattr__(m, "mesh_ranks", freeze(m.mesh_ranks))
    return metas


def _meta_infer(v, key):
    d, metas = v
    return fix_descriptor(d), list(metas)


def _plan(v, key):
    rp, descriptors = v
    return rp, {i: fix_descriptor(d) for i, d in descriptors.items()}


class VerifyPlan(TypedDict):
    """``plan/verify``: :class:`weight_transfer.control.fingerprint.VerifyOptions` as the coordinator runs it."""

    mode: str
    cycle: int
    algo: NotRequired[str]


class FpRequest(TypedDict):
    """``verify/{i}/request``: the ranges the coordinator asks inference rank ``i`` to hash
    (:mod:`weight_transfer.control.fingerprint`; int64 arrays as bytes, region offsets, shifts applied)."""

    version: int
    offsets: bytes
    lengths: bytes


class FpAnswer(TypedDict):
    """``step/{v}/fp/i{i}``: inference rank ``i``'s hashes (uint64 array as bytes, request order)."""

    hashes: bytes
    seconds: float
    error: str


class FpTrain(TypedDict):
    """``step/{v}/fp/t{r}``: training rank ``r``'s hashes of its selected writes (arrays as bytes)."""

    dst: bytes
    offsets: bytes
    lengths: bytes
    hashes: bytes
    seconds: float


wire.register_tagged(StepStats)
SHADOW_KEY = "meta/infer_shadow/{rank}"
"""Store key under which an inference rank with shadow targets publishes
:meth:`weight_transfer.api.shadow.Shadow.info` (at registration and after each go-live: a flip
receiver's ``shift`` moves with its live half)."""

R = wire.register
R("meta/train/{r}", list[ParamMeta], "a training rank's parameters (checkpoint names, shapes, meshes, shards)",
  post=lambda v, k: fix_metas(v))
R("meta/infer/{i}", tuple[RegionDescriptor, list[DestTensorMeta]],
  "an inference rank's registered region and the tensors in it", post=_meta_infer)
R("plan/{r}", tuple[RankPlan, dict[int, RegionDescriptor]], "training rank r's part of the first plan", post=_plan)
R("plan/e{e}/{r}", tuple[RankPlan, dict[int, RegionDescriptor]], "training rank r's part of a later plan epoch",
  post=_plan)
R("plan/error", wire.ErrorPair, "a refused plan: (type, message) every training rank raises")
R("step/{v}/done/{r}", wire.Done, "a training rank's result of an update", post=wire.untag_stats)
R("step/{v}/idone/{i}", wire.Report, "an active inference side's result of an update")
R("step/{v}/committed/{i}", wire.Report, "an inference rank's commit (staged targets) or go-live (shadow targets)")
R("step/{v}/shift", dict[int, Shift], "flip shadows: bytes added to each receiver's planned offsets")
R("plan/verify", VerifyPlan, "the coordinator's end-to-end check of every update (verify mode and cycle)")
R("verify/{i}/request", FpRequest, "the coordinator's fingerprint request to an inference rank")
R("step/{v}/fp/i{i}", FpAnswer, "an inference rank's fingerprints of an update's requested ranges")
R("step/{v}/fp/t{r}", FpTrain, "a training rank's fingerprints of the writes it sent")
R("step/{v}/where/{r}", Where, "what a training rank's update is doing, for naming a rank that holds the others up")
R("push/{n}/ready/{r}", wire.Ready, "a training rank is ready for push n")
R("push/{n}/decision", wire.Decision, "the coordinator's one decision on push n")
R("push/{n}/outcome", wire.Outcome, "how push n ended (set once, compare_set)")
R("meta/coordinator", wire.Proc, "the coordinator's host and pid")
R("meta/train_proc/{r}", wire.Proc, "a training rank's host and pid")
R("meta/world", wire.World, "the world sizes the coordinator plans for")
R("meta/engine", Engine, "the model and layout an inference side publishes (vLLM backend)")
R("meta/engine/{r}", Engine, "the model and layout of an engine deployment that joins later (vLLM backend)")
R("meta/infer_shadow/{i}", ShadowInfo, "an inference rank's shadow targets")
R("meta/infer_runtime/{i}", wire.Tagged, "a live engine's runtime layout (a registered engine type)",
  post=lambda v, k: wire.untag(v, key=k))
R("infer/delta_landing/{i}", RegionDescriptor, "an inference rank's landing region for packed deltas",
  post=lambda v, k: fix_descriptor(v))
R(TRACE_KEY.replace("{rank}", "{i}"), LoaderTrace, "an inference rank's traced vLLM loader")
R(SOURCES_KEY, dict[str, tuple[tuple[int, ...], str]], "the checkpoint tensors the trainer holds (shape, dtype)")
R(SOURCE_VIEWS_KEY, dict[str, tuple[str, Box]], "checkpoint tensors held as slices of fused training tensors")
R("step/{v}/verified/{i}", dict[str, Any], "an inference rank's verification of an update (the harness's checks)")
