"""``weight-transfer rl --metrics-port / --vllm-metrics-port``: the Prometheus metrics of every
push during the RL loop (docs/METRICS.md).

- The coordinator's (:class:`weight_transfer.metrics.UpdateMetrics`): the one_sided backend's
  coordinator in training rank 0 serves them (``OneSidedTrainerInitInfo(metrics=PORT)``).
- vLLM's own registry: the loop's vLLM is an offline ``LLM`` (no HTTP server), so training rank 0
  serves what a vLLM server's ``/metrics`` serves, ``get_prometheus_registry()``, in vLLM's
  multiprocess mode: :func:`prometheus_dir` sets ``PROMETHEUS_MULTIPROC_DIR`` before the
  trainers (and the vLLM processes they fork) start, so each vLLM worker's
  ``weight_transfer_worker_*`` metrics are written there and read at every scrape.
- After every push rank 0 scrapes both endpoints over HTTP and appends them to
  ``out_dir/rl_<tag>_metrics.jsonl`` (one JSON object per push: ``step``, ``version``, ``mode``,
  ``coordinator``, ``vllm``: the exposition texts; "" for an endpoint that is off).
"""
from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

__all__ = ["prometheus_dir", "coordinator_metrics", "scrapes", "Scrapes"]


def prometheus_dir(o, workdir: str | os.PathLike) -> str | None:
    """In the launching process, before the trainers start: with ``--vllm-metrics-port``, the
    ``PROMETHEUS_MULTIPROC_DIR`` every process started from here on writes its metrics into (an
    empty ``workdir/prometheus``; one already set is kept). Returns it (None without the flag)."""
    if o.vllm_metrics_port < 0:
        return None
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        d = Path(workdir) / "prometheus"
        d.mkdir(parents=True, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(d)
    return os.environ["PROMETHEUS_MULTIPROC_DIR"]


def coordinator_metrics(o, rank: int) -> int | None:
    """The one_sided backend's ``metrics`` init info on ``rank``: ``--metrics-port`` on training
    rank 0 (it hosts the coordinator), else None."""
    return o.metrics_port if rank == 0 and o.metrics_port >= 0 else None


def scrapes(o, rank: int, coordinator) -> Scrapes | None:
    """Training rank 0 with ``--metrics-port`` or ``--vllm-metrics-port``: its :class:`Scrapes`; else None."""
    return Scrapes(o, coordinator) if rank == 0 and (o.metrics_port >= 0 or o.vllm_metrics_port >= 0) else None


class Scrapes:
    """Training rank 0: the endpoints' URLs (the coordinator's from ``coordinator.metrics``, vLLM's
    registry served here), each printed once in one line (``metrics: URL``, ``vllm metrics:
    URL``), and :meth:`add` after each push."""

    def __init__(self, o, coordinator):
        self.path = Path(o.out_dir) / f"rl_{o.name}_metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        m = getattr(coordinator, "metrics", None)
        self.coordinator_url = m.url if m is not None else None
        self.vllm_url, self._server = None, None
        if o.vllm_metrics_port >= 0:
            from prometheus_client import start_http_server
            from vllm.v1.metrics.prometheus import get_prometheus_registry

            self._server, _ = start_http_server(o.vllm_metrics_port, addr="127.0.0.1",
                                                registry=get_prometheus_registry())
            self.vllm_url = f"http://127.0.0.1:{self._server.server_port}/metrics"
        if self.coordinator_url:
            print(f"metrics: {self.coordinator_url}", flush=True)
        if self.vllm_url:
            print(f"vllm metrics: {self.vllm_url}", flush=True)

    @staticmethod
    def _get(url: str | None) -> str:
        return urllib.request.urlopen(url, timeout=30).read().decode() if url else ""

    def add(self, step: int, version: int, mode: str | None = None) -> None:
        """Scrape both endpoints now (after the push of ``version``) and append the line."""
        rec = {"step": step, "version": version, "mode": mode or "", "coordinator": self._get(self.coordinator_url),
               "vllm": self._get(self.vllm_url)}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        """Stop serving vLLM's registry (the coordinator's endpoint ends with its process)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
