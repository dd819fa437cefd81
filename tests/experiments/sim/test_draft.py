"""The simulation with a served draft (``layout.draft="mtp"``): the config is predicted with and
without the draft, and its rows say what the draft and the FP8 scales add (issue 57 (3))."""
from weight_transfer.experiments.sim import run as sim_run
from weight_transfer.experiments.sim.configs import get_config
from weight_transfer.experiments.sim.draft import draft_split
from weight_transfer.types import DestTensorMeta


def test_draft_split_counts_draft_and_scale_bytes():
    dm = {0: [DestTensorMeta(rank=0, name="a.weight", shape=(4,), dtype="bfloat16", offset=0, nbytes=8),
              DestTensorMeta(rank=0, name="a.weight_scale_inv", shape=(1,), dtype="float32", offset=16, nbytes=4),
              DestTensorMeta(rank=0, name="draft.b.weight_scale_inv", shape=(1,), dtype="float32", offset=32, nbytes=4)],
          1: [DestTensorMeta(rank=1, name="draft.c", shape=(2,), dtype="bfloat16", offset=0, nbytes=4)]}
    s = draft_split(dm)
    assert (s["total"], s["draft"], s["scales"], s["draft_scales"]) == (20, 8, 8, 4)
    assert (s["max_total"], s["max_draft"], s["max_scales"]) == (16, 4, 8)  # rank 0 receives the most


def test_tiny_mtp_config_predicted_with_and_without_draft():
    cfg = get_config("tiny_deepseek_v3_mtp_2x2")
    sr = sim_run.run(cfg, log=lambda m: None)
    (row,) = sr.extra["draft"]
    assert row["method"] == "reference" and row["draft_bytes"] > 0 and row["scale_bytes"] > row["draft_scale_bytes"] > 0
    assert row["bytes"] - row["base_bytes"] == row["draft_bytes"]  # the draft is every byte the update adds
    assert row["seconds"] > row["base_seconds"] and row["draft_added_seconds"] == row["seconds"] - row["base_seconds"]
    (csv_row,) = sim_run.rows(sr)
    assert csv_row["draft_bytes"] == row["draft_bytes"] and csv_row["base_seconds"] == row["base_seconds"]
    assert "what the draft and the FP8 scales add" in sim_run.format_table(sr)
