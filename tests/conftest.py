"""Shared markers and fixtures.

Hardware and optional-package markers skip in one place, with the reason printed by ``-ra``,
instead of every module repeating its own ``skipif``:

- ``gpu``: needs a CUDA GPU and a CUDA build of torch;
- ``rdma``: needs pyverbs and an RDMA device (``ibv_get_device_list`` non-empty);
- ``nixl``: needs NIXL's Python package (``nixl``, ``nixl_cu12`` or ``nixl_cu13``; ``pip install -e .[nixl]``);
- ``vllm``: needs the ``vllm`` package (``make vllm``);
- ``triton``: needs the ``triton`` package (run on CPU with ``TRITON_INTERPRET=1``);
- ``trl``: needs Hugging Face TRL (``pip install -e .[trl]``; ``make vllm`` installs it);
- ``slurm``: needs a SLURM cluster: ``sbatch`` on PATH and ``sinfo`` showing an idle (or
  partly allocated) node (``bash scripts/slurm_local.sh start`` makes one on this machine).

A marked test never fakes its hardware: it runs where the thing exists and is skipped, with
the reason, where it does not.
"""
from __future__ import annotations

import functools
import importlib.util

import pytest


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _no_cuda_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU and a CUDA build of torch"
    return None


@functools.cache
def _no_rdma_reason() -> str | None:
    if not _has("pyverbs"):
        return "pyverbs not installed (pip install -e .[rdma])"
    try:
        import pyverbs.device as d

        if not d.get_device_list():
            return "no RDMA device found"
    except Exception as e:  # pyverbs raises its own error types when rdma-core finds no kernel support
        return f"no RDMA device usable: {e}"
    return None


@functools.cache
def _no_slurm_reason() -> str | None:
    import shutil
    import subprocess

    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "no SLURM cluster: sbatch/sinfo not on PATH (bash scripts/slurm_local.sh start)"
    try:
        p = subprocess.run(["sinfo", "-h", "-t", "idle,mix", "-o", "%N"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError) as e:
        return f"no SLURM cluster: sinfo failed ({e})"
    if p.returncode != 0:
        why = p.stderr.strip().splitlines() or [f"exit status {p.returncode}"]
        return f"no SLURM cluster: sinfo failed ({why[-1]})"
    if not p.stdout.strip():
        return "no idle SLURM node (sinfo; bash scripts/slurm_local.sh start)"
    return None


_REASONS = {
    "gpu": _no_cuda_reason,
    "rdma": _no_rdma_reason,
    "nixl": lambda: (None if _has("nixl") or _has("nixl_cu12") or _has("nixl_cu13")
                     else "nixl not installed (pip install -e .[nixl])"),
    "vllm": lambda: None if _has("vllm") else "vllm not installed (make vllm)",
    "triton": lambda: None if _has("triton") else "triton not installed (pip install -e .[triton])",
    "trl": lambda: None if _has("trl") else "trl not installed (pip install -e .[trl]; make vllm)",
    "slurm": _no_slurm_reason,
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for name, reason_fn in _REASONS.items():
            if item.get_closest_marker(name) is not None:
                why = reason_fn()
                if why:
                    item.add_marker(pytest.mark.skip(reason=why))
                    break
