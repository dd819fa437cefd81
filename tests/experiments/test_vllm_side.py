"""No vLLM process outlives a trial (marked ``vllm``): not one that was refused at plan time,
and not one whose command was killed mid-trial with SIGKILL (no cleanup code of the command
runs). Each trial's processes are found by their session: the command is started as a session
leader, and every process it starts (the vLLM instance, vLLM's EngineCore and workers, a
verification engine) stays in that session, also once orphaned.

The refused trial is the tiny Qwen3 with :data:`weight_transfer.engines.vllm.extension.HIDE_AMX_ENV` (every
linear a oneDNN handle, as on CPUs without AMX) and ``--vllm-targets direct`` (nothing staged),
so the plan names the opaque layers and refuses, after the engine started.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT
from tests.helpers.processes import kill_session, tagged, wait_none_left
from weight_transfer.testing import tiny

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

TINY_QWEN3 = ["--model", tiny.TINY_QWEN3[0], "--quant", "none", "--tp", "1", "--n-train", "2",
              *tiny.override_args(tiny.TINY_QWEN3[1])]
"""The tiny dense Qwen3 of the vLLM tests (:data:`weight_transfer.testing.tiny.TINY_QWEN3`) as
``weight-transfer run`` arguments."""


@pytest.fixture()
def session_reaper():
    """Kills every process of the sessions a test started, whatever the test's outcome (a failed
    assertion must not leave a trial blocked on a full stdout pipe)."""
    sids: list[int] = []
    yield sids.append
    for sid in sids:
        kill_session(sid)


def start(args: list[str], tmp_path) -> subprocess.Popen:
    env = dict(os.environ, WT_VLLM_HIDE_AMX="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "weight_transfer.experiments", "run", "--engine", "vllm", *args,
                             "--results", str(tmp_path / "trials.csv")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def test_refused_trial_leaves_no_vllm_process(tmp_path, session_reaper):
    p = start([*TINY_QWEN3, "--vllm-targets", "direct", "--steps", "1", "--warmup", "0"], tmp_path)
    session_reaper(p.pid)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 2, out[-3000:]
    err = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "weight plan refused" in err[0] and "oneDNN handle" in out, out[-3000:]
    left = wait_none_left(p.pid)
    assert not left, f"left running after a refused trial: {left}"


def test_staged_trial_verified_then_sigkilled_leaves_no_vllm_process(tmp_path, session_reaper):
    """The trial path of C22, then a kill mid-trial. The tiny Qwen3 on the no-AMX path through
    the command (FSDP2 trainers, the controller's commit phase, the vLLM instance's commit and
    verification): the first update must verify (direct bytes, staging bytes and outputs against
    a fresh vLLM). Then, while the next update's verification engine starts, SIGKILL of the
    command: the instance gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``) and SIGKILLs its
    process group, which holds every vLLM process it started."""
    p = start([*TINY_QWEN3, "--steps", "3", "--warmup", "1"], tmp_path)
    session_reaper(p.pid)
    seen, t0 = [], time.monotonic()
    for line in p.stdout:
        seen.append(line)
        if line.startswith("[vllm 0] version 1:"):
            break
        assert time.monotonic() - t0 < 600, "".join(seen[-50:])
    log = "".join(seen)
    staged = [x for x in seen if x.startswith("[vllm 0] staged ")]
    # embed_tokens, lm_head and the 8 linears of 2 layers: every one a oneDNN handle without AMX
    assert staged and staged[0].startswith("[vllm 0] staged 10 layer(s)"), (staged, log[-3000:])
    assert "version 1: bytes ok, staging ok, outputs ok" in seen[-1], log[-3000:]
    assert p.poll() is None, log[-3000:]
    time.sleep(4.0)                                    # update 2 done; its verification engine starting
    vllm_procs = [c for _, c in tagged(p.pid) if "VLLM::" in c]
    assert len(vllm_procs) >= 2, f"no vLLM EngineCore/worker found before the kill (the check would prove nothing): " \
                                 f"{tagged(p.pid)}"
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    left = wait_none_left(p.pid)
    assert not left, f"left running after SIGKILL of the command: {left}"
