"""Batched run writes: many ``(offset, length)`` runs of one span in one op (delta updates).

A delta update (:mod:`weight_transfer.delta.runs`) writes, per output and receiver, the byte runs
that changed: at a real RL step's ~1% of bf16 elements that is about one run per changed
element, hundreds of thousands per rank. One :class:`~.base.WriteOp` per run costs ~3 us of
Python (the dataclass, the checks, the iovec), far more than its bytes, so a :class:`RunsOp`
carries them as two int64 arrays and :func:`write` posts them without Python per run:

- **cma**: ``process_vm_writev`` from C with up to IOV_MAX (1024) local and remote iovecs per
  call, resuming a partial copy at the exact iovec and offset (``_delta.c``, ``wt_cma_write``);
- **shm**: one C loop of ``memcpy`` into this sender's mapping of the receiver's segment
  (``wt_scatter``);
- every other back end (and without the native kernel): the runs expanded into one
  :class:`~.base.WriteOp` each and given to :meth:`~.base.Transport.write` (correct, slow).

The contract is :meth:`~.base.Transport.write`'s, unchanged: every op's span is checked like a
:class:`~.base.WriteOp` of its length (local region registered, remote descriptor connected with
its key, both ranges inside their regions) and every run non-empty and inside its span, all
before any byte moves (so no run can land outside a registered region); then this sender's
lease at each receiver is entered and the receivers' published epochs checked (C17); the lease
is left once the bytes are copied (both back ends here are synchronous). One bad op refuses the
batch. Units: bytes.

``segment_cost_bytes``: what one more run costs on a back end, in bytes at its bandwidth (the
delta cost model's input), measured on the 2-core CI VM (``weight-transfer bench-delta
--ops-only``, docs/DELTA.md): cma ~350 ns per remote iovec (the kernel pins the pages of each)
against ~0.3 ns per byte -> 1024; shm 10-40 ns per memcpy call against ~0.2 ns per byte -> 64;
anything else ~3 us of Python per op -> 12288.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Batch, BoundsError, Transport, WriteOp

__all__ = ["RunsOp", "write", "expand", "op_count", "segment_cost_bytes", "posts_natively"]

_COST = {"cma": 1024, "shm": 64}


def segment_cost_bytes(transport: Transport | str) -> int:
    """Bytes one more run costs on ``transport`` (a back end or its name), see the module docstring."""
    name = transport if isinstance(transport, str) else transport.name
    return _COST.get(name, 12288)


@dataclass(frozen=True, slots=True)
class RunsOp:
    """For every ``k``: copy ``lens[k]`` bytes from ``local`` at ``local_offset + starts[k]`` to
    ``remote`` at ``remote_offset + starts[k]``. ``length``: the span's bytes (checked against both
    regions like a :class:`~.base.WriteOp` of that length). ``starts`` / ``lens``: contiguous int64
    CPU tensors of one length, every run non-empty and inside ``[0, length)``."""

    local: object
    local_offset: int
    remote: object
    remote_offset: int
    length: int
    starts: torch.Tensor
    lens: torch.Tensor

    @property
    def count(self) -> int:
        """Runs of the op."""
        return self.starts.numel()


def op_count(ops: Sequence) -> int:
    """Writes of a batch: one per :class:`~.base.WriteOp`, one per run of a :class:`RunsOp`."""
    return sum(op.count if type(op) is RunsOp else 1 for op in ops)


def expand(ops: Sequence) -> list[WriteOp]:
    """``ops`` with every :class:`RunsOp` replaced by one :class:`~.base.WriteOp` per run."""
    out: list[WriteOp] = []
    for op in ops:
        if type(op) is RunsOp:
            lo, ro = op.local_offset, op.remote_offset
            out += [WriteOp(op.local, lo + s, op.remote, ro + s, n) for s, n in zip(op.starts.tolist(), op.lens.tolist())]
        else:
            out.append(op)
    return out


def _lib():
    from ..native.delta import KERNEL

    return KERNEL.lib()


def posts_natively(transport: Transport) -> bool:
    """Whether :func:`write` posts ``transport``'s runs from C (cma, shm with the native kernel)."""
    return transport.name in _COST and _lib() is not None


def check_runs(op: RunsOp, i: int) -> int:
    """Bytes of ``op``'s runs; :class:`~.base.BoundsError` naming op ``i`` and the run when the
    arrays are malformed or a run is empty or leaves the span."""
    st, ln = op.starts, op.lens
    if (st.dtype != torch.int64 or ln.dtype != torch.int64 or st.device.type != "cpu" or ln.device.type != "cpu"
            or not st.is_contiguous() or not ln.is_contiguous() or st.shape != ln.shape or st.dim() != 1):
        raise BoundsError(f"op {i}: runs must be two contiguous 1-D int64 CPU tensors of one length, got "
                          f"{st.dtype} {tuple(st.shape)} on {st.device} and {ln.dtype} {tuple(ln.shape)} on {ln.device}; "
                          "nothing of the batch was issued")
    m = st.numel()
    if m == 0:
        return 0
    lib = _lib()
    if lib is not None:
        tot = ctypes.c_int64(0)
        bad = lib.wt_check_segments(st.data_ptr(), ln.data_ptr(), m, op.length, ctypes.byref(tot))
        if bad < 0:
            return tot.value
    else:
        badm = (st < 0) | (ln <= 0) | (ln > op.length) | (st > op.length - ln)
        if not bool(badm.any()):
            return int(ln.sum())
        bad = int(badm.nonzero()[0])
    raise BoundsError(f"op {i}: run {bad} (start {int(st[bad])}, length {int(ln[bad])}) is empty or outside its span "
                      f"of {op.length} bytes (local_offset {op.local_offset}, remote_offset {op.remote_offset}); "
                      "nothing of the batch was issued")


def write(transport: Transport, ops: Sequence):
    """Check and post a batch of :class:`~.base.WriteOp` s and :class:`RunsOp` s (the module
    docstring); returns the :class:`~.base.WriteHandle` (complete on cma and shm). Without a
    :class:`RunsOp`, or on a back end :func:`posts_natively` does not cover, this is
    ``transport.write`` (runs expanded)."""
    if not any(type(op) is RunsOp for op in ops):
        return transport.write(ops)
    from . import lease
    from .base import CompletedWrite

    spans = [WriteOp(op.local, op.local_offset, op.remote, op.remote_offset, op.length) if type(op) is RunsOp else op
             for op in ops]
    checked = transport.check(spans)  # registration, connection, span bounds: every op, before any byte
    if not posts_natively(transport):
        for i, op in enumerate(ops):
            if type(op) is RunsOp:
                check_runs(op, i)
        return transport.write(expand(ops))
    plain, runs, total = [], [], 0
    for i, op in enumerate(ops):
        if type(op) is RunsOp:
            nb = check_runs(op, i)
            if nb:
                runs.append((i, op, nb))
                total += nb
        else:
            plain.append(op)
    pb = transport.check(plain) if plain else Batch({}, 0, {})
    if not checked.groups or (not pb.groups and not runs):
        return CompletedWrite(0)
    held = transport._lease_enter(checked)  # before the epochs are read; left once the bytes are copied
    try:
        transport.check_epochs(checked.remotes.values())
        done = transport._post(pb, plain).wait() if pb.groups else 0
        post = _post_cma if transport.name == "cma" else _post_shm
        for i, op, _nb in runs:
            done = post(transport, op, i, ops, done, total + pb.nbytes)
    finally:
        lease.leave(held)
    return CompletedWrite(done)


def _addrs(transport: Transport, op: RunsOp) -> tuple[int, int]:
    c = transport._remote[transport._remote_key(op.remote)]
    return op.local.addr + op.local_offset, c.addr + op.remote_offset


def _post_cma(transport: Transport, op: RunsOp, i: int, ops, done: int, total: int) -> int:
    from .cma import _errno_error

    la, ra = _addrs(transport, op)
    failed, wrote = ctypes.c_int64(-1), ctypes.c_int64(0)
    r = _lib().wt_cma_write(op.remote.pid, la, ra, op.starts.data_ptr(), op.lens.data_ptr(), op.count,
                            ctypes.byref(failed), ctypes.byref(wrote))
    if r < 0:
        raise _errno_error(-r, op.remote.pid, i, ops, done + wrote.value, total) from None
    return done + r


def _post_shm(transport: Transport, op: RunsOp, i: int, ops, done: int, total: int) -> int:
    transport._check_alive(op.remote.pid)
    la, ra = _addrs(transport, op)
    dst = transport._dst[transport._remote_key(op.remote)] + op.remote_offset
    return done + _lib().wt_scatter(dst, la, op.starts.data_ptr(), op.lens.data_ptr(), op.count)
