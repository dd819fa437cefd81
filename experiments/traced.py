"""Recipes for the harness's planning without a live engine (the simulation): the hand-written
rules for the three families that have them, the recipes traced from vLLM's own loader for the
rest, where a vLLM is installed (C29).

A live vLLM worker traces its own loader (:mod:`weight_transfer.engines.vllm.trace.loader`); without
one, :func:`recipes_for` traces in a child process from the model's ``config.json``
(:func:`weight_transfer.engines.vllm.trace.loader.trace_subprocess`: a meta skeleton per TP rank, no
weights) and keeps the traces in a cache directory (``WT_TRACE_CACHE``, default
``~/.cache/weight_transfer/traces``), keyed by the config, the layout and vLLM's version, so a
sweep traces each (model, layout) once. The report says which recipes it planned with.
"""
from __future__ import annotations

from weight_transfer.engines.vllm.trace.cache import trace_cache_dir  # re-exported
from weight_transfer.engines.vllm.trace.loader import layout_spec  # re-exported
from weight_transfer.model_config import ModelConfig
from weight_transfer.types import InferenceLayout, PlanError

__all__ = ["recipes_for", "trace_cache_dir", "layout_spec"]


def recipes_for(mcfg: ModelConfig, layout: InferenceLayout, *, source_dtypes=None):
    """``(RecipeSet, how)``: the hand-written recipes (``how`` = ``"hand-written rules"``) for an
    architecture that has them, else the recipes traced from vLLM's loader for ``layout``
    (``how`` names vLLM's version and the model class; block FP8 traced on its checkpoint form,
    and the quantization state the engine keeps). PlanError for a traced architecture without
    vLLM installed, with data-parallel attention (not traced without workers), or when the
    traced loader computes a tensor (named)."""
    from weight_transfer.plan import build_recipes
    from weight_transfer.plan.scaled import scaled_gather_line
    from weight_transfer.plan.traced import kept_line, recipes_from_traces

    if mcfg.hand_written:
        return build_recipes(mcfg, layout, source_dtypes=source_dtypes), "hand-written rules"
    from weight_transfer.engines.vllm.engine import vllm_available

    if not vllm_available():
        raise PlanError(f"model {mcfg.label}: architecture {mcfg.architecture!r} is planned from vLLM's traced "
                        "loader and vLLM is not installed (make vllm)")
    if layout.dp_attention:
        raise PlanError(f"model {mcfg.label}: {layout.describe()}: traced recipes are planned without "
                        "data-parallel attention (trace in the workers)")
    from weight_transfer.engines.vllm.trace.cache import cached_traces
    from weight_transfer.testing.catalog import param_specs

    traces = cached_traces(mcfg, layout)
    sources = {p.name: (tuple(p.shape), p.dtype) for p in param_specs(mcfg)}
    dtypes = source_dtypes or {n: dt for n, (_, dt) in sources.items()}
    rs = recipes_from_traces(traces, layout, model=mcfg.label, source_dtypes=dtypes)
    return rs, f"traced from {next(iter(traces.values())).source}" + kept_line(rs) + scaled_gather_line(rs)
