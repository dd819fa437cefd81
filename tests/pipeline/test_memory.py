"""The memory the writes read from, registered once (weight_transfer.pipeline.memory): the output pool's
ring (chunks in admission order, out-of-order give-backs, waiting, a chunk as large as the pool
alone). The executor's use of it (no registration inside an update, C17 with pooled buffers, a
task larger than the watermark or the pool) is tested in tests/pipeline/test_executor.py."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from weight_transfer.pipeline.memory import POOL_ALIGN, OutputPool


def test_output_pool_ring():
    assert POOL_ALIGN == 64
    pool = OutputPool(torch.zeros(100, dtype=torch.uint8), None)
    a, b = pool.acquire(40), pool.acquire(40)
    assert (a, b) == (0, 40) and pool.in_use == 80
    ab = threading.Event()
    ab.set()
    with pytest.raises(RuntimeError, match="aborted while waiting for output pool space"):
        pool.acquire(30, ab)  # 20 left at the end, 0 at the start
    pool.release(0, 40)
    c = pool.acquire(30)  # wraps to the start
    assert c == 0
    pool.release(0, 30)  # out of order: reclaimed once the earlier chunk (at 40) is given back
    assert pool._fit(60) is None
    pool.release(40, 40)
    assert pool.in_use == 0 and pool.acquire(100) == 0  # a chunk as large as the pool, alone
    got = []
    th = threading.Thread(target=lambda: got.append(pool.acquire(10)))
    th.start()
    time.sleep(0.1)
    assert not got  # waits for space ...
    pool.release(0, 100)
    th.join(5)
    assert got == [0]  # ... and gets it once the earlier task released
    with pytest.raises(RuntimeError, match="pool holds 100"):
        pool.acquire(101)
    assert pool.acquire(0) == 0  # nothing to hold
