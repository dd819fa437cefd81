"""Per-tensor and per-channel FP8 recipes from a loader trace (``"fp8_tensor"``, ``"fp8_channel"``).

An engine serving per-tensor FP8 (``InferenceLayout.quant == "fp8-tensor"``) or per-channel FP8
(``"fp8-channel"``) loads each quantized linear weight ``x.weight`` as ``float8_e4m3fn`` and its
float32 ``x.weight_scale`` from a checkpoint that stores both
(:mod:`weight_transfer.convert.quant_scaled`). The trace of that checkpoint form
(:func:`weight_transfer.engines.vllm.trace.fp8.trace_quantized`) says where each checkpoint
tensor's rows go (the weight's pieces) and where its scale goes (the scale's pieces):

- per-tensor: ``weight_scale`` is one value per logical shard (``qkv_proj``: ``[3]``, one slot
  per checkpoint tensor ``q_proj`` / ``k_proj`` / ``v_proj``; ``o_proj``: ``[1]``), each the
  checkpoint tensor's scalar scale, loaded whole on every TP rank;
- per-channel: ``weight_scale`` ``[N, 1]`` is sharded with the weight's rows; a row-parallel layer
  (``o_proj``, ``down_proj``: ``K`` split over the TP ranks) holds every row's whole scale.

A destination's scale needs more of the source than the destination holds wherever the TP
split cuts the scale's domain: every TP-sharded per-tensor weight (the whole checkpoint tensor),
and a per-channel weight whose columns are split (whole rows). Such a recipe **gathers**: it
assembles the destination's own elements in the leading corner of its assembled tensor and the
other rows / columns of the domain after them (the maximum over ``|x|`` does not depend on the
order), quantizes the whole, and writes the corner and the scale
(:func:`weight_transfer.convert.transforms.apply_transform`). :func:`scaled_gather_line` says how much
is gathered in the plan line.

MoE experts (a 3-D fused ``w13_weight`` / ``w2_weight``) are not planned under these two
quantizations: the planner refuses them naming the parameter.
"""
from __future__ import annotations

import math

from ..types import Box, new_output, new_piece

__all__ = ["SCALE", "scaled_kind", "scaled_parts", "scaled_gather_line"]

SCALE = "_scale"
"""A per-tensor / per-channel FP8 weight ``x.weight``'s scale is ``x.weight_scale`` (vLLM's
parameter and the checkpoint's tensor)."""
FP8, F32 = "float8_e4m3fn", "float32"


def scaled_kind(shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> str:
    """``"fp8_channel"`` when a weight of load shape ``shape`` has a ``[N, 1]`` scale of its own
    rows, ``"fp8_tensor"`` for a 1-D scale (one per logical shard), ``""`` for anything else."""
    if len(shape) == 2 and tuple(scale_shape) == (shape[0], 1):
        return "fp8_channel"
    if len(shape) == 2 and len(scale_shape) == 1:
        return "fp8_tensor"
    return ""


def _domain(own: Box, full: tuple[int, ...], axes) -> list[tuple[Box, Box]]:
    """``(source box, assembled box)`` pairs tiling the domain: ``own`` (a box of a source of shape
    ``full``) in the leading corner, then, along each dim in ``axes``, the source's other ranges
    (before and after ``own``) appended after it; dims not in ``axes`` keep ``own``'s range."""
    segs = []
    for d, ((a, b), n) in enumerate(zip(own, full)):
        if d in axes:
            rest = [(x, y) for x, y in ((0, a), (b, n)) if y > x]
            segs.append([(a, b)] + rest)
        else:
            segs.append([(a, b)])
    out = []

    def walk(d, src, dst):
        if d == len(segs):
            out.append((tuple(src), tuple(dst)))
            return
        at = 0
        for x, y in segs[d]:
            walk(d + 1, src + [(x, y)], dst + [(at, at + y - x)])
            at += y - x

    walk(0, [], [])
    return out


def scaled_parts(name: str, tp, scale, kind: str, quantized) -> tuple[list, str]:
    """The recipe parts of the FP8 weight ``name`` (its trace ``tp``, its scale's ``scale``, both
    :class:`~weight_transfer.plan.traced.TracedParam`) under ``kind`` (:func:`scaled_kind`):
    ``([(suffix, assembled shape, pieces, outputs)], "")``, one part per quantization domain
    (per-tensor: per checkpoint tensor; per-channel: the whole parameter when every piece is whole
    rows, else one per piece with its other columns gathered), each with two outputs, the weight
    (the assembled corner) and its scale; or ``([], why)`` when the trace does not fit the format
    (``quantized``: checkpoint name -> shape of the tensors loaded as FP8)."""
    scale_at = {}
    for p in scale.pieces:
        if p.source is None or p.source.removesuffix(SCALE) not in quantized:
            return [], f"{name}{SCALE} is filled from {p.source or 'zeros'}, not a quantized tensor's scale"
        scale_at.setdefault(p.source.removesuffix(SCALE), []).append(p)
    parts = []
    if kind == "fp8_channel":
        whole = all(p.source is not None and p.src_box[-1] == (0, quantized.get(p.source, (0, -1))[-1])
                    and p.dst_box[-1] == (0, tp.shape[-1]) for p in tp.pieces)
        want = sorted(((p.source + SCALE, (p.src_box[0], (0, 1)), (p.dst_box[0], (0, 1))) for p in tp.pieces
                       if p.source is not None), key=str)
        got = sorted(((p.source, tuple(p.src_box), tuple(p.dst_box)) for p in scale.pieces), key=str)
        if want != got:
            return [], f"vLLM loads {name}{SCALE} from other rows than its weight's (first: {(want or got)[0]})"
        if whole:
            outs = (new_output(name, tuple((0, n) for n in tp.shape), FP8),
                    new_output(name + SCALE, ((0, tp.shape[0]), (0, 1)), F32))
            return [("", tuple(tp.shape), tuple(tp.pieces), outs)], ""
    for p in tp.pieces:
        full = quantized.get(p.source) if p.source is not None else None
        if full is None or len(full) != 2 or len(p.src_box) != 2:
            return [], f"filled from {p.source or 'zeros'}, which the engine does not load as 2-D FP8"
        if kind == "fp8_tensor":
            sp = scale_at.get(p.source, [])
            if len(sp) != 1 or math.prod(b - a for a, b in sp[0].dst_box) != 1:
                return [], f"vLLM loads {len(sp)} scale value(s) of {p.source} into {name}{SCALE}, not one"
            if sum(q.source == p.source for q in tp.pieces) != 1:
                return [], f"{p.source} lands in {name} in several pieces (one per-tensor scale for all of them)"
            sbox, axes = sp[0].dst_box, (0, 1)
        else:
            sbox, axes = (p.dst_box[0], (0, 1)), (1,)
        pieces = tuple(new_piece(p.source, s, d) for s, d in _domain(p.src_box, full, axes))
        shape = tuple(full) if kind == "fp8_tensor" else (p.src_box[0][1] - p.src_box[0][0], full[1])
        outs = (new_output(name, tuple(p.dst_box), FP8), new_output(name + SCALE, tuple(sbox), F32))
        parts.append((f"<{p.source}>", shape, pieces, outs))
    return parts, ""


def _gathered(r) -> int:
    """Source elements recipe ``r`` assembles beyond what it writes (its gather)."""
    return math.prod(r.shape) - math.prod(b - a for a, b in r.outputs[0].box)


def scaled_gather_line(recipes) -> str:
    """The plan line's words for the per-tensor / per-channel FP8 recipes of ``recipes`` (a
    :class:`~weight_transfer.plan.RecipeSet`) that gather:
    ``"; FP8 per-tensor: 12 recipe(s) read the rest of their checkpoint tensor for its scale
    (1.2 MB of BF16 gathered per update)"`` (per-channel: ``... of their rows ...``), or ``""``
    when none does."""
    parts = []
    for kind, what in (("fp8_tensor", "per-tensor: {n} recipe(s) read the rest of their checkpoint tensor for its "
                        "scale"),
                       ("fp8_channel", "per-channel: {n} recipe(s) read the other columns of their rows for the "
                        "rows' scales")):
        g = [r for r in recipes if r.transform == kind and _gathered(r) > 0]
        if g:
            mb = sum(_gathered(r) * len(r.ranks) for r in g) * 2 / 1e6
            parts.append(f"; FP8 {what.format(n=len(g))} ({mb:.1f} MB of BF16 gathered per update; e.g. {g[0].name})")
    return "".join(parts)
