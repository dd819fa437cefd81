"""The worker extension class handed to an unmodified vLLM (``LLM(worker_extension_cls=...)``).

vLLM mixes this class into its worker class; its methods then run **inside the worker process
that holds the parameters** when the driver calls ``LLM.collective_rpc("wt_report")``. This is
the public extension point RL frameworks use (verl, OpenRLHF, the vLLM RLHF examples). No vLLM
code is patched; nothing here runs per transferred byte (the commit of staged layers runs once
per update, only for those layers).

Methods (all return plain picklable data; tensors only from ``wt_read``):

- :meth:`wt_report`: the runtime tensors the model computes with, after
  ``process_weights_after_loading``: every parameter (name, shape, dtype, strides, storage
  offset, ``data_ptr``, bytes; a Parameter reachable under two names is listed once and the
  second name is an alias), every **derived** tensor that post-processing attached to a
  module outside ``named_parameters`` (MLA ``W_UV`` / ``W_UK_T``, CPU GEMM packed weights held
  in ``layer.cpu_linear``'s closure, oneDNN handles), each MoE layer's expert kernel (class,
  ISA), and the worker's pid, TP rank and host. See ``engines/vllm/worker/runtime.py`` for how the
  planner uses it.
- :meth:`wt_register`: registers, in the worker, the byte range holding the destination tensors
  with the CMA transport and returns its region descriptor (once).
- :meth:`wt_read`: copies of named runtime tensors (for byte verification; staging tensors as
  ``<module>.<param>:staging``).
- :meth:`wt_stage` (once) / :meth:`wt_commit` (per update): **staged targets** for the layers
  vLLM keeps opaque (oneDNN / zentorch handles): checkpoint-layout staging tensors the trainers
  write one-sidedly, and vLLM's own post-processing re-run for exactly those layers once every
  write of an update landed (C22).
- :meth:`wt_reload_begin` / :meth:`wt_load_weights` / :meth:`wt_reload_finish`: vLLM's own
  in-place reload, as the baselines use it (see the methods).

The ``wt_report`` ... ``wt_commit`` logic is :class:`weight_transfer.engines.vllm.worker.state.WorkerTargets`;
the methods here delegate to one instance per worker. When the worker also runs the one-sided
weight-transfer backend (``weight_transfer_config={"backend": "one_sided"}``), that instance is the
backend engine's own (:attr:`OneSidedWeightTransferEngine.targets`), so reads see its staging tensors.
"""
from __future__ import annotations

import torch

from weight_transfer.engines.vllm.worker.draft_targets import worker_draft
from weight_transfer.engines.vllm.worker.state import (
    HIDE_AMX_ENV,
    IN_PLACE_METHODS,
    STAGING_ALIGN,
    STAGING_SUFFIX,
    WorkerTargets,
    cpu_moe_layers,
    gemm_path,
    host_isa,
    tied_modules,
)

__all__ = ["WeightTransferExtension", "HIDE_AMX_ENV", "STAGING_SUFFIX", "STAGING_ALIGN", "IN_PLACE_METHODS",
           "host_isa", "gemm_path"]


class WeightTransferExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``); see the module docstring."""

    def _wt_model(self) -> torch.nn.Module:
        runner = self.model_runner  # type: ignore[attr-defined]
        model = getattr(runner, "model", None)
        if model is None and hasattr(runner, "get_model"):
            model = runner.get_model()
        return model

    def _wt_tp_rank(self) -> int:
        try:
            from vllm.distributed import get_tensor_model_parallel_rank

            return int(get_tensor_model_parallel_rank())
        except Exception:
            return int(getattr(self, "rank", 0))

    def _wt_targets(self) -> WorkerTargets:
        """This worker's :class:`WorkerTargets`: the one-sided backend engine's when the worker
        runs it, else one of the extension's own (made once)."""
        engine_targets = getattr(getattr(self, "weight_transfer_engine", None), "targets", None)
        if isinstance(engine_targets, WorkerTargets):
            return engine_targets
        own = getattr(self, "_wt_own_targets", None)
        if own is None:
            own = self._wt_own_targets = WorkerTargets(self._wt_model(), self.vllm_config,  # type: ignore[attr-defined]
                                                       self._wt_tp_rank(), draft=worker_draft(self))  # an MTP draft under draft.
        return own

    def wt_report(self) -> dict:
        """The runtime layout of this worker: :meth:`WorkerTargets.report`. Units: bytes."""
        return self._wt_targets().report()

    def wt_read(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """name -> a copy of that runtime tensor: :meth:`WorkerTargets.read`."""
        return self._wt_targets().read(names)

    def wt_register(self, spans: dict[int, tuple[int, int]]):
        """Register ``spans[tp_rank] = (base, length)`` with the CMA transport, once; returns
        the region descriptor: :meth:`WorkerTargets.register`."""
        return self._wt_targets().register(spans)

    # --------------------------------------------------------- staged targets (C22)
    def wt_stage(self, modules: dict[str, str]) -> dict:
        """Staging targets for the layers in ``modules``, once: :meth:`WorkerTargets.stage`."""
        return self._wt_targets().stage(modules)

    def wt_commit(self) -> dict:
        """vLLM's post-processing re-run for the staged layers: :meth:`WorkerTargets.commit`."""
        return self._wt_targets().commit()

    # ------------------------------------------------------------ the baselines' path
    def wt_reload_begin(self) -> None:
        """Start an in-place reload the way vLLM 0.32's own weight-transfer engines do
        (``IPCWeightTransferEngine.start_weight_update``, the first half of
        ``Worker.reload_weights``): :func:`vllm.model_executor.model_loader.reload.initialize_layerwise_reload`
        puts every layer back on its loading-time parameters (recorded by
        ``record_metadata_for_reloading`` when the model was built) and wraps their
        ``weight_loader`` so each layer is re-processed (``quant_method.process_weights_after_loading``:
        the CPU GEMM packing, the MoE prepack) as soon as all its weights arrived, and the
        result copied into the running tensors."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(self._wt_model())

    def wt_load_weights(self, weights: list) -> int:
        """vLLM's own loading path (what the baselines measure): ``model.load_weights`` with
        full Hugging Face tensors, given as ``(name, dtype, shape, raw bytes)`` because
        ``collective_rpc``'s serializer does not carry tensors. Must be called between
        :meth:`wt_reload_begin` and :meth:`wt_reload_finish` (after ``process_weights_after_loading``
        the dense linears' parameters are 0-byte husks without a ``weight_loader``; a plain
        ``model.load_weights`` raises ``AttributeError: 'Parameter' object has no attribute
        'weight_loader'``). Returns the number of tensors passed."""
        from vllm.config import set_current_vllm_config

        model = self._wt_model()
        decoded = [(n, torch.frombuffer(bytearray(b), dtype=getattr(torch, dt)).view(tuple(shape)))
                   for n, dt, shape, b in weights]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            model.load_weights(weights=iter(decoded))
        return len(weights)

    def wt_reload_finish(self) -> None:
        """End the reload (``IPCWeightTransferEngine.finish_weight_update``):
        :func:`vllm.model_executor.model_loader.reload.finalize_layerwise_reload` processes
        the layers not processed yet (attention, partly loaded ones) and puts the running
        tensors back on every layer; then each tied layer's ``quant_method.process_weights_after_loading``
        again (:func:`weight_transfer.engines.vllm.worker.state.tied_modules`) and each CPU MoE layer's expert prepack
        (:func:`weight_transfer.engines.vllm.worker.state.cpu_moe_layers`): two steps vLLM 0.32's reload leaves out on CPU."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self._wt_model()
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            finalize_layerwise_reload(model, self.model_runner.model_config)  # type: ignore[attr-defined]
            for _name, mod in tied_modules(model):
                mod.quant_method.process_weights_after_loading(mod)
            for _name, mod, experts in cpu_moe_layers(model):
                experts.process_weights_after_loading(mod)

    @staticmethod
    def _wt_cpu_moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
        """:func:`weight_transfer.engines.vllm.worker.state.cpu_moe_layers`."""
        return cpu_moe_layers(model)

    @staticmethod
    def _wt_tied_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """:func:`weight_transfer.engines.vllm.worker.state.tied_modules`."""
        return tied_modules(model)

    # ------------------------------------------------------------ the step clock (issue 38)
    def wt_step_clock_install(self) -> dict:
        """Install the step clock on this worker's model, once (idempotent):
        :meth:`weight_transfer.engines.vllm.worker.steps.StepClock.install`. Returns ``{"pid",
        "tp_rank", "installed_at"}`` (``time.time()`` seconds of the first install)."""
        import os

        from weight_transfer.engines.vllm.worker.steps import StepClock

        clock = StepClock.install(self._wt_model())
        return {"pid": os.getpid(), "tp_rank": self._wt_tp_rank(), "installed_at": clock.installed_at}

    def wt_steps(self, since: float = 0.0) -> dict:
        """This worker's step records and marks ending after ``since`` (``time.time()``
        seconds): :meth:`weight_transfer.engines.vllm.worker.steps.StepClock.snapshot` plus
        ``"tp_rank"``. RuntimeError when :meth:`wt_step_clock_install` was not called."""
        from weight_transfer.engines.vllm.worker.steps import StepClock

        clock = StepClock.of(self._wt_model())
        if clock is None:
            raise RuntimeError("wt_steps: no step clock in this worker: call collective_rpc('wt_step_clock_install') first")
        return dict(clock.snapshot(float(since)), tp_rank=self._wt_tp_rank())  # a string over HTTP's /collective_rpc

    def wt_step_mark(self, kind: str, hold_s: float = 0.0, **info) -> tuple[float, float]:
        """Mark ``kind`` on this worker's step clock over this call, which holds the worker
        ``hold_s`` seconds (a stand-in for work done between two engine steps, e.g. a
        go-live): returns the mark's ``(t0, t1)`` (``time.time()`` seconds). RuntimeError
        when no clock is installed."""
        import time

        from weight_transfer.engines.vllm.worker.steps import mark

        t0 = time.time()
        if hold_s > 0:
            time.sleep(hold_s)
        t1 = time.time()
        if not mark(self._wt_model(), kind, t0, t1, **info):
            raise RuntimeError("wt_step_mark: no step clock in this worker: call collective_rpc('wt_step_clock_install') first")
        return t0, t1
