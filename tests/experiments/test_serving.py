"""Serving while updates land, in the harness (experiments/serving.py, C27): the stand-in's
generation load through pause-based and shadow updates, the stall columns, the refusals."""
import pytest

from weight_transfer.experiments import config as config_mod
from weight_transfer.experiments.config import TrialConfig
from weight_transfer.experiments.serving import serve_columns, serve_lines

SMALL = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)


def small(**kw):
    base = dict(model="qwen3-0.6b", overrides=SMALL, n_train=2, tp=2, steps=2, warmup=0, timeout=60)
    base.update(kw)
    return TrialConfig.from_flat(**base)


@pytest.mark.multiproc
@pytest.mark.parametrize("shadow", ["off", "flip", "copy"])
def test_generation_runs_through_updates_and_each_row_has_its_stall(shadow):
    """Every update verified bit-exact while 3 requests generate; each row carries the stall
    columns; no step computed with other weights than its label says (sampled steps recomputed
    from the oracle of their label), no label contradicting the go-live times; with shadow targets
    the go-live is timed and the shadow's bytes are reported."""
    from weight_transfer.experiments.trial import run_trial

    res = run_trial(small(shadow=shadow, gen_load=3, gen_tokens=16, steps=3))
    assert len(res.rows) == 3 and all(r["verified"] is True for r in res.rows), [r.get("verify_error") for r in res.rows]
    for r in res.rows:
        assert r["shadow"] == shadow and r["gen_load"] == 3
        assert r["stall_s"] is not None and r["stall_s"] >= 0 and r["label_errors"] == 0, r
        assert r["replayed"] > 0 and r["replay_errors"] == 0, r
        if shadow == "off":
            assert r["shadow_extra_bytes"] == 0 and r["golive_s"] is None
        else:
            assert r["golive_s"] is not None and r["shadow_extra_bytes"] > 0
    text = "\n".join(serve_lines(res.rows))
    assert "stall p50" in text and ("shadow targets" in text or "pause-based" in text)


def test_serve_columns_take_the_slowest_rank():
    v = {0: {"serve": {"shadow": "copy", "gen_load": 2, "stall_s": 0.01, "golive_s": 0.002, "tok_s_during": 900.0,
                       "label_errors": 0, "replayed": 3, "replay_errors": 0}},
         1: {"serve": {"shadow": "copy", "gen_load": 2, "stall_s": 0.03, "golive_s": 0.001, "tok_s_during": 700.0,
                       "label_errors": 1, "replayed": 2, "replay_errors": 0}}}
    c = serve_columns(v)
    assert c["stall_s"] == 0.03 and c["golive_s"] == 0.002 and c["tok_s_during"] == 700.0
    assert c["label_errors"] == 1 and c["replayed"] == 5
    assert serve_columns({0: {"ok": True}}) == {}


def test_shadow_that_does_not_fit_is_refused_naming_rank_and_bytes(monkeypatch):
    cfg = small(shadow="copy")
    need, shadow = cfg.memory_estimate(), cfg.shadow_bytes()
    assert set(shadow) == {0, 1} and all(b > 0 for b in shadow.values())
    monkeypatch.setattr(config_mod, "available_memory", lambda: need + 1)  # fits without the shadows
    with pytest.raises(ValueError, match=rf"--shadow copy: the shadows do not fit: inference rank \d needs {shadow[0]} B"):
        cfg._check_memory()
    small(shadow="off")._check_memory()


def test_bad_serving_options_are_refused():
    with pytest.raises(ValueError, match="shadow mode 'swap'"):
        small(shadow="swap")
    with pytest.raises(ValueError, match="--shadow flip with --delta"):
        small(shadow="flip", delta=True)
    with pytest.raises(ValueError, match="shadow targets are the reference's"):
        small(shadow="copy", method="rank0_funnel")
    with pytest.raises(ValueError, match="--gen-load -1"):
        small(gen_load=-1)
