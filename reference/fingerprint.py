"""End-to-end fingerprints of an update (C31 of shared/CASES.md): the training side hashes
the bytes it sends, the inference side hashes the same ranges of its memory after they
landed, and the coordinator compares the two before it publishes ``complete v``.

The unit is one planned write (a :class:`weight_transfer.types.WriteSpec`: one recipe output
to one inference rank at one offset of its region). Both sides derive the ranges from the
static plan, never from the ops the data plane posted, so a write that landed shifted, a
range written twice (and another not at all), a byte changed after the write, or a shadow
still holding the previous version differ from what the plan says the range must hold.

- **Training side** (:func:`sender_hashes`): the executor hashes each selected output from
  the buffer it is written from (a pool slot, a view of a shard, or the shard pieces of a
  fused band, in output order), once the output is final and before the buffer is reused.
- **Inference side** (:class:`FingerprintServer`): a thread beside each
  :class:`weight_transfer.api.Receiver` answers the coordinator's request
  (:data:`REQ_KEY`: the ranges, already shifted to the half of a flip shadow that is not
  live) with the hashes of those ranges of its registered memory: after the writes, after a
  staged engine's commit, and with shadow targets in the shadow before the go-live.
- **Coordinator** (:class:`Verifier`): which ranges, the request, the comparison; a mismatch
  fails the update (:class:`weight_transfer.control.ControlError` naming the tensor, the byte
  range, the inference rank and the training rank that wrote it) like any failed write.

``verify="sample"`` checks the writes whose residue (:func:`residues`, a mix of the receiving
rank and the offset) equals ``version % cycle``: every planned byte is checked once in every
``cycle`` consecutive versions. ``"full"`` checks every write of every update.

The hash (:func:`hash_pieces`, one per job, published with the plan) is XXH3-64 on the host
(the ``xxhash`` package: a maintained binding of Yann Collet's xxHash, about 29 GB/s per core
on the project's CPUs) or, for GPU memory, ``fold64``: a position-weighted 64-bit sum in torch
integer ops, computed on the bytes' own device. Non-cryptographic hashes are enough: the control
plane that carries the values is authenticated (docs/SECURITY.md). Why hand-written: no
maintained library hashes a CUDA tensor in place with a value a host can reproduce.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from . import wire
from .options import VERIFY_MODES as MODES  # noqa: F401 -- re-exported
from .options import VerifyOptions

REQ_KEY = "verify/{i}/request"
"""The coordinator's request to inference rank ``i`` (``{"version", "offsets", "lengths"}``,
int64 arrays as bytes: region offsets to hash, shifts applied)."""
ANSWER_KEY = "step/{v}/fp/i{i}"
"""Inference rank ``i``'s hashes of version ``v``'s requested ranges (``{"hashes", "seconds",
"error"}``: uint64 array as bytes, in request order)."""
VERIFY_KEY = "plan/verify"
"""``{"mode", "cycle"}``: the coordinator's :class:`VerifyOptions`, published before the plan."""
TRAIN_KEY = "step/{v}/fp/t{r}"
"""Training rank ``r``'s hashes of version ``v``'s selected writes (``{"dst", "offsets",
"lengths", "hashes"}``: int64/uint64 arrays as bytes), set before its ``done`` report."""


def verify_options(store) -> VerifyOptions | None:
    """The coordinator's :class:`VerifyOptions` as published under :data:`VERIFY_KEY` (None when
    it published none, or ``"off"``)."""
    if not store.check([VERIFY_KEY]):
        return None
    d = wire.get(store, VERIFY_KEY)
    o = VerifyOptions(mode=d["mode"], cycle=d["cycle"], algo=d.get("algo", "xxh3"))
    return None if o.mode == "off" else o


def plan_value(options: VerifyOptions, payloads: dict) -> dict:
    """The :data:`VERIFY_KEY` value for ``options`` (``algo`` ``auto`` resolved: ``fold64`` when a
    receiver's region, among ``payloads`` -- ``{rank: (RegionDescriptor, metas)}`` --, is GPU
    memory (``cuda_ipc``), else ``xxh3``)."""
    algo = options.algo
    if algo == "auto":
        algo = "fold64" if any(getattr(p[0], "transport", "") == "cuda_ipc" for p in payloads.values()) else "xxh3"
    return {"mode": options.mode, "cycle": options.cycle, "algo": algo}


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
    them (:class:`weight_transfer.memory.RegisteredMemory`: its pool slot at chunk ``off``, the
    shard view it is, or the shard pieces of a fused band / strided slice, in output order),
    read in place after :meth:`~weight_transfer.memory.RegisteredMemory.ops` made the batch."""
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


class FingerprintServer:
    """A thread that answers the coordinator's fingerprint requests for one inference rank:
    it waits for :data:`REQ_KEY` to change (at the store's server where it can watch, else
    every ``poll`` seconds), hashes the requested ranges with ``view(offset, length)`` (a uint8
    tensor of this rank's memory) and sets :data:`ANSWER_KEY`. An error (a range outside the
    memory) is answered as such: the coordinator fails the update naming it. Stops on
    :meth:`stop` or the job's ``shutdown``.

    Why hand-written: the hashes must be taken inside the engine's process, of the memory it
    registered, between the last write and the go-live; nothing in torch.distributed or vLLM
    offers that hook for an arbitrary engine (the vLLM backend answers the same request from
    its worker, beside its commit)."""

    def __init__(self, store, rank: int, view: Callable[[int, int], torch.Tensor], *, poll: float = 0.01,
                 lock=None):
        import contextlib

        self.store, self.rank, self.view, self.poll = store, int(rank), view, poll
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.answered: list[int] = []
        """Versions answered, in order."""
        self.algo = "xxh3"
        """The job's hash (from the plan's :data:`VERIFY_KEY`)."""
        self.before: Callable | None = None
        """``before(version, offsets, lengths)`` (optional), called before hashing: raises when
        this rank's memory cannot hold version ``version``'s bytes in those ranges (e.g. a vLLM
        worker's staged layers whose commit of that version did not run); answered as the error."""
        self._stop = threading.Event()
        self._seen: bytes | None = None
        self._thread = threading.Thread(target=self._loop, name=f"wt-fingerprint-{rank}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:

        key = REQ_KEY.format(i=self.rank)
        while not self._stop.is_set():  # until the coordinator says whether it verifies
            try:
                if self.store.check([VERIFY_KEY]):
                    o = verify_options(self.store)
                    if o is None:
                        return  # verify off: nothing to serve
                    self.algo = o.algo
                    break
                if self.store.check(["shutdown"]):
                    return
                if getattr(self.store, "watch", None) is not None:
                    self.store.watch([VERIFY_KEY], timeout=0.5)
                else:
                    self._stop.wait(max(self.poll, 0.05))
            except Exception:
                if self._stop.wait(0.05):
                    return
        while not self._stop.is_set():
            try:
                raw = self.store.get_nowait(key) if hasattr(self.store, "get_nowait") else (
                    self.store.get(key) if self.store.check([key]) else None)
                if raw is None or raw == self._seen:
                    if self.store.check(["shutdown"]):
                        return
                    if getattr(self.store, "watch", None) is not None:
                        self.store.watch([key], [self._seen], timeout=0.5)
                    else:
                        self._stop.wait(self.poll)
                    continue
            except Exception:  # the store went away (the job ended): nothing more to serve
                if self._stop.wait(0.05):
                    return
                continue
            self._seen = raw
            self.answer(raw)

    def answer(self, raw: bytes) -> None:
        """Hash the ranges of request ``raw`` and publish the answer."""
        t0 = time.perf_counter()
        req = wire.decode(raw, REQ_KEY.format(i=self.rank))
        v = int(req["version"])
        out = {"hashes": b"", "seconds": 0.0, "error": ""}
        try:
            offs, lens = unpack(req["offsets"], np.int64), unpack(req["lengths"], np.int64)
            if self.before is not None:
                self.before(v, offs, lens)
            with self.lock:
                hs = [hash_pieces([self.view(int(o), int(n))], int(n), self.algo) for o, n in zip(offs, lens)]
            out["hashes"] = pack(np.array(hs, dtype=np.uint64))
        except Exception as e:
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out["seconds"] = time.perf_counter() - t0
        wire.put(self.store, ANSWER_KEY.format(v=v, i=self.rank), out)
        self.answered.append(v)

    def stop(self) -> None:
        """Stop the thread (returns within about 0.5 s)."""
        self._stop.set()
        self._thread.join(2.0)


# -------------------------------------------------------------------------- coordinator side


class Verifier:
    """The coordinator's side: which planned writes each update checks, the requests, and the
    comparison.

    ``options``: :class:`VerifyOptions`; ``schedule``: the plan
    (:class:`weight_transfer.types.Schedule`); ``metas``: ``{inference rank: [DestTensorMeta]}``
    (to name the tensor of a range). Built once per plan (and per plan epoch)."""

    def __init__(self, options: VerifyOptions, schedule, metas: dict):
        self.options = options
        rows = [(w.dst_rank, w.remote_offset, w.length, rp.rank)
                for rp in schedule.rank_plans.values() for t in rp.tasks for a in t.assignments
                for w in a.writes if w.length] if options.mode != "off" else []
        a = np.array(sorted(rows), dtype=np.int64).reshape(-1, 4)
        self.tables = {int(i): (a[a[:, 0] == i, 1], a[a[:, 0] == i, 2], a[a[:, 0] == i, 3])
                       for i in np.unique(a[:, 0])}
        """``{inference rank: (offsets, lengths, training ranks)}`` of every planned write."""
        self.metas = {int(i): sorted(ms, key=lambda m: m.offset) for i, ms in metas.items()}
        self._asked: dict[int, np.ndarray] = {}

    @property
    def on(self) -> bool:
        return self.options.mode != "off"

    def request(self, store, version: int, shifts: dict | None = None) -> list[int]:
        """Ask every inference rank with selected writes at ``version`` for its hashes
        (``shifts``: ``{rank: int | (lo, hi, bytes)}`` of flip shadows, applied to the offsets).
        Returns the ranks asked."""

        o = self.options
        asked = []
        self._asked = {}
        for i, (offs, lens, _r) in self.tables.items():
            m = selected(o.mode, o.cycle, version, i, offs)
            if not m.any():
                continue
            at = offs[m].copy()
            sh = (shifts or {}).get(i, 0)
            if isinstance(sh, int):
                at += sh
            else:
                lo, hi, d = sh
                at[(at >= lo) & (at < hi)] += d
            self._asked[i] = m
            wire.put(store, REQ_KEY.format(i=i), {"version": int(version), "offsets": pack(at),
                                                     "lengths": pack(lens[m])})
            asked.append(i)
        return asked

    def check(self, store, version: int, shifts: dict, n_train: int, *, wait) -> dict:
        """The whole check of ``version``: :meth:`request`, ``wait(keys, what)`` for the answers
        (the controller's bounded wait, naming a rank that does not answer), :meth:`compare`.
        Returns ``{"mode", "bytes" checked, "seconds"}`` (request to comparison); raises
        :class:`weight_transfer.errors.ControlError` naming every mismatched range (its
        ``metrics_kind`` ``fingerprint_mismatch``, or ``fingerprint_error`` for a rank that could
        not hash)."""
        from .errors import ControlError

        t0 = time.perf_counter()
        asked = self.request(store, version, shifts)
        train = [wire.get(store, TRAIN_KEY.format(v=version, r=r)) for r in range(n_train)]  # while they hash
        wait({i: ANSWER_KEY.format(v=version, i=i) for i in asked},
             f"step {version} fingerprints (each Receiver answers them from a thread of its own)")
        checked, _slowest, err = self.compare(store, version, n_train, train)
        if err is not None:  # a failure kind of its own in weight_transfer.metrics
            raise ControlError(err, kind="fingerprint_" + ("mismatch" if err.startswith("fingerprint mismatch") else "error"))
        return {"mode": self.options.mode, "bytes": checked, "seconds": time.perf_counter() - t0}

    def compare(self, store, version: int, n_train: int, train: list | None = None) -> tuple[int, float, str | None]:
        """Compare the answers of the ranks :meth:`request` asked with every training rank's
        hashes (all keys present; ``train``: their values, read already). Returns ``(bytes
        checked, seconds the inference side spent hashing (the slowest rank), None)`` or ``(...,
        error)``: the error names, for the first mismatches (at most 4), the tensor, its byte
        range, the inference rank and the training rank that wrote it."""
        tr = train if train is not None else [wire.get(store, TRAIN_KEY.format(v=version, r=r)) for r in range(n_train)]
        keys, hashes, lengths = [], [], []
        for d in tr:
            dst, offs = unpack(d["dst"], np.int64), unpack(d["offsets"], np.int64)
            keys.append((dst << 48) | offs)
            hashes.append(unpack(d["hashes"], np.uint64))
            lengths.append(unpack(d["lengths"], np.int64))
        keys_a = np.concatenate(keys) if keys else np.zeros(0, np.int64)
        hs_a = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
        order = np.argsort(keys_a, kind="stable")
        keys_a, hs_a = keys_a[order], hs_a[order]
        checked, slowest, bad = 0, 0.0, []
        for i, m in self._asked.items():
            ans = wire.get(store, ANSWER_KEY.format(v=version, i=i))
            slowest = max(slowest, float(ans["seconds"]))
            if ans["error"]:
                return checked, slowest, f"inference {i}: fingerprint failed: {ans['error']}"
            offs, lens, who = (x[m] for x in self.tables[i])
            got = unpack(ans["hashes"], np.uint64)
            if got.size != offs.size:
                return checked, slowest, (f"inference {i}: {got.size} fingerprints for {offs.size} requested ranges "
                                          f"of version {version}")
            want_keys = (np.int64(i) << 48) | offs
            pos = np.searchsorted(keys_a, want_keys)
            pos_c = np.minimum(pos, max(keys_a.size - 1, 0))
            found = (keys_a.size > 0) & (keys_a[pos_c] == want_keys) if keys_a.size else np.zeros(offs.size, bool)
            want = np.where(found, hs_a[pos_c] if keys_a.size else 0, 0).astype(np.uint64)
            ok = found & (want == got)
            checked += int(lens[ok].sum())
            for j in np.flatnonzero(~ok):
                bad.append(self._name(i, int(offs[j]), int(lens[j]), int(who[j]), bool(found[j])))
        if bad:
            more = f"; {len(bad) - 4} more range(s)" if len(bad) > 4 else ""
            return checked, slowest, (f"fingerprint mismatch in version {version} ({len(bad)} range(s)): "
                                      + "; ".join(bad[:4]) + more)
        return checked, slowest, None

    def _name(self, i: int, off: int, n: int, r: int, reported: bool) -> str:
        """``"<tensor> bytes [a, b) on inference i, written by training r"``."""
        import bisect

        ms = self.metas.get(i, [])
        k = bisect.bisect_right([m.offset for m in ms], off) - 1
        if 0 <= k < len(ms) and off < ms[k].offset + ms[k].nbytes:
            where = f"{ms[k].name} bytes [{off - ms[k].offset}, {off - ms[k].offset + n})"
        else:
            where = f"region bytes [{off}, {off + n})"
        if not reported:
            return f"{where} on inference {i}: training {r} reported no fingerprint for it"
        return f"{where} on inference {i}, written by training {r}"
