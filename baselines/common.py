"""What the two baselines share: the ordered parameter list, the rank-0 gather loop, buckets,
statistics, and the byte counts that make them comparable with the reference.

Byte definitions (docs/PERFORMANCE.md):

- ``bytes`` (the row's column, reported by training rank 0 as :attr:`BaselineStats.bytes_sent`):
  bytes that land in inference memory per update, summed over inference ranks -- the sum of
  every engine tensor's ``nbytes`` on every inference rank. That is exactly what the
  reference's schedule writes, so ``bytes / seconds`` compares like with like.
- ``wire_bytes``: payload bytes the method moved from the training job to the inference job
  and inside it (each inference rank's received bytes, summed): for both baselines the full
  checkpoint in the training dtype once per inference rank, plus, when a parameter's mesh does
  not contain training rank 0, the point-to-point hop that brings it there.

Collective order. ``full_tensor()`` is a collective over the parameter's DeviceMesh, so every
training rank walks the same global parameter list (:func:`param_entries`, published once by
the controller) in the same order; ranks not in a parameter's mesh skip it. When training rank
0 is not in the mesh (expert columns of the ``two_group`` layout), the mesh's lowest rank
sends the gathered tensor to rank 0 over the training world's default (Gloo) group, the way
frameworks funnel expert-parallel parameters through their EP rank 0.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist

from weight_transfer.control import protocol as control
from weight_transfer.control import wire
from weight_transfer.types import RegionDescriptor, torch_dtype

from .options import DEFAULT_BUCKET_BYTES, DEFAULT_RPC_TIMEOUT, BaselineOptions

BUCKET_ALIGN = 16
"""Byte alignment of each tensor inside a bucket (any dtype view of the slice is aligned)."""
KEY_PARAMS = "baselines/params"
KEY_DEST_BYTES = "baselines/dest_bytes"


@dataclass(frozen=True, slots=True)
class ParamEntry:
    """One training parameter as the baselines walk them: global shape, training dtype, and the
    lowest global rank of its mesh (``lead``: the rank that hands it to training rank 0)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    lead: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch_dtype(self.dtype).itemsize


@dataclass
class BaselineStats:
    """One training rank's part of one update (implements :class:`weight_transfer.method.UpdateStats`,
    the stats protocol the trial reads from any method).

    ``bytes_sent`` is the *landed* byte count (see module docstring; only training rank 0
    reports it, the other ranks report 0 so the trial's sum is the landed bytes once);
    ``wire_bytes`` what moved; ``n_writes`` the number of messages (broadcast buckets or RPCs)."""

    rank: int
    bytes_sent: int = 0
    wire_bytes: int = 0
    n_writes: int = 0
    seconds: float = 0.0
    peak_temp_bytes: int = 0
    peak_alloc_bytes: int = 0
    """Not measured by the baselines (0)."""
    records: list = field(default_factory=list)

    def stage_busy(self) -> dict[str, float]:
        return {}


# The baselines' results travel through the store as data (weight_transfer.control.wire): a training
# rank's stats as a tagged value of step/{v}/done/{r}; the controller publishes the parameter
# list and the landed byte count once. Registered here, imported by every process of a trial
# that runs a baseline (the method's module imports this one).
wire.register_tagged(BaselineStats)
wire.register(KEY_PARAMS, list[ParamEntry], "the baselines' ordered global parameter list (controller -> trainers)")
wire.register(KEY_DEST_BYTES, int, "bytes that land in inference memory per update (the baselines' `bytes`)")


def endpoint_descriptor(method: str, **fields) -> RegionDescriptor:
    """What a baseline's inference rank publishes as the descriptor of its setup payload
    (``meta/infer/{i}``, whose schema is the library's ``(RegionDescriptor, [DestTensorMeta])``):
    not a memory region -- the baselines' inference side receives actively -- but where to reach
    it: ``transport`` names the method, ``host`` / ``pid`` the process, ``addr`` / ``length`` /
    ``key`` are 0, and ``extra`` holds the method's fields (``fields``: str / int values, e.g.
    the RPC worker's ZeroMQ endpoint), read back with :func:`endpoint_fields`."""
    return RegionDescriptor(transport=method, host=socket.gethostname(), pid=os.getpid(), addr=0, length=0, key=0,
                            extra=tuple(sorted(fields.items())))


def endpoint_fields(desc: RegionDescriptor) -> dict:
    """The method's fields of a descriptor made by :func:`endpoint_descriptor`."""
    return dict(desc.extra)


def bucket_bytes(options: BaselineOptions | None) -> int:
    """The funnel's bucket size (bytes): ``options.bucket_bytes``, or the default."""
    return int(options.bucket_bytes) if options is not None else DEFAULT_BUCKET_BYTES


def rpc_timeout(options: BaselineOptions | None, control_timeout: float) -> float:
    """Seconds one RPC may wait: ``options.rpc_timeout`` if set, else
    min(:data:`DEFAULT_RPC_TIMEOUT`, ``control_timeout`` / 2), at least 1 s."""
    if options is not None and options.rpc_timeout:
        return float(options.rpc_timeout)
    return max(1.0, min(DEFAULT_RPC_TIMEOUT, float(control_timeout) / 2))


def param_entries(train_metas: dict[int, list]) -> list[ParamEntry]:
    """The global parameter list in a deterministic order: training rank 0's parameters in its
    order, then those rank 0 does not hold, in the order of the lowest rank holding them."""
    out: dict[str, ParamEntry] = {}
    for r in sorted(train_metas):
        for m in train_metas[r]:
            if m.name not in out:
                out[m.name] = ParamEntry(m.name, tuple(m.global_shape), m.dtype, min(m.mesh_flat))
    return list(out.values())


def dest_bytes(infer_payloads: dict[int, tuple]) -> int:
    """Bytes of every engine tensor on every inference rank (what lands per update)."""
    return sum(m.nbytes for _, metas in infer_payloads.values() for m in metas)


def publish_common(ctx) -> tuple[list[ParamEntry], int]:
    """Controller side, once: the ordered parameter list and the landed byte count."""
    entries = param_entries(ctx.train_metas)
    landed = dest_bytes(ctx.infer_payloads)
    control.put(ctx.store, KEY_PARAMS, entries)
    control.put(ctx.store, KEY_DEST_BYTES, landed)
    return entries, landed


def read_common(store, timeout: float) -> tuple[list[ParamEntry], int]:
    control.wait_keys(store, {0: KEY_PARAMS, 1: KEY_DEST_BYTES}, timeout=timeout, what="baseline parameter list")
    return control.get(store, KEY_PARAMS), control.get(store, KEY_DEST_BYTES)


def gather_to_rank0(params: dict, entries: list[ParamEntry], rank: int):
    """Walk ``entries`` in order on every training rank: ``full_tensor()`` where this rank is in
    the parameter's mesh (a collective), forward to rank 0 if rank 0 is not in it. Yields
    ``(entry, full tensor)`` on rank 0 and ``(entry, None)`` elsewhere; the caller must consume
    the whole generator on every rank (the collectives of later entries depend on it)."""
    from torch.distributed.tensor import DTensor

    for e in entries:
        p = params.get(e.name)
        full = None
        if p is not None and (not isinstance(p, DTensor) or p.device_mesh.get_coordinate() is not None):
            t = p.full_tensor() if isinstance(p, DTensor) else p
            if rank == 0:
                full = t
            elif rank == e.lead and e.lead != 0:
                dist.send(t.contiguous(), dst=0)
            del t
        elif rank == 0:
            full = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
            dist.recv(full, src=e.lead)
        yield e, full


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy when already contiguous)."""
    t = t.contiguous()
    return t.view(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def from_bytes(buf: torch.Tensor, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of :func:`as_bytes` (a view, no copy)."""
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=torch_dtype(dtype))
    return buf.view(torch_dtype(dtype)).view(shape)


class BucketItem(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One tensor of a funnel bucket: its name, shape and dtype, and its byte range in the
    bucket. A msgspec ``Struct`` (array-like: ``[name, shape, dtype, offset, nbytes]``): the
    funnel broadcasts each update's manifest of buckets to the inference ranks as data
    (:mod:`weight_transfer.baselines.funnel`), decoded strictly into these."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int


def plan_buckets(entries: list[ParamEntry], limit: int) -> list[list[BucketItem]]:
    """Greedy, in order: pack tensors into buckets of at most ``limit`` bytes (offsets
    ``BUCKET_ALIGN``-aligned); a tensor larger than ``limit`` gets a bucket of its own."""
    buckets: list[list[BucketItem]] = []
    cur: list[BucketItem] = []
    off = 0
    for e in entries:
        start = -(-off // BUCKET_ALIGN) * BUCKET_ALIGN
        if cur and start + e.nbytes > limit:
            buckets.append(cur)
            cur, start = [], 0
        cur.append(BucketItem(e.name, e.shape, e.dtype, start, e.nbytes))
        off = start + e.nbytes
    if cur:
        buckets.append(cur)
    return buckets


def bucket_size(bucket: list[BucketItem]) -> int:
    return max((it.offset + it.nbytes for it in bucket), default=0)
