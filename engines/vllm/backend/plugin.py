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
    from weight_transfer.engines.vllm.backend.plugin import OneSidedTrainerInitInfo, LLMClient
    info = OneSidedTrainerInitInfo(rank=rank, world_size=world)
    eng = WeightTransferTrainerFactory.trainer_init(info, client=LLMClient(llm),   # or HTTPVLLMWeightSyncClient(url)
                                                    source=ModuleSource(model))
    for step in ...:
        loss.backward(); optimizer.step()
        eng.send_weights()            # every rank; version 1, 2, ... (or send_weights(version=v))

What happens (the reference's protocol, :mod:`weight_transfer.api`):

- ``trainer_init``: training rank 0 starts the control-plane store (``store_port=0``: a free
  port, broadcast to the other ranks over the default process group), authenticated by the job
  secret of its environment or one it makes (docs/VLLM.md, "The job secret"), and calls
  ``client.init_weight_transfer_engine`` with :class:`OneSidedInitInfo` (the side channel: the
  store's address and the path of the secret's file -- never the secret; vLLM's API has no
  return path). Each worker joins the store with its own environment's secret, else that file's
  (:func:`~weight_transfer.engines.vllm.backend.worker.worker_secret`; without one the trainer
  gets :class:`weight_transfer.security.secret.AuthenticationError` with the worker's reason). In every worker,
  :meth:`OneSidedWeightTransferEngine.init_transfer_engine` reports the runtime tensors (after
  ``process_weights_after_loading``), stages the layers vLLM keeps opaque (oneDNN handles on CPUs
  without AMX: C22), registers the destination tensors once with the transport that fits their
  memory (``cma`` for host memory, ``cuda_ipc`` for a CUDA vLLM's GPU memory, or the init info's
  ``transport``: one region of one part per allocation,
  :meth:`~weight_transfer.engines.vllm.worker.state.WorkerTargets.receive`; a tensor no
  configured transport can register is refused here, naming it and its device) and publishes its
  descriptor, destination metadata and :class:`~weight_transfer.engines.vllm.worker.runtime.RuntimeLayout`;
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

The parts live in modules beside this one, every public name re-exported here (the entry point,
users' configs and imports name this module): :mod:`~weight_transfer.engines.vllm.backend.config`
(the names, :class:`OneSidedInitInfo`, :class:`OneSidedUpdateInfo`,
:class:`OneSidedTrainerInitInfo`, :func:`transfer_options`),
:mod:`~weight_transfer.engines.vllm.backend.worker` (:class:`OneSidedWeightTransferEngine`),
:mod:`~weight_transfer.engines.vllm.backend.trainer` (:class:`OneSidedTrainerEngine`,
:class:`DTensorSource`, :class:`Deployment`) and :mod:`~weight_transfer.engines.vllm.backend.clients`
(:class:`LLMClient`, :class:`AsyncLLMClient`).
"""
from __future__ import annotations

import sys
import time

from weight_transfer.engines.vllm.backend.clients import AsyncLLMClient, LLMClient
from weight_transfer.engines.vllm.backend.config import (
    BACKEND,
    GO_LIVE_UTILITY,
    INCOMPLETE,
    TARGETS,  # noqa: F401 -- re-exported
    OneSidedInitInfo,
    OneSidedTrainerInitInfo,
    OneSidedUpdateInfo,
    engine_key,
    transfer_options,
)
from weight_transfer.engines.vllm.backend.trainer import Deployment, DTensorSource, OneSidedTrainerEngine, _params_of  # noqa: F401 -- re-exported
from weight_transfer.engines.vllm.backend.worker import (  # applies WT_VLLM_HIDE_AMX in the worker
    OneSidedWeightTransferEngine,
    hf_config_dict,
)

__all__ = ["BACKEND", "INCOMPLETE", "GO_LIVE_UTILITY", "register", "OneSidedInitInfo", "OneSidedUpdateInfo",
           "OneSidedWeightTransferEngine", "OneSidedTrainerInitInfo", "OneSidedTrainerEngine", "DTensorSource",
           "LLMClient", "AsyncLLMClient", "Deployment", "engine_key", "transfer_options", "hf_config_dict"]


def register() -> None:
    """Register :data:`BACKEND` in ``WeightTransferEngineFactory`` and
    ``WeightTransferTrainerFactory``, and give vLLM's ``EngineCore`` the utility
    :data:`GO_LIVE_UTILITY` (:func:`_engine_core_go_live`) and the two engine-core names of its
    ``collective_rpc`` (:mod:`weight_transfer.engines.vllm.backend.recover`: the go-live and the
    recovery of a server over HTTP). Idempotent (vLLM runs general plugins
    once per process -- driver, engine core, workers --, and importing this module registers too)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    try:  # never let the utility stop the plugin (and so vLLM's process) from loading
        from vllm.v1.engine.core import EngineCore

        if not hasattr(EngineCore, GO_LIVE_UTILITY):
            setattr(EngineCore, GO_LIVE_UTILITY, _engine_core_go_live)
        from weight_transfer.engines.vllm.backend.recover import (
            install,  # the go-live and the recovery over HTTP's /collective_rpc (C27, C32)
        )

        install(EngineCore, _engine_core_go_live)
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


register()
