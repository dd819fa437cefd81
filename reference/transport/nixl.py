"""NIXL back end: one-sided WRITEs through NVIDIA's NIXL agents (UCX underneath).

What it is
----------
NIXL (https://github.com/ai-dynamo/nixl) is the transfer library of NVIDIA Dynamo: one *agent*
per process, memory registered with the agent, agent *metadata* (connection info + remote keys)
handed to peers out of band, then WRITE/READ requests between descriptor lists. Its UCX plugin
picks the best path UCX finds: RDMA (``rc``/``dc`` over InfiniBand/RoCE, GPUDirect for VRAM) on
clusters, ``cuda_ipc`` between GPUs of one host, cross-memory attach (``cma``) between CPU
processes of one host, and TCP everywhere else. The same code runs on a laptop and on a cluster.

How it maps onto :class:`~weight_transfer.transport.base.Transport`
-------------------------------------------------------------
- One agent per :class:`NixlTransport`, named ``wt-<host>-<pid>-<random>``: a new name per
  process and run, so a descriptor from another run names an agent this sender never loaded.
- :meth:`NixlTransport.register` registers the tensor's memory (DRAM for CPU tensors, VRAM for
  CUDA tensors); ``region.descriptor()`` (built on first call) is a
  :class:`~weight_transfer.types.RegionDescriptor` whose ``extra`` carries
  the agent name, the memory type and device id, and the agent's *partial metadata* for that
  one region including its connection info (``get_partial_agent_metadata(reg, True)``, a few
  hundred bytes of opaque bytes). ``key`` is a random 64-bit token, checked by the sender
  exactly like CMA's. The descriptor is therefore the whole side channel: the control plane
  (``TrainerClient.get_plan`` / the TCPStore) carries it like any other descriptor.
- :meth:`NixlTransport.connect` loads every descriptor's metadata blob into the local agent
  (``add_remote_agent``; partial blobs of one agent accumulate) and remembers the descriptor.
- :meth:`NixlTransport.write` runs the contract's op checks (:func:`~.base.check_batch`: local
  region registered here, remote descriptor connected and equal, offsets and lengths inside both
  regions; the same rules and messages for every back end), then builds one NIXL transfer
  request per (remote agent, local memory type and device, remote memory type and device) from
  ``N x 3`` descriptor arrays, *creates all requests before posting any* (so a request NIXL
  refuses leaves nothing of the batch issued), posts them, and returns a handle.
  :meth:`NixlWriteHandle.wait` polls ``check_xfer_state`` (which also progresses the sender's
  UCX worker) until every request is ``DONE``; a request in ``ERR`` raises
  :class:`TransportError` naming the remote agent and the
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
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from ..types import RegionDescriptor
from .base import Batch, Region, Transport, TransportError, WriteHandle, WriteOp, describe_remote

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
        except ImportError as e:
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


NixlRegion = Region
"""The region type (:class:`~weight_transfer.transport.base.Region`; ``native`` is
``(NIXL registration list, memory type "DRAM"/"VRAM", device id)``). Name kept for imports."""


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
            except Exception:
                pass
        self._pending = []

    def done(self) -> bool:
        if self._pending and self._error is None:
            self._poll()
        return not self._pending

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise TransportError(self._error)

    def _timeout_message(self, timeout: float) -> str:
        names = sorted({self._reqs[i][0] for i in self._pending})
        return (f"NIXL write not complete after {timeout} s ({len(self._pending)} requests pending, "
                f"to agents {names}); is the receiver's progress thread running?")


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
    parts_devices = ("cpu", "cuda")  # each part one entry of the registration list

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
        super().__init__(host)
        self.agent_name = agent_name or f"wt-{self.host}-{self.pid}-{secrets.token_hex(4)}"
        cfg = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
        try:
            self.agent = _make_agent(api, self.agent_name, cfg, progress_delay_us)
        except Exception as e:
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
        self._agents: set[str] = set()
        self._tables: set[str] = set()  # epoch tables whose metadata is loaded
        self._table_reg = self._table_md = None  # this agent's epoch table registration
        self._ebuf = None  # (int64 tensor, registration): where epoch READs land
        self.epoch_timeout = 10.0
        """Seconds the epoch READ before a batch may take."""

    # ---- hooks of the contract ----------------------------------------------------------------

    def _check_device(self, tensor: torch.Tensor) -> None:
        _mem_of(tensor)

    def _register(self, region: Region):
        """One NIXL registration list: the region, or each part of a region of several
        allocations (a VRAM registration cannot span two allocations)."""
        mem, dev = _mem_of(region.tensor)
        addr, n = region.addr, region.length
        spans = [(addr + o, k) for o, k in region.parts] if region.parts else [(addr, n)]
        try:
            reg = self.agent.register_memory([(a, k, dev, "") for a, k in spans], mem)
        except Exception as e:
            raise TransportError(f"register: NIXL could not register {mem}:{dev} {addr:#x}+{n} "
                                 f"({len(spans)} part(s)): {e}") from e
        return (reg, mem, dev)

    def _deregister(self, region: Region) -> None:
        self.agent.deregister_memory(region.native[0])

    def _describe(self, region: Region) -> RegionDescriptor:
        """The region's descriptor, with this agent's partial metadata for it (built on first
        use: a sender's per-task staging registrations never need it)."""
        reg, mem, dev = region.native
        try:
            md = self.agent.get_partial_agent_metadata(reg, True)
            if self._table_reg is None:  # the epoch table, readable by senders (NIXL READ)
                table = self._epoch_table()
                self._table_reg = self.agent.register_memory([(table.addr, table.words.nbytes, 0, "")], "DRAM")
                self._table_md = bytes(self.agent.get_partial_agent_metadata(self._table_reg, True))
        except Exception as e:
            raise TransportError(f"descriptor: NIXL could not export metadata of {region!r}: {e}") from e
        return self._descriptor(region, key=secrets.randbits(64),
                                extra=(("agent", self.agent_name), ("mem", mem), ("dev", dev), ("md", bytes(md)),
                                       ("epochs_md", self._table_md)))

    def _check_descriptor(self, d: RegionDescriptor) -> None:
        x = descriptor_extra(d)
        missing = [k for k in ("agent", "mem", "dev", "md", "epochs_md", "epochs") if k not in x]
        if missing or not isinstance(x.get("md"), (bytes, bytearray)):
            raise ValueError(f"connect: descriptor {describe_remote(d)} lacks NIXL fields {missing or ['md (bytes)']}")
        if x["mem"] not in ("DRAM", "VRAM"):
            raise ValueError(f"connect: descriptor {describe_remote(d)} has memory type {x['mem']!r}")

    def _connect(self, d: RegionDescriptor):
        """Load the descriptor's agent metadata (``add_remote_agent``; partial blobs of one agent
        accumulate). TransportError when NIXL refuses it."""
        x = descriptor_extra(d)
        try:
            got = self.agent.add_remote_agent(bytes(x["md"]))
        except Exception as e:
            raise TransportError(f"connect: NIXL refused the metadata of {describe_remote(d)}: {e}") from e
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != x["agent"]:
            raise ValueError(f"connect: descriptor {describe_remote(d)} names agent {x['agent']!r} "
                             f"but its metadata is agent {got!r}")
        self._agents.add(got)
        ident = x["epochs"][2]
        if ident not in self._tables:
            try:
                self.agent.add_remote_agent(bytes(x["epochs_md"]))
            except Exception as e:
                raise TransportError(f"connect: NIXL refused the epoch-table metadata of {describe_remote(d)}: {e}") from e
            self._tables.add(ident)
        return (got, d.addr)

    def _published_epochs(self, remotes: list[RegionDescriptor]) -> list[int]:
        """Read the owners' epoch words with NIXL READs (one request per remote agent, waited
        for: a round trip per batch) into a small registered buffer of this agent."""
        from .lease import EpochTable

        n = len(remotes)
        if self._ebuf is None or self._ebuf[0].numel() < n:
            if self._ebuf is not None:
                self.agent.deregister_memory(self._ebuf[1])
            buf = torch.zeros(max(64, n), dtype=torch.int64)
            self._ebuf = (buf, self.agent.register_memory([(buf.data_ptr(), buf.nbytes, 0, "")], "DRAM"))
        buf = self._ebuf[0]
        base = buf.data_ptr()
        by_agent: dict[str, list[int]] = {}
        for k, d in enumerate(remotes):
            by_agent.setdefault(dict(d.extra)["agent"], []).append(k)
        for agent, ks in by_agent.items():
            la = np.asarray([(base + 8 * k, 8, 0) for k in ks], dtype=np.uint64)
            ra = []
            for k in ks:
                table, slot, _ = dict(remotes[k].extra)["epochs"]
                ra.append((table + EpochTable.epoch_offset(slot), 8, 0))
            try:
                h = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(la, "DRAM"),
                                               self.agent.get_xfer_descs(np.asarray(ra, dtype=np.uint64), "DRAM"),
                                               agent)
            except Exception as e:
                raise TransportError(f"epoch check: NIXL refused reading the epoch table of agent {agent} "
                                     f"({type(e).__name__}: {e}); nothing of the batch was issued") from e
            try:
                state = self.agent.transfer(h)
                t0 = time.monotonic()
                while state not in ("DONE", "ERR"):
                    if time.monotonic() - t0 > self.epoch_timeout:
                        state = "timeout"
                        break
                    state = self.agent.check_xfer_state(h)
            finally:
                try:
                    self.agent.release_xfer_handle(h)
                except Exception:
                    pass
            if state != "DONE":
                raise TransportError(f"epoch check: reading the epoch table of agent {agent} failed ({state}); "
                                     "the receiver may be gone; nothing of the batch was issued")
        return buf[:n].tolist()

    def _disconnect(self) -> None:
        for r in (self._ebuf, (None, self._table_reg)):
            if r is not None and r[1] is not None:
                try:
                    self.agent.deregister_memory(r[1])
                except Exception:
                    pass
        self._ebuf = self._table_reg = None
        self._tables.clear()
        for a in list(self._agents):
            try:
                self.agent.remove_remote_agent(a)
            except Exception:
                pass
        self._agents.clear()

    def _remote_key(self, d: RegionDescriptor):
        """``(agent name, addr)``: a descriptor of another agent was never connected."""
        return (dict(d.extra).get("agent") if isinstance(d.extra, tuple) else None, d.addr)

    def _group_key(self, loc: Region, remote: RegionDescriptor, key):
        """One NIXL request per (remote agent, local memory type and device, remote memory type
        and device)."""
        _, lmem, ldev = loc.native
        x = dict(remote.extra)
        return (key[0], lmem, ldev, x["mem"], x["dev"])

    def _post(self, batch: Batch, ops: Sequence[WriteOp]) -> NixlWriteHandle:
        """Create one NIXL WRITE request per group, *all before posting any* (a request NIXL
        refuses leaves nothing of the batch issued), then post them all. Returns the handle;
        :meth:`NixlWriteHandle.wait` completes it."""
        reqs = []
        agent = None
        try:
            for (agent, lmem, ldev, rmem, rdev), g in batch.groups.items():
                la = np.asarray([(a, n, ldev) for a, n in zip(g.laddr, g.lens)], dtype=np.uint64)
                ra = np.asarray([(a, n, rdev) for a, n in zip(g.raddr, g.lens)], dtype=np.uint64)
                ld = self.agent.get_xfer_descs(la, lmem)
                rdl = self.agent.get_xfer_descs(ra, rmem)
                h = self.agent.initialize_xfer("WRITE", ld, rdl, agent)
                reqs.append((agent, h, len(g.idx), sum(g.lens)))
        except Exception as e:
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
                    except Exception:
                        pass
                raise TransportError(
                    f"NIXL could not post the WRITE of {nops} ops ({nb} bytes) to agent {agent}; "
                    f"{k} of {len(reqs)} requests of the batch had been posted"
                )
        return NixlWriteHandle(self.agent, reqs, batch.nbytes)
