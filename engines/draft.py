"""The stand-in engine's speculative-decoding draft: vLLM 0.32's ``DeepSeekMTP`` (DeepSeek-V3 /
Kimi-K2 multi-token prediction), laid out from docs/LAYOUTS.md ("Draft model: DeepSeek MTP")
independently of the trainer-side rules (``reference/plan/rules/mtp.py``).

vLLM builds the draft as a model of its own beside the target; its parameter names are those
inside ``DeepSeekMTP``, here under the prefix :data:`PREFIX` (the draft's memory is separate
from the target's, the names cannot collide). Per MTP layer ``L`` (``num_hidden_layers <= L <
num_hidden_layers + num_nextn_predict_layers``), in vLLM's module order:
``enorm.weight`` ``[H]``, ``hnorm.weight`` ``[H]``, ``eh_proj.weight`` ``[H, 2H]`` (a plain
``nn.Linear``: whole on every rank, never quantized), ``shared_head.norm.weight`` ``[H]``, then
``mtp_block.*``: a ``DeepseekV2DecoderLayer`` with ``layer_idx = L`` (MLA attention, MoE when
layer ``L`` is one, the same TP / EP / FP8 as the target's layers).

Loading follows ``DeepSeekMTP.load_weights`` / ``_rewrite_spec_layer_name``: checkpoint names
``model.layers.L.{enorm,hnorm,eh_proj,shared_head}...`` keep their place, every other tensor
of layer ``L`` moves under ``mtp_block.``; ``model.layers.L.embed_tokens.weight`` and
``model.layers.L.shared_head.head.weight`` load nothing here: vLLM's proposer replaces the
draft's embedding and head by the target's (``_maybe_share_embeddings`` /
``_maybe_share_lm_head``: an MTP draft always shares), so the target's tensors serve them.
"""
from __future__ import annotations

PREFIX = "draft."
"""Prefix of the draft model's parameter names in the stand-in engine."""

_SPEC = ("enorm", "hnorm", "eh_proj", "shared_head")
"""vLLM's ``spec_layer_weight_names`` that stay at the MTP layer's top level (``embed_tokens``,
the other one, is shared with the target)."""
_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
"""MTP-layer tensors vLLM serves with the target's (no parameter of the draft)."""


def mtp_range(cfg) -> range:
    """Checkpoint layer indices of the MTP layers (empty without ``num_nextn_predict_layers``)."""
    return range(cfg.num_layers, cfg.num_layers + (cfg.get("num_nextn_predict_layers") or 0))


def add_params(b) -> None:
    """Append the draft's parameters to the stand-in's builder ``b``
    (:class:`weight_transfer.engines.params._Builder`), after the target's."""
    cfg, H = b.cfg, b.cfg.hidden_size
    if not cfg.is_mla or not mtp_range(cfg):
        raise ValueError(f"model {cfg.label}: draft 'mtp' needs DeepSeek-V3-style MTP layers "
                         f"(num_nextn_predict_layers={cfg.get('num_nextn_predict_layers')!r})")
    for L in mtp_range(cfg):
        d = f"{PREFIX}model.layers.{L}"
        b.plain(f"{d}.enorm.weight", (H,))
        b.plain(f"{d}.hnorm.weight", (H,))
        b.plain(f"{d}.eh_proj.weight", (H, 2 * H))  # nn.Linear: replicated, unquantized
        b.plain(f"{d}.shared_head.norm.weight", (H,))
        b.layer(f"{d}.mtp_block", L)  # the target's decoder layer (MLA + MoE) under mtp_block


def layer_prefix(layer: int, suffix: str) -> str | None:
    """Where checkpoint tensor ``model.layers.{layer}.{suffix}`` of an MTP layer loads:
    the engine-name prefix to put before ``suffix`` (``draft.model.layers.L.`` for the layer's
    own tensors, ``draft.model.layers.L.mtp_block.`` for the decoder layer's), or None for a
    tensor the draft shares with the target (skipped, as vLLM's proposer does)."""
    if suffix in _SHARED:
        return None
    top = suffix.split(".", 1)[0]
    d = f"{PREFIX}model.layers.{layer}."
    return d if top in _SPEC else d + "mtp_block."
