"""End-to-end fingerprints of an update (C31 of shared/CASES.md): the training side hashes
the bytes it sends, the inference side hashes the same ranges of its memory after they
landed, and the coordinator compares the two before it publishes ``complete v``.

The unit is one planned write (a :class:`weight_transfer.types.WriteSpec`: one recipe output
to one inference rank at one offset of its region). Both sides derive the ranges from the
static plan, never from the ops the data plane posted, so a write that landed shifted, a
range written twice (and another not at all), a byte changed after the write, or a shadow
still holding the previous version differ from what the plan says the range must hold.

- **Training side** (:mod:`weight_transfer.pipeline.hashes`, re-exported here): the executor hashes each selected output from
  the buffer it is written from (a pool slot, a view of a shard, or the shard pieces of a
  fused band, in output order), once the output is final and before the buffer is reused.
- **Inference side** (:class:`FingerprintServer`): a thread beside each
  :class:`weight_transfer.api.Receiver` answers the coordinator's request
  (:data:`REQ_KEY`: the ranges, already shifted to the half of a flip shadow that is not
  live) with the hashes of those ranges of its registered memory: after the writes, after a
  staged engine's commit, and with shadow targets in the shadow before the go-live.
- **Coordinator** (:class:`Verifier`): which ranges, the request, the comparison; a mismatch
  fails the update (:class:`weight_transfer.control.protocol.ControlError` naming the tensor, the byte
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

from ..options import VERIFY_MODES as MODES  # noqa: F401 -- re-exported
from ..options import VerifyOptions
from ..pipeline.hashes import (  # noqa: F401 -- re-exported
    SenderHashes,
    hash_pieces,
    hash_task,
    output_pieces,
    pack,
    region_bytes,
    residue,
    residues,
    selected,
    unpack,
)
from . import wire

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
        from ..errors import ControlError

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
