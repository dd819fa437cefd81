"""CUDA IPC back end: the receiver exports CUDA memory once, the sender opens the handle and
copies device-to-device. Needs a CUDA GPU: marked ``gpu`` and skipped without one."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp

import pytest
import torch

from weight_transfer.transport import BoundsError, UnknownRegionError, WriteOp, make_transport
from weight_transfer.transport.cuda_ipc import INSTALL_HINT, CudaIpcTransport

NO_CUDA = not torch.cuda.is_available()


def test_factory_without_cuda_says_what_to_install():
    if not NO_CUDA:
        pytest.skip("CUDA is available here")
    with pytest.raises(ImportError, match="CUDA build of torch"):
        make_transport("cuda_ipc")
    assert "cuda" in INSTALL_HINT


def _rx(conn):
    t = CudaIpcTransport()
    buf = torch.full((1 << 20,), 0xA5, dtype=torch.uint8, device="cuda")
    r = t.register(buf)
    conn.send(r.descriptor())
    while True:
        cmd = conn.recv()
        if cmd == "bytes":
            torch.cuda.synchronize()
            conn.send(buf.cpu().numpy().tobytes())
        else:
            conn.send(True)
            return


@pytest.mark.gpu
@pytest.mark.multiproc
@pytest.mark.timeout(120)
@pytest.mark.skipif(NO_CUDA, reason="needs a CUDA GPU and a CUDA build of torch")
def test_cuda_ipc_write_bit_exact_and_refusals():
    ctx = mp.get_context("spawn")
    p, c = ctx.Pipe()
    pr = ctx.Process(target=_rx, args=(c,), daemon=True)
    pr.start()
    d = p.recv()
    t = CudaIpcTransport()
    t.connect([d])
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    loc = t.register(src)
    ops = [WriteOp(loc, i * 4096, d, (255 - i) * 4096, 4096) for i in range(256)]
    assert t.write(ops).wait(30) == 1 << 20
    p.send("bytes")
    got = torch.frombuffer(bytearray(p.recv()), dtype=torch.uint8).view(256, 4096)
    assert torch.equal(got, src.cpu().view(256, 4096).flip(0))
    with pytest.raises(BoundsError):
        t.write([WriteOp(loc, 0, d, (1 << 20) - 1, 2)])
    with pytest.raises(UnknownRegionError, match="another run"):
        t.write([WriteOp(loc, 0, dataclasses.replace(d, key=d.key ^ 1), 0, 2)])
    t.deregister(loc)
    with pytest.raises(UnknownRegionError, match="not registered"):
        t.write([WriteOp(loc, 0, d, 0, 2)])
    p.send("exit")
    pr.join(10)
