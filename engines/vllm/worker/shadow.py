"""Shadow targets inside a vLLM worker (case C27): every update lands in a shadow of the
worker's destination tensors while vLLM keeps generating from the live ones; ``update_weights``
is the go-live, between two engine steps.

Per worker (:class:`WorkerShadow`, built by the ``one_sided`` worker engine at
``init_weight_transfer_engine`` with ``shadow="copy"`` or ``"flip"``):

- one :class:`weight_transfer.api.shadow.Shadow` over every target of the worker's
  :class:`~weight_transfer.engines.vllm.worker.runtime.RuntimeLayout` -- direct targets (the bytes vLLM
  computes with) and the staging tensors of staged layers -- registered once as the worker's
  region; the layout published for the plan points into it (:meth:`WorkerShadow.layout`);
- **copy** (any target): the go-live copies each direct target shadow -> live; **flip** (every
  direct target a parameter vLLM reads at call time): the halves swap and each parameter is
  re-pointed (``param.data = view``); a target that is not a parameter (a packed copy held in a
  closure) is refused at init, naming it;
- **staged layers** (a oneDNN handle owns its own reordered copy of the weight): rebuilt **off
  the critical path** -- a thread of the worker waits until every training rank reported its
  writes of the version, then runs vLLM's own ``process_weights_after_loading`` on a clone of
  the layer whose parameters hold a private copy of the written bytes (the live layer is not
  touched); the go-live swaps the clone's state (``cpu_linear``, the emptied ``weight``) into the
  live layer. The part of the rebuild the go-live still had to wait for is measured
  (``rebuild_wait_s``) and reported apart from the copy.

A failed update touches nothing live (the rebuild's clones are dropped); the next update
rewrites the whole shadow.

Why hand-written: vLLM 0.32's reload path (``model_loader/reload``) rebuilds layers in place,
between steps, on the live module; nothing in it builds a layer's kernel state aside.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from typing import TypedDict

import torch

from weight_transfer.api.shadow import Shadow, check_mode
from weight_transfer.control import wire
from weight_transfer.engines.vllm.worker.runtime import STAGING_SUFFIX

__all__ = ["WorkerShadow", "clone_processed", "apply_clone", "receive_shadow", "start_shadow_update",
           "shadow_go_live", "trainer_go_live", "http_go_live", "READY_KEY", "Ready"]

READY_KEY = "shadow/{version}/ready/{rank}"
"""Store key: a worker's :class:`Ready` once every write of ``version`` landed in its shadow
and its staged layers were rebuilt aside (the trainer engine waits for it before the go-live,
so a failed rebuild fails the update before anything live moves)."""


class Ready(TypedDict):
    """:data:`READY_KEY`: ``ok`` (the rebuild of the staged layers succeeded), ``error`` (why
    not, one line; ``""`` when ok), ``rebuild_s`` (seconds the rebuild took; None when it
    failed)."""

    ok: bool
    error: str
    rebuild_s: float | None


wire.register(READY_KEY.replace("{version}", "{v}").replace("{rank}", "{i}"), Ready,
              "a vLLM worker's shadow written and its staged layers rebuilt aside, ready to go live (vLLM backend)")


def clone_processed(layer: torch.nn.Module, params: dict[str, torch.Tensor], vllm_config) -> torch.nn.Module:
    """A shallow clone of ``layer`` whose parameters ``params`` (name -> a private tensor in the
    loading layout) replace the layer's, after vLLM's ``quant_method.process_weights_after_loading``
    ran on the clone (e.g. ``dispatch_cpu_unquantized_gemm``: a new oneDNN handle in
    ``clone.cpu_linear``). The live layer is not touched: the clone has its own ``__dict__``,
    parameter and buffer dicts and its own Parameter objects (sharing the live tensors' memory
    only for parameters not in ``params``)."""
    from vllm.config import set_current_vllm_config

    clone = copy.copy(layer)
    clone.__dict__ = dict(layer.__dict__)
    clone._parameters = {k: (None if v is None else torch.nn.Parameter(v.data, requires_grad=False))
                         for k, v in layer._parameters.items()}
    clone._buffers = dict(layer._buffers)
    for pn, t in params.items():
        clone._parameters[pn] = torch.nn.Parameter(t, requires_grad=False)
    clone.__dict__.pop("_already_called_process_weights_after_loading", None)
    with torch.no_grad(), set_current_vllm_config(vllm_config):
        layer.quant_method.process_weights_after_loading(clone)
    return clone


def apply_clone(layer: torch.nn.Module, clone: torch.nn.Module, *, keep_params=()) -> list[str]:
    """Make ``layer`` compute like ``clone`` (:func:`clone_processed`): every attribute of the
    clone that differs from the layer's (``cpu_linear``, ...) and its parameters, except the
    names in ``keep_params`` (a parameter the trainers write in place keeps its tensor). Pointer
    swaps only. Returns the names swapped."""
    swapped = []
    for k, v in clone.__dict__.items():
        if k in ("_parameters", "_buffers", "_modules"):
            continue
        if layer.__dict__.get(k, _MISSING) is not v:
            layer.__dict__[k] = v
            swapped.append(k)
    for k, p in clone._parameters.items():
        if k in keep_params:
            continue
        if layer._parameters.get(k) is not p:
            layer._parameters[k] = p
            swapped.append(k)
    return swapped


_MISSING = object()


class WorkerShadow:
    """Shadow targets of one vLLM worker (see the module docstring). ``targets``: the worker's
    :class:`~weight_transfer.engines.vllm.worker.state.WorkerTargets` (staging set up);
    ``layout``: its :class:`~weight_transfer.engines.vllm.worker.runtime.RuntimeLayout`; ``mode``:
    ``"copy"`` or ``"flip"``. ValueError, naming the tensor, for a target ``"flip"`` cannot
    re-point (not a model parameter), or a mode that is neither."""

    def __init__(self, targets, layout, mode: str, *, who: str = "worker"):
        auto = mode == "auto"
        mode = "flip" if auto else check_mode(mode, where=f"{who}: shadow")
        if mode is None:
            raise ValueError(f"{who}: shadow mode must be 'copy', 'flip' or 'auto'")
        model = targets.model
        self.params = dict(model.named_parameters(remove_duplicate=False))
        bad = [t for t in layout.targets if not t.staged and t.name not in self.params]
        if auto:  # flip where every direct target is a parameter vLLM reads at call time, else copy
            mode = "copy" if bad else "flip"
            self.why = (f"copy: {bad[0].name} is not a parameter vLLM reads at call time ({len(bad)} such)" if bad
                        else "flip: every direct target is a parameter vLLM reads at call time")
        else:
            self.why = f"{mode}: as asked"
        self.targets, self.live_layout, self.mode, self.who = targets, layout, mode, who
        live = targets.runtime_tensors()
        tensors = {t.name: live[t.name] for t in layout.targets}
        self.staging = {t.name for t in layout.targets if t.staged}
        if mode == "flip":
            if bad:
                raise ValueError(f"{who}: shadow 'flip': {bad[0].name} is not a parameter vLLM reads at call time "
                                 f"({bad[0].step or 'a tensor derived after loading'}): it cannot be re-pointed "
                                 f"({len(bad)} such target(s)); use shadow 'copy'")
        self.shadow = Shadow.of_tensors(mode, tensors, rank=layout.rank, no_copy=self.staging,
                                        adopt=self._adopt if mode == "flip" else None)
        views = self.shadow.views(0)
        self.layout = dataclasses.replace(layout, targets=[dataclasses.replace(t, data_ptr=views[t.name].data_ptr())
                                                           for t in layout.targets], registered=None)
        self.layout.extra = self.shadow.region.numel() - self.layout.length if mode == "flip" else 0
        self.extra_bytes = self.shadow.extra_bytes
        self._built: dict[str, torch.nn.Module] | None = None
        self._build_error: BaseException | None = None
        self._build_thread: threading.Thread | None = None
        self._closed = False
        self._build_for: int | None = None
        self.build_seconds = 0.0
        self.version: int | None = None
        self.rank: int = layout.rank

    # ------------------------------------------------------------------ flip
    def _adopt(self, views: dict[str, torch.Tensor]) -> None:
        for name, v in views.items():
            if name in self.staging:
                continue
            self.params[name].data = v

    def info(self) -> dict:
        """What the coordinator hands the trainers (:data:`weight_transfer.control.protocol.SHADOW_KEY`,
        schema :class:`weight_transfer.control.keys.ShadowInfo`): :meth:`Shadow.info` (bytes) with
        ``shift`` as ``(lo, hi, delta)`` over the plan's offsets (half A: ``[0, length)``) for a
        flip, 0 for a copy, and ``why`` (how the mode was chosen, one line)."""
        out = self.shadow.info()
        out["why"] = self.why
        out["shift"] = (0, self.shadow.length, self.shadow.shift) if self.mode == "flip" else 0
        return out

    def live_ptrs(self) -> dict[str, int]:
        """Direct target -> the address vLLM must compute from now (layout-change check)."""
        if self.mode == "flip":
            views = self.shadow.views(self.shadow.live_index)
            return {n: v.data_ptr() for n, v in views.items() if n not in self.staging}
        return {t.name: t.data_ptr for t in self.live_layout.targets if not t.staged}

    # ------------------------------------------------------------------ rebuild off the critical path
    def start_rebuild(self, store, version_of_update, n_train: int, timeout: float, rank: int) -> None:
        """Start the thread that, once every training rank reported its writes of the update
        being written (``version_of_update()``: the version in ``weights/shadow``, polled),
        rebuilds every staged layer on a clone from the written half (:func:`clone_processed`)
        and publishes :data:`READY_KEY` (ok, or the rebuild's error)."""
        from weight_transfer.control import protocol as control

        self._built, self._build_error, self._build_for = None, None, None

        def run():
            v = None
            try:
                v = self._wait_written(store, version_of_update, n_train, timeout, lambda: self._closed)
                if v is None:
                    return
                t0 = time.perf_counter()
                self._build_for = v
                self._built = self._rebuild() if self.targets.staged else {}
                self.build_seconds = time.perf_counter() - t0
                control.put(store, READY_KEY.format(version=v, rank=rank),
                            Ready(ok=True, error="", rebuild_s=float(self.build_seconds)))
            except BaseException as e:  # reported by the go-live
                self._build_error = e
                if v is not None:
                    try:
                        control.put(store, READY_KEY.format(version=v, rank=rank),
                                    Ready(ok=False, error=f"{self.who}: rebuild of the staged layers failed: "
                                                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                                          rebuild_s=None))
                    except Exception:
                        pass
        self._build_thread = threading.Thread(target=run, name=f"wt-rebuild-{os.getpid()}", daemon=True)
        self._build_thread.start()

    @staticmethod
    def _wait_written(store, version_of_update, n_train: int, timeout: float, closed=lambda: False) -> int | None:
        from weight_transfer.control import protocol as control

        deadline = time.monotonic() + timeout
        v = None
        while time.monotonic() < deadline and not closed():
            v = v if v is not None else version_of_update()
            if v is not None:
                keys = [f"step/{v}/done/{r}" for r in range(n_train)]
                if store.check([f"step/{v}/failed"]):
                    return None
                if all(store.check([k]) for k in keys):
                    return v if all(control.get(store, k)["ok"] for k in keys) else None
            time.sleep(0.002)
        return None

    def _rebuild(self) -> dict[str, torch.nn.Module]:
        """Each staged layer's clone, processed from the written half's bytes, read in place: a
        kernel that makes its own copy (oneDNN, the packed GEMM) leaves nothing pointing into the
        shadow, so nothing large is allocated here or freed at the go-live; a clone whose
        parameters or ``cpu_linear`` closure still point into the shadow (a kernel that keeps
        the weight it was given: the next update would overwrite it while it serves) is rebuilt
        from a private copy."""
        mods = dict(self.targets.model.named_modules())
        written = self.shadow.views(self.shadow.shadow_index)
        by_ptr = {ptr: name for name, ptr in self.live_ptrs().items()}  # a tied parameter's target is its canonical name
        out = {}
        for mname, st in self.targets.staged.items():
            if st["mode"] == "copy":
                params = {pn: written[f"{mname}.{pn}{STAGING_SUFFIX}"] for pn in st["params"]}
            else:  # in place: the layer's own parameters are targets
                params = {}
                for pn, p in mods[mname].named_parameters(recurse=False):
                    name = by_ptr.get(p.data_ptr())
                    if name is None:
                        raise RuntimeError(f"{self.who}: {mname}.{pn} (staged in place) is no target of this worker")
                    params[pn] = written[name]
            clone = clone_processed(mods[mname], params, self.targets.vllm_config)
            if self._points_into_shadow(clone, keep=st["mode"] != "copy"):
                clone = clone_processed(mods[mname], {k: v.clone() for k, v in params.items()}, self.targets.vllm_config)
            out[mname] = clone
        return out

    def _points_into_shadow(self, clone, *, keep: bool) -> bool:
        """Whether what the go-live would swap in from ``clone`` reads shadow memory: its
        ``cpu_linear`` closure's tensors, and (unless ``keep``: in-place layers keep their own
        parameters) its parameters."""
        from weight_transfer.engines.vllm.worker.state import _closure_tensors

        lo = self.shadow.region.data_ptr()
        hi = lo + self.shadow.region.numel()
        ts = [v for _, v in _closure_tensors(getattr(clone, "cpu_linear", None))]
        ts += list(getattr(getattr(clone, "cpu_linear", None), "__defaults__", None) or ())
        if not keep:
            ts += [p for p in clone._parameters.values() if p is not None]
        return any(isinstance(t, torch.Tensor) and t.numel() and lo <= t.data_ptr() < hi for t in ts)

    def close(self, timeout: float = 10.0) -> None:
        """End this worker's shadow (the engine's shutdown, C32): stop the rebuild thread
        (bounded by ``timeout`` seconds; it polls the store, so it ends at its next poll), drop
        rebuilt clones, and give every model parameter that a flip left pointing into the
        shadow region a private copy, so nothing live reads the region and it is freed."""
        self._closed = True
        th = self._build_thread
        if th is not None and th.is_alive():
            th.join(timeout)
        self._built, self._build_thread = None, None
        lo = self.shadow.region.data_ptr()
        hi = lo + self.shadow.region.numel() * self.shadow.region.element_size()
        with torch.no_grad():
            for p in self.targets.model.parameters():
                if p.numel() and lo <= p.data_ptr() < hi:
                    p.data = p.data.clone()

    # ------------------------------------------------------------------ go-live
    def go_live(self, version: int, timeout: float) -> dict:
        """Between two engine steps: wait for the rebuild (bounded by ``timeout``; the wait is
        ``rebuild_wait_s``), make the shadow live (copy or flip), swap each staged layer's rebuilt
        state in. Returns ``{"mode", "seconds", "copy_s", "bytes", "swap_s", "rebuild_s",
        "rebuild_wait_s", "layers"}`` (seconds; ``rebuild_s`` ran off the critical path).
        RuntimeError when the rebuild failed or is not of ``version``."""
        t0 = time.perf_counter()
        wait = 0.0
        if self._build_thread is None:
            raise RuntimeError(f"{self.who}: go-live of version {version}: no rebuild was started "
                               "(start_weight_update first)")
        self._build_thread.join(timeout)
        wait = time.perf_counter() - t0
        if self._build_thread.is_alive():
            raise RuntimeError(f"{self.who}: go-live of version {version}: the staged layers' rebuild did not "
                               f"end within {timeout:.0f} s")
        if self._build_error is not None:
            raise RuntimeError(f"{self.who}: rebuild of the staged layers failed: "
                               f"{type(self._build_error).__name__}: {self._build_error}") from self._build_error
        if self._built is None or self._build_for != int(version):
            raise RuntimeError(f"{self.who}: go-live of version {version}: the staged layers were rebuilt for "
                               f"{self._build_for} (the trainers' writes of {version} not all reported ok)")
        st = self.shadow.go_live()
        t1 = time.perf_counter()
        mods = dict(self.targets.model.named_modules())
        for mname, clone in (self._built or {}).items():
            staged = self.targets.staged[mname]  # the layer keeps every parameter the trainers write in place:
            keep = tuple(pn for pn, _ in mods[mname].named_parameters(recurse=False)  # in a "copy" layer,
                         if staged["mode"] != "copy" or pn not in staged["params"])  # those not staged (a router's bias)
            apply_clone(mods[mname], clone, keep_params=keep)
        swap = time.perf_counter() - t1
        layers = len(self._built or {})
        self._built, self._build_thread, self.version = None, None, version
        return {"mode": self.mode, "seconds": time.perf_counter() - t0, "copy_s": st["seconds"], "bytes": st["bytes"],
                "swap_s": swap, "rebuild_s": self.build_seconds, "rebuild_wait_s": wait, "layers": layers}



# ------------------------------------------------------------------ the worker engine's calls


def receive_shadow(targets, layout, mode: str, *, rank: int, store, transport: str, timeout: float, who: str,
                   before_publish=None):
    """The shadow variant of :meth:`WorkerTargets.receive`: a :class:`WorkerShadow` over the
    layout's targets, its region (one allocation) registered with the transport its memory
    takes, its info published under :data:`weight_transfer.control.protocol.SHADOW_KEY`, then
    ``before_publish(receiver)`` and the receiver's metadata (the layout pointing into the
    shadow). Returns ``(WorkerShadow, Receiver)``; the errors of :class:`WorkerShadow` and of the
    Receiver, before anything is published."""
    from weight_transfer.api import Receiver
    from weight_transfer.control import protocol as control
    from weight_transfer.engines.vllm.worker.state import choose_transport

    sh = WorkerShadow(targets, layout, mode, who=who)
    name = choose_transport({"shadow region": sh.shadow.region}, transport, who=who)
    rx = Receiver(region=sh.shadow.region, metas=sh.layout.dest_metas(), rank=rank, store=store, transport=name,
                  timeout=timeout, runtime=sh.layout, publish=False)
    try:
        sh.layout.registered = rx.descriptor
        sh.layout.descriptor()  # the region is the destinations' span (+ a flip buffer's second half)
        control.put(store, control.SHADOW_KEY.format(rank=rank), sh.info())
        if before_publish is not None:
            before_publish(rx)
        rx.publish()
    except BaseException:
        rx.close()
        raise
    sh.rank = rank
    import sys

    print(f"[{who}] shadow targets: {sh.why}; {sh.extra_bytes / 1e6:.1f} MB extra", file=sys.stderr, flush=True)
    return sh, rx


def start_shadow_update(sh: WorkerShadow, store, *, who: str) -> None:
    """``start_weight_update`` with shadow targets (before the coordinator names the version):
    refuse when a live tensor moved since init (vLLM rebuilt the layer: the go-live would copy
    into memory vLLM no longer reads), then start the rebuild thread for the next version
    written (one above what ``weights/shadow`` holds now)."""
    from weight_transfer.api import WORLD_KEY
    from weight_transfer.control import protocol as control

    live = sh.targets.runtime_tensors()
    for name, ptr in sh.live_ptrs().items():
        now = live.get(name)
        if now is None or now.data_ptr() != ptr:
            where = "gone" if now is None else f"now {now.data_ptr():#x}"
            raise RuntimeError(f"{who}: the model's layout changed since init_weight_transfer_engine: {name} was "
                               f"{ptr:#x}, {where}; refusing the update (shutdown_weight_transfer_engine and init again)")
    floor = control.get_int(store, "weights/shadow") if store.check(["weights/shadow"]) else -1
    n_train = control.get(store, WORLD_KEY)["n_train"] if store.check([WORLD_KEY]) else 1

    def version_of_update():
        if store.check(["weights/shadow"]):
            v = control.get_int(store, "weights/shadow")
            return v if v > floor else None
        return None
    sh.start_rebuild(store, version_of_update, n_train, timeout=store_timeout(store), rank=sh.rank)


def store_timeout(store) -> float:
    """Seconds a call on ``store`` may block (its timeout; 120 s when it does not say)."""
    try:
        return float(store.timeout.total_seconds())
    except Exception:
        return 120.0


def shadow_go_live(sh: WorkerShadow, store, version: int, *, rank: int, timeout: float, refused: str) -> dict:
    """``update_weights(version)`` with shadow targets, after the caller checked every training
    rank's writes: the version written into the shadows must be ``version``; then
    :meth:`WorkerShadow.go_live`, marked on the worker's step clock, reported under
    ``step/{version}/committed/{rank}``, and the shadow's info republished (a flip moved the
    half the next update writes). Returns the go-live's stats; RuntimeError (reported as a
    failed commit) otherwise."""
    from weight_transfer.control import protocol as control
    from weight_transfer.engines.vllm.worker.steps import mark

    key = "weights/shadow"
    now = control.get_int(store, key) if store.check([key]) else None
    try:
        if now != version:
            raise RuntimeError(f"{refused}: the shadows hold the writes of version {now}, not {version}")
        t0 = time.time()
        stats = sh.go_live(version, timeout)
        mark(sh.targets.model, "go_live", t0, time.time(), version=version)
    except Exception as e:
        control.put(store, f"step/{version}/committed/{rank}", {"ok": False, "error": str(e).splitlines()[0],
                                                                 "stats": None})
        raise
    control.put(store, control.SHADOW_KEY.format(rank=rank), sh.info())
    control.put(store, f"step/{version}/committed/{rank}", {"ok": True, "error": "", "stats": stats})
    return stats


def trainer_go_live(store, deployments, version: int, *, timeout: float) -> dict:
    """The trainer engine's commit with shadow targets: wait (at most ``timeout`` seconds) until
    every worker of every deployment in ``deployments`` published :data:`READY_KEY` ok for
    ``version`` -- raising :class:`weight_transfer.control.protocol.GoLiveNotStarted` otherwise, so the
    update fails with nothing live touched --, then the go-live of each deployment: the
    client's ``go_live(version)`` (:meth:`AsyncLLMClient.go_live`: go-live, label and prefix
    reset in one between-steps window), a server's (:func:`http_go_live`), or, for another
    client, ``update_weights`` then ``finish_weight_update(str(version))`` (the label lags the
    go-live by one round trip).
    Returns ``{"ready_wait_s", "go_live_s", "rebuild_s", "engines"}`` (seconds)."""
    from weight_transfer.control import protocol as control

    t0 = time.perf_counter()
    keys = {r: READY_KEY.format(version=version, rank=r) for d in deployments for r in d.ranks}
    try:
        control.wait_keys(store, keys, timeout=timeout, what=f"shadows of version {version} ready to go live")
    except Exception as e:
        raise control.GoLiveNotStarted(f"version {version}: {str(e).splitlines()[0]}") from e
    ready = {r: control.get(store, k) for r, k in keys.items()}
    bad = {r: x["error"] for r, x in ready.items() if not x["ok"]}
    if bad:
        r = min(bad)
        raise control.GoLiveNotStarted(f"inference {r}: {bad[r]}")
    t1 = time.perf_counter()
    for d in deployments:
        try:
            if hasattr(d.client, "go_live"):
                d.client.go_live(version)
            elif hasattr(d.client, "base_url"):  # vLLM's HTTPVLLMWeightSyncClient: a server
                http_go_live(d.client, version)
            else:
                d.client.update_weights({"version": version})
                d.client.finish_weight_update(weight_version=str(version))
        except Exception as e:
            raise RuntimeError(f"{d.who()}: go-live of version {version} failed: {str(e).splitlines()[0]}") from e
    return {"ready_wait_s": t1 - t0, "go_live_s": time.perf_counter() - t1,
            "rebuild_s": max((x.get("rebuild_s") or 0.0 for x in ready.values()), default=0.0),
            "engines": [d.first_rank for d in deployments]}


def http_go_live(client, version: int) -> dict:
    """The go-live through a vLLM server (``client``: vLLM's ``HTTPVLLMWeightSyncClient``, its
    ``base_url`` and ``timeout``; the server started with ``VLLM_SERVER_DEV_MODE=1``): one
    engine-core call over the dev route ``/collective_rpc``
    (:func:`weight_transfer.engines.vllm.backend.recover.go_live_http`): the workers' go-live, the
    label and the prefix reset (with running requests) between two engine steps. No
    ``/pause``: requests keep generating through the whole update, go-live included.
    Returns ``{"seconds", "engine_s", "reset"}``; :class:`~weight_transfer.engines.vllm.backend.recover.ServerError`
    with the server's own reason for a refused call."""
    from weight_transfer.engines.vllm.backend.recover import go_live_http

    return go_live_http(client.base_url, version, timeout=getattr(client, "timeout", 300))
