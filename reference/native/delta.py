"""The native delta kernel (``_delta.c``): built once per machine, its functions' ctypes
signatures declared (:data:`KERNEL`; :mod:`weight_transfer.delta.runs` re-exports it). A module of its
own so that :mod:`weight_transfer.delta.masks` and :mod:`weight_transfer.delta.runs` both use it
without importing each other."""
from __future__ import annotations

import ctypes
from pathlib import Path

from .build import NativeKernel

__all__ = ["KERNEL"]


def _declare(lib: ctypes.CDLL) -> None:
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.wt_delta_runs.argtypes = [P, P, I, I, I, P, P, I, P, P, P]
    lib.wt_delta_runs.restype = I
    lib.wt_check_segments.argtypes = [P, P, I, I, P]
    lib.wt_check_segments.restype = I
    lib.wt_scatter.argtypes = [P, P, P, P, I]
    lib.wt_scatter.restype = I
    lib.wt_copy_pieces.argtypes = [I, P, P, P, I]
    lib.wt_copy_pieces.restype = I
    lib.wt_cma_write.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, P, P, I, P, P]
    lib.wt_cma_write.restype = I
    lib.wt_index_bytes.argtypes = [P, P, I, I, I]
    lib.wt_index_bytes.restype = I
    lib.wt_pack_runs.argtypes = [P, P, P, I, I, P, P]
    lib.wt_pack_runs.restype = I
    lib.wt_pack_runs_v.argtypes = [P, P, P, P, I, I, P, P]
    lib.wt_pack_runs_v.restype = I
    lib.wt_check_packed.argtypes = [P, I, I, I, I, P, P]
    lib.wt_check_packed.restype = I
    lib.wt_unpack.argtypes = [P, P, I, P, I, I, I]
    lib.wt_unpack.restype = I
    lib.wt_cast_bf16_delta.argtypes = [P, I, P, P, I, I, P, P, I, P, P, P]
    lib.wt_cast_bf16_delta.restype = I
    lib.wt_copy_delta.argtypes = [P, I, P, P, I, I, P, P, I, P, P, P]
    lib.wt_copy_delta.restype = I
    lib.wt_masks.argtypes = [P, I, I, P, P, P, P, I, P, P, P]
    lib.wt_masks.restype = I
    lib.wt_check_masks.argtypes = [P, P, I, I, P, P]
    lib.wt_check_masks.restype = I
    lib.wt_unpack_masks.argtypes = [P, P, P, I, P, I, I]
    lib.wt_unpack_masks.restype = I
    lib.wt_copy_unpack_masks.argtypes = [P, P, P, P, I, P, I, I]
    lib.wt_copy_unpack_masks.restype = I
    lib.wt_pack_masks.argtypes = [P, P, P, I, P, I]
    lib.wt_pack_masks.restype = I
    lib.wt_masks_isa.argtypes = []
    lib.wt_masks_isa.restype = ctypes.c_char_p


_CFLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-std=c11")
KERNEL = NativeKernel(Path(__file__).with_name("_delta.c"), stem="delta", env="WT_DELTA_NATIVE",
                      flag_sets=(_CFLAGS, tuple(f for f in _CFLAGS if f != "-march=native")), declare=_declare)
"""The native comparison and segment writers (``_delta.c``; ``WT_DELTA_NATIVE=0`` disables it:
the comparison then runs in torch and segments are posted one op each)."""
