"""The engine step clock (engines/vllm/worker/steps.py) and the AsyncLLM generation load
(experiments/vllm_load.py) that measure a vLLM engine's stall (issue 38).

Without vLLM: the clock's hooks on a toy module (times, token counts, idempotent install,
``since``, bounds, marks, uninstall), the gap and step-log helpers, the worker-extension methods
on a stand-in worker, and the span / arrival-gap checks on synthetic snapshots.

With vLLM (``vllm``, ``long``: an ``AsyncLLM`` of its own, about 1-2 min here): the tiny
Qwen3-MoE the backend tests use, the clock installed through ``collective_rpc``, 4 streaming
greedy requests for a few seconds: every engine step is recorded with its tokens, the gaps
between steps are small, tokens stream, every request finishes its full length with spans
covering its tokens and none is aborted; a ``collective_rpc`` holding the worker 0.3 s is
marked between two steps and shows as a gap; a ``pause_generation(mode="keep")`` of 1 s shows
as a ~1 s gap in the step clock and in the token arrivals.
"""
from __future__ import annotations

import bisect
import os
import time
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.vllm_server import LIVE_CPU, env_vars
from weight_transfer.engines.vllm.worker.steps import CLOCK_ATTR, StepClock, gaps, mark, max_gap, step_log
from weight_transfer.experiments.vllm_load import max_arrival_gap, span_problems, spans_ok


class Toy(torch.nn.Module):
    """Stands in for vLLM's top-level model: called with keyword arguments, like
    ``GPUModelRunner._model_forward`` calls it."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))

    def forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None):
        time.sleep(0.002)
        return positions.float() * 2


# ---------------------------------------------------------------------------- no engine


def test_clock_records_each_forward_with_its_tokens():
    m = Toy()
    t0 = time.time()
    clock = StepClock.install(m)
    assert StepClock.install(m) is clock and StepClock.of(m) is clock and getattr(m, CLOCK_ATTR) is clock
    assert len(m._forward_pre_hooks) == 1 and len(m._forward_hooks) == 1      # idempotent: hooks once
    for n in (7, 3, 3):
        m(input_ids=torch.zeros(n, dtype=torch.long), positions=torch.arange(n))
    m(input_ids=None, positions=torch.zeros(3, 5, dtype=torch.long))          # M-RoPE positions [3, N]
    recs = clock.records()
    assert [r[2] for r in recs] == [7, 3, 3, 5] and clock.n_steps == 4
    assert all(t0 <= a < b <= time.time() and b - a >= 0.002 for a, b, _ in recs)
    assert all(p[1] <= n[0] for p, n in zip(recs, recs[1:]))
    assert clock.records(since=recs[1][1]) == recs[2:]                        # poll with the last t_end seen
    assert [b - a for a, b in gaps(recs)] == [n[0] - p[1] for p, n in zip(recs, recs[1:])]
    clock.uninstall(m)
    m(positions=torch.arange(2))
    assert clock.n_steps == 4 and StepClock.of(m) is None and not m._forward_hooks and not m._forward_pre_hooks


def test_clock_is_bounded_and_marks_on_the_same_clock():
    m = Toy()
    clock = StepClock.install(m, maxlen=3)
    for _ in range(5):
        m(positions=torch.arange(1))
    snap = clock.snapshot()
    assert len(snap["steps"]) == 3 and snap["n_steps"] == 5 and snap["dropped_steps"] == 2 and snap["pid"] == os.getpid()
    assert snap["steps"] == clock.records()[-3:]
    t = time.time()
    assert mark(m, "go_live", t, t + 0.01, version=2) and not mark(Toy(), "go_live", t)   # no clock: nothing recorded
    clock.mark("handle", t + 1)
    assert clock.marks() == [("go_live", t, t + 0.01, {"version": 2}), ("handle", t + 1, t + 1, {})]
    assert clock.marks(since=t + 0.5) == [("handle", t + 1, t + 1, {})]


def test_max_gap_and_step_log():
    steps = [(0.0, 0.1, 4), (0.12, 0.2, 4), (1.2, 1.3, 4), (1.31, 1.4, 2)]
    assert max_gap(steps) == pytest.approx((1.0, 0.2, 1.2))
    assert max_gap(steps, start=1.25)[0] == pytest.approx(0.01)       # gaps ending before start are out
    assert max_gap(steps, end=0.11)[0] == pytest.approx(0.02)         # gaps beginning after end are out
    assert max_gap(steps[:1])[0] == 0.0
    marks = [("go_live", 0.5, 0.6, {"version": 3}), ("other", 0.0, 0.0, {"version": 9})]
    assert step_log(steps, marks, initial=2) == [[0.0, 0.1, 2, 4], [0.12, 0.2, 2, 4], [1.2, 1.3, 3, 4], [1.31, 1.4, 3, 2]]


def test_extension_methods_on_a_stand_in_worker():
    from weight_transfer.engines.vllm.extension import WeightTransferExtension

    m = Toy()
    worker = type("Worker", (WeightTransferExtension,), {})()
    worker.model_runner = SimpleNamespace(model=m)
    with pytest.raises(RuntimeError, match="wt_step_clock_install"):
        worker.wt_steps()
    with pytest.raises(RuntimeError, match="wt_step_clock_install"):
        worker.wt_step_mark("go_live")
    first = worker.wt_step_clock_install()
    assert worker.wt_step_clock_install() == first and first["pid"] == os.getpid() and first["tp_rank"] == 0
    m(positions=torch.arange(3))
    t0, t1 = worker.wt_step_mark("go_live", 0.01, version=1)
    m(positions=torch.arange(2))
    got = worker.wt_steps()
    assert [s[2] for s in got["steps"]] == [3, 2] and got["marks"] == [("go_live", t0, t1, {"version": 1})]
    assert t1 - t0 >= 0.01 and got["steps"][0][1] <= t0 and t1 <= got["steps"][1][0] and got["tp_rank"] == 0
    assert worker.wt_steps(since=t1)["marks"] == [] and len(worker.wt_steps(since=t1)["steps"]) == 1


def _snap(*reqs):
    requests = [{"id": f"r{i}", "finish_reason": fr, "tokens": [[t, 1, -0.1] for t in ts], "spans": sp}
                for i, (fr, ts, sp) in enumerate(reqs)]
    return {"requests": requests, "tokens": sorted([t[0], r["id"], i, 1] for r in requests for i, t in enumerate(r["tokens"]))}


def test_spans_ok_and_arrival_gaps():
    good = _snap(("length", [1.0, 1.1, 1.2], [["default", 0, 2], ["1", 2, 3]]), (None, [1.05], None))
    assert spans_ok(good) and span_problems(good) == []
    assert max_arrival_gap(good) == pytest.approx((0.1, 1.1, 1.2))
    assert max_arrival_gap(good, end=1.02)[0] == pytest.approx(0.05)
    assert max_arrival_gap(_snap(("length", [1.0], [["v", 0, 1]])))[0] == 0.0
    for spans, why in (([["default", 0, 2], ["1", 1, 3]], "after token 2"), ([["default", 0, 2]], "end at 2, 3 tokens"),
                       (None, "no spans"), ([["a", 1, 3]], "after token 0"), ([["a", 0, 0], ["b", 0, 3]], "after token 0")):
        bad = _snap(("length", [1.0, 1.1, 1.2], spans))
        assert not spans_ok(bad) and why in span_problems(bad)[0], (spans, span_problems(bad))


# ---------------------------------------------------------------------------- a live AsyncLLM

LOAD_S, PAUSE_S, HOLD_S = 3.0, 1.0, 0.3
"""Seconds of load before the probes, of the keep-pause, of the worker held by an RPC."""
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """An AsyncLLM on the tiny Qwen3-MoE with the step clock, under a load of 4 requests: a
    worker-holding RPC after :data:`LOAD_S` s, a keep-pause of :data:`PAUSE_S` s after that."""
    from weight_transfer.engines.vllm import write_checkpoint
    from weight_transfer.experiments.vllm_load import AsyncGenerationLoad, async_engine, run
    from weight_transfer.testing.catalog import load_config
    from weight_transfer.testing.tiny import TINY_QWEN3_MOE

    name, ov = TINY_QWEN3_MOE
    ckpt = write_checkpoint(load_config(name, **ov), tmp_path_factory.mktemp("ckpt") / "step0", step=0, seed=0)
    w = SimpleNamespace()
    with env_vars(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", VLLM_CPU_OMP_THREADS_BIND=LIVE_CPU):
        t = time.monotonic()
        with async_engine(ckpt, max_num_seqs=4) as (engine, loop):
            w.start_s = time.monotonic() - t
            w.installs = [run(loop, engine.collective_rpc("wt_step_clock_install")) for _ in range(2)]
            load = AsyncGenerationLoad(engine, loop, n_requests=4, max_tokens=MAX_TOKENS).start()
            time.sleep(LOAD_S)
            w.hold = run(loop, engine.collective_rpc("wt_step_mark", args=("probe", HOLD_S), kwargs={"n": 1}))[0]
            time.sleep(1.0)
            w.paused = load.pause_keep()
            w.paused_state = run(loop, engine.is_paused())
            time.sleep(PAUSE_S)
            w.resumed = load.resume()
            time.sleep(1.5)
            w.snap = load.stop(timeout=30)
            w.clock = run(loop, engine.collective_rpc("wt_steps"))[0]
            w.late = run(loop, engine.collective_rpc("wt_steps", args=(time.time(),)))[0]
    return w


@pytest.mark.vllm
@pytest.mark.long  # its own vLLM engine (1-2 min here): outside CI's 25-minute budget, make test-long
def test_step_clock_and_load_on_a_live_async_llm(live):
    w, snap, clock = live, live.snap, live.clock
    steps = clock["steps"]
    first = w.installs[0][0]
    assert w.installs[1][0] == first and clock["pid"] == first["pid"] != os.getpid()   # installed once, in the worker
    assert clock["n_steps"] == len(steps) and clock["dropped_steps"] == 0 and w.late["steps"] == []

    # steps recorded, with their tokens; the gaps between steps small while generating
    assert len(steps) >= 50, len(steps)
    assert all(a < b for a, b, _ in steps) and all(p[1] <= n[0] for p, n in zip(steps, steps[1:]))
    assert all(1 <= n for _, _, n in steps) and max(n for *_, n in steps) > 4          # prefills beside decodes
    steady = [b - a for a, b in gaps(steps) if b < w.hold[0] - 0.2 and a > snap["started_at"] + 0.5]
    steady.sort()
    p50, p99 = steady[len(steady) // 2], steady[int(len(steady) * 0.99)]
    durs = sorted(b - a for a, b, _ in steps)
    print(f"\n[steps] engine start {w.start_s:.1f} s; {len(steps)} steps, forward p50 {durs[len(durs) // 2] * 1e3:.1f} ms; "
          f"gap p50 {p50 * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {steady[-1] * 1e3:.1f} ms over {len(steady)} "
          f"steady gaps; {snap['n_tokens']} tokens in {snap['n_finished']} finished requests")
    assert p50 < 0.05 and p99 < 0.25, (p50, p99)

    # tokens streamed; every request its full length, spans covering its tokens, none aborted
    assert snap["n_aborted"] == 0 and snap["n_cancelled"] == 0 and snap["n_finished"] == snap["n_submitted"] >= 8
    assert snap["n_tokens"] == MAX_TOKENS * snap["n_finished"]
    assert all(r["finish_reason"] == "length" and len(r["tokens"]) == MAX_TOKENS for r in snap["requests"])
    assert spans_ok(snap), span_problems(snap)
    assert all(r["spans"] == [["default", 0, MAX_TOKENS]] for r in snap["requests"])
    assert all(lp is not None and lp <= 0 for r in snap["requests"] for _, _, lp in r["tokens"])
    assert sum(n for *_, n in steps) >= MAX_TOKENS * snap["n_submitted"]      # decodes + at least 1 prefill token each
    ends = [e for _, e, _ in steps]
    lags = sorted(t[0] - ends[bisect.bisect_right(ends, t[0]) - 1] for t in snap["tokens"])
    assert ends[0] <= snap["tokens"][0][0] and lags[len(lags) // 2] < 0.05, lags[len(lags) // 2]   # one clock: the
    # worker's step ends and the client's arrivals (a token arrives a few ms after the step that made it)

    # an RPC holding the worker runs between two steps, marked there: a gap of at least the hold
    t0, t1 = w.hold
    assert clock["marks"] == [("probe", t0, t1, {"n": 1})] and t1 - t0 >= HOLD_S
    assert not [s for s in steps if s[0] < t1 and s[1] > t0], "a step overlaps the RPC"
    g, a, b = max_gap(steps, t0, t1)
    assert a <= t0 and t1 <= b and HOLD_S <= g < HOLD_S + 0.3, (g, a, b, t0, t1)

    # a keep-pause of PAUSE_S: a ~PAUSE_S gap in the step clock and in the token arrivals
    assert w.paused_state and snap["pauses"] == [[w.paused, w.resumed]]
    g, a, b = max_gap(steps, w.paused, w.resumed)
    ga, aa, ba = max_arrival_gap(snap, w.paused, w.resumed)
    print(f"[pause] {w.resumed - w.paused:.3f} s paused: step gap {g:.3f} s, arrival gap {ga:.3f} s; "
          f"held {t1 - t0:.3f} s: step gap {max_gap(steps, t0, t1)[0]:.3f} s")
    assert a <= w.paused and w.resumed <= b + 0.05 and PAUSE_S - 0.05 <= g < PAUSE_S + 0.5, (g, a, b, w.paused, w.resumed)
    assert PAUSE_S - 0.05 <= ga < PAUSE_S + 0.6 and aa <= b and ba >= b, (ga, aa, ba, a, b)
