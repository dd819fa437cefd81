"""The training side's hashes of an update's writes, and the hash both sides use
(:mod:`weight_transfer.control.fingerprint` has the protocol: which writes, the request, the
comparison before ``complete v``).

The executor hashes each selected output from the buffer it is written from (a pool slot, a view
of a shard, or the shard pieces of a fused band, in output order), once the output is final and
before the buffer is reused (:class:`SenderHashes`, :func:`hash_task`). :func:`selected` picks the
writes of a version (``"sample"``: those whose :func:`residues` equal ``version % cycle``).

The hash (:func:`hash_pieces`) is XXH3-64 on the host (the ``xxhash`` package: a maintained
binding of Yann Collet's xxHash, about 29 GB/s per core on the project's CPUs) or, for GPU
memory, ``fold64``: a position-weighted 64-bit sum in torch integer ops, computed on the bytes'
own device. Why hand-written: no maintained library hashes a CUDA tensor in place with a value a
host can reproduce.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch

__all__ = ["residues", "residue", "selected", "hash_pieces", "region_bytes", "pack", "unpack", "SenderHashes", "output_pieces", "hash_task"]


def residues(dst, offsets, cycle: int) -> np.ndarray:
    """The residue class (``0 .. cycle-1``) of each planned write: ``dst`` (inference ranks)
    and ``offsets`` (planned region offsets, bytes) broadcast as numpy int64; a 64-bit
    multiplicative mix so that neighbouring writes fall into different classes."""
    d = np.asarray(dst, dtype=np.uint64)
    o = np.asarray(offsets, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (o >> np.uint64(4)) * np.uint64(0x9E3779B97F4A7C15) + d * np.uint64(0xC2B2AE3D27D4EB4F)
        x ^= x >> np.uint64(29)
    return (x % np.uint64(cycle)).astype(np.int64)


_M64 = (1 << 64) - 1


def residue(dst: int, offset: int, cycle: int) -> int:
    """:func:`residues` of one planned write, in Python integers (the training side asks once
    per write and update: a numpy call costs ~10 us, this ~0.5 us)."""
    x = (((offset >> 4) * 0x9E3779B97F4A7C15) + dst * 0xC2B2AE3D27D4EB4F) & _M64
    return (x ^ (x >> 29)) % cycle


def selected(mode: str, cycle: int, version: int, dst, offsets) -> np.ndarray:
    """Boolean mask of the planned writes ``(dst, offsets)`` checked at ``version``."""
    n = np.broadcast(np.asarray(dst), np.asarray(offsets)).shape
    if mode == "full":
        return np.ones(n, dtype=bool)
    if mode == "off":
        return np.zeros(n, dtype=bool)
    return residues(dst, offsets, cycle) == (int(version) % cycle)


FOLD_CHUNK = 1 << 22
"""``fold64``: bytes per step (its int64 temporaries are 16x this: 64 MiB)."""
_C1, _C2, _C3 = -7046029254386353131, 0x165667B19E3779F9, -4417276706812531889  # odd 64-bit constants (xxHash's)


def _fold64(pieces, length: int) -> int:
    """``fold64``: ``sum_i b_i * k_i mod 2^64`` over the bytes ``b_i`` of the concatenation
    (``i`` the byte's position in it, ``k_i`` an odd 64-bit weight mixed from ``i``), then mixed
    with ``length``; computed with torch integer ops on the pieces' own device (a GPU hashes its
    memory in place, no copy to the host), in steps of :data:`FOLD_CHUNK` bytes. Integer sums
    wrap alike on every device and in any order, so the value does not depend on where it ran or
    how the bytes were cut. Any one changed byte changes it (an odd weight times a change in
    [-255, 255] is never 0 mod 2^64); not a cryptographic hash."""
    acc, pos = 0, 0
    for p in pieces:
        p = p.contiguous().view(-1)
        for lo in range(0, p.numel(), FOLD_CHUNK):
            c = p[lo:lo + FOLD_CHUNK]
            k = torch.arange(pos, pos + c.numel(), dtype=torch.int64, device=c.device) * _C1 + _C2
            k = (k ^ (k >> 29)) | 1
            acc = (acc + int((c.to(torch.int64) * k).sum())) & _M64
            pos += c.numel()
    if pos != length:
        raise ValueError(f"fingerprint: pieces hold {pos} bytes, the range is {length}")
    x = (acc ^ ((int(length) * _C3) & _M64)) & _M64
    return (x ^ (x >> 31)) & _M64


def hash_pieces(pieces, length: int, algo: str = "xxh3") -> int:
    """The fingerprint of the concatenation of ``pieces`` (uint8 tensors, any device), a range
    of ``length`` bytes: ``algo`` ``"xxh3"``: XXH3-64 seeded with ``length`` (GPU pieces are
    copied to the host first); ``"fold64"``: :func:`_fold64`, on the pieces' device. ValueError
    when the pieces do not add up to ``length`` or for an unknown ``algo``."""
    if algo == "fold64":
        return _fold64(pieces, length)
    if algo != "xxh3":
        raise ValueError(f"fingerprint: algo={algo!r}: 'xxh3' or 'fold64'")
    import xxhash

    h = xxhash.xxh3_64(seed=int(length))
    total = 0
    for p in pieces:
        if p.device.type != "cpu":
            p = p.cpu()
        p = p.contiguous().view(-1)
        total += p.numel()
        if p.numel():
            h.update(memoryview(p.numpy()))
    if total != length:
        raise ValueError(f"fingerprint: pieces hold {total} bytes, the range is {length}")
    return h.intdigest()


def region_bytes(region, offset: int, length: int) -> torch.Tensor:
    """The uint8 bytes ``[offset, offset + length)`` of a registered local region
    (:class:`weight_transfer.transport.base.Region`, one or several parts), in place.
    ValueError when the range is not inside one of its parts."""
    parts = region._parts if getattr(region, "_parts", None) else [region.tensor]
    lo = region.addr + offset
    for t in parts:
        st = t.untyped_storage()
        base = t.data_ptr()
        if base <= lo and lo + length <= base + t.nbytes:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
            at = lo - st.data_ptr()
            return whole[at:at + length]
    raise ValueError(f"fingerprint: bytes [{offset}, {offset + length}) are not inside one part of the region")


def pack(a) -> bytes:
    """A numpy array's bytes (int64/uint64, little-endian, as :func:`unpack` reads them)."""
    return np.ascontiguousarray(a).astype(np.dtype(a.dtype).newbyteorder("<"), copy=False).tobytes()


def unpack(raw: bytes, dtype) -> np.ndarray:
    """The array :func:`pack` made (``dtype``: ``np.int64`` or ``np.uint64``). ValueError for a
    length that is not a whole number of items."""
    dt = np.dtype(dtype).newbyteorder("<")
    if len(raw) % dt.itemsize:
        raise ValueError(f"fingerprint: {len(raw)} bytes are not {dt.name} items")
    return np.frombuffer(raw, dtype=dt).astype(dtype)


# -------------------------------------------------------------------------- training side


class SenderHashes:
    """The hashes one training rank takes during one update: ``add`` per selected write,
    :meth:`value` the :data:`TRAIN_KEY` payload. Thread-safe (the write stage may run in
    several threads)."""

    def __init__(self, mode: str, cycle: int, version: int, algo: str = "xxh3"):
        self.mode, self.cycle, self.version, self.algo = mode, cycle, int(version), algo
        self.seconds = 0.0
        self._rows: list[tuple[int, int, int, int]] = []
        self._lock = threading.Lock()

    def wanted(self, dst: int, offset: int) -> bool:
        """Whether planned write ``(dst, offset)`` is checked this update."""
        return self.mode == "full" or (self.mode == "sample"
                                       and residue(dst, offset, self.cycle) == self.version % self.cycle)

    def add(self, dst: int, offset: int, length: int, pieces) -> None:
        """Hash ``pieces`` (the bytes of planned write ``(dst, offset, length)``, in order)."""
        t0 = time.perf_counter()
        h = hash_pieces(pieces, length, self.algo)
        with self._lock:
            self._rows.append((int(dst), int(offset), int(length), h))
            self.seconds += time.perf_counter() - t0

    def record(self, dst: int, offset: int, length: int, h: int) -> None:
        """Record hash ``h`` of planned write ``(dst, offset, length)``."""
        with self._lock:
            self._rows.append((int(dst), int(offset), int(length), int(h)))

    def value(self) -> dict:
        """``{"dst", "offsets", "lengths", "hashes", "seconds"}`` (arrays as bytes, seconds spent hashing)."""
        rows = sorted(self._rows)
        a = np.array(rows, dtype=np.uint64).reshape(-1, 4)
        return {"dst": pack(a[:, 0].astype(np.int64)), "offsets": pack(a[:, 1].astype(np.int64)),
                "lengths": pack(a[:, 2].astype(np.int64)), "hashes": pack(a[:, 3]), "seconds": self.seconds}


def _segment_pieces(reg, lo: int, sg) -> list[torch.Tensor]:
    """The bytes of a gather list (:class:`weight_transfer.transport.base.Segments`) in order: one
    copy through a strided view when the segments are rows of one stride (a TP column slice of a
    row-major shard, the common case: one piece, not one per row), else one piece per segment."""
    off, ln = np.asarray(sg.offsets), np.asarray(sg.lengths)
    if off.size > 1:
        stride = int(off[1] - off[0])
        if stride >= int(ln[0]) and (ln == ln[0]).all() and (np.diff(off) == stride).all():
            span = region_bytes(reg, lo + int(off[0]), stride * (off.size - 1) + int(ln[0]))
            return [span.as_strided((off.size, int(ln[0])), (stride, 1)).contiguous()]
    return [region_bytes(reg, lo + int(o), int(n)) for o, n in zip(off, ln)]


def output_pieces(memory, index: int, ai: int, k: int, outs, off: int) -> list[torch.Tensor]:
    """The bytes of output ``k`` of assignment ``ai`` of task ``index`` as the executor writes
    them (:class:`weight_transfer.pipeline.memory.RegisteredMemory`: its pool slot at chunk ``off``, the
    shard view it is, or the shard pieces of a fused band / strided slice, in output order),
    read in place after :meth:`~weight_transfer.pipeline.memory.RegisteredMemory.ops` made the batch."""
    from .memory import _Parts, _Slot

    p = memory.places[index][ai][k]
    if isinstance(p, _Parts):
        pieces = []
        for reg, lo, _at, n, sg in p.parts:
            if sg is None:
                pieces.append(region_bytes(reg, lo, n))
            else:
                pieces += _segment_pieces(reg, lo, sg)
        return pieces
    if isinstance(p, _Slot):
        lo = off + p.rel
        return [memory.pool.buffer[lo:lo + p.nbytes]]
    o = outs[k]
    return [o.contiguous().view(-1).view(torch.uint8)]


def hash_task(hashes: SenderHashes, memory, index: int, task, outs_all, off: int) -> None:
    """Add the selected planned writes of task ``index`` to ``hashes`` (each output hashed once,
    whatever number of receivers it goes to)."""
    for ai, a in enumerate(task.assignments):
        done: dict[int, int] = {}
        for w in a.writes:
            if not w.length or not hashes.wanted(w.dst_rank, w.remote_offset):
                continue
            if w.output not in done:
                t0 = time.perf_counter()
                done[w.output] = hash_pieces(output_pieces(memory, index, ai, w.output, outs_all[ai], off), w.length,
                                             hashes.algo)
                hashes.seconds += time.perf_counter() - t0
            hashes.record(w.dst_rank, w.remote_offset, w.length, done[w.output])


# -------------------------------------------------------------------------- inference side
