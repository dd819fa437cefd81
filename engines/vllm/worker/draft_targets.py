"""A speculative-decoding draft's memory in a vLLM worker, beside the target's (C33).

vLLM builds an MTP draft (``DeepSeekMTP``, ``Glm4MoeMTP`` ...) as a model of its own, held by the
worker's proposer (``model_runner.drafter.model``; ``Worker.get_draft_model()``), and hands a
weight-transfer engine only the target model. The ``one_sided`` backend writes the draft in the
same update as the target, under the same version: the worker registers both at init, and the
planner's traced recipes (:mod:`weight_transfer.engines.vllm.trace.draft`) name the draft's
tensors ``draft.`` + vLLM's name inside the draft model.

- :class:`ServedModels`: the target and its draft as one module tree (the target's names
  unchanged, the draft's under ``draft.``), what :class:`~weight_transfer.engines.vllm.worker.state.WorkerTargets`
  reports, stages, registers and commits. What the draft shares with the target (vLLM's proposer
  points an MTP draft's ``embed_tokens`` and ``lm_head`` at the target's modules) is one
  Parameter reached under two names: reported once, under the target's name, the draft's as an
  alias.
- :func:`worker_draft`: the draft model of a vLLM worker, or None.
- :func:`attach_draft_rpc`: run in each worker through vLLM's ``collective_rpc`` by the engine
  core right before ``init_weight_transfer_engine`` (:func:`weight_transfer.engines.vllm.backend.recover.install`):
  hands the worker's draft to its ``one_sided`` engine
  (:meth:`~weight_transfer.engines.vllm.backend.worker.OneSidedWeightTransferEngine.attach_draft`).

Why hand-written: vLLM 0.32 gives an engine its draft only inside a separate draft-update session
(``start_draft_weight_update`` -> ``set_weight_update_target``), a second session with no version
of its own; one decision and one version label for target and draft need the draft's memory
registered with the target's, at init.
"""
from __future__ import annotations

import torch

from weight_transfer.engines.vllm.trace.draft import draft_model_config

__all__ = ["DRAFT_MODULE", "ServedModels", "served_models", "worker_draft", "attach_draft_rpc", "draft_method"]

DRAFT_MODULE = "draft"
"""The draft's module name in :class:`ServedModels` (its tensors: ``draft.`` + vLLM's name,
:data:`weight_transfer.plan.rules.mtp.DRAFT_PREFIX`)."""


class ServedModels(torch.nn.Module):
    """``target`` and ``draft`` as one module tree: the target's children, parameters and buffers
    under their own names, the draft under :data:`DRAFT_MODULE`. Holds no tensor of its own;
    nothing is copied. ValueError when the target already has a member named ``draft``.
    Attribute :attr:`target` (not a child) is the target model."""

    def __init__(self, target: torch.nn.Module, draft: torch.nn.Module) -> None:
        super().__init__()
        if hasattr(target, DRAFT_MODULE):
            raise ValueError(f"{type(target).__name__} has a member named {DRAFT_MODULE!r}: its draft cannot be "
                             "reported beside it")
        for n, m in target.named_children():
            self.add_module(n, m)
        for n, p in target.named_parameters(recurse=False):
            self.register_parameter(n, p)
        for n, b in target.named_buffers(recurse=False):
            self.register_buffer(n, b)
        self.add_module(DRAFT_MODULE, draft)
        object.__setattr__(self, "target", target)  # not a child: its tensors are reported once

    def forward(self, *a, **kw):  # never run: a view for reports, staging and commits
        raise RuntimeError("ServedModels is a view of a worker's target and draft; it does not compute")


def served_models(target: torch.nn.Module, draft: torch.nn.Module | None) -> torch.nn.Module:
    """``target`` alone when there is no draft, else :class:`ServedModels` of both."""
    return target if draft is None else ServedModels(target, draft)


def worker_draft(worker):
    """The draft model of a vLLM worker (``Worker.get_draft_model()``, when its config has a
    draft model config; ``worker`` may be vLLM's ``WorkerWrapperBase``), or None when it serves no
    draft."""
    worker = getattr(worker, "worker", None) or worker
    get = getattr(worker, "get_draft_model", None)
    if draft_model_config(getattr(worker, "vllm_config", None)) is None or not callable(get):
        return None
    return get()


def draft_method(vllm_config) -> str | None:
    """``speculative_config.method`` of ``vllm_config`` when it serves a draft model, else None."""
    if draft_model_config(vllm_config) is None:
        return None
    return str(getattr(vllm_config.speculative_config, "method", None))


def attach_draft_rpc(worker) -> bool:
    """In one vLLM worker (``collective_rpc`` with this callable): hand its draft to its
    ``one_sided`` engine, once, before that engine's init. Returns whether a draft was attached
    (False: no draft, or another backend's engine)."""
    worker = getattr(worker, "worker", None) or worker
    eng = getattr(worker, "weight_transfer_engine", None)
    if not hasattr(eng, "attach_draft"):
        return False
    draft = worker_draft(worker)
    if draft is None:
        return False
    eng.attach_draft(draft)
    return True
