"""bench-delta (experiments/bench/delta.py): its options are checked, and a small run (the main
job's architecture cut further) writes verified rows of full and delta trials side by side."""
import pandas as pd
import pytest

from weight_transfer.experiments.bench.delta import DeltaBenchConfig, main

pytestmark = pytest.mark.multiproc


def test_config_refuses_bad_values():
    for kw in (dict(fractions=()), dict(fractions=(1.5,)), dict(merge_gaps=(-1,)), dict(warmup=0),
               dict(override=("x",)), dict(op_costs=(-2,)), dict(op_costs=()), dict(op_sizes=(0,))):
        with pytest.raises(ValueError):
            DeltaBenchConfig(**kw)


# `long` (make test-long): 30-60 s of CI's 25 minutes; delta updates are verified bit-exact in the default
# set by tests/delta/test_runs.py and tests/experiments/test_trial.py::test_delta_trial_every_update_bit_exact_*.
@pytest.mark.long
def test_small_run_full_and_delta_rows_verified(tmp_path, capsys):
    out = tmp_path / "d.csv"
    assert main(DeltaBenchConfig(fractions=(0.0,), op_costs=(0,), steps=1, out=str(out), op_sizes=(64, 4096),
                                 ops_out=str(tmp_path / "ops.csv"),
                                 override=("num_experts=4", "vocab_size=2048", "hidden_size=256",
                                           "moe_intermediate_size=128", "intermediate_size=256"))) == 0
    df = pd.read_csv(out)
    assert set(df["bench"]) == {"full", "delta cost=0"} and df["verified"].all()
    full = df[df.bench == "full"].iloc[0]
    delta = df[df.bench != "full"].iloc[0]
    assert full["delta_bytes"] == full["bytes"] == delta["bytes"] and delta["delta_bytes"] == 0  # nothing changed
    ops = pd.read_csv(tmp_path / "ops.csv")
    assert set(ops["transport"]) == {"cma", "shm"} and (ops["us_per_op"] > 0).all()
    from weight_transfer.delta.runs import native_status

    if native_status() == "ok":  # the RunsOp path is measured too
        assert set(ops["path"]) == {"op", "run"}
    text = capsys.readouterr().out
    assert "fraction" in text and "where delta stops paying" in text
