"""The delta comparison fused into the pass that already reads every byte: the prepare stage's
fp32 -> bf16 cast (``ExecutorOptions.delta_fused``, default on).

Without it a delta update reads each output twice more after building it: the cast writes the
output into its pool slot, then the write stage's comparison (:func:`weight_transfer.delta.changed_runs_native`)
reads the slot and the shadow. Fused (``_delta.c``, ``wt_cast_bf16_delta``), one native pass
per output reads the fp32 source, rounds to bf16 exactly as torch does (nearest even; an
output holding a NaN is cast by torch instead and written whole), writes the output into its slot and compares it with the shadow 4 KiB at a time while
those bytes are in L1, copies the changed blocks into the shadow and emits the runs; the write
stage then only chooses the mode and packs (:meth:`weight_transfer.delta.DeltaState.runs` takes
the runs from :attr:`~weight_transfer.delta.DeltaState.fused`). Memory traffic per bf16 element:
fused 4 (read fp32) + 2 (write) + 2 (read shadow) bytes, separate 4 + 2 + 2 + 2 -- the output is
not read again.

Where it applies: an assignment whose recipe is a ``copy`` with one identity-layout bfloat16
output made of one piece that fills it, a contiguous float32 slice of one source (a plain cast
of a parameter or of a row band of it: what the RL loop's fp32 master sends to a bf16 engine), built
in a pool slot, on the CPU, in a delta (not full) update, with the native kernel and a block
size dividing 4096. Everything else (fused projections, FP8 quantization, layouts) keeps the
separate comparison. Not fused yet: FP8 block quantization (the quantizer would compare its
output block by block the same way).
"""
from __future__ import annotations

import ctypes
import time

import torch

__all__ = ["cast_bf16_delta", "fuse"]


def cast_bf16_delta(src: torch.Tensor, out: torch.Tensor, shadow: torch.Tensor, granularity: int = 8,
                    merge_gap: int = 0, max_runs: int | None = None):
    """Cast contiguous float32 CPU ``src`` into ``out`` (flat uint8, 2 bytes per element),
    compare with ``shadow`` (flat uint8, same length) in ``granularity``-byte blocks, update the
    shadow and return the :class:`weight_transfer.delta.Runs`; None when there would be more
    than ``max_runs`` (the cast and the shadow are still complete). ValueError when the native
    kernel is unavailable or the arguments do not fit (the caller then casts and compares
    separately)."""
    from .delta import _EMPTY, KERNEL, Runs

    lib = KERNEL.lib()
    n = src.numel()
    if (lib is None or src.dtype != torch.float32 or not src.is_contiguous() or src.device.type != "cpu"
            or out.numel() != 2 * n or shadow.numel() != 2 * n or 4096 % granularity):
        raise ValueError("cast_bf16_delta: needs the native kernel, contiguous float32 CPU input, 2-byte outputs "
                         "and a block size dividing 4096")
    if n == 0:
        return Runs(_EMPTY, _EMPTY, 0)
    cap = (2 * n + granularity - 1) // granularity // 2 + 1 + (merge_gap == 0)
    if max_runs is not None:
        cap = min(cap, max_runs)
    st = torch.empty(cap, dtype=torch.int64)
    ln = torch.empty(cap, dtype=torch.int64)
    tot = ctypes.c_int64(0)
    m = lib.wt_cast_bf16_delta(src.data_ptr(), n, out.data_ptr(), shadow.data_ptr(), granularity, merge_gap,
                               st.data_ptr(), ln.data_ptr(), cap, ctypes.byref(tot))
    if m == -2:  # a NaN: torch's own cast (its NaN bits depend on its code path), written whole
        out.view(torch.bfloat16).copy_(src)
        shadow.copy_(out)
        return None
    if m < 0:
        return None
    return Runs(st[:m], ln[:m], tot.value)


def fuse(delta, task, index: int, full: dict, into: list) -> dict[int, list[torch.Tensor]]:
    """In the prepare stage of task ``index``: build every output the fused pass applies to
    (the module docstring) into its pool slot, its runs into ``delta.fused``; those
    assignments' entries of ``into`` (:meth:`weight_transfer.memory.RegisteredMemory.buffers`)
    become :data:`weight_transfer.tasks.DIRECT` (nothing left to build). Returns assignment
    index -> its outputs (typed views of the slots), to put in place of what
    :func:`weight_transfer.tasks.prepare_outputs` returns for them. ``{}`` when ``delta`` is
    None, full, or fusing is off."""
    from .delta import KERNEL
    from .layouts import IDENTITY
    from .tasks import DIRECT

    if delta is None or delta.full or not getattr(delta, "fuse", True) or KERNEL.lib() is None:
        return {}
    out: dict[int, list[torch.Tensor]] = {}
    t0 = time.perf_counter()
    for ai, (a, bufs) in enumerate(zip(task.assignments, into)):
        rec = a.recipe
        if (bufs is None or bufs is DIRECT or len(bufs) != 1 or bufs[0] is None or rec.transform != "copy"
                or len(rec.outputs) != 1 or rec.outputs[0].layout != IDENTITY or rec.outputs[0].dtype != "bfloat16"
                or rec.assembled_dtype not in ("float32", "bfloat16") or len(rec.pieces) != 1):
            continue
        at = delta._at.get((index, ai, 0))
        if at is None or at[1] != bufs[0].numel():
            continue
        try:
            src = _whole_piece(rec, full)
        except (KeyError, IndexError, RuntimeError, ValueError):
            continue
        if src is None or src.dtype != torch.float32 or not src.is_contiguous() or src.device.type != "cpu":
            continue
        off, n = at
        shadow = delta.shadow[off:off + n]
        try:
            runs = cast_bf16_delta(src.reshape(-1), bufs[0], shadow, delta.granularity, delta.merge_gap,
                                   max_runs=delta.cost.max_runs(n, delta.packer is not None and delta.packer.nbytes > 0))
        except ValueError:
            continue
        delta.fused[(index, ai, 0)] = False if runs is None else runs
        into[ai] = DIRECT
        out[ai] = [bufs[0].view(torch.bfloat16).view(tuple(rec.shape))]
    delta.fused_s = getattr(delta, "fused_s", 0.0) + time.perf_counter() - t0
    return out


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
