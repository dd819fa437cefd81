"""Shared-memory transport: what is specific to ``shm`` (the contract every transport shares,
bounds, stale descriptors, deregistered regions, bit-exact writes, is tests/transport/test_base.py).

The receiver (spawned, tests/helpers/transports.py) allocates its buffers through
``ShmTransport.allocate``, registers them and publishes their descriptors, then only answers
"show me your bytes" and the C17 region commands: it runs no code for the writes.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import threading
import time

import pytest
import torch

from tests.helpers.transports import C17_BYTES, POISON, start_receiver
from weight_transfer.transport import (
    RemoteGoneError,
    StaleRegionError,
    TransportError,
    WriteOp,
    lease,
    make_transport,
    shm,
)
from weight_transfer.transport.base import Segments
from weight_transfer.transport.shm import ShmTransport, allocated_segment

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]


def _pattern(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture(scope="module")
def rx():
    r = start_receiver("shm")
    yield r
    r.stop()


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_factory_and_allocate():
    t = make_transport("shm")
    assert isinstance(t, ShmTransport) and t.publishes_allocated_only
    buf = t.allocate(10_000)
    assert buf.dtype == torch.uint8 and buf.numel() == 10_000 and bool((buf == 0).all())
    seg = allocated_segment(buf.data_ptr(), 10_000)
    assert seg is not None and seg.size % 4096 == 0 and seg.size >= 10_000
    with pytest.raises(ValueError, match="CPU memory only"):
        t.allocate(16, device="meta")
    with pytest.raises(ValueError, match="CPU tensor"):
        t.register(torch.zeros(4, device="meta"))
    t.close()


def test_segment_closed_when_its_last_tensor_is_gone():
    buf = ShmTransport.allocate(1 << 16)
    view = buf[100:200]
    fd = allocated_segment(buf.data_ptr(), 1).fd
    assert os.path.exists(f"/proc/self/fd/{fd}")
    del buf
    gc.collect()
    assert allocated_segment(view.data_ptr(), 1) is not None  # a view keeps the segment mapped
    addr = view.data_ptr()
    del view
    gc.collect()
    assert allocated_segment(addr, 1) is None
    assert not os.path.exists(f"/proc/self/fd/{fd}") or os.readlink(f"/proc/self/fd/{fd}").find("weight_transfer") < 0


def test_segmented_ops_copied_by_one_c_loop_or_from_python_alike(rx):
    """The rows of a strided source (an op with Segments: thousands per TP slice) are copied by
    the native kernel's ``wt_copy_pieces`` in one call, not one ``ctypes.memmove`` per piece;
    with ``_memcpy`` patched (or no kernel) every piece goes through it. Both land the same
    bytes, beside a plain op of the same batch."""
    if shm._pieces_lib() is None:
        pytest.skip("no C compiler: the native delta kernel is not built here")
    d = rx.desc["buf"]
    src = _pattern(256 * 1024, seed=11)
    v = src.view(512, 512)[:, 128:320]  # 512 rows x 192 bytes, stride 512
    sg = Segments.strided(v.shape, v.stride(), 1, v.storage_offset())
    want = bytearray([POISON]) * (1 << 20)
    want[64:96] = src[:32].numpy().tobytes()
    want[8192:8192 + sg.nbytes] = v.contiguous().numpy().tobytes()
    for patched in (False, True):
        rx.ask("reset")
        t = ShmTransport()
        t.connect([d])
        ls = t.register(src)
        calls = []
        real = shm._memcpy
        if patched:
            shm._memcpy = lambda *a, calls=calls, real=real: calls.append(a[2]) or real(*a)
        try:
            h = t.write([WriteOp(ls, 0, d, 64, 32), WriteOp(ls, 0, d, 8192, sg.nbytes, sg)])
        finally:
            shm._memcpy = real
        assert h.wait() == 32 + sg.nbytes
        assert calls == ([32] + [192] * 512 if patched else [])
        assert rx.bytes() == bytes(want)
        t.close()


def test_publishing_an_arbitrary_tensor_is_refused_naming_allocate():
    t = ShmTransport()
    r = t.register(torch.zeros(64, dtype=torch.uint8))  # fine as a local source
    with pytest.raises(ValueError, match=r"not in a segment ShmTransport.allocate\(\) made.*transport.allocate\(nbytes\)"):
        r.descriptor()
    inside = t.register(t.allocate(4096)[128:256])  # a view of an allocated segment: publishable
    d = inside.descriptor()
    assert d.transport == "shm" and d.length == 128 and dict(d.extra)["offset"] == 128
    t.close()


def test_write_is_a_memcpy_into_the_mapping(rx):
    rx.ask("reset")
    t = ShmTransport()
    d = rx.desc["buf"]
    t.connect([d])
    src = _pattern(1 << 20, seed=3)
    ls = t.register(src)
    calls = []
    real = shm._memcpy
    shm._memcpy = lambda *a: calls.append(a[2]) or real(*a)
    try:
        h = t.write([WriteOp(ls, 0, d, 0, 4096), WriteOp(ls, 4096, d, 8192, 100)])
    finally:
        shm._memcpy = real
    assert h.done() and h.wait() == 4196 and calls == [4096, 100]
    got = rx.bytes()
    assert got[:4096] == src[:4096].numpy().tobytes() and got[8192:8292] == src[4096:4196].numpy().tobytes()
    assert got[4096:8192] == bytes([POISON]) * 4096
    t.close()


def test_connect_refuses_another_file_at_the_fd_and_a_foreign_host(rx):
    d = rx.desc["buf"]
    fd, ino, dev, size = dict(d.extra)["seg"]
    wrong = dataclasses.replace(d, extra=tuple((k, (fd, ino + 1, dev, size)) if k == "seg" else (k, v)
                                               for k, v in d.extra))
    with pytest.raises(TransportError, match="another file"):
        ShmTransport().connect([wrong])
    with pytest.raises(ValueError, match="one host"):
        ShmTransport().connect([dataclasses.replace(d, host="elsewhere")])
    with pytest.raises(ValueError, match="outside its segment"):
        ShmTransport().connect([dataclasses.replace(d, length=size + 1)])


def test_C17_epoch_checked_against_the_receivers_memory_not_the_senders_bookkeeping(rx):
    d = rx.ask("c17_new")
    t = ShmTransport()
    t.connect([d])
    ls = t.register(_pattern(16))
    assert rx.ask("c17_dereg") >= 0
    assert t._remote[(d.pid, d.addr)] == d  # the sender's own bookkeeping still accepts it
    with pytest.raises(StaleRegionError, match=r"op 0: .*owner publishes 0: the receiver deregistered it"):
        t.write([WriteOp(ls, 0, d, 0, 16)])
    assert rx.bytes("c17") == bytes([POISON]) * C17_BYTES
    t.close()


def _blocked_writer(monkeypatch, t, ops):
    """Start ``t.write(ops)`` in a thread whose copy blocks until ``release`` is set."""
    entered, release, out = threading.Event(), threading.Event(), []
    real = shm._memcpy

    def slow(*a):
        entered.set()
        release.wait(30)
        return real(*a)

    monkeypatch.setattr(shm, "_memcpy", slow)
    th = threading.Thread(target=lambda: out.append(t.write(ops).wait()), daemon=True)
    th.start()
    assert entered.wait(10)
    return release, th, out


def test_C17_deregister_waits_for_a_sender_inside_a_batch(rx, store, monkeypatch):
    d = rx.ask("c17_new")
    t = ShmTransport()
    lease.attach(t, store)
    t.connect([d])
    src = _pattern(C17_BYTES, seed=11)
    ls = t.register(src)
    release, th, out = _blocked_writer(monkeypatch, t, [WriteOp(ls, 0, d, 0, C17_BYTES)])
    rx.conn.send(("c17_dereg",))  # the receiver revokes while the batch is in flight
    t0 = time.monotonic()
    while t._published_epochs([d]) != [0]:  # until the receiver has revoked the epoch
        assert time.monotonic() - t0 < 20
        time.sleep(0.01)
    assert not rx.conn.poll(0.5), "deregister returned while a sender was inside a batch"
    release.set()
    th.join(10)
    waited = rx.conn.recv()
    assert isinstance(waited, float) and waited >= 0.5
    assert out == [C17_BYTES]  # the batch checked before the revocation completed ...
    assert rx.bytes("c17") == src.numpy().tobytes()  # ... before the memory was released
    monkeypatch.undo()
    with pytest.raises(StaleRegionError):  # and the next one is refused
        t.write([WriteOp(ls, 0, d, 0, 16)])
    t.close()


def test_C17_lease_timeout_keeps_the_memory_held(rx, store, monkeypatch):
    d = rx.ask("c17_new")
    t = ShmTransport()
    lease.attach(t, store)
    t.connect([d])
    ls = t.register(_pattern(64))
    release, th, out = _blocked_writer(monkeypatch, t, [WriteOp(ls, 0, d, 0, 64)])
    try:
        got = rx.ask("c17_dereg", 0.3)
        assert got.startswith("LeaseTimeoutError") and f"({os.getpid()}, " in got and "not released" in got
    finally:
        release.set()
        th.join(10)
    assert out == [64]
    t.close()


def test_dead_receiver_is_remote_gone_and_nothing_is_copied():
    r = start_receiver("shm")
    t = ShmTransport()
    d = r.desc["buf"]
    t.connect([d])
    ls = t.register(_pattern(8))
    assert t.write([WriteOp(ls, 0, d, 0, 8)]).wait() == 8
    r.proc.kill()
    r.proc.join(10)
    calls = []
    real = shm._memcpy
    shm._memcpy = lambda *a: calls.append(a) or real(*a)
    try:
        with pytest.raises(RemoteGoneError, match=f"pid {d.pid} no longer exists"):
            t.write([WriteOp(ls, 0, d, 0, 8)])
    finally:
        shm._memcpy = real
    assert calls == []
    t.close()  # unmaps the (orphaned) segment; no crash
    with pytest.raises(RemoteGoneError, match="gone"):
        ShmTransport().connect([d])
