"""Where a measurement was taken: host, versions, git commit, and this machine's memcpy
bandwidth. Imported by the trial runner, the benchmarks and the simulation (which must not
import the trial runner)."""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import time

import torch


def git_sha() -> str:
    """Short hash of the checkout's HEAD, or ``"unknown"`` (no git, not a checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__), timeout=5).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def environment() -> dict:
    """Host, torch, python, CPU count, platform and git commit of this process."""
    return {
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(terse=True),
        "git_sha": git_sha(),
    }


def measure_memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    """Best-of-``repeats`` single-thread torch copy bandwidth, GB/s (1e9 B/s)."""
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9
