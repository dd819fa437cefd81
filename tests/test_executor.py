"""The pipelined executor: stage queues, watermark gate, mesh-group barriers, H2D offload.

In-process tests drive :class:`reference.executor.Executor` with fake tasks (real planner
``Task`` objects without assignments, plain tensors as parameters) and stage functions slowed
down by sleeps; the multiprocess tests run small real trials (FSDP2 / two mesh groups over Gloo,
CMA writes) and check bit-exact delivery plus the recorded timelines."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from reference.executor import Executor, MemoryGate, StepStats, peak_in_flight
from reference.timeline import load_trace, task_stages
from reference.training import OffloadedParams
from reference.types import RankPlan, Task


def fake_tasks(temps, groups=None, sources=None):
    groups = groups or [0] * len(temps)
    out = []
    for i, t in enumerate(temps):
        src = sources[i] if sources else ()
        out.append(Task(id=i, group=groups[i], sources=src, mesh=(0,), assignments=(), source_bytes=t, temp_bytes=t))
    return out


def plan_of(tasks, rank=0):
    return RankPlan(rank, tuple(tasks), tuple(sorted({t.group for t in tasks})))


class SlowExecutor(Executor):
    """Stages sleep ``delays[stage]`` seconds (GIL released, like torch ops and CMA writes)."""

    delays = {"prepare": 0.02, "write": 0.02}

    def _prepare(self, w, st, abort=None):
        super()._prepare(w, st, abort)
        a, _ = w.rec.stages["prepare"]
        time.sleep(self.delays.get("prepare", 0))
        w.rec.stages["prepare"] = (a, time.perf_counter())

    def _write(self, w, st):
        super()._write(w, st)
        a, _ = w.rec.stages["write"]
        time.sleep(self.delays.get("write", 0))
        w.rec.stages["write"] = (a, time.perf_counter())


def check_stage_order(st: StepStats, stages=("prepare", "write", "release")):
    for r in st.records:
        assert tuple(r.stages) == stages, (r.task, r.stages)
        ends = 0.0
        for s in stages:
            a, b = r.stages[s]
            assert a <= b and a >= ends, (r.task, s, r.stages)
            ends = b
    # FIFO: every stage sees tasks in plan order
    for s in stages:
        starts = [r.stages[s][0] for r in st.records]
        assert starts == sorted(starts), s


# ---------------------------------------------------------------------------------------------
# the gate alone


def test_gate_admits_under_watermark_and_big_task_alone():
    g = MemoryGate(100)
    assert g.admits(60)
    g.acquire(60)
    assert g.admits(40) and not g.admits(41)
    g.acquire(40)
    assert not g.admits(1)
    g.release(60)
    g.release(40)
    assert g.admits(1000)  # nothing in flight: a task above the watermark runs alone
    g.acquire(1000)
    assert not g.admits(1)
    g.release(1000)
    assert g.peak == 1000 and g.in_flight == 0
    assert MemoryGate(None).admits(10**18)
    with pytest.raises(ValueError):
        MemoryGate(-1)


def test_gate_blocks_until_release_and_aborts():
    g = MemoryGate(10)
    g.acquire(8)
    got = []
    t = threading.Thread(target=lambda: got.append(g.acquire(5)))
    t.start()
    time.sleep(0.1)
    assert not got
    g.release(8)
    t.join(2)
    assert got and got[0] >= 0.05
    ab = threading.Event()
    ab.set()  # 5 in flight, 5 + 9 > 10: waits, sees the abort
    with pytest.raises(RuntimeError, match="aborted"):
        g.acquire(9, ab)


def test_peak_in_flight_touching_intervals_do_not_overlap():
    assert peak_in_flight([(0, 1, 5), (1, 2, 7)]) == 7
    assert peak_in_flight([(0, 2, 5), (1, 3, 7), (2.5, 4, 1)]) == 12
    assert peak_in_flight([]) == 0


# ---------------------------------------------------------------------------------------------
# the executor with fake tasks


@pytest.mark.parametrize("watermark", [None, 250, 100, 1])
def test_watermark_bounds_peak_temp_bytes(watermark):
    temps = [100, 50, 200, 10, 10, 300, 60, 60, 60, 5]
    st = SlowExecutor(plan_of(fake_tasks(temps)), {}, None, {}, watermark=watermark).run()
    assert len(st.records) == len(temps)
    check_stage_order(st)
    if watermark is None:
        assert st.peak_temp_bytes <= sum(temps)
    else:
        assert st.peak_temp_bytes <= max(watermark, max(temps)) <= watermark + max(temps)
    if watermark == 1:  # smaller than every task: each one runs alone, and all complete
        assert st.peak_temp_bytes == max(temps)
        recs = st.records
        for a, b in zip(recs, recs[1:]):
            assert b.start >= a.end


def test_pipelined_overlaps_stages_serial_does_not():
    tasks = fake_tasks([10] * 12)
    piped = SlowExecutor(plan_of(tasks), {}, None, {}, pipeline=True).run()
    serial = SlowExecutor(plan_of(tasks), {}, None, {}, pipeline=False).run()
    check_stage_order(piped)
    check_stage_order(serial)
    assert not serial.pipelined and piped.pipelined
    for a, b in zip(serial.records, serial.records[1:]):
        assert b.start >= a.end  # stage-serialized: one task at a time
    overlaps = sum(1 for a, b in zip(piped.records, piped.records[1:]) if b.stages["prepare"][0] < a.stages["write"][1])
    assert overlaps >= len(tasks) // 2
    assert piped.seconds < 0.8 * serial.seconds, (piped.seconds, serial.seconds)


class FakeHandle:
    def __init__(self, log, g):
        self.log, self.g = log, g

    def wait(self):
        self.log.append(("wait", self.g, time.perf_counter()))


def make_barrier(log):
    count = [0]

    def barrier(async_op=False):
        assert async_op
        log.append(("issue", count[0], time.perf_counter()))
        count[0] += 1
        return FakeHandle(log, count[0] - 1)

    return barrier


@pytest.mark.parametrize("pipeline", [True, False])
def test_mesh_group_barrier_orders_groups(pipeline):
    log = []
    tasks = fake_tasks([10] * 5, groups=[0, 0, 1, 1, 2])
    ex = SlowExecutor(plan_of(tasks), {}, None, {}, group_barrier=make_barrier(log), pipeline=pipeline)
    assert ex.n_groups == 3
    st = ex.run()
    assert [e[:2] for e in log if e[0] == "issue"] == [("issue", 0), ("issue", 1)]
    issue = {g: t for k, g, t in log if k == "issue"}
    wait = {g: t for k, g, t in log if k == "wait"}
    rec = {r.task: r for r in st.records}
    # issued after the group's last full_tensor (inside its prepare), waited before the next group's first prepare
    assert rec[1].stages["prepare"][0] <= issue[0] <= wait[0] <= rec[2].stages["prepare"][0]
    assert rec[3].stages["prepare"][0] <= issue[1] <= wait[1] <= rec[4].stages["prepare"][0]
    assert [b.group for b in st.barriers] == [0, 1] and all(b.waited for b in st.barriers)


def test_rank_without_tasks_in_some_groups_issues_every_barrier():
    """Every rank issues n_groups - 1 barriers per update, in order, even with no task in a
    group (or no task at all), or the other ranks' barriers would never complete."""
    for groups, n_groups in [([1], 3), ([0], 3), ([], 2), ([2, 2], 3)]:
        log = []
        ex = Executor(plan_of(fake_tasks([5] * len(groups), groups=groups)), {}, None, {},
                      group_barrier=make_barrier(log), n_groups=n_groups)
        st = ex.run()
        assert [g for k, g, _ in log if k == "issue"] == list(range(n_groups - 1)), groups
        assert [g for k, g, _ in log if k == "wait"] == list(range(n_groups - 1)), groups
        assert len(st.records) == len(groups)
        st2 = ex.run()  # the next update issues them again
        assert st2.step == 2 and len([e for e in log if e[0] == "issue"]) == 2 * (n_groups - 1)


def test_h2d_copies_host_shard_before_prepare():
    dev = {"a": torch.zeros(4, 3), "b": torch.zeros(5)}
    host = {"a": torch.arange(12.0).view(4, 3), "b": torch.full((5,), 7.0)}
    params = OffloadedParams(dev, host)
    seen = {}

    class Spy(Executor):
        def _prepare(self, w, st, abort=None):
            for n in w.task.sources:
                seen[n] = self.params[n].clone()
            super()._prepare(w, st, abort)

    tasks = fake_tasks([10, 10], sources=[("a",), ("b",)])
    with pytest.raises(ValueError, match="host copies"):
        Executor(plan_of(tasks), dev, None, {}, offload=True)
    st = Spy(plan_of(tasks), params, None, {}, offload=True).run()
    assert st.offloaded
    check_stage_order(st, ("h2d", "prepare", "write", "release"))
    assert torch.equal(seen["a"], host["a"]) and torch.equal(seen["b"], host["b"])
    assert [r.h2d_bytes for r in st.records] == [48, 20]
    host["a"] += 1  # the trainer updates the host copy; the next update must carry it
    Spy(plan_of(tasks), params, None, {}).run()
    assert torch.equal(seen["a"], host["a"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_h2d_on_cuda_side_stream_orders_prepare_after_copy():
    n = 1 << 22
    dev = {f"p{i}": torch.zeros(n, device="cuda") for i in range(4)}
    host = {k: torch.full((n,), float(i + 1)).pin_memory() for i, k in enumerate(dev)}
    seen = {}

    class Spy(Executor):
        def _prepare(self, w, st, abort=None):
            super()._prepare(w, st, abort)
            for name in w.task.sources:  # prepare's stream waited on the h2d event
                seen[name] = float(self.params[name].sum())

    tasks = fake_tasks([n * 4] * 4, sources=[(k,) for k in dev])
    ex = Spy(plan_of(tasks), OffloadedParams(dev, host), None, {}, offload=True)
    assert ex.cuda and ex._h2d_stream is not None
    st = ex.run()
    check_stage_order(st, ("h2d", "prepare", "write", "release"))
    assert seen == {k: float(i + 1) * n for i, k in enumerate(dev)}
    assert st.peak_device_bytes is not None


class FailingTransport:
    def register(self, t):
        raise RuntimeError("boom")

    def deregister(self, r):
        pass


def test_stage_error_names_stage_and_task_and_does_not_hang():
    from reference.types import Assignment, Recipe, WriteSpec

    t = fake_tasks([10, 10, 10])
    rec = Recipe("x", (0,), (2,), "float32", (), "copy", ())
    bad = Task(id=1, group=0, sources=(), mesh=(0,), assignments=(Assignment(rec, (WriteSpec(0, 0, 0, 8),)),),
               source_bytes=10, temp_bytes=10)
    tasks = [t[0], bad, t[2]]

    class Out(Executor):
        def _prepare(self, w, st, abort=None):
            if not w.admitted:
                self._admit(w, abort)
            t = time.perf_counter()
            w.outputs = [[torch.zeros(2)] for _ in w.task.assignments]
            w.rec.stages["prepare"] = (t, time.perf_counter())

    for pipeline in (True, False):
        with pytest.raises(RuntimeError, match=r"stage write of task 1 .*boom"):
            Out(plan_of(tasks), {}, FailingTransport(), {}, pipeline=pipeline, watermark=10).run()


# ---------------------------------------------------------------------------------------------
# real trials (processes, Gloo, CMA)

SMALL = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
SMALL_MOE = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, vocab_size=1000, hidden_size=128,
                 intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32)


def small(**kw):
    from experiments.config import TrialConfig

    base = dict(model="qwen3-0.6b", overrides=SMALL, n_train=2, tp=2, steps=1, warmup=0, timeout=60)
    base.update(kw)
    return TrialConfig(**base)


def run(cfg):
    from experiments.trial import run_trial

    res = run_trial(cfg)
    assert all(r["verified"] is True for r in res.rows), [r.get("verify_error") for r in res.rows]
    assert all(r["bytes"] > 0 for r in res.rows)
    return res


def traces(trace_dir):
    from reference.timeline import merge_step_traces

    return [load_trace(p) for p in merge_step_traces(trace_dir)]


def trace_tasks(tr):
    """{rank: [(task args, {stage: (ts, end)})]} and {rank: update args}."""
    upd = {e["pid"]: e["args"] for e in tr["traceEvents"] if e.get("cat") == "update"}
    temps = {}
    for e in tr["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") in ("h2d", "prepare", "write", "release"):
            temps[(e["pid"], e["args"]["task"])] = e["args"]["temp_bytes"]
    return upd, temps


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_offload_and_watermark_below_every_task_bit_exact(tmp_path):
    """Offloaded shards (the h2d stage really copies: step 2 would otherwise send step 1's
    weights) and a 1-byte watermark (every task runs alone) give bit-exact updates; the
    timeline shows h2d -> prepare -> write -> release for every task; peak temporary bytes =
    the largest task's."""
    res = run(small(offload=True, watermark=1, steps=2, trace_dir=str(tmp_path)))
    assert [r["watermark"] for r in res.rows] == [1, 1]
    trs = traces(tmp_path)
    assert len(trs) == 2
    for tr in trs:
        upd, temps = trace_tasks(tr)
        assert set(upd) == {0, 1}
        for (rank, task), stages in task_stages(tr).items():
            assert [s for s, _, _ in stages] == ["h2d", "prepare", "write", "release"], (rank, task)
            for (_, _, e1), (_, s2, _) in zip(stages, stages[1:]):
                assert s2 >= e1 - 1e-3
        for rank, a in upd.items():
            assert a["offloaded"] and a["pipelined"] and a["watermark"] == 1
            largest = max(t for (r, _), t in temps.items() if r == rank)
            assert a["peak_temp_bytes"] == largest


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_watermark_bounds_peak_in_real_trial(tmp_path):
    res = run(small(watermark=300_000, trace_dir=str(tmp_path)))
    (tr,) = traces(tmp_path)
    upd, temps = trace_tasks(tr)
    for rank, a in upd.items():
        largest = max(t for (r, _), t in temps.items() if r == rank)
        assert a["peak_temp_bytes"] <= a["watermark"] + largest
        assert a["peak_temp_bytes"] <= max(a["watermark"], largest)
    assert res.rows[0]["peak_temp_bytes"] == max(a["peak_temp_bytes"] for a in upd.values())


@pytest.mark.multiproc
@pytest.mark.timeout(120)
def test_stage_serialized_bit_exact():
    res = run(small(pipeline=False))
    assert res.cfg.executor_options()["pipeline"] is False


@pytest.mark.multiproc
@pytest.mark.timeout(150)
def test_two_mesh_groups_with_barrier_bit_exact(tmp_path):
    """The seed's layout: non-expert tasks on the 2x2 mesh (group 0), experts on the two
    columns (group 1, in parallel); one Gloo barrier over all four ranks between them."""
    run(small(model="qwen3-30b-a3b", overrides=SMALL_MOE, n_train=4, train_layout="two_group", train_mesh=(2, 2),
              ep=True, quant="fp8", trace_dir=str(tmp_path)))
    (tr,) = traces(tmp_path)
    ev = tr["traceEvents"]
    bars = {e["pid"]: e for e in ev if e.get("cat") == "barrier"}
    assert set(bars) == {0, 1, 2, 3}
    for rank, b in bars.items():
        assert b["args"]["group"] == 0
        g0 = [e for e in ev if e.get("cat") == "prepare" and e["pid"] == rank and e["args"]["group"] == 0]
        g1 = [e for e in ev if e.get("cat") == "prepare" and e["pid"] == rank and e["args"]["group"] == 1]
        assert g0 and g1
        assert b["ts"] >= max(e["ts"] for e in g0)                      # after the group's last full_tensor
        assert min(e["ts"] for e in g1) >= b["ts"] + b["dur"] - 1e-3    # next group waits on it
