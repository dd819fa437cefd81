"""The control-plane store as the public API opens it (:func:`serve_store`, :func:`connect_store`)
and the key under which a live engine publishes its runtime layout (:data:`RUNTIME_KEY`)."""
from __future__ import annotations

import torch.distributed as dist

from .control import get, make_store

__all__ = ["serve_store", "connect_store", "RUNTIME_KEY", "runtime_layouts"]


def serve_store(host: str = "0.0.0.0", port: int = 0, *, timeout: float = 600.0) -> dist.TCPStore:
    """Start the control-plane store (a ``TCPStore`` master) in this process and return it;
    ``port=0`` picks a free port (read ``store.port``). Keep the object alive as long as the job
    runs. ``timeout``: seconds a store call may block."""
    return make_store(host, port, is_master=True, timeout=timeout)


def connect_store(store, *, timeout: float = 600.0) -> dist.Store:
    """A client of the control-plane store: ``store`` as a ``torch.distributed.Store`` (returned
    as is), ``(host, port)`` or ``"host:port"``. ValueError for anything else."""
    if isinstance(store, dist.Store):
        return store
    if isinstance(store, str) and ":" in store:
        host, _, port = store.rpartition(":")
        store = (host, port)
    if isinstance(store, (tuple, list)) and len(store) == 2 and str(store[1]).isdigit():
        return make_store(str(store[0]), int(store[1]), is_master=False, timeout=timeout)
    raise ValueError(f"store={store!r}: a torch.distributed.Store, (host, port) or 'host:port'")



RUNTIME_KEY = "meta/infer_runtime/{rank}"
"""Store key under which an inference rank may publish its engine's runtime layout (an object
with ``targets`` / ``refused``, see :mod:`weight_transfer.retarget`; e.g. a live vLLM,
``experiments/vllm_side.py``)."""


def runtime_layouts(store, infer_payloads: dict) -> dict:
    """Inference rank -> published runtime layout, for the ranks that published one ({} when
    none did: the engine's load layout is its runtime layout)."""
    keys = {i: RUNTIME_KEY.format(rank=i) for i in infer_payloads}
    return {i: get(store, k) for i, k in keys.items() if store.check([k])}
