"""The pipelined executor: stage queues, watermark gate, mesh-group barriers, H2D offload.

In-process tests drive :class:`weight_transfer.pipeline.executor.Executor` with fake tasks (real planner
``Task`` objects without assignments, plain tensors as parameters) and stage functions slowed
down by sleeps, or with one-write assignments on a fake asynchronous transport (batches that
complete on demand: writes of several tasks in flight); the multiprocess tests run small real trials (FSDP2 / two mesh groups over Gloo,
CMA writes) and check bit-exact delivery plus the recorded timelines."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from weight_transfer.options import ExecutorOptions
from weight_transfer.pipeline.executor import Executor, MemoryGate, StepStats, TaskRecord, peak_in_flight
from weight_transfer.plan.metadata import OffloadedParams
from weight_transfer.timeline import load_trace, task_stages, union_seconds
from weight_transfer.transport.base import RemoteGoneError, TransportError, WriteHandle
from weight_transfer.types import RankPlan, Task


def fake_tasks(temps, groups=None, sources=None):
    groups = groups or [0] * len(temps)
    out = []
    for i, t in enumerate(temps):
        src = sources[i] if sources else ()
        out.append(Task(id=i, group=groups[i], sources=src, mesh=(0,), assignments=(), source_bytes=t, temp_bytes=t))
    return out


def plan_of(tasks, rank=0):
    return RankPlan(rank, tuple(tasks), tuple(sorted({t.group for t in tasks})))


class DelayedHandle(WriteHandle):
    """A batch that completes ``delay`` seconds after it was posted (like an RDMA WRITE)."""

    def __init__(self, delay: float, nbytes: int = 0):
        self.until, self.nbytes = time.perf_counter() + delay, nbytes

    def done(self) -> bool:
        return time.perf_counter() >= self.until

    def _idle(self) -> None:
        time.sleep(1e-4)


class SlowExecutor(Executor):
    """Prepare sleeps ``delays["prepare"]`` seconds (GIL released, like torch ops); each task's
    batch completes ``delays["write"]`` seconds after its post (an asynchronous write)."""

    delays = {"prepare": 0.02, "write": 0.02}

    def _prepare(self, w, st, abort=None):
        super()._prepare(w, st, abort)
        a, _ = w.rec.stages["prepare"]
        time.sleep(self.delays.get("prepare", 0))
        w.rec.stages["prepare"] = (a, time.perf_counter())

    def _post_write(self, w):
        p = super()._post_write(w)
        p.handle = DelayedHandle(self.delays.get("write", 0))
        return p


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
    st = SlowExecutor(plan_of(fake_tasks(temps)), {}, None, {}, options=ExecutorOptions(watermark=watermark)).run()
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
    piped = SlowExecutor(plan_of(tasks), {}, None, {}, options=ExecutorOptions(pipeline=True)).run()
    serial = SlowExecutor(plan_of(tasks), {}, None, {}, options=ExecutorOptions(pipeline=False)).run()
    check_stage_order(piped)
    check_stage_order(serial)
    assert not serial.pipelined and piped.pipelined
    for a, b in zip(serial.records, serial.records[1:]):
        assert b.start >= a.end  # stage-serialized: one task at a time
    overlaps = sum(1 for a, b in zip(piped.records, piped.records[1:]) if b.stages["prepare"][0] < a.stages["write"][1])
    assert overlaps >= len(tasks) // 2
    assert piped.seconds < serial.seconds, (piped.seconds, serial.seconds)


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
    ex = SlowExecutor(plan_of(tasks), {}, None, {}, group_barrier=make_barrier(log),
                      options=ExecutorOptions(pipeline=pipeline))
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
        Executor(plan_of(tasks), dev, None, {}, options=ExecutorOptions(offload=True))
    st = Spy(plan_of(tasks), params, None, {}, options=ExecutorOptions(offload=True)).run()
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
    ex = Spy(plan_of(tasks), OffloadedParams(dev, host), None, {}, options=ExecutorOptions(offload=True))
    assert ex.cuda and ex._h2d_stream is not None
    st = ex.run()
    check_stage_order(st, ("h2d", "prepare", "write", "release"))
    assert seen == {k: float(i + 1) * n for i, k in enumerate(dev)}
    assert st.peak_device_bytes is not None


class FailingTransport:
    """Registers (at setup), refuses every batch."""

    def register(self, t):
        return _Region(t)

    def deregister(self, r):
        pass

    def write(self, ops):
        raise RuntimeError("boom")


def test_stage_error_names_stage_and_task_and_does_not_hang():
    from weight_transfer.types import Assignment, Recipe, WriteSpec

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
            Out(plan_of(tasks), {}, FailingTransport(), _remote(), options=ExecutorOptions(pipeline=pipeline,
                                                                                          watermark=10)).run()


# ---------------------------------------------------------------------------------------------
# writes of several tasks in flight (a fake asynchronous transport)


class _Region:
    n = 0

    def __init__(self, t):
        self.tensor, self.length, self.key = t, t.nbytes, _Region.n
        _Region.n += 1


class AsyncTransport:
    """A fake transport whose batches complete when ``complete(i, transport)`` says so (``i``:
    the batch's post index). Logs every call with its thread (transports are not thread-safe:
    every call must come from the one write thread)."""

    def __init__(self, complete=lambda i, tr: True, fail=None, gone_pid=None):
        self.complete, self.fail, self.gone_pid = complete, fail or set(), gone_pid
        self.log: list[tuple] = []
        self.threads: set[str] = set()
        self.registered: set[int] = set()
        self.deregistered: set[int] = set()
        self.outstanding = self.max_outstanding = 0
        self.n_posted = 0

    def _call(self, *ev):
        if ev[0] != "register":  # registration happens at setup, on the thread building the executor
            self.threads.add(threading.current_thread().name)
        self.log.append(ev)

    def register(self, t):
        r = _Region(t)
        self._call("register", r.key)
        self.registered.add(r.key)
        return r

    def deregister(self, r):
        self._call("deregister", r.key)
        assert r.key in self.registered and r.key not in self.deregistered
        self.deregistered.add(r.key)

    def write(self, ops):
        i = self.n_posted
        self.n_posted += 1
        self._call("post", i)
        self.outstanding += 1
        self.max_outstanding = max(self.max_outstanding, self.outstanding)
        return AsyncHandle(self, i, sum(op.length for op in ops))


class AsyncHandle(WriteHandle):
    def __init__(self, tr: AsyncTransport, i: int, nbytes: int):
        self.tr, self.i, self.nbytes, self.finished = tr, i, nbytes, False

    def done(self) -> bool:
        self.tr._call("poll", self.i)
        if not self.finished and self.tr.complete(self.i, self.tr):
            self.finished = True
            self.tr.outstanding -= 1
        return self.finished

    def _idle(self) -> None:
        time.sleep(1e-4)

    def _raise_failure(self) -> None:
        if self.i in self.tr.fail:
            self.tr._call("fail", self.i)
            if self.tr.gone_pid:
                raise RemoteGoneError(f"process_vm_writev: pid {self.tr.gone_pid} (ESRCH)")
            raise TransportError(f"batch {self.i}: the NIC reported an error")

    def _timeout_message(self, timeout: float) -> str:
        self.tr._call("timeout", self.i)
        return f"fake batch {self.i} not complete after {timeout} s"


def writing_tasks(n, temp=10, dst=0):
    """``n`` tasks of one copy recipe each, writing its 8 output bytes to inference ``dst``."""
    from weight_transfer.types import Assignment, Recipe, WriteSpec

    rec = Recipe("x", (0,), (2,), "float32", (), "copy", ())
    return [Task(id=i, group=0, sources=(), mesh=(0,), assignments=(Assignment(rec, (WriteSpec(0, dst, 8 * i, 8),)),),
                 source_bytes=temp, temp_bytes=temp) for i in range(n)]


class Outs(Executor):
    """Prepare makes each assignment's output without sources (a 2-float tensor); ``pause``
    seconds per prepare."""

    pause = 0.0

    def _prepare(self, w, st, abort=None):
        if not w.admitted:
            self._admit(w, abort)
        t = time.perf_counter()
        time.sleep(self.pause)
        w.outputs = [[torch.full((2,), float(w.task.id))] for _ in w.task.assignments]
        w.rec.stages["prepare"] = (t, time.perf_counter())


def _remote(dst=0, pid=4242):
    from types import SimpleNamespace

    return {dst: SimpleNamespace(pid=pid)}


def check_transport_use(tr: AsyncTransport, ex: Executor | None = None, thread: str = "rank0-write"):
    assert tr.threads == {thread}, tr.threads              # one thread touches the transport during updates
    kinds = [e[0] for e in tr.log]
    n_reg = kinds.count("register")
    assert n_reg >= 1 and kinds[:n_reg] == ["register"] * n_reg   # registered once, at setup, before any post
    assert "deregister" not in kinds                        # nothing deregistered per update
    if ex is not None:
        ex.close()
        assert tr.registered == tr.deregistered             # close() deregisters what setup registered


def test_next_batch_posted_while_earlier_in_flight():
    """Unbounded watermark: a batch completes only once every batch was posted, so the update
    finishes only if the write stage posts task k+1 before task k completed."""
    n = 6
    tr = AsyncTransport(complete=lambda i, tr: tr.n_posted == n)
    ex = Outs(plan_of(writing_tasks(n)), {}, tr, _remote(), write_timeout=10)
    st = ex.run()
    assert tr.max_outstanding == n and ex._writes.max_in_flight == n
    assert (st.n_writes, st.bytes_sent) == (n, 8 * n)
    check_stage_order(st)
    check_transport_use(tr, ex)
    w = [r.stages["write"] for r in st.records]
    assert all(b[0] < a[1] for a, b in zip(w, w[1:]))   # write intervals overlap ...
    assert st.stage_busy()["write"] == pytest.approx(union_seconds(w))   # ... and busy counts their union
    assert st.stage_busy()["write"] < sum(b - a for a, b in w)


@pytest.mark.parametrize("watermark,most", [(10, 1), (20, 2)])
def test_watermark_bounds_batches_in_flight(watermark, most):
    """A task holds its temporary bytes until its batch completed: a watermark of one task
    (two tasks) keeps at most one (two) batches in flight, even when completion is slow."""
    polls: dict[int, int] = {}

    def complete(i, tr):  # each batch needs 5 polls
        polls[i] = polls.get(i, 0) + 1
        return polls[i] >= 5

    tr = AsyncTransport(complete=complete)
    ex = Outs(plan_of(writing_tasks(8)), {}, tr, _remote(), options=ExecutorOptions(watermark=watermark),
              write_timeout=10)
    st = ex.run()
    assert tr.max_outstanding <= most and ex._writes.max_in_flight <= most
    assert st.n_writes == 8 and st.peak_temp_bytes <= watermark
    check_transport_use(tr, ex)


@pytest.mark.parametrize("how", ["fail", "gone", "timeout"])
def test_failed_batch_aborts_names_task_posts_nothing_after(how):
    """Batch 1 fails (a transport error, the receiver gone, or past its timeout): the update
    raises naming the write stage and task 1 (and for a gone receiver the inference rank); no
    batch is posted after the failure surfaced; every region is deregistered."""
    n = 20
    if how == "timeout":
        tr = AsyncTransport(complete=lambda i, tr: i != 1)
    else:
        tr = AsyncTransport(fail={1}, gone_pid=4242 if how == "gone" else None)
    ex = Outs(plan_of(writing_tasks(n, dst=3)), {}, tr, _remote(dst=3), write_timeout=0.1)
    ex.pause = 0.02
    want = {"fail": r"stage write of task 1 .*NIC reported an error",
            "gone": r"stage write of task 1 .*RemoteGoneError: inference 3 \(pid 4242\) is gone",
            "timeout": r"stage write of task 1 .*TimeoutError: fake batch 1 not complete after 0.1 s"}[how]
    with pytest.raises(RuntimeError, match=want):
        ex.run()
    kinds = [e[0] for e in tr.log]
    surfaced = kinds.index("timeout" if how == "timeout" else "fail")
    assert "post" not in kinds[surfaced:]
    assert tr.n_posted < n
    check_transport_use(tr, ex)


def test_serial_keeps_one_batch_in_flight():
    """``pipeline=False``: each batch is waited for before the next task starts."""
    polls: dict[int, int] = {}

    def complete(i, tr):
        polls[i] = polls.get(i, 0) + 1
        return polls[i] >= 3

    tr = AsyncTransport(complete=complete)
    ex = Outs(plan_of(writing_tasks(5)), {}, tr, _remote(), options=ExecutorOptions(pipeline=False))
    st = ex.run()
    assert tr.max_outstanding == 1 and st.n_writes == 5
    check_transport_use(tr, ex, thread=threading.current_thread().name)  # stage-serialized: the caller's thread


def test_stage_busy_is_union_of_intervals():
    recs = [TaskRecord(0, 0, stages={"write": (0.0, 2.0), "prepare": (0.0, 1.0)}),
            TaskRecord(1, 0, stages={"write": (1.0, 3.0), "prepare": (1.0, 1.5)}),
            TaskRecord(2, 0, stages={"write": (5.0, 6.0), "prepare": (2.0, 2.5)})]
    busy = StepStats(rank=0, records=recs).stage_busy()
    assert busy == pytest.approx({"write": 4.0, "prepare": 2.0})
    assert union_seconds([]) == 0.0


# ---------------------------------------------------------------------------------------------
# real trials (processes, Gloo, CMA)

SMALL = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
SMALL_MOE = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, vocab_size=1000, hidden_size=128,
                 intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32)


def small(**kw):
    from weight_transfer.experiments.config import TrialConfig

    base = dict(model="qwen3-0.6b", overrides=SMALL, n_train=2, tp=2, steps=1, warmup=0, timeout=60)
    base.update(kw)
    return TrialConfig.from_flat(**base)


def run(cfg):
    from weight_transfer.experiments.trial import run_trial

    res = run_trial(cfg)
    assert all(r["verified"] is True for r in res.rows), [r.get("verify_error") for r in res.rows]
    assert all(r["bytes"] > 0 for r in res.rows)
    return res


def traces(trace_dir):
    from weight_transfer.timeline import merge_step_traces

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
    assert res.cfg.transfer.executor.pipeline is False


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


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_trainer_copy_bytes_counts_gathers_and_new_buffers_not_shard_views():
    """``trainer_copy_bytes`` (issue 29 item 2): bytes the training ranks copy outside the
    writes. With every source gathered (``local_writes=False``) at least every byte written was
    gathered first; shard-local prepare copies less; block FP8 builds its outputs in buffers of
    their own; never more than gathered + written."""
    gather = run(small(local_writes=False, quant=None)).rows[0]
    local = run(small(quant=None)).rows[0]
    fp8 = run(small(quant="fp8")).rows[0]
    assert gather["trainer_copy_bytes"] >= gather["bytes"]
    assert 0 <= local["trainer_copy_bytes"] < gather["trainer_copy_bytes"]
    assert fp8["trainer_copy_bytes"] > 0


# ---------------------------------------------------------------------------------------------
# memory registered once (issue 29 item 1): shard storages and the output pool, at setup

from tests.helpers.loopback import Loopback  # noqa: E402

TINY = dict(num_hidden_layers=1, vocab_size=500, hidden_size=256, intermediate_size=256,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def _ckpt(cfg, step):
    from weight_transfer.testing.catalog import param_specs
    from weight_transfer.testing.weights import SyntheticCheckpoint

    return {n: t for n, t in SyntheticCheckpoint(param_specs(cfg), step=step, seed=0)}


def _counting(tr):
    """Count ``register`` / ``deregister`` calls on transport ``tr`` (instance attributes)."""
    calls = {"register": 0, "deregister": 0}
    for name in calls:
        real = getattr(tr, name)

        def counted(*a, _real=real, _name=name):
            calls[_name] += 1
            return _real(*a)

        setattr(tr, name, counted)
    return calls


@pytest.mark.parametrize("transport", ["cma", "shm"])
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_memory_registered_at_setup_never_inside_an_update(transport, quant):
    """Every ``transport.register`` call of the sender happens while the executor is built:
    three updates register (and deregister) nothing, and each is bit-exact. Plain recipes are
    written from the shards' storages, the rest from the pool; the counts and bytes are in
    ``setup_stats``."""
    from weight_transfer.testing.catalog import load_config
    from weight_transfer.types import InferenceLayout

    cfg = load_config("qwen3-0.6b", **TINY)
    lb = Loopback(cfg, InferenceLayout(tp=2, quant=quant), transport=transport)
    calls = _counting(lb.tx)
    ex = lb.setup(_ckpt(cfg, 1))
    at_setup = calls["register"]
    s = ex.setup_stats
    assert at_setup == s.n_regions == s.source_regions + 1 >= 2 and s.transport == transport
    assert s.registered_bytes == s.source_bytes + s.pool_bytes and s.register_seconds > 0
    assert 0 < s.pooled_bytes <= s.pool_bytes or quant is None
    assert "registered once" in s.summary() and f"{s.n_regions} regions" in s.summary()
    for step in (1, 2, 3):
        src = _ckpt(cfg, step)
        st = lb.transfer(src)
        assert lb.verify(src) == [], step
        assert st.bytes_sent == sum(m.nbytes for e in lb.engines for m in e.tensor_metas())
    assert calls == {"register": at_setup, "deregister": 0}  # zero inside the three updates
    ex.close()
    assert calls["deregister"] == at_setup


def test_fake_transport_registers_at_setup_only_over_three_updates():
    tr = AsyncTransport()
    ex = Outs(plan_of(writing_tasks(6)), {}, tr, _remote(), write_timeout=10)
    n = [e[0] for e in tr.log].count("register")
    assert n == 1 and ex.setup_stats.n_regions == 1 and ex.setup_stats.pool_bytes >= 6 * 64  # one pool, 64 B slots
    for _ in range(3):
        st = ex.run()
        assert st.n_writes == 6
        assert ex.memory.pool.in_use == 0
    kinds = [e[0] for e in tr.log]
    assert kinds.count("register") == n and "deregister" not in kinds
    check_transport_use(tr, ex)


def test_C17_holds_for_pooled_buffers():
    """The epoch check still refuses a stale descriptor before any byte moves, whatever memory
    the batch reads: after the receiver re-registered its arena the update fails naming the
    stale region, every pool chunk is given back, the arena is untouched; once the sender has
    the new descriptor the next update is bit-exact, still without a registration."""
    from weight_transfer.testing.catalog import load_config
    from weight_transfer.types import InferenceLayout

    cfg = load_config("qwen3-0.6b", **TINY)
    lb = Loopback(cfg, InferenceLayout(tp=2, quant="fp8"))
    calls = _counting(lb.tx)
    lb.transfer(_ckpt(cfg, 1))
    n = calls["register"]
    lb.rx.deregister(lb.regions[0])  # the receiver re-registers rank 0's arena: a new epoch
    lb.regions[0] = lb.rx.register(lb.engines[0].arena)
    before = lb.engines[0].arena.clone()
    with pytest.raises(RuntimeError, match="StaleRegionError: .*owner publishes 0: the receiver deregistered it"):
        lb.transfer(_ckpt(cfg, 2))
    assert lb.executor.memory.pool.in_use == 0
    assert torch.equal(lb.engines[0].arena, before)  # nothing written into the re-registered arena
    lb.desc[0] = lb.regions[0].descriptor()  # the control plane hands the new descriptor
    lb.tx.connect([lb.desc[0]])
    src = _ckpt(cfg, 3)
    lb.transfer(src)
    assert lb.verify(src) == [] and calls["register"] == n


@pytest.mark.parametrize("how", ["watermark", "pool"])
def test_task_larger_than_the_watermark_or_pool_runs_alone(how):
    """A watermark below every task (each runs alone), or a pool holding exactly the largest
    task's chunk (tasks wait for pool space, in plan order): updates complete, bit-exact; the
    pool never holds more than it has."""
    from weight_transfer.testing.catalog import load_config
    from weight_transfer.types import InferenceLayout

    cfg = load_config("qwen3-0.6b", **TINY)
    layout = InferenceLayout(tp=2, quant="fp8")
    if how == "watermark":
        lb = Loopback(cfg, layout, options=ExecutorOptions(watermark=1))
    else:
        probe = Loopback(cfg, layout)
        most = max(probe.setup(_ckpt(cfg, 1)).memory.chunk)
        lb = Loopback(cfg, layout, pool_bytes=most)
    for step in (1, 2):
        src = _ckpt(cfg, step)
        st = lb.transfer(src)
        assert lb.verify(src) == []
        pool = lb.executor.memory.pool
        assert pool.peak <= pool.nbytes and pool.in_use == 0
    if how == "watermark":
        assert pool.nbytes == max(lb.executor.memory.chunk) + 1 and pool.peak == max(lb.executor.memory.chunk)
        recs = st.records
        assert all(b.start >= a.end for a, b in zip(recs, recs[1:]))


def test_a_shard_reallocated_after_setup_is_refused_naming_it():
    from weight_transfer.testing.catalog import load_config
    from weight_transfer.types import InferenceLayout

    cfg = load_config("qwen3-0.6b", **TINY)
    lb = Loopback(cfg, InferenceLayout(tp=2))
    ex = lb.setup(_ckpt(cfg, 1))
    name = "model.norm.weight"  # a plain recipe: written from the shard itself
    lb.sources[name] = lb.sources[name].clone()  # not in place: a new storage
    with pytest.raises(RuntimeError, match="storage changed since the executor was built; update shards in place"):
        ex.run()


# ---------------------------------------------------------------------------------------------
# C28: a rank that fails (or is cancelled) still makes every collective of the plan


class FakeDT:
    """Stands in for a DTensor source: ``full_tensor()`` is logged (the collective every rank
    of the mesh must call, in plan order); ``fail``: that call raises (a broken collective)."""

    def __init__(self, name, log, fail=False):
        self.name, self.log, self.fail = name, log, fail

    def full_tensor(self):
        self.log.append(("gather", self.name))
        if self.fail:
            raise RuntimeError(f"gloo: connection closed by peer during {self.name}")
        return torch.zeros(2)

    def to_local(self):
        return torch.zeros(2)


@pytest.fixture
def fake_dtensors(monkeypatch):
    import weight_transfer.pipeline.executor as ex
    import weight_transfer.pipeline.stages as stages
    import weight_transfer.pipeline.tasks as tasks

    for mod in (ex, stages, tasks):
        monkeypatch.setattr(mod, "DTensor", FakeDT)
    return ex


def _collective_world(log, fail_source=None):
    names = [f"p{i}" for i in range(5)]
    tasks = fake_tasks([10] * 5, groups=[0, 0, 1, 1, 2], sources=[(n,) for n in names])
    params = {n: FakeDT(n, log, fail=(n == fail_source)) for n in names}
    return tasks, params


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_rank_failing_in_prepare_still_makes_every_collective(fake_dtensors, monkeypatch, pipeline):
    """Task 1's prepare raises after its full_tensor(): the rest of the plan's full_tensor()
    calls and every group barrier are still made, in plan order, nothing more is built, and
    the update raises naming the stage and task (C28: the other ranks' collectives complete)."""
    log = []
    tasks, params = _collective_world(log)
    real, built = fake_dtensors.prepare_outputs, []

    def prepare_outputs(task, full, into=None):
        built.append(task.id)
        if task.id == 1:
            raise RuntimeError("injected: prepare fails")
        return real(task, full, into=into)
    monkeypatch.setattr(fake_dtensors, "prepare_outputs", prepare_outputs)
    ex = Executor(plan_of(tasks), params, None, {}, group_barrier=make_barrier(log), n_groups=3,
                  options=ExecutorOptions(pipeline=pipeline))
    with pytest.raises(RuntimeError, match=r"stage prepare of task 1 .*injected: prepare fails"):
        ex.run()
    assert [e for e in log if e[0] == "gather"] == [("gather", f"p{i}") for i in range(5)]
    assert [g for k, g, *_ in log if k == "issue"] == [0, 1] and [g for k, g, *_ in log if k == "wait"] == [0, 1]
    assert built == [0, 1]  # nothing built after the failure


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_cancelled_update_makes_its_collectives_and_posts_nothing(fake_dtensors, pipeline):
    """``run(cancel=...)`` set (another rank failed): the collectives still run, no write is
    posted, :class:`UpdateCancelled` is raised."""
    from weight_transfer.pipeline.executor import UpdateCancelled

    log = []
    tasks, params = _collective_world(log)
    cancel = threading.Event()
    cancel.set()
    tr = AsyncTransport()
    ex = Executor(plan_of(tasks), params, tr, {}, group_barrier=make_barrier(log), n_groups=3,
                  options=ExecutorOptions(pipeline=pipeline))
    with pytest.raises(UpdateCancelled, match="cancelled"):
        ex.run(cancel=cancel)
    assert len([e for e in log if e[0] == "gather"]) == 5
    assert [g for k, g, *_ in log if k == "issue"] == [0, 1]
    assert "post" not in [e[0] for e in tr.log]


def test_a_collective_that_fails_stops_the_collectives(fake_dtensors):
    """A full_tensor() that raises (the group is broken: a peer died) ends the collectives of
    this update: none after it (they could only block), and the error names it."""
    log = []
    tasks, params = _collective_world(log, fail_source="p2")
    ex = Executor(plan_of(tasks), params, None, {}, group_barrier=make_barrier(log), n_groups=3)
    with pytest.raises(RuntimeError, match=r"stage prepare of task 2 .*connection closed by peer"):
        ex.run()
    assert [e[1] for e in log if e[0] == "gather"] == ["p0", "p1", "p2"]
    assert [g for k, g, *_ in log if k == "issue"] == [0]  # the barrier after group 0 only
