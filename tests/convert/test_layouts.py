"""Layout failure kinds of shared/CASES.md (C2, C4-C8), each through the real planner,
executor, CMA transport and the engine oracle, on hand-made inputs (tests/helpers/loopback.py)."""
import pytest
import torch

from tests.helpers.loopback import Loopback
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint
from weight_transfer.types import InferenceLayout, PlanError


def ckpt(cfg, step=1, dtype=None):
    return {n: t for n, t in SyntheticCheckpoint(param_specs(cfg), step=step, seed=0, dtype_override=dtype)}


GQA = dict(num_hidden_layers=1, vocab_size=500, hidden_size=256, intermediate_size=256,
           num_attention_heads=8, num_key_value_heads=2, head_dim=32)


@pytest.mark.parametrize("tp", [2, 4])
def test_c4_gqa_qkv_per_rank(tp):
    cfg = load_config("qwen3-0.6b", **GQA)
    src = ckpt(cfg)
    lb = Loopback(cfg, InferenceLayout(tp=tp))
    lb.transfer(src)
    assert lb.verify(src) == []
    # independent hand computation: [q shard; k shard; v shard], KV heads replicated at TP=4
    hd, nh, nkv = 32, 8, 2
    p = "model.layers.0.self_attn."
    for r, eng in enumerate(lb.engines):
        q = src[p + "q_proj.weight"][r * nh // tp * hd:(r + 1) * nh // tp * hd]
        kvh = r // (tp // nkv) if tp > nkv else r
        nk = max(1, nkv // tp)
        k = src[p + "k_proj.weight"][kvh * nk * hd:(kvh + 1) * nk * hd]
        v = src[p + "v_proj.weight"][kvh * nk * hd:(kvh + 1) * nk * hd]
        got = eng.named_parameters()[p + "qkv_proj.weight"]
        assert torch.equal(got.view(torch.int16), torch.cat([q, k, v]).view(torch.int16)), r


def test_c5_experts_land_once_on_the_right_rank_and_slot():
    cfg = load_config("qwen3-30b-a3b", num_hidden_layers=1, num_experts=16, hidden_size=128,
                      moe_intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      vocab_size=256)
    src = ckpt(cfg)
    for e in range(16):
        for w in ("gate_proj", "up_proj", "down_proj"):
            src[f"model.layers.0.mlp.experts.{e}.{w}.weight"].fill_(float(e + 1))
    lb = Loopback(cfg, InferenceLayout(tp=4, ep=True))
    lb.transfer(src)
    assert lb.verify(src) == []
    seen = []
    for r, eng in enumerate(lb.engines):
        w13 = eng.named_parameters()["model.layers.0.mlp.experts.routed_experts.w13_weight"]
        w2 = eng.named_parameters()["model.layers.0.mlp.experts.routed_experts.w2_weight"]
        assert w13.shape[0] == 4
        for j in range(4):
            vals = set(w13[j].float().unique().tolist()) | set(w2[j].float().unique().tolist())
            assert vals == {float(r * 4 + j + 1)}, (r, j, vals)
            seen.append(r * 4 + j)
    assert sorted(seen) == list(range(16))


def test_c6_tied_embeddings_update_lm_head():
    cfg = load_config("qwen3-0.6b", **GQA)
    assert cfg.tie_word_embeddings
    lb = Loopback(cfg, InferenceLayout(tp=2))
    names = set(lb.engines[0].named_parameters())
    assert "lm_head.weight" not in names  # vLLM: lm_head *is* embed_tokens when tied
    for step in (1, 2):
        src = ckpt(cfg, step)
        lb.transfer(src)
        assert lb.verify(src) == []
        emb = lb.engines[1].named_parameters()["model.embed_tokens.weight"]
        vp = emb.shape[0]
        assert torch.equal(emb[: 500 - vp].view(torch.int16), src["model.embed_tokens.weight"][vp:].view(torch.int16))
        assert (emb[500 - vp:].float() == 0).all()  # vocab padding rows zero, not stale


def test_c7_fp8_fused_qkv_tp2_rows_not_multiple_of_128():
    cfg = load_config("qwen3-0.6b", num_hidden_layers=1, vocab_size=300, hidden_size=200, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=48)
    src = ckpt(cfg)
    lb = Loopback(cfg, InferenceLayout(tp=2, quant="fp8"))
    lb.transfer(src)
    assert lb.verify(src) == []
    for eng in lb.engines:
        p = eng.named_parameters()
        w, s = p["model.layers.0.self_attn.qkv_proj.weight"], p["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
        assert w.dtype == torch.float8_e4m3fn and w.shape == (192, 200)
        assert s.dtype == torch.float32 and s.shape == (2, 2)


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_c8_fp32_masters_into_bf16_and_fp8(quant):
    cfg = load_config("qwen3-0.6b", **GQA)
    src = ckpt(cfg, dtype="float32")
    assert src["model.norm.weight"].dtype == torch.float32
    lb = Loopback(cfg, InferenceLayout(tp=2, quant=quant))
    stats = lb.transfer(src)
    assert lb.verify(src) == []
    # bytes on the wire are the destination's, not raw fp32
    assert stats.bytes_sent == sum(m.nbytes for e in lb.engines for m in e.tensor_metas())


def test_c2_rename_drop_fuse():
    """Tied checkpoint with an explicit lm_head.weight (as Qwen3-0.6B's safetensors ship it):
    declared ignored -> dropped; renames and fusions cover every byte once. An undeclared
    extra source fails at plan time, naming it."""
    cfg = load_config("qwen3-0.6b", **GQA)
    src = ckpt(cfg)
    src["lm_head.weight"] = src["model.embed_tokens.weight"].clone()
    lb = Loopback(cfg, InferenceLayout(tp=2))
    lb.transfer(src)
    assert lb.verify({k: v for k, v in src.items() if k != "lm_head.weight"}) == []
    src["model.layers.0.self_attn.q_proj.lora_A"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    with pytest.raises(PlanError, match=r"q_proj\.lora_A"):
        Loopback(cfg, InferenceLayout(tp=2)).plan(src)


def test_c10_many_small_tensors_back_to_back_two_versions():
    cfg = load_config("qwen3-0.6b", **{**GQA, "num_hidden_layers": 3})
    lb = Loopback(cfg, InferenceLayout(tp=2, dp=2), max_chunk_bytes=4096)
    for step in (1, 2):
        src = ckpt(cfg, step)
        lb.transfer(src)
        assert lb.verify(src) == []
