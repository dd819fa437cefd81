"""Replayed RL steps (weight_transfer.testing.replay): the saved-steps format round-trips
bit-exact (and is the safetensors format), any slice of any step reads back exactly, bad
directories and other models are refused naming the cause; a tiny saved run replayed through a
real loopback trial with paired full/delta pushes is verified bit-exact at every update."""
from __future__ import annotations

import json
import os

import pytest
import torch

from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.replay import ReplayCheckpoint, ReplaySteps, read_header, save_step, step_path
from weight_transfer.testing.weights import SyntheticCheckpoint

SMALL = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def _save_run(d, n_steps: int, change=(0.02,)) -> list[dict]:
    """A tiny 'RL run': steps 0..n_steps of synthetic weights changing ``change`` per step, saved."""
    specs = param_specs(load_config("qwen3-0.6b", **SMALL))
    out = []
    for s in range(n_steps + 1):
        w = dict(SyntheticCheckpoint(specs, step=s + 1, seed=7, change=change))
        save_step(str(d), s, w, info={"lr": 1e-6, "model": "qwen3-0.6b"})
        out.append(w)
    return out


def test_round_trip_slices_and_safetensors_compat(tmp_path):
    saved = _save_run(tmp_path, 2)
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["steps"] == [0, 1, 2] and man["dtype"] == "bfloat16" and man["lr"] == 1e-6
    rp = ReplaySteps(str(tmp_path), start=1)
    assert rp.n_trial_steps == 2 and rp.saved_step(1) == 1 and rp.saved_step(2) == 2
    name = "model.layers.1.mlp.gate_proj.weight"
    full = saved[2][name]
    # any box, any dtype: exact (bf16 -> fp32 is exact)
    box = ((3, 77), (10, 200))
    got = rp.param_box(name, tuple(full.shape), box, step=2, dtype="bfloat16")
    assert torch.equal(got.view(torch.int16), full[3:77, 10:200].contiguous().view(torch.int16))
    out = torch.empty(74, 190, dtype=torch.float32)
    rp.param_box(name, tuple(full.shape), box, step=2, dtype=torch.float32, out=out)
    assert torch.equal(out, full[3:77, 10:200].float())
    ck = ReplayCheckpoint(rp, param_specs(load_config("qwen3-0.6b", **SMALL)), step=1)
    assert all(torch.equal(ck[n].view(torch.int16), saved[1][n].view(torch.int16)) for n in ck.names())
    # the file is plain safetensors
    st = pytest.importorskip("safetensors.torch")
    loaded = st.load_file(step_path(str(tmp_path), 2))
    assert set(loaded) == set(saved[2]) and all(torch.equal(loaded[n], saved[2][n]) for n in loaded)
    header, base = read_header(step_path(str(tmp_path), 0))
    assert base % 8 == 0 and header[name]["dtype"] == "BF16"


def test_refusals_name_the_cause(tmp_path):
    with pytest.raises(ValueError, match="no manifest.json"):
        ReplaySteps(str(tmp_path))
    _save_run(tmp_path, 1)
    with pytest.raises(ValueError, match="start step 5 not saved"):
        ReplaySteps(str(tmp_path), start=5)
    rp = ReplaySteps(str(tmp_path))
    with pytest.raises(ValueError, match="trial step 3 wants saved step 2"):
        rp.saved_step(3)
    other = param_specs(load_config("qwen3-0.6b", **{**SMALL, "vocab_size": 2000}))
    with pytest.raises(ValueError, match="not this model's"):
        rp.check_specs(other)
    os.remove(step_path(str(tmp_path), 1))
    with pytest.raises(ValueError, match="missing step files"):
        ReplaySteps(str(tmp_path))


def test_config_maps_pairs_and_refuses_bad_replays(tmp_path):
    from weight_transfer.experiments.config import TrialConfig

    _save_run(tmp_path, 2)
    base = dict(model="qwen3-0.6b", overrides=SMALL, n_train=1, tp=1, timeout=60)
    cfg = TrialConfig.from_flat(**base, replay=str(tmp_path), delta=True, delta_pairs=True, warmup=2, steps=4)
    run = cfg.run
    assert [run.source_step(s) for s in range(1, 7)] == [1, 1, 2, 2, 3, 3]
    assert [run.push_mode(s) for s in range(1, 7)] == ["full", "delta", "delta", "full", "full", "delta"]
    with pytest.raises(ValueError, match="needs 4 saved steps from 0, 3 are saved"):
        TrialConfig.from_flat(**base, replay=str(tmp_path), delta=True, delta_pairs=True, warmup=2, steps=6)
    with pytest.raises(ValueError, match="not this model's"):
        TrialConfig.from_flat(**{**base, "overrides": {**SMALL, "vocab_size": 2000}}, replay=str(tmp_path), steps=1)
    with pytest.raises(ValueError, match="--delta-pairs without --delta"):
        TrialConfig.from_flat(**base, delta_pairs=True)
    with pytest.raises(ValueError, match="--replay with --change-fraction"):
        TrialConfig.from_flat(**base, replay=str(tmp_path), change_fraction=(0.1,))


@pytest.mark.multiproc
@pytest.mark.timeout(180)
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_replayed_steps_through_a_loopback_trial_paired(tmp_path, quant):
    """A saved 3-step run replayed (from saved step 1) through the real planner, executor and
    transport with ``--delta --delta-pairs``: every push verified bit-exact against an oracle
    that reads the same saved steps; the full and delta pushes of a pair load the same weights;
    the delta writes less than the full."""
    from weight_transfer.experiments.config import TrialConfig
    from weight_transfer.experiments.link import pair_table
    from weight_transfer.experiments.trial import run_trial

    _save_run(tmp_path, 3)
    cfg = TrialConfig.from_flat(model="qwen3-0.6b", overrides=SMALL, n_train=2, tp=1, timeout=60, quant=quant,
                                replay=str(tmp_path), replay_start=1, delta=True, delta_pairs=True, delta_op_cost=0,
                                warmup=2, steps=4)
    res = run_trial(cfg)
    rows = res.rows
    assert len(rows) == 6 and all(r["verified"] is True for r in rows), [r.get("verify_error") for r in rows]
    assert [r["source_step"] for r in rows] == [1, 1, 2, 2, 3, 3]
    assert [r["pair_mode"] for r in rows] == ["full", "delta", "delta", "full", "full", "delta"]
    full = rows[0]["bytes"]
    # the full push of pair 1 leaves the delta state untouched: the delta push after it is the
    # executor's first delta update, full (C26), and fills the shadow
    assert rows[1]["delta"] == "full: first update" and rows[1]["delta_bytes"] == full
    for r in rows[2:]:
        if r["pair_mode"] == "full":
            assert r["delta_bytes"] == full and r["delta"] == ""
        else:
            assert r["delta"] == "delta" and 0 < r["delta_bytes"] < 0.5 * full
    text, nums = pair_table(rows, rate_bits=None)
    assert nums["verified"] and nums["n_pairs"] == 2 and "delta/full p50" in text
