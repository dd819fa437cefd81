"""Tracing the draft model of speculative decoding beside the target (issue 57, C33).

An engine started with ``--speculative-config '{"method": "mtp", ...}'`` serves a second model,
the draft (vLLM's ``DeepSeekMTP``, ``Glm4MoeMTP``, ``Qwen3NextMTP`` ...: the checkpoint's
multi-token-prediction layers, built from ``speculative_config.draft_model_config`` by the
proposer, ``vllm/v1/spec_decode/llm_base_proposer.py``). Its parameters are filled by the draft
model's own ``load_weights`` from the same checkpoint, so they are traced exactly as the target's
(:func:`weight_transfer.engines.vllm.trace.loader.trace_load` on a meta skeleton of the draft model; on
its block-FP8 checkpoint form where the engine serves FP8), and :func:`with_draft` folds that trace
into the rank's :class:`~weight_transfer.plan.traced.LoaderTrace` under the prefix
:data:`~weight_transfer.plan.rules.mtp.DRAFT_PREFIX` (``draft.`` + the name inside the draft
model, the names the hand-written MTP rules use). The planner then writes the draft in the same
update as the target, under the same version.

What the draft does not hold at run time is not planned: vLLM's proposer replaces an MTP draft's
``embed_tokens`` with the target's and its ``lm_head`` and every layer's ``shared_head.head`` with
the target's ``lm_head`` (``_maybe_share_embeddings`` / ``_maybe_share_lm_head``: "Detected MTP
model. Sharing target model ..."). Those draft parameters are dropped from the trace, recorded in
``shared`` (checkpoint tensor -> the target tensor that serves it), and their checkpoint tensors
count as skipped. An EAGLE draft shares by comparing weights at load time (not a static rule), so
only MTP drafts are traced here (:data:`SPECULATIVE`).
"""
from __future__ import annotations

import dataclasses

from weight_transfer.plan import PlanError
from weight_transfer.plan.rules.mtp import DRAFT_PREFIX
from weight_transfer.plan.traced import LoaderTrace

__all__ = ["SPECULATIVE", "DRAFT_PREFIX", "with_draft", "draft_model_config", "shared_with_target",
           "refuse_missing_draft"]

SPECULATIVE = {"mtp": {"method": "mtp", "num_speculative_tokens": 1}}
"""``InferenceLayout.draft`` -> the ``speculative_config`` an engine serving it is started with."""


def draft_model_config(vllm_config):
    """The draft model's ``ModelConfig`` of ``vllm_config`` (its speculative config), or None."""
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(spec, "draft_model_config", None) if spec is not None else None


def shared_with_target(name: str, target_params) -> str | None:
    """The target parameter that serves the MTP draft's parameter ``name`` at run time (vLLM's
    proposer, module docstring), or None when the draft holds it: ``model.embed_tokens.weight`` ->
    the target's ``model.embed_tokens.weight``; ``lm_head.weight`` and ``*.shared_head.head.weight``
    -> the target's ``lm_head.weight`` (its ``model.embed_tokens.weight`` when the target ties them
    and holds no ``lm_head.weight``). ``target_params``: the target's parameter names."""
    if name == "model.embed_tokens.weight":
        return name
    if name == "lm_head.weight" or name.endswith(".shared_head.head.weight"):
        return "lm_head.weight" if "lm_head.weight" in target_params else "model.embed_tokens.weight"
    return None


def with_draft(target: LoaderTrace, draft: LoaderTrace) -> LoaderTrace:
    """``target``'s trace with the MTP ``draft``'s folded in (module docstring): the draft's
    parameters, refusals and kept scales under ``draft.``, minus those the target serves
    (``shared``: their checkpoint sources -> the target tensor); ``skipped`` the sources neither
    loader writes anywhere; ``quantized`` both; an ``error`` of either named."""
    params, served = dict(target.params), {}
    for n, tp in draft.params.items():
        to = shared_with_target(n, target.params)
        if to is None:
            params[DRAFT_PREFIX + n] = tp
        else:
            served.update({p.source: to for p in tp.pieces if p.source is not None})
    used = {p.source for tp in params.values() for p in tp.pieces if p.source is not None}
    shared = target.shared | {s: to for s, to in served.items() if s not in used}
    skipped = tuple(n for n in dict.fromkeys(target.skipped + draft.skipped + tuple(shared)) if n not in used)
    error = "; ".join(e for e in (target.error, f"the draft: {draft.error}" if draft.error else "") if e)
    return dataclasses.replace(
        target, params=params, refused=target.refused | {DRAFT_PREFIX + k: v for k, v in draft.refused.items()},
        skipped=skipped, error=error, source=f"{target.source} + draft {draft.source.removeprefix('vllm ')}",
        seconds=target.seconds + draft.seconds, quantized=target.quantized | draft.quantized,
        kept=target.kept + tuple(DRAFT_PREFIX + k for k in draft.kept), shared=shared)


def refuse_missing_draft(engine: dict, sources) -> None:
    """Before planning: when the engine serves an MTP draft (``engine``: what its first worker
    published, :data:`weight_transfer.api.ENGINE_KEY`: ``layout.draft == "mtp"`` and its
    ``hf_config``) and the trainer's checkpoint names ``sources`` hold none of the MTP layers'
    tensors (``model.layers.{L}.*`` for ``L`` in ``[num_hidden_layers, + num_nextn_predict_layers)``:
    transformers' own DeepSeek-V3 / GLM-4.5 classes drop them at load), :class:`weight_transfer.plan.PlanError`
    naming them and the two ways out, before any byte moves; the draft would otherwise stay at
    its checkpoint weights while the target moves (C33)."""
    lay = engine.get("layout")
    if getattr(lay, "draft", None) != "mtp":
        return
    hf = engine.get("hf_config") or {}
    first = int(hf.get("num_hidden_layers") or 0)
    n = int(hf.get("num_nextn_predict_layers") or 1)
    prefixes = tuple(f"model.layers.{i}." for i in range(first, first + n))
    if any(s.startswith(prefixes) for s in sources):
        return
    raise PlanError(f"the engine serves an MTP draft (checkpoint tensors {prefixes[0]}*"
                    + (f" .. {prefixes[-1]}*" if n > 1 else "") + ") and the trainer's source holds none of them: add "
                    "them to the source (trained, or loaded from the checkpoint and held frozen), or start vLLM without "
                    "--speculative-config (docs/VLLM.md, Draft models)")
