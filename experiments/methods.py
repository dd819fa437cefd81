"""Method registry: name -> (controller side, trainer side, inference side) classes.

``reference`` is the one-sided design; ``rank0_funnel`` and ``rpc`` are the baselines in
``baselines/``. All three run in the same worlds with the same verification.
"""
from __future__ import annotations

import importlib

from weight_transfer.control.clients import job_ending

METHODS = {
    "reference": ("weight_transfer.method", "ReferenceController", "ReferenceTrainer", "ReferenceInference"),
    "rank0_funnel": ("weight_transfer.baselines.funnel", "FunnelController", "FunnelTrainer", "FunnelInference"),
    "rpc": ("weight_transfer.baselines.rpc", "RpcController", "RpcTrainer", "RpcInference"),
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


def serve_active_step(client, side, step: int) -> bool:
    """One update of an *active* inference side (a baseline that receives: funnel, RPC): wait for
    the controller's go for ``step``, run ``side.receive(step)`` and report its stats, or the
    error (``Type: message``, traceback on stderr) so the controller fails the update naming this
    rank instead of waiting for it. Returns False when the job is shutting down (no go came)."""
    import traceback

    if not client.wait_go(step):
        return False
    try:
        client.done(step, ok=True, stats=side.receive(step))
    except Exception as e:  # reported to the controller, which fails the update
        if not job_ending(client.store):  # the controller ending the job reports that itself
            traceback.print_exc()
        client.done(step, ok=False, error=f"{type(e).__name__}: {e}")
    return True
