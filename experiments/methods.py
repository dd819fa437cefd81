"""Method registry: name -> (controller side, trainer side, inference side) classes.

``reference`` is the one-sided design; ``rank0_funnel`` and ``rpc`` are the baselines in
``baselines/``. All three run in the same worlds with the same verification.
"""
from __future__ import annotations

import importlib

METHODS = {
    "reference": ("reference.method", "ReferenceController", "ReferenceTrainer", "ReferenceInference"),
    "rank0_funnel": ("baselines.funnel", "FunnelController", "FunnelTrainer", "FunnelInference"),
    "rpc": ("baselines.rpc", "RpcController", "RpcTrainer", "RpcInference"),
}


def get_method(name: str):
    """(ControllerSide, TrainerSide, InferenceSide) classes of method ``name``.

    ``name`` is a registered method, or ``module:`` -- an importable module defining
    ``CONTROLLER``, ``TRAINER`` and ``INFERENCE`` (plug in your own method, or a fault-injecting
    one in tests). Raises ValueError naming an unknown method and listing the known ones."""
    if name.endswith(":"):
        try:
            m = importlib.import_module(name[:-1])
            return m.CONTROLLER, m.TRAINER, m.INFERENCE
        except (ImportError, AttributeError) as e:
            raise ValueError(f"method {name!r}: {e}") from None
    try:
        mod, c, t, i = METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(METHODS)}, or 'module:'") from None
    m = importlib.import_module(mod)
    return getattr(m, c), getattr(m, t), getattr(m, i)
