"""The public API (weight_transfer.api): Sender / Coordinator / Receiver in one process (whole
tensors, a 1-rank training world, the stand-in engine as the receiver, real CMA writes into
this process), every byte checked against the engine's own load_weights; the coordinator in
training rank 0 and in its own thread (``serve``); bad input refused before anything moves;
a failed write publishes ``incomplete`` and the next push restores a complete version.
The multi-process path (2 FSDP2 ranks -> 2 inference ranks) is examples/train_and_push.py,
run by tests/project/test_examples.py."""
from __future__ import annotations

import threading

import pytest
import torch

import weight_transfer as wt
from tests.helpers.api_small import CFG, LAYOUT
from tests.helpers.api_small import same as _same
from tests.helpers.api_small import weights as _weights
from weight_transfer.engines import Engine
from weight_transfer.testing.catalog import param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint


@pytest.fixture
def world():
    store = wt.serve_store("127.0.0.1", 0)
    addr = ("127.0.0.1", store.port)
    engine = Engine(CFG, LAYOUT, 0)
    engine.arena.fill_(0xA5)
    rx = wt.Receiver.from_arena(engine.arena, engine.tensor_metas(), rank=0, store=addr)
    yield store, addr, engine, rx
    rx.close()


def test_push_with_the_coordinator_on_rank_0_updates_every_byte_and_the_version(world):
    store, addr, engine, rx = world
    coord = wt.Coordinator(addr, n_train=1, n_infer=1, model_config=CFG, layout=LAYOUT)
    params = _weights(1)
    tx = wt.Sender(params, rank=0, world_size=1, store=addr, coordinator=coord)
    assert rx.version() == -1
    for step in (1, 2, 3):
        new = _weights(step)
        for n, t in params.items():
            t.copy_(new[n])  # the "optimizer step": in place, the plan stays valid
        stats = tx.push(step)
        assert rx.version() == step and rx.state().complete
        up = tx.last_update
        assert up.version == step and up.bytes == stats.bytes_sent == sum(m.nbytes for m in engine.tensor_metas())
        assert up.seconds > 0 and up.n_writes == stats.n_writes > 0
        _same(engine, new)
    with pytest.raises(wt.VersionError, match="versions only increase"):
        tx.push(3)
    state, copy = rx.read_consistent(lambda: engine.arena.clone())
    assert state.complete and state.version == 3 and torch.equal(copy, engine.arena)
    tx.close()


def test_fp32_master_to_bf16_engine_is_a_planned_cast(world):
    store, addr, engine, rx = world
    coord = wt.Coordinator(addr, n_train=1, n_infer=1, model_config=CFG, layout=LAYOUT)
    master = _weights(5, torch.float32)
    tx = wt.Sender(master, rank=0, world_size=1, store=addr, coordinator=coord)
    tx.push(1)
    recipes = [a.recipe for rp in coord.schedule.rank_plans.values() for t in rp.tasks for a in t.assignments]
    assert {m.dtype for m in tx.metas} == {"float32"}  # the master's shards, as published ...
    assert {o.dtype for r in recipes for o in r.outputs} == {"bfloat16"}  # ... cast where the recipe assembles
    _same(engine, master)  # the engine's load_weights casts the fp32 tensors the same way
    tx.close()


def test_coordinator_in_its_own_process_serves_rank_0s_pushes(world):
    store, addr, engine, rx = world
    coord = wt.Coordinator(addr, n_train=1, n_infer=1, model_config=CFG, layout=LAYOUT)
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("r", coord.serve(count=2)), daemon=True)
    th.start()
    params = _weights(1)
    tx = wt.Sender(params, rank=0, world_size=1, store=addr)  # no coordinator here
    tx.push(10)
    new = _weights(2)
    for n, t in params.items():
        t.copy_(new[n])
    tx.push(20)
    th.join(60)
    assert [r.version for r in out["r"]] == [10, 20] and tx.last_update is None
    assert rx.wait_version(20).version == 20
    _same(engine, new)
    tx.close()


def test_a_failed_write_publishes_incomplete_and_the_next_push_restores(world, monkeypatch):
    store, addr, engine, rx = world
    coord = wt.Coordinator(addr, n_train=1, n_infer=1, model_config=CFG, layout=LAYOUT, timeout=20)
    params = _weights(1)
    tx = wt.Sender(params, rank=0, world_size=1, store=addr, coordinator=coord)
    tx.push(1)
    tx.plan()
    real = tx.executor.run

    def broken(step=None, cancel=None):
        raise RuntimeError("injected: NIC gone")
    monkeypatch.setattr(tx.executor, "run", broken)
    with pytest.raises(wt.ControlError, match="training 0: RuntimeError: injected: NIC gone") as ei:
        tx.push(2)
    assert isinstance(ei.value.__cause__, RuntimeError) and "NIC gone" in str(ei.value.__cause__)
    s = rx.state()
    assert s.state == "incomplete" and s.version == 2 and rx.version() is None
    with pytest.raises(wt.UpdateInProgress):
        rx.read_consistent(lambda: None, wait=False)
    monkeypatch.setattr(tx.executor, "run", real)
    new = _weights(3)
    for n, t in params.items():
        t.copy_(new[n])
    tx.push(3)
    assert rx.version() == 3
    _same(engine, new)
    tx.close()


def test_receiver_of_named_tensors_spans_them_and_refuses_aliases():
    store = wt.serve_store("127.0.0.1", 0)
    a, b = torch.zeros(64, dtype=torch.bfloat16), torch.zeros(8, 4)
    rx = wt.Receiver({"a": a, "b": b}, rank=0, store=store)
    metas = {m.name: m for m in rx.metas}
    assert metas["a"].nbytes == 128 and metas["b"].nbytes == 128
    d = rx.descriptor
    lo = min(a.data_ptr(), b.data_ptr())
    assert d.addr == lo and d.length >= 256
    # two allocations: one region of two parts (what a CUDA module's parameters need), writes held to them
    assert rx.region.parts == dict(d.extra)["parts"] and len(rx.region.parts) == 2
    assert {(m.offset, m.nbytes) for m in rx.metas} == set(rx.region.parts)
    rx.close()
    base = torch.zeros(100)
    one = wt.Receiver({"x": base[:10], "y": base[50:60]}, rank=1, store=store)  # views of one storage
    assert {m.name: m.offset for m in one.metas} == {"x": 0, "y": 200}
    assert one.region.parts is None and "parts" not in dict(one.descriptor.extra)  # one allocation: one plain region
    one.close()
    with pytest.raises(ValueError, match="overlap"):
        wt.Receiver({"x": base[:10], "y": base[5:20]}, rank=2, store=store)
    with pytest.raises(ValueError, match="not contiguous"):
        wt.Receiver({"t": torch.zeros(4, 4).t()}, rank=2, store=store)
    with pytest.raises(ValueError, match="no tensors"):
        wt.Receiver({}, rank=2, store=store)


def test_bad_arguments_are_refused_before_anything_is_published():
    store = wt.serve_store("127.0.0.1", 0)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        wt.Sender({"w": torch.zeros(2)}, rank=2, world_size=2, store=store)
    with pytest.raises(TypeError, match="all be DTensors"):
        wt.Sender({"w": torch.zeros(2)}, rank=0, world_size=2, store=store)
    with pytest.raises(TypeError, match="nn.Module or a mapping"):
        wt.Sender([torch.zeros(2)], rank=0, world_size=1, store=store)
    with pytest.raises(ValueError, match="n_train=0"):
        wt.Coordinator(store, n_train=0, n_infer=1)
    with pytest.raises(ValueError, match="store="):
        wt.connect_store("nowhere")
    assert not store.check(["meta/train/0"])


def test_the_package_root_exports_the_api_lazily():
    import subprocess
    import sys

    code = ("import sys, weight_transfer as wt; assert 'weight_transfer.api' not in sys.modules; "
            "wt.Sender; assert 'weight_transfer.api' in sys.modules; "
            "assert all(hasattr(wt, n) for n in wt.__all__)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_delta_pushes_and_C26_full_after_a_version_not_published_complete(world):
    """``TransferOptions(executor=ExecutorOptions(delta=True))``: the first push is full, a 1%
    step writes less, every push bit-exact; a push whose writes all landed but whose commit
    failed (the version is published ``incomplete``) makes the next push full (C26), and a
    failed write does too."""
    from weight_transfer.options import ExecutorOptions, TransferOptions

    store, addr, engine, rx = world
    # delta_op_cost=0: every run written (the transport's cost model would write this model's
    # small outputs whole at 1%: tests/delta/test_runs.py covers it)
    opts = TransferOptions(executor=ExecutorOptions(delta=True, delta_op_cost=0))
    coord = wt.Coordinator(addr, n_train=1, n_infer=1, model_config=CFG, layout=LAYOUT, timeout=20, options=opts)
    change = (1.0, 0.01, 0.0, 0.0, 0.01)

    def weights(step):
        ck = SyntheticCheckpoint(param_specs(CFG), step=step, seed=3, change=change)
        return {n: ck[n] for n in ck.names()}

    params = {n: t.clone() for n, t in weights(1).items()}
    tx = wt.Sender(params, rank=0, world_size=1, store=addr, coordinator=coord, options=opts)

    def step(v, **kw):
        new = weights(v)
        for n, t in params.items():
            t.copy_(new[n])
        return tx.push(v, **kw), new

    st, new = step(1)
    full = sum(m.nbytes for m in engine.tensor_metas())
    assert st.delta == "full: first update" and st.bytes_sent == full
    _same(engine, new)
    st, new = step(2)
    assert st.delta == "delta" and 0 < st.bytes_sent < full and tx.last_update.bytes == st.bytes_sent
    _same(engine, new)

    def failing_commit(v):
        raise RuntimeError("injected: the engine's commit failed")

    with pytest.raises(Exception, match="commit failed"):
        step(3, commit=failing_commit)
    assert rx.state().state == "incomplete"
    st, new = step(4)  # nothing changed since 3, but 3 was never published complete
    assert st.delta == "full: version 3 was not published complete" and st.bytes_sent == full
    _same(engine, new)
    st, new = step(5)
    assert st.delta == "delta" and st.bytes_sent < full
    _same(engine, new)
    tx.close()


def test_a_writer_left_blocked_refuses_the_next_push_until_it_ends(world, monkeypatch):
    """A rank whose writer cannot end (blocked in a collective of the user's own process group,
    simulated: ``Executor.run`` ignores the cancel) raises ControlError saying so, within the
    timeout plus the writer's grace; the next push is refused on every rank while that writer
    still runs (no bytes of two updates at once); once it ended, the next push completes."""
    import time

    store, addr, engine, rx = world
    coord = wt.Coordinator(addr, n_train=1, n_infer=1, model_config=CFG, layout=LAYOUT, timeout=2)
    params = _weights(1)
    tx = wt.Sender(params, rank=0, world_size=1, store=addr, coordinator=coord, timeout=2)
    tx.push(1)
    real, gate = tx.executor.run, threading.Event()

    def blocked(step=None, cancel=None):
        gate.wait(60)  # deaf to the cancel, as a thread inside a Gloo collective is
        return real(step, cancel=cancel)
    monkeypatch.setattr(tx.executor, "run", blocked)
    t0 = time.monotonic()
    with pytest.raises(wt.ControlError, match="no answer within 2 s from rank") as ei:
        tx.push(2)
    assert "still blocked" in str(ei.value.__cause__)  # this rank's own account
    assert tx.writer_blocked and not tx.wait_writer(0.1)
    assert time.monotonic() - t0 < 2 + 2 + 8  # the timeout, the grace, slack for a loaded machine
    assert rx.state().state == "incomplete"
    with pytest.raises(wt.ControlError, match="writes of version 2 are still blocked"):
        tx.push(3)
    monkeypatch.setattr(tx.executor, "run", real)
    gate.set()
    assert tx.wait_writer(30) and not tx.writer_blocked
    new = _weights(4)
    for n, t in params.items():
        t.copy_(new[n])
    tx.push(4)
    assert rx.version() == 4
    _same(engine, new)
    tx.close()
