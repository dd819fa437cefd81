"""``one_sided``: the reference as a backend of vLLM's own weight-transfer API.

vLLM 0.32 (``vllm/distributed/weight_transfer``) splits a weight sync into a **worker engine**,
built inside every vLLM worker from ``WeightTransferConfig(backend=...)``, and a **trainer
engine** built in every training process, which drives the inference side through a
four-method client (``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``: the offline ``LLM``, ``AsyncLLM``, the HTTP
routes). This module registers both under :data:`BACKEND` (``register()``, idempotent; the
``vllm.general_plugins`` entry point in pyproject.toml runs it in every vLLM process)::

    # inference: an unmodified vLLM
    llm = LLM(model_dir, weight_transfer_config={"backend": "one_sided"})
    #   or: VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
    #           --weight-transfer-config '{"backend": "one_sided"}'

    # every training rank (FSDP2 module: DTensors; world_size 1: plain tensors too)
    from weight_transfer.engines.vllm.backend import OneSidedTrainerInitInfo, LLMClient
    info = OneSidedTrainerInitInfo(rank=rank, world_size=world)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm),   # or HTTPVLLMWeightSyncClient(url)
                                                    source=ModuleSource(model))
    for step in ...:
        loss.backward(); optimizer.step()
        eng.send_weights()            # every rank; version 1, 2, ... (or send_weights(version=v))

What happens (the reference's protocol, :mod:`weight_transfer.api`):

- ``trainer_init``: training rank 0 starts the control-plane store (``store_port=0``: a free
  port, broadcast to the other ranks over the default process group) and calls
  ``client.init_weight_transfer_engine`` with :class:`OneSidedInitInfo` (the side channel: the
  store's address; vLLM's API has no return path). In every worker,
  :meth:`OneSidedWeightTransferEngine.init_transfer_engine` reports the runtime tensors (after
  ``process_weights_after_loading``), stages the layers vLLM keeps opaque (oneDNN handles on CPUs
  without AMX: C22), registers the destination tensors once with the transport that fits their
  memory (``cma`` for host memory, ``cuda_ipc`` for a CUDA vLLM's GPU memory, or the init info's
  ``transport``: one region of one part per allocation,
  :meth:`~weight_transfer.engines.vllm.worker_state.WorkerTargets.receive`; a tensor no
  configured transport can register is refused here, naming it and its device) and publishes its
  descriptor, destination metadata and :class:`~weight_transfer.engines.vllm.runtime.RuntimeLayout`;
  worker 0 also publishes the HF config and layout (:data:`weight_transfer.api.ENGINE_KEY`).
  Rank 0 then builds the :class:`weight_transfer.api.Coordinator` (model and layout from the
  engine), every rank its :class:`weight_transfer.api.Sender`, and the plan is made once against
  the runtime layout: what cannot be targeted is refused here, in the trainer, naming the
  tensor and vLLM's step (:class:`weight_transfer.plan.PlanError`).
- ``send_weights``: every rank ``Sender.push(v)``, a collective call: every rank says it is
  ready, the coordinator (rank 0) takes one decision for all of them -- a refusal every rank
  raises alike before any byte moves and before any engine is touched (VersionError for a
  version that does not increase, a repeated one included; TypeError for a non-int version;
  ValueError for ranks asking for different versions) or "go". On "go" rank 0 calls
  ``client.start_weight_update()``, says "go", every rank writes its part one-sidedly into the
  workers' memory, and once every write completed rank 0 calls
  ``client.update_weights({"version": v})`` -- each worker checks in the store, on its own, that
  every training rank reported ``ok`` for ``v``, then re-runs vLLM's post-processing for its
  staged layers -- and ``client.finish_weight_update(weight_version=str(v))``: vLLM labels
  outputs ``v``. Only then is ``complete v`` published in the store.
- A failed update (a training rank raising or dying mid-update, a vLLM worker dying, a commit
  failing): every training rank raises ControlError naming role, rank and cause within the
  control timeout (a rank that raised keeps taking part in the update's remaining
  ``full_tensor()`` collectives, so no rank is left blocked in one; a rank that was *killed*
  cannot, and the survivors' writer thread may then stay blocked in your own process group,
  whose timeout the library does not own); the store says ``incomplete v``, the workers refuse
  ``update_weights(v)`` (naming the rank), and vLLM's weight version becomes :data:`INCOMPLETE`
  (``"incomplete:v"``) on every engine whose update began, never ``v`` and never the old label
  over mixed bytes (C14); a later update restores a complete version.

- Engines joining and dying between updates (C24): :meth:`OneSidedTrainerEngine.add_engine`
  (rank 0) initializes another engine's workers at the next inference ranks; the coordinator
  replans for the new membership before the next "go" and that update is the newcomer's first.
  A vLLM worker dying mid-update fails that update naming ``inference rank(s) [r] gone``; the
  next update drives only the engines still in the coordinator's membership
  (:meth:`OneSidedTrainerEngine.active`).

Trainer processes need no accelerator with a CPU vLLM (``cma``); with a CUDA vLLM on their host
(``cuda_ipc``) they need CUDA to open the workers' IPC handles (not run on a GPU yet: docs/GPU.md).
The workers run vLLM's own code only (nothing patched). The prefix cache: vLLM keeps KV blocks computed with the old weights; the
client adapters here (:class:`LLMClient`, :class:`AsyncLLMClient`) reset it at
``finish_weight_update``; over HTTP call ``/reset_prefix_cache`` (or pause with ``clear_cache``).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import operator
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.base import ParamMeta as VllmParamMeta

from . import delta_apply  # packed deltas: the landing region and the commit's scatter
from .worker_state import WorkerTargets  # applies WT_VLLM_HIDE_AMX in the worker, before the model is built

__all__ = ["BACKEND", "INCOMPLETE", "GO_LIVE_UTILITY", "register", "OneSidedInitInfo", "OneSidedUpdateInfo",
           "OneSidedWeightTransferEngine", "OneSidedTrainerInitInfo", "OneSidedTrainerEngine", "DTensorSource",
           "LLMClient", "AsyncLLMClient", "Deployment", "engine_key", "transfer_options", "hf_config_dict"]

BACKEND = "one_sided"
"""The name both vLLM registries know this backend by (``weight_transfer_config={"backend": BACKEND}``)."""
INCOMPLETE = "incomplete:{version}"
"""vLLM's weight version after a failed update to ``version``: the bytes are a mix, so no
complete version is present (C14); outputs carry this label until a later update completes."""
TARGETS = ("auto", "staged", "direct")
"""As :data:`weight_transfer.engines.vllm.engine.TARGETS`."""


def register() -> None:
    """Register :data:`BACKEND` in ``WeightTransferEngineFactory`` and
    ``WeightTransferTrainerFactory``, and give vLLM's ``EngineCore`` the utility
    :data:`GO_LIVE_UTILITY` (:func:`_engine_core_go_live`). Idempotent (vLLM runs general plugins
    once per process -- driver, engine core, workers --, and importing this module registers too)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    try:  # never let the utility stop the plugin (and so vLLM's process) from loading
        from vllm.v1.engine.core import EngineCore

        if not hasattr(EngineCore, GO_LIVE_UTILITY):
            setattr(EngineCore, GO_LIVE_UTILITY, _engine_core_go_live)
    except Exception as e:  # the shadow go-live then says the utility is missing
        print(f"one_sided: could not add {GO_LIVE_UTILITY} to vLLM's EngineCore: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)

    for factory, cls in ((WeightTransferEngineFactory, OneSidedWeightTransferEngine),
                         (WeightTransferTrainerFactory, OneSidedTrainerEngine)):
        if BACKEND in getattr(factory, "_registry", {}):
            continue
        try:
            factory.register_engine(BACKEND, cls)
        except ValueError:  # registered meanwhile (another thread): the same class
            pass


GO_LIVE_UTILITY = "wt_go_live"
"""The engine-core utility (``engine_core.call_utility_async(GO_LIVE_UTILITY, version, reset)``)
that makes a shadow update live (C27), added to vLLM's ``EngineCore`` by :func:`register`."""


def _engine_core_go_live(self, version: int, reset: bool = True) -> dict:
    """Run in vLLM's engine core as one utility call, i.e. between two engine steps and before
    the next: the workers' go-live (``update_weights({"version"})``: every worker's shadow
    becomes live), the end of the update session, the weight version label, and (``reset``) the
    prefix-cache reset with ``reset_running_requests`` (kept requests re-prefill under the new
    weights: no KV computed with the old ones is used after the go-live, C21/C23). Separate
    client calls would let steps run between them -- new weights under the old label, or new
    weights on old KV. A worker's failure raises here before the label changes. Returns
    ``{"seconds", "reset"}``.

    Why a utility of our own: vLLM 0.32 sets the label in ``AsyncLLM.finish_weight_update`` after
    the workers' RPC returned, a separate engine-core request (``set_weight_version``)."""
    t0 = time.perf_counter()
    self.collective_rpc("update_weights", kwargs={"update_info": {"version": int(version)}})
    self.collective_rpc("finish_weight_update")
    self.set_weight_version(str(version))
    ok = self.reset_prefix_cache(reset_running_requests=True) if reset else True
    return {"seconds": time.perf_counter() - t0, "reset": bool(ok)}


def engine_key(first_rank: int) -> str:
    """Store key under which the worker at inference rank ``first_rank`` of a deployment says
    what it serves (``{"hf_config", "layout", "name", "n_workers", "vllm"}``):
    :data:`weight_transfer.api.ENGINE_KEY` for the first deployment (``first_rank`` 0: the
    coordinator plans from it), ``ENGINE_KEY/{first_rank}`` for one that joins later
    (:meth:`OneSidedTrainerEngine.add_engine` checks it serves the same model and layout)."""
    from weight_transfer.api import ENGINE_KEY

    return ENGINE_KEY if first_rank == 0 else f"{ENGINE_KEY}/{first_rank}"


def _first_line(e: BaseException) -> str:
    s = str(e)
    return f"{type(e).__name__}: {s.splitlines()[0]}" if s else type(e).__name__


# ============================================================================ worker side


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



@dataclass
class OneSidedInitInfo(WeightTransferInitInfo):
    """What training rank 0 hands every worker (``init_weight_transfer_engine(init_info)``):
    the side channel vLLM's API lacks.

    ``store_host`` / ``store_port``: the control-plane store (a ``TCPStore`` in training rank 0)
    the worker connects to and publishes its region descriptor, destination metadata and
    runtime layout in; ``first_rank``: the inference rank of this deployment's worker 0 (worker
    ``w`` of data-parallel replica ``d`` is inference rank ``first_rank + d * world_size + w``);
    ``targets``: ``"auto"`` (staged only where vLLM keeps the runtime bytes opaque), ``"staged"``
    (every post-processed layer staged) or ``"direct"`` (nothing staged: opaque layers are refused
    at plan time), as :class:`weight_transfer.engines.vllm.VllmEngine`; ``transport``: the data
    plane the trainers write with: ``"auto"`` (the worker chooses from its tensors' memory:
    ``cma`` for host memory, ``cuda_ipc`` for CUDA memory on one host,
    :func:`~weight_transfer.engines.vllm.worker_state.choose_transport`) or a transport's name
    (``"nixl"`` for trainers on other hosts; refused at init, naming the tensor and its device,
    when it cannot register the worker's tensors); the trainer engine passes its options'
    transport (``auto`` unless set) and its senders follow the workers' choice; ``timeout``:
    seconds a store call may block; ``shadow``: ``"off"``, ``"copy"`` or ``"flip"`` -- shadow
    targets (C27, :mod:`weight_transfer.engines.vllm.shadow`): the writes land in a shadow while
    vLLM keeps generating, ``update_weights`` is the go-live; ``"auto"``: flip where every direct
    target is a parameter vLLM reads at call time, copy otherwise (said on stderr). ValueError (vLLM's
    ``parse_init_info`` passes it on) for a bad value."""

    store_host: str
    store_port: int
    first_rank: int = 0
    targets: str = "auto"
    transport: str = "auto"
    timeout: float = 120.0
    shadow: str = "off"
    delta_landing: float = 0.0
    """Packed delta updates: register a landing region of this fraction of the worker's target
    bytes (:mod:`weight_transfer.engines.vllm.delta_apply`); 0: none."""

    def __post_init__(self):
        if not isinstance(self.store_host, str) or not self.store_host:
            raise ValueError(f"store_host={self.store_host!r}: a host name or address")
        if not isinstance(self.store_port, int) or not 0 < self.store_port < 65536:
            raise ValueError(f"store_port={self.store_port!r}: a TCP port 1..65535")
        if not isinstance(self.first_rank, int) or self.first_rank < 0:
            raise ValueError(f"first_rank={self.first_rank!r}: an inference rank >= 0")
        if self.targets not in TARGETS:
            raise ValueError(f"targets={self.targets!r}: one of {', '.join(TARGETS)}")
        from weight_transfer.transport import TRANSPORTS

        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: 'auto' or one of {', '.join(sorted(TRANSPORTS))}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r}: seconds > 0")
        from weight_transfer.shadow import check_mode

        if self.shadow != "auto":  # auto: each worker picks flip where it can, else copy (engines/vllm/shadow.py)
            check_mode(self.shadow, where="shadow")


@dataclass
class OneSidedUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights(update_info={"version": v})``: commit the update to version ``v``
    (whose bytes the trainers wrote one-sidedly)."""

    version: int

    def __post_init__(self):
        try:
            self.version = int(self.version)
        except (TypeError, ValueError):
            raise ValueError(f"version={self.version!r}: an int") from None


class OneSidedWeightTransferEngine(WeightTransferEngine[OneSidedInitInfo, OneSidedUpdateInfo]):
    """The worker engine (one per vLLM worker; vLLM builds it in ``Worker.load_model`` after
    ``process_weights_after_loading``). Passive on the data plane: the trainers write into its
    registered memory; per update it only checks and commits. See the module docstring.

    Attributes: :attr:`targets` (the :class:`~weight_transfer.engines.vllm.worker_state.WorkerTargets`
    of this worker, shared with ``WeightTransferExtension`` when both run), :attr:`layout` (the
    :class:`~weight_transfer.engines.vllm.runtime.RuntimeLayout` published), :attr:`rank` (this
    worker's inference rank), :attr:`version` (the last version committed)."""

    init_info_cls = OneSidedInitInfo
    update_info_cls = OneSidedUpdateInfo
    supports_draft_weight_update = False  # a draft model's memory is not registered
    trace = None
    """This worker's :class:`~weight_transfer.plan.traced.LoaderTrace` (published at init)."""
    shadow = None
    """:class:`~weight_transfer.engines.vllm.shadow.WorkerShadow` with ``shadow`` in the init info
    (set at init; a class attribute too, for engines built without ``__init__``)."""

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
    def init_transfer_engine(self, init_info: OneSidedInitInfo) -> None:
        """Report, stage, register once, publish (see the module docstring): the tensors are
        registered with the transport that fits their memory (:meth:`WorkerTargets.receive`).
        RuntimeError when already initialized (``shutdown_weight_transfer_engine`` first) or for a
        parallel layout this backend does not plan (pipeline parallelism); ValueError, naming the
        tensor and its device, before anything is registered or published, for a tensor no
        configured transport can register (a CUDA tensor with ``transport="cma"``, a ``meta``
        tensor, tensors on two devices)."""
        from weight_transfer import control
        from weight_transfer.api import connect_store
        from weight_transfer.types import InferenceLayout

        from .runtime import opaque_layers, post_processed_layers, runtime_layout

        if self.receiver is not None:
            raise RuntimeError(f"{self._who()}: the one_sided engine is initialized already; "
                               "shutdown_weight_transfer_engine first")
        pc = self.parallel_config
        if getattr(pc, "pipeline_parallel_size", 1) != 1:
            raise RuntimeError(f"{self._who()}: pipeline_parallel_size={pc.pipeline_parallel_size}: the one_sided "
                               "backend plans tensor/expert/data-parallel layouts only")
        dp_index = int(getattr(pc, "data_parallel_index", 0) or 0)
        rank = init_info.first_rank + dp_index * int(pc.world_size) + self.local_rank
        self.rank = rank
        store = connect_store((init_info.store_host, init_info.store_port), timeout=max(init_info.timeout, 60.0))
        from .trace import publish_trace

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
        quant = getattr(mc, "quantization", None)
        if rank == init_info.first_rank and quant not in (None, "fp8"):
            raise RuntimeError(f"{self._who()}: quantization={quant!r}: the one_sided backend plans BF16 "
                               "or block-FP8 ('fp8') weights")

        def engine_info(rx) -> None:  # the deployment's first worker says what the model is (the plan's input)
            if rank != init_info.first_rank:
                return
            layout = InferenceLayout(tp=int(pc.tensor_parallel_size), dp=int(getattr(pc, "data_parallel_size", 1)),
                                     ep=bool(getattr(pc, "enable_expert_parallel", False)), quant=quant,
                                     dtype=str(mc.dtype).removeprefix("torch."))
            control.put(store, engine_key(init_info.first_rank), {
                "hf_config": hf_config_dict(mc.hf_config), "layout": layout,
                "name": str(getattr(mc, "served_model_name", None) or mc.model),
                "n_workers": int(pc.world_size) * int(getattr(pc, "data_parallel_size", 1)),
                "vllm": __import__("vllm").__version__, "transport": rx.transport.name})

        # one path for every transport: chosen from the tensors' memory (or the init info's), refused
        # naming the tensor and its device before anything is registered or published, one region of
        # one part per allocation, then published
        if init_info.shadow != "off":  # writes into a shadow, update_weights goes live (C27)
            from .shadow import receive_shadow

            self.shadow, rx = receive_shadow(self.targets, lay, init_info.shadow, rank=rank, store=store,
                                             transport=init_info.transport, timeout=max(init_info.timeout, 60.0),
                                             who=self._who(), before_publish=engine_info)
            lay = self.shadow.layout
        else:
            rx = self.targets.receive(lay, rank=rank, store=store, transport=init_info.transport,
                                      timeout=max(init_info.timeout, 60.0), who=self._who(), before_publish=engine_info)
        self.receiver, self.layout, self.store = rx, lay, store
        self.delta_landing = delta_apply.attach(self, rx, lay, store, rank, init_info.delta_landing)  # packed deltas

    # ------------------------------------------------------------------ per update
    def start_weight_update(self) -> None:
        """Begin an update: refuses (RuntimeError naming the tensor) when a destination tensor
        is no longer where it was registered (vLLM reloaded or rebuilt the layer since
        ``init_weight_transfer_engine``): no byte may be written there."""
        if self.receiver is None:
            raise RuntimeError(f"{self._who()}: init_weight_transfer_engine first")
        if self.shadow is not None:
            from .shadow import start_shadow_update

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
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: OneSidedUpdateInfo) -> None:
        """Commit version ``update_info.version``: check in the store, independently of the
        caller, that every training rank (:data:`weight_transfer.api.WORLD_KEY`) reported its
        writes of that version ``ok`` and that the update is the one being written, then re-run
        vLLM's post-processing for the staged layers (:meth:`WorkerTargets.commit`). Raises
        RuntimeError naming the training rank that did not report or failed (the weights are
        then not one version: vLLM must not label them ``v``)."""
        from weight_transfer import control
        from weight_transfer.api import WORLD_KEY

        if self.receiver is None:
            raise RuntimeError(f"{self._who()}: init_weight_transfer_engine first")
        v = update_info.version
        store = self.store
        refused = f"{self._who()}: update_weights(version={v}) refused"
        if not store.check([WORLD_KEY]):
            raise RuntimeError(f"{refused}: no coordinator published {WORLD_KEY!r}")
        n_train = int(control.get(store, WORLD_KEY)["n_train"])
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
                reason = store.get("weights/reason").decode() if store.check(["weights/reason"]) else ""
                raise RuntimeError(f"{refused}: the store says the weights are {state}, not 'writing {v}'"
                                   + (f" ({reason})" if reason and state.state == "incomplete" else ""))
        dstats = delta_apply.apply_delta(self, v)  # packed delta records scattered into place, before the go-live/commit
        if self.shadow is not None:  # the go-live, between two engine steps
            from .shadow import shadow_go_live

            self.last_commit = shadow_go_live(self.shadow, store, v, rank=self.rank, timeout=self.timeout_s(),
                                              refused=refused)
            self.version, self._active = v, v
            return
        try:
            stats = self.targets.commit() if self.targets.staged else {"seconds": 0.0, "layers": 0, "bytes": 0}
        except Exception as e:
            control.put(store, f"step/{v}/committed/{self.rank}", {"ok": False, "error": _first_line(e), "stats": None})
            raise
        stats = {**stats, **dstats}
        control.put(store, f"step/{v}/committed/{self.rank}", {"ok": True, "error": "", "stats": stats})
        self.version, self.last_commit, self._active = v, stats, v

    def timeout_s(self) -> float:
        """Seconds a go-live may wait for the staged layers' rebuild (the store's timeout)."""
        from .shadow import store_timeout

        return store_timeout(self.store)

    def finish_weight_update(self) -> None:
        """Bookkeeping only (vLLM sets the weight version after this returns)."""
        self._active = None

    def shutdown(self) -> None:
        """Release the registration (waits for a sender's batch in flight); idempotent. The
        staging tensors stay (vLLM's post-processing reads them only at a commit)."""
        rx, self.receiver = self.receiver, None
        delta_apply.close(self)
        if rx is not None:
            rx.close()
        self.targets.release()
        self.layout, self.store, self._active = None, None, None


# ============================================================================ trainer side


class DTensorSource(WeightSource):
    """A ``WeightSource`` over a training rank's own parameters: an ``nn.Module`` (FSDP2:
    DTensors) or a mapping ``{checkpoint name: DTensor | tensor}``; ``views`` for training
    tensors that fuse several checkpoint tensors (transformers 5's fused experts: pass
    ``fused_expert_views({n: p.shape for n, p in model.named_parameters()}, config.model_type)``). The one-sided backend reads
    the shards in place (``to_local()``, ``full_tensor()`` only where a recipe needs rows of
    other ranks); iterating yields full tensors like vLLM's ``ModuleSource`` (a collective for
    DTensors), for other backends."""

    def __init__(self, params, *, views=None) -> None:
        if not isinstance(params, (torch.nn.Module, Mapping)):
            raise TypeError(f"DTensorSource: an nn.Module or a mapping name -> tensor, not {type(params).__name__}")
        if views is not None and not isinstance(views, Mapping):
            raise TypeError(f"DTensorSource: views is a mapping checkpoint name -> (tensor name, box), not "
                            f"{type(views).__name__}")
        self.params = params
        self.views = dict(views or {})
        """Checkpoint name -> (training tensor name, box): the checkpoint tensors a fused training
        tensor holds (:func:`weight_transfer.plan.traced.fused_expert_views`), C29."""

    def named(self) -> dict[str, torch.Tensor]:
        return dict(self.params.named_parameters()) if isinstance(self.params, torch.nn.Module) else dict(self.params)

    def metadata(self) -> list[VllmParamMeta]:
        return [VllmParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in self.named().items():
            yield n, materialize_full_tensor(t)


def _params_of(source):
    if isinstance(source, DTensorSource):
        return source.params
    if isinstance(source, ModuleSource):
        return source._module
    if source is None:
        raise TypeError("one_sided trainer_init: source= is required (ModuleSource(model) or DTensorSource(params))")
    raise TypeError(f"one_sided trainer_init: source {type(source).__name__} materializes full tensors; the one-sided "
                    "backend writes from the shards: pass ModuleSource(model) or DTensorSource(module_or_mapping)")


def transfer_options(options=None):
    """A :class:`weight_transfer.options.TransferOptions` from ``None`` (the defaults, with
    transport ``"auto"``: the vLLM workers choose from their tensors' memory and the senders
    follow), a ``TransferOptions`` (taken as it is), or a dict of flat overrides of those
    defaults (a leaf field's name, or its ``flat`` name: ``{"transport": "cma", "watermark":
    64 << 20, "timeout": 60}``). TypeError names an unknown key; ValueError comes from the
    options' own checks."""
    from weight_transfer.options import AUTO_TRANSPORT, TransferOptions, TransportOptions

    base = TransferOptions(transport=TransportOptions(name=AUTO_TRANSPORT))
    if options is None:
        return base
    if isinstance(options, TransferOptions):
        return options
    if not isinstance(options, Mapping):
        raise TypeError(f"options: a dict of TransferOptions overrides or a TransferOptions, not {type(options).__name__}")
    where: dict[str, tuple[str, str]] = {}
    for part in dataclasses.fields(base):
        for leaf in dataclasses.fields(getattr(base, part.name)):
            where[leaf.metadata.get("flat", leaf.name)] = (part.name, leaf.name)
    unknown = sorted(k for k in options if k not in where)
    if unknown:
        raise TypeError(f"options: no TransferOptions field {', '.join(map(repr, unknown))}; known: {', '.join(sorted(where))}")
    changes: dict[str, dict] = {}
    for k, v in options.items():
        part, leaf = where[k]
        changes.setdefault(part, {})[leaf] = v
    return dataclasses.replace(base, **{p: dataclasses.replace(getattr(base, p), **c) for p, c in changes.items()})


@dataclass
class OneSidedTrainerInitInfo(TrainerInitInfo):
    """Every training rank's init info (``WeightTransferTrainerFactory.trainer_init``).

    ``rank`` (keyword, from vLLM's base): this training rank; ``world_size``: training ranks
    (each calls ``trainer_init`` and ``send_weights``); ``store_host`` / ``store_port``: where
    training rank 0 starts the control-plane store and where the vLLM workers and other ranks
    reach it (``store_port=0``: a free port, sent to the other ranks with
    ``torch.distributed.broadcast_object_list`` over the default process group, which must exist
    when ``world_size > 1``); ``n_infer``: inference ranks (None: every worker of the engine the
    client drives, as it reports); ``options``: :func:`transfer_options` (a dict of flat
    ``TransferOptions`` overrides, a ``TransferOptions``, or None; the transport is ``"auto"``
    unless set: the workers choose it from their tensors' memory and every rank's sender writes
    with what they chose); ``timeout``: seconds any rank
    may take to answer (None: ``options``' control timeout); ``targets``: the workers' targets
    (:class:`OneSidedInitInfo`); ``shadow``: the workers' shadow targets (``"off"``, ``"copy"``,
    ``"flip"``, ``"auto"``; C27): with them no caller pauses generation, each update's commit is the
    go-live, sent with the weight version label and the prefix-cache reset in one window
    between two engine steps (:meth:`AsyncLLMClient.go_live`)."""

    backend: ClassVar[str] = BACKEND

    world_size: int = 1
    store_host: str = "127.0.0.1"
    store_port: int = 0
    n_infer: int | None = None
    options: Any = None
    timeout: float | None = None
    targets: str = "auto"
    shadow: str = "off"

    def __post_init__(self):
        from weight_transfer.shadow import check_mode

        if self.shadow != "auto":  # auto: each worker picks flip where it can, else copy (engines/vllm/shadow.py)
            check_mode(self.shadow, where="shadow")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r}: training ranks >= 1")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r}: 0 <= rank < world_size={self.world_size}")
        if not isinstance(self.store_port, int) or not 0 <= self.store_port < 65536:
            raise ValueError(f"store_port={self.store_port!r}: a TCP port (0: a free one)")
        if self.n_infer is not None and (not isinstance(self.n_infer, int) or self.n_infer < 1):
            raise ValueError(f"n_infer={self.n_infer!r}: inference ranks >= 1, or None (from the engine)")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r}: seconds > 0, or None")
        if self.targets not in TARGETS:
            raise ValueError(f"targets={self.targets!r}: one of {', '.join(TARGETS)}")
        transfer_options(self.options)  # unknown keys / bad values refused here, before any process is reached


@dataclass
class Deployment:
    """One vLLM engine (a ``LLM``, an ``AsyncLLM``, a server) the trainer engine updates:
    ``client`` (its ``VLLMWeightSyncClient``), ``first_rank`` (the inference rank of its worker
    0), ``n_workers`` (its workers: inference ranks ``first_rank .. first_rank + n_workers - 1``),
    ``since`` (the first version it takes part in; 1 for the engine of ``trainer_init``)."""

    client: Any
    first_rank: int
    n_workers: int
    since: int = 1

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.n_workers)

    def who(self) -> str:
        r = self.ranks
        ranks = f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}..{r[-1]}"
        return f"inference {ranks} ({type(self.client).__name__})"


class OneSidedTrainerEngine(TrainerWeightTransferEngine[OneSidedTrainerInitInfo]):
    """The trainer engine (one per training rank). Built by :meth:`trainer_init`; per update
    :meth:`send_weights`; rank 0 may add engines between updates (:meth:`add_engine`).
    Attributes: :attr:`sender` (this rank's :class:`weight_transfer.api.Sender`),
    :attr:`coordinator` (rank 0), :attr:`store`, :attr:`version` (the last version sent or
    attempted), :attr:`last_result` (rank 0: the last :class:`weight_transfer.api.UpdateResult`),
    :attr:`deployments` (rank 0: every engine added, :class:`Deployment`; those with a rank in
    the coordinator's membership are driven at each update, :meth:`active`)."""

    init_info_cls = OneSidedTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True, info: OneSidedTrainerInitInfo | None = None,
                 store=None, sender=None, coordinator=None, n_workers: int = 1) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info, self.store, self.sender, self.coordinator = info, store, sender, coordinator
        self.version = 0
        self.last_result = None
        self.deployments: list[Deployment] = [Deployment(client, 0, n_workers)] if is_sender else []

    @classmethod
    def trainer_init(cls, init_info: OneSidedTrainerInitInfo, *, client, source=None) -> OneSidedTrainerEngine:
        """Rendezvous (see the module docstring) and plan once. Raises RuntimeError naming the
        inference side when ``client.init_weight_transfer_engine`` fails (e.g. the server is
        not up), :class:`weight_transfer.plan.PlanError` naming a tensor the plan cannot
        target, ControlError when a rank does not answer within the timeout, TypeError for a
        ``source`` the backend cannot write from."""
        import torch.distributed as dist

        from weight_transfer import control
        from weight_transfer.api import ENGINE_KEY, Coordinator, Sender, connect_store, serve_store

        params = _params_of(source)
        opts = transfer_options(init_info.options)
        timeout = float(init_info.timeout if init_info.timeout is not None else opts.control.timeout)
        rank, world = init_info.rank, init_info.world_size
        host, port = init_info.store_host, init_info.store_port
        store = None
        if rank == 0:
            store = serve_store(host, port, timeout=max(timeout, 60.0))
            port = int(store.port)
        if world > 1 and init_info.store_port == 0:
            if not dist.is_initialized():
                raise RuntimeError(f"training {rank}: store_port=0 with world_size={world} needs the default process "
                                   "group to send rank 0's store address (or give store_port)")
            box = [(host, port)]
            dist.broadcast_object_list(box, src=0)
            host, port = box[0]
        if store is None:
            store = connect_store((host, port), timeout=max(timeout, 60.0))
        coordinator, n_workers = None, 1
        if rank == 0:
            try:
                _publish_sources(store, params, getattr(source, "views", None) or {})
                _init_inference(client, _worker_info(host, port, 0, init_info, opts, timeout))
                if not store.check([ENGINE_KEY]):
                    raise RuntimeError(f"training 0: init_weight_transfer_engine returned but no worker published "
                                       f"{ENGINE_KEY!r}: is the engine's backend {BACKEND!r}?")
                eng = control.get(store, ENGINE_KEY)
                n_workers = int(eng["n_workers"])
                n_infer = init_info.n_infer or n_workers
                coordinator = Coordinator(store, n_train=world, n_infer=n_infer, options=opts, timeout=timeout)
            except BaseException as e:
                store.set("abort", f"training 0: trainer_init failed: {_first_line(e)}".encode())  # other ranks stop
                raise
        sender = Sender(params, rank=rank, world_size=world, store=store, coordinator=coordinator, options=opts,
                        timeout=timeout, views=getattr(source, "views", None) or None)
        self = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info, store=store,
                   sender=sender, coordinator=coordinator, n_workers=n_workers)
        self._worker_addr, self._opts, self._timeout = (host, port), opts, timeout
        sender.plan()  # plan once, now: a refusal (PlanError naming the tensor and vLLM's step) reaches the trainer here
        return self

    # ------------------------------------------------------------------ membership (rank 0)
    def add_engine(self, client, *, first_rank: int | None = None) -> Deployment:
        """Rank 0, between updates: a vLLM engine joins (a new one, or a restarted one with
        fresh memory) -- another ``LLM`` or server started with the ``one_sided`` backend,
        driven by ``client`` (an :class:`LLMClient`, an :class:`AsyncLLMClient`, vLLM's
        ``HTTPVLLMWeightSyncClient``). Its workers register through
        ``client.init_weight_transfer_engine`` at inference ranks ``first_rank ..`` (None: after
        every rank used so far) and announce the join; the coordinator replans for the new
        membership before the next update's "go" (the training ranks follow the new plan
        epoch; none restarts), and that update is the newcomer's first: written in full, its
        weight version the update's. Returns the :class:`Deployment`.

        Raises RuntimeError naming the inference side when its init fails, ValueError when it
        serves another model or parallel layout than the first engine (its registration is
        then withdrawn: it is never planned in)."""
        from weight_transfer import control, membership
        from weight_transfer.api import ENGINE_KEY

        if not self.is_sender or self.coordinator is None:
            raise RuntimeError("add_engine: on training rank 0 (it hosts the coordinator) only")
        lay = self.coordinator.layout
        if lay.ep:
            raise ValueError("add_engine: the first engine is expert-parallel (experts sharded across its DP ranks): "
                             "a joining engine would be another EP group, which one plan does not cover")
        if first_rank is None:
            first_rank = max(r for d in self.deployments for r in d.ranks) + 1
        if first_rank % lay.tp:
            raise ValueError(f"add_engine: first_rank={first_rank}: a multiple of the engines' TP size {lay.tp} "
                             "(inference rank = replica * TP + TP rank)")
        used = {r for d in self.deployments for r in d.ranks if r in self.coordinator.members}
        if first_rank in used:
            raise ValueError(f"add_engine: first_rank={first_rank} is inference rank of a member engine "
                             f"(members: {sorted(used)})")
        host, port = self._worker_addr
        _init_inference(client, _worker_info(host, port, first_rank, self.info, self._opts, self._timeout))
        key = engine_key(first_rank)
        if not self.store.check([key]):
            raise RuntimeError(f"training 0: init_weight_transfer_engine returned but no worker published {key!r}: is "
                               f"the new engine's backend {BACKEND!r}?")
        new, first = control.get(self.store, key), control.get(self.store, ENGINE_KEY)
        dep = Deployment(client, first_rank, int(new["n_workers"]), since=self.version + 1)
        why = [f"{k}: {new.get(k)!r} != {first.get(k)!r}" for k in ("layout", "n_workers", "transport")
               if new.get(k) != first.get(k)]
        why += [f"hf_config[{k!r}]: {new['hf_config'].get(k)!r} != {v!r}" for k, v in first["hf_config"].items()
                if k not in ("_name_or_path", "name_or_path") and new["hf_config"].get(k) != v][:3]
        if why:
            for r in dep.ranks:  # its receivers published and announced a join: withdraw them before any plan
                membership.announce_leave(self.store, r)
            with contextlib.suppress(Exception):
                getattr(client, "shutdown_weight_transfer_engine", lambda: None)()
            raise ValueError(f"add_engine: {dep.who()} serves another model or layout than inference rank 0's: "
                             + "; ".join(why))
        # one plan covers every engine as data-parallel replicas of the first one's layout: room for the
        # newcomer's (the coordinator plans the members only, so replicas that left cost nothing)
        dp = max(lay.dp, (dep.ranks[-1] + 1 + lay.tp - 1) // lay.tp)
        if dp != lay.dp:
            self.coordinator.layout = dataclasses.replace(lay, dp=dp)
        self.deployments.append(dep)
        return dep

    def active(self) -> list[Deployment]:
        """The engines an update drives: each with a rank in the coordinator's membership.
        Called before the update's "go", after the coordinator followed the membership: an
        engine added since the last update is in it (its first update), one that died or left
        is not (dropped after the update it failed in, C24). An engine whose join the
        coordinator did not take is never started or committed (its bytes were not written)."""
        if self.coordinator is None:
            return list(self.deployments)
        members = self.coordinator.members
        return [d for d in self.deployments if any(r in members for r in d.ranks)]

    # ------------------------------------------------------------------ per update
    def send_weights(self, version: int | None = None):
        """One update, on every training rank: a collective call (see the module docstring)
        with :meth:`weight_transfer.api.Sender.push`'s contract. ``version``: an int (None: the
        last version attempted + 1, from 1). Returns this rank's
        :class:`weight_transfer.executor.StepStats` (rank 0: :attr:`last_result` holds the
        update's :class:`weight_transfer.api.UpdateResult`).

        Raises, on every training rank alike (one decision for all of them, C28):

        - before any byte moves (no engine is started, its bytes and weight version stay as
          they are, :attr:`version` is unchanged): VersionError when ``version`` does not
          increase (a repeated version included), TypeError when a rank's ``version`` is not an
          int, ValueError when the ranks asked for different versions;
        - ControlError when the update failed -- a training rank raising in any stage (on that
          rank the stage's exception is the ``__cause__``), a vLLM worker that died (``inference
          rank(s) [r] gone``; the next update drives the engines still alive), an engine's
          ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` failing, a rank
          that did not answer within the timeout -- naming role, rank and cause, after vLLM's
          weight version was set to :data:`INCOMPLETE` (rank 0) on every engine whose update
          began and that still answers. :attr:`version` is then the failed version, so the next
          default is above it (the coordinator refuses a failed version again)."""
        from weight_transfer.control import ControlError, VersionError

        v = self.version + 1 if version is None else version  # push checks it (TypeError on every rank alike)
        started: list[Deployment] = []

        def before_go(ver: int) -> None:  # after the decision "go" and the membership: only live engines
            deps = self.active()
            for d in deps:
                try:
                    d.client.start_weight_update()
                except Exception as e:
                    why = f"{d.who()}: start_weight_update failed: {_first_line(e)}"
                    if len(deps) == 1:
                        self.store.set("abort", why.encode())  # the only engine: this trainer engine is done
                    raise RuntimeError(f"training 0: {why}") from e
                started.append(d)

        def commit(ver: int) -> dict:
            if self.info is not None and self.info.shadow not in (None, "off"):
                from .shadow import trainer_go_live

                return trainer_go_live(self.store, started, ver, timeout=self._timeout)
            t0 = time.perf_counter()
            for d in started:
                try:
                    d.client.update_weights({"version": ver})
                except Exception as e:
                    raise RuntimeError(f"{d.who()}: update_weights(version={ver}) failed: {_first_line(e)}") from e
            t1 = time.perf_counter()
            for d in started:
                try:
                    d.client.finish_weight_update(weight_version=str(ver))
                except Exception as e:
                    raise RuntimeError(f"{d.who()}: finish_weight_update failed: {_first_line(e)}") from e
            return {"update_weights_s": t1 - t0, "finish_weight_update_s": time.perf_counter() - t1,
                    "engines": [d.first_rank for d in started]}

        try:
            if self.is_sender:
                stats = self.sender.push(v, commit=commit, before_go=before_go)
            else:
                stats = self.sender.push(v)
        except BaseException as e:
            if isinstance(e, ControlError) and not isinstance(e, VersionError) and isinstance(v, int):
                self.version = max(self.version, int(v))  # a failed update: the next default is above it
            if self._served_intact():  # shadow targets, failed before any go-live: the label stays
                self._close_sessions(started)
            else:
                self._mark_incomplete(v, started)  # only engines whose update began (none for a refusal)
            raise
        self.version = operator.index(v)
        if self.is_sender:
            self.last_result = self.sender.last_update
        return stats

    def _served_intact(self) -> bool:
        """With shadow targets: the store still says ``complete`` (the update failed before any
        go-live, so every engine serves the last complete version untouched)."""
        if self.info is None or self.info.shadow in (None, "off") or self.store is None:
            return False
        from weight_transfer.control import read_state

        try:
            return read_state(self.store).complete
        except Exception:
            return False

    def _close_sessions(self, deps: list[Deployment]) -> None:
        """Close the update session of every engine in ``deps`` without changing its weight
        version (``finish_weight_update()``); one that does not answer is said on stderr."""
        for d in deps:
            try:
                d.client.finish_weight_update()
            except Exception as e:
                print(f"[rank 0] one_sided: could not close the update session of {d.who()}: {_first_line(e)}",
                      file=sys.stderr, flush=True)

    def _mark_incomplete(self, v: int, deps: list[Deployment]) -> None:
        """After a failed update: vLLM's weight version :data:`INCOMPLETE` on every engine whose
        update began (``deps``), closing its update session whether or not its workers closed it
        (their ``update_weights`` raising closes it). An engine that does not answer (dead) is
        said on stderr; the caller gets the update's own error."""
        label = INCOMPLETE.format(version=v)
        for d in deps:
            try:
                d.client.finish_weight_update(weight_version=label)
                continue
            except Exception:
                pass
            try:
                d.client.start_weight_update()
                d.client.finish_weight_update(weight_version=label)
            except Exception as e:
                print(f"[rank 0] one_sided: could not set the weight version of {d.who()} to {label!r}: "
                      f"{_first_line(e)}", file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        """Release this rank's transport (rank 0: and tell every rank the job ends)."""
        if self.sender is not None:
            self.sender.close()
        if self.coordinator is not None:
            self.coordinator.shutdown()


def _publish_sources(store, params, views) -> None:
    """Training rank 0's checkpoint names, global shapes and dtypes (fused tensors replaced by
    the checkpoint tensors their ``views`` hold), for the workers to trace their loader with
    (:data:`weight_transfer.plan.traced.SOURCES_KEY`, C29)."""
    from weight_transfer import control
    from weight_transfer.plan.traced import SOURCES_KEY, expand_sources

    named = dict(params.named_parameters()) if isinstance(params, torch.nn.Module) else dict(params)
    held = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named.items()}
    control.put(store, SOURCES_KEY, expand_sources(held, views))


def _worker_info(host: str, port: int, first_rank: int, info: OneSidedTrainerInitInfo, opts, timeout: float) -> dict:
    """The :class:`OneSidedInitInfo` (as a dict) rank 0 hands one engine's workers."""
    return {"store_host": host, "store_port": port, "first_rank": first_rank, "targets": info.targets,
            "transport": opts.transport.name, "timeout": timeout, "shadow": info.shadow or "off",
            "delta_landing": opts.executor.delta_landing if opts.executor.delta and opts.executor.delta_mode != "scattered" else 0.0}


def _init_inference(client, worker_info: dict) -> None:
    """``client.init_weight_transfer_engine(worker_info)``; RuntimeError naming the inference
    side and what to check when it fails (e.g. the server is not up yet)."""
    try:
        client.init_weight_transfer_engine(worker_info)
    except Exception as e:
        first = worker_info["first_rank"]
        raise RuntimeError(
            f"training 0: the inference side{f' at rank {first}' if first else ''} did not initialize the "
            f"{BACKEND!r} backend (client.init_weight_transfer_engine via {type(client).__name__}): {_first_line(e)}. "
            "Is vLLM up and started with weight_transfer_config={'backend': 'one_sided'} "
            "(server: --weight-transfer-config '{\"backend\": \"one_sided\"}', VLLM_SERVER_DEV_MODE=1)?"
        ) from e


# ============================================================================ clients


class LLMClient:
    """A ``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` in this process (vLLM ships HTTP
    and Ray clients only): each call is the ``LLM`` method of the same name.
    ``finish_weight_update`` also resets the prefix cache (``reset_prefix_cache``: cached KV
    blocks were computed with the old weights, C21) unless ``reset_prefix_cache=False`` or no
    weight version is given (a session closed with the weights unchanged)."""

    def __init__(self, llm, *, reset_prefix_cache: bool = True) -> None:
        self.llm, self.reset = llm, reset_prefix_cache

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        if weight_version is None:  # a session closed with the weights unchanged (shadow, failed before go-live)
            return
        if self.reset and self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused to reset the prefix cache after the update")

    def go_live(self, version: int) -> dict:
        """Shadow targets' go-live: the engine-core utility :data:`GO_LIVE_UTILITY` (the offline
        ``LLM`` generates only between calls, so this is the go-live without a load)."""
        core = self.llm.llm_engine.engine_core
        if hasattr(core, "call_utility"):
            out = core.call_utility(GO_LIVE_UTILITY, int(version), bool(self.reset))
        else:  # in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0)
            out = getattr(core.engine_core, GO_LIVE_UTILITY)(int(version), bool(self.reset))
        if self.reset and not out["reset"]:
            raise RuntimeError("vLLM refused to reset the prefix cache at the go-live")
        return out


class AsyncLLMClient:
    """A ``VLLMWeightSyncClient`` over a ``vllm.v1.engine.async_llm.AsyncLLM`` whose event loop
    runs in another thread (``loop``): each call runs the coroutine of the same name there and
    waits. ``finish_weight_update`` also resets the prefix cache with
    ``reset_running_requests=True`` (requests kept across a ``pause_generation(mode="keep")`` are
    recomputed under the new weights, so no cached block holds old-weight KV: C21, C23) unless
    ``reset_prefix_cache=False`` or no weight version is given (a session closed with the weights
    unchanged). ``timeout``: seconds per call."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, *, reset_prefix_cache: bool = True,
                 timeout: float = 300.0) -> None:
        self.engine, self.loop, self.reset, self.timeout = engine, loop, reset_prefix_cache, timeout

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(self.timeout)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))
        if weight_version is None:  # a session closed with the weights unchanged (shadow, failed before go-live)
            return
        if self.reset and self._run(self.engine.reset_prefix_cache(reset_running_requests=True)) is False:
            raise RuntimeError("vLLM refused to reset the prefix cache after the update")

    def go_live(self, version: int) -> dict:
        """Shadow targets' go-live (C27): one engine-core utility call, :data:`GO_LIVE_UTILITY`
        (the workers' go-live, the session's end, the weight version label and the prefix-cache
        reset, in one window between two engine steps). Returns its ``{"seconds", "reset"}``;
        RuntimeError when vLLM refused the reset; the workers' error otherwise."""
        out = self._run(self.engine.engine_core.call_utility_async(GO_LIVE_UTILITY, int(version), bool(self.reset)))
        if self.reset and not out["reset"]:
            raise RuntimeError("vLLM refused to reset the prefix cache at the go-live")
        return out


register()
