"""Packed delta updates into the harness's stand-in engine (experiments/landing.py): every
inference rank registers a landing region, the trainers pack changed runs into it with one
write per output, and the rank's commit scatters them before the version is published
complete; every update verified against a fresh oracle after the scatter."""
import pytest

from weight_transfer.experiments.config import TrialConfig
from weight_transfer.experiments.trial import run_trial

SMALL = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("transport,quant", [("cma", None), ("shm", "fp8")])
def test_packed_delta_into_the_stand_in_every_update_verified(transport, quant):
    """``run --delta --delta-mode packed --change-fraction 1,0.01,0.001``: update 1 full (C26:
    the executor's first), then packed records on every rank (``delta_records`` from the
    commits, ``delta_n_packed`` from the senders), the row's ``commit_seconds`` / ``delta_apply_s``
    the ranks' scatter, every update bit-exact."""
    cfg = TrialConfig.from_flat(model="qwen3-0.6b", overrides=SMALL, n_train=2, tp=1, steps=3, warmup=0, timeout=60,
                                transport=transport, quant=quant, delta=True, delta_mode="packed",
                                change_fraction=(1.0, 0.01, 0.001))
    res = run_trial(cfg)
    rows = res.rows
    assert len(rows) == 3
    assert all(r["verified"] is True for r in rows), [r.get("verify_error") for r in rows]
    assert rows[0]["delta"] == "full: first update"
    for r in rows[1:]:
        assert r["delta"] == "delta"
        assert r["delta_records"] > 0 and r["delta_n_packed"] > 0, r
        assert r["delta_packed_bytes"] > 0 and r["delta_apply_s"] >= 0
    assert rows[1]["delta_bytes"] < rows[1]["bytes"] and rows[2]["delta_bytes"] < rows[1]["delta_bytes"]


def test_packed_asked_without_a_landing_region_is_an_error(capsys):
    """``--delta-mode packed`` where the stand-in cannot take packed records: with shadow targets
    the CLI refuses it (one ``error:`` line, exit 2); on a GPU arena the rank's setup raises
    naming why (:func:`weight_transfer.experiments.landing.attach`), never a silent fallback."""
    import types

    import torch

    from weight_transfer.experiments.command import main
    from weight_transfer.experiments.landing import attach

    assert main(["run", "--delta", "--delta-mode", "packed", "--shadow", "copy", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "no landing region" in err[0]
    cfg = TrialConfig.from_flat(model="qwen3-0.6b", overrides=SMALL, delta=True, delta_mode="packed")
    engine = types.SimpleNamespace(arena=torch.empty(0, dtype=torch.uint8, device="meta"))
    store = types.SimpleNamespace(delete_key=lambda k: None)
    with pytest.raises(ValueError, match="--delta-mode packed: inference rank 0: no landing region"):
        attach(cfg.resolved_transfer, engine, types.SimpleNamespace(transport=object()), store, 0)
