"""The delta comparison fused into the pass that already reads every byte: the prepare stage's
fp32 -> bf16 cast, or its bf16 copy (``ExecutorOptions.delta_fused``, default on).

Without it a delta update reads each output twice more after building it: the cast writes the
output into its pool slot, then the write stage's comparison (:func:`weight_transfer.delta.runs.changed_runs_native`)
reads the slot and the shadow. Fused (``_delta.c``, ``wt_cast_bf16_delta`` / ``wt_copy_delta``),
one native pass per output reads the source, rounds fp32 to bf16 exactly as torch does (nearest
even; an output holding a NaN is cast by torch instead and written whole) or copies bf16 as is,
writes the output into its slot and compares it with the shadow 4 KiB at a time while those
bytes are in L1, copies the changed blocks into the shadow and emits the runs (with their packed
index size and, when the delta may pack, the bytes of every run of at most 8 bytes, so that
packing does not read the output again); the write stage then only chooses the mode and packs
(:meth:`weight_transfer.delta.runs.DeltaState.runs` takes the runs from
:attr:`~weight_transfer.delta.runs.DeltaState.fused`). Memory traffic per bf16 element from fp32:
fused 4 (read fp32) + 2 (write) + 2 (read shadow) bytes, separate 4 + 2 + 2 + 2 -- the output is
not read again.

With packed format 3 (:attr:`weight_transfer.delta.runs.DeltaState.format` ``"masks"``) the same
place runs ``wt_masks`` instead (:func:`_fused_masks`): one vector pass casts (or reads), compares
64 bytes at a time, takes each changed chunk's mask and bytes and updates the shadow, and does
**not** write the output into its slot -- a packed record needs only the changed bytes; an output
that goes whole after all has its slot filled from the shadow (which then equals it) first
(:meth:`weight_transfer.delta.runs.Masks.fill`). Memory traffic per bf16 element from fp32: 4 (read)
+ 2 (read shadow), plus the changed bytes.

Where it applies: an assignment whose recipe is a ``copy`` with one identity-layout bfloat16
output whose pieces are bands of whole rows (one piece filling the output, or a fused
``qkv_proj`` / ``gate_up_proj`` of row bands: each band is cast or copied and compared in place
and their runs joined), each a contiguous slice of a source that is float32 (the RL loop's fp32
master into a bf16 engine) or bfloat16 with a bfloat16 assembly (a bf16 training copy, a
replayed bf16 step), built in a pool slot, on the CPU, in a delta (not full) update, with the
native kernel and a block size dividing 4096. Everything else (FP8 block quantization, layouts,
pieces that are not whole-row bands) keeps the separate comparison.
"""
from __future__ import annotations

import ctypes
import time

import torch

__all__ = ["cast_bf16_delta", "fuse"]


def cast_bf16_delta(src: torch.Tensor, out: torch.Tensor, shadow: torch.Tensor, granularity: int = 8,
                    merge_gap: int = 0, max_runs: int | None = None, inline: bool = False):
    """Cast contiguous float32 CPU ``src`` into ``out`` (flat uint8, 2 bytes per element; a
    bfloat16 ``src`` is copied: ``wt_copy_delta``), compare with ``shadow`` (flat uint8, same
    length) in ``granularity``-byte blocks, update the shadow and return the
    :class:`weight_transfer.delta.runs.Runs`; None when there would be more than ``max_runs`` (the
    cast and the shadow are still complete). The runs carry their packed index bytes and, with
    ``inline``, their values (:func:`weight_transfer.delta.runs.changed_runs_native`). ValueError
    when the native kernel is unavailable or the arguments do not fit (the caller then casts and
    compares separately)."""
    from .runs import _EMPTY, KERNEL, Runs, _native_runs

    lib = KERNEL.lib()
    n = src.numel()
    if (lib is None or src.dtype not in (torch.float32, torch.bfloat16) or not src.is_contiguous()
            or src.device.type != "cpu" or out.numel() != 2 * n or shadow.numel() != 2 * n or 4096 % granularity):
        raise ValueError("cast_bf16_delta: needs the native kernel, contiguous float32 or bfloat16 CPU input, "
                         "2-byte outputs and a block size dividing 4096")
    if n == 0:
        return Runs(_EMPTY, _EMPTY, 0)
    cap = (2 * n + granularity - 1) // granularity // 2 + 1 + (merge_gap == 0)
    if max_runs is not None:
        cap = min(cap, max_runs)
    st = torch.empty(cap, dtype=torch.int64)
    ln = torch.empty(cap, dtype=torch.int64)
    vals = torch.empty(cap, dtype=torch.int64) if inline else None
    tot, ixb = ctypes.c_int64(0), ctypes.c_int64(0)
    fn, size = (lib.wt_cast_bf16_delta, n) if src.dtype == torch.float32 else (lib.wt_copy_delta, 2 * n)
    m = fn(src.data_ptr(), size, out.data_ptr(), shadow.data_ptr(), granularity, merge_gap, st.data_ptr(),
           ln.data_ptr(), cap, ctypes.byref(tot), None if vals is None else vals.data_ptr(), ctypes.byref(ixb))
    if m == -2:  # a NaN: torch's own cast (its NaN bits depend on its code path), written whole
        out.view(torch.bfloat16).copy_(src)
        shadow.copy_(out)
        return None
    if m < 0:
        return None
    return _native_runs(st, ln, vals, m, tot.value, granularity, ixb.value)


def fuse(delta, task, index: int, full: dict, into: list) -> dict[int, list[torch.Tensor]]:
    """In the prepare stage of task ``index``: build every output the fused pass applies to
    (the module docstring) into its pool slot, its runs into ``delta.fused``; those
    assignments' entries of ``into`` (:meth:`weight_transfer.pipeline.memory.RegisteredMemory.buffers`)
    become :data:`weight_transfer.convert.transforms.DIRECT` (nothing left to build). Returns assignment
    index -> its outputs (typed views of the slots), to put in place of what
    :func:`weight_transfer.pipeline.tasks.prepare_outputs` returns for them. ``{}`` when ``delta`` is
    None, full, or fusing is off."""
    from ..convert.layouts import IDENTITY
    from ..convert.transforms import DIRECT
    from .runs import KERNEL

    if delta is None or delta.full or not getattr(delta, "fuse", True) or KERNEL.lib() is None:
        return {}
    out: dict[int, list[torch.Tensor]] = {}
    t0 = time.perf_counter()
    for ai, (a, bufs) in enumerate(zip(task.assignments, into)):
        rec = a.recipe
        if (bufs is None or bufs is DIRECT or len(bufs) != 1 or bufs[0] is None or rec.transform != "copy"
                or len(rec.outputs) != 1 or rec.outputs[0].layout != IDENTITY or rec.outputs[0].dtype != "bfloat16"
                or rec.assembled_dtype not in ("float32", "bfloat16")):
            continue
        at = delta._at.get((index, ai, 0))
        if at is None or at[1] != bufs[0].numel():
            continue
        try:
            bands = _bands(rec, full, delta.granularity)
        except (KeyError, IndexError, RuntimeError, ValueError):
            continue
        if bands is None:
            continue
        off, n = at
        packs = delta.packer is not None and delta.packer.nbytes > 0
        try:
            if getattr(delta, "format", "runs") == "masks" and packs and delta.cost.mode != "scattered":
                runs = _fused_masks(bands, bufs[0], delta.shadow[off:off + n], delta.cost.max_chunks(n))
            else:
                runs = _fused_bands(bands, bufs[0], delta.shadow[off:off + n], delta,
                                    delta.cost.max_runs(n, packs), packs and delta.cost.mode != "scattered")
        except ValueError:
            continue
        delta.fused[(index, ai, 0)] = False if runs is None else runs
        into[ai] = DIRECT
        out[ai] = [bufs[0].view(torch.bfloat16).view(tuple(rec.shape))]
    delta.fused_s = getattr(delta, "fused_s", 0.0) + time.perf_counter() - t0
    return out


def _bands(rec, full: dict, granularity: int) -> list[tuple[int, torch.Tensor]] | None:
    """The recipe's pieces as ``[(byte offset in the bf16 output, flat contiguous float32 or
    bfloat16 CPU source slice)]`` when every piece is a band of whole rows of the output (its
    ``dst_box`` spans every dimension but the first: one piece filling the output, or a fused
    ``qkv_proj`` / ``gate_up_proj`` of row bands), each starting on a compare block, together
    tiling the output in order, and a bfloat16 source is assembled as bfloat16 (a copy; through
    float32 torch would make a NaN's payload canonical); None otherwise."""
    ok_dtypes = (torch.float32, torch.bfloat16) if rec.assembled_dtype == "bfloat16" else (torch.float32,)
    shape = tuple(rec.shape)
    if len(shape) < 1:
        src = _whole_piece(rec, full)
        ok = src is not None and src.dtype in ok_dtypes and src.is_contiguous() and src.device.type == "cpu"
        return [(0, src.reshape(-1))] if ok else None
    row = 1
    for d in shape[1:]:
        row *= d
    out, at = [], 0
    for p in sorted(rec.pieces, key=lambda p: p.dst_box[0][0] if p.dst_box else 0):
        if p.source is None or len(p.dst_box) != len(shape):
            return None
        (a, b), rest = p.dst_box[0], p.dst_box[1:]
        if (a * row != at or any(lo != 0 or hi != d for (lo, hi), d in zip(rest, shape[1:]))
                or (2 * a * row) % granularity):
            return None
        src = full[p.source][tuple(slice(x, y) for x, y in p.src_box)]
        if (src.dtype not in ok_dtypes or not src.is_contiguous() or src.device.type != "cpu"
                or src.numel() != (b - a) * row):
            return None
        out.append((2 * a * row, src.reshape(-1)))
        at = b * row
    return out if out and at == row * shape[0] else None


def _fused_bands(bands, out: torch.Tensor, shadow: torch.Tensor, delta, max_runs: int | None, inline: bool):
    """Cast + compare each band of ``bands`` (:func:`_bands`) into its slice of ``out`` and
    ``shadow`` (flat uint8) and join their runs into the output's: offsets shifted, the packed
    index's byte count corrected for each band's first gap (counted from the previous band's
    last run instead of the band's start). None when the output has more than ``max_runs`` runs
    or a band holds a NaN (every band is still cast and its shadow refreshed: the output is then
    written whole). ValueError as :func:`cast_bf16_delta`."""
    from .runs import _EMPTY, Runs

    g = delta.granularity
    parts, whole = [], False
    for boff, src in bands:
        nb = 2 * src.numel()
        r = cast_bf16_delta(src, out[boff:boff + nb], shadow[boff:boff + nb], g, delta.merge_gap,
                            max_runs=0 if whole else max_runs, inline=inline)
        if r is None:
            whole = True
        elif len(r):
            parts.append((boff, r))
    if whole:
        return None
    if not parts:
        return Runs(_EMPTY, _EMPTY, 0)
    if len(parts) == 1 and parts[0][0] == 0:
        return parts[0][1]
    st = torch.cat([r.starts + b for b, r in parts])
    if max_runs is not None and st.numel() > max_runs:
        return None
    joined = Runs(st, torch.cat([r.lens for _, r in parts]), sum(r.nbytes for _, r in parts))
    ix, prev = 0, 0
    for b, r in parts:
        first = int(r.starts[0])
        ix += r.index[2] - _vlen_int(first // g) + _vlen_int((b + first - prev) // g)
        prev = b + int(r.starts[-1]) + int(r.lens[-1])
    joined.index = (g, g, ix)
    joined.vals = torch.cat([r.vals for _, r in parts]) if inline else None
    return joined


def _fused_masks(bands, out: torch.Tensor, shadow: torch.Tensor, max_chunks: int | None):
    """As :func:`_fused_bands` for packed format 3 (:func:`weight_transfer.delta.runs.changed_masks`):
    each band cast (or read) and compared with its slice of ``shadow`` in 64-byte chunks, the
    shadow taking the changed bytes, the bands' chunks joined (indices shifted by each band's
    offset / 64). The pool slot ``out`` is not written: a packed record needs only the changed
    bytes, and a whole write fills it from the shadow first (:meth:`weight_transfer.delta.runs.Masks.fill`;
    saves a write of every output byte). Every band must start on a 64-byte chunk (checked
    before any byte moves: ValueError, and the caller compares separately). None when more than
    ``max_chunks`` chunks changed or a band holds a NaN (every band is still cast, its shadow
    refreshed and ``out`` written from it: written whole)."""
    from .runs import Masks, changed_masks

    if any(boff % 64 for boff, _ in bands):
        raise ValueError("a band does not start on a 64-byte chunk")
    parts, whole = [], False
    for boff, src in bands:
        nb = 2 * src.numel()
        s = src if src.dtype == torch.float32 else src.view(torch.uint8)
        r = changed_masks(s, shadow[boff:boff + nb], max_chunks=0 if whole else max_chunks)
        if r is None:
            whole = True
        elif len(r):
            parts.append((boff, r))
    if not whole:
        if len(parts) == 1 and parts[0][0] == 0:
            got = parts[0][1]
        elif not parts:
            got = Masks(torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64),
                        torch.empty(0, dtype=torch.uint8))
        else:
            got = Masks(torch.cat([r.chunks + b // 64 for b, r in parts]), torch.cat([r.masks for _, r in parts]),
                        torch.cat([r.vals for _, r in parts]), sum(r.runs for _, r in parts))
        if max_chunks is None or len(got) <= max_chunks:
            got.pending = (out, shadow)
            return got
    out.copy_(shadow)  # every band's shadow now equals its output: written whole
    return None


def _vlen_int(v: int) -> int:
    """LEB128 bytes of ``v`` >= 0."""
    return max(1, (v.bit_length() + 6) // 7)


def _whole_piece(rec, full: dict):
    """The source slice of a one-piece recipe whose piece fills the whole output (``dst_box`` the
    recipe's shape), as a tensor of the output's element count; None otherwise. Assembling it
    is ``dst.copy_(src)`` (a cast to the assembled dtype, then to the output's: with both
    bfloat16 or the output bfloat16 from float32, one round to nearest even)."""
    (p,) = rec.pieces
    if p.source is None or any(a != 0 or b != n for (a, b), n in zip(p.dst_box, rec.shape)):
        return None
    src = full[p.source][tuple(slice(a, b) for a, b in p.src_box)]
    n = 1
    for d in rec.shape:
        n *= d
    return src if src.numel() == n else None
