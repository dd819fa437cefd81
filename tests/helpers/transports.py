"""The transport-contract receiver: a spawned process that builds one transport, registers a
1 MiB uint8 buffer of POISON and a bf16 tensor (on the GPU for ``cuda_ipc``), publishes their
descriptors and then only answers requests (bytes, re-register, the C17 region commands). Used
by tests/transport/test_base.py (every transport), tests/transport/test_cma.py and
tests/transport/test_shm.py (C17). Where the transport registers several allocations as one
region on its device (``parts_devices``) it also publishes ``parts``: two slices of one buffer
with a gap between them (``register_parts``). Its memory comes from the transport's ``allocate`` (plain
``torch.empty`` for most; a shared segment for ``shm``, which can publish nothing else)."""
from __future__ import annotations

import os

import pytest
import torch

from weight_transfer.transport import make_transport

from .receiver import Receiver

MIB = 1 << 20
POISON = 0xA5
BF16_N = 257  # odd element count: 514 bytes


# ---- which transports are present ------------------------------------------------------------


def _nixl_missing() -> str | None:
    try:
        from weight_transfer.transport.nixl import load_nixl

        load_nixl()
    except ImportError as e:
        return f"NIXL not installed ({e})"
    return None


def _verbs_missing() -> str | None:
    from weight_transfer.transport import verbs

    try:
        verbs.load_pyverbs()
    except ImportError as e:
        return f"pyverbs not installed ({e})"
    if not verbs.list_nics():
        return "no RDMA device (/sys/class/infiniband absent or empty; libibverbs lists none)"
    return None


def _cuda_missing() -> str | None:
    return None if torch.cuda.is_available() else "needs a CUDA GPU and a CUDA build of torch"


def _kwargs(name: str) -> dict:
    if name == "verbs":
        from weight_transfer.transport import verbs

        return {"nics": verbs.list_nics()[:1], "listen": ("127.0.0.1", 0)}
    return {}


def _device(name: str) -> str:
    return "cuda" if name == "cuda_ipc" else "cpu"


def alloc(t, n: int, dtype=torch.uint8, device: str = "cpu") -> torch.Tensor:
    """``n`` elements of ``dtype`` in memory transport ``t`` can publish (``t.allocate``)."""
    return t.allocate(n * dtype.itemsize, device=device).view(dtype)


def _param(name: str, missing, *marks):
    why = missing() if missing else None
    return pytest.param(name, id=name, marks=[*marks, *([pytest.mark.skip(reason=why)] if why else [])])


TRANSPORTS = [
    _param("cma", None),
    _param("shm", None),
    _param("nixl", _nixl_missing),
    _param("verbs", _verbs_missing, pytest.mark.rdma),
    _param("cuda_ipc", _cuda_missing, pytest.mark.gpu),
]


# ---- the receiver process ----------------------------------------------------------------------


C17_BYTES = 64 << 10  # the C17 region: 64 KiB
PART_BYTES = 4096  # each part of the region of several parts ("parts")
C17_NEW = 0x3C  # what the unrelated tensor at a reused address holds


def _receiver(conn, name: str, kw: dict) -> None:
    """Register buffers, publish descriptors, then serve byte dumps until told to exit.

    The C17 commands work on a 64 KiB region ``c17`` cut from ``pool`` (so "free it and put a
    new tensor at the same address" is deterministic, as a caching allocator reusing a block):
    ``c17_new`` registers a fresh one (POISON) and answers its descriptor; ``c17_dereg``
    deregisters it (answers the seconds it took, or the error); ``c17_rereg`` deregisters and
    registers the same tensor again (new descriptor); ``c17_reuse`` deregisters, drops the
    tensor and makes an unrelated tensor at the same address holding C17_NEW (answers its
    address); ``race_dereg`` waits the given seconds (busy, to land inside a sender's stream of
    batches), deregisters, and at once overwrites the region's memory with C17_NEW (its reuse;
    answers the seconds deregister took); ``fill_leases`` / ``clear_leases`` mark every free lease
    slot of its table held by itself (a live pid) / free them again."""
    import time

    t = make_transport(name, **kw)
    dev = _device(name)
    pool = alloc(t, 2 * C17_BYTES, device=dev)
    tensors = {
        "buf": alloc(t, MIB, device=dev).fill_(POISON),
        "bf16": alloc(t, BF16_N, torch.bfloat16, dev).zero_(),
    }
    regions = {k: t.register(v) for k, v in tensors.items()}
    parts: list = []
    if torch.device(dev).type in t.parts_devices:  # "parts": two slices of one buffer, PART_BYTES apart
        ppool = alloc(t, 3 * PART_BYTES, device=dev).fill_(POISON)
        parts = [ppool[:PART_BYTES], ppool[2 * PART_BYTES:]]
        regions["parts"] = t.register_parts(parts)
    conn.send({k: r.descriptor() for k, r in regions.items()})
    while True:
        cmd, *args = conn.recv()
        if dev == "cuda":
            torch.cuda.synchronize()
        if cmd == "c17_new":
            if "c17" in regions:
                t.deregister(regions.pop("c17"))
            tensors["c17"] = pool[:C17_BYTES].fill_(POISON)
            regions["c17"] = t.register(tensors["c17"])
            conn.send(regions["c17"].descriptor())
        elif cmd == "c17_dereg":
            if args:
                t.lease_timeout = args[0]
            t0 = time.monotonic()
            try:
                t.deregister(regions.pop("c17"))
                conn.send(time.monotonic() - t0)
            except Exception as e:
                conn.send(f"{type(e).__name__}: {e}")
        elif cmd == "race_dereg":
            t_end = time.monotonic() + args[0]
            while time.monotonic() < t_end:
                pass
            t0 = time.monotonic()
            t.deregister(regions.pop("c17"))
            took = time.monotonic() - t0
            tensors["c17"].fill_(C17_NEW)  # deregister returned: the memory is the receiver's again
            conn.send(took)
        elif cmd in ("fill_leases", "clear_leases"):
            from weight_transfer.transport.lease import LEASE_SLOTS, REGION_SLOTS

            lw = t._epoch_table().words[1 + REGION_SLOTS:].view(LEASE_SLOTS, 2)
            mine = args[0] if args else []
            if cmd == "fill_leases":
                free = [i for i in range(LEASE_SLOTS) if lw[i, 0] == 0]
                for i in free:
                    lw[i, 0] = os.getpid()
                conn.send(free)
            else:
                for i in mine:
                    lw[i] = 0
                conn.send(True)
        elif cmd == "c17_rereg":
            t.deregister(regions.pop("c17"))
            regions["c17"] = t.register(tensors["c17"])
            conn.send(regions["c17"].descriptor())
        elif cmd == "c17_reuse":
            t.deregister(regions.pop("c17"))
            del tensors["c17"]
            tensors["c17"] = pool[:C17_BYTES].fill_(C17_NEW)  # a new tensor on the same block
            conn.send(tensors["c17"].data_ptr())
        elif cmd == "bytes":
            got = [p.cpu() for p in parts] if args[0] == "parts" else [tensors[args[0]].view(torch.uint8).cpu()]
            conn.send(b"".join(x.numpy().tobytes() for x in got))  # "parts": the parts in address order
        elif cmd == "reset":
            tensors["buf"].fill_(POISON)
            tensors["bf16"].zero_()
            for p in parts:
                p.fill_(POISON)
            conn.send(True)
        elif cmd == "reregister":
            t.deregister(regions[args[0]])
            regions[args[0]] = t.register(tensors[args[0]])
            conn.send(regions[args[0]].descriptor())
        elif cmd == "exit":
            t.close()
            conn.send(True)
            return


def start_receiver(name: str) -> Receiver:
    """A :class:`receiver.Receiver` running :func:`_receiver` for transport ``name``."""
    return Receiver(_receiver, (name, _kwargs(name)), start_timeout=60, what=f"{name} receiver")
