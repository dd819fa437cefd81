"""Delta updates (issue 26 item 3, weight_transfer.delta.runs): the byte runs, the shadow, the
full-or-delta decision (C26), and updates through the real planner, executor and transports
(loopback) verified bit-exact against a fresh oracle every update -- a step where nothing
changed, one where everything changed, and partial ones."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.loopback import Loopback
from weight_transfer.delta.runs import DeltaState, changed_runs, changed_runs_native, check_published, native_status
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
    assert d.runs((0, 0, 0), y) == [(0, 8)]  # the 8-byte block holding byte 5
    assert d.runs((0, 0, 0), y) == []  # the shadow took the change
    y[40:100] ^= 1
    assert d.runs((0, 0, 0), y) == [(40, 60)]
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
    steps write less; every update bit-exact against a fresh oracle of that step. At the default
    8-byte blocks (runs posted from C as RunsOps), no cost-model fallback (``delta_op_cost=0``:
    every output's runs are written)."""
    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.0, 1.0, 0.01, 0.3, 0.0)
    opts = ExecutorOptions(delta=True, delta_op_cost=0)
    lb = Loopback(cfg, InferenceLayout(tp=2, quant=quant), transport=transport, options=opts)
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
    for kw in (dict(delta_granularity=0), dict(delta_merge_gap=-1), dict(delta_max_bytes=-5), dict(delta_op_cost=-1)):
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


# ---- the native runs, the batched run writes, the cost model --------------------------------------


def test_native_runs_equal_the_python_reference_and_update_the_shadow():
    """The C pass (``_delta.c``) gives exactly :func:`changed_runs`' runs at every granularity
    and gap (odd lengths, short tail blocks, granularities that are no word size), and leaves the
    shadow equal to the new bytes; nothing changed -> no run; everything changed -> one run."""
    if native_status() != "ok":
        pytest.skip(f"native delta kernel unavailable: {native_status()}")
    g = torch.Generator().manual_seed(5)
    for trial in range(200):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        old = _u8(n, trial)
        new = old.clone()
        k = int(torch.randint(0, 40, (1,), generator=g))
        new[torch.randint(0, n, (k,), generator=g)] ^= 0x11
        gran = (1, 2, 3, 8, 16, 64, 128, 100, 4)[trial % 9]
        gap = (0, 8, 100, 256)[trial // 8 % 4]
        want = changed_runs(new, old, gran, gap)
        shadow = old.clone()
        got = changed_runs_native(new, shadow, gran, gap)
        assert got == want, (n, gran, gap)
        assert got.nbytes == sum(m for _, m in want)
        assert torch.equal(shadow, new)
    x = _u8(4099)
    assert changed_runs_native(x, x.clone(), 8) == []
    assert changed_runs_native(x, x ^ 0xFF, 8) == [(0, 4099)]
    # more runs than allowed: None, and the shadow refreshed whole
    y = x.clone()
    y[::16] ^= 1
    shadow = x.clone()
    assert changed_runs_native(y, shadow, 8, max_runs=10) is None and torch.equal(shadow, y)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("transport", ["cma", "shm"])
def test_runs_op_writes_exactly_its_runs_and_refuses_a_run_outside_its_span(transport, native, monkeypatch):
    """A RunsOp lands exactly its runs (other bytes untouched) on cma and shm, from C and (no
    native kernel) one op per run; a run outside its span, an empty run or malformed arrays
    refuse the whole batch before any byte moves."""
    from weight_transfer.delta import runs as delta
    from weight_transfer.transport import make_transport
    from weight_transfer.transport.base import BoundsError, WriteOp
    from weight_transfer.transport.runs import RunsOp, op_count, write

    if not native:
        monkeypatch.setattr(delta.KERNEL, "lib", lambda: None)
    elif native_status() != "ok":
        pytest.skip(f"native delta kernel unavailable: {native_status()}")
    rx, tx = make_transport(transport), make_transport(transport)
    arena = rx.allocate(1 << 16) if rx.publishes_allocated_only else torch.empty(1 << 16, dtype=torch.uint8)
    arena.fill_(0xA5)
    d = rx.register(arena).descriptor()
    tx.connect([d])
    src = _u8(1 << 16, 9)
    loc = tx.register(src)
    starts = torch.tensor([0, 100, 5000, 9000], dtype=torch.int64)
    lens = torch.tensor([8, 50, 1, 1000], dtype=torch.int64)
    ops = [RunsOp(loc, 1024, d, 2048, 10000, starts, lens), WriteOp(loc, 0, d, 60000, 16)]
    assert op_count(ops) == 5
    assert write(tx, ops).wait() == 8 + 50 + 1 + 1000 + 16
    want = torch.full((1 << 16,), 0xA5, dtype=torch.uint8)
    for s, n in zip(starts.tolist(), lens.tolist()):
        want[2048 + s:2048 + s + n] = src[1024 + s:1024 + s + n]
    want[60000:60016] = src[:16]
    assert torch.equal(arena, want)
    before = arena.clone()
    bad = [(torch.tensor([9999], dtype=torch.int64), torch.tensor([2], dtype=torch.int64)),  # leaves the span
           (torch.tensor([-1], dtype=torch.int64), torch.tensor([2], dtype=torch.int64)),
           (torch.tensor([10], dtype=torch.int64), torch.tensor([0], dtype=torch.int64)),  # empty
           (torch.tensor([10], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))]
    for st, ln in bad:
        with pytest.raises(BoundsError, match="op 1"):
            write(tx, [WriteOp(loc, 0, d, 0, 16), RunsOp(loc, 0, d, 0, 10000, st, ln)])
    with pytest.raises(BoundsError):  # the span itself leaves the remote region
        write(tx, [RunsOp(loc, 0, d, (1 << 16) - 100, 10000, starts[:1], lens[:1])])
    assert torch.equal(arena, before)  # nothing of a refused batch was written
    tx.close()
    rx.close()


def test_cost_model_writes_an_output_whole_when_its_runs_cost_more():
    """``op_cost_bytes``: runs x cost + bytes >= the output -> the whole output (None), the shadow
    refreshed; a few runs -> the runs."""
    d = DeltaState([[[_P(4096)]]], device="cpu", op_cost_bytes=1024)
    remote = {0: _Desc(1)}
    d.begin(remote)
    x = _u8(4096)
    assert d.runs((0, 0, 0), x) is None
    d.end(1, ok=True)
    d.begin(remote)
    y = x.clone()
    y[100] ^= 1
    assert d.runs((0, 0, 0), y) == [(96, 8)] and d.whole == 0
    y[::512] ^= 1  # 8 runs x 1024 > 4096: whole
    assert d.runs((0, 0, 0), y) is None and d.whole == 1
    assert d.runs((0, 0, 0), y) == []  # the shadow was refreshed


def test_delta_at_the_transport_cost_is_bit_exact():
    """The default options (8-byte blocks, the transport's run cost: outputs whose runs cost more
    are written whole) through the loopback: bit-exact every update, a sparse step writes less
    than full, nothing changed writes nothing."""
    cfg = load_config("qwen3-0.6b", **TINY)
    change = (1.0, 0.0005, 0.0)
    lb = Loopback(cfg, InferenceLayout(tp=2), options=ExecutorOptions(delta=True))
    seen = []
    for step in range(1, 4):
        src = _ckpt(cfg, step, change)
        st = lb.transfer(src)
        assert lb.verify(src) == [], (step, st.delta)
        seen.append((st.delta, st.bytes_sent, st.full_bytes))
    assert seen[0][0].startswith("full") and seen[0][1] == seen[0][2]
    assert seen[1][0] == "delta" and 0 < seen[1][1] < seen[1][2]
    assert seen[2] == ("delta", 0, seen[2][2])
    lb.executor.close()
