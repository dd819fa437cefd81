"""NIXL transport: what is specific to NIXL (agent metadata in the descriptor, UCX paths). The
contract every transport shares runs over NIXL in tests/transport/test_base.py.

Skipped when NIXL is not installed (CI installs only ``.[dev]``; ``pip install -e '.[nixl]'``
adds it). The receiver (spawned) creates a NIXL agent with its progress thread, registers a
1 MiB uint8 buffer filled with POISON and a bf16 tensor, publishes their descriptors, then only
answers "show me your bytes". Runs over UCX's default choice here (CMA puts, TCP wire-up) and,
in one test, over TCP only (``UCX_TLS=tcp``).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.helpers.receiver import Receiver
from weight_transfer.transport import TransportError, WriteOp, make_transport
from weight_transfer.types import RegionDescriptor

nixl_mod = pytest.importorskip("weight_transfer.transport.nixl")
try:
    nixl_mod.load_nixl()
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"NIXL not installed: {e}", allow_module_level=True)

from weight_transfer.transport.nixl import NixlTransport  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(60)]

MIB = 1 << 20
POISON = 0xA5
BF16_N = 257


def _receiver(conn, env: dict, progress_thread: bool) -> None:
    os.environ.update(env)
    t = NixlTransport(progress_thread=progress_thread)
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


def start_receiver(env: dict | None = None, progress_thread: bool = True) -> Receiver:
    """A :class:`receiver.Receiver` running :func:`_receiver` with ``env`` set in it."""
    return Receiver(_receiver, (env or {}, progress_thread), what="NIXL receiver")


@pytest.fixture(scope="module")
def sender():
    t = NixlTransport()
    yield t
    t.close()


def _pattern(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


# ---- no receiver needed ---------------------------------------------------------------------


def test_factory_and_descriptor(sender):
    assert isinstance(make_transport("nixl"), NixlTransport)
    x = torch.zeros(1000, dtype=torch.bfloat16)
    r = sender.register(x)
    d = r.descriptor()
    extra = dict(d.extra)
    assert d.transport == "nixl" and d.addr == x.data_ptr() and d.length == 2000
    assert extra["agent"] == sender.agent_name and extra["mem"] == "DRAM" and extra["dev"] == 0
    assert isinstance(extra["md"], bytes) and len(extra["md"]) > 0
    r2 = sender.register(x)
    assert r2.descriptor().key != d.key
    sender.deregister(r)
    sender.deregister(r2)
    import pickle

    assert pickle.loads(pickle.dumps(d)) == d  # travels through the control plane as is


def test_register_refuses_other_devices(sender):
    with pytest.raises(ValueError, match="CPU or CUDA"):
        sender.register(torch.empty(8, device="meta"))


def test_connect_refuses_foreign_descriptors(sender):
    cma = RegionDescriptor(transport="cma", host="h", pid=1, addr=4096, length=10, key=1)
    with pytest.raises(ValueError, match="not 'nixl'"):
        sender.connect([cma])
    bare = dataclasses.replace(cma, transport="nixl")
    with pytest.raises(ValueError, match="lacks NIXL fields"):
        sender.connect([bare])
    junk = dataclasses.replace(bare, epoch=1, extra=(("agent", "x"), ("mem", "DRAM"), ("dev", 0), ("md", b"garbage"),
                                                     ("epochs_md", b"garbage"), ("epochs", (4096, 0, "t"))))
    with pytest.raises(TransportError, match="refused the metadata"):
        sender.connect([junk])


# ---- the TCP path ---------------------------------------------------------------


def test_write_over_tcp(monkeypatch):
    """UCX_TLS=tcp on both ends: the path the network-namespace test takes between hosts."""
    r = start_receiver(env={"UCX_TLS": "tcp"})
    try:
        monkeypatch.setenv("UCX_TLS", "tcp")
        t = NixlTransport()
        t.connect([r.desc["buf"]])
        src = _pattern(MIB, seed=5)
        loc = t.register(src)
        assert t.write([WriteOp(loc, 0, r.desc["buf"], 0, MIB)]).wait(20) == MIB
        assert r.bytes() == src.numpy().tobytes()
        t.close()
    finally:
        r.stop()
