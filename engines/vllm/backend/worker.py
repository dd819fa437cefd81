"""The ``one_sided`` backend's worker engine (:mod:`weight_transfer.engines.vllm.backend.plugin`): one per
vLLM worker, built by vLLM from ``WeightTransferConfig(backend="one_sided")``. Once it reports,
stages, registers and publishes the worker's runtime tensors; per update it only checks, in the
store, that every training rank wrote the version, and commits it.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from weight_transfer.engines.vllm.backend.config import OneSidedInitInfo, OneSidedUpdateInfo, _first_line, engine_key
from weight_transfer.engines.vllm.trace.fp8 import layout_quant
from weight_transfer.engines.vllm.worker import (
    delta_apply,  # packed deltas: the landing region and the commit's scatter
)
from weight_transfer.engines.vllm.worker.state import (
    WorkerTargets,  # applies WT_VLLM_HIDE_AMX in the worker, before the model is built
)

__all__ = ["OneSidedWeightTransferEngine", "hf_config_dict", "worker_secret", "connect_worker", "SECRET_HOW"]

SECRET_HOW = ("set WEIGHT_TRANSFER_SECRET (the job secret, hex) or WEIGHT_TRANSFER_SECRET_FILE (a file only the vLLM "
              "server's user can read) in the vLLM server's environment, or make the init info's secret_file (written "
              "by training rank 0) a file the vLLM server's user owns and alone can read (same user and host, or a "
              "shared home); docs/VLLM.md")
"""How a vLLM worker gets the job secret, for its errors (they reach the trainer through vLLM)."""


def worker_secret(init_info: OneSidedInitInfo, *, who: str):
    """The job secret this worker joins the store with: its own environment's
    (:meth:`weight_transfer.security.secret.JobSecret.from_env`) first, else the file the init info's
    ``secret_file`` names (:meth:`~weight_transfer.security.secret.JobSecret.from_file`: a regular file
    this user owns, mode 0600/0400). None under the opt-out (``WEIGHT_TRANSFER_INSECURE=1`` in
    the worker's environment). :class:`weight_transfer.security.secret.AuthenticationError` naming
    ``who``, ``WEIGHT_TRANSFER_SECRET`` and :data:`SECRET_HOW` when there is none, or when the
    variable or the file holds no secret or the file is not this user's alone. One line: it
    travels to the trainer in vLLM's error text."""
    from weight_transfer.security.secret import AuthenticationError, JobSecret, insecure_requested

    if insecure_requested():
        return None
    try:
        sec = JobSecret.from_env()
        if sec is None and init_info.secret_file:
            sec = JobSecret.from_file(init_info.secret_file)
    except ValueError as e:
        raise AuthenticationError(f"{who}: no usable job secret ({_first_line(e)}): {SECRET_HOW}") from None
    if sec is None:
        raise AuthenticationError(f"{who}: no job secret to join the control-plane store at {init_info.store_host}:"
                                  f"{init_info.store_port} (none in WEIGHT_TRANSFER_SECRET / WEIGHT_TRANSFER_SECRET_FILE,"
                                  " no secret_file in the init info): " + SECRET_HOW)
    return sec


def connect_worker(init_info: OneSidedInitInfo, *, who: str):
    """This worker's handle on the store (:func:`weight_transfer.api.connect_store` with
    :func:`worker_secret`). AuthenticationError (naming ``WEIGHT_TRANSFER_SECRET``) when it has
    no secret or not the store's; ControlError when no store answers within the timeout."""
    from weight_transfer.api import connect_store
    from weight_transfer.security.secret import AuthenticationError

    secret = worker_secret(init_info, who=who)
    addr = (init_info.store_host, init_info.store_port)
    try:
        return connect_store(addr, timeout=max(init_info.timeout, 60.0), secret=secret)
    except AuthenticationError as e:
        raise AuthenticationError(f"{who}: {str(e).splitlines()[0]}: is the vLLM server's WEIGHT_TRANSFER_SECRET the "
                                  f"job's? {SECRET_HOW}") from None


def check_draft(vllm_config, draft, who: str) -> None:
    """At init: the speculative-decoding draft this engine serves, if any, must be one the backend
    writes. RuntimeError, before anything is registered, for a draft that is not an MTP draft
    (EAGLE heads and separate draft models share the target's tensors by comparing weights at
    load time, which the planner does not trace yet: refused rather than served stale, C33), and
    for an engine whose draft vLLM's engine core did not hand over before the init
    (:func:`weight_transfer.engines.vllm.worker.draft_targets.attach_draft_rpc`: the ``one_sided``
    plugin must be loaded in the engine core)."""
    from weight_transfer.engines.vllm.trace.draft import draft_model_config
    from weight_transfer.engines.vllm.worker.draft_targets import draft_method

    method = draft_method(vllm_config)
    if method is None:
        return
    arch = (getattr(draft_model_config(vllm_config).hf_config, "architectures", None) or ["?"])[0]
    if "mtp" not in method:
        raise RuntimeError(f"{who}: this engine serves a speculative-decoding draft ({arch}, speculative_config method "
                           f"{method!r}): the one_sided backend writes MTP drafts (method 'mtp') with the target; an "
                           "EAGLE head or a separate draft model would stay at its old weights and its acceptance "
                           "would collapse (C33): start vLLM with an MTP draft or without --speculative-config")
    if draft is None:
        raise RuntimeError(f"{who}: this engine serves an MTP draft ({arch}) but vLLM's engine core did not hand it to "
                           "the one_sided engine before init_weight_transfer_engine (the one_sided plugin's engine-core "
                           "hook, weight_transfer.engines.vllm.backend.recover.install): is the plugin installed where the "
                           "engine core runs?")


def hf_config_dict(hf_config) -> dict:
    """The model's Hugging Face config as a dict, as vLLM holds it (``hf_config.to_dict()``), with
    each ``attribute_map`` alias added under its published name too: transformers 5 writes
    canonical names (``num_local_experts`` for Qwen3-MoE's ``num_experts``), the planner reads
    the published ``config.json`` names."""
    d = hf_config.to_dict()
    for alias, canon in (getattr(hf_config, "attribute_map", None) or {}).items():
        if canon in d and alias not in d:
            d[alias] = d[canon]
    return d


class OneSidedWeightTransferEngine(WeightTransferEngine[OneSidedInitInfo, OneSidedUpdateInfo]):
    """The worker engine (one per vLLM worker; vLLM builds it in ``Worker.load_model`` after
    ``process_weights_after_loading``). Passive on the data plane: the trainers write into its
    registered memory; per update it only checks and commits. See the module docstring.

    Attributes: :attr:`targets` (the :class:`~weight_transfer.engines.vllm.worker.state.WorkerTargets`
    of this worker, shared with ``WeightTransferExtension`` when both run), :attr:`layout` (the
    :class:`~weight_transfer.engines.vllm.worker.runtime.RuntimeLayout` published), :attr:`rank` (this
    worker's inference rank), :attr:`version` (the last version committed)."""

    init_info_cls = OneSidedInitInfo
    update_info_cls = OneSidedUpdateInfo
    supports_draft_weight_update = True
    """vLLM's flag: this engine writes a speculative-decoding draft (an MTP draft) -- with the
    target, in every update under one version (:meth:`attach_draft`), not in a draft session of
    its own (``start_draft_weight_update`` after init is refused, naming this)."""
    draft = None
    """The draft model vLLM serves beside the target (:meth:`attach_draft`), or None."""
    trace = None
    """This worker's :class:`~weight_transfer.plan.traced.LoaderTrace` (published at init)."""
    metrics = None
    """This worker's :class:`weight_transfer.metrics.WorkerMetrics` (set at init): its commits, go-lives,
    version and target bytes in vLLM's own ``/metrics`` (docs/METRICS.md)."""
    shadow = None
    """:class:`~weight_transfer.engines.vllm.worker.shadow.WorkerShadow` with ``shadow`` in the init info
    (set at init; a class attribute too, for engines built without ``__init__``)."""
    holder = None
    """``(host, port)`` of the store of the training run this worker is registered with (None: none)."""

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.tp_rank = self._tp_rank()
        self.local_rank = self._local_rank()
        self.targets = WorkerTargets(model, vllm_config, self.tp_rank)
        self.receiver = None
        self.layout = None
        self.rank: int | None = None
        self.store = None
        self.version: int | None = None
        self.last_commit: dict | None = None
        self._active: int | None = None
        self.delta_landing = None
        self.shadow = None
        self.holder: tuple[str, int] | None = None  # the store of the training run this worker serves

    def _tp_rank(self) -> int:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:
            return 0

    def _local_rank(self) -> int:
        try:
            from vllm.distributed.parallel_state import get_world_group

            return int(get_world_group().rank_in_group)
        except Exception:
            return self.tp_rank

    def _who(self) -> str:
        return f"inference {self.rank if self.rank is not None else '?'} (vLLM worker pid {os.getpid()})"

    # ------------------------------------------------------------------ once
    def attach_draft(self, model: torch.nn.Module) -> None:
        """Take the speculative-decoding draft ``model`` that this worker serves beside the
        target: the next
        :meth:`init_transfer_engine` reports, stages, registers and publishes its tensors with
        the target's (``draft.`` + vLLM's name), so every update writes both under one version.
        Called by vLLM's engine core in each worker right before the init
        (:func:`weight_transfer.engines.vllm.worker.draft_targets.attach_draft_rpc`). Idempotent for
        the same draft; RuntimeError while initialized (a registered layout does not change)."""
        if self.draft is model:
            return
        if self.receiver is not None:
            raise RuntimeError(f"{self._who()}: attach_draft while initialized; shutdown_weight_transfer_engine first")
        self.draft = model
        self.targets = WorkerTargets(self._default_model, self.vllm_config, self.tp_rank, draft=model)

    def init_transfer_engine(self, init_info: OneSidedInitInfo) -> None:
        """Report, stage, register once, publish (see the module docstring): the tensors are
        registered with the transport that fits their memory (:meth:`WorkerTargets.receive`).
        RuntimeError when already initialized by a training run whose store still answers (a
        run whose store is gone -- a killed trainer -- is released first, :meth:`_release_stale`) or for a
        parallel layout this backend does not plan (pipeline parallelism); ValueError, naming the
        tensor and its device, before anything is registered or published, for a tensor no
        configured transport can register (a CUDA tensor with ``transport="cma"``, a ``meta``
        tensor, tensors on two devices); :class:`weight_transfer.security.secret.AuthenticationError`
        naming ``WEIGHT_TRANSFER_SECRET`` when the worker has no job secret or not the store's
        (:func:`connect_worker`), before anything is registered."""
        from weight_transfer.control import protocol as control
        from weight_transfer.engines.vllm.worker.runtime import opaque_layers, post_processed_layers, runtime_layout
        from weight_transfer.types import InferenceLayout

        if self.receiver is not None:
            self._release_stale(init_info)
        pc = self.parallel_config
        if getattr(pc, "pipeline_parallel_size", 1) != 1:
            raise RuntimeError(f"{self._who()}: pipeline_parallel_size={pc.pipeline_parallel_size}: the one_sided "
                               "backend plans tensor/expert/data-parallel layouts only")
        dp_index = int(getattr(pc, "data_parallel_index", 0) or 0)
        rank = init_info.first_rank + dp_index * int(pc.world_size) + self.local_rank
        self.rank = rank
        check_draft(self.vllm_config, self.draft, self._who())  # before anything is registered
        store = connect_worker(init_info, who=self._who())
        from weight_transfer.engines.vllm.trace.publish import publish_trace

        self.trace = publish_trace(store, rank, self.vllm_config)  # the loader's recipes (C29), before any publish
        report = self.targets.report()
        if init_info.targets != "direct" and not self.targets.staged:
            mods = (opaque_layers if init_info.targets == "auto" else post_processed_layers)(report)
            if mods:
                self.targets.stage(mods)
                report = self.targets.report()
        lay = runtime_layout(report, rank)
        if not lay.targets:
            raise RuntimeError(f"{self._who()}: no runtime tensor to write (every weight refused: "
                               f"{lay.refused[:3]})")
        mc = self.model_config
        try:  # vLLM's quantization and its config -> the layout's quant (trace_fp8.layout_quant)
            quant = layout_quant(getattr(mc, "quantization", None),
                                 getattr(mc.hf_config, "quantization_config", None) or {})
        except ValueError as e:
            if rank == init_info.first_rank:
                raise RuntimeError(f"{self._who()}: {e}: the one_sided backend plans BF16, block-FP8 ('fp8'), "
                                   "per-tensor FP8 ('fp8-tensor') or per-channel FP8 ('fp8-channel') weights") from None
            quant = None  # only the first worker describes the model

        def engine_info(rx) -> None:  # the deployment's first worker says what the model is (the plan's input)
            if rank != init_info.first_rank:
                return
            layout = InferenceLayout(tp=int(pc.tensor_parallel_size), dp=int(getattr(pc, "data_parallel_size", 1)),
                                     ep=bool(getattr(pc, "enable_expert_parallel", False)), quant=quant,
                                     dtype=str(mc.dtype).removeprefix("torch."),
                                     draft="mtp" if self.draft is not None else None)
            control.put(store, engine_key(init_info.first_rank), {
                "hf_config": hf_config_dict(mc.hf_config), "layout": layout,
                "name": str(getattr(mc, "served_model_name", None) or mc.model),
                "n_workers": int(pc.world_size) * int(getattr(pc, "data_parallel_size", 1)),
                "vllm": __import__("vllm").__version__, "transport": rx.transport.name})

        # one path for every transport: chosen from the tensors' memory (or the init info's), refused
        # naming the tensor and its device before anything is registered or published, one region of
        # one part per allocation, then published
        if init_info.shadow != "off":  # writes into a shadow, update_weights goes live (C27)
            from weight_transfer.engines.vllm.worker.shadow import receive_shadow

            self.shadow, rx = receive_shadow(self.targets, lay, init_info.shadow, rank=rank, store=store,
                                             transport=init_info.transport, timeout=max(init_info.timeout, 60.0),
                                             who=self._who(), before_publish=engine_info)
            lay = self.shadow.layout
        else:
            rx = self.targets.receive(lay, rank=rank, store=store, transport=init_info.transport,
                                      timeout=max(init_info.timeout, 60.0), who=self._who(), before_publish=engine_info)
        self.receiver, self.layout, self.store = rx, lay, store
        self.holder = (init_info.store_host, int(init_info.store_port))
        if self.shadow is None and rx.fingerprint_server is not None:  # verify=: staged bytes count once committed
            rx.fingerprint_server.before = self._staged_committed
        self.delta_landing = delta_apply.attach(self, rx, lay, store, rank, init_info.delta_landing)  # packed deltas
        from weight_transfer.metrics import WorkerMetrics

        self.metrics = WorkerMetrics(rank)  # this worker's side of every update, in vLLM's /metrics
        self.metrics.targets(sum(t.nbytes for t in lay.targets))

    # ------------------------------------------------------------------ per update
    def start_weight_update(self) -> None:
        """Begin an update: refuses (RuntimeError naming the tensor) when a destination tensor
        is no longer where it was registered (vLLM reloaded or rebuilt the layer since
        ``init_weight_transfer_engine``): no byte may be written there."""
        if self.receiver is None:
            raise RuntimeError(f"{self._who()}: init_weight_transfer_engine first")
        if self.model is not self._default_model:  # vLLM's start_draft_weight_update retargeted us
            raise RuntimeError(f"{self._who()}: start_draft_weight_update: the one_sided backend writes the draft "
                               f"({'registered' if self.draft is not None else 'none served'}) with the target in "
                               "every update, under one version; start_weight_update")
        if self.shadow is not None:
            from weight_transfer.engines.vllm.worker.shadow import start_shadow_update

            start_shadow_update(self.shadow, self.store, who=self._who())
            self._active = -1
            return
        tensors = self.targets.runtime_tensors()
        for t in self.layout.targets:
            now = tensors.get(t.name)
            if now is None or now.data_ptr() != t.data_ptr or now.numel() * now.element_size() != t.nbytes:
                where = "gone" if now is None else f"now {now.data_ptr():#x}+{now.numel() * now.element_size()}"
                raise RuntimeError(f"{self._who()}: the model's layout changed since init_weight_transfer_engine: "
                                   f"{t.name} was {t.data_ptr:#x}+{t.nbytes}, {where}; refusing the update "
                                   "(shutdown_weight_transfer_engine and init again)")
        self._active = -1

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """:meth:`receive_weights`; the base class's ``torch.accelerator.synchronize()`` only on
        an accelerator (it raises on a CPU-only host)."""
        info = self.parse_update_info(update_info)
        with (self.metrics.commit(info.version, stats=lambda: self.last_commit) if self.metrics is not None
              else contextlib.nullcontext()):  # timed and counted per worker (weight_transfer.metrics)
            self.receive_weights(info)
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: OneSidedUpdateInfo) -> None:
        """Commit version ``update_info.version``: check in the store, independently of the
        caller, that every training rank (:data:`weight_transfer.api.WORLD_KEY`) reported its
        writes of that version ``ok`` and that the update is the one being written, then re-run
        vLLM's post-processing for the staged layers (:meth:`WorkerTargets.commit`). Raises
        RuntimeError naming the training rank that did not report or failed (the weights are
        then not one version: vLLM must not label them ``v``)."""
        from weight_transfer.api import WORLD_KEY
        from weight_transfer.control import protocol as control

        if self.receiver is None:
            raise RuntimeError(f"{self._who()}: init_weight_transfer_engine first")
        v = update_info.version
        store = self.store
        refused = f"{self._who()}: update_weights(version={v}) refused"
        if not store.check([WORLD_KEY]):
            raise RuntimeError(f"{refused}: no coordinator published {WORLD_KEY!r}")
        n_train = control.get(store, WORLD_KEY)["n_train"]
        for r in range(n_train):
            key = f"step/{v}/done/{r}"
            if not store.check([key]):
                raise RuntimeError(f"{refused}: training {r} has not reported its writes of version {v} "
                                   f"(weights: {control.read_state(store)})")
            res = control.get(store, key)
            if not res["ok"]:
                raise RuntimeError(f"{refused}: training {r} failed: {res['error']}")
        if self.shadow is None:
            state = control.read_state(store)
            if state.state != "writing" or state.version != v:
                reason = control.get_text(store, "weights/reason") if store.check(["weights/reason"]) else ""
                raise RuntimeError(f"{refused}: the store says the weights are {state}, not 'writing {v}'"
                                   + (f" ({reason})" if reason and state.state == "incomplete" else ""))
        # packed delta records scattered into place, before the go-live/commit; without shadow targets
        # the staging arena's format-3 records are applied during the commit's copy of each staged layer
        # (with fingerprints every record is scattered first: the staging then holds the version's bytes)
        dstats = delta_apply.apply_delta(self, v, defer=self.shadow is None and bool(self.targets.staged)
                                         and not self._verifying())
        if self.shadow is not None:  # the go-live, between two engine steps
            from weight_transfer.engines.vllm.worker.shadow import shadow_go_live

            self.last_commit = shadow_go_live(self.shadow, store, v, rank=self.rank, timeout=self.timeout_s(),
                                              refused=refused)
            self.version, self._active = v, v
            return
        try:
            stats = (self.targets.commit(copy_in=delta_apply.copy_in(self)) if self.targets.staged
                     else {"seconds": 0.0, "layers": 0, "bytes": 0})
        except Exception as e:
            control.put(store, f"step/{v}/committed/{self.rank}", {"ok": False, "error": _first_line(e), "stats": None})
            raise
        stats = delta_apply.finish(self, v, {**stats, **dstats})
        self.committed_version = v  # the staged layers hold version v's bytes as vLLM computes with them
        control.put(store, f"step/{v}/committed/{self.rank}", {"ok": True, "error": "", "stats": stats})
        self.version, self.last_commit, self._active = v, stats, v

    def _verifying(self) -> bool:
        """Whether the coordinator runs fingerprints (``plan/verify``, read once)."""
        if getattr(self, "_verify_mode", None) is None:
            from weight_transfer.control.fingerprint import verify_options

            self._verify_mode = "off"
            try:
                o = verify_options(self.store)
                self._verify_mode = o.mode if o is not None else "off"
            except Exception:
                self._verify_mode = None  # asked again at the next update
                return False
        return self._verify_mode != "off"

    def _staged_committed(self, version: int, offsets, lengths) -> None:
        """The fingerprint server's check before hashing (:class:`weight_transfer.control.fingerprint.FingerprintServer`):
        a requested range of a staged layer (a ``"copy"`` layer's staging tensor, an ``"in_place"``
        layer's weight whose kernel handle vLLM rebuilds) stands for what vLLM computes with only
        once ``update_weights`` committed that version (vLLM's post-processing re-run);
        RuntimeError naming the layer and the last committed version otherwise (a skipped or
        failed commit)."""
        if getattr(self, "committed_version", None) == version:
            return
        from weight_transfer.engines.vllm.worker.state import STAGING_SUFFIX

        lay = self.layout
        for t in lay.targets:  # staged "copy" layers (their staging tensors) and "in_place" ones (handles rebuilt)
            if not t.staged:
                continue
            lo = t.data_ptr - lay.base
            hit = (offsets < lo + t.nbytes) & (offsets + lengths > lo)
            if hit.any():
                raise RuntimeError(f"staged {t.name.removesuffix(STAGING_SUFFIX)} was not committed for version "
                                   f"{version} (last commit: {getattr(self, 'committed_version', None)}): "
                                   "update_weights did not run vLLM's post-processing of its bytes")

    def timeout_s(self) -> float:
        """Seconds a go-live may wait for the staged layers' rebuild (the store's timeout)."""
        from weight_transfer.engines.vllm.worker.shadow import store_timeout

        return store_timeout(self.store)

    def finish_weight_update(self) -> None:
        """Bookkeeping only (vLLM sets the weight version after this returns)."""
        self._active = None

    def _release_stale(self, init_info: OneSidedInitInfo) -> None:
        """``init_weight_transfer_engine`` while initialized: when the previous trainer's store no
        longer answers (a trainer killed without ``shutdown_weight_transfer_engine``), release
        its registration (:meth:`shutdown`) and go on as a fresh server would; otherwise
        RuntimeError naming the trainer still attached and the way out (C32)."""
        from weight_transfer.engines.vllm.backend.config import store_alive

        old = self.holder
        if old is not None and not store_alive(*old):
            import sys

            print(f"[{self._who()}] released the registration of a training run that is gone (its store at "
                  f"{old[0]}:{old[1]} does not answer)", file=sys.stderr, flush=True)
            self.shutdown()
            return
        where = f" (its store at {old[0]}:{old[1]} answers)" if old is not None else ""
        raise RuntimeError(f"{self._who()}: the one_sided engine is initialized already by another training run"
                           f"{where}; that run's destroy()/shutdown_weight_transfer_engine releases it, or "
                           "`weight-transfer vllm-recover --url URL --force` (docs/VLLM.md, Recovering a server)")

    def shutdown(self) -> None:
        """Return this worker to the state of a fresh server (C32; idempotent): the registration
        released (waits for a sender's batch in flight), the landing region of packed deltas, the
        shadow targets (their rebuild thread stopped; parameters a flip re-pointed into the
        shadow region get private memory, so the region is freed), the staging of opaque layers
        (made again at the next init) and every per-run counter. The live weights stay what they
        are (the last version that went live)."""
        rx, self.receiver = self.receiver, None
        delta_apply.close(self)
        if rx is not None:
            rx.close()
        self.targets.release()
        sh, self.shadow = self.shadow, None
        if sh is not None:
            sh.close()
        self.targets.unstage()
        self.layout, self.store, self._active, self.holder = None, None, None, None
        self.version, self.last_commit, self.delta_landing = None, None, None
        self.committed_version, self._verify_mode, self.trace = None, None, None
