"""weight_transfer.metrics: the Prometheus metrics of every update (docs/METRICS.md). The
coordinator's collector against a synthetic UpdateResult (every value of the exposition text,
parsed as Prometheus parses it), failures by kind, the ``metrics=`` argument refused before the
store, a served endpoint, a Coordinator with metrics through the public API (pushes and a
refusal), and the inference side's metrics -- in-process and through
``PROMETHEUS_MULTIPROC_DIR`` (how vLLM's ``/metrics`` reads a worker's), in a child process.
The same metrics during ``weight-transfer rl``: tests/engines/vllm/test_rl_loop.py."""
from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import weight_transfer as wt
from weight_transfer.api.update import UpdateResult
from weight_transfer.control.protocol import ControlError, VersionError
from weight_transfer.metrics import (
    BUCKETS,
    FINGERPRINT_MISMATCH,
    UpdateMetrics,
    WorkerMetrics,
    delta_ratio,
    failure_kind,
    metrics_arg,
    phase_seconds,
    recorded,
)
from weight_transfer.pipeline.records import StepStats, TaskRecord


def samples(text: str) -> dict[tuple, float]:
    """``{(sample name, ((label, value), ...)): value}`` of an exposition text."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _stats(rank: int, prepare: list[tuple[float, float]], sent: int, full: int) -> StepStats:
    recs = [TaskRecord(task=k, group=0, stages={"prepare": ab, "write": (ab[1], ab[1] + 0.5)})
            for k, ab in enumerate(prepare)]
    return StepStats(rank=rank, bytes_sent=sent, n_writes=10 + rank, full_bytes=full, records=recs)


def _result(version: int = 7) -> UpdateResult:
    """A synthetic update: two training ranks (prepare busy 0.25 s and 0.5 s: overlapping
    intervals count once), a delta (300 of 1000 bytes), two shadow go-lives (0.002 s and
    0.004 s), a sampled fingerprint check."""
    stats = {0: _stats(0, [(1.0, 1.125), (1.1, 1.25)], 100, 400),
             1: _stats(1, [(2.0, 2.25), (3.0, 3.25)], 200, 600)}
    commits = {("commit", 0): {"mode": "flip", "seconds": 0.002, "bytes": 0},
               ("commit", 1): {"mode": "copy", "seconds": 0.004, "bytes": 64}}
    return UpdateResult(version=version, seconds=1.5, write_seconds=1.0, bytes=300, n_writes=21, stats=stats,
                        commits=commits, verify="sample", verified_bytes=128, verify_seconds=0.25)


def test_phases_of_a_result_are_what_was_measured():
    r = _result()
    assert phase_seconds(r) == {"prepare": 0.5, "write": 1.0, "commit": 0.25, "go_live": 0.004, "verify": 0.25}
    assert delta_ratio(r) == 0.3
    plain = UpdateResult(version=1, seconds=0.5, write_seconds=0.5, bytes=8, n_writes=1)
    assert phase_seconds(plain) == {"write": 0.5} and delta_ratio(plain) is None  # no stages, no commit, no check
    call = UpdateResult(version=1, seconds=0.5, write_seconds=0.25, bytes=8, n_writes=1,
                        commits={("commit", "call"): {"go_live_s": 0.125, "ready_wait_s": 0.0}})
    assert phase_seconds(call) == {"write": 0.25, "commit": 0.25, "go_live": 0.125}  # the vLLM backend's shadows


def test_exposition_of_one_update_and_failures_by_kind():
    m = UpdateMetrics()
    assert recorded(m, lambda: _result(7)).version == 7
    m.failed(VersionError("push(version=7): refused"), before_go=True)
    m.failed(ControlError("step 8: update failed"))
    inner = ControlError("fingerprint mismatch in version 8 (1 range(s))", kind=FINGERPRINT_MISMATCH)

    def update():  # fails after its go: the error as the coordinator sees it, the check's below
        raise ControlError("step 8: update failed, weights marked incomplete") from inner
    with pytest.raises(ControlError):
        recorded(m, update)
    s = samples(m.text())
    P = "weight_transfer_"
    assert s[(P + "weights_version", ())] == 7
    assert s[(P + "last_update_bytes", ())] == 300 and s[(P + "last_update_seconds", ())] == 1.5
    assert s[(P + "last_update_delta_ratio", ())] == 0.3 and s[(P + "last_update_stall_seconds", ())] == 0.004
    assert s[(P + "last_update_timestamp_seconds", ())] > 1.7e9
    assert s[(P + "update_bytes_total", ())] == 300 and s[(P + "update_writes_total", ())] == 21
    assert {k[1][0][1]: v for k, v in s.items() if k[0] == P + "updates_total"} == {"ok": 1, "failed": 2, "refused": 1}
    assert {k[1][0][1]: v for k, v in s.items() if k[0] == P + "update_failures_total"} == {
        "VersionError": 1, "ControlError": 1, FINGERPRINT_MISMATCH: 1}
    assert s[(P + "fingerprint_checks_total", (("mode", "sample"),))] == 1
    assert s[(P + "fingerprint_verified_bytes_total", ())] == 128
    assert s[(P + "fingerprint_mismatches_total", ())] == 1
    for phase, sec in {"prepare": 0.5, "write": 1.0, "commit": 0.25, "go_live": 0.004, "verify": 0.25}.items():
        lab = (("phase", phase),)
        assert s[(P + "update_phase_seconds_count", lab)] == 1 and s[(P + "update_phase_seconds_sum", lab)] == sec
        for le in BUCKETS:  # cumulative: 1 from the first bound >= the observation on
            assert s[(P + "update_phase_seconds_bucket", (("le", str(le)), ("phase", phase)))] == (le >= sec), (phase, le)
        assert s[(P + "update_phase_seconds_bucket", (("le", "+Inf"), ("phase", phase)))] == 1
    assert s[(P + "update_seconds_count", ())] == 1 and s[(P + "update_seconds_sum", ())] == 1.5
    # before any update: the counters are 0, the last-update gauges absent
    fresh = samples(UpdateMetrics().text())
    assert fresh[(P + "updates_total", (("outcome", "ok"),))] == 0 and (P + "weights_version", ()) not in fresh


def test_failure_kind():
    assert failure_kind(VersionError("x")) == "VersionError"
    e = ControlError("outer")
    e.__cause__ = RuntimeError("inner")
    assert failure_kind(e) == "ControlError"
    e.__cause__.metrics_kind = "fingerprint_error"
    assert failure_kind(e) == "fingerprint_error"


def test_metrics_argument_is_checked_before_the_store():
    m, serve = metrics_arg(None)
    assert m is None and serve() is None
    m, serve = metrics_arg(0)
    assert isinstance(m, UpdateMetrics) and m.server is None  # served by the caller, once the store answered
    serve()
    assert m.port > 0 and m.url.endswith(f":{m.port}/metrics")
    m.close()
    reg = CollectorRegistry()
    m, serve = metrics_arg(reg)
    serve()
    assert m.registry is reg and m.server is None and b"weight_transfer_updates_total" in generate_latest(reg)
    with pytest.raises(ValueError, match="already has these metrics"):
        metrics_arg(reg)
    assert metrics_arg(m)[0] is m
    UpdateMetrics(), UpdateMetrics()  # private registries: two coordinators of one process do not collide
    dead = ("127.0.0.1", 9)  # nothing listens: the store would time out; the argument is refused first
    for bad, err in ((True, TypeError), ("9100", TypeError), (-1, ValueError), (65536, ValueError)):
        with pytest.raises(err, match="Coordinator: metrics="):
            wt.Coordinator(dead, n_train=1, n_infer=1, metrics=bad, timeout=30)


def test_serve_answers_a_scrape():
    m = UpdateMetrics()
    port = m.serve(0)
    try:
        assert port > 0 and m.url == f"http://127.0.0.1:{port}/metrics"
        m.observe(_result(3))
        text = urllib.request.urlopen(m.url, timeout=10).read().decode()
        assert samples(text)[("weight_transfer_weights_version", ())] == 3
        with pytest.raises(RuntimeError, match="already serving"):
            m.serve(0)
    finally:
        m.close()


def test_coordinator_metrics_advance_per_push(monkeypatch):
    """Through the public API (one process, the stand-in engine, ``verify="full"``): two clean
    pushes, a refused one, then a byte flipped after the writes -- caught by the fingerprint
    check, counted as ``fingerprint_mismatch``."""
    from weight_transfer.engines import Engine

    from .helpers.api_small import CFG, LAYOUT, weights

    store = wt.serve_store("127.0.0.1", 0)
    addr = ("127.0.0.1", store.port)
    engine = Engine(CFG, LAYOUT, 0)
    rx = wt.Receiver.from_arena(engine.arena, engine.tensor_metas(), rank=0, store=addr)
    coord = wt.Coordinator(addr, n_train=1, n_infer=1, model_config=CFG, layout=LAYOUT, metrics=0, verify="full",
                           timeout=20)
    tx = wt.Sender(weights(1), rank=0, world_size=1, store=addr, coordinator=coord)
    try:
        url = coord.metrics.url
        for v in (1, 2):
            tx.push(v)
            s = samples(urllib.request.urlopen(url, timeout=10).read().decode())
            assert s[("weight_transfer_weights_version", ())] == v
            assert s[("weight_transfer_updates_total", (("outcome", "ok"),))] == v
            assert s[("weight_transfer_update_bytes_total", ())] == v * tx.last_update.bytes
            assert s[("weight_transfer_fingerprint_verified_bytes_total", ())] == v * tx.last_update.bytes
            assert s[("weight_transfer_fingerprint_checks_total", (("mode", "full"),))] == v
            for phase in ("prepare", "write", "verify"):
                assert s[("weight_transfer_update_phase_seconds_count", (("phase", phase),))] == v
            assert s[("weight_transfer_last_update_delta_ratio", ())] == 1.0
        with pytest.raises(wt.VersionError):
            tx.push(2)
        real = tx.executor.run

        def run(step=None, cancel=None):
            st = real(step, cancel=cancel)
            engine.arena[engine.arena.numel() // 2] ^= 0x01  # after every write completed, before the check
            return st
        monkeypatch.setattr(tx.executor, "run", run)
        with pytest.raises(wt.ControlError, match="fingerprint mismatch in version 3"):
            tx.push(3)
        s = samples(coord.metrics.text())
        assert {k[1][0][1]: v for k, v in s.items() if k[0] == "weight_transfer_updates_total"} == {
            "ok": 2, "refused": 1, "failed": 1}
        assert {k[1][0][1]: v for k, v in s.items() if k[0] == "weight_transfer_update_failures_total"} == {
            "VersionError": 1, FINGERPRINT_MISMATCH: 1}
        assert s[("weight_transfer_fingerprint_mismatches_total", ())] == 1
        assert s[("weight_transfer_weights_version", ())] == 2
    finally:
        tx.close()
        rx.close()
        coord.metrics.close()


def test_worker_metrics_in_a_registry():
    reg = CollectorRegistry()
    w = WorkerMetrics(3, registry=reg)
    w.targets(4096)
    with w.commit(5, stats=lambda: {"bytes": 100, "mode": "copy", "seconds": 0.002}):
        pass
    with pytest.raises(RuntimeError), w.commit(6):
        raise RuntimeError("update_weights refused")
    s = samples(generate_latest(reg).decode())
    r = (("rank", "3"),)
    assert s[("weight_transfer_worker_weights_version", r)] == 5
    assert s[("weight_transfer_worker_target_bytes", r)] == 4096
    assert s[("weight_transfer_worker_committed_bytes_total", r)] == 100
    assert s[("weight_transfer_worker_commits_total", (("outcome", "ok"), ("rank", "3")))] == 1
    assert s[("weight_transfer_worker_commits_total", (("outcome", "failed"), ("rank", "3")))] == 1
    assert s[("weight_transfer_worker_commit_seconds_count", r)] == 1
    assert s[("weight_transfer_worker_go_live_seconds_sum", r)] == 0.002


CHILD = """
import os, sys
import prometheus_client                      # imported before the variable is set (a forked vLLM worker)
os.environ["PROMETHEUS_MULTIPROC_DIR"] = sys.argv[1]
from weight_transfer.metrics import WorkerMetrics
w = WorkerMetrics(1)
w.targets(2048)
with w.commit(4, stats={"bytes": 10}):
    pass
"""


def test_worker_metrics_reach_a_multiprocess_collector(tmp_path):
    """What vLLM's ``/metrics`` does with ``PROMETHEUS_MULTIPROC_DIR``: another process (the
    worker) records; this one reads the directory with ``MultiProcessCollector``."""
    from prometheus_client import multiprocess

    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], check=True, timeout=60)
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(tmp_path))
    s = samples(generate_latest(reg).decode())
    assert s[("weight_transfer_worker_weights_version", (("rank", "1"),))] == 4
    assert s[("weight_transfer_worker_target_bytes", (("rank", "1"),))] == 2048
    assert s[("weight_transfer_worker_commits_total", (("outcome", "ok"), ("rank", "1")))] == 1
    assert s[("weight_transfer_worker_committed_bytes_total", (("rank", "1"),))] == 10
