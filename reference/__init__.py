"""weight_transfer: one-sided weight transfer for RL post-training.

The public API (:mod:`weight_transfer.api`): build a :class:`Sender` on every training rank
from its FSDP2 module and call :meth:`Sender.push` after each ``optimizer.step()``; a
:class:`Coordinator` (in training rank 0 or its own process) plans once and publishes the
weight versions; a :class:`Receiver` on every inference rank registers that engine's tensors
once. For vLLM, the registered weight-transfer backend does the inference side for you
(``weight_transfer.engines.vllm.backend.plugin``: ``LLM(..., weight_transfer_config={"backend":
"one_sided"})``). Everything else in the package (planner, executor, transports) is importable
for those who build their own, and documented in docs/.

The names below are imported on first use (PEP 562), so ``import weight_transfer`` is cheap
and safe in every vLLM process that loads the plugin.
"""
from __future__ import annotations

import importlib

__all__ = [
    # roles
    "Sender", "Coordinator", "Receiver", "UpdateResult", "serve_store", "connect_store", "JobSecret",
    # options and layouts
    "TransferOptions", "PlanOptions", "ExecutorOptions", "TransportOptions", "ControlOptions",
    "VerifyOptions", "InferenceLayout", "ModelConfig", "fused_expert_views",
    # state and errors
    "WeightsState", "ControlError", "VersionError", "UpdateInProgress", "read_consistent", "PlanError",
    "UpdateStats", "StepStats", "AuthenticationError",
    # observability
    "UpdateMetrics",
]

_WHERE = {
    "Sender": "api", "Coordinator": "api", "Receiver": "api", "UpdateResult": "api", "serve_store": "api",
    "connect_store": "api", "JobSecret": "security.secret", "AuthenticationError": "security.secret",
    "TransferOptions": "options", "PlanOptions": "options", "ExecutorOptions": "options",
    "TransportOptions": "options", "ControlOptions": "options", "VerifyOptions": "options",
    "InferenceLayout": "types", "PlanError": "types", "ModelConfig": "model_config",
    "fused_expert_views": "plan.traced",
    "WeightsState": "control.protocol", "ControlError": "control.protocol", "VersionError": "control.protocol",
    "UpdateInProgress": "control.protocol", "read_consistent": "control.protocol",
    "UpdateStats": "method", "StepStats": "pipeline.executor", "UpdateMetrics": "metrics",
}


def __getattr__(name: str):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'weight_transfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
