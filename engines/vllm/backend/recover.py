"""One training run leaves nothing behind in a vLLM engine (case C32): the engine-core calls
that make a shadow update live and that return the ``one_sided`` backend to a fresh server's
state, reachable over HTTP without ``/pause``.

vLLM 0.32's HTTP server has no route to an engine-core method of a plugin, but its dev route
``POST /collective_rpc`` (``VLLM_SERVER_DEV_MODE=1``, the mode the weight-transfer routes need)
reaches ``EngineCore.collective_rpc`` as one utility call -- run by the engine core between two
engine steps. :func:`install` (from :func:`weight_transfer.engines.vllm.backend.plugin.register`, in
the engine-core process) wraps that method so two names are the engine core's own, never a
worker's:

- :data:`GO_LIVE_RPC` (``args: [version, reset]`` as strings): the shadow go-live, the end of
  the update session, vLLM's weight version label and the prefix-cache reset in one window
  between two steps (:func:`weight_transfer.engines.vllm.backend.plugin._engine_core_go_live`);
- :data:`RECOVER_RPC` (``args: [stale_only, resume]``): :func:`engine_core_recover` -- every worker's
  ``one_sided`` engine released to a fresh server's state (registration, shadows, staging,
  landing region, the update session vLLM keeps open), the label marked
  :data:`~weight_transfer.engines.vllm.backend.config.INCOMPLETE` when an interrupted update
  had begun writing the live bytes (no shadow), and (``resume``) the scheduler resumed when the
  run that paused it is gone. ``stale_only``: only a registration whose trainer's store no longer
  answers (a killed trainer) is released; a live trainer's is kept and named.

Who calls it: training rank 0 before it initializes the engine (a trainer killed earlier is
cleaned up without a restart: :func:`recover_http`), and users by hand
(``weight-transfer vllm-recover --url URL``, docs/VLLM.md "Recovering a server").

Why hand-written: vLLM 0.32 has no way to drop a worker's weight-transfer session other than
``finish_weight_update`` from the same client, and none that resets a plugin's state.
"""
from __future__ import annotations

import time
from typing import Any

from weight_transfer.engines.vllm.backend.config import server_message, store_alive
from weight_transfer.engines.vllm.worker.draft_targets import attach_draft_rpc, draft_method

__all__ = ["GO_LIVE_RPC", "RECOVER_RPC", "install", "worker_release", "engine_core_recover", "store_alive",
           "recover_http", "go_live_http", "rpc_http", "post_route", "wait_health", "server_message", "ServerError"]

GO_LIVE_RPC = "wt_go_live"
"""``/collective_rpc`` method name of the shadow go-live (the engine core's, not a worker's)."""
RECOVER_RPC = "wt_recover"
"""``/collective_rpc`` method name of :func:`engine_core_recover`."""


class ServerError(RuntimeError):
    """A vLLM server's route failed: ``url``, ``route``, ``status`` (None: no answer), ``reason``
    (the server's own message, or the connection error)."""

    def __init__(self, message: str, *, url: str, route: str, status: int | None, reason: str) -> None:
        super().__init__(message)
        self.url, self.route, self.status, self.reason = url, route, status, reason


def worker_release(worker, stale_only: bool = True) -> dict:
    """In one vLLM worker (``collective_rpc`` with this callable): release its ``one_sided``
    engine to a fresh server's state. With ``stale_only`` a registration whose store still
    answers (a trainer alive) is kept. Returns ``{"rank", "holder" ("host:port" or None),
    "alive", "released", "interrupted" (an update session was open), "mixed" (the update had
    begun writing the live bytes: no shadow), "version" (the last version committed)}``."""
    worker = getattr(worker, "worker", None) or worker  # vLLM's WorkerWrapperBase holds the worker
    eng = getattr(worker, "weight_transfer_engine", None)
    out: dict[str, Any] = {"rank": None, "holder": None, "alive": False, "released": False, "interrupted": False,
                           "mixed": False, "version": None}
    if "OneSidedWeightTransferEngine" not in {c.__name__ for c in type(eng).__mro__}:
        return out  # another backend's engine, or none (by name: the worker engine's module imports this one)
    out["rank"], out["version"], holder = eng.rank, eng.version, eng.holder
    out["holder"] = None if holder is None else f"{holder[0]}:{holder[1]}"
    if holder is not None and stale_only and store_alive(*holder):
        out["alive"] = True
        return out
    active = bool(getattr(worker, "_weight_update_active", False))
    out["interrupted"] = active
    out["mixed"] = active and eng.shadow is None and eng._active is not None
    if active:  # the session the dead trainer opened: closed as vLLM's finish_weight_update would
        try:
            eng.finish_weight_update()
            eng.reset_weight_update_target()
        finally:
            worker._weight_update_active = False
    eng.shutdown()
    out["released"] = holder is not None or active
    return out


def engine_core_recover(self, stale_only: bool = True, resume: bool = True) -> dict:
    """Run in vLLM's engine core (between two steps): :func:`worker_release` on every worker;
    when a released update had begun writing live bytes, vLLM's weight version becomes
    ``incomplete:<last version + 1>`` (the bytes are no complete version, C14) and the prefix
    cache is reset with running requests; when anything was released, ``resume`` and the
    scheduler is paused (the run that paused it is gone), it resumes. Returns ``{"workers", "label",
    "resumed", "released", "kept"}`` (``kept``: ``host:port`` of live registrations)."""
    from weight_transfer.engines.vllm.backend.config import INCOMPLETE

    res = self.collective_rpc(worker_release, args=(bool(stale_only),))
    released = any(r["released"] for r in res)
    if any(r["mixed"] for r in res):
        last = max((r["version"] for r in res if r["version"] is not None), default=0)
        self.set_weight_version(INCOMPLETE.format(version=last + 1))
        self.reset_prefix_cache(reset_running_requests=True)
    resumed = False
    if released and resume and self.is_scheduler_paused():
        self.resume_scheduler()
        resumed = True
    return {"workers": res, "label": self.get_weight_version(), "resumed": resumed, "released": released,
            "kept": sorted({r["holder"] for r in res if r["alive"]})}


def install(engine_core_cls, go_live) -> None:
    """Wrap ``engine_core_cls.collective_rpc`` (idempotent) so :data:`GO_LIVE_RPC` runs
    ``go_live(self, version, reset)`` and :data:`RECOVER_RPC` :func:`engine_core_recover` in
    the engine core, each answering a one-element list (what the route returns as JSON); before
    ``init_weight_transfer_engine`` reaches the workers of an engine serving a speculative-decoding
    draft, each worker hands its draft to its ``one_sided`` engine
    (:func:`weight_transfer.engines.vllm.worker.draft_targets.attach_draft_rpc`); every other method
    goes to the workers unchanged."""
    real = engine_core_cls.collective_rpc
    if getattr(real, "_wt_wrapped", False):
        return

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == GO_LIVE_RPC:
            version, reset = (list(args) + [True])[:2]
            return [go_live(self, int(version), _flag(reset))]
        if method == RECOVER_RPC:
            stale_only, resume = (list(args) + [True, True])[:2]
            return [engine_core_recover(self, _flag(stale_only), _flag(resume))]
        if method == "init_weight_transfer_engine" and draft_method(getattr(self, "vllm_config", None)):
            real(self, attach_draft_rpc, timeout, (), None)  # the draft registered with the target (C33)
        return real(self, method, timeout, args, kwargs)

    collective_rpc._wt_wrapped = True
    collective_rpc.__doc__ = real.__doc__
    engine_core_cls.collective_rpc = collective_rpc


def _flag(x) -> bool:
    """A boolean passed as a string over ``/collective_rpc`` (``"true"``/``"false"``) or as a bool."""
    return x if isinstance(x, bool) else str(x).strip().lower() in ("1", "true", "yes")


# ------------------------------------------------------------------ the trainer's side (HTTP)


def rpc_http(base_url: str, method: str, args: list, *, timeout: float, doing: str) -> Any:
    """``POST {base_url}/collective_rpc`` with ``method`` and string ``args``; the first result.
    :class:`ServerError` naming the URL, what was being done (``doing``) and the server's own
    reason (its error message) when it answers otherwise than 200 or not at all."""
    import requests

    url = f"{base_url.rstrip('/')}/collective_rpc"
    try:
        r = requests.post(url, json={"method": method, "args": [str(a) for a in args]}, timeout=timeout)
    except requests.RequestException as e:
        raise ServerError(f"the vLLM server at {base_url} did not answer {doing} (POST /collective_rpc): "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", url=base_url,
                          route="collective_rpc", status=None, reason=str(e)) from None
    if r.status_code != 200:
        why = server_message(r)
        hint = " (is VLLM_SERVER_DEV_MODE=1 set for the server?)" if r.status_code == 404 else ""
        raise ServerError(f"the vLLM server at {base_url} refused {doing} (POST /collective_rpc answered "
                          f"{r.status_code}{hint}): {why}", url=base_url, route="collective_rpc",
                          status=r.status_code, reason=why)
    return r.json()["results"][0]


def post_route(base_url: str, path: str, doing: str, *, who: str, timeout: float, **params) -> dict:
    """``POST {base_url}/{path}`` with query ``params``: its JSON answer (``{}`` when empty).
    :class:`weight_transfer.errors.ControlError` naming ``who``, the URL and ``doing`` when the
    server does not answer (dead, or a wrong URL); :class:`ServerError` with the server's own
    reason when it answers otherwise than 200."""
    import requests

    from weight_transfer.errors import ControlError

    try:
        r = requests.post(f"{base_url}/{path}", params=params or None, timeout=timeout)
    except requests.RequestException as e:
        raise ControlError(f"{who}: the vLLM server at {base_url} did not answer POST /{path} ({doing}): "
                           f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    if r.status_code != 200:
        why = server_message(r)
        raise ServerError(f"{who}: the vLLM server at {base_url} refused POST /{path} ({doing}): {r.status_code}: "
                          f"{why}", url=base_url, route=path, status=r.status_code, reason=why)
    return r.json() if r.content else {}


def wait_health(base_url: str, limit: float, *, who: str, setting: str) -> float:
    """Poll ``{base_url}/health`` once a second until it answers 200; returns the seconds waited.
    TimeoutError naming the URL and ``setting`` (the option that sets ``limit``) after ``limit``
    seconds; RuntimeError at once when something else answers there (404: not a vLLM server)."""
    import requests

    t0 = time.monotonic()
    last = "no answer"
    while True:
        try:
            r = requests.get(f"{base_url}/health", timeout=5)
            if r.status_code == 200:
                return time.monotonic() - t0
            if r.status_code == 404:
                raise RuntimeError(f"{who}: {base_url} answers, but has no /health (404): not a vLLM server's URL?")
            last = f"/health answered {r.status_code}"
        except requests.RequestException as e:
            last = type(e).__name__
        if time.monotonic() - t0 > limit:
            raise TimeoutError(f"{who}: the vLLM server at {base_url} did not answer /health within {limit:.0f} s "
                               f"({last}; {setting})")
        time.sleep(1.0)


def go_live_http(base_url: str, version: int, *, reset: bool = True, timeout: float = 300.0) -> dict:
    """The shadow go-live of a vLLM server (:data:`GO_LIVE_RPC`): one engine-core call between
    two steps, no ``/pause``. Returns ``{"seconds", "reset"}``; :class:`ServerError` otherwise,
    RuntimeError when vLLM refused the prefix-cache reset."""
    t0 = time.perf_counter()
    out = rpc_http(base_url, GO_LIVE_RPC, [int(version), bool(reset)], timeout=timeout,
                   doing=f"the go-live of version {version}")
    if reset and not out.get("reset", False):
        raise RuntimeError(f"the vLLM server at {base_url} refused to reset the prefix cache at the go-live")
    return {"seconds": time.perf_counter() - t0, "engine_s": out.get("seconds"), "reset": bool(out.get("reset"))}


def recover_http(base_url: str, *, stale_only: bool = True, resume: bool = True, timeout: float = 120.0) -> dict:
    """:func:`engine_core_recover` on the server at ``base_url`` (:data:`RECOVER_RPC`). Returns
    its answer; :class:`ServerError` when the server refuses or does not answer."""
    return rpc_http(base_url, RECOVER_RPC, [bool(stale_only), bool(resume)], timeout=timeout,
                    doing="the release of a previous training run (one_sided recovery)")
