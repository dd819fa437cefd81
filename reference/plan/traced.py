"""Recipes compiled from the inference engine's own weight loader (C29).

The hand-written rules (:mod:`weight_transfer.plan.rules`) know three families. Every other
model vLLM serves is planned from a **loader trace**: each vLLM worker runs its model's own
``load_weights`` once, on ``meta`` tensors (a skeleton of the model, never the live weights),
with the trainer's checkpoint names and shapes as input, and records every ``copy_`` into a
parameter (which slice of which checkpoint tensor lands at which slice of which parameter) and
every zero fill (vocabulary padding). :mod:`weight_transfer.engines.vllm.trace.loader` makes the traces
(it needs vLLM); this module, which does not, turns the traces of every inference rank into the
planner's :class:`~weight_transfer.plan.RecipeSet` (:func:`recipes_from_traces`), and compares two
recipe sets destination byte by destination byte (:func:`compare_recipes`, the cross-check of the
hand-written rules against the traced ones).

What a trace cannot express as a copy of checkpoint bytes (an arithmetic op on the loaded
tensor, a broadcast, a transpose into the parameter, a partial overwrite) is recorded per
parameter as **refused**, with the loader step (the aten op) that did it; the plan refuses such a
model naming the parameter. Dtype changes are planned casts (the source is cast to the
parameter's dtype, as ``copy_`` does). Parameters the loader never fills from the trainer's
tensors are refused too (the trainer lacks a tensor the engine loads), naming them.

Granularity is the hand-written rules': one recipe per (parameter, distinct content) with the
ranks that receive identical bytes merged (replicated norms: one recipe for every rank), and a
parameter of three or more dims whose pieces each fill whole slots of its first dim (the experts
of a fused MoE ``w13_weight`` / ``w2_weight``) cut into one recipe per slot, so a trainer
materializes an expert's tensors, not a layer's.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..convert.quant import QUANT_BLOCK, cdiv, scale_shape
from ..types import Box, InferenceLayout, Piece, PlanError, new_output, new_piece, new_recipe
from .scaled import SCALE, scaled_kind, scaled_parts

__all__ = ["TracedParam", "LoaderTrace", "TRACE_KEY", "SOURCES_KEY", "recipes_from_traces", "canonical_pieces",
           "compare_recipes", "box_volume", "SOURCE_VIEWS_KEY", "check_views", "view_shape", "expand_sources",
           "apply_source_views", "fused_expert_views", "SCALE_SUFFIX", "kept_line"]

TRACE_KEY = "meta/infer_trace/{rank}"
"""Store key under which an inference rank publishes its :class:`LoaderTrace`."""
SCALE_SUFFIX = "_scale_inv"
"""A block-FP8 weight ``x.weight``'s scale is ``x.weight_scale_inv``, in vLLM's model (``w13_weight``:
``w13_weight_scale_inv``) as in a DeepSeek-V3 checkpoint."""
FP8, BF16, F32 = "float8_e4m3fn", "bfloat16", "float32"
SOURCES_KEY = "meta/train_sources"
"""Store key under which training rank 0 publishes ``{checkpoint name: (global shape, dtype name)}``
before the inference side initializes: the names and shapes the workers trace their loader with
(without it they read their checkpoint's safetensors headers)."""


def box_volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


@dataclass(frozen=True)
class TracedParam:
    """One parameter as vLLM's loader fills it: its load-time ``shape`` and ``dtype`` name and
    the :class:`~weight_transfer.types.Piece` s (checkpoint source and slice -> the slice of the
    parameter; ``source`` None: a zero fill), in the order the loader wrote them."""

    shape: tuple[int, ...]
    dtype: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class LoaderTrace:
    """What one inference rank's loader does with the trainer's tensors.

    ``params``: vLLM parameter name -> :class:`TracedParam` (the loader's order); ``refused``:
    vLLM parameter name -> why it is not a copy of checkpoint bytes (the loader step named);
    ``skipped``: checkpoint names the loader consumed without writing them anywhere on this
    rank (a tied ``lm_head.weight``, experts of another EP rank, rotary buffers); ``error``: the
    loader raised (one line) and the trace is unusable; ``source``: which loader, e.g.
    ``"vllm 0.32.0 LlamaForCausalLM.load_weights"``; ``seconds``: how long tracing took.
    A block-FP8 engine (:mod:`weight_transfer.engines.vllm.trace.fp8`): ``quantized``, checkpoint
    name -> shape of each trainer tensor the engine loads as ``float8_e4m3fn`` + ``weight_scale_inv``
    (the trace is of that checkpoint form); ``kept``, quantization-state parameters (KV-cache and
    activation scales) the loader left at the engine's own value. An engine serving a draft model
    (:mod:`weight_transfer.engines.vllm.trace.draft`): the draft's parameters are in ``params``
    under ``draft.``; ``shared``, checkpoint name -> the target tensor that serves the draft
    parameter it would fill (an MTP draft's embedding and head)."""

    params: dict[str, TracedParam]
    refused: dict[str, str] = field(default_factory=dict)
    skipped: tuple[str, ...] = ()
    error: str = ""
    source: str = ""
    seconds: float = 0.0
    quantized: dict[str, tuple[int, ...]] = field(default_factory=dict)
    kept: tuple[str, ...] = ()
    shared: dict[str, str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of the traced parameters (their load-layout size)."""
        from ..types import itemsize

        return sum(math.prod(p.shape) * itemsize(p.dtype) for p in self.params.values())


def _check(rank: int, name: str, tp: TracedParam, problems: list[str]) -> bool:
    n = math.prod(tp.shape)
    got = sum(box_volume(p.dst_box) for p in tp.pieces)
    if got == n:
        return True
    what = "fills" if got < n else "writes"
    problems.append(f"inference rank {rank}: vLLM's loader {what} {got} of the {n} elements of {name} "
                    f"{list(tp.shape)} from the trainer's tensors"
                    + (" (a tensor the engine loads is missing on the training side)" if got < n else
                       " (some elements twice)"))
    return False


def _slots(name: str, tp: TracedParam):
    """``tp`` cut into one part per slot of its first dim when every piece fills whole slots
    (``[(j, pieces re-based to slot j)]``), else None."""
    if len(tp.shape) < 3 or tp.shape[0] < 2:
        return None
    per: dict[int, list[Piece]] = {}
    for p in tp.pieces:
        (a, b) = p.dst_box[0]
        if b - a != 1:
            return None
        per.setdefault(a, []).append(new_piece(p.source, p.src_box, ((0, 1),) + tuple(p.dst_box[1:])))
    if sorted(per) != list(range(tp.shape[0])):
        return None
    return sorted(per.items())


def _block_problem(name: str, tp: TracedParam, scale: TracedParam | None, quantized) -> str:
    """Why the block-FP8 weight ``name`` (its trace ``tp``, its scale's ``scale``) cannot be made by
    quantizing the trainer's BF16 rows assembled as vLLM's loader places them, or ``""``: every
    piece is whole 128x128 blocks of its source (``quantized``: source -> shape) landing on whole
    blocks of the parameter (a partial block only at both tensors' ends), and vLLM loads the
    scale of each destination block from the matching block of that source's ``weight_scale_inv``."""
    if scale is None:
        return f"float8_e4m3fn without a scale {name}{SCALE_SUFFIX} or {name}{SCALE}"
    B = QUANT_BLOCK
    want = []
    for p in tp.pieces:
        sshape = quantized.get(p.source) if p.source is not None else None
        if sshape is None:
            return f"filled from {p.source or 'zeros'}, which the engine does not load as block FP8"
        ks, kd = len(p.src_box) - 2, len(p.dst_box) - 2
        for box, shape, what in ((p.src_box[ks:], sshape[-2:], f"rows/columns {list(p.src_box)} of {p.source}"),
                                 (p.dst_box[kd:], tp.shape[-2:], f"its box {list(p.dst_box)}")):
            if any(a % B or (b % B and b != n) for (a, b), n in zip(box, shape)):
                return f"{what} cut(s) a {B}x{B} quantization block (vLLM loads the checkpoint's blocks whole)"
        blocks = lambda box: tuple((a // B, cdiv(b, B)) for a, b in box)  # noqa: E731
        want.append((p.source + SCALE_SUFFIX, tuple(p.src_box[:ks]) + blocks(p.src_box[ks:]),
                     tuple(p.dst_box[:kd]) + blocks(p.dst_box[kd:])))
    got = sorted((q.source or "", tuple(q.src_box), tuple(q.dst_box)) for q in scale.pieces)
    if sorted(want) != got:
        diff = next((x for x in sorted(want) if x not in got), None) or next(x for x in got if x not in want)
        return f"vLLM loads {name}{SCALE_SUFFIX} from other blocks than its weight's (first: {diff})"
    return ""


def _outputs(name: str, shape: tuple[int, ...], kind: str, lead: Box) -> tuple:
    """A traced recipe's outputs: the box ``lead`` of ``name``'s leading dims and the rest whole;
    for ``kind`` ``"fp8_block"`` the ``float8_e4m3fn`` weight and its float32 scale's same slots."""
    tail = tuple((0, s) for s in shape[len(lead):])
    if kind != "fp8_block":
        return (new_output(name, lead + tail, kind),)
    sc = scale_shape(shape)
    return (new_output(name, lead + tail, FP8), new_output(name + SCALE_SUFFIX, lead + tuple((0, s) for s in sc[len(lead):]), F32))


def recipes_from_traces(traces: Mapping[int, LoaderTrace], layout: InferenceLayout | None = None, *,
                        model: str = "", source_dtypes: Mapping[str, str] | None = None):
    """The :class:`~weight_transfer.plan.RecipeSet` of the traced loaders of every inference rank
    in ``traces`` (rank -> :class:`LoaderTrace`): one ``"copy"`` recipe per (parameter,
    content), the ranks receiving identical bytes merged, MoE expert slots cut (module docstring);
    each recipe's output is the whole parameter (or slot) in its load-time dtype, for
    :func:`weight_transfer.plan.retarget.retarget` to aim at the runtime layout as for the
    hand-written recipes. ``ignored``: the ``source_dtypes`` names no recipe reads that some
    rank's loader skipped (a tied head, rotary buffers); any other unused trainer tensor is left
    to :func:`weight_transfer.plan.checks.validate` to refuse (C2).

    A block-FP8 parameter (``float8_e4m3fn`` with a ``_scale_inv`` sibling, traced on the FP8
    checkpoint form, :attr:`LoaderTrace.quantized`) is one ``"fp8_block"`` recipe (per expert slot)
    assembled in BF16 from the trainer's tensors, with two outputs, the weight and its scale, as
    the hand-written FP8 rules make; its scale parameter is not a recipe of its own. A per-tensor
    or per-channel FP8 parameter (``float8_e4m3fn`` with a ``_scale`` sibling) is one
    ``"fp8_tensor"`` / ``"fp8_channel"`` recipe per quantization domain, gathering the source rows
    or columns its scale needs beyond the destination's (:mod:`weight_transfer.plan.scaled`). ``kept``:
    the quantization-state parameters every rank's engine keeps (:attr:`LoaderTrace.kept`).

    Raises :class:`PlanError` (one line per problem, the first 20) when a rank's loader raised,
    refused a parameter (a computation, not a copy: the loader step is named), or fills a
    parameter only partly or twice, or a block-FP8 weight cannot be quantized from the rows as
    vLLM places them (:func:`_block_problem`: a piece cutting a 128x128 block, a scale loaded
    from other blocks), or a per-tensor / per-channel FP8 weight does not fit its format
    (:func:`~weight_transfer.plan.scaled.scaled_parts`; MoE experts, refused naming the parameter)."""
    from . import RecipeSet

    problems: list[str] = []
    for r, t in sorted(traces.items()):
        if t.error:
            problems.append(f"inference rank {r}: tracing vLLM's loader failed: {t.error}")
        for name, why in sorted(t.refused.items()):
            problems.append(f"inference rank {r}: {name} is not a copy of checkpoint bytes ({why}); "
                            "it cannot be written one-sidedly")
    groups: dict[tuple, list[int]] = {}
    order: list[tuple] = []
    for r, t in sorted(traces.items()):
        if t.error:
            continue
        scales = {n + sfx for n, p in t.params.items() if p.dtype == FP8 for sfx in (SCALE_SUFFIX, SCALE)}
        for name, tp in t.params.items():
            if name in t.refused or name in scales or not _check(r, name, tp, problems):
                continue
            kind = tp.dtype
            sc = t.params.get(name + SCALE) if tp.dtype == FP8 and name + SCALE_SUFFIX not in t.params else None
            if sc is not None:  # per-tensor / per-channel FP8 (weight_transfer.plan.scaled)
                k = scaled_kind(tp.shape, sc.shape)
                parts, why = scaled_parts(name, tp, sc, k, t.quantized) if k else ([], (
                    f"a {len(tp.shape)}-D FP8 weight with a {list(sc.shape)} {name}{SCALE}: MoE experts are not planned "
                    "under per-tensor / per-channel FP8 (block FP8 plans them)" if len(tp.shape) == 3 else
                    f"its scale {name}{SCALE} {list(sc.shape)} is neither per-tensor nor per-channel"))
                if why:
                    problems.append(f"inference rank {r}: {name} {list(tp.shape)}: {why}")
                for suffix, shape, pieces, outs in parts:
                    key = (name + suffix, shape, k, pieces, outs)
                    if key not in groups:
                        groups[key] = []
                        order.append(key)
                    groups[key].append(r)
                continue
            if tp.dtype == FP8:
                why = _block_problem(name, tp, t.params.get(name + SCALE_SUFFIX), t.quantized)
                if why:
                    problems.append(f"inference rank {r}: {name} {list(tp.shape)}: {why}")
                    continue
                kind = "fp8_block"
            key = (name, tp.shape, kind, tp.pieces)
            if key not in groups:
                groups[key] = []
                order.append(key)
            groups[key].append(r)
    if problems:
        raise PlanError(f"model {model}: {len(problems)} problem(s) in the recipes traced from vLLM's loader\n"
                        + "\n".join(problems[:20]))
    tp_size = layout.tp if layout is not None else 1
    n_variants: dict[str, int] = {}
    for key in order:
        n_variants[key[0]] = n_variants.get(key[0], 0) + 1
    recipes = []
    for key in order:
        name, shape, dtype, pieces = key[:4]
        ranks = tuple(sorted(groups[key]))
        rname = name if n_variants[name] == 1 else f"{name}@tp{ranks[0] % tp_size}"
        if len(key) == 5:  # per-tensor / per-channel FP8: its outputs made by scaled_parts
            recipes.append(new_recipe(rname, ranks, shape, BF16, pieces, dtype, key[4]))
            continue
        fp8 = dtype == "fp8_block"
        tp = TracedParam(shape, FP8 if fp8 else dtype, pieces)

        slots = _slots(name, tp)
        assembled, transform = (BF16, "fp8_block") if fp8 else (dtype, "copy")
        if slots is None:
            recipes.append(new_recipe(rname, ranks, shape, assembled, pieces, transform, _outputs(name, shape, dtype, ())))
            continue
        for j, ps in slots:
            recipes.append(new_recipe(f"{rname}[{j}]", ranks, (1,) + tuple(shape[1:]), assembled, tuple(ps), transform,
                                      _outputs(name, shape, dtype, ((j, j + 1),))))
    ignored: frozenset[str] = frozenset()
    if source_dtypes:
        used = {p.source for r in recipes for p in r.pieces if p.source is not None}
        skipped = {s for t in traces.values() for s in t.skipped}
        ignored = frozenset(n for n in source_dtypes if n not in used and n in skipped)
    kept = sorted({k for t in traces.values() for k in t.kept})
    shared = {s: to for t in traces.values() for s, to in t.shared.items()}
    return RecipeSet(recipes, ignored, layout=layout, model=model, kept=kept, shared=shared)


def kept_line(recipes) -> str:
    """The plan line's words for ``recipes.kept`` (a :class:`~weight_transfer.plan.RecipeSet`):
    ``"; kept by the engine (the trainer holds none): 8 quantization-state tensor(s) (k_scale x2,
    ...)"``, or ``""`` when it keeps nothing."""
    from collections import Counter

    if not recipes.kept:
        return ""
    kinds = Counter(n.rsplit(".", 1)[-1] for n in recipes.kept)
    return (f"; kept by the engine (the trainer holds none): {len(recipes.kept)} quantization-state tensor(s) ("
            + ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) + ")")


# ============================================================================================
# cross-check


def canonical_pieces(recipes) -> dict[tuple[int, str], tuple]:
    """``(inference rank, destination tensor, dtype) -> sorted pieces`` in the destination tensor's own
    coordinates (each piece's ``dst_box`` moved by its recipe's output box; leading unit dims
    kept), for ``"copy"`` and ``"fp8_block"`` recipes in the identity layout: two recipe sets that
    write the same bytes from the same source slices have equal canonical pieces, however their
    recipes are cut. A ``"fp8_block"`` recipe's weight output counts as a copy (the quantizer's
    input), and its scale output as one entry ``(scale box, "fp8_block of" weight, weight box)``:
    equal entries quantize the same blocks. Pieces are further cut at every row where either set
    cuts (:func:`compare_recipes`)."""
    out: dict[tuple[int, str], list] = {}
    for r in recipes:
        if not (r.transform == "copy" and len(r.outputs) == 1 or r.transform == "fp8_block" and len(r.outputs) == 2):
            continue
        o = r.outputs[0]
        if r.transform == "fp8_block":
            s = r.outputs[1]
            for rank in r.ranks:
                out.setdefault((rank, s.tensor, s.dtype), []).append((tuple(s.box), f"fp8_block of {o.tensor}", o.box))
        origin = [a for a, _ in o.box]
        for p in r.pieces:
            k = len(o.box) - len(p.dst_box)
            dst = tuple((origin[d + k] + a, origin[d + k] + b) for d, (a, b) in enumerate(p.dst_box))
            dst = tuple(o.box[:k]) + dst
            for rank in r.ranks:
                out.setdefault((rank, o.tensor, o.dtype), []).append((dst, p.source, tuple(p.src_box)))
    return {k: tuple(sorted(v, key=lambda x: (x[0], x[1] or "", x[2]))) for k, v in out.items()}


def _rows(pieces) -> list:
    """Pieces cut into single rows of their first dim of extent > 1 (a normal form)."""
    out = []
    for dst, src, sb in pieces:
        dst_core = [(a, b) for a, b in dst]
        # the first dst dim with extent > 1, and the matching source dim (same trailing position)
        d = next((i for i, (a, b) in enumerate(dst_core) if b - a > 1), None)
        if d is None:
            out.append((dst, src, sb))
            continue
        k = len(dst) - len(sb)
        a0, b0 = dst[d]
        for i in range(b0 - a0):
            nd = list(dst)
            nd[d] = (a0 + i, a0 + i + 1)
            ns = list(sb)
            if src is not None and d >= k:
                s0 = sb[d - k][0]
                ns[d - k] = (s0 + i, s0 + i + 1)
            out.append((tuple(nd), src, tuple(ns)))
    return sorted(out, key=lambda x: (x[0], x[1] or "", x[2]))


def compare_recipes(a, b, *, max_problems: int = 20) -> list[str]:
    """Where two recipe sets write different bytes: one line per (inference rank, destination
    tensor) that only one of them writes or that they make from different source slices (the
    first ``max_problems``); ``[]`` when every destination byte comes from the same source byte
    in both. Compares canonical pieces (:func:`canonical_pieces`), cut to single rows where the two
    sets cut a tensor differently; ``"copy"`` and ``"fp8_block"`` recipes (:func:`canonical_pieces`)."""
    ca, cb = canonical_pieces(a), canonical_pieces(b)
    out = []
    for key in sorted(set(ca) | set(cb)):
        pa, pb = ca.get(key), cb.get(key)
        if pa is None or pb is None:
            out.append(f"inference rank {key[0]}: {key[1]} ({key[2]}) is written by only the "
                       f"{'first' if pb is None else 'second'} recipe set")
        elif pa != pb and _rows(pa) != _rows(pb):
            ra, rb = _rows(pa), _rows(pb)
            diff = next(((x, y) for x, y in zip(ra, rb) if x != y), (ra[len(rb):][:1], rb[len(ra):][:1]))
            out.append(f"inference rank {key[0]}: {key[1]} differs: {diff[0]} against {diff[1]}")
        if len(out) >= max_problems:
            break
    return out


# ============================================================================================
# training tensors that hold several checkpoint tensors (fused experts)

SOURCE_VIEWS_KEY = "meta/train_views"
"""Store key under which training rank 0 publishes its source views (:func:`apply_source_views`)."""


def check_views(views: Mapping[str, tuple[str, Box]], shapes: Mapping[str, tuple[int, ...]], *,
                where: str = "views") -> dict[str, tuple[str, Box]]:
    """``views`` (checkpoint name -> (training tensor name, box of it)) checked against the
    training tensors' global ``shapes``: the tensor exists, the box lies inside it, and the
    checkpoint name is not itself a training tensor. Returns a plain dict with tuple boxes;
    ValueError naming the first bad view."""
    out = {}
    for ck, (name, box) in views.items():
        box = tuple((int(a), int(b)) for a, b in box)
        if name not in shapes:
            raise ValueError(f"{where}: {ck!r} is a view of {name!r}, which is not a training tensor")
        if ck in shapes:
            raise ValueError(f"{where}: {ck!r} is a training tensor and a view of {name!r}: one or the other")
        sh = shapes[name]
        if len(box) != len(sh) or any(not (0 <= a < b <= n) for (a, b), n in zip(box, sh)):
            raise ValueError(f"{where}: {ck!r} = {name}{list(box)} is outside its shape {list(sh)}")
        out[ck] = (name, box)
    return out


def view_shape(box: Box) -> tuple[int, ...]:
    """The checkpoint tensor's shape of a view: the box's extents without its leading unit dims
    (an expert's ``[I, H]`` rows of a fused ``[E, 2I, H]`` tensor)."""
    ext = [b - a for a, b in box]
    while len(ext) > 1 and ext[0] == 1:
        ext.pop(0)
    return tuple(ext)


def expand_sources(sources: Mapping[str, tuple[tuple[int, ...], str]], views: Mapping[str, tuple[str, Box]]):
    """The checkpoint names, shapes and dtypes a loader consumes: ``sources`` (training name ->
    (shape, dtype)) with every tensor that views cover replaced by its views."""
    covered = {name for name, _ in views.values()}
    out = {n: v for n, v in sources.items() if n not in covered}
    for ck, (name, box) in views.items():
        out[ck] = (view_shape(box), sources[name][1])
    return out


def apply_source_views(recipes, views: Mapping[str, tuple[str, Box]]):
    """``recipes`` (over checkpoint names) read from the training tensors that hold them: each
    piece of a viewed checkpoint tensor becomes a piece of the training tensor, its slice moved
    into the view's box (leading unit dims kept: the recipe's destination box then has as many
    dims as the source slice, as an expert slot of ``w13_weight`` has). PlanError when a view's
    slice has more dims than the piece's destination (a fused tensor feeding a 2-D parameter
    through a unit dim)."""
    from . import RecipeSet

    if not views:
        return recipes
    out = []
    for r in recipes:
        if not any(p.source in views for p in r.pieces):
            out.append(r)
            continue
        pieces = []
        for p in r.pieces:
            v = views.get(p.source) if p.source is not None else None
            if v is None:
                pieces.append(p)
                continue
            name, box = v
            k = len(box) - len(p.src_box)
            sb = tuple(box[:k]) + tuple((box[k + d][0] + a, box[k + d][0] + b) for d, (a, b) in enumerate(p.src_box))
            if len(sb) > len(p.dst_box):
                raise PlanError(f"recipe {r.name!r}: checkpoint tensor {p.source} is a view {list(box)} of {name} with "
                                f"{k} leading unit dim(s) more than its destination box {list(p.dst_box)}")
            pieces.append(new_piece(name, sb, p.dst_box))
        out.append(new_recipe(r.name, r.ranks, r.shape, r.assembled_dtype, tuple(pieces), r.transform, r.outputs))
    ignored = {views[n][0] if n in views else n for n in recipes.ignored}
    return RecipeSet(out, ignored, layout=recipes.layout, model=recipes.model, kept=recipes.kept)


def fused_expert_views(shapes: Mapping[str, tuple[int, ...]], model_type: str) -> dict[str, tuple[str, Box]]:
    """The views of a transformers-5 model whose experts are fused (``mlp.experts.gate_up_proj``
    ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) onto the per-expert checkpoint names
    vLLM's loader consumes, read from transformers' own checkpoint conversion mapping
    (``transformers.conversion_mapping``, the rules it loads such checkpoints with) for
    ``model_type`` (``config.model_type``, e.g. ``"qwen3_moe"``). ``shapes``: training tensor name
    -> global shape. Only converters made of ``MergeModulelist`` and ``Concatenate`` (pure slices)
    are turned into views; ValueError naming the converter for another operation on a tensor the
    model holds (a transpose or interleave is not a slice), or for a ``model_type`` transformers
    has no conversion for while ``shapes`` holds fused experts (a typo). ``{}`` when nothing is
    fused. Needs transformers (the ``vllm`` extra)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    convs = get_checkpoint_conversion_mapping(model_type) or []
    fused = sorted(n for n in shapes if n.endswith((".experts.gate_up_proj", ".experts.down_proj")))
    if not convs and fused:
        raise ValueError(f"model_type {model_type!r}: transformers has no checkpoint conversion for it, but the model "
                         f"holds fused experts ({fused[0]}, ...): check config.model_type, or declare the views by hand")
    out: dict[str, tuple[str, Box]] = {}
    for conv in convs:
        if not isinstance(conv, WeightConverter) or len(conv.target_patterns) != 1:
            continue
        target = conv.target_patterns[0]
        held = [n for n in shapes if n.endswith("." + target) or n.endswith("." + target + ".weight")
                or n.endswith(target)]
        if not held:
            continue
        ops = conv.operations
        if not all(isinstance(op, (MergeModulelist, Concatenate)) for op in ops) or not any(
                isinstance(op, MergeModulelist) and op.dim == 0 for op in ops):
            raise ValueError(f"{model_type}: {held[0]} is converted by {[type(op).__name__ for op in ops]}: not "
                             "slices of the checkpoint's tensors; declare its views by hand")
        cat = next((op.dim for op in ops if isinstance(op, Concatenate)), None)
        srcs = list(conv.source_patterns)
        for name in held:
            shape = shapes[name]
            prefix = name[: len(name) - len(target)] if name.endswith(target) else name.rsplit(target, 1)[0]
            parts = len(srcs)
            if cat is not None and shape[cat] % parts:
                raise ValueError(f"{name} {list(shape)}: dim {cat} does not split into {parts} parts")
            step = shape[cat] // parts if cat is not None else None
            for e in range(shape[0]):
                for i, pat in enumerate(srcs):
                    box = [(0, n) for n in shape]
                    box[0] = (e, e + 1)
                    if cat is not None:
                        box[cat] = (i * step, (i + 1) * step)
                    ck = (prefix + pat.replace("*", str(e))).replace("..", ".")
                    out[ck] = (name, tuple(box))
    return out
