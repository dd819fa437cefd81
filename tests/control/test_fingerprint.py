"""End-to-end fingerprints (weight_transfer.control.fingerprint, C31 of shared/CASES.md): the units
(residue classes cover every write once per cycle, a range hashes the same however it is cut,
region bounds), then the faults through the public API in one process (a 1-rank training world,
the stand-in engine as the receiver, real CMA writes): a write that lands shifted, a range
written twice while another is not written, a byte flipped after the write, a flip shadow
that still holds the previous version -- each caught by ``verify="full"`` (the update fails
with ControlError naming the tensor and both ranks, nothing is published complete, or with
shadow targets nothing live is touched), and a persistent fault caught by ``"sample"`` within
its cycle. A clean run with ``"full"`` checks every byte of every update."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import weight_transfer as wt
from tests.helpers.api_small import CFG, LAYOUT
from tests.helpers.api_small import same as _same
from tests.helpers.api_small import weights as _weights
from weight_transfer.control import fingerprint as fp
from weight_transfer.engines import Engine
from weight_transfer.pipeline import hashes

TENSOR = "model.layers.0.mlp.down_proj.weight"


def test_sample_covers_every_write_once_per_cycle():
    rng = np.random.default_rng(0)
    dst = rng.integers(0, 8, 5000)
    offs = np.sort(rng.integers(0, 1 << 40, 5000)) & ~np.int64(63)
    for cycle in (1, 3, 8):
        hits = sum(fp.selected("sample", cycle, v, dst, offs).astype(int) for v in range(10, 10 + cycle))
        assert (hits == 1).all()  # each write exactly once in any `cycle` consecutive versions
        share = fp.selected("sample", cycle, 7, dst, offs).mean()
        assert abs(share - 1 / cycle) < 0.05  # about 1/cycle of the writes each version
    assert fp.selected("full", 8, 3, dst, offs).all() and not fp.selected("off", 8, 3, dst, offs).any()
    # the training side's per-write form agrees with the coordinator's vectorized one
    got = [fp.residue(int(d), int(o), 8) for d, o in zip(dst[:500], offs[:500])]
    assert got == fp.residues(dst[:500], offs[:500], 8).tolist()


def test_a_range_hashes_the_same_however_it_is_cut_and_differs_for_one_byte():
    b = torch.randint(0, 256, (10_000,), dtype=torch.uint8)
    whole = fp.hash_pieces([b], b.numel())
    assert fp.hash_pieces([b[:1], b[1:4096], b[4096:]], b.numel()) == whole
    c = b.clone()
    c[9999] ^= 1
    assert fp.hash_pieces([c], c.numel()) != whole
    with pytest.raises(ValueError, match="pieces hold 9999 bytes, the range is 10000"):
        fp.hash_pieces([b[1:]], 10_000)
    a = np.arange(5, dtype=np.uint64) * np.uint64(1 << 63)
    assert (fp.unpack(fp.pack(a), np.uint64) == a).all()


def test_fold64_is_the_same_however_the_bytes_are_cut_and_sees_one_byte(monkeypatch):
    """The device-side hash (``algo="fold64"``, torch integer ops where the bytes are): the same
    value for any cut into pieces and any step size, a different one for one changed byte or two
    swapped bytes; run here on the CPU, on a GPU by the ``gpu`` test below."""
    b = torch.randint(0, 256, (100_003,), dtype=torch.uint8)
    whole = fp.hash_pieces([b], b.numel(), "fold64")
    monkeypatch.setattr(hashes, "FOLD_CHUNK", 4093)  # the hash lives in pipeline.hashes
    assert fp.hash_pieces([b[:5], b[5:77_777], b[77_777:]], b.numel(), "fold64") == whole
    for at, delta in ((0, 1), (50_000, 128), (100_002, 255)):
        c = b.clone()
        c[at] ^= delta
        assert fp.hash_pieces([c], c.numel(), "fold64") != whole
    c = b.clone()
    c[[10, 20]] = torch.tensor([1, 2], dtype=torch.uint8)
    d = c.clone()
    d[[10, 20]] = torch.tensor([2, 1], dtype=torch.uint8)
    assert fp.hash_pieces([c], c.numel(), "fold64") != fp.hash_pieces([d], d.numel(), "fold64")
    with pytest.raises(ValueError, match="pieces hold 100002 bytes, the range is 100003"):
        fp.hash_pieces([b[1:]], b.numel(), "fold64")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fold64_on_a_gpu_equals_the_host_value_and_xxh3_copies_to_the_host():
    b = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8)
    g = b.cuda()
    assert fp.hash_pieces([g[:12345], g[12345:]], b.numel(), "fold64") == fp.hash_pieces([b], b.numel(), "fold64")
    assert fp.hash_pieces([g], b.numel(), "xxh3") == fp.hash_pieces([b], b.numel(), "xxh3")


def test_auto_picks_fold64_for_gpu_receivers():
    from types import SimpleNamespace as NS

    gpu = {0: (NS(transport="cuda_ipc"), []), 1: (NS(transport="cuda_ipc"), [])}
    host = {0: (NS(transport="cma"), [])}
    assert fp.plan_value(wt.VerifyOptions(mode="full"), gpu)["algo"] == "fold64"
    assert fp.plan_value(wt.VerifyOptions(mode="full"), host)["algo"] == "xxh3"
    assert fp.plan_value(wt.VerifyOptions(mode="full", algo="fold64"), host)["algo"] == "fold64"
    with pytest.raises(ValueError, match="one of auto, xxh3, fold64"):
        wt.VerifyOptions(algo="md5")


def test_verify_options_are_checked():
    with pytest.raises(ValueError, match="verify='some'.*one of off, sample, full"):
        wt.VerifyOptions(mode="some")
    with pytest.raises(ValueError, match="an int >= 1"):
        wt.VerifyOptions(mode="sample", cycle=0)
    with pytest.raises(ValueError, match="verify='x'"):
        wt.Coordinator(("127.0.0.1", 1), n_train=1, n_infer=1, verify="x")


@pytest.fixture
def job():
    """A job whose coordinator runs ``verify`` (a callable building the world for a mode)."""
    made = []

    def make(verify: str, *, cycle: int = 8, shadow: str | None = None, algo: str = "auto"):
        store = wt.serve_store("127.0.0.1", 0)
        addr = ("127.0.0.1", store.port)
        engine = Engine(CFG, LAYOUT, 0)
        engine.arena.fill_(0xA5)
        if shadow is None:
            rx = wt.Receiver.from_arena(engine.arena, engine.tensor_metas(), rank=0, store=addr)
        else:
            rx = wt.Receiver.from_arena(engine.arena, engine.tensor_metas(), rank=0, store=addr, shadow=shadow,
                                        adopt=engine.rebind if shadow == "flip" else None)
        opts = wt.TransferOptions(verify=wt.VerifyOptions(mode=verify, cycle=cycle, algo=algo))
        coord = wt.Coordinator(addr, n_train=1, n_infer=1, model_config=CFG, layout=LAYOUT, options=opts, timeout=20)
        params = _weights(1)
        tx = wt.Sender(params, rank=0, world_size=1, store=addr, coordinator=coord)
        made.append((tx, rx, store))
        return engine, rx, tx, params

    yield make
    for tx, rx, _store in made:
        tx.close()
        rx.close()


def _step(params, v: int):
    new = _weights(v)
    for n, t in params.items():
        t.copy_(new[n])
    return new


def _patch_ops(monkeypatch, tx, edit):
    """Let ``edit(ops)`` change the batch of every task (the data plane's view, not the plan's)."""
    mem = tx.executor.memory
    real = mem.ops

    def ops(*a, **k):
        out, copied = real(*a, **k)
        return edit(out), copied
    monkeypatch.setattr(mem, "ops", ops)


def _target(engine, tx, name=TENSOR):
    m = next(m for m in engine.tensor_metas() if m.name == name)
    return m.offset, m.nbytes


def _clean(tx, engine, params, v: int):
    new = _step(params, v)
    tx.push(v)
    up = tx.last_update
    _same(engine, new)
    return up


def test_full_checks_every_byte_of_a_clean_update(job):
    engine, rx, tx, params = job("full")
    for v in (1, 2):
        up = _clean(tx, engine, params, v)
        assert up.verify == "full" and up.verified_bytes == up.bytes == sum(m.nbytes for m in engine.tensor_metas())
        assert 0 < up.verify_seconds < up.seconds


def _expect_caught(tx, rx, v: int, what: str):
    with pytest.raises(wt.ControlError) as ei:
        tx.push(v)
    msg = str(ei.value)
    assert f"fingerprint mismatch in version {v}" in msg and what in msg, msg
    assert "on inference 0, written by training 0" in msg, msg
    s = rx.state()
    assert not (s.complete and s.version == v)  # never published complete over the wrong bytes
    return msg


def test_full_catches_a_write_that_lands_shifted(job, monkeypatch):
    engine, rx, tx, params = job("full")
    _clean(tx, engine, params, 1)
    off, n = _target(engine, tx)

    def shift(ops):
        return [type(o)(o.local, o.local_offset, o.remote, o.remote_offset + 2, o.length, o.segments)
                if o.remote_offset == off else o for o in ops]
    _patch_ops(monkeypatch, tx, shift)
    _step(params, 2)
    _expect_caught(tx, rx, 2, f"{TENSOR} bytes [0, {n})")
    assert rx.state().state == "incomplete"
    monkeypatch.undo()
    _clean(tx, engine, params, 3)  # the next clean update restores a complete, verified version


def test_full_catches_a_range_written_twice_and_another_left_stale(job, monkeypatch):
    engine, rx, tx, params = job("full")
    _clean(tx, engine, params, 1)
    off, n = _target(engine, tx)

    seen: list = []

    def twice(ops):  # TENSOR's write replaced by a second copy of an earlier write (vllm#48312's kind)
        for k, o in enumerate(ops):
            if o.remote_offset == off and (seen or k):
                a = ops[k - 1] if k else seen[-1]
                ops[k] = type(a)(a.local, a.local_offset, a.remote, a.remote_offset, a.length, a.segments)
        seen.extend(o for o in ops if o.remote_offset != off)
        return ops
    _patch_ops(monkeypatch, tx, twice)
    _step(params, 2)
    _expect_caught(tx, rx, 2, f"{TENSOR} bytes [0, {n})")


@pytest.mark.parametrize("algo", ["xxh3", "fold64"])
def test_full_catches_a_byte_flipped_after_the_write(job, monkeypatch, algo):
    engine, rx, tx, params = job("full", algo=algo)
    _clean(tx, engine, params, 1)
    off, n = _target(engine, tx)
    real = tx.executor.run

    def run(step=None, cancel=None):
        st = real(step, cancel=cancel)
        engine.arena[off + n // 2] ^= 0x01  # after every write completed, before the coordinator publishes
        return st
    monkeypatch.setattr(tx.executor, "run", run)
    _step(params, 2)
    _expect_caught(tx, rx, 2, TENSOR)


def test_full_catches_a_flip_shadow_that_holds_the_previous_version_and_nothing_live_is_touched(job, monkeypatch):
    engine, rx, tx, params = job("full", shadow="flip")
    srv = rx.serve_go_live()
    first = _step(params, 1)
    tx.push(1)
    assert rx.wait_version(1).version == 1
    live = {k: t.clone() for k, t in engine.named_parameters().items()}
    _same(engine, first)
    # the writes of version 2 are lost on the way: the shadow half keeps the bytes of version 0 (C31)
    _patch_ops(monkeypatch, tx, lambda ops: [])
    _step(params, 2)
    with pytest.raises(wt.ControlError) as ei:
        tx.push(2)
    msg = str(ei.value)
    assert "nothing live was touched" in msg and "fingerprint mismatch in version 2" in msg, msg
    assert rx.version() == 1 and rx.state().complete and srv.golives[-1]["version"] == 1
    for k, t in engine.named_parameters().items():  # the engine still computes with version 1, every byte
        assert torch.equal(t.view(-1).view(torch.uint8), live[k].view(-1).view(torch.uint8)), k


def test_sample_catches_a_persistent_fault_within_its_cycle(job, monkeypatch):
    cycle = 4
    engine, rx, tx, params = job("sample", cycle=cycle)
    _clean(tx, engine, params, 1)
    off, n = _target(engine, tx)
    _patch_ops(monkeypatch, tx, lambda ops: [o for o in ops if o.remote_offset != off])  # never written again
    caught = None
    for v in range(2, 2 + cycle):
        _step(params, v)
        try:
            tx.push(v)
        except wt.ControlError as e:
            caught = (v, str(e))
            break
        assert tx.last_update.verify == "sample" and 0 < tx.last_update.verified_bytes < tx.last_update.bytes
    assert caught is not None, f"a range left stale for {cycle} versions was never checked"
    v, msg = caught
    assert f"fingerprint mismatch in version {v}" in msg and TENSOR in msg
    assert fp.selected("sample", cycle, v, 0, off)  # caught exactly when its residue class came up


def test_a_strided_gather_list_hashes_as_its_rows_in_order():
    """A TP column slice written from a row-major shard (one segment per row) is hashed as the
    rows concatenated, through one strided copy; an irregular list piece by piece."""
    from weight_transfer.transport import make_transport
    from weight_transfer.transport.base import Segments

    shard = torch.randint(0, 256, (64, 96), dtype=torch.uint8)
    tx = make_transport("cma")
    try:
        reg = tx.register(shard.view(-1))
        cols = shard[:, 16:48]
        rows = hashes._segment_pieces(reg, 16, Segments(np.arange(64) * 96, np.full(64, 32)))
        assert len(rows) == 1 and torch.equal(rows[0], cols.contiguous())
        odd = hashes._segment_pieces(reg, 0, Segments([96 * 5, 7, 300], [10, 20, 5]))
        flat = shard.view(-1)
        assert torch.equal(torch.cat(odd), torch.cat([flat[480:490], flat[7:27], flat[300:305]]))
        assert fp.hash_pieces(rows, 64 * 32) == fp.hash_pieces([cols.contiguous()], 64 * 32)
    finally:
        tx.close()
