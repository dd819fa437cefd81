"""Shadow targets (case C27): the one-sided writes of an update land in a **shadow** of an
inference rank's weights while the engine keeps computing with the live ones; the version goes
live in one short step between two engine steps.

Two ways, both with the schedule unchanged (the plan writes the same offsets every update):

- ``"flip"``: the live tensors move, once, into half A of one allocation ``[A | guard | B]``;
  an update writes the half that is not live (the plan's offsets plus :attr:`Shadow.shift`:
  0 or the half's stride), and the go-live swaps which half the engine computes with (the
  engine re-points its tensors: ``adopt``). For engines that read their weights at call time.
  Costs a pointer swap; one extra copy of the weights.
- ``"copy"``: a separate shadow of the same layout is registered; the go-live copies each
  destination tensor shadow -> live (one device-local copy of the received bytes; bytes
  between tensors are never touched). For engines whose weights' addresses are captured
  (CUDA graphs, compiled constants, a packed weight held in a closure).

A failed update touches nothing live: the engine keeps serving the last complete version, and
the next update rewrites the whole shadow (a full update: after a failed one the shadow's
bytes are a mix, C26).

The shadow's layout: for an arena engine (:meth:`Shadow.of_arena`) the arena's own offsets
(:class:`~weight_transfer.types.DestTensorMeta` unchanged); for named tensors
(:meth:`Shadow.of_tensors`) one compact arena, tensors in address order, each at a
:data:`ALIGN`-byte aligned offset. Guard bytes (:data:`GUARD`, value :data:`GUARD_BYTE`) sit
before, between and after the halves: :meth:`Shadow.guard_damage` finds a write that strayed.

Why hand-written: no library (torch, vLLM 0.32) keeps a registered double buffer for one-sided
writes; vLLM's own weight updates write the live parameters between two steps.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from ..types import DestTensorMeta, dtype_name

__all__ = ["Shadow", "GoLiveServer", "SHADOW_MODES", "ALIGN", "GUARD", "GUARD_BYTE", "check_mode"]

SHADOW_MODES = ("flip", "copy")
ALIGN = 64
"""Byte alignment of each tensor in a compact shadow arena (a cache line)."""
GUARD = 64
"""Guard bytes before, between and after the shadow's halves."""
GUARD_BYTE = 0x5A


def check_mode(mode, where: str = "shadow") -> str | None:
    """``mode`` as a shadow mode: None / ``"off"`` -> None, ``"flip"`` / ``"copy"`` as given.
    ValueError naming ``where`` for anything else."""
    if mode in (None, "off", "none", False):
        return None
    if mode not in SHADOW_MODES:
        raise ValueError(f"{where}: shadow mode {mode!r} is not one of off, {', '.join(SHADOW_MODES)}")
    return mode


def _alloc(nbytes: int, device, allocate) -> torch.Tensor:
    if allocate is not None:
        return allocate(nbytes, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class Shadow:
    """The shadow of one inference rank's destination tensors (see the module docstring).

    Build with :meth:`of_arena` (an engine whose tensors are views into one ``uint8`` arena)
    or :meth:`of_tensors` (named tensors anywhere on one device). Attributes:

    - :attr:`mode`: ``"flip"`` or ``"copy"``;
    - :attr:`region`: the ``uint8`` tensor to register with the transport (flip: both halves
      and the guard between them; copy: the shadow);
    - :attr:`metas`: the destination metadata the plan writes (offsets from :attr:`region`'s
      first byte, i.e. into half A for flip);
    - :attr:`shift`: bytes to add to every planned offset for the next update (flip: the half
      that is not live; copy: 0);
    - :attr:`extra_bytes`: the memory the shadow adds to this rank (bytes).

    ``allocate(nbytes, device=...)``: how the shadow's memory is allocated (a transport that
    publishes only memory it allocated: ``Transport.allocate``); default ``torch.empty``.
    ValueError for an unknown mode, no tensors, or tensors on several devices."""

    def __init__(self, mode: str, live: dict[str, torch.Tensor], metas: list[DestTensorMeta], length: int,
                 device, *, allocate=None, adopt: Callable[[dict[str, torch.Tensor]], None] | None = None,
                 arena: torch.Tensor | None = None, no_copy=()):
        mode = check_mode(mode)
        if mode is None:
            raise ValueError("Shadow: mode must be 'flip' or 'copy'")
        if mode == "flip" and adopt is None:
            raise ValueError("Shadow: mode 'flip' needs adopt= (the engine re-points its tensors at go-live)")
        self.mode, self.metas, self.length, self.adopt = mode, list(metas), int(length), adopt
        self.no_copy = frozenset(no_copy)
        """Names the copy go-live skips: bytes a consumer reads from the written half itself
        (e.g. a vLLM worker's staging, re-processed by vLLM)."""
        self._live = dict(live)  # name -> the tensor the engine computes with now
        self.stride = -(-(self.length + GUARD) // ALIGN) * ALIGN  # half A to half B, bytes
        halves = 2 if mode == "flip" else 1
        total = GUARD + self.stride * (halves - 1) + self.length + GUARD
        self._buffer = _alloc(total, device, allocate)
        self._buffer.fill_(GUARD_BYTE)
        self.region = self._buffer[GUARD:GUARD + self.stride * (halves - 1) + self.length]
        self.live_index = 0
        """Flip: the half the engine computes with (0 = A, 1 = B). Copy: always 0."""
        self.extra_bytes = total - GUARD - self.length if mode == "flip" else total
        """Memory the shadow adds to the rank (bytes): the whole shadow (copy), or the second half
        (flip: half A replaces the engine's own copy of the weights, which it can then free -- a
        vLLM worker does; the stand-in engine keeps its first arena, so there both halves are
        extra), guards included."""
        self.golives = 0
        if mode == "flip":  # move the live bytes into half A once; the engine computes from there
            half = self._half(0)
            if arena is not None:
                half.copy_(arena.view(-1).view(torch.uint8)[:self.length])
            else:
                for m in self.metas:
                    half[m.offset:m.offset + m.nbytes].copy_(self._live[m.name].reshape(-1).view(torch.uint8))
            self._half(1).copy_(half)  # the same bytes between tensors in both halves (never written)
            self.adopt(self.views(0))
            self._live = self.views(0)
        else:
            self.region.zero_()  # every update writes every destination byte (the plan's cover check)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def of_arena(cls, mode: str, arena: torch.Tensor, metas: list[DestTensorMeta], *, allocate=None,
                 adopt: Callable[[torch.Tensor], None] | None = None) -> Shadow:
        """The shadow of an arena engine (``arena``: flat ``uint8``; ``metas``: its tensors,
        offsets into it). Flip: ``adopt(new_arena)`` re-points the engine at the live half (at
        construction and at each go-live); the halves have the arena's layout, so the engine's
        own offsets stay valid."""
        arena = arena.view(-1).view(torch.uint8)
        live = {m.name: arena[m.offset:m.offset + m.nbytes] for m in metas}
        sh = cls.__new__(cls)
        per = (lambda views: adopt(sh._half(sh.live_index))) if adopt is not None else None
        Shadow.__init__(sh, mode, live, metas, arena.numel(), arena.device, allocate=allocate, adopt=per,
                        arena=arena)
        if mode == "copy":
            sh._live_arena = arena
        return sh

    @classmethod
    def of_tensors(cls, mode: str, tensors: Mapping[str, torch.Tensor], *, rank: int = 0, allocate=None,
                   adopt: Callable[[dict[str, torch.Tensor]], None] | None = None, no_copy=()) -> Shadow:
        """The shadow of named tensors (contiguous, on one device): one compact arena, tensors in
        address order at :data:`ALIGN`-aligned offsets. Flip: ``adopt({name: view})`` re-points
        each tensor (e.g. ``param.data = view``) at construction and at each go-live. ``no_copy``:
        names the copy go-live leaves alone (their consumer reads the written half)."""
        if not tensors:
            raise ValueError("Shadow: no tensors")
        devs = {str(t.device) for t in tensors.values()}
        if len(devs) != 1:
            raise ValueError(f"Shadow: tensors on several devices {sorted(devs)}")
        metas, off = [], 0
        for name, t in sorted(tensors.items(), key=lambda kv: kv[1].data_ptr()):
            if not t.is_contiguous():
                raise ValueError(f"Shadow: {name!r} is not contiguous (stride {tuple(t.stride())})")
            n = t.numel() * t.element_size()
            metas.append(DestTensorMeta(rank=rank, name=name, shape=tuple(t.shape), dtype=dtype_name(t.dtype),
                                        offset=off, nbytes=n))
            off += -(-n // ALIGN) * ALIGN
        dev = next(iter(tensors.values())).device
        return cls(mode, dict(tensors), metas, max(off, 1), dev, allocate=allocate, adopt=adopt, no_copy=no_copy)

    # ------------------------------------------------------------------ layout
    def _half(self, index: int) -> torch.Tensor:
        return self.region[index * self.stride:index * self.stride + self.length]

    def views(self, index: int) -> dict[str, torch.Tensor]:
        """Every destination tensor as a view into half ``index`` (flip) or the shadow (copy,
        index 0), with its shape and dtype."""
        from ..types import torch_dtype

        half = self._half(index)
        return {m.name: half[m.offset:m.offset + m.nbytes].view(torch_dtype(m.dtype)).view(m.shape) for m in self.metas}

    @property
    def shadow_index(self) -> int:
        """The half the next update writes (flip); 0 for copy."""
        return 1 - self.live_index if self.mode == "flip" else 0

    @property
    def shift(self) -> int:
        """Bytes added to every planned offset for the next update (see the class docstring)."""
        return self.shadow_index * self.stride if self.mode == "flip" else 0

    def live_arena(self) -> torch.Tensor:
        """The bytes the engine computes with (an arena engine): flip, the live half."""
        return self._half(self.live_index) if self.mode == "flip" else self._live_arena

    def info(self) -> dict:
        """What a coordinator needs to drive this shadow: ``{"mode", "stride", "shift",
        "live_index", "extra_bytes", "golives"}`` (bytes)."""
        return {"mode": self.mode, "stride": self.stride, "shift": self.shift, "live_index": self.live_index,
                "extra_bytes": self.extra_bytes, "golives": self.golives}

    # ------------------------------------------------------------------ go-live
    def go_live(self) -> dict:
        """Make the shadow's bytes the live ones. Call between two engine steps, after every
        write of the update completed. Flip: swap the halves and ``adopt`` the new live views;
        copy: each destination tensor shadow -> live (only the tensors' bytes). Returns
        ``{"mode", "seconds", "bytes"}`` (wall seconds of the go-live; bytes copied)."""
        t0 = time.perf_counter()
        n = 0
        if self.mode == "flip":
            self.live_index = 1 - self.live_index
            views = self.views(self.live_index)
            self.adopt(views)
            self._live = views
        else:
            sh = self._half(0)
            for m in self.metas:
                if m.name in self.no_copy:
                    continue
                dst = self._live[m.name]
                src = sh[m.offset:m.offset + m.nbytes]
                dst.reshape(-1).view(torch.uint8).copy_(src) if dst.is_contiguous() else dst.copy_(
                    src.view(dst.dtype).view(dst.shape))
                n += m.nbytes
        if self.region.device.type == "cuda":
            torch.cuda.synchronize(self.region.device)
        self.golives += 1
        return {"mode": self.mode, "seconds": time.perf_counter() - t0, "bytes": n}

    def guard_damage(self) -> list[tuple[str, int]]:
        """Guard bytes around the halves that changed: ``[(where, n_changed)]``; empty when intact."""
        out = []
        b = self._buffer
        spans = [("before", 0, GUARD)]
        if self.mode == "flip":
            spans.append(("between", GUARD + self.length, GUARD + self.stride))
            end = GUARD + self.stride + self.length
        else:
            end = GUARD + self.length
        spans.append(("after", end, b.numel()))
        for where, lo, hi in spans:
            bad = int((b[lo:hi] != GUARD_BYTE).sum())
            if bad:
                out.append((where, bad))
        return out


class GoLiveServer:
    """A thread that serves one :class:`weight_transfer.api.Receiver`'s go-lives: it waits for
    each commit request (:meth:`Receiver.commit_requested`, polled every ``poll`` seconds) and
    runs :meth:`Receiver.go_live` holding ``lock`` (the engine holds the same lock around each
    step: the go-live falls between two steps), with ``on_live(version, stats)`` inside the
    same window. :attr:`golives` records each one (``{"version", "t0", "t1", "mode",
    "seconds", "bytes"}``, ``t0``/``t1`` wall clock, seconds); :attr:`errors` the failures
    (each also reported as the rank's failed commit). Stops on :meth:`stop` or the job's
    shutdown.

    Why hand-written: the go-live must run inside the engine's own step boundary; no library
    offers a hook there for an arbitrary engine (vLLM's worker RPCs do it for vLLM, and the vLLM
    backend uses those instead)."""

    def __init__(self, receiver, lock=None, on_live=None, *, poll: float = 0.002):
        import contextlib
        import threading

        self.rx, self.lock = receiver, lock if lock is not None else contextlib.nullcontext()
        self.on_live, self.poll = on_live, poll
        self.golives: list[dict] = []
        self.errors: list[str] = []
        self._failed: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"wt-golive-{receiver.rank}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                v = self.rx.commit_requested()
                if v is None or v == self._failed:
                    if self.rx.store.check(["shutdown"]):
                        return
                    self._wait()
                    continue
            except Exception:  # the store went away (the job ended): nothing more to serve
                if self._stop.wait(0.05):
                    return
                continue
            with self.lock:
                t0 = time.time()
                try:
                    stats = self.rx.go_live(v, then=self.on_live)
                except Exception as e:
                    self._failed = v
                    self.errors.append(f"version {v}: {type(e).__name__}: {e}")
                    continue
                t1 = time.time()
            self.golives.append({"version": v, "t0": t0, "t1": t1, **stats})

    def _wait(self) -> None:
        """Until the next commit request may have come: at the store's server, woken when the
        version written into the shadows or its commit key changes (at most 0.1 s); a store that
        cannot watch, ``poll`` seconds."""
        from ..control import protocol as control

        st = self.rx.store
        if not control.can_watch(st):
            self._stop.wait(self.poll)
            return
        raw = st.get_nowait("weights/shadow")
        keys, seen = ["weights/shadow", "shutdown"], [raw, None]
        if raw is not None and (v := control.parse_int(raw, "weights/shadow")) > self.rx.live_version:
            keys.append(f"step/{v}/commit")
            seen.append(None)
        control.watch(st, keys, 0.1, seen)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (waits at most ``timeout`` seconds for a go-live in progress)."""
        self._stop.set()
        self._thread.join(timeout)
