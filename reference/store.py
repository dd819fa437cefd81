"""The control-plane store as the public API opens it (:func:`serve_store`, :func:`connect_store`)
and the key under which a live engine publishes its runtime layout (:data:`RUNTIME_KEY`).

Connecting is bounded by the caller's ``timeout``: ``torch.distributed.TCPStore``'s own client
retries past it (measured with torch 2.13: ``timeout=2 s`` against a port where nothing listens
raises ``DistNetworkError`` "The client socket has timed out after 2000ms" after about 4 s,
``0.5 s`` after 1.6 s: two attempts and a random back-off of 1-2.5 s), so :func:`connect_store`
first waits for the address to accept a TCP connection itself, retrying until the deadline (a
store started a moment later is found), and only then builds the ``TCPStore`` client with the
time left -- in a helper thread, because that client waits without any deadline on a peer that
accepts connections and never answers (another service on the port); such a peer is refused at
the deadline, and the helper thread stays blocked until the peer closes."""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from .args import check_int, check_seconds, check_type
from .control import SHADOW_KEY, ControlError, backoff, get, make_store

__all__ = ["serve_store", "connect_store", "RUNTIME_KEY", "runtime_layouts", "SHADOW_KEY", "shadow_infos"]


def serve_store(host: str = "0.0.0.0", port: int = 0, *, timeout: float = 600.0) -> dist.TCPStore:
    """Start the control-plane store (a ``TCPStore`` master) in this process and return it;
    ``port=0`` picks a free port (read ``store.port``). Keep the object alive as long as the job
    runs. ``timeout``: seconds a store call may block. TypeError / ValueError for a bad ``host``,
    ``port`` (0..65535) or ``timeout`` (seconds > 0)."""
    check_type(host, "host", str, where="serve_store")
    port = check_int(port, "port", where="serve_store", lo=0, hi=65535)
    timeout = check_seconds(timeout, "timeout", where="serve_store")
    return make_store(host, port, is_master=True, timeout=timeout)


def _address(store) -> tuple[str, int]:
    """``(host, port)`` of ``(host, port)`` / ``"host:port"`` (``"[::1]:port"`` too); ValueError otherwise."""
    addr = store
    if isinstance(addr, str) and ":" in addr:
        host, _, port = addr.rpartition(":")
        addr = (host[1:-1] if host.startswith("[") and host.endswith("]") else host, port)
    if isinstance(addr, (tuple, list)) and len(addr) == 2 and isinstance(addr[0], str) and addr[0]:
        port = addr[1]
        if isinstance(port, str) and port.isdigit():
            port = int(port)
        if isinstance(port, int) and not isinstance(port, bool) and 0 < port <= 65535:
            return addr[0], port
    raise ValueError(f"connect_store: store={store!r}: a torch.distributed.Store, (host, port) or 'host:port' "
                     "(port 1..65535)")


def connect_store(store, *, timeout: float = 600.0) -> dist.Store:
    """A client of the control-plane store: ``store`` as a ``torch.distributed.Store`` (returned
    as is), ``(host, port)`` or ``"host:port"``. ``timeout`` (seconds > 0) bounds connecting
    (retrying while nothing answers yet, e.g. a store started later) and then every store call.

    Raises ValueError for a malformed address, TypeError / ValueError for a bad ``timeout``,
    :class:`weight_transfer.control.ControlError` naming ``host:port`` and the timeout when no
    store answers within about ``timeout`` seconds (chained from the last connection error)."""
    timeout = check_seconds(timeout, "timeout", where="connect_store")
    if isinstance(store, dist.Store):
        return store
    host, port = _address(store)
    where = f"connect_store: no store answers at {host}:{port} within {timeout:g} s"
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    for expired in backoff(timeout, 0.1):
        try:
            with socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic())):
                break
        except OSError as e:  # refused, unresolvable, unreachable: retried until the deadline
            last = e
        if expired or time.monotonic() >= deadline:
            raise ControlError(f"{where} (last error: {type(last).__name__}: {last})") from last
    # the address accepts connections: TCPStore's handshake gets the time left (at least 1 s), in a
    # thread because torch's client waits without a deadline for a peer that accepts and never answers
    left = max(1.0, deadline - time.monotonic())
    box: dict = {}

    def handshake():
        try:
            box["store"] = make_store(host, port, is_master=False, timeout=left)
        except BaseException as e:  # re-raised below, in the caller's thread
            box["error"] = e
    t = threading.Thread(target=handshake, name=f"wt-connect-{host}:{port}", daemon=True)
    t.start()
    t.join(left + 0.25)
    if t.is_alive():
        raise ControlError(f"{where}: the address accepts connections but no TCPStore answered (another "
                           "service on that port?)")
    if "error" in box:  # torch's DistNetworkError / DistStoreError
        e = box["error"]
        raise ControlError(f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    box["store"].set_timeout(timedelta(seconds=timeout))
    return box["store"]


RUNTIME_KEY = "meta/infer_runtime/{rank}"
"""Store key under which an inference rank may publish its engine's runtime layout (an object
with ``targets`` / ``refused``, see :mod:`weight_transfer.retarget`; e.g. a live vLLM,
``experiments/vllm_side.py``)."""


def shadow_infos(store, ranks) -> dict:
    """Inference rank -> its published shadow info, for the ranks in ``ranks`` that have one."""
    keys = {i: SHADOW_KEY.format(rank=i) for i in ranks}
    return {i: get(store, k) for i, k in keys.items() if store.check([k])}


def runtime_layouts(store, infer_payloads: dict) -> dict:
    """Inference rank -> published runtime layout, for the ranks that published one ({} when
    none did: the engine's load layout is its runtime layout)."""
    keys = {i: RUNTIME_KEY.format(rank=i) for i in infer_payloads}
    return {i: get(store, k) for i, k in keys.items() if store.check([k])}
