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
    """Best-of-``repeats`` single-thread torch copy bandwidth of ``nbytes`` bytes, GB/s
    (1e9 B/s). torch splits a copy this large over its intra-op threads (``parallel_for``), so
    the copy runs with ``torch.set_num_threads(1)`` and the caller's setting is restored after:
    unpinned, the controller's copy used every core (2 here) and the floor moved between
    16 and 32 GB/s from one run to the next on a 2-core VM where one thread gave 16.6-18.7."""
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        b.copy_(a)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            b.copy_(a)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return nbytes / best / 1e9
