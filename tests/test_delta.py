"""Delta updates (issue 26 item 3, weight_transfer.delta): the byte runs, the shadow, the
full-or-delta decision (C26), and updates through the real planner, executor and transports
(loopback) verified bit-exact against a fresh oracle every update -- a step where nothing
changed, one where everything changed, and partial ones."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.loopback import Loopback
from weight_transfer.delta import DeltaState, changed_runs, check_published
from weight_transfer.options import ExecutorOptions
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint
from weight_transfer.types import InferenceLayout

TINY = dict(num_hidden_layers=1, vocab_size=500, hidden_size=256, intermediate_size=256,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32)


# ---- the runs ------------------------------------------------------------------------------------


def _u8(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_changed_runs_blocks_coalesce_merge_and_tail():
    old = _u8(1000)
    new = old.clone()
    assert changed_runs(new, old, 128) == []
    new[0] ^= 1  # block 0
    new[130] ^= 1  # block 1: adjacent -> one run
    new[520] ^= 1  # block 4
    new[999] ^= 1  # the short tail block [896, 1000)
    assert changed_runs(new, old, 128) == [(0, 256), (512, 128), (896, 104)]
    # merge_gap: runs separated by <= merge_gap unchanged bytes (here 2 blocks) become one
    assert changed_runs(new, old, 128, merge_gap=255) == [(0, 256), (512, 128), (896, 104)]
    assert changed_runs(new, old, 128, merge_gap=256) == [(0, 1000)]
    new[999] ^= 1
    assert changed_runs(new, old, 128, merge_gap=256) == [(0, 640)]
    # an odd length and address (no wide-integer view) gives the same runs
    a, b = torch.zeros(1001, dtype=torch.uint8), torch.zeros(1001, dtype=torch.uint8)
    a[1 + 700] = 3
    assert changed_runs(a[1:], b[1:], 128) == [(640, 128)]
    assert changed_runs(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)) == []


def test_every_changed_byte_is_inside_a_run_and_runs_are_block_aligned():
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        n = int(torch.randint(1, 5000, (1,), generator=g))
        old = _u8(n, trial)
        new = old.clone()
        k = int(torch.randint(0, 20, (1,), generator=g))
        pos = torch.randint(0, n, (k,), generator=g)
        new[pos] ^= 0x40
        runs = changed_runs(new, old, 64, merge_gap=128)
        covered = torch.zeros(n, dtype=torch.bool)
        for s, m in runs:
            assert s % 64 == 0 and (s + m == n or m % 64 == 0)
            covered[s:s + m] = True
        assert bool(covered[new != old].all())
        # applying the runs to the old bytes gives the new ones
        rx = old.clone()
        for s, m in runs:
            rx[s:s + m] = new[s:s + m]
        assert torch.equal(rx, new)


class _P:
    def __init__(self, n):
        self.nbytes = n


def test_shadow_bytes_bound_and_decisions():
    places = [[[_P(100), None, _P(28)]], [[_P(0), _P(50)]]]
    d = DeltaState(places, device="cpu")
    assert d.shadow_bytes == 178
    with pytest.raises(ValueError, match=r"shadow of 178 bytes .*delta_max_bytes is 100 .*--delta-max-mb"):
        DeltaState(places, device="cpu", max_bytes=100)
    remote = {0: _Desc(1), 1: _Desc(2)}
    assert d.begin(remote) and d.reason == "first update"
    x = _u8(100)
    assert d.runs((0, 0, 0), x) is None  # full: whole output, shadow refreshed
    d.end(1, ok=True)
    assert not d.begin(remote)
    assert d.runs((0, 0, 0), x) == []  # nothing changed
    y = x.clone()
    y[5] ^= 1
    assert d.runs((0, 0, 0), y) == [(0, 100)]
    assert d.runs((0, 0, 0), y) == []  # the shadow took the change
    d.end(2, ok=False)
    assert d.begin(remote) and "failed" in d.reason  # C26: after a failed update
    d.end(3, ok=True)
    remote[1] = _Desc(2, epoch=9)  # a re-registered receiver
    assert d.begin(remote) and "re-registered" in d.reason and "[1]" in d.reason
    d.end(4, ok=True)
    assert not d.begin(remote)
    d.end(5, ok=True)

    class Store:
        def __init__(self, keys):
            self.keys = keys

        def check(self, keys):
            return all(k in self.keys for k in keys)

    ex = type("E", (), {"delta": d})()
    check_published(ex, Store({"complete/5"}))
    assert not d.begin(remote)  # version 5 was published complete: a delta
    d.end(6, ok=True)
    check_published(ex, Store({"complete/5"}))  # 6 was not (another rank or a commit failed)
    assert d.begin(remote) and "version 6 was not published complete" in d.reason


class _Desc:
    def __init__(self, addr, epoch=1):
        self.pid, self.addr, self.length, self.key, self.epoch = 1, addr, 10, 7, epoch


# ---- through the planner, executor and transport (loopback) ------------------------------------


def _ckpt(cfg, step, change):
    return {n: t for n, t in SyntheticCheckpoint(param_specs(cfg), step=step, seed=0, change=change)}


@pytest.mark.parametrize("transport", ["cma", "shm"])
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_delta_updates_bit_exact_nothing_everything_and_partial(transport, quant):
    """Steps 1..6 of the schedule (1, 0, 1, 0.01, 0.3, 0): the first update is full; a step where
    nothing changed writes no byte; one where everything changed writes every byte; partial
    steps write less; every update bit-exact against a fresh oracle of that step."""
    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.0, 1.0, 0.01, 0.3, 0.0)
    lb = Loopback(cfg, InferenceLayout(tp=2, quant=quant), transport=transport, options=ExecutorOptions(delta=True))
    full = None
    seen = []
    for step in range(1, 7):
        src = _ckpt(cfg, step, change)
        st = lb.transfer(src)
        assert lb.verify(src) == [], (step, st.delta)
        full = full or st.full_bytes
        assert st.full_bytes == full
        seen.append((st.delta, st.bytes_sent))
    assert seen[0] == ("full: first update", full)
    assert seen[1] == ("delta", 0)  # nothing changed: no byte written
    # everything changed: every byte but the vocabulary padding rows of the last TP rank (zeros)
    assert seen[2][0] == "delta" and 0.98 * full < seen[2][1] <= full
    assert seen[3][0] == "delta" and 0 < seen[3][1] < full
    assert seen[4][0] == "delta" and seen[3][1] <= seen[4][1] <= full
    assert seen[5] == ("delta", 0)
    shadow = lb.executor.delta.shadow_bytes
    assert 0 < shadow <= full  # one byte per distinct output byte (no replicas here: = the outputs)
    lb.executor.close()


def test_C26_a_failed_update_makes_the_next_one_full():
    """A write fails midway (some of the update's bytes landed, others not); the next update must
    be full, or the receiver would keep the bytes the failed update never wrote."""
    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.5, 0.0)
    lb = Loopback(cfg, InferenceLayout(tp=2), options=ExecutorOptions(delta=True))
    lb.transfer(_ckpt(cfg, 1, change))
    real, calls = lb.tx.write, []

    def flaky(ops):
        calls.append(len(ops))
        if len(calls) == 2:
            raise RuntimeError("injected: the NIC went away")
        return real(ops)

    lb.tx.write = flaky
    with pytest.raises(RuntimeError, match="injected"):
        lb.transfer(_ckpt(cfg, 2, change))
    lb.tx.write = real
    src = _ckpt(cfg, 3, change)  # f=0 at step 3: a delta would write nothing, and be wrong
    st = lb.transfer(src)
    assert st.delta.startswith("full: the update to version") and st.bytes_sent == st.full_bytes
    assert lb.verify(src) == []
    lb.executor.close()


def test_C26_a_reregistered_receiver_makes_the_next_update_full():
    """The receiver deregisters and registers its arena again (a new epoch in its descriptor)
    and its memory no longer holds what the sender wrote (here: poisoned); the next update is
    full and bit-exact, though nothing changed on the trainer."""
    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.0)
    lb = Loopback(cfg, InferenceLayout(tp=2), options=ExecutorOptions(delta=True))
    lb.transfer(_ckpt(cfg, 1, change))
    lb.rx.deregister(lb.regions[1])
    lb.engines[1].arena.fill_(0xA5)
    lb.regions[1] = lb.rx.register(lb.engines[1].arena)
    lb.desc[1] = lb.regions[1].descriptor()  # the executor's own mapping (the control plane's new plan)
    lb.tx.connect([lb.desc[1]])
    src = _ckpt(cfg, 2, change)
    st = lb.transfer(src)
    assert st.delta.startswith("full: receiver region(s) of inference rank(s) [1]")
    assert lb.verify(src) == []
    st = lb.transfer(_ckpt(cfg, 2, change))
    assert st.delta == "delta" and st.bytes_sent == 0
    lb.executor.close()


def test_delta_max_bytes_refuses_a_plan_whose_shadow_is_larger():
    cfg = load_config("qwen3-0.6b", **TINY)
    lb = Loopback(cfg, InferenceLayout(tp=2), options=ExecutorOptions(delta=True, delta_max_bytes=1000))
    with pytest.raises(ValueError, match=r"rank 0: delta updates need a shadow of \d+ bytes .*delta_max_bytes is 1000"):
        lb.setup(_ckpt(cfg, 1, None))


def test_options_refuse_bad_delta_values():
    for kw in (dict(delta_granularity=0), dict(delta_merge_gap=-1), dict(delta_max_bytes=-5)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            ExecutorOptions(**kw)


def test_change_fraction_steps_change_that_fraction_and_any_slice_agrees():
    from weight_transfer.testing.weights import flat_range

    n = 1 << 20
    for f in (0.001, 0.01, 0.1, 0.5):
        a = flat_range("w", 0, n, step=3, seed=1, dtype=torch.bfloat16, change=(f,))
        b = flat_range("w", 0, n, step=4, seed=1, dtype=torch.bfloat16, change=(f,))
        got = (a.view(torch.int16) != b.view(torch.int16)).double().mean().item()
        assert abs(got - f) < 0.05 * f + 3e-4, (f, got)
    whole = flat_range("w", 0, 5000, step=7, seed=1, dtype=torch.bfloat16, change=(0.01,))
    part = flat_range("w", 1234, 4321, step=7, seed=1, dtype=torch.bfloat16, change=(0.01,))
    assert torch.equal(whole[1234:4321].view(torch.int16), part.view(torch.int16))
    # fraction 1 every step is the plain synthetic step (every element changes)
    plain = flat_range("w", 0, 5000, step=7, seed=1, dtype=torch.bfloat16)
    ones = flat_range("w", 0, 5000, step=7, seed=1, dtype=torch.bfloat16, change=(1.0,))
    assert torch.equal(plain.view(torch.int16), ones.view(torch.int16))
