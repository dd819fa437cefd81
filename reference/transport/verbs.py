"""pyverbs back end: RDMA WRITE over RC queue pairs (the cluster data plane).

What it is
----------
rdma-core's Python bindings (``pyverbs``) drive the NIC directly: open the device, allocate a
protection domain (PD), register memory regions (MR: host memory with ``ibv_reg_mr``; GPU
memory through a dma-buf file descriptor, ``ibv_reg_dmabuf_mr``, or through ``nvidia_peermem``
when the plain registration of a device pointer is accepted), create one reliable-connected
queue pair (RC QP) per (sender NIC, receiver NIC) pair, and post ``IBV_WR_RDMA_WRITE`` work
requests that land in the receiver's memory without its CPU.

Connection set-up (the only thing the receiver does)
----------------------------------------------------
An RC QP needs both ends: each side creates a QP and learns the other's QP number, LID/GID
and starting PSN (:class:`ConnInfo`, JSON-serializable). The receiver's transport therefore
runs a small *connection listener* thread (TCP, address in the descriptor's ``extra["cm"]``):
a sender connects once per receiver process, sends its :class:`ConnInfo` per rail, the
listener creates matching QPs, moves them INIT -> RTR -> RTS and answers with its own
:class:`ConnInfo`. After that the receiver's CPU is not involved; the listener only serves new
senders. The descriptor carries everything else: address, length, ``key`` (the rkey on the
first NIC), ``extra["rkeys"]`` (rkey per NIC), ``extra["run"]`` (a random token per transport:
a descriptor from another run is refused at connect time when the handshake answers another
token, and at write time when its key differs from the connected one).

Several NICs per node
---------------------
``nics=["mlx5_0", "mlx5_1"]`` (or ``WT_RDMA_NICS=mlx5_0,mlx5_1``) selects devices; ``None``
takes every device found. An unknown name raises ValueError listing the available devices, or
saying none exist. Memory is registered on every selected NIC; rails pair local NIC ``i`` with
remote NIC ``i mod n_remote``. ``stripe="write"`` spreads the writes of a batch round-robin
over the rails (by bytes, :func:`assign_rails`), ``stripe="region"`` sends every write to one
remote region over the same rail (chosen by the region's address), which keeps per-region
ordering.

Posting policy
--------------
Ops longer than ``max_msg`` (default 1 GiB; the port's ``max_msg_sz`` is usually 2 GiB) are
split (:func:`chunk_ops`). Work requests are posted as linked chains of at most ``max_chain``
(one ``ibv_post_send`` per chain); every ``signal_every``-th work request of a QP and the last
one of a batch are signaled (:func:`plan_signals`); an RC QP completes in order, so one signaled
completion retires every unsignaled request before it. The sender polls the completion queue
whenever a QP's send queue would overflow and in :meth:`VerbsWriteHandle.wait`. A completion
with an error status raises :class:`TransportError` with the status name
(:func:`wc_status_name`, e.g. ``IBV_WC_REM_ACCESS_ERR``: the receiver deregistered the region
or the rkey is stale) and the op it belongs to.

Checks before any post
----------------------
Same rules as every back end (:mod:`.base`): local region registered, remote descriptor
connected with the same key and length, offsets/lengths inside both regions; nothing of a batch
is posted when one op fails them.

Install (see docs/TRANSPORTS.md)
--------------------------------
Debian/Ubuntu: ``apt-get install python3-pyverbs`` (built for the system python; import it from
a venv of the same minor version by adding ``/usr/lib/python3/dist-packages`` to ``sys.path``,
which :func:`load_pyverbs` does as a fallback). PyPI: the ``pyverbs==56.0rc1`` manylinux wheel
(bundles libibverbs); the ``59.0`` sdist builds all of rdma-core and needs its build
dependencies (cmake, libnl-3-dev, libnl-route-3-dev, cython, ...).

Usage::

    # receiver (inference rank), once; keep `t` alive (its listener serves new senders)
    t = VerbsTransport(nics=["mlx5_0"]); region = t.register(params); publish(region.descriptor())
    # sender (training rank)
    t = VerbsTransport(nics=["mlx5_1"]); src = t.register(staging); t.connect(descriptors)
    t.write([WriteOp(src, 0, descriptors[0], 0, n)]).wait()
"""
from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
from collections.abc import Sequence

import torch

from ..types import RegionDescriptor
from .base import Batch, Region, Transport, TransportError, UnknownRegionError, WriteHandle, WriteOp
from .verbs_plan import (  # the pure parts (re-exported)
    _WC_HINTS,
    WC_STATUS_NAMES,
    ConnInfo,
    _recv_msg,
    _remote_key,
    _send_msg,
    assign_rails,
    check_ops,
    chunk_ops,
    plan_chains,
    plan_signals,
    select_nics,
    validate_descriptor,
    wc_status_name,
)

__all__ = [
    "ConnInfo", "VerbsTransport", "VerbsRegion", "VerbsWriteHandle", "WC_STATUS_NAMES",
    "assign_rails", "check_ops", "chunk_ops", "list_nics", "load_pyverbs", "plan_chains",
    "plan_signals", "select_nics", "validate_descriptor", "wc_status_name", "INSTALL_HINT",
]

INSTALL_HINT = (
    "the 'verbs' transport needs rdma-core's Python bindings (pyverbs): apt-get install "
    "python3-pyverbs (system python 3, importable from a venv of the same minor version), or "
    "pip install pyverbs==56.0rc1 (manylinux wheel); see docs/TRANSPORTS.md"
)


def list_nics() -> list[str]:
    """RDMA device names: from pyverbs when it imports, else from /sys/class/infiniband."""
    try:
        d = load_pyverbs()
        try:
            return sorted(x.name.decode() if isinstance(x.name, bytes) else x.name for x in d.device.get_device_list())
        except Exception:
            return []
    except ImportError:
        try:
            return sorted(os.listdir("/sys/class/infiniband"))
        except OSError:
            return []


# ---------------------------------------------------------------------------------------------
# device part

_PV = None


def load_pyverbs():
    """Import pyverbs (``device``, ``pd``, ``mr``, ``cq``, ``qp``, ``wr``, ``addr``, ``enums``
    as attributes of the returned namespace). Falls back to the distro's
    ``/usr/lib/python3/dist-packages`` when the running python's minor version matches.
    Raises ImportError with :data:`INSTALL_HINT`."""
    global _PV
    if _PV is not None:
        return _PV
    import importlib
    import types

    def _imp():
        ns = types.SimpleNamespace()
        for m in ("device", "pd", "mr", "cq", "qp", "wr", "addr", "enums"):
            setattr(ns, m, importlib.import_module(f"pyverbs.{m}"))
        return ns

    try:
        _PV = _imp()
    except ImportError as first:
        dist = "/usr/lib/python3/dist-packages"
        if os.path.isdir(os.path.join(dist, "pyverbs")) and dist not in sys.path:
            sys.path.append(dist)
            try:
                _PV = _imp()
            except ImportError as e:
                raise ImportError(f"{INSTALL_HINT} ({dist}/pyverbs exists but does not import: {e})") from e
        else:
            raise ImportError(f"{INSTALL_HINT} ({first})") from first
    return _PV


class _Nic:
    """One opened device: context, PD, CQ, port attributes."""

    def __init__(self, pv, name: str, port: int, gid_index: int | None, cq_depth: int):
        self.name, self.port = name, port
        self.ctx = pv.device.Context(name=name)
        self.pd = pv.pd.PD(self.ctx)
        self.cq = pv.cq.CQ(self.ctx, cq_depth)
        pa = self.ctx.query_port(port)
        self.lid = pa.lid
        self.mtu = pa.active_mtu
        self.gid_index = gid_index if gid_index is not None else (0 if pa.lid else _pick_roce_gid(self.ctx, port))
        self.gid = str(self.ctx.query_gid(port, self.gid_index)).replace(":", "").lower()
        self.max_msg = getattr(pa, "max_msg_sz", 1 << 31)


def _pick_roce_gid(ctx, port: int) -> int:
    """RoCE: prefer a RoCE v2 IPv4-mapped GID (``::ffff:a.b.c.d``), else index 0."""
    try:
        for idx in range(16):
            g = str(ctx.query_gid(port, idx)).replace(":", "").lower()
            if g.startswith("00000000000000000000ffff"):
                return idx
    except Exception:
        pass
    return 0


VerbsRegion = Region
"""The region type (:class:`~weight_transfer.transport.base.Region`; ``native`` is the list of MRs,
one per selected NIC). Name kept for imports."""


class _Rail:
    """One RC QP from a local NIC to a remote NIC, with its send-queue accounting."""

    def __init__(self, nic: _Nic, qp, remote: ConnInfo, depth: int):
        self.nic, self.qp, self.remote, self.depth = nic, qp, remote, depth
        self.outstanding = 0  # posted, not yet retired by a signaled completion
        self.since_signal = 0
        self.signaled: dict[int, int] = {}  # wr_id -> WRs it retires


class VerbsWriteHandle(WriteHandle):
    def __init__(self, transport: VerbsTransport, rails: list[_Rail], nbytes: int, ops):
        self._t, self._rails, self.nbytes, self._ops = transport, rails, nbytes, ops

    def done(self) -> bool:
        self._t._poll(self._ops, block=False)
        return all(r.outstanding == 0 for r in self._rails)

    def _timeout_message(self, timeout: float) -> str:
        return f"RDMA WRITE batch not complete after {timeout} s"


class VerbsTransport(Transport):
    """One process's RDMA endpoint over the selected NICs (see the module docstring)."""

    name = "verbs"
    revocation = "nic"  # deregistration closes the MRs: the NIC refuses the old rkey (no lease needed)

    def __init__(self, host: str | None = None, *, nics: Sequence[str] | str | None = None, port: int = 1,
                 gid_index: int | None = None, listen: tuple[str, int] = ("0.0.0.0", 0),
                 advertise: str | None = None, sq_depth: int = 1024, signal_every: int = 64,
                 max_chain: int = 32, max_msg: int = 1 << 30, stripe: str = "write"):
        if signal_every > sq_depth or max_chain > sq_depth:
            raise ValueError(f"signal_every {signal_every} and max_chain {max_chain} must be <= sq_depth {sq_depth}")
        if stripe not in ("write", "region"):
            raise ValueError(f"stripe {stripe!r}: 'write' or 'region'")
        self.pv = load_pyverbs()
        if nics is None:
            nics = os.environ.get("WT_RDMA_NICS") or None
        names = select_nics(nics, list_nics())
        super().__init__(host)
        self.run = secrets.token_hex(8)
        self.sq_depth, self.signal_every, self.max_chain, self.stripe = sq_depth, signal_every, max_chain, stripe
        self.nics = [_Nic(self.pv, n, port, gid_index, cq_depth=4 * sq_depth) for n in names]
        self.max_msg = min([max_msg] + [n.max_msg for n in self.nics])
        self._peers: dict[str, list[_Rail]] = {}  # cm endpoint -> rails
        self._accepted: list = []  # receiver side: QPs created for senders (kept alive)
        self._wr_seq = 0
        self._lock = threading.Lock()
        self._srv = socket.create_server(listen)
        adv = advertise or (self.host if listen[0] in ("0.0.0.0", "") else listen[0])
        self.cm = f"{adv}:{self._srv.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._serve, name="verbs-cm", daemon=True).start()

    # ---- QP plumbing ------------------------------------------------------------------------

    def _access(self) -> int:
        e = self.pv.enums
        return e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE

    def _new_qp(self, nic: _Nic):
        pv = self.pv
        cap = pv.qp.QPCap(max_send_wr=self.sq_depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=pv.enums.IBV_QPT_RC, scq=nic.cq, rcq=nic.cq, cap=cap, sq_sig_all=0)
        qp = pv.qp.QP(nic.pd, init)
        psn = secrets.randbits(24)
        info = ConnInfo(nic=nic.name, port=nic.port, lid=nic.lid, gid=nic.gid, gid_index=nic.gid_index,
                        qpn=qp.qp_num, psn=psn, mtu=int(nic.mtu))
        return qp, info

    def _bring_up(self, nic: _Nic, qp, mine: ConnInfo, peer: ConnInfo) -> None:
        pv = self.pv
        a = pv.qp.QPAttr(port_num=nic.port)
        a.qp_access_flags = self._access()
        qp.to_init(a)
        a = pv.qp.QPAttr(port_num=nic.port)
        a.path_mtu = min(mine.mtu, peer.mtu)
        a.dest_qp_num = peer.qpn
        a.rq_psn = peer.psn
        a.max_dest_rd_atomic = 1
        a.min_rnr_timer = 12
        gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(peer.gid_colon), sgid_index=mine.gid_index)
        a.ah_attr = pv.addr.AHAttr(dlid=peer.lid, port_num=nic.port, is_global=1 if (peer.gid.strip("0")) else 0, grh=gr)
        qp.to_rtr(a)
        a.sq_psn = mine.psn
        a.timeout, a.retry_cnt, a.rnr_retry, a.max_rd_atomic = 14, 7, 7, 1
        qp.to_rts(a)

    def _serve(self) -> None:
        """Receiver side: answer each sender's handshake (one TCP connection per sender)."""
        while not self._stop:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            try:
                with conn:
                    msg = _recv_msg(conn)
                    reply = {"run": self.run, "qps": [], "error": None}
                    if msg.get("want_run") not in (None, self.run):
                        reply["error"] = f"run token {msg.get('want_run')} is not this transport's ({self.run})"
                    else:
                        for k, js in enumerate(msg["qps"]):
                            peer = ConnInfo.from_json(js)
                            nic = self.nics[k % len(self.nics)]
                            qp, mine = self._new_qp(nic)
                            self._bring_up(nic, qp, mine, peer)
                            self._accepted.append(qp)
                            reply["qps"].append(mine.to_json())
                    _send_msg(conn, reply)
            except Exception as ex:
                print(f"[verbs cm {self.cm}] handshake failed: {type(ex).__name__}: {ex}", file=sys.stderr, flush=True)

    def _handshake(self, cm: str, run: str) -> list[_Rail]:
        host, _, port = cm.rpartition(":")
        pending = [(nic, *self._new_qp(nic)) for nic in self.nics]
        with socket.create_connection((host, int(port)), timeout=30) as s:
            _send_msg(s, {"want_run": run, "qps": [info.to_json() for _, _, info in pending]})
            reply = _recv_msg(s)
        if reply.get("error"):
            raise UnknownRegionError(f"connect: receiver at {cm} refused: {reply['error']} (a descriptor from another run)")
        rails = []
        for (nic, qp, mine), js in zip(pending, reply["qps"]):
            peer = ConnInfo.from_json(js)
            self._bring_up(nic, qp, mine, peer)
            rails.append(_Rail(nic, qp, peer, self.sq_depth))
        return rails

    # ---- hooks of the contract ----------------------------------------------------------------

    def _check_device(self, tensor: torch.Tensor) -> None:
        if tensor.device.type not in ("cpu", "cuda"):
            raise ValueError(f"register: unsupported device {tensor.device} (CPU or CUDA memory)")

    def _register(self, region: Region) -> list:
        """One MR per selected NIC (host memory: ``ibv_reg_mr``; GPU memory: :func:`_gpu_mr`)."""
        t, n = region.tensor, region.length
        mrs = []
        for nic in self.nics:
            if t.device.type == "cpu":
                mrs.append(self.pv.mr.MR(nic.pd, n, self._access(), address=region.addr))
            else:
                mrs.append(_gpu_mr(self.pv, nic.pd, t, n, self._access()))
        return mrs

    def _deregister(self, region: Region) -> None:
        for mr in region.native:
            mr.close()

    def _describe(self, region: Region) -> RegionDescriptor:
        rkeys = tuple((nic.name, int(mr.rkey)) for nic, mr in zip(self.nics, region.native))
        return self._descriptor(region, key=rkeys[0][1], extra=(("run", self.run), ("cm", self.cm), ("rkeys", rkeys)))

    def _check_descriptor(self, d: RegionDescriptor) -> None:
        validate_descriptor(d)

    def _connect(self, d: RegionDescriptor):
        x = dict(d.extra)
        if x["cm"] not in self._peers:
            self._peers[x["cm"]] = self._handshake(x["cm"], x["run"])
        return (x["cm"], d.addr)

    def _remote_key(self, d: RegionDescriptor):
        return _remote_key(d)

    def _group_key(self, loc: Region, remote: RegionDescriptor, key):
        """Per receiver (its connection listener): striped over that receiver's rails."""
        return key[0]

    def _post(self, batch: Batch, ops: Sequence[WriteOp]) -> VerbsWriteHandle:
        """Split ops longer than ``max_msg``, stripe each receiver's ops over its rails and post
        them as linked chains (see the module docstring)."""
        used: list[_Rail] = []
        for cm, g in batch.groups.items():
            rails = self._peers[cm]
            sub = chunk_ops(zip(g.idx, g.laddr, g.raddr, g.lens), self.max_msg)
            parts = assign_rails(sub, len(rails), self.stripe, remote_of=lambda j, sub=sub: ops[sub[j][0]].remote.addr)
            for rail, idx in zip(rails, parts):
                if idx:
                    self._post_rail(rail, [sub[j] for j in idx], ops)
                    used.append(rail)
        return VerbsWriteHandle(self, used, batch.nbytes, ops)

    def _post_rail(self, rail: _Rail, items, ops) -> None:
        pv, e = self.pv, self.pv.enums
        rk_of = {}
        sig = plan_signals(len(items), self.signal_every, rail.since_signal)
        for s, t in plan_chains(len(items), self.max_chain):
            while rail.outstanding + (t - s) > rail.depth:
                self._poll(ops, block=True)
            head = prev = None
            for k in range(s, t):
                i, la, ra, n = items[k]
                op = ops[i]
                loc_mr = op.local.native[self.nics.index(rail.nic)]
                if id(op.remote) not in rk_of:
                    rk_of[id(op.remote)] = dict(dict(op.remote.extra)["rkeys"]).get(rail.remote.nic)
                rkey = rk_of[id(op.remote)]
                self._wr_seq += 1
                flags = e.IBV_SEND_SIGNALED if sig[k] else 0
                wr = pv.wr.SendWR(wr_id=self._wr_seq, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                                  sg=[pv.wr.SGE(la, n, loc_mr.lkey)], send_flags=flags)
                wr.set_wr_rdma(rkey, ra)
                rail.since_signal += 1
                if sig[k]:
                    rail.signaled[self._wr_seq] = (rail.since_signal, i)
                    rail.since_signal = 0
                if prev is None:
                    head = wr
                else:
                    prev.next_wr = wr
                prev = wr
            rail.qp.post_send(head)
            rail.outstanding += t - s

    def _poll(self, ops, block: bool) -> None:
        for nic in self.nics:
            while True:
                npolled, wcs = nic.cq.poll(num_entries=64)
                if npolled <= 0:
                    break
                for wc in wcs[:npolled]:
                    rail = next((r for rails in self._peers.values() for r in rails if wc.wr_id in r.signaled), None)
                    retired, i = rail.signaled.pop(wc.wr_id) if rail else (0, None)
                    if rail:
                        rail.outstanding -= retired
                    if wc.status != 0:
                        name = wc_status_name(wc.status)
                        hint = _WC_HINTS.get(int(wc.status), "")
                        raise TransportError(
                            f"RDMA WRITE failed: {name} (status {wc.status}, vendor_err {wc.vendor_err}) on the "
                            f"signaled WR of op {i} via {nic.name}"
                            + (f": {hint}" if hint else "")
                        )

    def close(self) -> None:
        self._stop = True
        try:
            self._srv.close()
        except OSError:
            pass
        super().close()

    def _disconnect(self) -> None:
        for rails in self._peers.values():
            for r in rails:
                r.qp.close()
        for qp in self._accepted:
            qp.close()
        self._peers.clear()


def _gpu_mr(pv, pd, tensor: torch.Tensor, n: int, access: int):
    """Register CUDA memory: dma-buf (``cuMemGetHandleForAddressRange`` through cuda-python,
    then ``ibv_reg_dmabuf_mr``) where available, else a plain ``ibv_reg_mr`` of the device
    pointer (works with the ``nvidia_peermem`` kernel module).

    Not verified on hardware (no RDMA NIC nor GPU where this was written); the descriptor
    advertises the tensor's virtual address, which is the MR's iova only if the provider maps
    the dma-buf MR at that address; check on the first GPU cluster run."""
    try:
        from cuda.bindings import driver as cu  # cuda-python >= 12.6
    except ImportError:
        cu = None
    if cu is not None:
        addr = tensor.data_ptr()
        page = 1 << 16
        base = addr & ~(page - 1)
        err, fd = cu.cuMemGetHandleForAddressRange(
            base, ((addr + n - base + page - 1) // page) * page,
            cu.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
        if int(err) == 0:
            import pyverbs.mr as pmr

            return pmr.DmaBufMR(pd, n, access, dmabuf=int(fd), offset=addr - base)
    return pv.mr.MR(pd, n, access, address=tensor.data_ptr())
