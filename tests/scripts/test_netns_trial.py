"""Multi-host on one machine: training and inference sides in two network namespaces (veth
pair, 10.77.0.1/24 <-> 10.77.0.2/24 inside the namespaces only), weights moved with NIXL over
TCP, verified bit-exact, and the veth's receive counter shows the bytes crossed the link.

Skipped without root / ``ip netns`` permission, or without NIXL. The commands they run are the
documented ones (docs/TRANSPORTS.md): ``python scripts/netns_demo.py`` (a raw buffer) and
``python scripts/netns_trial.py`` (a whole trial: controller + training ranks in one namespace,
inference ranks in the other, a small Qwen3 variant, 1 + 1 ranks, ~17 s here).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

spec = importlib.util.spec_from_file_location("netns_demo", ROOT / "scripts" / "netns_demo.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]


def _skip_reason() -> str | None:
    ok, why = demo.netns_supported()
    if not ok:
        return f"network namespaces not permitted here: {why}"
    try:
        from weight_transfer.transport.nixl import load_nixl

        load_nixl()
    except ImportError as e:
        return f"NIXL not installed: {e}"
    return None


def test_nixl_over_tcp_between_namespaces():
    why = _skip_reason()
    if why:
        pytest.skip(why)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "netns_demo.py"), "--mib", "8", "--ops", "33"],
                       capture_output=True, text=True, timeout=110, cwd=ROOT)
    line = next((x for x in r.stdout.splitlines() if x.startswith("netns demo:")), "")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bit-exact: True" in line and "(>= payload: True)" in line, line
    # namespaces cleaned up
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "wt-train-" not in left and "wt-infer-" not in left, left


SMALL = ["--model", "qwen3-0.6b", "--override", "num_hidden_layers=2", "--override", "vocab_size=1000",
         "--override", "hidden_size=256", "--override", "intermediate_size=512", "--override", "num_attention_heads=4",
         "--override", "num_key_value_heads=2", "--override", "head_dim=64"]


def test_whole_trial_between_namespaces():
    """``scripts/netns_trial.py``: controller + training rank in one namespace, inference rank in
    the other, transport nixl over TCP on the veth; every update verified bit-exact, the
    inference-side veth received at least the bytes of every update, namespaces removed."""
    why = _skip_reason()
    if why:
        pytest.skip(why)
    import re

    cmd = [sys.executable, os.path.join(ROOT, "scripts", "netns_trial.py"), *SMALL,
           "--n-train", "1", "--tp", "1", "--steps", "2", "--warmup", "1", "--no-csv", "--timeout", "60"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=110, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    line = next((x for x in r.stdout.splitlines() if x.startswith("netns trial:")), "")
    assert "transport nixl over veth: verified 3/3;" in line and "veth check: True" in line, r.stdout
    m = re.search(r"veth rx (\d+) >= (\d+) bytes written", line)
    assert m and int(m.group(1)) >= int(m.group(2)) > 0, line
    rows = [x for x in r.stdout.splitlines() if re.match(r"^\s+\d+\s+\d+\s", x)]
    assert len(rows) == 3 and all(" yes" in x for x in rows), r.stdout
    assert "transport=nixl" in r.stdout
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "wt-train-" not in left and "wt-infer-" not in left, left


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rate_limited_link_paired_full_and_delta(tmp_path):
    """``--link-rate``: a tc token bucket on the training veth; the report states the rate, the
    memory:wire ratio, the veth and bucket counters, the wire-bound check (the small model's full
    update at 40 Mbit/s is ~1 s of wire) and the full-against-delta table of paired pushes, every
    update verified; the rows land in --wire-csv with the link's columns. ~35 s here (slow: the
    wire is the point)."""
    why = _skip_reason()
    if why:
        pytest.skip(why)
    import csv

    out = tmp_path / "wire.csv"
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "netns_trial.py"), *SMALL, "--n-train", "1", "--tp", "1",
           "--steps", "2", "--warmup", "2", "--timeout", "60", "--link-rate", "40mbit", "--delta", "--delta-pairs",
           "--change-fraction", "0.01", "--results", str(tmp_path / "trials.csv"), "--wire-csv", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "tbf rate 40.000 Mbit/s" in r.stdout and "burst 131072 B" in r.stdout and "memory:wire" in r.stdout
    assert "overlimits" in r.stdout and "wire-bound check:" in r.stdout and ": wire-bound" in r.stdout
    assert "delta/full p50:" in r.stdout and "every update verified bit-exact: True" in r.stdout
    rows = list(csv.DictReader(open(out)))
    assert len(rows) == 4 and {x["pair_mode"] for x in rows} == {"full", "delta"}
    assert all(int(x["link_rate_bits"]) == 40_000_000 and int(x["link_tx_bytes"]) > 0 for x in rows)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "wt-train-" not in left and "wt-infer-" not in left, left


# ---- without namespaces: what the launcher hands its tasks (no NIXL, no root needed) ----------


def _netns_trial():
    spec = importlib.util.spec_from_file_location("netns_trial", ROOT / "scripts" / "netns_trial.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("netns_trial", mod)  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


def test_tasks_get_the_job_secret_in_their_environment_only(monkeypatch):
    """The controller task serves the store, the others connect: every task's environment holds
    one secret, made by the launcher unless its own environment has one; the opt-out passes on."""
    from weight_transfer.security.secret import ENV_INSECURE, ENV_SECRET, ENV_SECRET_FILE, JobSecret

    nt = _netns_trial()
    for var in (ENV_SECRET, ENV_SECRET_FILE, ENV_INSECURE):
        monkeypatch.delenv(var, raising=False)
    a, b = nt.task_env(), nt.task_env()
    assert JobSecret.parse(a[ENV_SECRET]).hex() == a[ENV_SECRET] != b[ENV_SECRET]  # one per launch
    assert ENV_SECRET not in os.environ
    mine = JobSecret.generate().hex()
    monkeypatch.setenv(ENV_SECRET, mine)
    assert nt.task_env()[ENV_SECRET] == mine
    monkeypatch.delenv(ENV_SECRET)
    monkeypatch.setenv(ENV_INSECURE, "1")
    assert ENV_SECRET not in nt.task_env() and nt.task_env()[ENV_INSECURE] == "1"


def test_config_and_result_files_are_data():
    """``--cfg`` is the TrialConfig as JSON, ``--result`` the TrialResult as msgpack: both round
    trip exactly (NaN kept), and a field no part has, or of the wrong type, is refused by name."""
    import json
    import math

    from weight_transfer.experiments.config import TrialConfig
    from weight_transfer.experiments.data import config_from_json, config_to_json, result_from_bytes, result_to_bytes
    from weight_transfer.experiments.trial import TrialResult

    cfg = TrialConfig.from_flat(model="qwen3-0.6b", overrides={"num_hidden_layers": 2}, n_train=1, tp=1,
                                transport="nixl", delta=True, change_fraction=(0.01, 0.5), watermark=1 << 20)
    raw = config_to_json(cfg)
    assert config_from_json(raw) == cfg and raw.lstrip()[:1] == b"{"
    d = json.loads(raw)
    d["run"]["steps"] = "3"
    with pytest.raises(ValueError, match=r"Expected `int`, got `str` - at `\$.run.steps`"):
        config_from_json(json.dumps(d))
    d = json.loads(raw)
    d["transfer"]["executor"]["evil"] = 1
    with pytest.raises(ValueError, match=r"\$.transfer.executor.evil is not in TrialConfig"):
        config_from_json(json.dumps(d))
    rows = [{"step": 1, "seconds": 0.25, "verified": True, "error": None, "p": float("nan"), "layout": "tp=1"}]
    res = TrialResult(cfg, rows, "plan: 3 tasks", 0.5, 12.5, {"host": "h", "cpus": 2})
    back = result_from_bytes(result_to_bytes(res))
    assert back.cfg == cfg and back.env == res.env and back.schedule_summary == res.schedule_summary
    assert math.isnan(back.rows[0].pop("p")) and back.rows == [{k: v for k, v in rows[0].items() if k != "p"}]
    with pytest.raises(ValueError, match="trial result"):
        result_from_bytes(b"\x80\x04N.")
