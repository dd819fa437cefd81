"""Packed format 3 (chunk masks; :mod:`weight_transfer.delta.packed` has the record, the packer
and the landing region): an output's changes as 64-byte chunks with a byte mask each, found by
the native ``wt_masks`` (``_delta.c``) in one vector pass (:func:`changed_masks`), the
:class:`Masks` that carries them to the packer, and the index's size and its torch check and
byte positions for a receiver without the native kernel (:func:`masks_index_bytes`,
:func:`check_masks`).

The record: the format-2 header with its own magic, ``runs`` = the number ``m`` of changed
chunks (counted from the span's first byte, the last one clipped to the span), ``index bytes``
``8m + 4m`` rounded up to 8, ``unit`` 64; then ``m`` int64 byte masks (bit j: byte j of the
chunk), ``m`` uint32 chunk indices (ascending), padding, and the changed bytes in chunk and
byte order; spans at most ``MAX_SPAN_MASKS`` (2^38) bytes. Checked (indices ascending and inside
the span, no mask empty or reaching past the span's end, the masks' bytes equal to the data
bytes) before any byte is scattered. ~12 bytes of index per changed chunk instead of ~2 per run,
and no run extraction, varint or per-byte branch on either side: the format for a fast wire (the
cost model's choice, :meth:`weight_transfer.delta.cost.CostModel.pack_format`)."""
from __future__ import annotations

import ctypes

import torch

__all__ = ["Masks", "changed_masks", "check_masks", "masks_index_bytes"]


class Masks:
    """The changes of one output as 64-byte chunks counted from its first byte (packed format 3,
    :mod:`weight_transfer.delta.packed`): ``chunks`` int32 (ascending chunk indices), ``masks``
    int64 (bit j: byte j of that chunk changed), ``vals`` uint8 (the changed bytes in order,
    ``nbytes`` of them), ``runs`` the runs of adjacent changed bytes within chunks (for the
    report). ``len()`` is the number of changed chunks."""

    __slots__ = ("chunks", "masks", "vals", "nbytes", "runs", "mode", "data", "pending")

    def __init__(self, chunks: torch.Tensor, masks: torch.Tensor, vals: torch.Tensor, runs: int = 0):
        self.chunks, self.masks, self.vals = chunks, masks, vals
        self.nbytes, self.runs = vals.numel(), int(runs)
        self.mode = "packed"
        """The cost model's choice: ``"packed"`` (or ``"full"``)."""
        self.data = None
        """The output's bytes (flat uint8) the cost model saw, as :class:`weight_transfer.delta.runs.Runs` keeps them."""
        self.pending = None
        """``(out, shadow)`` when the fused pass left the output's pool slot unwritten (it only
        needs the changed bytes): :meth:`fill` copies the shadow, which then equals the output,
        into the slot before a whole write reads it."""

    def fill(self) -> None:
        """Write the output's pool slot from the shadow if the fused pass left it unwritten."""
        if self.pending is not None:
            out, shadow = self.pending
            out.copy_(shadow)
            self.pending = None

    def __len__(self) -> int:
        return self.chunks.numel()

    def __repr__(self) -> str:
        return f"Masks({len(self)} chunks, {self.nbytes} bytes, {self.runs} runs)"


def changed_masks(src: torch.Tensor, shadow: torch.Tensor, *, out: torch.Tensor | None = None,
                  max_chunks: int | None = None) -> Masks | None:
    """Compare an output with its ``shadow`` (flat uint8 CPU, the output's bytes) in 64-byte
    chunks at 1-byte granularity (``wt_masks``), copy the changed bytes into the shadow and return
    them as :class:`Masks`. ``src``: the output's bytes (flat uint8; with ``out`` also copied
    there), or a contiguous float32 tensor whose bf16 cast is the output (cast into ``out``,
    flat uint8 of 2 bytes per element, exactly as torch rounds; without ``out`` only compared,
    the shadow taking the changed bytes). None when more than ``max_chunks`` chunks changed (the
    shadow then equals the output) or a float32 source holds a NaN (cast by torch instead into
    ``out`` and the shadow, refreshed whole: written whole). ValueError without the native
    kernel or for arguments that do not fit."""
    from ..native.delta import KERNEL

    lib = KERNEL.lib()
    n = shadow.numel()
    kind = 1 if src.dtype == torch.float32 else 0
    if (lib is None or shadow.dtype != torch.uint8 or not shadow.is_contiguous() or not src.is_contiguous()
            or src.device.type != "cpu" or shadow.device.type != "cpu"
            or (out is not None and (out.dtype != torch.uint8 or not out.is_contiguous() or out.device.type != "cpu"))
            or (kind == 1 and ((out is not None and out.numel() != n) or 2 * src.numel() != n))
            or (kind == 0 and (src.dtype != torch.uint8 or src.numel() != n or (out is not None and out.numel() != n)))):
        raise ValueError("changed_masks: needs the native kernel, contiguous CPU tensors, a uint8 shadow of the "
                         "output's bytes, a uint8 source of the same length or a float32 source of half as many "
                         "elements, and an optional uint8 output of the shadow's length")
    cap = n // 64 + 1
    if max_chunks is not None:
        cap = max(0, min(cap, max_chunks))
    masks = torch.empty(cap + 1, dtype=torch.int64)
    chunks = torch.empty(cap + 1, dtype=torch.int32)
    vals = torch.empty(64 * (cap + 2), dtype=torch.uint8)
    nv, nr = ctypes.c_int64(0), ctypes.c_int64(0)
    k = lib.wt_masks(src.data_ptr(), n, kind, None if out is None else out.data_ptr(), shadow.data_ptr(),
                     masks.data_ptr(), chunks.data_ptr(), cap, vals.data_ptr(), ctypes.byref(nv), ctypes.byref(nr))
    if k == -2:  # a NaN: torch's own cast (its NaN bits depend on its code path), written whole
        shadow.view(torch.bfloat16).copy_(src)
        if out is not None:
            out.copy_(shadow)
        return None
    if k < 0:
        return None
    return Masks(chunks[:k], masks[:k], vals[:nv.value], nr.value)


def masks_index_bytes(chunks: int) -> int:
    """Index bytes of a format-3 record of ``chunks`` changed chunks: ``8 x chunks`` of masks and
    ``4 x chunks`` of chunk indices, rounded up to 8."""
    return 8 * chunks + -(-4 * chunks // 8) * 8


def _mask_positions(masks: torch.Tensor, chunks: torch.Tensor) -> torch.Tensor:
    """Byte offsets (int64, in order) that format-3 ``masks`` / ``chunks`` select (torch)."""
    bits = ((masks.unsqueeze(1) >> torch.arange(64, dtype=torch.int64)) & 1).bool()
    pos = (chunks.to(torch.int64) & 0xFFFFFFFF).unsqueeze(1) * 64 + torch.arange(64, dtype=torch.int64)
    return pos[bits]


def check_masks(masks: torch.Tensor, chunks: torch.Tensor, span: int) -> tuple[int, int, int]:
    """Check a format-3 index (int64 ``masks``, int32 ``chunks``) against a span of ``span``
    bytes as ``wt_check_masks`` does (torch): ``(bad, why, bytes)``, ``bad`` -1 when fine (then
    ``bytes`` the masks select), else the first bad chunk and its reason code (6, 7, 8:
    :data:`weight_transfer.delta.index.WHY`)."""
    c = chunks.to(torch.int64) & 0xFFFFFFFF  # uint32 on the wire
    nch = -(-span // 64)
    tail = span - 64 * (nch - 1)
    over = (masks & ~((1 << tail) - 1)) != 0 if tail < 64 else torch.zeros_like(masks, dtype=torch.bool)
    err = torch.zeros(c.numel(), dtype=torch.int64)
    err = torch.where(masks == 0, 8, err)
    err = torch.where((c >= nch) | ((c == nch - 1) & over), 7, err)
    if c.numel() > 1:
        err[1:] = torch.where(c[1:] <= c[:-1], 6, err[1:])
    bad = (err > 0).nonzero().flatten()
    if bad.numel():
        k = int(bad[0])
        return k, int(err[k]), 0
    return -1, 0, int(_mask_positions(masks, chunks).numel())
