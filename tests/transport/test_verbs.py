"""pyverbs RDMA WRITE back end.

Everything that does not touch a device is tested everywhere: connection-info serialization,
NIC selection, WR chunking / rail striping / signalling / chaining as pure functions, status
names, descriptor validation and the checks done before any post. Tests that need an RDMA
device are marked ``rdma`` and skip (with the reason) where none exists.
"""
from __future__ import annotations

import dataclasses
import multiprocessing as mp

import pytest
import torch

from weight_transfer.transport import BoundsError, UnknownRegionError, WriteOp, make_transport
from weight_transfer.transport import verbs as V
from weight_transfer.types import RegionDescriptor

GID = "fe800000000000000000000000000001"


def _info(**kw):
    base = dict(nic="mlx5_0", port=1, lid=7, gid=GID, gid_index=0, qpn=0x1234, psn=0xABCDE, mtu=5)
    base.update(kw)
    return V.ConnInfo(**base)


def test_conn_info_roundtrip_and_validation():
    c = _info()
    assert V.ConnInfo.from_json(c.to_json()) == c
    assert c.gid_colon == "fe80:0000:0000:0000:0000:0000:0000:0001"
    for bad in (dict(qpn=0), dict(qpn=1 << 24), dict(psn=1 << 24), dict(lid=1 << 16), dict(gid="xyz"),
                dict(gid=GID.upper()), dict(mtu=6), dict(nic=""), dict(port=0)):
        with pytest.raises(ValueError, match="ConnInfo"):
            _info(**bad)
    with pytest.raises(ValueError, match="fields"):
        V.ConnInfo.from_json('{"nic": "mlx5_0"}')


def test_select_nics():
    assert V.select_nics(None, ["mlx5_0", "mlx5_1"]) == ["mlx5_0", "mlx5_1"]
    assert V.select_nics("mlx5_1", ["mlx5_0", "mlx5_1"]) == ["mlx5_1"]
    assert V.select_nics(["mlx5_1", "mlx5_0"], ["mlx5_0", "mlx5_1"]) == ["mlx5_1", "mlx5_0"]
    with pytest.raises(ValueError, match=r"unknown RDMA NIC\(s\) \['mlx5_9'\]; available: \['mlx5_0', 'mlx5_1'\]"):
        V.select_nics("mlx5_0,mlx5_9", ["mlx5_0", "mlx5_1"])
    with pytest.raises(ValueError, match="no RDMA device found.*asked for \\['mlx5_0'\\]"):
        V.select_nics(["mlx5_0"], [])
    with pytest.raises(ValueError, match="twice"):
        V.select_nics(["mlx5_0", "mlx5_0"], ["mlx5_0"])


def test_wc_status_names():
    assert V.wc_status_name(0) == "IBV_WC_SUCCESS"
    assert V.wc_status_name(10) == "IBV_WC_REM_ACCESS_ERR"
    assert V.wc_status_name(12) == "IBV_WC_RETRY_EXC_ERR"
    assert V.wc_status_name(99) == "IBV_WC_99"
    try:
        pv = V.load_pyverbs()
    except ImportError:
        return
    for code, name in V.WC_STATUS_NAMES.items():  # the table matches rdma-core's enum
        if hasattr(pv.enums, name):
            assert getattr(pv.enums, name) == code, name


def test_chunk_rails_signals_chains():
    items = [(0, 1000, 5000, 10), (1, 0, 0, 25)]
    assert V.chunk_ops(items, 10) == [(0, 1000, 5000, 10), (1, 0, 0, 10), (1, 10, 10, 10), (1, 20, 20, 5)]
    with pytest.raises(ValueError):
        V.chunk_ops(items, 0)
    its = [(i, 0, 0, n) for i, n in enumerate([100, 10, 10, 10, 100, 5])]
    rails = V.assign_rails(its, 2, "write")
    assert sorted(sum(rails, [])) == list(range(6))
    loads = [sum(its[k][3] for k in r) for r in rails]
    assert abs(loads[0] - loads[1]) <= 100
    reg = V.assign_rails(its, 3, "region", remote_of=lambda k: [7, 7, 8, 8, 7, 9][k])
    where = {k: r for r, ks in enumerate(reg) for k in ks}
    assert where[0] == where[1] == where[4] and where[2] == where[3]
    assert V.plan_signals(5, 2) == [False, True, False, True, True]
    assert V.plan_signals(3, 4, already=3) == [True, False, True]
    assert V.plan_signals(0, 4) == []
    assert V.plan_chains(70, 32) == [(0, 32), (32, 64), (64, 70)]
    with pytest.raises(ValueError):
        V.plan_signals(3, 0)


def _desc(**kw):
    base = dict(transport="verbs", host="n1", pid=5, addr=1 << 20, length=4096, key=0x55,
                extra=(("run", "abc"), ("cm", "10.0.0.2:5000"), ("rkeys", (("mlx5_0", 0x55), ("mlx5_1", 0x66)))))
    base.update(kw)
    return RegionDescriptor(**base)


def test_descriptor_validation():
    x = V.validate_descriptor(_desc())
    assert x["cm"] == "10.0.0.2:5000"
    bad = [(_desc(transport="cma"), "not 'verbs'"), (_desc(length=0), "malformed"), (_desc(key=1 << 32), "32-bit"),
           (_desc(extra=(("run", "a"),)), "lacks"), (_desc(key=0x66), "rkey of first NIC"),
           (_desc(extra=(("run", "a"), ("cm", "nohostport"), ("rkeys", (("m", 0x55),)))), "host:port")]
    for d, msg in bad:
        with pytest.raises(ValueError, match=msg):
            V.validate_descriptor(d)


class _Loc:
    def __init__(self, length):
        self.addr, self.length = 1 << 30, length


def test_checks_before_any_post():
    d = _desc()
    loc = _Loc(100)
    local = {id(loc): loc}
    remote = {("10.0.0.2:5000", d.addr): d}
    out = V.check_ops([WriteOp(loc, 0, d, 0, 100), WriteOp(loc, 10, d, 4000, 0)], local, remote)
    assert out == [(0, loc.addr, d.addr, 100)]
    with pytest.raises(BoundsError, match="op 1"):
        V.check_ops([WriteOp(loc, 0, d, 0, 1), WriteOp(loc, 0, d, 4000, 97)], local, remote)
    with pytest.raises(BoundsError):
        V.check_ops([WriteOp(loc, 90, d, 0, 11)], local, remote)
    with pytest.raises(UnknownRegionError, match="another run"):
        V.check_ops([WriteOp(loc, 0, dataclasses.replace(d, key=0x77), 0, 1)], local, remote)
    stale = dataclasses.replace(d, extra=(("run", "old"),) + d.extra[1:])
    with pytest.raises(UnknownRegionError, match="another run"):
        V.check_ops([WriteOp(loc, 0, stale, 0, 1)], local, remote)
    with pytest.raises(UnknownRegionError, match="never connected"):
        V.check_ops([WriteOp(loc, 0, _desc(addr=1 << 21), 0, 1)], local, remote)
    with pytest.raises(UnknownRegionError, match="not registered"):
        V.check_ops([WriteOp(_Loc(100), 0, d, 0, 1)], local, remote)


def _no_device_reason() -> str | None:
    try:
        V.load_pyverbs()
    except ImportError as e:
        return f"pyverbs not installed: {e}"
    if not V.list_nics():
        return "no RDMA device (/sys/class/infiniband absent or empty; libibverbs lists none)"
    return None


def test_factory_without_device_is_clear():
    why = _no_device_reason()
    if why is None:
        pytest.skip("an RDMA device exists here")
    with pytest.raises((ImportError, ValueError), match="pyverbs|no RDMA device"):
        make_transport("verbs")
    if "pyverbs not installed" not in why:
        with pytest.raises(ValueError, match="no RDMA device found.*mlx5_7"):
            make_transport("verbs", nics=["mlx5_7"])


# ---- device tests -----------------------------------------------------------------------------

rdma = pytest.mark.rdma


def _rx(conn, nic):
    t = V.VerbsTransport(nics=nic, listen=("127.0.0.1", 0))
    buf = torch.full((1 << 20,), 0xA5, dtype=torch.uint8)
    r = t.register(buf)
    conn.send(r.descriptor())
    while True:
        cmd = conn.recv()
        if cmd == "bytes":
            conn.send(buf.numpy().tobytes())
        elif cmd == "dereg":
            t.deregister(r)
            conn.send(True)
        else:
            conn.send(True)
            return


@rdma
@pytest.mark.multiproc
@pytest.mark.timeout(60)
def test_rdma_write_loopback_bit_exact():
    why = _no_device_reason()
    if why:
        pytest.skip(why)
    nic = V.list_nics()[0]
    ctx = mp.get_context("spawn")
    p, c = ctx.Pipe()
    pr = ctx.Process(target=_rx, args=(c, nic), daemon=True)
    pr.start()
    d = p.recv()
    t = V.VerbsTransport(nics=nic, listen=("127.0.0.1", 0), signal_every=4, max_chain=3)
    t.connect([d])
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
    loc = t.register(src)
    ops = [WriteOp(loc, i * 4096, d, (255 - i) * 4096, 4096) for i in range(256)]
    assert t.write(ops).wait(30) == 1 << 20
    p.send("bytes")
    got = torch.frombuffer(bytearray(p.recv()), dtype=torch.uint8).view(256, 4096)
    assert torch.equal(got, src.view(256, 4096).flip(0))
    # remote deregistered: the NIC refuses with a named status
    p.send("dereg")
    p.recv()
    with pytest.raises(V.TransportError, match="IBV_WC_REM_ACCESS_ERR|IBV_WC_"):
        t.write([WriteOp(loc, 0, d, 0, 64)]).wait(10)
    p.send("exit")
    pr.join(10)
    t.close()
