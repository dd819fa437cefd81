"""What one training step changes in the served weights, at every granularity a delta update
could use.

For two versions of a checkpoint tensor (the weights as served: bf16 from the trainer's master,
and FP8 e4m3 after 128x128 block quantization when the engine serves FP8) this counts:

- ``bf16_elems``: bf16 elements whose bytes differ;
- ``bf16_rows``: 128-byte runs of the bf16 tensor (64 elements, the last one may be shorter)
  with any byte differing -- the granularity of a delta that writes whole cache lines;
- ``fp8_elems``: FP8 elements that differ after each version is block-quantized on its own
  (a scale that moves can change every element of its block even where bf16 did not change);
- ``fp8_rows``: 128-byte rows of FP8 (one row of one 128x128 block: 128 elements) differing;
- ``fp8_blocks``: whole 128x128 blocks (their 16 KiB of FP8 or their scale) differing;
- ``scales``: ``weight_scale_inv`` entries (float32, one per block) differing.

and the bytes a delta would carry at each granularity, index included (a 4-byte index per
element, row or block; :data:`INDEX_BYTES`): ``delta_bytes[g] = changed units x (unit bytes +
4)``, where a changed FP8 block or row also carries its block's 4-byte scale, and the FP8
element delta carries the changed scales. ``full_bytes`` is what a full update writes (bf16:
the tensor; FP8: elements plus scales).

Tensors of fewer than 2 dims (norms, biases) are never FP8 (the project's FP8 recipes quantize
2-D weights only, as DeepSeek-V3 checkpoints do): their FP8 counts are their bf16 ones.

Pure functions of tensors; no transfer code runs. Used by ``examples/rl_loop.py`` and
``weight-transfer changes`` (the measured tables in results/ and docs/DELTA.md).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from ..convert.quant import QUANT_BLOCK, quantize_fp8_block

__all__ = ["ChangeCounts", "tensor_kind", "count_changes", "changes_by_kind", "GRANULARITIES", "INDEX_BYTES", "KINDS"]

INDEX_BYTES = 4
"""Bytes of one index entry of a delta (a 32-bit offset of the element, row or block)."""
ROW_BYTES = 128
"""Bytes of one row of a row-granular delta (a 128-byte run: 64 bf16 or 128 FP8 elements)."""
GRANULARITIES = ("bf16_elems", "bf16_rows", "fp8_elems", "fp8_rows", "fp8_blocks")
"""Delta granularities :attr:`ChangeCounts.delta_bytes` is given for."""
KINDS = ("attention", "mlp", "experts", "router", "embeddings", "norms", "other")
"""Tensor kinds of :func:`tensor_kind` (embeddings include ``lm_head``)."""


def tensor_kind(name: str) -> str:
    """The kind of checkpoint tensor ``name`` (Hugging Face names): ``attention`` (q/k/v/o
    projections, MLA's low-rank projections), ``experts`` (routed and shared experts),
    ``router`` (``mlp.gate.weight``, its bias), ``mlp`` (dense MLP), ``embeddings``
    (``embed_tokens``, ``lm_head``), ``norms`` (any ``*norm*``), else ``other``."""
    if "norm" in name:
        return "norms"
    if "embed_tokens" in name or name.startswith("lm_head"):
        return "embeddings"
    if ".self_attn." in name:
        return "attention"
    if ".experts." in name or "shared_expert" in name:
        return "experts"
    if re.search(r"\.mlp\.gate\.(weight|e_score_correction_bias)$", name):
        return "router"
    if ".mlp." in name:
        return "mlp"
    return "other"


@dataclass
class ChangeCounts:
    """Counts of changed units between two versions (see the module docstring); adds up over
    tensors with ``+``. ``total`` holds the unit counts of the tensors (the denominators)."""

    changed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GRANULARITIES + ("scales",), 0))
    total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GRANULARITIES + ("scales",), 0))
    delta_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GRANULARITIES, 0))
    full_bytes: dict[str, int] = field(default_factory=lambda: {"bf16": 0, "fp8": 0})
    tensors: int = 0

    def __add__(self, o: ChangeCounts) -> ChangeCounts:
        def add(a, b):
            return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}
        return ChangeCounts(add(self.changed, o.changed), add(self.total, o.total), add(self.delta_bytes, o.delta_bytes),
                            add(self.full_bytes, o.full_bytes), self.tensors + o.tensors)

    def fraction(self, unit: str) -> float:
        """Changed / total for ``unit`` (one of :data:`GRANULARITIES` or ``"scales"``); 0 when empty."""
        return self.changed[unit] / self.total[unit] if self.total[unit] else 0.0

    def delta_ratio(self, g: str) -> float:
        """Bytes of a ``g`` delta over the full update's bytes (bf16 or FP8 as ``g`` says)."""
        full = self.full_bytes["bf16" if g.startswith("bf16") else "fp8"]
        return self.delta_bytes[g] / full if full else 0.0


def _row_changes(a: torch.Tensor, b: torch.Tensor, row_bytes: int) -> tuple[int, int]:
    """(changed, total) ``row_bytes`` runs of the flattened bytes of ``a`` vs ``b``."""
    ab = a.contiguous().view(-1).view(torch.uint8)
    bb = b.contiguous().view(-1).view(torch.uint8)
    n = ab.numel()
    rows = -(-n // row_bytes)
    diff = ab != bb
    pad = rows * row_bytes - n
    if pad:
        diff = torch.cat([diff, diff.new_zeros(pad)])
    return int(diff.view(rows, row_bytes).any(dim=1).sum()), rows


def _elem_changes(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements of ``a`` whose bytes differ from ``b``'s (same dtype and shape)."""
    isz = a.element_size()
    d = a.contiguous().view(-1).view(torch.uint8) != b.contiguous().view(-1).view(torch.uint8)
    return int(d.view(-1, isz).any(dim=1).sum())


def count_changes(old: torch.Tensor, new: torch.Tensor, *, fp8: bool = True, block: int = QUANT_BLOCK) -> ChangeCounts:
    """Changes between two versions of one tensor (same shape; any floating dtype: each is
    cast to bf16 first, as served). ``fp8``: also quantize both (128x128 blocks) and count FP8
    changes; tensors of fewer than 2 dims count bf16 only. ValueError for different shapes."""
    if tuple(old.shape) != tuple(new.shape):
        raise ValueError(f"count_changes: shapes {tuple(old.shape)} and {tuple(new.shape)} differ")
    a, b = old.detach().to(torch.bfloat16), new.detach().to(torch.bfloat16)
    c = ChangeCounts(tensors=1)
    n = a.numel()
    c.changed["bf16_elems"], c.total["bf16_elems"] = _elem_changes(a, b), n
    c.changed["bf16_rows"], c.total["bf16_rows"] = _row_changes(a, b, ROW_BYTES)
    c.delta_bytes["bf16_elems"] = c.changed["bf16_elems"] * (2 + INDEX_BYTES)
    c.delta_bytes["bf16_rows"] = c.changed["bf16_rows"] * (ROW_BYTES + INDEX_BYTES)
    c.full_bytes["bf16"] = 2 * n
    if not fp8 or a.dim() < 2:  # never FP8: the served bytes are the bf16 ones
        for g in ("fp8_elems", "fp8_rows", "fp8_blocks"):
            src = {"fp8_elems": "bf16_elems", "fp8_rows": "bf16_rows", "fp8_blocks": "bf16_rows"}[g]
            c.changed[g], c.total[g], c.delta_bytes[g] = c.changed[src], c.total[src], c.delta_bytes[src]
        c.full_bytes["fp8"] = 2 * n
        return c
    qa, sa = quantize_fp8_block(a, block)
    qb, sb = quantize_fp8_block(b, block)
    N, K = a.shape[-2], a.shape[-1]
    lead = a.numel() // (N * K)
    nb, kb = -(-N // block), -(-K // block)
    c.changed["fp8_elems"], c.total["fp8_elems"] = _elem_changes(qa, qb), n
    c.changed["scales"], c.total["scales"] = _elem_changes(sa, sb), sa.numel()
    # per element changed -> per (row of a block) and per block, padded to whole blocks
    d = (qa.view(torch.uint8) != qb.view(torch.uint8)).view(lead, N, K)
    dp = torch.zeros(lead, nb * block, kb * block, dtype=torch.bool)
    dp[:, :N, :K] = d
    rows = dp.view(lead, nb * block, kb, block).any(dim=3)  # [lead, N padded, kb]: one 128-element row of a block
    scale_changed = (sa.view(torch.int32) != sb.view(torch.int32)).view(lead, nb, kb)
    blocks = rows.view(lead, nb, block, kb).any(dim=2) | scale_changed
    real_rows = rows[:, :N, :]
    c.changed["fp8_rows"], c.total["fp8_rows"] = int(real_rows.sum()), real_rows.numel()
    c.changed["fp8_blocks"], c.total["fp8_blocks"] = int(blocks.sum()), blocks.numel()
    ns = c.changed["scales"]
    c.delta_bytes["fp8_elems"] = c.changed["fp8_elems"] * (1 + INDEX_BYTES) + ns * (4 + INDEX_BYTES)
    # a row or block carries its scale with it (the scale is what dequantizes it)
    c.delta_bytes["fp8_rows"] = c.changed["fp8_rows"] * (block + INDEX_BYTES) + ns * (4 + INDEX_BYTES)
    c.delta_bytes["fp8_blocks"] = c.changed["fp8_blocks"] * (block * block + 4 + INDEX_BYTES)
    c.full_bytes["fp8"] = n + 4 * sa.numel()
    return c


def changes_by_kind(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, fp8: bool = True,
                    names: Iterable[str] | None = None) -> dict[str, ChangeCounts]:
    """Per :func:`tensor_kind` (plus ``"all"``), the :class:`ChangeCounts` between two
    checkpoints (same names). KeyError names a tensor missing from ``new``."""
    out: dict[str, ChangeCounts] = {}
    for name in (names if names is not None else old):
        if name not in new:
            raise KeyError(f"changes_by_kind: {name!r} is not in the new version")
        c = count_changes(old[name], new[name], fp8=fp8)
        k = tensor_kind(name)
        out[k] = out[k] + c if k in out else c
        out["all"] = out["all"] + c if "all" in out else c
    return out
