"""The receiving engine (engines/engine.py): vLLM layouts per docs/LAYOUTS.md, load_weights
semantics, block FP8, the arena. Small configs of each real architecture; all in-process.

Expectations here are written from LAYOUTS.md directly (slices of the checkpoint), not from
the engine's own helpers, so the oracle is itself checked against the contract."""
from __future__ import annotations

import math

import pytest
import torch

from weight_transfer.engines import (
    Engine,
    dequantize_block_fp8,
    engine_tensor_metas,
    expected_from_checkpoint,
    quantize_block_fp8,
)
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.tiny import TINY_DEEPSEEK
from weight_transfer.types import InferenceLayout

BF16 = torch.bfloat16


# ------------------------------------------------------------------------------- fixtures
def qwen3(**kw):
    base = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    return load_config("qwen3-0.6b", **{**base, **kw})


def qwen3_moe(**kw):
    base = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
                moe_intermediate_size=128, num_experts=16, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64)
    return load_config("qwen3-30b-a3b", **{**base, **kw})


def deepseek(**kw):
    return load_config(TINY_DEEPSEEK[0], **{**TINY_DEEPSEEK[1], "num_hidden_layers": 3, **kw})


def checkpoint(cfg, dtype=BF16, seed=0) -> dict[str, torch.Tensor]:
    """Random full checkpoint (float32 spec entries stay float32 unless dtype is float32)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in param_specs(cfg):
        t = torch.randn(p.shape, generator=g)
        out[p.name] = t if p.dtype == "float32" else t.to(dtype)
    return out


def load(cfg, layout, rank, ckpt) -> Engine:
    return expected_from_checkpoint(cfg, layout, rank, ckpt.__getitem__, ckpt)


def rows(t, a, b):
    return t[a:b]


# ------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen3_dense_shapes(tp):
    cfg = qwen3()
    e = Engine(cfg, InferenceLayout(tp=tp), rank=tp - 1)
    p = e.named_parameters()
    kvr = max(1, 2 // tp)
    assert "lm_head.weight" not in p  # tied
    assert p["model.embed_tokens.weight"].shape == (1024 // tp, 256)
    L = "model.layers.1."
    assert p[L + "self_attn.qkv_proj.weight"].shape == ((4 // tp + 2 * kvr) * 64, 256)
    assert p[L + "self_attn.o_proj.weight"].shape == (256, 4 * 64 // tp)
    assert p[L + "self_attn.q_norm.weight"].shape == (64,)
    assert p[L + "mlp.gate_up_proj.weight"].shape == (2 * 512 // tp, 256)
    assert p[L + "mlp.down_proj.weight"].shape == (256, 512 // tp)
    assert p["model.norm.weight"].shape == (256,)
    assert all(t.dtype == BF16 for t in p.values())
    # vLLM module order: attention, mlp, then the layer norms
    names = list(p)
    assert names[:8] == ["model.embed_tokens.weight",
                         "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                         "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
                         "model.layers.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.down_proj.weight",
                         "model.layers.0.input_layernorm.weight"]
    assert names[-1] == "model.norm.weight"


@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_qwen3_moe_shapes(tp, ep):
    cfg = qwen3_moe(tie_word_embeddings=False)
    p = Engine(cfg, InferenceLayout(tp=tp, ep=ep), rank=0).named_parameters()
    L = "model.layers.0.mlp."
    el, il = (16 // tp, 128) if ep else (16, 128 // tp)
    assert p[L + "gate.weight"].shape == (16, 256)
    assert p[L + "experts.routed_experts.w13_weight"].shape == (el, 2 * il, 256)
    assert p[L + "experts.routed_experts.w2_weight"].shape == (el, 256, il)
    assert L + "gate.e_score_correction_bias" not in p
    assert p["lm_head.weight"].shape == (1024 // tp, 256)
    assert list(p)[-1] == "lm_head.weight"


@pytest.mark.parametrize("tp,ep", [(1, False), (2, False), (4, True)])
def test_deepseek_shapes(tp, ep):
    cfg = deepseek()
    p = Engine(cfg, InferenceLayout(tp=tp, ep=ep), rank=0).named_parameters()
    a = "model.layers.0.self_attn."
    assert p[a + "fused_qkv_a_proj.weight"].shape == (96 + 64 + 16, 256)
    assert p[a + "q_a_layernorm.weight"].shape == (96,)
    assert p[a + "kv_a_layernorm.weight"].shape == (64,)
    assert p[a + "q_b_proj.weight"].shape == (4 // tp * 48, 96)
    assert p[a + "kv_b_proj.weight"].shape == (4 // tp * 64, 64)
    assert p[a + "o_proj.weight"].shape == (256, 4 * 32 // tp)
    assert p["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * 512 // tp, 256)  # first dense
    m = "model.layers.1.mlp."
    assert p[m + "gate.e_score_correction_bias"].dtype == torch.float32
    assert p[m + "gate.e_score_correction_bias"].shape == (8,)
    assert p[m + "shared_experts.gate_up_proj.weight"].shape == (2 * 128 // tp, 256)
    assert p[m + "shared_experts.down_proj.weight"].shape == (256, 128 // tp)
    el, il = (8 // tp, 128) if ep else (8, 128 // tp)
    assert p[m + "experts.routed_experts.w13_weight"].shape == (el, 2 * il, 256)
    assert p[m + "experts.routed_experts.w2_weight"].shape == (el, 256, il)
    order = [n for n in p if n.startswith(m)]
    assert order == [m + "gate.weight", m + "gate.e_score_correction_bias",
                     m + "shared_experts.gate_up_proj.weight", m + "shared_experts.down_proj.weight",
                     m + "experts.routed_experts.w13_weight", m + "experts.routed_experts.w2_weight"]


def test_fp8_shapes_and_names():
    cfg = deepseek()
    p = Engine(cfg, InferenceLayout(tp=2, ep=True, quant="fp8"), rank=1).named_parameters()
    a = "model.layers.0.self_attn."
    assert p[a + "fused_qkv_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert p[a + "fused_qkv_a_proj.weight_scale_inv"].shape == (math.ceil(176 / 128), 2)
    assert p[a + "fused_qkv_a_proj.weight_scale_inv"].dtype == torch.float32
    m = "model.layers.1.mlp."
    assert p[m + "experts.routed_experts.w13_weight_scale_inv"].shape == (4, 2, 2)
    assert p[m + "experts.routed_experts.w2_weight_scale_inv"].shape == (4, 2, 1)
    # not quantized: embeddings, norms, router, bias
    assert p["model.embed_tokens.weight"].dtype == BF16
    assert p[m + "gate.weight"].dtype == BF16
    assert p[m + "gate.e_score_correction_bias"].dtype == torch.float32
    assert p["lm_head.weight"].dtype == BF16
    assert not any(n.startswith("model.embed") and "scale" in n for n in p)
    names = [n for n in p if n.startswith(m + "experts")]
    assert names == [m + "experts.routed_experts.w13_weight", m + "experts.routed_experts.w2_weight",
                     m + "experts.routed_experts.w13_weight_scale_inv", m + "experts.routed_experts.w2_weight_scale_inv"]


# ------------------------------------------------------------------------------- C4: QKV
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_C4_qkv_gqa_each_rank(tp):
    cfg = qwen3()  # nh=4, nkv=2, hd=64
    ck = checkpoint(cfg)
    L = "model.layers.0.self_attn."
    q, k, v = ck[L + "q_proj.weight"], ck[L + "k_proj.weight"], ck[L + "v_proj.weight"]
    hd, nhl = 64, 4 // tp
    for r in range(tp):
        e = load(cfg, InferenceLayout(tp=tp), r, ck)
        kv_head = r * 2 // tp if tp <= 2 else r // (tp // 2)   # T<=nkv: heads [r*kvr,..); else r//(T/nkv)
        kvr = max(1, 2 // tp)
        want = torch.cat([rows(q, r * nhl * hd, (r + 1) * nhl * hd),
                          rows(k, kv_head * hd, (kv_head + kvr) * hd),
                          rows(v, kv_head * hd, (kv_head + kvr) * hd)])
        assert torch.equal(e.named_parameters()[L + "qkv_proj.weight"], want), (tp, r)
        o = e.named_parameters()[L + "o_proj.weight"]
        assert torch.equal(o, ck[L + "o_proj.weight"][:, r * 256 // tp:(r + 1) * 256 // tp])
    if tp == 4:  # KV replication: ranks 0,1 share kv head 0; ranks 2,3 share kv head 1
        e0, e1, e2 = (load(cfg, InferenceLayout(tp=4), r, ck).named_parameters()[L + "qkv_proj.weight"] for r in (0, 1, 2))
        assert torch.equal(e0[64:], e1[64:]) and not torch.equal(e0[64:], e2[64:])


def test_dense_mlp_and_norms():
    cfg = qwen3()
    ck = checkpoint(cfg)
    L = "model.layers.1."
    for r in range(2):
        p = load(cfg, InferenceLayout(tp=2), r, ck).named_parameters()
        g, u = ck[L + "mlp.gate_proj.weight"], ck[L + "mlp.up_proj.weight"]
        assert torch.equal(p[L + "mlp.gate_up_proj.weight"], torch.cat([g[r * 256:(r + 1) * 256], u[r * 256:(r + 1) * 256]]))
        assert torch.equal(p[L + "mlp.down_proj.weight"], ck[L + "mlp.down_proj.weight"][:, r * 256:(r + 1) * 256])
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.k_norm.weight"):
            assert torch.equal(p[L + n], ck[L + n])
        assert torch.equal(p["model.norm.weight"], ck["model.norm.weight"])


# ------------------------------------------------------------------------------- C5: experts
def _expert_ckpt(cfg):
    ck = checkpoint(cfg)
    for L in range(cfg.num_layers):
        for ex in range(cfg.num_experts):
            pre = f"model.layers.{L}.mlp.experts.{ex}."
            ck[pre + "gate_proj.weight"] = torch.full_like(ck[pre + "gate_proj.weight"], ex + 1)
            ck[pre + "up_proj.weight"] = torch.full_like(ck[pre + "up_proj.weight"], -(ex + 1))
            d = torch.full_like(ck[pre + "down_proj.weight"], ex + 0.5)
            d[:, :64] += 100  # distinguishes the two TP halves of the columns
            ck[pre + "down_proj.weight"] = d
    return ck


def test_C5_experts_ep4_right_rank_and_slot():
    cfg = qwen3_moe()  # 16 experts
    ck = _expert_ckpt(cfg)
    seen = []
    for r in range(4):
        e = load(cfg, InferenceLayout(tp=4, ep=True), r, ck)
        assert e.missing_after_load() == []
        p = e.named_parameters()
        w13, w2 = p["model.layers.1.mlp.experts.routed_experts.w13_weight"], p["model.layers.1.mlp.experts.routed_experts.w2_weight"]
        assert w13.shape == (4, 256, 256)
        for j in range(4):
            ex = int(w13[j, 0, 0].item()) - 1
            assert ex == 4 * r + j  # global expert e on rank e // 4, slot e % 4
            assert torch.all(w13[j, :128] == ex + 1) and torch.all(w13[j, 128:] == -(ex + 1))
            assert torch.equal(w2[j], ck[f"model.layers.1.mlp.experts.{ex}.down_proj.weight"])
            seen.append(ex)
        # experts of other ranks are skipped, not unknown
        assert sum("experts." in n for n in e.skipped_names) == 2 * 12 * 3
    assert sorted(seen) == list(range(16))


def test_experts_tp_sliced_without_ep():
    cfg = qwen3_moe()
    ck = _expert_ckpt(cfg)
    for r in range(2):
        p = load(cfg, InferenceLayout(tp=2), r, ck).named_parameters()
        w13, w2 = p["model.layers.0.mlp.experts.routed_experts.w13_weight"], p["model.layers.0.mlp.experts.routed_experts.w2_weight"]
        assert w13.shape == (16, 128, 256) and w2.shape == (16, 256, 64)
        for j in range(16):
            pre = f"model.layers.0.mlp.experts.{j}."
            g, u = ck[pre + "gate_proj.weight"], ck[pre + "up_proj.weight"]
            assert torch.equal(w13[j], torch.cat([g[r * 64:(r + 1) * 64], u[r * 64:(r + 1) * 64]]))
            assert torch.equal(w2[j], ck[pre + "down_proj.weight"][:, r * 64:(r + 1) * 64])


# ------------------------------------------------------------------------------- MLA
@pytest.mark.parametrize("tp,ep", [(2, False), (4, True)])
def test_mla_deepseek_load(tp, ep):
    cfg = deepseek()
    ck = checkpoint(cfg)
    r = tp - 1
    e = load(cfg, InferenceLayout(tp=tp, ep=ep), r, ck)
    assert e.missing_after_load() == []
    p = e.named_parameters()
    a = "model.layers.2.self_attn."
    assert torch.equal(p[a + "fused_qkv_a_proj.weight"], torch.cat([ck[a + "q_a_proj.weight"], ck[a + "kv_a_proj_with_mqa.weight"]]))
    nhl = 4 // tp
    assert torch.equal(p[a + "q_b_proj.weight"], ck[a + "q_b_proj.weight"][r * nhl * 48:(r + 1) * nhl * 48])
    assert torch.equal(p[a + "kv_b_proj.weight"], ck[a + "kv_b_proj.weight"][r * nhl * 64:(r + 1) * nhl * 64])
    assert torch.equal(p[a + "o_proj.weight"], ck[a + "o_proj.weight"][:, r * nhl * 32:(r + 1) * nhl * 32])
    assert torch.equal(p[a + "q_a_layernorm.weight"], ck[a + "q_a_layernorm.weight"])
    m = "model.layers.1.mlp."
    assert torch.equal(p[m + "gate.e_score_correction_bias"], ck[m + "gate.e_score_correction_bias"])  # fp32 kept
    sI = 128 // tp
    g, u = ck[m + "shared_experts.gate_proj.weight"], ck[m + "shared_experts.up_proj.weight"]
    assert torch.equal(p[m + "shared_experts.gate_up_proj.weight"], torch.cat([g[r * sI:(r + 1) * sI], u[r * sI:(r + 1) * sI]]))
    d = "model.layers.0.mlp."  # first_k_dense_replace
    assert torch.equal(p[d + "down_proj.weight"], ck[d + "down_proj.weight"][:, r * 512 // tp:(r + 1) * 512 // tp])


def test_mla_skips_mtp_layer_and_rotary():
    cfg = deepseek()
    e = Engine(cfg, InferenceLayout(tp=1), 0)
    mtp = f"model.layers.{cfg.num_layers}.self_attn.q_a_proj.weight"
    rot = "model.layers.0.self_attn.rotary_emb.inv_freq"
    assert e.load_weights([(mtp, torch.zeros(1)), (rot, torch.zeros(1))]) == set()
    assert e.skipped_names == [mtp, rot]
    with pytest.raises(KeyError, match=f"model.layers.{cfg.num_layers + 1}"):
        e.load_weights([(f"model.layers.{cfg.num_layers + 1}.input_layernorm.weight", torch.zeros(256))])


def test_mla_without_q_lora():
    cfg = deepseek(q_lora_rank=None)
    ck = checkpoint(cfg)
    e = load(cfg, InferenceLayout(tp=2), 1, ck)
    assert e.missing_after_load() == []
    p = e.named_parameters()
    a = "model.layers.0.self_attn."
    assert a + "fused_qkv_a_proj.weight" not in p
    assert torch.equal(p[a + "q_proj.weight"], ck[a + "q_proj.weight"][96:])
    assert torch.equal(p[a + "kv_a_proj_with_mqa.weight"], ck[a + "kv_a_proj_with_mqa.weight"])


def test_C9_non_contiguous_sources():
    cfg = qwen3()
    ck = checkpoint(cfg)
    nc = {n: (t.t().contiguous().t() if t.dim() == 2 else t) for n, t in ck.items()}
    assert not nc["model.layers.0.self_attn.q_proj.weight"].is_contiguous()
    lay = InferenceLayout(tp=2)
    assert torch.equal(load(cfg, lay, 1, nc).arena, load(cfg, lay, 1, ck).arena)


# ------------------------------------------------------------------------------- C6: tied
def test_C6_tied_embeddings_padding_and_no_lm_head():
    cfg = qwen3()  # tie_word_embeddings true, V=1000 -> Vp=1024
    ck = checkpoint(cfg)
    assert "lm_head.weight" not in ck
    emb = ck["model.embed_tokens.weight"]
    for r in range(4):
        e = Engine(cfg, InferenceLayout(tp=4), r)
        e.arena.fill_(0xFF)  # poison: padding must be written as zeros, not left alone
        e.load_weights(ck.items())
        p = e.named_parameters()
        assert "lm_head.weight" not in p
        local = p["model.embed_tokens.weight"]
        lo, hi = r * 256, (r + 1) * 256
        n = max(0, min(hi, 1000) - lo)
        assert torch.equal(local[:n], emb[lo:lo + n])
        assert torch.all(local[n:] == 0)
    # an lm_head.weight sent anyway while tied is skipped, like vLLM
    e = Engine(cfg, InferenceLayout(tp=1), 0)
    assert e.load_weights([("lm_head.weight", emb)]) == set()
    assert e.skipped_names == ["lm_head.weight"]


def test_untied_lm_head_vocab_parallel():
    cfg = qwen3(tie_word_embeddings=False)
    ck = checkpoint(cfg)
    p = load(cfg, InferenceLayout(tp=2), 1, ck).named_parameters()
    lm = p["lm_head.weight"]
    assert lm.shape == (512, 256)
    assert torch.equal(lm[:488], ck["lm_head.weight"][512:]) and torch.all(lm[488:] == 0)


# ------------------------------------------------------------------------------- C7: FP8
def _naive_block_fp8(x: torch.Tensor):
    """Block loop straight from LAYOUTS.md (independent of the vectorized engine code)."""
    n, k = x.shape
    nb, kb = -(-n // 128), -(-k // 128)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(nb, kb)
    xf = x.float()
    for i in range(nb):
        for j in range(kb):
            blk = xf[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = blk.abs().max() if blk.numel() else torch.tensor(0.0)
            sc = torch.maximum(amax, torch.tensor(1e-12)) / 448.0
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = torch.clamp(blk / sc, -448, 448).to(torch.float8_e4m3fn)
            s[i, j] = sc
    return q, s


def test_C7_fp8_qkv_tp2_non_multiple_of_128():
    cfg = qwen3(num_attention_heads=6, hidden_size=200)  # local qkv N = (3 + 2*1)*64 = 320, K = 200
    ck = checkpoint(cfg, seed=3)
    L = "model.layers.0.self_attn."
    lay = InferenceLayout(tp=2, quant="fp8")
    for r in range(2):
        e = Engine(cfg, lay, r)
        e.load_weights(ck.items())
        staged = e.staged_bf16()[L + "qkv_proj.weight"]
        want = torch.cat([ck[L + "q_proj.weight"][r * 192:(r + 1) * 192],
                          ck[L + "k_proj.weight"][r * 64:(r + 1) * 64],
                          ck[L + "v_proj.weight"][r * 64:(r + 1) * 64]])
        assert staged.dtype == BF16 and torch.equal(staged, want)
        e.process_weights_after_loading()
        assert e.staged_bf16() == {} and e.missing_after_load() == []
        p = e.named_parameters()
        w, s = p[L + "qkv_proj.weight"], p[L + "qkv_proj.weight_scale_inv"]
        assert w.shape == (320, 200) and w.dtype == torch.float8_e4m3fn
        assert s.shape == (3, 2) and s.dtype == torch.float32
        qn, sn = _naive_block_fp8(want)
        assert torch.equal(w.view(torch.uint8), qn.view(torch.uint8)) and torch.equal(s, sn)  # bit-exact
        deq = dequantize_block_fp8(w, s)
        tol = 0.07 * want.float().abs() + s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:320, :200] * 2 ** -9
        assert torch.all((deq - want.float()).abs() <= tol)


def test_fp8_zero_block_and_experts_per_slot():
    x = torch.zeros(130, 260, dtype=BF16)
    x[128:, 256:] = 3.0
    q, s = quantize_block_fp8(x)
    assert not torch.isnan(q.float()).any() and not torch.isnan(s).any()
    assert torch.all(q.float()[:128, :256] == 0) and s.shape == (2, 3)
    assert torch.allclose(dequantize_block_fp8(q, s)[128:, 256:], torch.full((2, 4), 3.0))
    # experts: each slot quantized on its own
    cfg = qwen3_moe()
    ck = checkpoint(cfg, seed=5)
    e = Engine(cfg, InferenceLayout(tp=2, ep=True, quant="fp8"), 1)
    e.load_weights(ck.items())
    staged = {n: t.clone() for n, t in e.staged_bf16().items()}
    e.process_weights_after_loading()
    p = e.named_parameters()
    w13n = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    assert p[w13n + "_scale_inv"].shape == (8, 2, 2)
    for j in (0, 7):
        qn, sn = _naive_block_fp8(staged[w13n][j])
        assert torch.equal(p[w13n][j].view(torch.uint8), qn.view(torch.uint8))
        assert torch.equal(p[w13n + "_scale_inv"][j], sn)
    g = ck["model.layers.1.mlp.experts.8.gate_proj.weight"]  # rank 1, slot 0
    assert torch.equal(staged[w13n][0, :128], g)


def test_fp8_incomplete_staging_raises():
    cfg = qwen3()
    ck = checkpoint(cfg)
    e = Engine(cfg, InferenceLayout(tp=1, quant="fp8"), 0)
    e.load_weights((n, t) for n, t in ck.items() if n != "model.layers.1.self_attn.v_proj.weight")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight.*'v'"):
        e.process_weights_after_loading()
    with pytest.raises(KeyError, match="weight_scale_inv"):
        e.load_weights([("model.layers.0.self_attn.o_proj.weight_scale_inv", torch.zeros(2, 2))])


# ------------------------------------------------------------------------------- C8: fp32
def test_C8_fp32_master_cast_to_bf16():
    cfg = deepseek()
    ck = checkpoint(cfg, dtype=torch.float32, seed=7)
    r = 1
    p = load(cfg, InferenceLayout(tp=2), r, ck).named_parameters()
    assert all(t.dtype == BF16 for n, t in p.items() if "e_score_correction_bias" not in n)
    a = "model.layers.0.self_attn."
    assert torch.equal(p[a + "kv_b_proj.weight"], ck[a + "kv_b_proj.weight"][128:].to(BF16))  # RNE cast
    assert not torch.equal(p[a + "kv_b_proj.weight"].float(), ck[a + "kv_b_proj.weight"][128:])  # really rounded
    assert torch.equal(p["model.embed_tokens.weight"][:488], ck["model.embed_tokens.weight"][512:].to(BF16))
    b = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert p[b].dtype == torch.float32 and torch.equal(p[b], ck[b])
    # FP8 from an fp32 master: quantize exactly the BF16 cast
    e = Engine(cfg, InferenceLayout(tp=2, quant="fp8"), r)
    e.load_weights(ck.items())
    assert torch.equal(e.staged_bf16()[a + "kv_b_proj.weight"], ck[a + "kv_b_proj.weight"][128:].to(BF16))


# ------------------------------------------------------------------------------- arena
@pytest.mark.parametrize("quant", [None, "fp8"])
def test_arena_back_to_back_aligned_views(quant):
    cfg = deepseek()
    lay = InferenceLayout(tp=2, dp=2, ep=True, quant=quant)
    e = Engine(cfg, lay, 3)
    metas = e.tensor_metas()
    assert metas == engine_tensor_metas(cfg, lay, 3)  # same metadata without allocating
    assert [m.name for m in metas] == list(e.named_parameters())
    assert torch.all(e.arena == 0) and e.arena.dtype == torch.uint8
    base = e.arena.data_ptr()
    end = 0
    for m, t in zip(metas, e.named_parameters().values()):
        assert m.rank == 3 and m.offset % 16 == 0 and m.offset >= end
        assert m.offset - end < 16  # back to back, only alignment gaps
        assert m.nbytes == t.numel() * t.element_size() and m.shape == tuple(t.shape)
        assert t.data_ptr() == base + m.offset and t.is_contiguous()
        assert t.untyped_storage().data_ptr() == e.arena.untyped_storage().data_ptr()
        end = m.offset + m.nbytes
    assert e.arena.numel() >= end and e.arena.numel() - end < 16
    # writing the arena changes the tensors (and the reverse)
    m = metas[5]
    e.arena[m.offset:m.offset + m.nbytes] = 0x3F
    t = e.named_parameters()[m.name]
    assert torch.all(t.view(torch.uint8) == 0x3F)
    t.view(torch.uint8).zero_()
    assert torch.all(e.arena[m.offset:m.offset + m.nbytes] == 0)


def test_dp_replicas_identical_bytes_and_missing_tracking():
    cfg = qwen3_moe(num_experts=4)
    ck = checkpoint(cfg)
    lay = InferenceLayout(tp=2, dp=2, ep=True, quant="fp8")
    a, b = load(cfg, lay, 1, ck), load(cfg, lay, 3, ck)
    assert torch.equal(a.arena, b.arena) and a.missing_after_load() == []
    # one checkpoint tensor missing: named by missing_after_load, strict refuses
    drop = "model.layers.0.mlp.experts.3.up_proj.weight"
    e = Engine(cfg, InferenceLayout(tp=2, ep=True), 1)
    e.load_weights((n, t) for n, t in ck.items() if n != drop)
    assert e.missing_after_load() == ["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    with pytest.raises(ValueError, match="w13_weight"):
        expected_from_checkpoint(cfg, InferenceLayout(tp=2, ep=True), 1, ck.__getitem__,
                                 [n for n in ck if n != drop], strict=True)
    # nothing loaded: every tensor missing, fp8 scales included
    f = Engine(cfg, lay, 0)
    assert f.missing_after_load() == list(f.named_parameters())


def test_reload_second_version_changes_every_tensor():
    cfg = qwen3()
    lay = InferenceLayout(tp=2, quant="fp8")
    ck0, ck1 = checkpoint(cfg, seed=0), checkpoint(cfg, seed=1)
    e = load(cfg, lay, 0, ck0)
    before = {n: t.clone() for n, t in e.named_parameters().items()}
    e.load_weights(ck1.items())
    e.process_weights_after_loading()
    ref = load(cfg, lay, 0, ck1)
    assert torch.equal(e.arena, ref.arena)
    assert all(not torch.equal(before[n].view(torch.uint8), t.view(torch.uint8)) for n, t in e.named_parameters().items())


# ------------------------------------------------------------------------------- errors
def test_unknown_names_and_bad_shapes():
    cfg = qwen3_moe()
    e = Engine(cfg, InferenceLayout(tp=1), 0)
    with pytest.raises(KeyError, match="model.layers.0.self_attn.bogus.weight"):
        e.load_weights([("model.layers.0.self_attn.bogus.weight", torch.zeros(1))])
    with pytest.raises(KeyError, match="experts.16.gate_proj"):
        e.load_weights([("model.layers.0.mlp.experts.16.gate_proj.weight", torch.zeros(128, 256))])
    with pytest.raises(KeyError, match="lm_head.bias"):
        e.load_weights([("lm_head.bias", torch.zeros(1))])
    for fused in ("model.layers.0.mlp.experts.routed_experts.w13_weight", "model.layers.1.self_attn.qkv_proj.weight"):
        with pytest.raises(KeyError, match=fused):  # engine names of fused tensors are not checkpoint names
            e.load_weights([(fused, torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight.*\(64, 256\)"):
        e.load_weights([("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 256))])


@pytest.mark.parametrize("make,layout,match", [
    (lambda: qwen3(), InferenceLayout(tp=8), r"self_attn.qkv_proj.weight: num_attention_heads=4 .*tp=8"),
    (lambda: qwen3(num_attention_heads=6, num_key_value_heads=4, vocab_size=960), InferenceLayout(tp=3),
     r"self_attn.qkv_proj.weight: num_key_value_heads=4 .*tp=3"),
    (lambda: qwen3(num_attention_heads=8, num_key_value_heads=3), InferenceLayout(tp=4),
     r"self_attn.qkv_proj.weight: tp=4 > num_key_value_heads=3"),
    (lambda: qwen3(intermediate_size=510), InferenceLayout(tp=4), r"mlp.gate_up_proj.weight: intermediate_size=510 .*tp=4"),
    (lambda: qwen3_moe(num_experts=6), InferenceLayout(tp=4, ep=True), r"experts.routed_experts.w13_weight: num_experts=6 .*tp=4"),
    (lambda: qwen3_moe(moe_intermediate_size=100, num_attention_heads=8), InferenceLayout(tp=8),
     r"experts.routed_experts.w13_weight: moe_intermediate_size=100 .*tp=8"),
    (lambda: qwen3(vocab_size=64, num_attention_heads=3, num_key_value_heads=3), InferenceLayout(tp=3),
     r"model.embed_tokens.weight: padded vocab_size=64 .*tp=3"),
    (lambda: deepseek(vocab_size=960), InferenceLayout(tp=3), r"model.layers.0.self_attn.q_b_proj.weight: num_attention_heads=4 .*tp=3"),
    (lambda: deepseek(vocab_size=960, num_attention_heads=6, intermediate_size=510, moe_intermediate_size=96),
     InferenceLayout(tp=3, ep=True), r"experts.routed_experts.w13_weight: num_experts=8 .*tp=3"),
])
def test_divisibility_errors(make, layout, match):
    with pytest.raises(ValueError, match=match):
        Engine(make(), layout, 0)


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="rank 4"):
        Engine(qwen3(), InferenceLayout(tp=2, dp=2), 4)
