"""The draft model of speculative decoding: DeepSeek-V3 / Kimi-K2 multi-token prediction (MTP).

vLLM 0.32 serves a DeepSeek MTP draft (``--speculative-config '{"method": "mtp"}'``) as a model
of its own, ``DeepSeekMTP`` (``vllm/model_executor/models/deepseek_mtp.py``), beside the target;
its parameters are named inside that model and, here, carry the prefix :data:`DRAFT_PREFIX`
(they live in separate memory that cannot collide with the target's names). For checkpoint
layer ``L = num_hidden_layers + i`` (``i < num_nextn_predict_layers``), docs/LAYOUTS.md
("Draft model: DeepSeek MTP"):

- ``model.layers.L.{enorm,hnorm}.weight`` ``[H]`` and ``shared_head.norm.weight`` ``[H]``:
  replicated RMSNorm weights, same names;
- ``model.layers.L.eh_proj.weight`` ``[H, 2H]``: a plain ``nn.Linear`` in vLLM (not parallel,
  not quantized): replicated, ``layout.dtype`` even under FP8;
- every other tensor of layer ``L`` is the ``mtp_block`` decoder layer (MLA attention + MoE,
  ``DeepseekV2DecoderLayer`` with ``layer_idx = L``): the target's per-layer rules
  (:mod:`.mla`, :mod:`.moe` / :mod:`.dense`) under ``model.layers.L.mtp_block.``, BF16 or FP8
  exactly as the target's layers;
- shared with the target (vLLM's proposer, ``llm_base_proposer.py``
  ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``: an MTP draft always takes the target's
  ``embed_tokens`` and ``lm_head``): ``model.layers.L.embed_tokens.weight`` and
  ``model.layers.L.shared_head.head.weight`` have no destination of their own. They are written
  once, as the target's ``model.embed_tokens.weight`` / ``lm_head.weight``
  (:data:`SHARED`; the plan lists them in :attr:`~weight_transfer.plan.recipes.RecipeSet.shared`).
"""
from __future__ import annotations

from ...types import Piece, full_box
from .base import RecipeBuilder
from .layer import decoder_layer

DRAFT_PREFIX = "draft."
"""Prefix of every destination tensor of the draft model: ``draft.`` + vLLM's name inside
``DeepSeekMTP`` (``draft.model.layers.61.mtp_block.self_attn.o_proj.weight``)."""

SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
"""MTP-layer checkpoint suffix -> the target tensor vLLM's proposer serves it with (the draft
holds no copy; a tied model's ``lm_head`` is ``model.embed_tokens.weight`` itself)."""


def mtp_layers(cfg) -> range:
    """Checkpoint layer indices of the MTP layers: ``[num_hidden_layers, + num_nextn_predict_layers)``."""
    return range(cfg.num_layers, cfg.num_layers + (cfg.get("num_nextn_predict_layers") or 0))


def shared_sources(cfg) -> dict[str, str]:
    """MTP checkpoint tensor -> the target destination tensor that serves it (:data:`SHARED`)."""
    lm = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return {f"model.layers.{L}.{k}": (lm if k.startswith("shared_head") else v)
            for L in mtp_layers(cfg) for k, v in SHARED.items()}


def draft_layers(b: RecipeBuilder) -> None:
    """Recipes of every MTP layer of ``b.cfg`` (the module docstring), appended to ``b``."""
    cfg = b.cfg
    H = cfg.hidden_size
    for L in mtp_layers(cfg):
        src = f"model.layers.{L}"
        dst = f"{DRAFT_PREFIX}model.layers.{L}"
        for n in ("enorm", "hnorm", "shared_head.norm"):
            s = f"{src}.{n}.weight"
            b.copy(f"{dst}.{n}.weight", b.all_ranks, (H,), (Piece(s, full_box((H,)), full_box((H,))),))
        eh = f"{src}.eh_proj.weight"
        b.copy(f"{dst}.eh_proj.weight", b.all_ranks, (H, 2 * H), (Piece(eh, full_box((H, 2 * H)), full_box((H, 2 * H))),))
        b.rename = (f"{src}.", f"{dst}.mtp_block.")
        try:
            decoder_layer(b, src, L)  # the target's rules (MLA + MoE) under mtp_block
        finally:
            b.rename = None
