"""``weight-transfer bench-stall`` (experiments/bench/stall.py): options refused, a small stand-in
run (every mode's rows verified, the stall columns, the table's ratio line)."""
import pandas as pd
import pytest

from weight_transfer.experiments.bench.stall import StallBenchConfig, format_table, main


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="engine='gpu'"):
        StallBenchConfig(engine="gpu")
    with pytest.raises(ValueError, match="modes="):
        StallBenchConfig(modes=("pause", "swap"))
    with pytest.raises(ValueError, match="steps=0"):
        StallBenchConfig(steps=0)
    with pytest.raises(ValueError, match="override 'x'"):
        StallBenchConfig(override=("x",))


@pytest.mark.multiproc
def test_small_stand_in_run_every_mode_verified(tmp_path, capsys):
    out = tmp_path / "stall.csv"
    cfg = StallBenchConfig(engine="stand-in", steps=2, warmup=0, n_requests=2, max_tokens=8, out=str(out), plot="",
                           override=("num_hidden_layers=1", "num_experts=4", "vocab_size=2048", "hidden_size=256",
                                     "intermediate_size=512", "moe_intermediate_size=128"))
    assert main(cfg) == 0
    df = pd.read_csv(out)
    assert sorted(set(df["mode"])) == ["copy", "flip", "pause"] and len(df) == 6
    assert df["verified"].all() and (df["stall_s"] >= 0).all() and (df["label_errors"] == 0).all()
    assert (df.loc[df["mode"] != "pause", "extra_bytes"] > 0).all()
    text = capsys.readouterr().out
    assert "x the pause-based stall" in text and "verified: 6/6" in text


def test_table_marks_a_failed_check():
    rows = [{"mode": "pause", "version": 1, "warmup": False, "transfer_s": 1.0, "golive_s": None, "stall_s": 1.0,
             "max_gap_during_s": 1.0, "max_gap_between_s": 0.01, "tok_s_during": 0.0, "tok_s_between": 100.0,
             "extra_bytes": 0, "verified": True},
            {"mode": "copy", "version": 1, "warmup": False, "transfer_s": 1.0, "golive_s": 0.01, "stall_s": 0.02,
             "max_gap_during_s": 0.03, "max_gap_between_s": 0.01, "tok_s_during": 90.0, "tok_s_between": 100.0,
             "extra_bytes": 2e6, "verified": False}]
    text = format_table(rows, ["note"])
    assert "= 0.020 x the pause-based stall" in text and "<-- FAILED" in text and "# note" in text
