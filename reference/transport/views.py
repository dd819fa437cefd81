"""Views of this process's memory as ``uint8`` tensors: a raw address range
(:func:`span_view`) and the allocations behind a set of tensors (:func:`storage_parts`, the parts
of one registered region). Used by the receiving side (:mod:`weight_transfer.api.receiver`, the
packed-delta commit in :mod:`weight_transfer.delta.packed`, the vLLM worker's region)."""
from __future__ import annotations

import ctypes

import torch

__all__ = ["span_view", "storage_parts"]


def span_view(base: int, length: int) -> torch.Tensor:
    """A ``uint8`` CPU tensor viewing ``[base, base + length)`` of this process's memory in
    place (no copy; the caller keeps the memory alive)."""
    import numpy as np

    buf = (ctypes.c_uint8 * length).from_address(base)
    view = torch.from_numpy(np.ctypeslib.as_array(buf))
    view._wt_buffer = buf  # type: ignore[attr-defined] -- keep the ctypes object alive with the view
    return view


def storage_parts(tensors) -> list[torch.Tensor]:
    """The memory of ``tensors`` as one ``uint8`` view per storage (allocation), covering that
    storage's tensors from the lowest first byte to the highest last, in address order (each view
    keeps its storage alive): the parts of one region
    (:meth:`weight_transfer.transport.base.Transport.register_parts`). One storage gives one part.
    On a GPU each storage is its own allocation, which no one tensor can span; on the CPU the same
    parts make one region too (the transport registers their span)."""
    by: dict[tuple[str, int], list] = {}
    for t in tensors:
        n = t.numel() * t.element_size()
        st = t.untyped_storage()
        lo_hi = by.setdefault((str(t.device), st.data_ptr()), [st, t.data_ptr(), t.data_ptr() + n])
        lo_hi[1], lo_hi[2] = min(lo_hi[1], t.data_ptr()), max(lo_hi[2], t.data_ptr() + n)
    parts = []
    for st, lo, hi in sorted(by.values(), key=lambda v: v[1]):
        whole = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (st.nbytes(),), (1,))
        start = lo - st.data_ptr()
        parts.append(whole[start:start + (hi - lo)])
    return parts
