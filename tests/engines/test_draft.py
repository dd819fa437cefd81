"""The stand-in engine's draft model (engines/draft.py, vLLM 0.32's ``DeepSeekMTP``): names in
vLLM's module order after the target's, the shard rules of docs/LAYOUTS.md, and loading by
checkpoint name (``_rewrite_spec_layer_name``; the shared embedding and head skipped)."""
import pytest
import torch

from weight_transfer.engines import Engine, engine_tensor_metas
from weight_transfer.engines.draft import layer_prefix
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.tiny import TINY_DEEPSEEK
from weight_transfer.types import InferenceLayout


def deepseek(**kw):
    return load_config(TINY_DEEPSEEK[0], **{**TINY_DEEPSEEK[1], **kw})


def test_layer_prefix_follows_vllms_rewrite():
    assert layer_prefix(61, "enorm.weight") == "draft.model.layers.61."
    assert layer_prefix(61, "shared_head.norm.weight") == "draft.model.layers.61."
    assert layer_prefix(61, "self_attn.q_a_proj.weight") == "draft.model.layers.61.mtp_block."
    assert layer_prefix(61, "mlp.experts.3.up_proj.weight") == "draft.model.layers.61.mtp_block."
    assert layer_prefix(61, "embed_tokens.weight") is None and layer_prefix(61, "shared_head.head.weight") is None


def test_draft_tensors_after_the_target_in_module_order():
    cfg = deepseek()
    names = [m.name for m in engine_tensor_metas(cfg, InferenceLayout(tp=2, ep=True, draft="mtp"), 1)]
    target = [m.name for m in engine_tensor_metas(cfg, InferenceLayout(tp=2, ep=True), 1)]
    assert names[:len(target)] == target
    d = "draft.model.layers.2."
    assert names[len(target):len(target) + 5] == [d + "enorm.weight", d + "hnorm.weight", d + "eh_proj.weight",
                                                   d + "shared_head.norm.weight",
                                                   d + "mtp_block.self_attn.fused_qkv_a_proj.weight"]
    assert names[-2:] == [d + "mtp_block.input_layernorm.weight", d + "mtp_block.post_attention_layernorm.weight"]


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_shard_rules_and_load(quant):
    cfg = deepseek()
    lay = InferenceLayout(tp=2, ep=True, quant=quant, draft="mtp")
    g = torch.Generator().manual_seed(0)
    ck = {p.name: torch.randn(p.shape, generator=g).to(torch.float32 if p.dtype == "float32" else torch.bfloat16)
          for p in param_specs(cfg, "mtp")}
    d = "draft.model.layers.2."
    for rank in (0, 1):
        eng = Engine(cfg, lay, rank)
        eng.load_weights(ck.items())
        eng.process_weights_after_loading()
        assert not eng.missing_after_load()
        p = eng.named_parameters()
        assert torch.equal(p[d + "eh_proj.weight"], ck["model.layers.2.eh_proj.weight"])  # whole, never quantized
        assert torch.equal(p[d + "enorm.weight"], ck["model.layers.2.enorm.weight"])
        w2 = p[d + "mtp_block.mlp.experts.routed_experts.w2_weight"]  # EP: experts [4r, 4r+4) whole
        assert w2.shape[0] == 4
        if quant is None:
            assert torch.equal(w2[1], ck[f"model.layers.2.mlp.experts.{4 * rank + 1}.down_proj.weight"])
            o = p[d + "mtp_block.self_attn.o_proj.weight"]  # row-parallel: columns of rank r
            assert torch.equal(o, ck["model.layers.2.self_attn.o_proj.weight"][:, rank * 64:(rank + 1) * 64])
        else:
            assert w2.dtype == torch.float8_e4m3fn and d + "mtp_block.mlp.experts.routed_experts.w2_weight_scale_inv" in p
        assert "model.layers.2.embed_tokens.weight" in eng.skipped_names  # served by the target's
        assert "model.layers.2.shared_head.head.weight" in eng.skipped_names


@pytest.mark.vllm
def test_names_match_vllms_own_rewrite():
    """vLLM 0.32's ``DeepSeekMTP._rewrite_spec_layer_name`` (it reads nothing of its model) puts
    every checkpoint tensor of the MTP layer where :func:`layer_prefix` does (the shared embedding
    aside: vLLM loads it into the draft's ``model.embed_tokens``, which its proposer then replaces
    by the target's, so the stand-in skips it)."""
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    cfg = deepseek()
    for p in param_specs(cfg, "mtp"):
        if not p.name.startswith("model.layers.2."):
            continue
        suffix = p.name.removeprefix("model.layers.2.")
        theirs = DeepSeekMTP._rewrite_spec_layer_name(None, 2, p.name)
        pre = layer_prefix(2, suffix)
        if suffix == "embed_tokens.weight":
            assert pre is None and theirs == "model.embed_tokens.weight"
        elif suffix == "shared_head.head.weight":
            assert pre is None and theirs == p.name  # loaded, then replaced by the target's lm_head
        else:
            assert "draft." + theirs == pre + suffix, p.name
