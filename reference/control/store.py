"""The control-plane store as the public API opens it (:func:`serve_store`, :func:`connect_store`)
and the key under which a live engine publishes its runtime layout (:data:`RUNTIME_KEY`).

The store is :class:`weight_transfer.security.secure_store.SecureStore`: only members of the job, who hold
its secret (:mod:`weight_transfer.security.secret`), can connect; every value is sealed with the job's
key. :func:`serve_store` binds where the caller says, loopback by default (a one-host job);
a multi-node job names the interface the other hosts reach (``serve_store("0.0.0.0")``) and hands
the secret to every host in the environment (docs/SECURITY.md). The explicit opt-out
(:data:`weight_transfer.security.secret.ENV_INSECURE` or ``insecure=True``) keeps torch's plain
``TCPStore`` and prints a warning every time.

Connecting is bounded by the caller's ``timeout``: :func:`connect_store` retries while nothing
accepts on the address (a store started a moment later is found) and refuses at once what
cannot succeed: no secret, a secret the store does not share, a peer that is not a store of
this kind. (torch's ``TCPStore`` client retries past its own timeout -- measured with torch
2.13: ``timeout=2 s`` against a port where nothing listens raises after about 4 s -- and waits
without any deadline on a peer that accepts and never answers; under the opt-out the client is
built in a helper thread bounded by the deadline, as before.)"""
from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ..args import check_bool, check_int, check_seconds, check_type
from ..errors import ControlError, backoff
from ..security.secret import (
    AuthenticationError,
    JobSecret,
    insecure_requested,
    resolve_secret,
    warn_insecure,
)
from .keys import SHADOW_KEY
from .wire import get

__all__ = ["serve_store", "connect_store", "make_store", "plain_tcp_store", "RUNTIME_KEY", "runtime_layouts",
           "SHADOW_KEY", "shadow_infos", "JobSecret"]


def serve_store(host: str = "127.0.0.1", port: int = 0, *, timeout: float = 600.0, secret=None,
                insecure: bool | None = None) -> dist.Store:
    """Start the control-plane store's server in this process and return this process's handle
    on it (:class:`weight_transfer.security.secure_store.SecureStore`; ``store.port``: the port, picked
    free for ``port=0``; ``store.secret``: the job secret). Keep the object alive as long as the
    job runs; ``store.close()`` stops it.

    ``host``: the address to listen on -- ``"127.0.0.1"`` (default) for a job on one host, the
    interface the other hosts reach (or ``"0.0.0.0"``) for a multi-node job. ``timeout``: seconds
    a store call may block. ``secret``: the job secret (a
    :class:`~weight_transfer.security.secret.JobSecret`, hex ``str`` or ``bytes``); default: the
    environment's (:data:`~weight_transfer.security.secret.ENV_SECRET` /
    :data:`~weight_transfer.security.secret.ENV_SECRET_FILE`), else a fresh one, exported to this
    process's environment so that the processes it starts from now on inherit it (members
    started otherwise need it passed: ``store.secret.env()``, ``store.secret.write_file(path)``).
    ``insecure=True`` (or ``WEIGHT_TRANSFER_INSECURE=1``): torch's plain ``TCPStore``, no
    authentication, a warning printed.

    TypeError / ValueError for a bad ``host``, ``port`` (0..65535), ``timeout`` (seconds > 0) or
    ``secret``; OSError naming the address when it cannot listen there."""
    check_type(host, "host", str, where="serve_store")
    port = check_int(port, "port", where="serve_store", lo=0, hi=65535)
    timeout = check_seconds(timeout, "timeout", where="serve_store")
    check_bool(insecure, "insecure", where="serve_store", allow_none=True)
    if insecure_requested(insecure):
        store = plain_tcp_store(host, port, is_master=True, timeout=timeout)
        warn_insecure(f"serve_store: the control plane at {host}:{store.port} runs")
        return store
    from ..security.secure_store import SecureStore

    sec = resolve_secret(secret, where="serve_store", required=False)
    if sec is None:
        sec = JobSecret.generate()
        sec.export()
    return SecureStore.serve(host, port, sec, timeout=timeout)


def make_store(host: str, port: int, *, is_master: bool, world_size: int | None = None,
               timeout: float = 300.0, secret=None) -> dist.Store:
    """The control-plane store: its server here (``is_master``; ``port=0`` picks a free port:
    read ``store.port``), or a member's connection to it -- :func:`weight_transfer.serve_store`
    / :func:`weight_transfer.connect_store` (the job secret from ``secret`` or the environment;
    a master without one makes one and exports it to the processes it starts). ``world_size``
    is accepted for callers of torch's ``TCPStore`` signature and not used."""
    del world_size
    if is_master:
        return serve_store(host, port, timeout=timeout, secret=secret)
    return connect_store((host, port), timeout=timeout, secret=secret)


def plain_tcp_store(host: str, port: int, *, is_master: bool, timeout: float) -> dist.TCPStore:
    """torch's unauthenticated ``TCPStore`` (the explicit opt-out only: :data:`weight_transfer.security.secret.ENV_INSECURE`)."""
    return dist.TCPStore(host, port, None, is_master, timedelta(seconds=timeout), wait_for_workers=False)


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
    raise ValueError(f"connect_store: store={store!r}: a store handle, (host, port) or 'host:port' (port 1..65535)")


def connect_store(store, *, timeout: float = 600.0, secret=None, insecure: bool | None = None) -> dist.Store:
    """A member's handle on the control-plane store: ``store`` as a handle
    (:class:`~weight_transfer.security.secure_store.SecureStore`, returned as is), ``(host, port)`` or
    ``"host:port"``. ``timeout`` (seconds > 0) bounds connecting (retrying while nothing answers
    yet, e.g. a store started later) and then every store call. ``secret``: the job secret
    (default: the environment's, see :func:`serve_store`). ``insecure=True`` (or
    ``WEIGHT_TRANSFER_INSECURE=1``): torch's plain ``TCPStore`` client, or any
    ``torch.distributed.Store`` handed in, without authentication, a warning printed.

    Raises, before a byte of a request is sent: ValueError for a malformed address or secret,
    TypeError / ValueError for a bad ``timeout``;
    :class:`weight_transfer.security.secret.AuthenticationError` when this process has no secret (naming
    how to pass it), when the store does not share it, when the peer is not an authenticated
    store, and for a plain ``torch.distributed.Store`` without the opt-out;
    :class:`weight_transfer.control.protocol.ControlError` naming ``host:port`` and the timeout when no
    store answers within about ``timeout`` seconds (chained from the last connection error)."""
    from ..security.secure_store import SecureStore, StoreBusy

    timeout = check_seconds(timeout, "timeout", where="connect_store")
    check_bool(insecure, "insecure", where="connect_store", allow_none=True)
    if isinstance(store, SecureStore):
        return store
    if isinstance(store, dist.Store):
        if insecure_requested(insecure):
            warn_insecure(f"connect_store: a {type(store).__name__} is used")
            return store
        raise AuthenticationError(f"connect_store: a {type(store).__name__} is not an authenticated store: anyone who "
                                  "reaches it is a member. Use weight_transfer.serve_store / connect_store, or "
                                  "WEIGHT_TRANSFER_INSECURE=1 on a network you trust (docs/SECURITY.md)")
    host, port = _address(store)
    if insecure_requested(insecure):
        warn_insecure(f"connect_store: the control plane at {host}:{port} is used")
        return _connect_plain(host, port, timeout)
    sec = resolve_secret(secret, where=f"connect_store({host}:{port})")
    where = f"connect_store: no store answers at {host}:{port} within {timeout:g} s"
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    for expired in backoff(timeout, 0.1):
        try:
            return SecureStore.connect(host, port, sec, timeout=max(0.05, deadline - time.monotonic())
                                       if not expired else 0.05)._with_timeout(timeout)
        except AuthenticationError as e:
            raise AuthenticationError(f"connect_store: {e}") from None
        except OSError as e:  # refused, unresolvable, unreachable, no answer yet: retried until the deadline
            last = e
        if expired or time.monotonic() >= deadline:
            if isinstance(last, TimeoutError):
                raise ControlError(f"{where}: the address accepts connections but no store answered (another "
                                   "service on that port, or a store started with WEIGHT_TRANSFER_INSECURE=1?)") from last
            if isinstance(last, StoreBusy):
                raise ControlError(f"{where}: it kept closing the connection during the handshake ({last}): its "
                                   "handshake slots are taken (a flood of connections?) or it is shutting down") from last
            raise ControlError(f"{where} (last error: {type(last).__name__}: {last})") from last
    raise AssertionError("unreachable")


def _connect_plain(host: str, port: int, timeout: float) -> dist.Store:
    """torch's ``TCPStore`` client (the opt-out), bounded by ``timeout`` as :func:`connect_store` documents."""
    where = f"connect_store: no store answers at {host}:{port} within {timeout:g} s"
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    for expired in backoff(timeout, 0.1):
        try:
            with socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic())):
                break
        except OSError as e:
            last = e
        if expired or time.monotonic() >= deadline:
            raise ControlError(f"{where} (last error: {type(last).__name__}: {last})") from last
    left = max(1.0, deadline - time.monotonic())
    box: dict = {}

    def handshake():
        try:
            box["store"] = plain_tcp_store(host, port, is_master=False, timeout=left)
        except BaseException as e:  # re-raised below, in the caller's thread
            box["error"] = e
    t = threading.Thread(target=handshake, name=f"wt-connect-{host}:{port}", daemon=True)
    t.start()
    t.join(left + 0.25)
    if t.is_alive():
        raise ControlError(f"{where}: the address accepts connections but no TCPStore answered (another service on "
                           "that port, or the job's authenticated store: unset WEIGHT_TRANSFER_INSECURE and pass the "
                           "job secret?)")
    if "error" in box:
        e = box["error"]
        raise ControlError(f"{where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    box["store"].set_timeout(timedelta(seconds=timeout))
    return box["store"]


RUNTIME_KEY = "meta/infer_runtime/{rank}"
"""Store key under which an inference rank may publish its engine's runtime layout (an object
with ``targets`` / ``refused``, see :mod:`weight_transfer.plan.retarget`; e.g. a live vLLM,
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
