"""Cross-memory-attach transport: what is specific to CMA (the contract every transport shares,
bounds, stale descriptors, deregistered regions, bit-exact writes, is tests/transport/test_base.py).

The receiver (spawned) registers a 1 MiB uint8 buffer filled with POISON and a small bf16
tensor, sends their descriptors back, then only answers "show me your bytes" requests: it runs
no code for the writes themselves. The test process is the sender.
"""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import os
import random
import time

import pytest
import torch

from tests.helpers.receiver import Receiver
from weight_transfer.transport import (
    BoundsError,
    PermissionDeniedError,
    RemoteGoneError,
    TransportError,
    UnknownRegionError,
    WriteOp,
    cma,
    make_transport,
)
from weight_transfer.transport.base import Segments
from weight_transfer.transport.cma import IOV_MAX, CmaTransport
from weight_transfer.types import RegionDescriptor

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]

MIB = 1 << 20
POISON = 0xA5
BF16_N = 257  # odd element count: 514 bytes


def _receiver(conn) -> None:
    """Register buffers, publish descriptors, then serve byte dumps until told to exit."""
    t = CmaTransport()
    tensors = {
        "buf": torch.full((MIB,), POISON, dtype=torch.uint8),
        "bf16": torch.zeros(BF16_N, dtype=torch.bfloat16),
    }
    regions = {k: t.register(v) for k, v in tensors.items()}
    conn.send({k: r.descriptor() for k, r in regions.items()})
    while True:
        cmd, *args = conn.recv()
        if cmd == "bytes":
            conn.send(tensors[args[0]].view(torch.uint8).numpy().tobytes())
        elif cmd == "reset":
            tensors["buf"].fill_(POISON)
            tensors["bf16"].zero_()
            conn.send(True)
        elif cmd == "exit":
            conn.send(True)
            return


@pytest.fixture(scope="module")
def rx():
    r = Receiver(_receiver)
    yield r
    r.stop()


@pytest.fixture
def recv(rx):
    rx.ask("reset")
    return rx


@pytest.fixture
def tx(recv):
    t = CmaTransport()
    t.connect(list(recv.desc.values()))
    yield t
    t.close()


def _pattern(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# ---- registration, factory (no receiver needed) ---------------------------------------------


def test_descriptor_fields():
    t = CmaTransport()
    x = torch.zeros(1000, dtype=torch.bfloat16)
    d = t.register(x).descriptor()
    assert d.transport == "cma" and d.pid == os.getpid()
    assert d.addr == x.data_ptr() and d.length == 2000
    assert 0 <= d.key < 2**64
    import socket

    assert d.host == socket.gethostname()
    assert CmaTransport(host="node7").register(x).descriptor().host == "node7"
    assert t.register(x).descriptor().key != d.key  # a fresh key per registration


def test_register_refuses_non_cpu_tensors():
    with pytest.raises(ValueError, match="CPU tensor.*CUDA IPC or verbs"):
        CmaTransport().register(torch.empty(8, device="meta"))


def test_factory():
    assert isinstance(make_transport("cma"), CmaTransport)
    assert make_transport("cma", host="h").host == "h"


def test_connect_refuses_foreign_descriptors():
    t = CmaTransport(host="here")
    good = dict(transport="cma", host="here", pid=os.getpid(), addr=4096, length=10, key=1)
    with pytest.raises(ValueError, match="transport 'verbs'"):
        t.connect([RegionDescriptor(**{**good, "transport": "verbs"})])
    with pytest.raises(ValueError, match="host 'there'.*one host"):
        t.connect([RegionDescriptor(**{**good, "host": "there"})])
    with pytest.raises(ValueError, match="malformed"):
        t.connect([RegionDescriptor(**{**good, "pid": 0})])


def test_write_to_self_and_zero_length_skipped(monkeypatch):
    t = CmaTransport()
    a, b = _pattern(100), torch.zeros(100, dtype=torch.uint8)
    ra, rb = t.register(a), t.register(b)
    t.connect([rb.descriptor()])
    calls = []
    real = cma._process_vm_writev
    monkeypatch.setattr(cma, "_process_vm_writev", lambda *a: calls.append(a) or real(*a))
    h = t.write([WriteOp(ra, 0, rb.descriptor(), 0, 0), WriteOp(ra, 100, rb.descriptor(), 100, 0)])
    assert h.done() and h.wait() == 0 and calls == []
    assert t.write([WriteOp(ra, 10, rb.descriptor(), 20, 50)]).wait(timeout=0) == 50
    assert torch.equal(b[20:70], a[10:60]) and not b[:20].any() and not b[70:].any()


# ---- real writes into the receiver process -------------------------------------------------


def test_read_back_with_process_vm_readv(recv, tx):
    src = _pattern(MIB, seed=1)
    ls = tx.register(src)
    d = recv.desc["buf"]
    assert tx.write([WriteOp(ls, 0, d, 0, MIB)]).wait() == MIB
    assert tx.read(d, MIB - 3, 3) == src[-3:].numpy().tobytes()
    assert tx.read(d) == recv.bytes() == src.numpy().tobytes()
    with pytest.raises(BoundsError, match="read: offset 10 \\+ length 1048576 outside"):
        tx.read(d, 10, MIB)
    forged = RegionDescriptor(**{**{f: getattr(d, f) for f in d.__slots__}, "key": d.key ^ 1})
    with pytest.raises(UnknownRegionError, match="read: .*another run"):
        tx.read(forged, 0, 4)


def test_many_ops_over_iov_max(recv, tx, monkeypatch):
    n_ops, sz = 3 * IOV_MAX + 7, 150  # 4 syscalls per receiver
    src = _pattern(2 * n_ops * sz, seed=2)
    ls = tx.register(src)
    d = recv.desc["buf"]
    slots = list(range(0, MIB // sz, 2))  # no two pieces adjacent on either side: nothing merges
    random.Random(0).shuffle(slots)
    ops = [WriteOp(ls, 2 * i * sz, d, slots[i] * sz, sz) for i in range(n_ops)]
    counts = []
    real = cma._process_vm_writev

    def spy(pid, l, nl, r, nr):
        counts.append((nl, nr))
        return real(pid, l, nl, r, nr)

    monkeypatch.setattr(cma, "_process_vm_writev", spy)
    assert tx.write(ops).wait() == n_ops * sz
    assert counts == [(IOV_MAX, IOV_MAX)] * 3 + [(7, 7)]
    expect = bytearray([POISON]) * MIB
    s = src.numpy().tobytes()
    for i in range(n_ops):
        expect[slots[i] * sz:(slots[i] + 1) * sz] = s[2 * i * sz:(2 * i + 1) * sz]
    assert recv.bytes() == bytes(expect)


def test_adjacent_pieces_merge_into_one_iovec_per_side(recv, tx, monkeypatch):
    """Pieces adjacent on one side share an iovec on that side (issue 29 item 3): the 2 * IOV_MAX
    + 5 row segments of one strided write land in one remote iovec, in 3 calls of at most
    IOV_MAX local iovecs; contiguous local pieces scattered remotely become one local iovec."""
    rows, cols = 2 * IOV_MAX + 5, 64
    src = _pattern(rows * 2 * cols, seed=9)
    ls = tx.register(src)
    d = recv.desc["buf"]
    v = src.view(rows, 2 * cols)[:, 10:10 + cols]
    sg = Segments.strided(v.shape, v.stride(), 1, v.storage_offset())
    counts = []
    real = cma._process_vm_writev

    def spy(pid, l, nl, r, nr):
        counts.append((nl, nr))
        return real(pid, l, nl, r, nr)

    monkeypatch.setattr(cma, "_process_vm_writev", spy)
    assert tx.write([WriteOp(ls, 0, d, 1000, sg.nbytes, sg)]).wait() == sg.nbytes
    assert counts == [(IOV_MAX, 1), (IOV_MAX, 1), (5, 1)]
    got = recv.bytes()
    assert got[1000:1000 + sg.nbytes] == v.contiguous().numpy().tobytes()
    assert got[:1000] == bytes([POISON]) * 1000 and got[1000 + sg.nbytes] == POISON
    counts.clear()
    ops = [WriteOp(ls, 100 * i, d, 300_000 - 200 * i, 100) for i in range(40)]  # local contiguous, remote not
    assert tx.write(ops).wait() == 4000
    assert counts == [(1, 40)]
    got = recv.bytes()
    s = src.numpy().tobytes()
    assert all(got[300_000 - 200 * i:300_100 - 200 * i] == s[100 * i:100 * (i + 1)] for i in range(40))


def test_partial_write_of_merged_iovecs_resumes_mid_piece(recv, tx, monkeypatch):
    """A partial copy in the merged path (local and remote iovec lists of different lengths)
    resumes at the exact piece and offset."""
    rows, cols = 300, 50
    src = _pattern(rows * 3 * cols, seed=10)
    ls = tx.register(src)
    d = recv.desc["buf"]
    v = src.view(rows, 3 * cols)[:, cols:2 * cols]
    sg = Segments.strided(v.shape, v.stride(), 1, v.storage_offset())
    real = cma._process_vm_writev
    calls = []

    def fake(pid, l, nl, r, nr):  # the first call copies only 7 * cols + 13 bytes, as a partial write
        liov, riov = _iov_list(l, nl), _iov_list(r, nr)
        calls.append((liov, riov))
        if len(calls) > 1:
            return real(pid, l, nl, r, nr)
        cut = 7 * cols + 13
        la = (ctypes.c_ulong * 16)(*[v for e in liov[:7] for v in e], liov[7][0], 13)
        ra = (ctypes.c_ulong * 2)(riov[0][0], cut)
        return real(pid, ctypes.addressof(la), 8, ctypes.addressof(ra), 1)

    monkeypatch.setattr(cma, "_process_vm_writev", fake)
    assert tx.write([WriteOp(ls, 0, d, 777, sg.nbytes, sg)]).wait() == sg.nbytes
    first, second = calls
    assert len(first[0]) == rows and len(first[1]) == 1
    assert second[0][0] == [ls.addr + 7 * 3 * cols + cols + 13, cols - 13] and len(second[0]) == rows - 7
    assert second[1] == [[d.addr + 777 + 7 * cols + 13, sg.nbytes - 7 * cols - 13]]
    assert recv.bytes()[777:777 + sg.nbytes] == v.contiguous().numpy().tobytes()


def test_batch_to_two_processes(recv, tx):
    # one batch, two receiving pids: the receiver and this process itself
    mine = torch.zeros(64, dtype=torch.uint8)
    rm = tx.register(mine)
    tx.connect([rm.descriptor()])
    src = _pattern(128, seed=3)
    ls = tx.register(src)
    tx.write([WriteOp(ls, 0, recv.desc["buf"], 100, 64), WriteOp(ls, 64, rm.descriptor(), 0, 64)]).wait()
    assert torch.equal(mine, src[64:])
    assert recv.bytes()[100:164] == src[:64].numpy().tobytes()


def _iov_list(addr: int, n: int) -> list[list[int]]:
    flat = (ctypes.c_ulong * (2 * n)).from_address(addr)
    return [[flat[2 * i], flat[2 * i + 1]] for i in range(n)]


def _truncating(real, cut: int):
    """A syscall wrapper that, on its first call, really copies only the first ``cut`` bytes
    (as the kernel does on a partial write) and returns ``cut``."""
    state = {"calls": []}

    def fake(pid, l, nl, r, nr):
        state["calls"].append((_iov_list(l, nl), _iov_list(r, nr)))
        if len(state["calls"]) > 1:
            return real(pid, l, nl, r, nr)
        liov, riov = _iov_list(l, nl), _iov_list(r, nr)
        left, k = cut, 0
        while left > 0:  # truncate the iovec lists to `cut` bytes
            take = min(left, liov[k][1])
            liov[k][1] = riov[k][1] = take
            left -= take
            k += 1
        la = (ctypes.c_ulong * (2 * k))(*[v for e in liov[:k] for v in e])
        ra = (ctypes.c_ulong * (2 * k))(*[v for e in riov[:k] for v in e])
        return real(pid, ctypes.addressof(la), k, ctypes.addressof(ra), k)

    return fake, state


def test_partial_write_resumes_mid_iovec(recv, tx, monkeypatch):
    sz, n_ops = 1000, 10
    src = _pattern(sz * n_ops, seed=4)
    ls = tx.register(src)
    d = recv.desc["buf"]
    ops = [WriteOp(ls, i * sz, d, 5000 + 2 * i * sz, sz) for i in range(n_ops)]
    fake, state = _truncating(cma._process_vm_writev, cut=3 * sz + 123)
    monkeypatch.setattr(cma, "_process_vm_writev", fake)
    assert tx.write(ops).wait() == sz * n_ops
    first, second = state["calls"]
    assert len(second[0]) == n_ops - 3  # resumed at op 3 ...
    assert second[0][0] == [ls.addr + 3 * sz + 123, sz - 123]  # ... 123 bytes into it
    assert second[1][0] == [d.addr + 5000 + 6 * sz + 123, sz - 123]
    got = recv.bytes()
    for i in range(n_ops):
        o = 5000 + 2 * i * sz
        assert got[o:o + sz] == src[i * sz:(i + 1) * sz].numpy().tobytes(), i
        assert got[o + sz:o + 2 * sz] == bytes([POISON]) * sz


def test_no_progress_raises(recv, tx, monkeypatch):
    ls = tx.register(_pattern(10))
    monkeypatch.setattr(cma, "_process_vm_writev", lambda *a: 0)
    with pytest.raises(TransportError, match="op 0 .*no progress"):
        tx.write([WriteOp(ls, 0, recv.desc["buf"], 0, 10)])


def test_unmapped_remote_address_is_efault(recv, tx):
    d = recv.desc["buf"]
    # the receiver's real epoch (the check passes), an address it never mapped
    bogus = dataclasses.replace(d, addr=4096, length=4096, key=7)
    tx.connect([bogus])
    ls = tx.register(_pattern(64))
    with pytest.raises(TransportError, match=r"op 1 \(.*EFAULT.*16 of 48 bytes"):
        tx.write([WriteOp(ls, 0, d, 0, 16), WriteOp(ls, 0, bogus, 0, 32)])
    assert recv.bytes()[:16] == ls.tensor[:16].numpy().tobytes()


@pytest.mark.parametrize(
    "err,cls,pattern",
    [
        (errno.EPERM, PermissionDeniedError, "ptrace_scope.*CAP_SYS_PTRACE.*seccomp"),
        (errno.EACCES, PermissionDeniedError, "CAP_SYS_PTRACE"),
        (errno.ESRCH, RemoteGoneError, "pid"),
        (errno.EINVAL, TransportError, os.strerror(errno.EINVAL)),
    ],
)
def test_errno_mapping(recv, tx, monkeypatch, err, cls, pattern):
    def fail(*a):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(cma, "_process_vm_writev", fail)
    ls = tx.register(_pattern(8))
    with pytest.raises(cls, match=pattern) as ei:
        tx.write([WriteOp(ls, 0, recv.desc["buf"], 0, 8)])
    assert "op 0" in str(ei.value)


def test_dead_receiver_is_remote_gone():
    r = Receiver(_receiver)
    t = CmaTransport()
    t.connect([r.desc["buf"]])
    ls = t.register(_pattern(8))
    assert t.write([WriteOp(ls, 0, r.desc["buf"], 0, 8)]).wait() == 8
    r.proc.kill()
    r.proc.join(10)
    with pytest.raises(RemoteGoneError, match=f"pid {r.desc['buf'].pid} no longer exists"):
        t.write([WriteOp(ls, 0, r.desc["buf"], 0, 8)])


# ---- C17: regions with a lifetime (epochs, revocation, leases) -------------------------------
# The generic C17 cases (write after deregister, reused address, fresh sender with an old
# descriptor) run over every transport in test_transport_conformance.py; these are CMA's own:
# the check reads the receiver's memory, and the lease makes deregister wait for a batch in flight.

from tests.helpers.transports import C17_BYTES, start_receiver  # noqa: E402
from weight_transfer.transport import StaleRegionError, lease  # noqa: E402
from weight_transfer.transport.lease import LEASE_SLOTS, REGION_SLOTS, EpochTable  # noqa: E402


@pytest.fixture(scope="module")
def c17rx():
    r = start_receiver("cma")
    yield r
    r.stop()


@pytest.fixture
def store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def test_C17_connect_refuses_a_descriptor_without_epoch(c17rx):
    d = c17rx.desc["buf"]
    with pytest.raises(ValueError, match="carries no epoch"):
        CmaTransport().connect([dataclasses.replace(d, epoch=0)])


def test_C17_epoch_checked_against_the_receivers_memory_not_the_senders_bookkeeping(c17rx):
    d = c17rx.ask("c17_new")
    t = CmaTransport()
    t.connect([d])
    ls = t.register(_pattern(16))
    assert c17rx.ask("c17_dereg") >= 0
    assert t._remote[(d.pid, d.addr)] == d  # the sender's own bookkeeping still accepts it
    with pytest.raises(StaleRegionError, match=r"op 0: .*has epoch .*owner publishes 0: the receiver deregistered it"):
        t.write([WriteOp(ls, 0, d, 0, 16)])
    with pytest.raises(StaleRegionError, match="read: "):
        t.read(d, 0, 4)
    # right key, address and length, another epoch: refused by the receiver's table too
    d2 = c17rx.ask("c17_new")
    forged = dataclasses.replace(d2, epoch=d2.epoch + 1)
    t.connect([forged])
    with pytest.raises(StaleRegionError, match=f"publishes {d2.epoch:#x}"):
        t.write([WriteOp(ls, 0, forged, 0, 16)])
    assert c17rx.bytes("c17") == bytes([POISON]) * C17_BYTES
    t.close()


def _blocked_writer(monkeypatch, t, ops):
    """Start ``t.write(ops)`` in a thread whose data copy blocks until ``release`` is set."""
    import threading

    entered, release, out = threading.Event(), threading.Event(), []
    real = cma._process_vm_writev

    def slow(*a):
        entered.set()
        release.wait(30)
        return real(*a)

    monkeypatch.setattr(cma, "_process_vm_writev", slow)
    th = threading.Thread(target=lambda: out.append(t.write(ops).wait()), daemon=True)
    th.start()
    assert entered.wait(10)
    return release, th, out


def test_C17_deregister_waits_for_a_sender_inside_a_batch(c17rx, store, monkeypatch):
    d = c17rx.ask("c17_new")
    t = CmaTransport()
    lease.attach(t, store)
    t.connect([d])
    src = _pattern(C17_BYTES, seed=11)
    ls = t.register(src)
    release, th, out = _blocked_writer(monkeypatch, t, [WriteOp(ls, 0, d, 0, C17_BYTES)])
    c17rx.conn.send(("c17_dereg",))  # the receiver revokes while the batch is in flight
    t0 = time.monotonic()
    while cma.read_published_epochs([d]) != [0]:  # until the receiver has revoked the epoch
        assert time.monotonic() - t0 < 20
        time.sleep(0.01)
    assert not c17rx.conn.poll(0.5), "deregister returned while a sender was inside a batch"
    release.set()
    th.join(10)
    waited = c17rx.conn.recv()
    assert isinstance(waited, float) and waited >= 0.5
    assert out == [C17_BYTES]  # the batch checked before the revocation completed ...
    assert c17rx.bytes("c17") == src.numpy().tobytes()  # ... before the memory was released
    monkeypatch.undo()
    with pytest.raises(StaleRegionError):  # and the next one is refused
        t.write([WriteOp(ls, 0, d, 0, 16)])
    t.close()


def test_C17_lease_timeout_keeps_the_memory_held(c17rx, store, monkeypatch):
    d = c17rx.ask("c17_new")
    t = CmaTransport()
    lease.attach(t, store)
    t.connect([d])
    ls = t.register(_pattern(64))
    release, th, out = _blocked_writer(monkeypatch, t, [WriteOp(ls, 0, d, 0, 64)])
    try:
        got = c17rx.ask("c17_dereg", 0.3)
        assert got.startswith("LeaseTimeoutError") and f"({os.getpid()}, " in got and "not released" in got
    finally:
        release.set()
        th.join(10)
    assert out == [64]
    t.close()


def test_C17_epoch_table_unit():
    tab = EpochTable()
    assert tab.words.numel() == 1 + REGION_SLOTS + 2 * LEASE_SLOTS
    (s1, e1), (s2, e2) = tab.publish(), tab.publish()
    assert s1 != s2 and e2 == e1 + 1 and e1 > 0
    tab.revoke(s1)
    assert tab.words[1 + s1] == 0 and tab.words[1 + s2] == e2
    tab.release(s1)
    s3, e3 = tab.publish()
    assert s3 == s1 and e3 not in (e1, e2)  # a reused slot gets a new epoch
    assert EpochTable().publish()[1] != e1  # another table (run): another epoch range
    # leases: a live sender inside a batch is waited for; a dead one is not
    lw = tab.words[1 + REGION_SLOTS:].view(LEASE_SLOTS, 2)
    lw[3] = torch.tensor([os.getpid(), 7])
    assert tab.busy_senders() == [(3, os.getpid(), 7)]
    assert tab.await_senders(0.05) == [(os.getpid(), 7)]
    assert tab.await_senders(0.05, alive=lambda pid: False) == []
    lw[3, 1] = 8  # left the batch
    assert tab.await_senders(5) == []


# ---- guard bytes (issue 15, 8) ------------------------------------------------------------------


def test_guard_bytes_just_outside_a_region():
    from weight_transfer.transport.guard import Guard

    backing = torch.full((4096 + 128,), 0x77, dtype=torch.uint8)
    arena = backing[64:64 + 4096]  # the registered region; 64 guard bytes each side
    t = CmaTransport()
    r = t.register(arena)
    t.connect([r.descriptor()])
    g = Guard(r, 64)
    assert g.covered == 128
    src = t.register(_pattern(4096, seed=12))
    t.write([WriteOp(src, 0, r.descriptor(), 0, 1), WriteOp(src, 1, r.descriptor(), 4095, 1)]).wait()
    assert g.check("after update") == 128  # edges written, guards intact
    backing[63] = 1  # a stray byte just before ...
    backing[64 + 4096 + 2] = 2  # ... and one 3 bytes after
    with pytest.raises(TransportError, match=r"after update: 2 byte\(s\) just outside .*-1: 0x77 -> 0x01, 4098: 0x77 -> 0x02"):
        g.check("after update")
    with pytest.raises(ValueError, match="> 0"):
        Guard(r, 0)
    t.close()
