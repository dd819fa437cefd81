"""Prometheus metrics of every weight update (``prometheus_client``): where operators look.

Two sides, both named ``weight_transfer_...`` in base units (seconds, bytes; ratios 0..1), the
table and a sample scrape in docs/METRICS.md:

- :class:`UpdateMetrics`, the coordinator's: each completed update's phase seconds, bytes,
  writes, delta ratio, published version, go-live stall and fingerprint result, and every
  push that was refused or failed, by kind. :class:`weight_transfer.api.Coordinator` keeps one
  as ``coordinator.metrics`` (its ``metrics=`` argument: a port to serve, a caller's
  ``CollectorRegistry`` to register into, or an instance); nothing is exported without it.
  A custom collector over plain counts (no ``prometheus_client`` metric objects): two
  coordinators in one process never collide, and a process in ``prometheus_client``'s
  multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``) does not spill them into that directory.
- :class:`WorkerMetrics`, one inference rank's (the vLLM backend's workers): its commits, its
  go-lives, the version it serves, its target bytes, labelled ``rank``; ordinary metric objects
  in the process's default registry, so vLLM's own ``/metrics`` shows them -- directly when
  the worker runs in the API server's process, through ``PROMETHEUS_MULTIPROC_DIR`` (vLLM's
  multiprocess registry, :func:`vllm.v1.metrics.prometheus.get_prometheus_registry`)
  otherwise: see docs/METRICS.md for when vLLM sets it and when the operator must.

The phases of an update (wall seconds, from :class:`weight_transfer.api.update.UpdateResult` --
what the coordinator and the training ranks measured; nothing estimated). They overlap (the
pipeline prepares while it writes), so they do not add up to the update's seconds:

- ``prepare``: the slowest training rank's prepare stage -- the union of its tasks' prepare
  intervals (``full_tensor()``, fusion, cast, FP8 quantization; ``StepStats.stage_busy()``);
  not observed for methods without stages (the baselines);
- ``write``: from "go" to the last training rank's report that all its writes completed
  (``UpdateResult.write_seconds``; contains ``prepare``);
- ``commit``: from there to the last engine's commit -- ``seconds - write_seconds -
  verify_seconds``: staged layers post-processed, shadow targets gone live, vLLM's
  ``update_weights`` / ``finish_weight_update``; observed only for updates with a commit;
- ``go_live``: shadow targets only: the go-live the engines reported (the longest), or the
  vLLM backend's go-live calls as the trainer timed them (``go_live_s``: round trips included);
  it is part of ``commit``, and the engines' stall: :attr:`UpdateMetrics` sets the stall gauge
  from it;
- ``verify``: the end-to-end fingerprint check (``UpdateResult.verify_seconds``), when on.

``prometheus_client`` is imported on first use, not with this module: a process that never
asks for metrics does not import it, and so does not fix its value mode
(``PROMETHEUS_MULTIPROC_DIR`` is read at that import) before vLLM's processes fork from it.
"""
from __future__ import annotations

import bisect
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["UpdateMetrics", "WorkerMetrics", "metrics_arg", "recorded", "record_failure", "failure_kind",
           "phase_seconds", "delta_ratio", "PHASES", "BUCKETS", "FINGERPRINT_MISMATCH"]

PHASES = ("prepare", "write", "commit", "go_live", "verify")
"""The ``phase`` label's values (see the module docstring)."""
BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Histogram bucket upper bounds in seconds (plus ``+Inf``): 1 ms .. 60 s, 1-2.5-5 steps."""
OUTCOMES = ("ok", "failed", "refused")
"""``weight_transfer_updates_total``'s ``outcome``: completed; failed after its "go" (the
weights are then ``incomplete``, or untouched with shadow targets); ended before its "go" (a
refusal -- a version that does not increase, ranks asking for different versions, a refused
plan -- or ranks that were not ready): nothing was written."""
FINGERPRINT_MISMATCH = "fingerprint_mismatch"
"""The failure ``kind`` of an update whose end-to-end fingerprint check found different bytes:
an error (or one in its ``__cause__`` chain) with ``metrics_kind = FINGERPRINT_MISMATCH``
(``ControlError(msg, kind=...)``, raised by the controller's check); it also counts in
``weight_transfer_fingerprint_mismatches_total``."""
P = "weight_transfer_"


def failure_kind(e: BaseException) -> str:
    """The ``kind`` label of a failed or refused push: the first ``metrics_kind`` (a str) along
    ``e`` and its ``__cause__`` chain (e.g. :data:`FINGERPRINT_MISMATCH`), else ``e``'s type
    name (``ControlError``, ``VersionError``, ``PlanError``, ``ValueError`` ...)."""
    seen, x = set(), e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        kind = getattr(x, "metrics_kind", None)
        if isinstance(kind, str) and kind:
            return kind
        x = x.__cause__
    return type(e).__name__


def _commit_reports(result) -> list[dict]:
    return [c for c in (getattr(result, "commits", None) or {}).values() if isinstance(c, dict)]


def go_live_seconds(result) -> float | None:
    """Shadow targets: the longest go-live the update's engines reported (``("commit", i)``
    reports with a ``mode``: :meth:`weight_transfer.api.receiver.Receiver.go_live`'s stats), else
    the commit call's ``go_live_s`` (the vLLM backend with shadow targets); None without."""
    reports = _commit_reports(result)
    lives = [float(c["seconds"]) for c in reports if c.get("mode") in ("flip", "copy") and "seconds" in c]
    if lives:
        return max(lives)
    calls = [float(c["go_live_s"]) for c in reports if "go_live_s" in c]
    return max(calls) if calls else None


def phase_seconds(result) -> dict[str, float]:
    """``{phase: seconds}`` of a :class:`weight_transfer.api.update.UpdateResult`, the phases it
    measured (see the module docstring for each one's definition)."""
    out: dict[str, float] = {}
    busy = [s.stage_busy().get("prepare") for s in (result.stats or {}).values() if hasattr(s, "stage_busy")]
    busy = [b for b in busy if b is not None]
    if busy:
        out["prepare"] = max(busy)
    out["write"] = float(result.write_seconds)
    verify = float(getattr(result, "verify_seconds", 0.0) or 0.0)
    if result.commits:
        out["commit"] = max(0.0, float(result.seconds) - float(result.write_seconds) - verify)
    live = go_live_seconds(result)
    if live is not None:
        out["go_live"] = live
    if getattr(result, "verify", "off") not in (None, "off"):
        out["verify"] = verify
    return out


def delta_ratio(result) -> float | None:
    """Bytes written / bytes a full update writes (``StepStats.bytes_sent / full_bytes``, summed
    over training ranks): 1.0 for a full update, less for a delta; None when the ranks do not
    report a full size (the baselines)."""
    st = [s for s in (result.stats or {}).values() if getattr(s, "full_bytes", 0)]
    full = sum(s.full_bytes for s in st)
    return sum(s.bytes_sent for s in st) / full if full else None


class _Hist:
    """Cumulative-on-export histogram counts over :data:`BUCKETS`."""

    def __init__(self):
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, v)] += 1
        self.sum += v

    def buckets(self) -> list[tuple[str, int]]:
        from prometheus_client.utils import floatToGoString

        out, acc = [], 0
        for le, n in zip((*BUCKETS, float("inf")), self.counts):
            acc += n
            out.append((floatToGoString(le), acc))
        return out


class UpdateMetrics:
    """The coordinator's metrics of every update (see the module docstring and docs/METRICS.md):
    a ``prometheus_client`` collector registered into ``registry`` (the caller's
    ``CollectorRegistry``; default: a private one, never the global ``REGISTRY``, so two
    coordinators of one process do not collide). :meth:`observe` takes each completed
    :class:`weight_transfer.api.update.UpdateResult`, :meth:`failed` each refused or failed push;
    :meth:`serve` exports :attr:`registry` over HTTP. Thread-safe. ValueError (from
    ``prometheus_client``) when ``registry`` already has these names."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry

        self._lock = threading.Lock()
        self._phase = {p: _Hist() for p in PHASES}
        self._total = _Hist()
        self._outcomes = dict.fromkeys(OUTCOMES, 0)
        self._kinds: dict[str, int] = {}
        self._bytes = self._writes = self._verified = self._mismatches = 0
        self._checks: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self.server, self._addr = None, "127.0.0.1"
        self.port: int | None = None
        """The port :meth:`serve` bound (None until then)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        """The ``CollectorRegistry`` these metrics are in (scrape it, or :meth:`serve` it)."""
        self.registry.register(self)

    # ------------------------------------------------------------------ recording
    def observe(self, result) -> None:
        """One completed update (a :class:`weight_transfer.api.update.UpdateResult`): its phases
        into the phase histogram, its seconds into the update histogram, bytes and writes into
        their counters, and the last-update gauges (version, bytes, seconds, delta ratio,
        stall, timestamp); a fingerprint check's verified bytes."""
        phases, ratio, live = phase_seconds(result), delta_ratio(result), go_live_seconds(result)
        mode = getattr(result, "verify", "off") or "off"
        with self._lock:
            for p, s in phases.items():
                self._phase[p].observe(s)
            self._total.observe(float(result.seconds))
            self._outcomes["ok"] += 1
            self._bytes += int(result.bytes)
            self._writes += int(result.n_writes)
            if mode != "off":
                self._checks[mode] = self._checks.get(mode, 0) + 1
                self._verified += int(getattr(result, "verified_bytes", 0) or 0)
            last = {"version": float(result.version), "bytes": float(result.bytes), "seconds": float(result.seconds),
                    "timestamp": time.time()}
            if ratio is not None:
                last["delta_ratio"] = ratio
            if live is not None:
                last["stall"] = live
            self._last.update(last)

    def failed(self, error: BaseException, *, before_go: bool = False) -> None:
        """One push that did not complete: ``outcome="refused"`` when it ended before its "go"
        (``before_go``), else ``"failed"``; ``kind`` from :func:`failure_kind`."""
        kind = failure_kind(error)
        with self._lock:
            self._outcomes["refused" if before_go else "failed"] += 1
            self._kinds[kind] = self._kinds.get(kind, 0) + 1
            if kind == FINGERPRINT_MISMATCH:
                self._mismatches += 1

    # ------------------------------------------------------------------ export
    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve :attr:`registry` at ``http://addr:port/metrics`` (any path answers) from a
        daemon thread (``prometheus_client.start_http_server``); ``port=0``: a free one.
        Returns the bound port (also :attr:`port`); RuntimeError when already serving,
        OSError when the port cannot be bound."""
        from prometheus_client import start_http_server

        if self.server is not None:
            raise RuntimeError(f"UpdateMetrics: already serving at {self.url}")
        self.server, _ = start_http_server(int(port), addr=addr, registry=self.registry)
        self.port, self._addr = int(self.server.server_port), addr
        return self.port

    @property
    def url(self) -> str | None:
        """``http://addr:port/metrics`` once served, else None."""
        return f"http://{self._addr}:{self.port}/metrics" if self.server is not None else None

    def close(self) -> None:
        """Stop serving (the metrics stay in :attr:`registry`)."""
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def text(self) -> str:
        """The exposition text of :attr:`registry` (what a scrape returns)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def describe(self):
        """The metric families without samples (for the registry's name-collision check)."""
        return self._families(empty=True)

    def collect(self):
        """The metric families with their current samples (called by the registry at a scrape)."""
        with self._lock:
            return self._families()

    def _families(self, empty: bool = False) -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        def counter(name, doc, labels=None, values=None):
            f = CounterMetricFamily(P + name, doc, labels=labels)
            for k, v in ({} if empty else values).items():
                f.add_metric([k] if labels else [], v)
            return f

        phase = HistogramMetricFamily(P + "update_phase_seconds", "Wall seconds of each phase of a completed update "
                                      "(phases overlap; docs/METRICS.md defines each).", labels=["phase"])
        total = HistogramMetricFamily(P + "update_seconds", "Wall seconds of a completed update, go to the last "
                                      "write completion or engine commit (UpdateResult.seconds).")
        if not empty:
            for p, h in self._phase.items():
                phase.add_metric([p], h.buckets(), h.sum)
            total.add_metric([], self._total.buckets(), self._total.sum)
        gauges = {"weights_version": ("version", "The weight version the last completed update published."),
                  "last_update_bytes": ("bytes", "Bytes the last completed update wrote into inference memory."),
                  "last_update_seconds": ("seconds", "Wall seconds of the last completed update."),
                  "last_update_delta_ratio": ("delta_ratio", "Bytes the last update wrote / bytes a full update "
                                              "writes (1: full; less: a delta update)."),
                  "last_update_stall_seconds": ("stall", "Shadow targets: seconds of the last update's go-live, "
                                                "the engines' stall (docs/METRICS.md)."),
                  "last_update_timestamp_seconds": ("timestamp", "Unix time the last update completed.")}
        out = [phase, total,
               counter("updates", "Pushes by outcome: ok, failed (after go), refused (before go: nothing written).",
                       ["outcome"], self._outcomes),
               counter("update_failures", "Pushes that failed or were refused, by kind (the error's type, or "
                       "fingerprint_mismatch).", ["kind"], self._kinds),
               counter("update_bytes", "Bytes written into inference memory by completed updates.", None,
                       {"": self._bytes}),
               counter("update_writes", "One-sided writes posted by completed updates.", None, {"": self._writes}),
               counter("fingerprint_checks", "Completed updates whose end-to-end fingerprint check matched, by "
                       "mode (sample, full).", ["mode"], self._checks),
               counter("fingerprint_verified_bytes", "Bytes of inference memory whose fingerprint matched the "
                       "training side's.", None, {"": self._verified}),
               counter("fingerprint_mismatches", "Updates whose fingerprint check found different bytes.", None,
                       {"": self._mismatches})]
        for name, (key, doc) in gauges.items():
            g = GaugeMetricFamily(P + name, doc)
            if not empty and key in self._last:
                g.add_metric([], self._last[key])
            out.append(g)
        return out


def metrics_arg(metrics, *, where: str = "Coordinator") -> tuple[UpdateMetrics | None, Callable[[], None]]:
    """A coordinator's ``metrics=`` argument, checked before the store is reached:
    ``(UpdateMetrics or None, serve)``, ``serve()`` to call once the store answered (it binds
    the port asked for; a no-op otherwise). None: off; an int: a port (0: a free one,
    :attr:`UpdateMetrics.port` once served); a ``prometheus_client.CollectorRegistry``: metrics
    registered into it; an :class:`UpdateMetrics`: itself. TypeError for another type
    (``bool`` included), ValueError for a port out of 0..65535 or a registry that already has
    these metrics."""
    import numbers

    from .args import check_int

    def nothing() -> None:
        return None

    if metrics is None:
        return None, nothing
    if isinstance(metrics, UpdateMetrics):
        return metrics, nothing
    if isinstance(metrics, numbers.Integral) and not isinstance(metrics, bool):
        port, m = check_int(metrics, "metrics", where=where, lo=0, hi=65535), UpdateMetrics()

        def serve() -> None:
            m.serve(port)
        return m, serve
    from prometheus_client import CollectorRegistry

    if isinstance(metrics, CollectorRegistry):
        try:
            return UpdateMetrics(metrics), nothing
        except ValueError as e:
            raise ValueError(f"{where}: metrics=: the registry already has these metrics ({e})") from None
    raise TypeError(f"{where}: metrics={metrics!r} is a {type(metrics).__name__}; None, a port (int), a "
                    "prometheus_client.CollectorRegistry or a weight_transfer.metrics.UpdateMetrics is required")


def recorded(metrics: UpdateMetrics | None, update: Callable[[], Any]):
    """``update()`` (an update after its "go", returning its UpdateResult), observed into
    ``metrics`` when there are any: the result, or the error it raised (``outcome="failed"``,
    raised again)."""
    try:
        result = update()
    except BaseException as e:
        record_failure(metrics, e)
        raise
    if metrics is not None:
        metrics.observe(result)
    return result


def record_failure(metrics: UpdateMetrics | None, error: BaseException, *, before_go: bool = False) -> None:
    """:meth:`UpdateMetrics.failed` when there are metrics (None: nothing)."""
    if metrics is not None:
        metrics.failed(error, before_go=before_go)


# ------------------------------------------------------------------------------ inference side

_WORKER: dict[int, tuple] = {}
_WORKER_LOCK = threading.Lock()


def _multiprocess_values() -> None:
    """Honour ``PROMETHEUS_MULTIPROC_DIR`` in this process even when ``prometheus_client`` was
    imported before it was set: its value mode is fixed at import, and vLLM's processes fork
    from one that may have imported it earlier (``vllm serve --api-server-count N`` sets the
    variable only after). Without this, this worker's values would stay in its own memory,
    where vLLM's ``/metrics`` (another process) never reads them."""
    from prometheus_client import values

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR") and not getattr(values.ValueClass, "_multiprocess", False):
        values.ValueClass = values.MultiProcessValue()


def _worker_families(registry) -> tuple:
    """The inference side's metric objects of this process (made once per registry)."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    registry = REGISTRY if registry is None else registry
    with _WORKER_LOCK:
        if id(registry) not in _WORKER:
            _multiprocess_values()
            W = P + "worker_"
            _WORKER[id(registry)] = (
                Histogram(W + "commit_seconds", "Wall seconds of this inference rank's commit of an update "
                          "(update_weights: checks, packed deltas applied, staged layers post-processed or the "
                          "shadow go-live).", ["rank"], buckets=BUCKETS, registry=registry),
                Histogram(W + "go_live_seconds", "Shadow targets: wall seconds of this rank's go-live (the "
                          "engine's stall).", ["rank"], buckets=BUCKETS, registry=registry),
                Counter(W + "commits", "Commits of this inference rank by outcome (ok, failed).", ["rank", "outcome"],
                        registry=registry),
                Counter(W + "committed_bytes", "Bytes this rank's commits post-processed or copied live (staged "
                        "layers, shadow copies).", ["rank"], registry=registry),
                Gauge(W + "weights_version", "The weight version this inference rank last committed.", ["rank"],
                      multiprocess_mode="mostrecent", registry=registry),
                Gauge(W + "target_bytes", "Bytes of this rank's registered targets (what a full update writes).",
                      ["rank"], multiprocess_mode="mostrecent", registry=registry))
        return _WORKER[id(registry)]


class WorkerMetrics:
    """One inference rank's side of each update (``rank``: its inference rank, the ``rank``
    label), in ``registry`` (default: ``prometheus_client.REGISTRY``, the registry vLLM's
    ``/metrics`` serves; in multiprocess mode, values written under ``PROMETHEUS_MULTIPROC_DIR``
    for vLLM's multiprocess collector). One set of metric objects per process and registry,
    shared by the ranks of a process. Recording never raises: a metrics error is said once
    on stderr and the update goes on."""

    def __init__(self, rank: int, registry=None):
        self.rank, self._registry, self._warned = str(int(rank)), registry, False

    def _families(self):
        return _worker_families(self._registry)

    def _safely(self, f) -> None:
        try:
            f(*self._families())
        except Exception as e:  # metrics must never fail an update
            if not self._warned:
                self._warned = True
                print(f"weight_transfer.metrics: inference rank {self.rank}: metrics not recorded: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def targets(self, nbytes: int) -> None:
        """The bytes of this rank's registered targets (after each registration)."""
        self._safely(lambda c, g, n, b, v, t: t.labels(self.rank).set(int(nbytes)))

    def committed(self, version: int, seconds: float, stats: dict | None = None) -> None:
        """A commit of ``version`` that took ``seconds``; ``stats``: the commit's report
        (``bytes``; with shadow targets a ``mode`` and the go-live's ``seconds``)."""
        stats = stats if isinstance(stats, dict) else {}

        def rec(c, g, n, b, v, t):
            c.labels(self.rank).observe(float(seconds))
            n.labels(self.rank, "ok").inc()
            b.labels(self.rank).inc(int(stats.get("bytes") or 0))
            v.labels(self.rank).set(int(version))
            if stats.get("mode") in ("flip", "copy") and "seconds" in stats:
                g.labels(self.rank).observe(float(stats["seconds"]))
        self._safely(rec)

    def failed(self) -> None:
        """A commit that raised."""
        self._safely(lambda c, g, n, b, v, t: n.labels(self.rank, "failed").inc())

    @contextlib.contextmanager
    def commit(self, version: int, stats: Any = None):
        """Time the block as a commit of ``version``: :meth:`committed` when it returns (its
        report: ``stats()``, a callable read after the block), :meth:`failed` when it raises."""
        t0 = time.perf_counter()
        try:
            yield
        except BaseException:
            self.failed()
            raise
        self.committed(version, time.perf_counter() - t0, stats() if callable(stats) else stats)
