"""The pure parts of the verbs back end (:mod:`.verbs`): no device and no pyverbs needed, so they
are unit-tested everywhere. Connection info of an RC QP (:class:`ConnInfo`), NIC selection,
work-completion status names, descriptor validation, the contract's op checks with verbs' lookup
key, the posting plan (chunking, rail striping, signalling, chaining) and the handshake's wire
format. :mod:`.verbs` re-exports every public name."""
from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from ..types import RegionDescriptor
from .base import TransportError, WriteOp, check_batch, describe_remote

__all__ = [
    "ConnInfo", "WC_STATUS_NAMES", "assign_rails", "check_ops", "chunk_ops", "plan_chains", "plan_signals",
    "select_nics", "validate_descriptor", "wc_status_name",
]

# ---------------------------------------------------------------------------------------------
# pure parts (no device, no pyverbs): unit-tested everywhere

WC_STATUS_NAMES: dict[int, str] = {
    0: "IBV_WC_SUCCESS", 1: "IBV_WC_LOC_LEN_ERR", 2: "IBV_WC_LOC_QP_OP_ERR",
    3: "IBV_WC_LOC_EEC_OP_ERR", 4: "IBV_WC_LOC_PROT_ERR", 5: "IBV_WC_WR_FLUSH_ERR",
    6: "IBV_WC_MW_BIND_ERR", 7: "IBV_WC_BAD_RESP_ERR", 8: "IBV_WC_LOC_ACCESS_ERR",
    9: "IBV_WC_REM_INV_REQ_ERR", 10: "IBV_WC_REM_ACCESS_ERR", 11: "IBV_WC_REM_OP_ERR",
    12: "IBV_WC_RETRY_EXC_ERR", 13: "IBV_WC_RNR_RETRY_EXC_ERR", 14: "IBV_WC_LOC_RDD_VIOL_ERR",
    15: "IBV_WC_REM_INV_RD_REQ_ERR", 16: "IBV_WC_REM_ABORT_ERR", 17: "IBV_WC_INV_EECN_ERR",
    18: "IBV_WC_INV_EEC_STATE_ERR", 19: "IBV_WC_FATAL_ERR", 20: "IBV_WC_RESP_TIMEOUT_ERR",
    21: "IBV_WC_GENERAL_ERR", 22: "IBV_WC_TM_ERR", 23: "IBV_WC_TM_RNDV_INCOMPLETE",
}
"""``enum ibv_wc_status`` (libibverbs ``verbs.h``), value -> name."""

_WC_HINTS = {
    10: "the remote region is not registered with this rkey (deregistered, stale descriptor, or out of bounds)",
    12: "the receiver did not acknowledge (gone, link down, or wrong LID/GID/QP number)",
    5: "the QP went to the error state after an earlier failure",
    4: "the local buffer is not covered by its MR (deregistered?)",
}


def wc_status_name(status: int) -> str:
    """``10 -> "IBV_WC_REM_ACCESS_ERR"``; unknown values give ``"IBV_WC_<status>"``."""
    return WC_STATUS_NAMES.get(int(status), f"IBV_WC_{int(status)}")


@dataclass(frozen=True, slots=True)
class ConnInfo:
    """What one end of an RC QP tells the other: enough for ``INIT -> RTR -> RTS``."""

    nic: str
    """Device name (``mlx5_0``)."""
    port: int
    lid: int
    """Port LID (InfiniBand; 0 on RoCE)."""
    gid: str
    """Port GID as 32 hex digits (RoCE and routed InfiniBand need it)."""
    gid_index: int
    qpn: int
    """QP number (24 bits)."""
    psn: int
    """Starting packet sequence number (24 bits)."""
    mtu: int
    """Active MTU as the ``ibv_mtu`` enum value (1..5 = 256..4096 bytes)."""

    def __post_init__(self):
        if not self.nic:
            raise ValueError("ConnInfo: empty nic name")
        if not (0 < self.qpn < 1 << 24):
            raise ValueError(f"ConnInfo: qpn {self.qpn} is not a 24-bit QP number")
        if not (0 <= self.psn < 1 << 24):
            raise ValueError(f"ConnInfo: psn {self.psn} is not 24-bit")
        if not (0 <= self.lid < 1 << 16):
            raise ValueError(f"ConnInfo: lid {self.lid} is not 16-bit")
        if len(self.gid) != 32 or any(c not in "0123456789abcdef" for c in self.gid):
            raise ValueError(f"ConnInfo: gid {self.gid!r} is not 32 lowercase hex digits")
        if self.mtu not in (1, 2, 3, 4, 5):
            raise ValueError(f"ConnInfo: mtu enum {self.mtu} not in 1..5")
        if not (1 <= self.port <= 255) or not (0 <= self.gid_index < 256):
            raise ValueError(f"ConnInfo: port {self.port} / gid_index {self.gid_index} out of range")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, s: str | bytes) -> ConnInfo:
        d = json.loads(s)
        want = {f for f in cls.__dataclass_fields__}  # type: ignore[attr-defined]
        if set(d) != want:
            raise ValueError(f"ConnInfo: fields {sorted(d)} != {sorted(want)}")
        return cls(**d)

    @property
    def gid_colon(self) -> str:
        """The GID in pyverbs' ``fe80:0000:...`` form."""
        return ":".join(self.gid[i:i + 4] for i in range(0, 32, 4))


def select_nics(requested: Sequence[str] | str | None, available: Sequence[str]) -> list[str]:
    """Resolve an explicit NIC selection against the devices found. ``None`` (or ``""``) means
    all. Raises ValueError naming unknown NICs and listing the available ones, or saying that
    no RDMA device exists."""
    if isinstance(requested, str):
        requested = [x for x in requested.split(",") if x.strip()]
    avail = list(available)
    if not avail:
        asked = f" (asked for {list(requested)})" if requested else ""
        raise ValueError(
            f"no RDMA device found{asked}: /sys/class/infiniband is empty or absent and libibverbs lists "
            "no device; the verbs transport needs an InfiniBand/RoCE NIC (or a soft-RoCE rxe device)"
        )
    if not requested:
        return avail
    req = [r.strip() for r in requested]
    unknown = [r for r in req if r not in avail]
    if unknown:
        raise ValueError(f"unknown RDMA NIC(s) {unknown}; available: {avail}")
    if len(set(req)) != len(req):
        raise ValueError(f"NIC selection {req} names a device twice")
    return req


def validate_descriptor(d: RegionDescriptor) -> dict:
    """Check a verbs descriptor's fields; returns ``extra`` as a dict. ValueError otherwise."""
    if not isinstance(d, RegionDescriptor):
        raise ValueError(f"expected RegionDescriptor, got {type(d).__name__}")
    if d.transport != "verbs":
        raise ValueError(f"descriptor {describe_remote(d)} is for transport {d.transport!r}, not 'verbs'")
    if d.addr <= 0 or d.length <= 0:
        raise ValueError(f"malformed descriptor {d}")
    if not (0 <= d.key < 1 << 32):
        raise ValueError(f"descriptor {describe_remote(d)}: key {d.key} is not a 32-bit rkey")
    try:
        x = dict(d.extra)
    except (TypeError, ValueError):
        raise ValueError(f"descriptor {describe_remote(d)}: extra is not a tuple of (key, value) pairs") from None
    for k in ("run", "cm", "rkeys"):
        if k not in x:
            raise ValueError(f"descriptor {describe_remote(d)} lacks extra[{k!r}]")
    rkeys = x["rkeys"]
    if not rkeys or any(len(p) != 2 or not (0 <= int(p[1]) < 1 << 32) for p in rkeys):
        raise ValueError(f"descriptor {describe_remote(d)}: extra['rkeys'] must be ((nic, rkey), ...), got {rkeys!r}")
    if int(rkeys[0][1]) != d.key:
        raise ValueError(f"descriptor {describe_remote(d)}: key {d.key:#x} != rkey of first NIC {int(rkeys[0][1]):#x}")
    host, _, port = str(x["cm"]).rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"descriptor {describe_remote(d)}: extra['cm'] {x['cm']!r} is not host:port")
    return x


def check_ops(ops: Sequence[WriteOp], local: dict, remote: dict) -> list[tuple[int, int, int, int]]:
    """The contract's op checks (:func:`~weight_transfer.transport.base.check_batch`) with verbs'
    lookup key. ``local``: ``id(region) -> region`` of registered regions; ``remote``:
    ``(cm, addr) -> descriptor`` connected. Returns ``[(op index, local addr, remote addr,
    length)]`` for the non-empty ops, in op order. Raises :class:`UnknownRegionError` /
    :class:`BoundsError` naming the op."""
    batch = check_batch(ops, local, remote, _remote_key, lambda loc, c, k: k[0])
    out = [it for g in batch.groups.values() for it in zip(g.idx, g.laddr, g.raddr, g.lens)]
    out.sort()
    return out


def _remote_key(d: RegionDescriptor) -> tuple:
    """``(cm endpoint, addr)``: the receiver's connection listener names its transport."""
    return (dict(d.extra).get("cm") if isinstance(d.extra, tuple) else None, d.addr)


def chunk_ops(items: Iterable[tuple[int, int, int, int]], max_msg: int) -> list[tuple[int, int, int, int]]:
    """Split ``(op, local addr, remote addr, length)`` items longer than ``max_msg`` bytes into
    consecutive pieces of at most ``max_msg``."""
    if max_msg <= 0:
        raise ValueError(f"max_msg {max_msg} must be > 0")
    out = []
    for i, la, ra, n in items:
        off = 0
        while off < n:
            k = min(max_msg, n - off)
            out.append((i, la + off, ra + off, k))
            off += k
    return out


def assign_rails(items: Sequence[tuple[int, int, int, int]], n_rails: int, stripe: str = "write",
                 remote_of=None) -> list[list[int]]:
    """Indices of ``items`` per rail. ``"write"``: each item goes to the rail with the fewest
    bytes so far (ties to the lower rail), balancing bytes; ``"region"``: every item of one remote
    region goes to rail ``hash(region) % n_rails`` (``remote_of(index) -> region id``, default the
    op index), keeping per-region ordering."""
    if n_rails < 1:
        raise ValueError("n_rails must be >= 1")
    rails: list[list[int]] = [[] for _ in range(n_rails)]
    if stripe == "write":
        load = [0] * n_rails
        for k, it in enumerate(items):
            r = min(range(n_rails), key=load.__getitem__)
            rails[r].append(k)
            load[r] += it[3]
    elif stripe == "region":
        for k, it in enumerate(items):
            key = remote_of(k) if remote_of is not None else it[0]
            rails[(key // 4096 if key > 1 << 20 else key) % n_rails].append(k)
    else:
        raise ValueError(f"stripe {stripe!r}: 'write' or 'region'")
    return rails


def plan_signals(n: int, signal_every: int, already: int = 0) -> list[bool]:
    """Which of ``n`` work requests are signaled: every ``signal_every``-th counting from
    ``already`` requests posted earlier on the QP since its last signaled one, and the last."""
    if signal_every < 1:
        raise ValueError("signal_every must be >= 1")
    sig = [((already + k + 1) % signal_every) == 0 for k in range(n)]
    if n:
        sig[-1] = True
    return sig


def plan_chains(n: int, max_chain: int) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of linked work-request chains of at most ``max_chain``."""
    if max_chain < 1:
        raise ValueError("max_chain must be >= 1")
    return [(s, min(s + max_chain, n)) for s in range(0, n, max_chain)]


# ---------------------------------------------------------------------------------------------
# handshake wire format: 4-byte big-endian length + JSON


def _send_msg(sock: socket.socket, obj) -> None:
    b = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(b)) + b)


def _recv_msg(sock: socket.socket):
    hdr = _recv_exact(sock, 4)
    (n,) = struct.unpack(">I", hdr)
    if n > 1 << 20:
        raise TransportError(f"handshake message of {n} bytes refused")
    return json.loads(_recv_exact(sock, n))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        b = sock.recv(n - len(buf))
        if not b:
            raise TransportError("handshake peer closed the connection")
        buf += b
    return buf
