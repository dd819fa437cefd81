"""Trainer-side weight mapping (recipes), its plan-time validation, and the transforms.

The expected destination tensors are transcribed from docs/LAYOUTS.md by hand below
(:func:`layouts_md_shapes`), independently of reference/plan/recipes.py; contents are checked with
naive slicing written here. Case ids (C2..C9) refer to /work/shared/CASES.md.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from weight_transfer.convert.quant import quantize_fp8_block
from weight_transfer.convert.transforms import apply_transform, assemble, recipe_outputs, split_recipe
from weight_transfer.plan import (
    PlanError,
    RecipeSet,
    build_recipes,
    expected_dest_shapes,
    expected_dests,
    fusion_groups,
    make_dest_metas,
    validate,
)
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.types import InferenceLayout, Output, box_flat_range, torch_dtype

# ------------------------------------------------------------------------------------------
# small configs (the brief's overrides)


def qwen_dense(**kw):
    base = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    base.update(kw)
    return load_config("qwen3-0.6b", **base)


def qwen_moe(**kw):
    base = dict(num_hidden_layers=2, num_experts=16, hidden_size=256, moe_intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)
    base.update(kw)
    return load_config("qwen3-30b-a3b", **base)


def mla(**kw):
    base = dict(num_hidden_layers=2, first_k_dense_replace=1, num_experts=8, hidden_size=256,
                intermediate_size=512, moe_intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, vocab_size=1000)
    base.update(kw)
    return load_config("deepseek-v3", **base)


FAMILIES = {"dense": qwen_dense, "moe": qwen_moe, "mla": mla}

LAYOUTS = [
    InferenceLayout(tp=1),
    InferenceLayout(tp=2, dp=2),
    InferenceLayout(tp=4),
    InferenceLayout(tp=2, quant="fp8"),
    InferenceLayout(tp=4, dp=2, ep=True, quant="fp8"),
    InferenceLayout(tp=2, ep=True),
]


def sources_of(cfg, dtype=None):
    return {p.name: (p.shape, dtype or p.dtype) for p in param_specs(cfg)}


# ------------------------------------------------------------------------------------------
# LAYOUTS.md, transcribed by hand


def layouts_md_shapes(cfg, lay: InferenceLayout, rank: int) -> dict[str, tuple[tuple[int, ...], str]]:
    T, dt, fp8 = lay.tp, lay.dtype, lay.quant == "fp8"
    H, V = cfg.hidden_size, cfg.vocab_size
    out = {}

    def lin(w, shape, s=None):  # weight name, shape; scale name
        if fp8:
            out[w] = (shape, "float8_e4m3fn")
            sname = s or w.removesuffix(".weight") + ".weight_scale_inv"
            out[sname] = ((*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128)), "float32")
        else:
            out[w] = (shape, dt)

    Vp = math.ceil(V / 64) * 64
    out["model.embed_tokens.weight"] = ((Vp // T, H), dt)
    for L in range(cfg.num_layers):
        p = f"model.layers.{L}"
        out[f"{p}.input_layernorm.weight"] = ((H,), dt)
        out[f"{p}.post_attention_layernorm.weight"] = ((H,), dt)
        a = f"{p}.self_attn"
        if cfg.is_mla:
            ql, kl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
            nope, rope, vd, nh = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg.num_heads
            lin(f"{a}.fused_qkv_a_proj.weight", (ql + kl + rope, H))
            out[f"{a}.q_a_layernorm.weight"] = ((ql,), dt)
            out[f"{a}.kv_a_layernorm.weight"] = ((kl,), dt)
            lin(f"{a}.q_b_proj.weight", (nh // T * (nope + rope), ql))
            lin(f"{a}.kv_b_proj.weight", (nh // T * (nope + vd), kl))
            lin(f"{a}.o_proj.weight", (H, nh * vd // T))
        else:
            nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
            kvr = nkv // T if T <= nkv else 1
            lin(f"{a}.qkv_proj.weight", ((nh // T + 2 * kvr) * hd, H))
            lin(f"{a}.o_proj.weight", (H, nh * hd // T))
            out[f"{a}.q_norm.weight"] = ((hd,), dt)
            out[f"{a}.k_norm.weight"] = ((hd,), dt)
        m = f"{p}.mlp"
        if cfg.is_moe_layer(L):
            E, mI, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_shared_experts
            out[f"{m}.gate.weight"] = ((E, H), dt)
            if cfg.is_mla:
                out[f"{m}.gate.e_score_correction_bias"] = ((E,), "float32")
            El, Il = (E // T, mI) if lay.ep else (E, mI // T)
            lin(f"{m}.experts.routed_experts.w13_weight", (El, 2 * Il, H), f"{m}.experts.routed_experts.w13_weight_scale_inv")
            lin(f"{m}.experts.routed_experts.w2_weight", (El, H, Il), f"{m}.experts.routed_experts.w2_weight_scale_inv")
            if S:
                lin(f"{m}.shared_experts.gate_up_proj.weight", (2 * S * mI // T, H))
                lin(f"{m}.shared_experts.down_proj.weight", (H, S * mI // T))
        else:
            I = cfg["intermediate_size"]
            lin(f"{m}.gate_up_proj.weight", (2 * I // T, H))
            lin(f"{m}.down_proj.weight", (H, I // T))
    out["model.norm.weight"] = ((H,), dt)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((Vp // T, H), dt)
    return out


def md_dests(cfg, lay):
    shapes = {}
    for rank in range(lay.world_size):
        for name, v in layouts_md_shapes(cfg, lay, rank).items():
            shapes[(rank, name)] = v
    return make_dest_metas(shapes)


# ------------------------------------------------------------------------------------------
# materializing a whole inference world from recipes (with a write counter)


def rand_sources(cfg, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for p in param_specs(cfg):
        out[p.name] = torch.randn(p.shape, generator=g).to(torch_dtype(p.dtype) if dtype is None else dtype)
    return out


def materialize(rs: RecipeSet, dests, sources):
    """Run every recipe, write its outputs into per-rank tensors; count writes per element."""
    bufs = {k: torch.zeros(d.shape, dtype=torch_dtype(d.dtype)) for k, d in dests.items()}
    counts = {k: torch.zeros(math.prod(d.shape), dtype=torch.int32) for k, d in dests.items()}
    for r in rs.recipes:
        outs = recipe_outputs(r, sources.__getitem__)
        for o, t in zip(r.outputs, outs):
            assert t.dtype == torch_dtype(o.dtype) and t.is_contiguous()
            for rank in r.ranks:
                a, b = box_flat_range(o.box, dests[(rank, o.tensor)].shape)
                buf = bufs[(rank, o.tensor)]
                buf.view(-1).view(torch.uint8 if buf.element_size() == 1 else buf.dtype)[a:b] = (
                    t.reshape(-1).view(torch.uint8) if buf.element_size() == 1 else t.reshape(-1)
                )
                counts[(rank, o.tensor)][a:b] += 1
    return bufs, counts


# ------------------------------------------------------------------------------------------
# shapes and exact cover


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda l: l.describe())
def test_dest_shapes_match_layouts_md_and_validate(family, lay):
    cfg = FAMILIES[family]()
    rs = build_recipes(cfg, lay)
    for rank in range(lay.world_size):
        got = expected_dest_shapes(cfg, lay, rank, recipeset=rs)
        want = layouts_md_shapes(cfg, lay, rank)
        assert got == want, set(got.items()) ^ set(want.items())
    assert set(expected_dests(rs)) == {(rk, n) for rk in range(lay.world_size) for n in layouts_md_shapes(cfg, lay, rk)}
    validate(rs, sources_of(cfg), md_dests(cfg, lay))  # every byte once, dtypes, sources
    for r in rs.recipes:
        assert tuple(b - a for a, b in r.outputs[0].box) == r.shape
        assert r.transform == ("fp8_block" if len(r.outputs) == 2 else "copy")


def test_some_shapes_by_hand():
    d = expected_dest_shapes(qwen_dense(), InferenceLayout(tp=4), 3)
    assert d["model.layers.0.self_attn.qkv_proj.weight"] == ((192, 256), "bfloat16")  # (1+2*1)*64
    assert d["model.embed_tokens.weight"] == ((256, 256), "bfloat16")  # 1024/4
    assert "lm_head.weight" not in d  # tied
    d = expected_dest_shapes(qwen_moe(), InferenceLayout(tp=2, quant="fp8"), 1)
    assert d["model.layers.1.mlp.experts.routed_experts.w13_weight"] == ((16, 128, 256), "float8_e4m3fn")
    assert d["model.layers.1.mlp.experts.routed_experts.w13_weight_scale_inv"] == ((16, 1, 2), "float32")
    assert d["model.layers.1.mlp.experts.routed_experts.w2_weight"] == ((16, 256, 64), "float8_e4m3fn")
    assert d["model.layers.1.mlp.gate.weight"] == ((16, 256), "bfloat16")
    d = expected_dest_shapes(mla(), InferenceLayout(tp=2, ep=True, quant="fp8"), 0)
    assert d["model.layers.0.self_attn.fused_qkv_a_proj.weight"] == ((112, 256), "float8_e4m3fn")
    assert d["model.layers.0.self_attn.q_b_proj.weight_scale_inv"] == ((1, 1), "float32")
    assert d["model.layers.1.mlp.gate.e_score_correction_bias"] == ((8,), "float32")
    assert d["model.layers.1.mlp.experts.routed_experts.w13_weight"] == ((4, 256, 256), "float8_e4m3fn")
    assert d["model.layers.1.mlp.shared_experts.gate_up_proj.weight"] == ((128, 256), "float8_e4m3fn")
    assert d["model.layers.0.mlp.gate_up_proj.weight"] == ((512, 256), "float8_e4m3fn")
    assert d["lm_head.weight"] == ((512, 256), "bfloat16")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_byte_written_once_by_running_recipes(family):
    cfg = FAMILIES[family]()
    for lay in (InferenceLayout(tp=2, dp=2, ep=True, quant="fp8"), InferenceLayout(tp=4)):
        rs = build_recipes(cfg, lay)
        dests = md_dests(cfg, lay)
        _, counts = materialize(rs, dests, rand_sources(cfg))
        for k, c in counts.items():
            assert (c == 1).all(), k


def test_replicas_and_replicated_tensors_are_extra_ranks_not_recipes():
    cfg = qwen_dense()
    lay = InferenceLayout(tp=2, dp=3)
    rs = build_recipes(cfg, lay)
    names = [r.name for r in rs.recipes]
    assert len(names) == len(set(names))
    norm = [r for r in rs.recipes if r.outputs[0].tensor == "model.norm.weight"]
    assert len(norm) == 1 and norm[0].ranks == (0, 1, 2, 3, 4, 5)
    qkv = [r for r in rs.recipes if r.outputs[0].tensor == "model.layers.0.self_attn.qkv_proj.weight"]
    assert [r.ranks for r in qkv] == [(0, 2, 4), (1, 3, 5)]
    assert set(rs.for_rank(5)) == {r for r in rs.recipes if 5 in r.ranks}
    assert rs.for_source("model.layers.0.self_attn.k_proj.weight") == tuple(qkv)


# ------------------------------------------------------------------------------------------
# contents (C4, C5, C6, C7, C8, C9)


@pytest.mark.parametrize("tp", [2, 4])
def test_C4_gqa_qkv_content(tp):
    cfg = qwen_dense()  # 4 q heads, 2 kv heads, hd 64
    lay = InferenceLayout(tp=tp)
    rs = build_recipes(cfg, lay)
    src = rand_sources(cfg, seed=tp)
    bufs, _ = materialize(rs, md_dests(cfg, lay), src)
    hd, qh = 64, 4 // tp
    for L in range(2):
        a = f"model.layers.{L}.self_attn"
        q, k, v = (src[f"{a}.{x}_proj.weight"] for x in "qkv")
        for r in range(tp):
            kvh = [r * (2 // tp) + i for i in range(2 // tp)] if tp <= 2 else [r // (tp // 2)]
            want = torch.cat(
                [q[r * qh * hd:(r + 1) * qh * hd]]
                + [k[h * hd:(h + 1) * hd] for h in kvh]
                + [v[h * hd:(h + 1) * hd] for h in kvh]
            )
            assert torch.equal(bufs[(r, f"{a}.qkv_proj.weight")], want)
            o = src[f"{a}.o_proj.weight"]
            w = 256 // tp
            assert torch.equal(bufs[(r, f"{a}.o_proj.weight")], o[:, r * w:(r + 1) * w])


def test_C5_experts_ep4_each_global_expert_once():
    cfg = qwen_moe()  # 16 experts
    lay = InferenceLayout(tp=4, ep=True)
    rs = build_recipes(cfg, lay)
    src = rand_sources(cfg)
    for L in range(2):
        for e in range(16):
            pre = f"model.layers.{L}.mlp.experts.{e}"
            src[f"{pre}.gate_proj.weight"].fill_(3 * e + 1)
            src[f"{pre}.up_proj.weight"].fill_(3 * e + 2)
            src[f"{pre}.down_proj.weight"].fill_(3 * e + 3)
    bufs, counts = materialize(rs, md_dests(cfg, lay), src)
    for L in range(2):
        m = f"model.layers.{L}.mlp.experts.routed_experts"
        seen = []
        for r in range(4):
            w13, w2 = bufs[(r, f"{m}.w13_weight")], bufs[(r, f"{m}.w2_weight")]
            assert w13.shape == (4, 256, 256) and w2.shape == (4, 256, 128)
            for j in range(4):
                e = r * 4 + j  # vLLM linear placement
                assert (w13[j, :128] == 3 * e + 1).all() and (w13[j, 128:] == 3 * e + 2).all()
                assert (w2[j] == 3 * e + 3).all()
                seen.append(int(w13[j, 0, 0].item() - 1) // 3)
        assert sorted(seen) == list(range(16))


def test_experts_without_ep_are_tp_sliced():
    cfg = qwen_moe()
    lay = InferenceLayout(tp=2)
    rs = build_recipes(cfg, lay)
    src = rand_sources(cfg, seed=4)
    bufs, _ = materialize(rs, md_dests(cfg, lay), src)
    m = "model.layers.0.mlp.experts"
    for r in range(2):
        for e in (0, 7, 15):
            g, u, d = (src[f"{m}.{e}.{x}_proj.weight"] for x in ("gate", "up", "down"))
            rows = slice(r * 64, (r + 1) * 64)
            assert torch.equal(bufs[(r, f"{m}.routed_experts.w13_weight")][e], torch.cat([g[rows], u[rows]]))
            assert torch.equal(bufs[(r, f"{m}.routed_experts.w2_weight")][e], d[:, rows])


def test_C6_tied_embeddings_and_vocab_padding():
    cfg = qwen_dense()  # tied, V=1000 -> Vp=1024
    assert cfg.tie_word_embeddings
    lay = InferenceLayout(tp=4)
    rs = build_recipes(cfg, lay)
    assert not any(o.tensor == "lm_head.weight" for r in rs.recipes for o in r.outputs)
    assert not rs.for_source("lm_head.weight")
    emb = [r for r in rs.recipes if r.outputs[0].tensor == "model.embed_tokens.weight"]
    assert len(emb) == 4
    assert [p.source for p in emb[3].pieces] == ["model.embed_tokens.weight", None]
    assert emb[3].pieces[1].dst_box == ((1000 - 768, 256), (0, 256))
    src = rand_sources(cfg)
    bufs, _ = materialize(rs, md_dests(cfg, lay), src)
    full = torch.cat([bufs[(r, "model.embed_tokens.weight")] for r in range(4)])
    assert torch.equal(full[:1000], src["model.embed_tokens.weight"])
    assert (full[1000:] == 0).all()
    # a checkpoint that still carries a tied lm_head copy: deliberately ignored, not an error
    sd = {p.name: p.dtype for p in param_specs(cfg)} | {"lm_head.weight": "bfloat16"}
    rs2 = build_recipes(cfg, lay, source_dtypes=sd)
    assert rs2.ignored == {"lm_head.weight"}
    validate(rs2, sources_of(cfg) | {"lm_head.weight": ((1000, 256), "bfloat16")}, md_dests(cfg, lay))


def test_untied_lm_head_padded():
    cfg = mla()
    lay = InferenceLayout(tp=2)
    rs = build_recipes(cfg, lay)
    src = rand_sources(cfg, dtype=None)
    bufs, _ = materialize(rs, md_dests(cfg, lay), src)
    full = torch.cat([bufs[(r, "lm_head.weight")] for r in range(2)])
    assert torch.equal(full[:1000], src["lm_head.weight"]) and (full[1000:] == 0).all()
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bufs[(1, bias)].dtype == torch.float32 and torch.equal(bufs[(1, bias)], src[bias])


def test_mla_content():
    cfg = mla()
    lay = InferenceLayout(tp=2)
    rs = build_recipes(cfg, lay)
    src = rand_sources(cfg)
    bufs, _ = materialize(rs, md_dests(cfg, lay), src)
    a = "model.layers.0.self_attn"
    fused = torch.cat([src[f"{a}.q_a_proj.weight"], src[f"{a}.kv_a_proj_with_mqa.weight"]])
    for r in range(2):
        assert torch.equal(bufs[(r, f"{a}.fused_qkv_a_proj.weight")], fused)
        assert torch.equal(bufs[(r, f"{a}.q_b_proj.weight")], src[f"{a}.q_b_proj.weight"][r * 96:(r + 1) * 96])
        assert torch.equal(bufs[(r, f"{a}.kv_b_proj.weight")], src[f"{a}.kv_b_proj.weight"][r * 128:(r + 1) * 128])
        assert torch.equal(bufs[(r, f"{a}.o_proj.weight")], src[f"{a}.o_proj.weight"][:, r * 64:(r + 1) * 64])
        m = "model.layers.1.mlp.shared_experts"
        g, u = src[f"{m}.gate_proj.weight"], src[f"{m}.up_proj.weight"]
        assert torch.equal(bufs[(r, f"{m}.gate_up_proj.weight")], torch.cat([g[r * 64:(r + 1) * 64], u[r * 64:(r + 1) * 64]]))


def test_C7_fp8_qkv_tp2_matches_quantized_local_bf16():
    # q heads 4, kv 2, hd 48 -> local qkv rows (2+2)*48 = 192: not a multiple of 128
    cfg = qwen_dense(head_dim=48)
    lay = InferenceLayout(tp=2, quant="fp8")
    rs = build_recipes(cfg, lay)
    src = rand_sources(cfg, seed=9)
    bufs, _ = materialize(rs, md_dests(cfg, lay), src)
    a = "model.layers.1.self_attn"
    for r in range(2):
        q, k, v = (src[f"{a}.{x}_proj.weight"] for x in "qkv")
        local = torch.cat([q[r * 96:(r + 1) * 96], k[r * 48:(r + 1) * 48], v[r * 48:(r + 1) * 48]])
        wq, ws = quantize_fp8_block(local)
        w, s = bufs[(r, f"{a}.qkv_proj.weight")], bufs[(r, f"{a}.qkv_proj.weight_scale_inv")]
        assert s.shape == (2, 2)
        assert torch.equal(w.view(torch.uint8), wq.view(torch.uint8)) and torch.equal(s, ws)


def test_C8_fp32_master_is_a_planned_cast():
    cfg = qwen_dense()
    for lay in (InferenceLayout(tp=2), InferenceLayout(tp=2, quant="fp8")):
        rs = build_recipes(cfg, lay)
        validate(rs, sources_of(cfg, dtype="float32"), md_dests(cfg, lay))  # planned cast: OK
        src32 = rand_sources(cfg, seed=1, dtype=torch.float32)
        src16 = {k: v.to(torch.bfloat16) for k, v in src32.items()}
        b32, _ = materialize(rs, md_dests(cfg, lay), src32)
        b16, _ = materialize(rs, md_dests(cfg, lay), src16)
        for k in b32:  # cast first, then quantize: identical to serving the bf16 tensor
            assert k[1].endswith("scale_inv") or b32[k].dtype != torch.float32
            assert torch.equal(b32[k].view(torch.uint8), b16[k].view(torch.uint8)), k


def test_C8_refusals_name_the_tensor():
    cfg = qwen_dense()
    lay = InferenceLayout(tp=2, quant="fp8")
    rs = build_recipes(cfg, lay)
    dests = md_dests(cfg, lay)
    # a copy recipe into a float8 destination (raw cast into fp8) is refused
    bad = []
    for r in rs.recipes:
        if r.name == "model.layers.0.mlp.down_proj.weight@tp1":
            r = replace(r, transform="copy", assembled_dtype="bfloat16",
                        outputs=(Output(r.outputs[0].tensor, r.outputs[0].box, "float8_e4m3fn"),))
        bad.append(r)
    bad_set = RecipeSet(bad, layout=lay)
    with pytest.raises(PlanError) as ei:
        validate(bad_set, sources_of(cfg), dests)
    msg = str(ei.value)
    assert "model.layers.0.mlp.down_proj.weight" in msg and "fp8_block" in msg
    # a float8 training tensor cannot be cast as planned
    srcs = sources_of(cfg)
    srcs["model.layers.1.self_attn.k_proj.weight"] = (srcs["model.layers.1.self_attn.k_proj.weight"][0], "float8_e4m3fn")
    with pytest.raises(PlanError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*float8"):
        validate(rs, srcs, dests)
    # destination dtype mismatch (receiver holds fp32 where the plan writes bf16)
    d2 = dict(dests)
    k = (0, "model.norm.weight")
    d2[k] = replace(d2[k], dtype="float32", nbytes=d2[k].nbytes * 2)
    with pytest.raises(PlanError, match=r"model\.norm\.weight.*float32"):
        validate(rs, sources_of(cfg), d2)


def test_C9_non_contiguous_sources():
    cfg = qwen_dense()
    lay = InferenceLayout(tp=2, quant="fp8")
    rs = build_recipes(cfg, lay)
    src = rand_sources(cfg, seed=2)
    views = {}
    for k, t in src.items():
        if t.dim() == 2:
            views[k] = t.t().contiguous().t()  # same values, transposed strides
            assert not views[k].is_contiguous()
        else:
            big = torch.zeros(t.shape[0] * 2, dtype=t.dtype)
            big[::2] = t
            views[k] = big[::2]  # strided 1-D view
    for r in rs.recipes:
        a = recipe_outputs(r, src.__getitem__)
        b = recipe_outputs(r, views.__getitem__)
        for x, y in zip(a, b):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), r.name


# ------------------------------------------------------------------------------------------
# validation: C2, C3, cover


def test_C2_unused_source_named():
    cfg = qwen_dense()
    lay = InferenceLayout(tp=2)
    rs = build_recipes(cfg, lay)
    srcs = sources_of(cfg) | {"model.layers.0.mlp.renamed_proj.weight": ((4, 4), "bfloat16")}
    with pytest.raises(PlanError) as ei:
        validate(rs, srcs, md_dests(cfg, lay))
    msg = str(ei.value)
    assert "model.layers.0.mlp.renamed_proj.weight" in msg and "not declared ignored" in msg
    assert msg.splitlines()[0].startswith("weight plan refused") and "1 problem" in msg.splitlines()[0]
    # declared ignored -> fine
    validate(RecipeSet(rs.recipes, {"model.layers.0.mlp.renamed_proj.weight"}), srcs, md_dests(cfg, lay))


def test_mtp_layers_ignored_for_deepseek():
    cfg = mla(num_nextn_predict_layers=1)
    sd = {p.name: p.dtype for p in param_specs(cfg)}
    sd["model.layers.2.eh_proj.weight"] = "bfloat16"  # MTP layer index = num_layers
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = "float32"
    sd["model.layers.0.self_attn.bogus.weight"] = "bfloat16"
    rs = build_recipes(cfg, InferenceLayout(tp=2), source_dtypes=sd)
    assert rs.ignored == {"model.layers.2.eh_proj.weight", "model.layers.0.self_attn.rotary_emb.inv_freq"}


def test_C3_missing_source_named():
    cfg = qwen_moe()
    lay = InferenceLayout(tp=2, ep=True)
    rs = build_recipes(cfg, lay)
    srcs = sources_of(cfg)
    del srcs["model.layers.1.mlp.experts.13.up_proj.weight"]
    with pytest.raises(PlanError) as ei:
        validate(rs, srcs, md_dests(cfg, lay))
    msg = str(ei.value)
    assert "training side lacks parameter 'model.layers.1.mlp.experts.13.up_proj.weight'" in msg
    assert "w13_weight[5]@tp1" in msg  # expert 13 -> rank 1, slot 5


def test_overlap_gap_and_uncovered_named():
    cfg = qwen_moe()
    lay = InferenceLayout(tp=2, ep=True, quant="fp8")
    rs = build_recipes(cfg, lay)
    dests = md_dests(cfg, lay)
    srcs = sources_of(cfg)
    recs = list(rs.recipes)
    # duplicate one expert slot -> overlap
    dup = next(r for r in recs if r.name == "model.layers.0.mlp.experts.routed_experts.w2_weight[3]@tp0")
    with pytest.raises(PlanError, match=r"model\.layers\.0\.mlp\.experts\.routed_experts\.w2_weight.*written twice"):
        validate(RecipeSet(recs + [replace(dup, name=dup.name + "-again")]), srcs, dests)
    # drop one expert slot -> gap in weight and scale (its sources become unused too)
    gap = [r for r in recs if r.name != "model.layers.1.mlp.experts.routed_experts.w13_weight[2]@tp1"]
    with pytest.raises(PlanError) as ei:
        validate(RecipeSet(gap), srcs, dests)
    msg = str(ei.value)
    assert "'model.layers.1.mlp.experts.routed_experts.w13_weight' on rank 1: elements" in msg
    assert "'model.layers.1.mlp.experts.routed_experts.w13_weight_scale_inv' on rank 1" in msg
    assert "model.layers.1.mlp.experts.10.gate_proj.weight" in msg  # unused
    # drop every recipe of a tensor -> uncovered
    none = [r for r in recs if r.outputs[0].tensor != "model.norm.weight"]
    with pytest.raises(PlanError, match=r"'model\.norm\.weight' on rank 0 .* written by no recipe"):
        validate(RecipeSet(none, {"model.norm.weight"}), srcs, dests)
    # dest the engine does not have; dest shape mismatch
    d2 = dict(dests)
    del d2[(1, "model.layers.0.self_attn.q_norm.weight")]
    k = (0, "model.layers.0.self_attn.o_proj.weight")
    d2[k] = replace(d2[k], shape=(256, 64))
    with pytest.raises(PlanError) as ei:
        validate(rs, srcs, d2)
    msg = str(ei.value)
    assert "model.layers.0.self_attn.q_norm.weight' on rank 1, which that rank does not have" in msg
    assert "model.layers.0.self_attn.o_proj.weight" in msg and "out of bounds" in msg


def test_piece_errors_and_many_problems_listed():
    cfg = qwen_dense()
    lay = InferenceLayout(tp=2)
    rs = build_recipes(cfg, lay)
    srcs = sources_of(cfg)
    srcs["model.layers.0.self_attn.q_proj.weight"] = ((100, 256), "bfloat16")  # too small
    recs = list(rs.recipes)
    i = next(i for i, r in enumerate(recs) if r.name == "model.layers.1.mlp.gate_up_proj.weight@tp0")
    r = recs[i]
    recs[i] = replace(r, pieces=r.pieces[:1])  # up rows missing in the assembled tensor
    with pytest.raises(PlanError) as ei:
        validate(RecipeSet(recs), srcs, md_dests(cfg, lay))
    msg = str(ei.value)
    assert "slice ((0, 128), (0, 256)) of source 'model.layers.0.self_attn.q_proj.weight' is outside" in msg
    assert "'model.layers.1.mlp.gate_up_proj.weight@tp0': pieces cover" in msg
    # many problems: listed up to 20, counted all
    with pytest.raises(PlanError) as ei:
        validate(rs, {}, md_dests(cfg, lay))
    lines = str(ei.value).splitlines()
    assert len(lines) == 1 + 20 + 1 and lines[-1].strip().startswith("... and")


def test_source_larger_than_config_is_refused():
    cfg = qwen_dense()
    lay = InferenceLayout(tp=2)
    srcs = sources_of(cfg) | {"model.embed_tokens.weight": ((1100, 256), "bfloat16")}
    with pytest.raises(PlanError, match=r"'model\.embed_tokens\.weight' has shape \(1100, 256\) but the recipes read only"):
        validate(build_recipes(cfg, lay), srcs, md_dests(cfg, lay))


def test_mla_without_q_lora_builds_exact_cover():
    cfg = mla(q_lora_rank=None)
    lay = InferenceLayout(tp=2, quant="fp8")
    rs = build_recipes(cfg, lay)
    validate(rs, sources_of(cfg), make_dest_metas(expected_dests(rs)))
    d = expected_dest_shapes(cfg, lay, 1, recipeset=rs)
    assert d["model.layers.0.self_attn.q_proj.weight"] == ((96, 256), "float8_e4m3fn")
    assert d["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == ((48, 256), "float8_e4m3fn")


def test_divisibility_errors_name_tensor():
    with pytest.raises(PlanError, match="padded vocab .* = 1024 is not divisible by tp = 3"):
        build_recipes(qwen_dense(), InferenceLayout(tp=3))
    with pytest.raises(PlanError, match="self_attn num_attention_heads = 4 is not divisible by tp = 3"):
        build_recipes(qwen_dense(vocab_size=960), InferenceLayout(tp=3))
    with pytest.raises(PlanError, match="experts num_experts .* 16 is not divisible by tp = 32"):
        build_recipes(qwen_moe(num_attention_heads=32, num_key_value_heads=32), InferenceLayout(tp=32, ep=True))


# ------------------------------------------------------------------------------------------
# fusion groups, splitting


def test_fusion_groups():
    cfg = qwen_dense()
    rs = build_recipes(cfg, InferenceLayout(tp=2, dp=2))
    groups = fusion_groups(rs)
    assert sum(len(g) for g in groups) == len(rs)
    assert [r.name for r in groups[0]] == ["model.embed_tokens.weight@tp0", "model.embed_tokens.weight@tp1"]
    qkv = next(g for g in groups if "model.layers.0.self_attn.q_proj.weight" in g[0].sources)
    assert [r.name for r in qkv] == [f"model.layers.0.self_attn.qkv_proj.weight@tp{i}" for i in range(2)]
    gu = next(g for g in groups if "model.layers.1.mlp.gate_proj.weight" in g[0].sources)
    assert {s for r in gu for s in r.sources} == {"model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.up_proj.weight"}
    # checkpoint order of first sources; deterministic
    order = {p.name: i for i, p in enumerate(param_specs(cfg))}
    keys = [min(order[s] for r in g for s in r.sources) for g in groups]
    assert keys == sorted(keys)
    assert [[r.name for r in g] for g in fusion_groups(rs.recipes)] == [[r.name for r in g] for g in groups]
    moe = build_recipes(mla(), InferenceLayout(tp=2))
    g = next(g for g in fusion_groups(moe) if "model.layers.1.mlp.experts.3.gate_proj.weight" in g[0].sources)
    assert [r.name for r in g] == ["model.layers.1.mlp.experts.routed_experts.w13_weight[3]@tp0", "model.layers.1.mlp.experts.routed_experts.w13_weight[3]@tp1"]


def _write(outputs_by_recipe, dests):
    bufs = {k: torch.zeros(d.shape, dtype=torch_dtype(d.dtype)).view(-1).view(torch.uint8) for k, d in dests.items()}
    for r, outs in outputs_by_recipe:
        for o, t in zip(r.outputs, outs):
            d = dests[(r.ranks[0], o.tensor)]
            a, b = box_flat_range(o.box, d.shape)
            n = t.element_size()
            bufs[(r.ranks[0], o.tensor)][a * n:b * n] = t.reshape(-1).view(torch.uint8)
    return bufs


@pytest.mark.parametrize("lay", [InferenceLayout(tp=1, quant="fp8"), InferenceLayout(tp=2), InferenceLayout(tp=2, ep=True, quant="fp8")],
                         ids=lambda l: l.describe())
@pytest.mark.parametrize("max_rows", [1, 100, 130, 300])
def test_split_recipe_byte_identical(lay, max_rows):
    cfg = mla()
    rs = build_recipes(cfg, lay)
    src = rand_sources(cfg, seed=max_rows)
    dests = make_dest_metas(expected_dests(rs))
    whole = [(r, recipe_outputs(r, src.__getitem__)) for r in rs.recipes]
    parts_all = []
    n_split = 0
    for r in rs.recipes:
        parts = split_recipe(r, max_rows)
        n_split += len(parts) > 1
        for p in parts:
            assert tuple(b - a for a, b in p.outputs[0].box) == p.shape
            if p.transform == "fp8_block" and len(parts) > 1:
                d = next(i for i, s in enumerate(p.shape) if s > 1)
                assert p.shape[d] % 128 == 0 or p is parts[-1]
        parts_all += parts
    assert n_split > 0
    split_set = RecipeSet(parts_all)
    validate(split_set, sources_of(cfg), dests)  # still an exact cover
    split = [(p, recipe_outputs(p, src.__getitem__)) for p in parts_all]
    a, b = _write(whole, dests), _write(split, dests)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_split_recipe_details():
    cfg = qwen_dense()
    rs = build_recipes(cfg, InferenceLayout(tp=4))
    emb = next(r for r in rs.recipes if r.name == "model.embed_tokens.weight@tp3")  # 232 real + 24 zero rows
    parts = split_recipe(emb, 100)
    assert [p.shape for p in parts] == [(100, 256), (100, 256), (56, 256)]
    assert [p.name for p in parts] == [f"model.embed_tokens.weight@tp3#rows{a}:{b}" for a, b in ((0, 100), (100, 200), (200, 256))]
    assert parts[2].pieces[0].src_box == ((968, 1000), (0, 256)) and parts[2].pieces[1].source is None
    assert parts[2].outputs[0].box == ((200, 256), (0, 256))
    assert split_recipe(emb, 1000) == [emb]
    fp = build_recipes(qwen_moe(), InferenceLayout(tp=1, quant="fp8"))
    w2 = next(r for r in fp.recipes if r.name == "model.layers.0.mlp.experts.routed_experts.w2_weight[5]@tp0")  # [1, 256, 128]
    parts = split_recipe(w2, 50)  # fp8 along N: bands of 128
    assert [p.shape for p in parts] == [(1, 128, 128), (1, 128, 128)]
    assert [p.outputs[1].box for p in parts] == [((5, 6), (0, 1), (0, 1)), ((5, 6), (1, 2), (0, 1))]
    assert parts[1].pieces[0].src_box == ((128, 256), (0, 128))


def test_assemble_out_and_transform_contract():
    cfg = qwen_dense()
    rs = build_recipes(cfg, InferenceLayout(tp=2, quant="fp8"))
    src = rand_sources(cfg)
    r = next(r for r in rs.recipes if r.transform == "fp8_block")
    out = torch.full(r.shape, float("nan"), dtype=torch.bfloat16)
    got = assemble(r, src.__getitem__, out=out)
    assert got is out and not torch.isnan(out.float()).any()
    q, s = apply_transform(r, out)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    with pytest.raises(ValueError):
        assemble(r, src.__getitem__, out=torch.empty(r.shape, dtype=torch.float32))


def test_kimi_k2_full_scale_recipe_count():
    cfg = load_config("kimi-k2")
    lay = InferenceLayout(tp=16, dp=8, ep=True, quant="fp8")
    rs = build_recipes(cfg, lay)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_layers))
    assert moe_layers == 60
    expert = 2 * 384 * moe_layers
    assert sum("experts.w" in r.name for r in rs.recipes) == expert
    assert all(len(r.ranks) == 8 for r in rs.recipes if "experts.w" in r.name)
    norm = next(r for r in rs.recipes if r.name == "model.norm.weight")
    assert norm.ranks == tuple(range(128))
