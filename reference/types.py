"""Metadata types shared by every part of the transfer: plain frozen dataclasses, picklable.

What a training rank holds (:class:`ParamMeta`), what an inference rank exposes
(:class:`DestTensorMeta`, :class:`RegionDescriptor`), how the inference world is laid out
(:class:`InferenceLayout`), and the *recipes* that say how destination bytes are made from
source parameters (:class:`Piece`, :class:`Output`, :class:`Recipe`); and the plan made of
them (:class:`Schedule` of :class:`RankPlan` of :class:`Task` of :class:`Assignment` of
:class:`WriteSpec`, built by :func:`weight_transfer.plan.plan`, run by :mod:`weight_transfer.pipeline.executor`),
and :class:`PlanError`, the error of a plan that cannot be executed correctly.

Boxes
-----
A *box* is a tuple of ``(start, stop)`` pairs, one per dimension, in elements; it names the
sub-tensor ``t[start0:stop0, start1:stop1, ...]``. Boxes are used for source slices, for the
place of a piece inside a recipe's assembled tensor, and for the place of a recipe's output
inside a destination tensor. An output box must be *flat-contiguous* in its destination tensor
(all dimensions after the first one whose extent is > 1 are full), so that it is one byte range
of the destination: one write per receiver.

Dtypes travel as strings (``"bfloat16"``, ``"float32"``, ``"float8_e4m3fn"``) so metadata can
be serialized without pickling torch objects; :func:`torch_dtype` and :func:`dtype_name`
convert.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

Box = tuple[tuple[int, int], ...]

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "uint8": torch.uint8,
}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``. Raises ValueError naming an unknown dtype."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


_ITEMSIZE = {name: dt.itemsize for name, dt in _DTYPES.items()}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype given by name. Raises ValueError naming an unknown dtype."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        return torch_dtype(dtype).itemsize  # raises the ValueError


def numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def full_box(shape: tuple[int, ...]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple((0, s) for s in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    return math.prod([b - a for a, b in box])


def box_to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def box_flat_range(box: Box, shape: tuple[int, ...]) -> tuple[int, int]:
    """Element range ``[start, stop)`` of a flat-contiguous ``box`` in a C-contiguous tensor of
    ``shape``; ``(0, 0)`` for an empty box. Raises ValueError if the box is out of bounds or not
    one contiguous range (some dimension is cut while a dimension outside it spans more than one
    index). One pass from the innermost dimension (the planner calls it ~10^5 times at
    Kimi-K2 scale)."""
    n = len(shape)
    if len(box) != n:
        raise ValueError(f"box {box} has {len(box)} dims, tensor has shape {shape}")
    start, stride, count, cut, contiguous = 0, 1, 1, False, True
    for i in range(n - 1, -1, -1):
        a, b = box[i]
        s = shape[i]
        if not (0 <= a <= b <= s):
            raise ValueError(f"box {box} out of bounds of shape {shape}")
        if cut and b - a != 1:
            contiguous = False
        if a or b != s:
            cut = True
        start += a * stride
        count *= b - a
        stride *= s
    if count == 0:
        return (0, 0)
    if not contiguous:
        raise ValueError(f"box {box} is not flat-contiguous in shape {shape}")
    return (start, start + count)


# --------------------------------------------------------------------------------------------
# training side


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamMeta:
    """One training parameter as held by one training rank.

    The name is the Hugging Face checkpoint name. ``mesh_ranks`` is the DeviceMesh's rank
    tensor as nested tuples (global ranks of the training world), ``placements`` the DTensor
    placements as strings (``"Shard(dim=0)"``, ``"Replicate()"``), and ``local_offset`` /
    ``local_shape`` the part of the global tensor this rank stores (the shape may have a 0:
    DTensor's uneven sharding leaves trailing shards empty).
    """

    name: str
    """Hugging Face checkpoint name, e.g. ``model.layers.0.self_attn.q_proj.weight``."""
    global_shape: tuple[int, ...]
    dtype: str
    """dtype name of the training copy, e.g. ``"bfloat16"`` (or ``"float32"`` for fp32 masters)."""
    mesh_ranks: tuple
    """Nested tuples of global training ranks, the DeviceMesh's ``mesh`` tensor as a list."""
    mesh_dim_names: tuple[str, ...] | None = None
    placements: tuple[str, ...]
    local_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    offloaded: bool = False
    """True when the local shard lives in host memory and needs an H2D copy before use."""

    @property
    def mesh_flat(self) -> tuple[int, ...]:
        """Every global rank of the mesh, flattened in mesh order."""
        out: list[int] = []

        def walk(x):
            if isinstance(x, (tuple, list)):
                for y in x:
                    walk(y)
            else:
                out.append(int(x))

        walk(self.mesh_ranks)
        return tuple(out)

    @property
    def nbytes(self) -> int:
        return numel(self.global_shape) * itemsize(self.dtype)


# --------------------------------------------------------------------------------------------
# inference side


@dataclass(frozen=True, kw_only=True, slots=True)
class RegionDescriptor:
    """A registered memory region as another process needs it to write there.

    ``transport`` names the back end (``"cma"``, ``"verbs"``, ...); ``host`` the machine;
    ``pid`` the owning process (CMA); ``addr`` / ``length`` the virtual address range in
    bytes; ``key`` a per-registration token (the rkey for RDMA; for CMA a random 64-bit value
    checked against the owner's registry so a descriptor from another run is refused);
    ``extra`` back-end specific fields (QP info, GID, ...), as a tuple of (key, value) pairs;
    ``epoch`` the registration's epoch: the owner publishes it while the region is registered
    and revokes it (0) when deregistering, and every write checks it against the owner's
    published value first (reference/transport/base.py). 0: a descriptor without an epoch.
    """

    transport: str
    host: str
    pid: int
    addr: int
    length: int
    key: int
    extra: tuple = ()
    epoch: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class DestTensorMeta:
    """One parameter tensor of an inference rank: vLLM name, shape, dtype, and its place in the
    rank's registered region (byte ``offset`` from the region start, ``nbytes`` long)."""

    rank: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


QUANTS = (None, "fp8", "fp8-tensor", "fp8-channel")
"""Values of :attr:`InferenceLayout.quant`: BF16, block FP8, per-tensor FP8, per-channel FP8."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InferenceLayout:
    """How the inference world is laid out (vLLM terms).

    ``tp`` ranks form one engine instance (tensor parallel); ``dp`` instances are full replicas
    (each receives a full copy); ``ep`` True places MoE experts expert-parallel over the
    instance's ``tp`` ranks (each rank holds ``E / tp`` whole experts, vLLM's linear placement:
    global expert ``e`` on rank ``e // (E/tp)``, slot ``e % (E/tp)``) instead of TP-slicing every
    expert. ``quant`` is ``None`` (serve the training dtype cast to ``dtype``), ``"fp8"``
    (DeepSeek-V3 block FP8: e4m3 weights plus float32 ``weight_scale_inv`` per 128x128 block for
    linear layers), ``"fp8-tensor"`` (e4m3 weights plus one float32 ``weight_scale`` per checkpoint
    tensor: vLLM's ``Fp8Config`` without ``weight_block_size``) or ``"fp8-channel"`` (e4m3 weights
    plus a float32 ``weight_scale`` ``[N, 1]`` per output row: compressed-tensors' FP8 channel
    scheme); the last two are planned from vLLM's traced loader only
    (:mod:`weight_transfer.convert.quant_scaled`). Inference rank ``i`` is instance ``i // tp``, TP rank ``i % tp``.
    ``draft`` is ``None`` or ``"mtp"``: every rank also serves the draft model of speculative
    decoding, DeepSeek-V3's multi-token-prediction layers (vLLM's ``DeepSeekMTP``, same TP / EP /
    quantization as the target), whose tensors are written in the same update under the same
    version (docs/LAYOUTS.md, "Draft model: DeepSeek MTP").

    ``dp_attention`` True (needs ``ep``): data-parallel attention with expert parallelism, as
    SGLang's ``--enable-dp-attention`` / vLLM's DP + EP serve MoE models: every rank of the
    instance holds all non-expert tensors whole (attention, embeddings, lm_head, router,
    norms, shared experts and dense MLPs replicated, as at ``tp=1``), and the routed experts
    are split over the instance's ``tp`` ranks (EP degree ``tp``). Source: Perplexity's
    engine serves Qwen3-235B this way (Lequn Chen, le.qun.ch, 2025-09-07, issue #16).
    """

    tp: int = 1
    """Inference tensor-parallel size (ranks per engine instance)."""
    dp: int = 1
    """Inference replicas (engine instances, each receiving a full copy)."""
    ep: bool = False
    """Place MoE experts expert-parallel over each instance's TP ranks."""
    quant: Literal["fp8", "fp8-tensor", "fp8-channel"] | None = None
    """``None`` (serve BF16; ``none`` on the command line), ``"fp8"`` (block FP8 e4m3 with
    ``weight_scale_inv``), ``"fp8-tensor"`` or ``"fp8-channel"`` (e4m3 with a per-tensor or
    per-output-channel float32 ``weight_scale``)."""
    dtype: str = "bfloat16"
    """dtype of the non-quantized tensors on the inference side."""
    dp_attention: bool = False
    """Non-expert tensors replicated on every rank, experts split over the ``tp`` ranks."""
    draft: Literal["mtp"] | None = None
    """``None`` (no draft model; ``none`` on the command line) or ``"mtp"``: the engine also
    serves the model's MTP layers as its speculative-decoding draft (destination names
    ``draft.`` + vLLM's name inside ``DeepSeekMTP``)."""

    def __post_init__(self):
        if self.tp < 1 or self.dp < 1:
            raise ValueError(f"InferenceLayout: tp={self.tp} and dp={self.dp} must be >= 1")
        if self.dp_attention and not self.ep:
            raise ValueError("InferenceLayout: dp_attention=True needs ep=True (experts split over the tp ranks)")
        if self.quant not in QUANTS:
            raise ValueError(f"InferenceLayout: unknown quant {self.quant!r} (None, {', '.join(map(repr, QUANTS[1:]))})")
        if self.draft not in (None, "mtp"):
            raise ValueError(f"InferenceLayout: unknown draft {self.draft!r} (None or 'mtp')")
        torch_dtype(self.dtype)

    @property
    def world_size(self) -> int:
        return self.tp * self.dp

    def ranks_of_tp_rank(self, tp_rank: int) -> tuple[int, ...]:
        """Inference ranks holding TP rank ``tp_rank`` of every replica."""
        return tuple(d * self.tp + tp_rank for d in range(self.dp))

    @property
    def dense_tp(self) -> int:
        """TP degree of the non-expert tensors: 1 under data-parallel attention, else ``tp``."""
        return 1 if self.dp_attention else self.tp

    def describe(self) -> str:
        if self.dp_attention:
            s = f"DPA+EP{self.tp}"
            if self.dp > 1:
                s += f"xDP{self.dp}"
            return s + (f"-{self.quant}" if self.quant else "") + (f"+{self.draft}" if self.draft else "")
        s = f"TP{self.tp}"
        if self.ep:
            s += "+EP"
        if self.dp > 1:
            s += f"xDP{self.dp}"
        if self.quant:
            s += f"-{self.quant}"
        if self.draft:
            s += f"+{self.draft}"
        return s


# --------------------------------------------------------------------------------------------
# recipes


@dataclass(frozen=True, slots=True)
class Piece:
    """``assembled[dst_box] = source[src_box]`` (cast to the recipe's assembled dtype).

    ``source`` None means zero fill (e.g. vocab padding rows); then ``src_box`` is ``()``.
    """

    source: str | None
    src_box: Box
    dst_box: Box


@dataclass(frozen=True, slots=True)
class Output:
    """One tensor a recipe's transform produces, and where it goes: destination tensor
    ``tensor`` (vLLM name), at the flat-contiguous ``box`` of it, on every rank of the recipe."""

    tensor: str
    box: Box
    dtype: str
    layout: str = "identity"
    """Element order of the bytes in the destination (see :mod:`weight_transfer.convert.layouts`):
    ``"identity"`` (C order, what ``load_weights`` makes) or an engine's post-processed order
    such as ``"blocked:32x2"`` (vLLM CPU packed GEMM weights)."""


Transform = Literal["copy", "fp8_block", "fp8_tensor", "fp8_channel"]


@dataclass(frozen=True, slots=True)
class Recipe:
    """How one piece of destination memory is made.

    The pieces assemble a tensor of ``shape`` and dtype ``assembled_dtype`` (every element
    covered exactly once). The transform then makes the outputs:

    - ``"copy"``: one output, the assembled tensor cast to the output dtype;
    - ``"fp8_block"``: two outputs, the FP8 e4m3 weight (same shape) and its float32
      ``weight_scale_inv`` of shape ``[..., ceil(N/128), ceil(K/128)]`` over the last two dims
      (DeepSeek-V3 format), quantized from exactly the assembled BF16 tensor;
    - ``"fp8_tensor"`` / ``"fp8_channel"``: two outputs, the FP8 e4m3 weight and its float32
      ``weight_scale`` (one value; ``[rows, 1]``), quantized per tensor / per row over the whole
      assembled BF16 tensor (:mod:`weight_transfer.convert.quant_scaled`); the weight output is the
      assembled tensor's leading corner of the output box's shape (the destination's own
      elements; the rest are the source rows / columns the scale needs besides them).

    ``ranks`` are the inference ranks that receive identical bytes (TP-replicated tensors and
    DP replicas are extra destinations of one recipe).
    """

    name: str
    """Human-readable id for errors and logs, e.g. ``'model.layers.0.self_attn.qkv_proj.weight@tp1'``."""
    ranks: tuple[int, ...]
    shape: tuple[int, ...]
    assembled_dtype: str
    pieces: tuple[Piece, ...]
    transform: Transform
    outputs: tuple[Output, ...]

    @property
    def sources(self) -> tuple[str, ...]:
        """Distinct source parameter names, in first-use order."""
        seen: dict[str, None] = {}
        for p in self.pieces:
            if p.source is not None:
                seen.setdefault(p.source, None)
        return tuple(seen)

    @property
    def output_nbytes(self) -> int:
        """Bytes written per receiving rank (the planner reads it for every recipe and band:
        one loop, no helper calls)."""
        n = 0
        for o in self.outputs:
            c = _ITEMSIZE.get(o.dtype) or itemsize(o.dtype)
            for a, b in o.box:
                c *= b - a
            n += c
        return n


def _slot_setters(cls) -> tuple:
    """The ``__set__`` of each of ``cls``'s slot descriptors, in ``__slots__`` order (the fast
    constructors here and in :mod:`weight_transfer.plan.fast` set fields through them)."""
    return tuple(cls.__dict__[f].__set__ for f in cls.__slots__)


_NEW = object.__new__
_P_SET, _O_SET, _R_SET = _slot_setters(Piece), _slot_setters(Output), _slot_setters(Recipe)
assert Piece.__slots__ == ("source", "src_box", "dst_box") and Output.__slots__ == ("tensor", "box", "dtype", "layout")
assert Recipe.__slots__ == ("name", "ranks", "shape", "assembled_dtype", "pieces", "transform", "outputs")


def new_piece(source, src_box, dst_box, _set=_P_SET) -> Piece:
    """``Piece(source, src_box, dst_box)`` without the frozen dataclass's ``object.__setattr__``
    per field (the slots are set through their descriptors): an equal object, 3x faster. The
    planner cuts 10^5 recipes into bands at Kimi-K2 scale (``new_*``: the only hand-built ones)."""
    p = _NEW(Piece)
    a, b, c = _set
    a(p, source)
    b(p, src_box)
    c(p, dst_box)
    return p


def new_output(tensor, box, dtype, layout="identity", _set=_O_SET) -> Output:
    """``Output(tensor, box, dtype, layout)``, fast (see :func:`new_piece`)."""
    o = _NEW(Output)
    a, b, c, d = _set
    a(o, tensor)
    b(o, box)
    c(o, dtype)
    d(o, layout)
    return o


def new_recipe(name, ranks, shape, assembled_dtype, pieces, transform, outputs, _set=_R_SET) -> Recipe:
    """``Recipe(name, ranks, shape, assembled_dtype, pieces, transform, outputs)`` with every
    field positional, fast (see :func:`new_piece`)."""
    r = _NEW(Recipe)
    a, b, c, d, e, f, g = _set
    a(r, name)
    b(r, ranks)
    c(r, shape)
    d(r, assembled_dtype)
    e(r, pieces)
    f(r, transform)
    g(r, outputs)
    return r


# --------------------------------------------------------------------------------------------
# the plan (what :func:`weight_transfer.plan.plan` returns; what the executor runs)


class PlanError(ValueError):
    """A weight plan that cannot be executed correctly. The message names the tensors: its first
    line is a one-line summary, then one line per problem (the first 20)."""


class WriteSpec(NamedTuple):
    """One one-sided write: output ``output`` of the recipe (all its bytes) to inference rank
    ``dst_rank`` at byte ``remote_offset`` of that rank's region, ``length`` bytes.

    A named tuple rather than a frozen dataclass: the planner makes about a million per plan
    at Kimi-K2 scale, and a tuple is built in one C call."""

    output: int
    dst_rank: int
    remote_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Assignment:
    """A recipe this rank prepares, and the writes it posts from the outputs."""

    recipe: Recipe
    writes: tuple[WriteSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(w.length for w in self.writes)


@dataclass(frozen=True, slots=True)
class Task:
    """One fusion group as one training rank runs it.

    ``sources`` are gathered with ``full_tensor()`` in this order by every rank of ``mesh``
    (including ranks with nothing to send: the all-gather is collective). ``temp_bytes`` is
    what the task holds on this rank between prepare and release (gathered sources plus its
    outputs), the quantity the executor's watermark bounds."""

    id: int
    group: int
    sources: tuple[str, ...]
    mesh: tuple[int, ...]
    assignments: tuple[Assignment, ...]
    source_bytes: int
    temp_bytes: int
    local_sources: tuple[str, ...] = ()
    """A *local* task (no ``sources``): its recipes read only this rank's own shards
    (``to_local()``, piece boxes already in local coordinates); no collective, no gather."""

    @property
    def send_bytes(self) -> int:
        return sum(a.nbytes for a in self.assignments)


@dataclass(frozen=True, slots=True)
class RankPlan:
    """Everything one training rank executes per step, in order."""

    rank: int
    tasks: tuple[Task, ...]
    groups: tuple[int, ...]
    """Mesh groups this rank takes part in, in execution order."""
    n_groups: int | None = None
    """Mesh groups of the whole schedule: every rank issues ``n_groups - 1`` barriers, also
    ranks with no task in some group. None when unknown (the executor then agrees on it)."""

    @property
    def send_bytes(self) -> int:
        return sum(t.send_bytes for t in self.tasks)

    @property
    def n_writes(self) -> int:
        return sum(len(a.writes) for t in self.tasks for a in t.assignments)


@dataclass(frozen=True)
class Schedule:
    """The whole plan: one :class:`RankPlan` per training rank plus totals."""

    rank_plans: dict[int, RankPlan]
    send_bytes: dict[int, int]
    recv_bytes: dict[int, int]
    n_tasks: int
    n_groups: int
    gather_bytes: int = 0
    """Bytes of source parameters materialized with ``full_tensor()`` per update (global sizes,
    each gathered source once per task; every rank of its mesh receives the ``(n-1)/n`` of it it
    does not hold). 0 when every recipe is made from the ranks' own shards."""
    gathers: tuple[tuple[str, int, int, str], ...] = ()
    """Why the rest is gathered: ``(reason, recipes, bytes of their sources, the first such
    recipe's name)`` per reason, most bytes first (:func:`weight_transfer.plan.local.localize_group`);
    a source shared by recipes of two reasons counts under the first."""

    @property
    def total_bytes(self) -> int:
        """Bytes written into inference memory per update (all ranks, replicas included)."""
        return sum(self.recv_bytes.values())

    @property
    def n_writes(self) -> int:
        return sum(p.n_writes for p in self.rank_plans.values())

    def summary(self) -> str:
        s, r = self.send_bytes, self.recv_bytes
        return (f"{self.n_tasks} tasks in {self.n_groups} mesh group(s), {self.n_writes} writes, "
                f"{self.total_bytes / 1e9:.3f} GB; busiest sender {max(s.values(), default=0) / 1e9:.3f} GB, "
                f"busiest receiver {max(r.values(), default=0) / 1e9:.3f} GB; "
                f"gathers {self.gather_bytes / 1e6:.1f} MB (full_tensor())" + self.gathers_line())

    def gathers_line(self) -> str:
        """``": <reason> (<n> recipes, <MB>; e.g. <recipe>); ..."`` for the reasons of
        :attr:`gathers` (at most 4, most bytes first), or ``""`` when nothing is gathered."""
        if not self.gathers:
            return ""
        parts = [f"{why} ({n} recipe{'s' if n != 1 else ''}, {b / 1e6:.1f} MB; e.g. {ex})"
                 for why, n, b, ex in self.gathers[:4]]
        more = len(self.gathers) - 4
        return ": " + "; ".join(parts) + (f"; {more} more reason(s)" if more > 0 else "")
