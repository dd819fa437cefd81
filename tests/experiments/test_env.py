"""The machine facts printed beside every table (experiments/env.py)."""
from __future__ import annotations

import torch

from weight_transfer.experiments import env


def test_memcpy_floor_is_one_thread_and_leaves_the_callers_threads(monkeypatch):
    """The footer's "memcpy (same run, 1 thread)": torch splits a 256 MiB copy over its intra-op
    threads, so the measurement pins one thread while it copies and restores the caller's."""
    seen = []
    real_copy = torch.Tensor.copy_

    def copy_(self, src, *a, **k):
        seen.append(torch.get_num_threads())
        return real_copy(self, src, *a, **k)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        gbps = env.measure_memcpy_gbps(nbytes=1 << 20, repeats=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert gbps > 0 and seen == [1, 1, 1]  # the warm-up copy and the two timed ones
