"""The baselines (rank-0 funnel, per-tensor RPC update_weight) through real processes, with the
same verification as the reference; failure kinds of shared/CASES.md named by id; the RPC
client's timeout and error paths against real worker processes.

Fault-injecting variants live in this module and are selected with ``BASELINE_FAULT`` (set
before the trial; spawned ranks inherit the environment) and ``method="tests.baselines.test_common:"``.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import re
import time
from types import SimpleNamespace

import pytest
import torch

from weight_transfer.baselines.common import (
    BaselineStats,
    bucket_size,
    endpoint_fields,
    param_entries,
    plan_buckets,
    read_common,
)
from weight_transfer.baselines.funnel import FunnelController, FunnelInference, FunnelTrainer
from weight_transfer.baselines.options import BaselineOptions
from weight_transfer.baselines.rpc import RpcClient, RpcController, RpcError, RpcInference, RpcTrainer
from weight_transfer.control.protocol import ControlError
from weight_transfer.engines import engine_tensor_metas
from weight_transfer.experiments.config import TrialConfig
from weight_transfer.options import ControlOptions, TransferOptions
from weight_transfer.testing.catalog import param_specs

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(300)]

SMALL = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def small(**kw) -> TrialConfig:
    base = dict(model="qwen3-0.6b", overrides=SMALL, n_train=2, tp=2, steps=2, warmup=0, timeout=60)
    base.update(kw)
    return TrialConfig.from_flat(**base)


def landed_bytes(cfg: TrialConfig) -> int:
    mcfg = cfg.model_config()
    return sum(m.nbytes for i in range(cfg.n_infer) for m in engine_tensor_metas(mcfg, cfg.inference, i))


# --------------------------------------------------------------------------------------------
# fault-injecting methods (imported by the spawned ranks as module ``tests.baselines.test_common``)


class NoopFunnelTrainer(FunnelTrainer):
    """Broadcasts a manifest with no buckets and reports success: nothing moves (C11)."""

    def _lazy_init(self):
        super()._lazy_init()
        self.entries, self.buckets = [], []


class NoopRpcTrainer(RpcTrainer):
    """Sends only the ``finish`` RPC and reports success: nothing moves (C11)."""

    def transfer(self, step):
        if self.entries is None:
            _, self.landed = read_common(self.ctx.store, timeout=self.ctx.transfer.control.timeout)
            self.entries = []
        return super().transfer(step)


class ShortTimeoutRpcTrainer(RpcTrainer):
    RPC_TIMEOUT = 4.0

    def setup(self, ctx):
        super().setup(ctx)
        if self.client is not None:
            self.client.timeout = self.RPC_TIMEOUT


class DyingRpcInference(RpcInference):
    """The real RPC worker, except that inference rank 1 dies when update 3 starts (no reply,
    no goodbye)."""

    def receive(self, step):
        if self.ctx.rank == 1 and step == 3:
            os._exit(3)
        return super().receive(step)


_FAULTS = {
    "noop_funnel": (FunnelController, NoopFunnelTrainer, FunnelInference),
    "noop_rpc": (RpcController, NoopRpcTrainer, RpcInference),
    "kill_rpc": (RpcController, ShortTimeoutRpcTrainer, DyingRpcInference),
}


def __getattr__(name):
    """``CONTROLLER`` / ``TRAINER`` / ``INFERENCE`` of the fault named by ``BASELINE_FAULT``,
    read when the trial asks (the controller runs in this process, the ranks in spawned ones)."""
    sides = {"CONTROLLER": 0, "TRAINER": 1, "INFERENCE": 2}
    if name not in sides:
        raise AttributeError(name)
    return _FAULTS[os.environ["BASELINE_FAULT"]][sides[name]]


def run_faulty(monkeypatch, fault: str, cfg: TrialConfig):
    from weight_transfer.experiments.trial import run_trial

    monkeypatch.setenv("BASELINE_FAULT", fault)
    return run_trial(cfg.replace(method="tests.baselines.test_common:"))


# --------------------------------------------------------------------------------------------
# end to end


def check_verified_rows(cfg, rows, method):
    assert [r["verified"] for r in rows] == [True] * len(rows), [r.get("verify_error") for r in rows]
    ckpt = sum(s.nbytes for s in param_specs(cfg.model_config()))
    for r in rows:
        assert r["method"] == method
        assert r["bytes"] == landed_bytes(cfg)
        assert r["wire_bytes"] == cfg.n_infer * ckpt
        assert r["n_writes"] > 0 and r["seconds"] > 0


@dataclasses.dataclass(kw_only=True, slots=True)
class SmallBuckets(TrialConfig):
    """The trial config with a 64 KiB funnel bucket (``baseline.bucket_bytes``, which the funnel
    reads; ``bucket_bytes`` repeats it for the assertions), so one update has many buckets,
    packed ones and single-tensor ones."""

    bucket_bytes: int = 64 << 10

    def __post_init__(self):
        TrialConfig.__post_init__(self)
        self.baseline = BaselineOptions(bucket_bytes=self.bucket_bytes)


def test_funnel_c1_c10_c11_consecutive_versions_bit_exact():
    """Two consecutive versions into the same (poisoned, 0xA5) buffers, each verified: every
    byte of every destination tensor (incl. byte 0 and each tensor's edges) equals the
    engine oracle of that step, alignment gaps untouched (C1, C10, C11 restore). ``bytes`` is
    the landed quantity, the same as the reference's; ``wire_bytes`` the checkpoint once per
    inference rank."""
    from weight_transfer.experiments.trial import run_trial

    cfg = SmallBuckets(**{f.name: getattr(small(method="rank0_funnel", poison=True), f.name)
                          for f in dataclasses.fields(TrialConfig)})
    res = run_trial(cfg)
    assert [r["step"] for r in res.rows] == [1, 2]
    check_verified_rows(cfg, res.rows, "rank0_funnel")
    buckets = plan_buckets(param_entries({0: collect_metas_for(cfg)}), cfg.bucket_bytes)
    assert any(len(b) == 1 and bucket_size(b) > cfg.bucket_bytes for b in buckets)
    assert any(len(b) > 1 for b in buckets)
    assert all(r["n_writes"] == len(buckets) for r in res.rows)


def collect_metas_for(cfg):
    """Training metadata as a single rank holding everything would publish it."""
    from weight_transfer.types import ParamMeta

    return [ParamMeta(name=s.name, global_shape=s.shape, dtype=s.dtype, mesh_ranks=(0,), placements=("Replicate()",),
                      local_offset=(0,) * len(s.shape), local_shape=s.shape) for s in param_specs(cfg.model_config())]


def test_plan_buckets_covers_every_tensor_once_aligned_and_bounded():
    from weight_transfer.baselines.common import BUCKET_ALIGN, ParamEntry

    sizes = [1, 3, 100, 4096, 70000, 5, 0, 65536, 65535, 2]
    entries = [ParamEntry(f"t{i}", (n,), "bfloat16", 0) for i, n in enumerate(sizes)]
    buckets = plan_buckets(entries, 64 << 10)
    assert [it.name for b in buckets for it in b] == [e.name for e in entries]
    for b in buckets:
        spans = sorted((it.offset, it.offset + it.nbytes) for it in b)
        assert all(a % BUCKET_ALIGN == 0 for a, _ in spans)
        assert all(spans[k][1] <= spans[k + 1][0] for k in range(len(spans) - 1))
        assert len(b) == 1 or bucket_size(b) <= 64 << 10


def test_c1_oracle_of_consecutive_steps_differs_in_every_tensor():
    """C1's premise: a transfer that does not happen cannot verify, because every
    destination tensor of step 2 differs from step 1 (so two verified versions prove both
    landed)."""
    from weight_transfer.experiments.verify import expected_engine

    cfg = small()
    for rank in range(cfg.n_infer):
        a = expected_engine(cfg.model_config(), cfg.inference, rank, step=1, seed=cfg.run.seed).named_parameters()
        b = expected_engine(cfg.model_config(), cfg.inference, rank, step=2, seed=cfg.run.seed).named_parameters()
        same = [n for n in a if a[n].numel() and torch.equal(a[n].view(-1).view(torch.uint8), b[n].view(-1).view(torch.uint8))]
        assert not same


@pytest.mark.parametrize("fault", ["noop_funnel", "noop_rpc"])
def test_c11_update_that_moves_nothing_fails_verification(monkeypatch, fault):
    """The method reports success (and claims the landed bytes) but moved nothing: the
    poisoned destinations do not verify."""
    res = run_faulty(monkeypatch, fault, small(steps=1, poison=True))
    assert [r["verified"] for r in res.rows] == [False]
    assert "qkv_proj" in res.rows[0]["verify_error"] or "mismatch" in res.rows[0]["verify_error"]


def test_rpc_c1_c10_c11_versions_bit_exact_then_dead_worker_fails_update(monkeypatch, capfd):
    """The RPC baseline (its real worker) lands two consecutive versions into the same
    poisoned buffers, each verified bit-exact (C1, C10, C11 restore, as for the funnel). Then
    inference worker 1 dies at update 3: the controller names it at once (``inference 1``),
    the update fails, and the weights are marked incomplete (never
    version 2 over changed bytes). (One trial for both,
    to keep the multi-process tests short.)"""
    from weight_transfer.control import protocol as control
    from weight_transfer.experiments import trial

    made = []

    class Recording(control.Controller):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    monkeypatch.setattr(trial.control, "Controller", Recording)
    seen = []
    monkeypatch.setenv("BASELINE_FAULT", "kill_rpc")
    t0 = time.monotonic()
    cfg = small(steps=3, poison=True)
    with pytest.raises(ControlError, match="step 3") as ei:
        trial.run_trial(cfg.replace(method="tests.baselines.test_common:"), progress=seen.append)
    assert time.monotonic() - t0 < 110
    assert [r["step"] for r in seen] == [1, 2]
    check_verified_rows(cfg, seen, "tests.baselines.test_common:")
    assert made[0].state().state == "incomplete" and made[0].state().version == 3  # never "2" over changed bytes
    assert int(made[0].store.get("version")) == -1
    # the controller names the dead worker at once (issue 15), before training rank 0's RPC
    # times out on it (that path: the RPC client tests below)
    assert re.search(r"inference 1: process \d+ exited with code 3", str(ei.value)), str(ei.value)


# --------------------------------------------------------------------------------------------
# the RPC client against real worker processes


class _FakeStore:
    def check(self, keys):
        return False


class _RecordingEngine:
    """Stands in for the engine: records what load_weights got; refuses names with 'bad'."""

    def __init__(self):
        self.got = {}
        self.finished = 0

    def load_weights(self, weights):
        for name, t in weights:
            if "bad" in name:
                raise KeyError(f"unknown checkpoint tensor {name!r}")
            self.got[name] = t.clone()

    def process_weights_after_loading(self):
        self.finished += 1

    def tensor_metas(self):
        return []


def _worker(rank: int, conn) -> None:
    eng = _RecordingEngine()
    ctx = SimpleNamespace(rank=rank, engine=eng, store=_FakeStore(), transfer=TransferOptions(control=ControlOptions(timeout=30.0)),
                          log=lambda m: None)
    side = RpcInference()
    desc, _ = side.setup(ctx)
    conn.send(endpoint_fields(desc)["endpoint"])
    step = 1
    while True:
        try:
            stats = side.receive(step)
            conn.send(("done", stats, {n: t for n, t in eng.got.items()}, eng.finished))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        step += 1


@pytest.fixture()
def workers():
    ctx = mp.get_context("spawn")
    procs, conns, eps = [], [], {}
    for i in range(2):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_worker, args=(i, b), daemon=True)
        p.start()
        procs.append(p)
        conns.append(a)
    for i, a in enumerate(conns):
        assert a.poll(60), "worker did not start"
        eps[i] = a.recv()
    yield procs, conns, eps
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


def test_rpc_round_trip_error_reply_and_dead_worker(workers):
    procs, conns, eps = workers
    client = RpcClient(eps, timeout=5.0)
    try:
        # bit-exact round trip of awkward tensors (odd sizes, bf16 / fp32, empty), then finish
        sent = {"a.weight": torch.randn(3, 257).to(torch.bfloat16), "b.bias": torch.randn(7),
                "empty.weight": torch.empty(0, 5, dtype=torch.bfloat16)}
        for name, t in sent.items():
            data = t.contiguous().view(-1).view(torch.uint8) if t.numel() else None
            replies = client.call({"op": "load", "name": name, "dtype": str(t.dtype).removeprefix("torch."),
                                   "shape": tuple(t.shape)}, memoryview(data.numpy()) if data is not None else b"")
            assert set(replies) == {0, 1} and all(r["ok"] for r in replies.values())
        client.call({"op": "finish", "step": 1})
        for a in conns:
            kind, stats, got, finished = a.recv()
            assert kind == "done" and finished == 1 and stats["tensors"] == 3
            for name, t in sent.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape
                assert torch.equal(got[name].view(-1).view(torch.uint8) if t.numel() else got[name],
                                   t.view(-1).view(torch.uint8) if t.numel() else t)

        # a worker-side exception comes back as an error naming the worker and the tensor
        with pytest.raises(RpcError) as ei:
            client.call({"op": "load", "name": "model.bad.weight", "dtype": "float32", "shape": (2,)},
                        memoryview(torch.zeros(2).view(torch.uint8).numpy()))
        msg = str(ei.value)
        assert "model.bad.weight" in msg and "inference worker 0 at tcp://" in msg and "infer 1" in msg
        assert "KeyError" in msg
        client.abort("test")  # workers drop the update and say why
        for a in conns:
            kind, why = a.recv()
            assert kind == "error" and "aborted by training rank 0" in why

        # a dead worker: the call fails within the timeout, naming only the dead worker
        procs[1].kill()
        procs[1].join(5)
        t0 = time.monotonic()
        with pytest.raises(RpcError) as ei:
            client.call({"op": "load", "name": "c.weight", "dtype": "float32", "shape": (4,)},
                        memoryview(torch.ones(4).view(torch.uint8).numpy()), timeout=1.5)
        dt = time.monotonic() - t0
        assert 1.4 <= dt < 10  # at its timeout, not at the default one
        msg = str(ei.value)
        assert f"no reply from inference worker(s) 1 at {eps[1]} within 1.5 s" in msg
        assert "'c.weight'" in msg and f"0 at {eps[0]}" not in msg
    finally:
        client.close()


def test_stats_shape_matches_what_the_trial_reads():
    st = BaselineStats(rank=0, bytes_sent=10, wire_bytes=20, n_writes=3, peak_temp_bytes=5)
    assert (st.bytes_sent, st.n_writes, st.peak_temp_bytes, st.records, st.stage_busy()) == (10, 3, 5, [], {})


# --------------------------------------------------------------------------------------------
# what crosses between processes is data (no pickle): the funnel's manifest, the RPC's headers


def test_funnel_manifest_round_trip_and_refusals():
    import msgspec

    from weight_transfer.baselines.common import BucketItem
    from weight_transfer.baselines.funnel import Manifest, ManifestError, decode_manifest, encode_manifest

    m = Manifest(3, [[BucketItem("a.weight", (2, 3), "bfloat16", 0, 12), BucketItem("b", (), "float32", 16, 4)]])
    raw = encode_manifest(m)
    assert decode_manifest(raw) == m and raw[:1] != b"\x80"  # msgpack, not a pickle
    enc = msgspec.msgpack.encode
    for bad, why in (({"step": 1, "buckets": [], "extra": 1}, "unknown field"),
                     ({"step": "1", "buckets": []}, "Expected `int`"),
                     ({"step": 1, "buckets": [[["a", [2], "bfloat16", 0, 4, 99]]]}, "at most length 5"),
                     (b"\x80\x04N.", None)):
        with pytest.raises(ManifestError, match=why or "not one"):
            decode_manifest(bad if isinstance(bad, bytes) else enc(bad))


def test_rpc_header_that_is_not_a_request_is_refused_and_the_worker_serves_on():
    import threading

    import msgspec
    import zmq

    from weight_transfer.baselines.rpc import RpcServer

    server = RpcServer()
    got = []
    t = threading.Thread(target=lambda: got.append(server.recv(10)), daemon=True)
    t.start()
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.endpoint)
    try:
        for bad in (b"\x80\x04\x95garbage.", msgspec.msgpack.encode({"op": "exec", "id": 1}),
                    msgspec.msgpack.encode({"op": "load", "id": 2, "name": "x", "shape": [1], "dtype": "bfloat16",
                                            "code": "os.system"})):
            s.send_multipart([b"", bad])
            assert s.poll(5000)
            rep = msgspec.msgpack.decode(s.recv_multipart()[-1])
            assert rep["ok"] is False and "refused an RPC request" in rep["error"], rep
        s.send_multipart([b"", msgspec.msgpack.encode({"op": "finish", "id": 7, "step": 2})])
        t.join(10)
        header, frame = got[0]
        assert (header.op, header.id, header.step, frame) == ("finish", 7, 2, None)
    finally:
        s.close(linger=0)
        server.close()
