"""NIXL back end: one-sided WRITEs through NVIDIA's NIXL agents (UCX underneath).

What it is
----------
NIXL (https://github.com/ai-dynamo/nixl) is the transfer library of NVIDIA Dynamo: one *agent*
per process, memory registered with the agent, agent *metadata* (connection info + remote keys)
handed to peers out of band, then WRITE/READ requests between descriptor lists. Its UCX plugin
picks the best path UCX finds: RDMA (``rc``/``dc`` over InfiniBand/RoCE, GPUDirect for VRAM) on
clusters, ``cuda_ipc`` between GPUs of one host, cross-memory attach (``cma``) between CPU
processes of one host, and TCP everywhere else. The same code runs on a laptop and on a cluster.

How it maps onto :class:`~reference.transport.base.Transport`
-------------------------------------------------------------
- One agent per :class:`NixlTransport`, named ``wt-<host>-<pid>-<random>``: a new name per
  process and run, so a descriptor from another run names an agent this sender never loaded.
- :meth:`NixlTransport.register` registers the tensor's memory (DRAM for CPU tensors, VRAM for
  CUDA tensors); ``region.descriptor()`` (built on first call) is a
  :class:`~reference.types.RegionDescriptor` whose ``extra`` carries
  the agent name, the memory type and device id, and the agent's *partial metadata* for that
  one region including its connection info (``get_partial_agent_metadata(reg, True)``, a few
  hundred bytes of opaque bytes). ``key`` is a random 64-bit token, checked by the sender
  exactly like CMA's. The descriptor is therefore the whole side channel: the control plane
  (``TrainerClient.get_plan`` / the TCPStore) carries it like any other descriptor.
- :meth:`NixlTransport.connect` loads every descriptor's metadata blob into the local agent
  (``add_remote_agent``; partial blobs of one agent accumulate) and remembers the descriptor.
- :meth:`NixlTransport.write` validates every op first (local region registered here, remote
  descriptor connected with the same key and length, offsets and lengths inside both regions:
  the same rules and messages as CMA), then builds one NIXL transfer request per
  (remote agent, local memory type, remote memory type) from ``N x 3`` descriptor arrays,
  *creates all requests before posting any* (so a request NIXL refuses leaves nothing of the
  batch issued), posts them, and returns a handle. :meth:`NixlWriteHandle.wait` polls
  ``check_xfer_state`` (which also progresses the sender's UCX worker) until every request is
  ``DONE``; a request in ``ERR`` raises :class:`TransportError` naming the remote agent and the
  number of ops; the handles are released either way.

The receiver's progress thread (must run)
-----------------------------------------
The receiving side runs no code per write, but its NIXL agent must run its **progress
thread** (``nixl_agent_config(enable_prog_thread=True)``, this class's default
``progress_thread=True``): UCX's connection set-up (wire-up) is a message exchange that needs
the receiver's worker to make progress, and over TCP every put is an active message the
receiver's worker must process. Measured here (two processes, 256 MiB write): with the
receiver's progress thread off, the write never completes, over TCP (``UCX_TLS=tcp``) and with
UCX's default choice (CMA put, TCP wire-up) alike; with it on, both complete. On an RDMA fabric
the data itself moves without the receiver's CPU, but wire-up still needs the thread. So an
inference rank creates its ``NixlTransport`` (progress thread on), registers, publishes, and
keeps the transport object alive for the whole job.

Selecting the path
------------------
UCX reads its environment when the agent is created: ``UCX_TLS=tcp`` forces TCP (what the
network-namespace test uses), ``UCX_NET_DEVICES=mlx5_0:1,mlx5_1:1`` selects NICs (several
devices: UCX stripes over them), ``UCX_TLS`` unset lets UCX choose. ``ucx_tls=`` /
``net_devices=`` set those variables for this process before the agent is created (they are
process-wide: set them before the first agent). Verified here: default (CMA put over TCP
wire-up) and ``UCX_TLS=tcp`` work between processes; ``UCX_TLS`` limited to shared memory
(``sm``, ``shm,self``, ``cma,self``) makes NIXL's UCX backend creation fail
(``NIXL_ERR_BACKEND``): it needs a transport that can also carry wire-up, e.g. ``cma,tcp``.

Install
-------
``pip install 'nixl-cu12==1.5.1'`` (or ``pip install -e '.[nixl]'``): its own requirements are
only ``torch`` and ``numpy``, so a CPU torch already installed stays. The wheel bundles UCX,
libibverbs and mlx5. Do not ``pip install nixl`` plainly: the ``nixl`` meta package depends on
both ``nixl-cu12`` and ``nixl-cu13``; if you want the ``import nixl`` name, add it with
``pip install --no-deps nixl==1.5.1``. This module imports ``nixl._api`` and falls back to
``nixl_cu12._api`` / ``nixl_cu13._api``.

Usage::

    # receiver (inference rank), once; keep `t` alive
    t = NixlTransport(); region = t.register(params_buffer); publish(region.descriptor())
    # sender (training rank)
    t = NixlTransport(); src = t.register(staging); t.connect(descriptors)
    t.write([WriteOp(src, 0, descriptors[0], 4096, n)]).wait()
"""
from __future__ import annotations

import importlib
import os
import secrets
import socket
import threading
import time
from typing import Sequence

import numpy as np
import torch

from ..types import RegionDescriptor
from .base import BoundsError, Region, Transport, TransportError, UnknownRegionError, WriteHandle, WriteOp

__all__ = ["NixlTransport", "NixlRegion", "NixlWriteHandle", "load_nixl", "INSTALL_HINT", "descriptor_extra"]

INSTALL_HINT = (
    "the 'nixl' transport needs NIXL's Python package: pip install 'nixl-cu12==1.5.1' "
    "(or pip install -e '.[nixl]'); do not 'pip install nixl' plainly (it also pulls nixl-cu13), "
    "see docs/TRANSPORTS.md"
)

_API = None


def load_nixl():
    """Import NIXL's Python API module (``nixl._api``, else ``nixl_cu12._api`` /
    ``nixl_cu13._api``). Raises ImportError with :data:`INSTALL_HINT` when none is installed."""
    global _API
    if _API is not None:
        return _API
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent creation at INFO
    errors = []
    for mod in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            _API = importlib.import_module(mod)
            return _API
        except ImportError as e:  # noqa: PERF203
            errors.append(f"{mod}: {e}")
    raise ImportError(f"{INSTALL_HINT} (tried {'; '.join(errors)})")


def descriptor_extra(d: RegionDescriptor) -> dict:
    """``d.extra`` as a dict (``agent``, ``mem``, ``dev``, ``md``)."""
    return dict(d.extra)


def _mem_of(t: torch.Tensor) -> tuple[str, int]:
    if t.device.type == "cpu":
        return "DRAM", 0
    if t.device.type == "cuda":
        return "VRAM", t.device.index if t.device.index is not None else torch.cuda.current_device()
    raise ValueError(f"register: NIXL registers CPU or CUDA tensors, got device {t.device}")


class NixlRegion(Region):
    """A registered tensor (holds a reference while registered) and its NIXL registration."""

    __slots__ = ("_tensor", "_desc", "_reg", "mem", "dev", "_addr", "_length", "_owner")

    def __init__(self, tensor: torch.Tensor, desc, reg, mem: str, dev: int, addr: int, length: int, owner):
        self._tensor, self._desc, self._reg, self.mem, self.dev = tensor, desc, reg, mem, dev
        self._addr, self._length, self._owner = addr, length, owner

    @property
    def addr(self) -> int:
        return self._addr

    @property
    def length(self) -> int:
        return self._length

    @property
    def tensor(self) -> torch.Tensor | None:
        return self._tensor

    def descriptor(self) -> RegionDescriptor:
        if self._desc is None:
            if self._tensor is None:
                raise TransportError(f"descriptor: {self!r} was deregistered")
            self._desc = self._owner._describe(self)
        return self._desc

    def __repr__(self) -> str:
        live = "" if self._tensor is not None else ", deregistered"
        return f"NixlRegion({self.mem}:{self.dev}, addr={self.addr:#x}, length={self.length}{live})"


class NixlWriteHandle(WriteHandle):
    """Completion of one posted batch: the NIXL transfer requests of the batch, per remote agent."""

    def __init__(self, agent, reqs: list[tuple[str, object, int, int]], nbytes: int):
        self._agent = agent
        self._reqs = reqs  # (remote agent, xfer handle, n ops, bytes)
        self._pending = list(range(len(reqs)))
        self.nbytes = nbytes
        self._error: str | None = None

    def _poll(self) -> None:
        still = []
        for i in self._pending:
            name, h, nops, nb = self._reqs[i]
            s = self._agent.check_xfer_state(h)
            if s == "DONE":
                self._agent.release_xfer_handle(h)
            elif s == "PROC":
                still.append(i)
            else:
                self._error = (
                    f"NIXL transfer of {nops} ops ({nb} bytes) to agent {name} failed (state {s}); "
                    "the receiver may have exited or deregistered its memory"
                )
                self._release_all()
                still = []
                break
        self._pending = still

    def _release_all(self) -> None:
        for i in self._pending:
            try:
                self._agent.release_xfer_handle(self._reqs[i][1])
            except Exception:  # noqa: BLE001  (a request in flight cannot always be released)
                pass
        self._pending = []

    def done(self) -> bool:
        if self._pending and self._error is None:
            self._poll()
        return not self._pending

    def wait(self, timeout: float | None = None) -> int:
        t0 = time.monotonic()
        while True:
            if self._pending and self._error is None:
                self._poll()
            if self._error is not None:
                raise TransportError(self._error)
            if not self._pending:
                return self.nbytes
            if timeout is not None and time.monotonic() - t0 > timeout:
                names = sorted({self._reqs[i][0] for i in self._pending})
                raise TimeoutError(
                    f"NIXL write not complete after {timeout} s ({len(self._pending)} requests pending, "
                    f"to agents {names}); is the receiver's progress thread running?"
                )


def _rdma_devices() -> list[str]:
    """RDMA devices the kernel exposes (``/sys/class/infiniband``).

    Why it matters: without an RDMA NIC, UCX's ``ib`` modules are useless, and when Debian's
    rdma-core is installed too (e.g. ``python3-pyverbs`` pulls it), the wheel's bundled
    libibverbs loads the system's verbs providers, so two copies of libnl-route-3 end up in the
    process and the process dies with SIGSEGV in ``rtnl_tc_unregister`` at exit (measured with
    gdb here, NIXL 1.5.1). ``UCX_MODULES=^ib`` avoids loading them; :class:`NixlTransport` sets
    it when no device exists and ``UCX_MODULES`` is unset."""
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


_AGENT_LOCK = threading.Lock()


def _make_agent(api, name: str, cfg, delay_us: int):
    """``api.nixl_agent(name, cfg)`` with the progress thread's poll delay set to ``delay_us``.

    NIXL's Python wrapper hard-codes ``pthrDelay = 0``: the progress thread then spins, and on
    a 2-core box each idle agent takes 0.2-0.4 of a core (measured: 0.57 and 1.28 CPU-s per 3 s idle),
    starving the other processes. 100 us takes it to ~0.06 CPU-s per 3 s with no measurable
    change in write bandwidth here. The wrapper offers no knob, so the binding's agent
    constructor is wrapped for the duration of this call (under a lock)."""
    real = api.nixlBind.nixlAgent

    def agent_with_delay(agent_name, agent_config):
        agent_config.pthrDelay = int(delay_us)
        return real(agent_name, agent_config)

    with _AGENT_LOCK:
        api.nixlBind.nixlAgent = agent_with_delay
        try:
            return api.nixl_agent(name, cfg)
        finally:
            api.nixlBind.nixlAgent = real


class NixlTransport(Transport):
    """One process's NIXL endpoint (one agent).

    ``progress_thread`` must stay True on receivers (see the module docstring);
    ``progress_delay_us`` is its poll period (0 = spin, NIXL's default). ``ucx_tls`` and
    ``net_devices`` set ``UCX_TLS`` / ``UCX_NET_DEVICES`` for this process before the agent is
    created. ``backends`` are NIXL plugin names (``("UCX",)``)."""

    name = "nixl"

    def __init__(self, host: str | None = None, *, agent_name: str | None = None,
                 backends: Sequence[str] = ("UCX",), progress_thread: bool = True,
                 progress_delay_us: int = 100,
                 ucx_tls: str | None = None, net_devices: str | None = None):
        api = load_nixl()
        if ucx_tls is not None:
            os.environ["UCX_TLS"] = ucx_tls
        if net_devices is not None:
            os.environ["UCX_NET_DEVICES"] = net_devices
        if "UCX_MODULES" not in os.environ and not _rdma_devices():
            # no RDMA NIC: keep UCX from loading its InfiniBand modules (see _rdma_devices)
            os.environ["UCX_MODULES"] = "^ib"
        self.host = host if host is not None else socket.gethostname()
        self.pid = os.getpid()
        self.agent_name = agent_name or f"wt-{self.host}-{self.pid}-{secrets.token_hex(4)}"
        cfg = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
        try:
            self.agent = _make_agent(api, self.agent_name, cfg, progress_delay_us)
        except Exception as e:  # noqa: BLE001
            raise TransportError(
                f"NIXL agent {self.agent_name} could not start backends {list(backends)}: "
                f"{type(e).__name__}: {e} (UCX_TLS={os.environ.get('UCX_TLS')!r}; UCX needs a transport "
                "that can carry wire-up, e.g. leave UCX_TLS unset or include tcp)"
            ) from e
        missing = [b for b in backends if b not in self.agent.backends]
        if missing:
            raise TransportError(
                f"NIXL agent {self.agent_name}: backends {missing} not available; "
                f"plugins found: {self.agent.get_plugin_list()}"
            )
        self._local: dict[int, NixlRegion] = {}
        self._remote: dict[tuple[str, int], RegionDescriptor] = {}  # (agent, addr) -> desc
        self._agents: set[str] = set()

    # ---- registration -----------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> NixlRegion:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"register: expected a torch.Tensor, got {type(tensor).__name__}")
        mem, dev = _mem_of(tensor)
        if not tensor.is_contiguous():
            raise ValueError("register: tensor must be contiguous")
        n = tensor.numel() * tensor.element_size()
        if n == 0:
            raise ValueError("register: cannot register a zero-byte tensor")
        addr = tensor.data_ptr()
        try:
            reg = self.agent.register_memory([(addr, n, dev, "")], mem)
        except Exception as e:  # noqa: BLE001
            raise TransportError(f"register: NIXL could not register {mem}:{dev} {addr:#x}+{n}: {e}") from e
        region = NixlRegion(tensor, None, reg, mem, dev, addr, n, self)
        self._local[id(region)] = region
        return region

    def _describe(self, region: "NixlRegion") -> RegionDescriptor:
        """The region's descriptor, with this agent's partial metadata for it (built on first
        use: a sender's per-task staging registrations never need it)."""
        try:
            md = self.agent.get_partial_agent_metadata(region._reg, True)
        except Exception as e:  # noqa: BLE001
            raise TransportError(f"descriptor: NIXL could not export metadata of {region!r}: {e}") from e
        return RegionDescriptor(
            transport="nixl", host=self.host, pid=self.pid, addr=region.addr, length=region.length,
            key=secrets.randbits(64),
            extra=(("agent", self.agent_name), ("mem", region.mem), ("dev", region.dev), ("md", bytes(md))),
        )

    def deregister(self, region: Region) -> None:
        if self._local.pop(id(region), None) is not None:
            try:
                self.agent.deregister_memory(region._reg)  # type: ignore[attr-defined]
            finally:
                region._tensor = None  # type: ignore[attr-defined]

    def connect(self, descriptors: Sequence[RegionDescriptor]) -> None:
        """Load every descriptor's agent metadata. All are checked before any is loaded:
        ValueError for another transport or a malformed descriptor; TransportError when NIXL
        refuses a metadata blob."""
        for d in descriptors:
            if not isinstance(d, RegionDescriptor):
                raise ValueError(f"connect: expected RegionDescriptor, got {type(d).__name__}")
            if d.transport != "nixl":
                raise ValueError(f"connect: descriptor {_name(d)} is for transport {d.transport!r}, not 'nixl'")
            x = descriptor_extra(d)
            missing = [k for k in ("agent", "mem", "dev", "md") if k not in x]
            if missing or not isinstance(x.get("md"), (bytes, bytearray)):
                raise ValueError(f"connect: descriptor {_name(d)} lacks NIXL fields {missing or ['md (bytes)']}")
            if x["mem"] not in ("DRAM", "VRAM"):
                raise ValueError(f"connect: descriptor {_name(d)} has memory type {x['mem']!r}")
            if d.addr <= 0 or d.length <= 0:
                raise ValueError(f"connect: malformed descriptor {d}")
        for d in descriptors:
            x = descriptor_extra(d)
            try:
                got = self.agent.add_remote_agent(bytes(x["md"]))
            except Exception as e:  # noqa: BLE001
                raise TransportError(f"connect: NIXL refused the metadata of {_name(d)}: {e}") from e
            got = got.decode() if isinstance(got, bytes) else str(got)
            if got != x["agent"]:
                raise ValueError(f"connect: descriptor {_name(d)} names agent {x['agent']!r} but its metadata is agent {got!r}")
            self._agents.add(got)
            self._remote[(got, d.addr)] = d

    def close(self) -> None:
        for r in list(self._local.values()):
            self.deregister(r)
        for a in list(self._agents):
            try:
                self.agent.remove_remote_agent(a)
            except Exception:  # noqa: BLE001
                pass
        self._agents.clear()
        self._remote.clear()

    # ---- data path --------------------------------------------------------------------------

    def write(self, ops: Sequence[WriteOp]) -> NixlWriteHandle:
        """Validate every op, create one NIXL WRITE request per (remote agent, memory types),
        then post them all. Returns the handle; :meth:`NixlWriteHandle.wait` completes it."""
        groups: dict[tuple[str, str, str], tuple[list, list, list]] = {}
        total = 0
        last_loc = last_rd = None
        g = None
        rinfo = None
        for i, op in enumerate(ops):
            loc = op.local
            if loc is not last_loc:
                if self._local.get(id(loc)) is not loc:
                    raise UnknownRegionError(
                        f"op {i}: local region {loc!r} is not registered with this transport "
                        "(deregistered, or registered elsewhere); nothing of the batch was issued"
                    )
                last_loc = loc
                last_rd = None  # the group depends on the local memory type too
            rd = op.remote
            if rd is not last_rd:
                x = dict(rd.extra)
                agent = x.get("agent")
                c = self._remote.get((agent, rd.addr))
                if c is None or c.key != rd.key or c.length != rd.length:
                    raise UnknownRegionError(_unknown_msg(i, rd, c))
                last_rd = rd
                cx = dict(c.extra)
                rinfo = (c, cx["dev"])
                gk = (agent, loc.mem, cx["mem"])
                g = groups.get(gk)
                if g is None:
                    g = groups[gk] = ([], [], [])
            c, rdev = rinfo
            lo, ro, n = op.local_offset, op.remote_offset, op.length
            if lo < 0 or ro < 0 or n < 0 or lo + n > loc.length or ro + n > c.length:
                raise BoundsError(_bounds_msg(i, loc, c, lo, ro, n))
            if n:
                g[0].append((loc.addr + lo, n, loc.dev))
                g[1].append((c.addr + ro, n, rdev))
                g[2].append(i)
                total += n

        # create every request first: a refusal leaves nothing of the batch issued
        reqs = []
        try:
            for (agent, lmem, rmem), (la, ra, idx) in groups.items():
                ld = self.agent.get_xfer_descs(np.asarray(la, dtype=np.uint64), lmem)
                rdl = self.agent.get_xfer_descs(np.asarray(ra, dtype=np.uint64), rmem)
                h = self.agent.initialize_xfer("WRITE", ld, rdl, agent)
                reqs.append((agent, h, len(idx), sum(x[1] for x in la)))
        except Exception as e:  # noqa: BLE001
            for _, h, _, _ in reqs:
                self.agent.release_xfer_handle(h)
            raise TransportError(
                f"NIXL refused a WRITE request to agent {agent} ({type(e).__name__}: {e}): a region "
                "is not registered on one side as NIXL knows it; nothing of the batch was issued"
            ) from e
        for k, (agent, h, nops, nb) in enumerate(reqs):
            s = self.agent.transfer(h)
            if s == "ERR":
                for _, h2, _, _ in reqs[k:]:
                    try:
                        self.agent.release_xfer_handle(h2)
                    except Exception:  # noqa: BLE001
                        pass
                raise TransportError(
                    f"NIXL could not post the WRITE of {nops} ops ({nb} bytes) to agent {agent}; "
                    f"{k} of {len(reqs)} requests of the batch had been posted"
                )
        return NixlWriteHandle(self.agent, reqs, total)


# --------------------------------------------------------------------------------------------
# messages


def _name(d: RegionDescriptor) -> str:
    agent = dict(d.extra).get("agent", "?") if isinstance(d.extra, tuple) else "?"
    return f"(agent {agent}, addr {d.addr:#x}, length {d.length})"


def _unknown_msg(i, rd: RegionDescriptor, c: RegionDescriptor | None) -> str:
    if c is None:
        why = ("was never connected (a descriptor of another agent or run; call connect() with the "
               "receiver's descriptors first)")
    elif c.key != rd.key:
        why = (f"has key {rd.key:#x} but the connected registration has key {c.key:#x} "
               "(a descriptor from another run or a re-registration)")
    else:
        why = f"has length {rd.length} but the connected one has length {c.length}"
    return f"op {i}: remote region {_name(rd)} {why}; nothing of the batch was issued"


def _bounds_msg(i: int, loc: NixlRegion, c: RegionDescriptor, lo: int, ro: int, n: int) -> str:
    parts = []
    if lo < 0:
        parts.append(f"local_offset {lo} < 0")
    if ro < 0:
        parts.append(f"remote_offset {ro} < 0")
    if n < 0:
        parts.append(f"length {n} < 0")
    if lo + n > loc.length:
        parts.append(f"local_offset {lo} + length {n} = {lo + n} > local region length {loc.length}")
    if ro + n > c.length:
        parts.append(f"remote_offset {ro} + length {n} = {ro + n} > remote region length {c.length}")
    return (f"op {i}: out of bounds: {'; '.join(parts)} [local {loc!r}, remote {_name(c)}]; "
            "nothing of the batch was issued")
