"""The worker's side of tracing vLLM's loader (C29): at ``init_weight_transfer_engine`` the
``one_sided`` backend's worker traces its own loader (:func:`weight_transfer.engines.vllm.trace.loader.trace_worker`)
with the checkpoint names and shapes the trainer published -- or, when it published none, those
of the safetensors checkpoint vLLM loaded (:func:`checkpoint_sources`) -- and publishes the
trace for the planner (:func:`publish_trace`).
"""
from __future__ import annotations

import os

from weight_transfer.engines.vllm.trace.loader import trace_worker
from weight_transfer.plan.traced import LoaderTrace

__all__ = ["checkpoint_sources", "publish_trace"]

_ST_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
              "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def checkpoint_sources(model: str, *, revision: str | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{checkpoint name: (shape, dtype name)}`` from the safetensors headers of the checkpoint
    vLLM loaded (``model``: a directory, or a Hugging Face id already in the local cache); no
    tensor data is read. ``{}`` when there is none (``load_format="dummy"``)."""
    import glob

    folder = model if os.path.isdir(model) else None
    if folder is None:
        try:
            from huggingface_hub import snapshot_download

            folder = snapshot_download(model, revision=revision, allow_patterns=["*.safetensors", "*.json"],
                                       local_files_only=True)
        except Exception:
            return {}
    from safetensors import safe_open

    out = {}
    for f in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(f, framework="pt") as fh:
            for k in fh.keys():
                sl = fh.get_slice(k)
                out[k] = (tuple(sl.get_shape()), _ST_DTYPES.get(sl.get_dtype(), sl.get_dtype().lower()))
    return out


def publish_trace(store, rank: int, vllm_config) -> LoaderTrace:
    """Trace this worker's loader (:func:`trace_worker`) with the trainer's names and shapes
    (:data:`~weight_transfer.plan.traced.SOURCES_KEY`, else the checkpoint's headers,
    :func:`checkpoint_sources`) and publish it under :data:`~weight_transfer.plan.traced.TRACE_KEY`
    for inference rank ``rank``. Never raises: a failure is the published trace's ``error``,
    and the planner says so (or falls back to the hand-written rules where they exist)."""
    from weight_transfer.control import protocol as control
    from weight_transfer.plan.traced import SOURCES_KEY, TRACE_KEY

    try:
        if store.check([SOURCES_KEY]):
            sources = control.get(store, SOURCES_KEY)
        else:
            mc = vllm_config.model_config
            sources = checkpoint_sources(str(mc.model), revision=getattr(mc, "revision", None))
        trace = (trace_worker(vllm_config, sources) if sources else
                 LoaderTrace(params={}, error="no checkpoint names to trace with (the trainer published none under "
                                             f"{SOURCES_KEY!r} and the engine has no safetensors checkpoint)"))
    except Exception as e:
        trace = LoaderTrace(params={}, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    control.put(store, TRACE_KEY.format(rank=rank), trace)
    return trace
