"""A vLLM OpenAI server for the tests: ``python -m vllm.entrypoints.openai.api_server`` with the
``one_sided`` weight-transfer backend (tests/engines/vllm/backend/test_plugin.py, test_shadow.py)."""
from __future__ import annotations

import contextlib
import os
import socket
import time

LIVE_CPU = str(min(os.sched_getaffinity(0)))
"""The one CPU a live engine's worker computes on (``VLLM_CPU_OMP_THREADS_BIND``)."""
MAX_TOKENS = 6


@contextlib.contextmanager
def env_vars(**kv):
    """Set environment variables (None: unset) for the ``with`` block, then restore them
    (vLLM reads its ``VLLM_*`` variables when its processes start)."""
    old = {k: os.environ.get(k) for k in kv}
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m vllm.entrypoints.openai.api_server --weight-transfer-config '{"backend":
    "one_sided"}'`` (``vllm serve`` fails on vllm-cpu with PackageNotFoundError) with
    ``VLLM_SERVER_DEV_MODE=1`` for the weight-transfer routes."""

    def __init__(self, model_dir, log, *, amx: str = "hide", extra: tuple[str, ...] = ()):
        import subprocess
        import sys

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # on an AMX host vllm-cpu 0.32's server (unlike LLM/AsyncLLM) dies at its first request with SIGILL in
        # cpu_attention_with_kv_cache (AMX attention), with or without this backend. amx="hide":
        # WT_VLLM_HIDE_AMX=1 (vLLM's no-AMX path: staged layers); "init": WT_VLLM_INIT_AMX=1 (the host's own
        # path, the AMX tile state requested in every vLLM process)
        amx_env = {"WT_VLLM_HIDE_AMX": "1"} if amx == "hide" else {"WT_VLLM_INIT_AMX": "1"}
        env = dict({k: v for k, v in os.environ.items() if k not in ("WT_VLLM_HIDE_AMX", "WT_VLLM_INIT_AMX")},
                   VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=LIVE_CPU, **amx_env)
        self.log = open(log, "w")
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--port", str(self.port), "--host", "127.0.0.1", "--weight-transfer-config",
                    '{"backend": "one_sided"}', "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16",
                    "--max-model-len", "1024", "--max-num-seqs", "4", "--seed", "0", "--enable-prefix-caching", *extra]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 400.0) -> float:
        import requests

        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: " + self.tail())
            try:
                if requests.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready in {timeout} s: " + self.tail())

    def tail(self) -> str:
        self.log.flush()
        return "\n".join(open(self.log.name).read().splitlines()[-20:])

    def post(self, path: str, **kw):
        import requests

        r = requests.post(f"{self.url}/{path}", timeout=120, **kw)
        r.raise_for_status()
        return r.json()

    def generate(self, prompts) -> list:
        out = []
        for p in prompts:
            c = self.post("v1/completions", json={"model": self.cmd[4], "prompt": list(p), "max_tokens": MAX_TOKENS,
                                                   "temperature": 0.0, "logprobs": 0, "ignore_eos": True,
                                                   "return_token_ids": True, "return_tokens_as_token_ids": True,
                                                   })["choices"][0]
            out.append((list(c["token_ids"]), [float(x) for x in c["logprobs"]["token_logprobs"]]))
        return out

    def close(self):
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except Exception:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
