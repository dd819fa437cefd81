"""A served draft model (``--draft mtp``: DeepSeek-V3's MTP layer) end to end: planned and written
in the same update as the target, every byte of both verified against the stand-in's own
load_weights; a frozen draft (``--draft-frozen``) is written by the first update and reported
unchanged by the delta updates after it. Issue 57 (3)."""
import pytest

from weight_transfer.experiments.config import TrialConfig
from weight_transfer.experiments.trial import run_trial

TINY_DS = dict(num_hidden_layers=2, first_k_dense_replace=1, num_experts=4, hidden_size=128, intermediate_size=256,
               moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32,
               qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, vocab_size=1001)


def _cfg(**kw):
    base = dict(model="deepseek-v3", overrides=TINY_DS, n_train=2, tp=2, quant="fp8", draft="mtp", steps=2,
                warmup=0, timeout=60)
    return TrialConfig.from_flat(**{**base, **kw})


@pytest.mark.multiproc
def test_frozen_draft_written_once_then_unchanged():
    res = run_trial(_cfg(draft_frozen=True, delta=True))
    assert [r["verified"] for r in res.rows] == [True, True], [r.get("verify_error") for r in res.rows]
    first, second = res.rows
    assert first["delta_draft_n_full"] > 0 and not first.get("delta_draft_n_unchanged")  # first update: whole
    assert second["delta_draft_n_unchanged"] > 0 and not second.get("delta_draft_n_full")  # then unchanged
    assert second["delta_draft_bytes_unchanged"] == 0 and second["delta_n_full"] > 0  # the target changed


@pytest.mark.multiproc
def test_c33_stale_draft_named_by_verification():
    """C33: from the second update on the draft's writes are dropped (the target still lands and
    the method reports success): verification fails that update and names a draft tensor."""
    res = run_trial(_cfg(method="tests.helpers.stale_draft:"))
    first, second = res.rows
    assert first["verified"] is True and second["verified"] is False
    assert "draft.model.layers.2." in second["verify_error"], second["verify_error"]
    assert second["bytes"] < first["bytes"]  # the target's bytes only


def test_draft_refused_one_line():
    with pytest.raises(ValueError, match="has no MTP layers"):
        TrialConfig.from_flat(model="qwen3-0.6b", draft="mtp")
    with pytest.raises(ValueError, match="--draft-frozen without --draft"):
        _cfg(draft=None, draft_frozen=True)
    with pytest.raises(ValueError, match="not wired for vLLM engines"):
        _cfg(engine="vllm", quant=None)
    assert len(_cfg().train_specs()) > len(_cfg(draft=None).train_specs())


@pytest.mark.long  # 45 s here; the traced draft's recipes are checked in CI by tests/engines/vllm/trace/test_loader.py
def test_a_traced_models_mtp_draft_is_traced_and_verified_against_vllms_loaders(tmp_path, monkeypatch):
    """GLM-4.5-Air (no hand-written rules) serving its MTP layer as the draft: target and draft both
    planned from vLLM's loaders traced in a child (``Glm4MoeForCausalLM`` + ``Glm4MoeMTP``), every
    byte of both verified against vLLM's own load_weights of the step's checkpoint each update (the
    draft's embedding and head are the target's, named as shared)."""
    from weight_transfer.engines.vllm.engine import vllm_available

    if not vllm_available():
        pytest.skip("vLLM is not installed (make vllm): a traced architecture needs vLLM's loader")
    from weight_transfer.testing.tiny import TINY_TRACED

    monkeypatch.setenv("WT_TRACE_CACHE", str(tmp_path / "traces"))
    res = run_trial(TrialConfig.from_flat(model="glm-4.5-air", overrides=dict(TINY_TRACED["glm-4.5-air"]), n_train=2,
                                          tp=2, draft="mtp", steps=2, warmup=0, timeout=60))
    assert [r["verified"] for r in res.rows] == [True, True], [r.get("verify_error") for r in res.rows]
    from weight_transfer.experiments.traced import recipes_for

    rs, how = recipes_for(res.cfg.model_config(), res.cfg.inference)
    assert "+ draft" in how and "Glm4MoeMTP.load_weights" in how, how
    draft = [r for r in rs if r.outputs[0].tensor.startswith("draft.model.layers.2.mtp_block.")]
    assert draft and rs.shared == {"model.layers.2.embed_tokens.weight": "model.embed_tokens.weight",
                                   "model.layers.2.shared_head.head.weight": "lm_head.weight"}
