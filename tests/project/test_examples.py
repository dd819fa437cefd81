"""examples/train_and_push.py, as the README runs it: 2 FSDP2 ranks train a 2-layer Qwen3 with
AdamW on a next-token loss and push after every step into 2 inference ranks; every update is
verified byte for byte there against the engine's own load_weights of the gathered weights.
The loss must fall, and the file must stay within the 60 lines the README promises."""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

EXAMPLE = ROOT / "examples" / "train_and_push.py"


def test_the_example_is_at_most_60_lines():
    assert len(EXAMPLE.read_text().splitlines()) <= 60


@pytest.mark.multiproc
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="the example's model is transformers' Qwen3ForCausalLM (installed with vLLM: make vllm)")
def test_train_and_push_learns_and_every_update_is_verified(tmp_path):
    env = {"WT_EXAMPLE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, str(EXAMPLE), "3"], capture_output=True, text=True, timeout=480, env=env,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    steps = re.findall(r"step (\d+): loss ([\d.]+), pushed ([\d.]+) MB in [\d.]+ s \(.*\), (\S+) on 2", p.stdout)
    assert [int(s) for s, *_ in steps] == [1, 2, 3], p.stdout
    assert all(v == "verified" for *_, v in steps), p.stdout
    losses = [float(x) for _, x, _, _ in steps]
    assert losses[-1] < losses[0], losses
    assert all(float(mb) > 70 for _, _, mb, _ in steps)  # the whole 2-layer model (bf16) every step
