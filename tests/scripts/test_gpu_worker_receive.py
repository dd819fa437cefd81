"""scripts/gpu_worker_receive.py (issue 42 item 3, gpu_check.sh's ``worker_cuda`` step): the
vLLM worker engine's register-and-publish path over a module, written by another process. Here:
the whole run on the host (``--device cpu``: ``cma``, the same code as on a GPU but for the
transport), the skip without CUDA (exit 77, the reason last) and the argument errors. On a GPU
the run itself is the ``worker_cuda`` step (not duplicated in the ``tests`` step)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "gpu_worker_receive.py"


def run(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=env, check=False, timeout=timeout)


@pytest.mark.multiproc
def test_host_run_every_check_passes():
    """``--device cpu``: transport chosen ``cma``, one region of 6 parts (one per parameter
    allocation), published; the sender process writes every tensor and its write between two
    parts is refused; every parameter holds the new bytes; cuda_ipc forced and a meta tensor are
    refused naming the tensor and the device."""
    r = run("--device", "cpu", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "FAIL" not in out and out.count("[worker 0] ok ") == 10, out
    assert "transport chosen from the tensors' memory: cma" in out
    assert "one region of 6 parts (one per allocation)" in out
    assert "tensor '0.weight' is on device cpu, which transport 'cuda_ipc' cannot register" in out
    assert "tensor 'meta.weight' is on device meta, which no transport registers" in out
    assert "a write between two parts refused: BoundsError: op 1: remote bytes" in out
    assert "every parameter holds the new weights byte for byte (6/6)" in out
    assert out.strip().splitlines()[-1].startswith("worker_cpu: cma, 6 parameters in 6 allocations -> 1 region of 6 parts")


def test_cuda_without_cuda_is_a_skip_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the run is gpu_check.sh's worker_cuda step")
    r = run("--device", "cuda", timeout=60)
    assert r.returncode == 77, r.stdout + r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("skipped: --device cuda but torch.cuda.is_available() is False here (torch ")
    assert "the worker's cuda_ipc registration needs a GPU" in last


@pytest.mark.parametrize("args, msg", [(["--device", "tpu"], "invalid choice: 'tpu'"),
                                       (["--timeout", "0"], "--timeout 0.0: seconds > 0"),
                                       (["--bogus"], "unrecognized arguments: --bogus")])
def test_bad_arguments_exit_2(args, msg):
    r = run(*args, timeout=60)
    assert r.returncode == 2 and msg in r.stderr, r.stdout + r.stderr
