"""Traces kept on disk: vLLM's loader traced once per (model config, layout, vLLM, tracer source)
for the processes that plan or lay out a model without a live engine (the stand-in engine, the
simulation, the harness's planning), in a child process (:func:`weight_transfer.engines.vllm.trace.loader.trace_subprocess`)."""
from __future__ import annotations

import os

from weight_transfer.engines.vllm.trace.fp8 import quantized_config
from weight_transfer.engines.vllm.trace.loader import layout_spec, read_data, trace_subprocess, write_data
from weight_transfer.plan.traced import LoaderTrace

__all__ = ["cached_traces", "trace_cache_dir", "TRACER"]

TRACER = ("loader.py", "fp8.py", "draft.py", "cache.py")
"""The tracer's source files (beside this one): a change to any of them traces again."""


def trace_cache_dir():
    """Where :func:`cached_traces` keeps traces (``WT_TRACE_CACHE`` or
    ``~/.cache/weight_transfer/traces``)."""
    from pathlib import Path

    return Path(os.environ.get("WT_TRACE_CACHE") or Path.home() / ".cache" / "weight_transfer" / "traces")


def cached_traces(mcfg, layout) -> dict:
    """``{inference rank: LoaderTrace}`` of ``mcfg`` (a catalog
    :class:`~weight_transfer.model_config.ModelConfig`; its checkpoint names from
    :func:`weight_transfer.testing.catalog.param_specs`) on ``layout``, traced without a live engine
    (:func:`trace_subprocess` on its ``config.json``) and kept in :func:`trace_cache_dir` keyed by
    the config, the layout, vLLM's version and this module's source (a changed tracer traces
    again), so the processes of one trial or sweep trace once.
    Block FP8 (``layout.quant == "fp8"``) is traced on the FP8 checkpoint form
    (:mod:`weight_transfer.engines.vllm.trace.fp8`), a draft beside the target
    (:mod:`weight_transfer.engines.vllm.trace.draft`). ValueError for data-parallel attention
    (not traced without workers)."""
    import hashlib
    import json
    import tempfile
    from pathlib import Path

    from weight_transfer.engines.vllm.checkpoint import hf_config
    from weight_transfer.engines.vllm.engine import vllm_version
    from weight_transfer.testing.catalog import param_specs

    if layout.dp_attention:
        raise ValueError(f"{layout.describe()}: traced recipes are planned without data-parallel attention")
    specs = param_specs(mcfg, layout.draft)  # a draft's (MTP) layers too, and its engine keeps them
    cfgjson = json.dumps(quantized_config(hf_config(mcfg, draft=layout.draft), layout.quant, [p.name for p in specs]),
                         sort_keys=True)
    spec = layout_spec(layout)
    code = hashlib.sha256(b"".join(Path(__file__).with_name(f).read_bytes() for f in TRACER)).hexdigest()[:12]
    key = hashlib.sha256(f"{cfgjson}|{spec}|{layout.dtype}|{vllm_version()}|{code}".encode()).hexdigest()[:20]
    path = trace_cache_dir() / f"{key}.msgpack"
    if path.exists():
        return read_data(path, dict[int, LoaderTrace])
    sources = {p.name: (tuple(p.shape), p.dtype) for p in specs}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(cfgjson)
        traces = trace_subprocess(d, sources, [spec])[spec]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    write_data(tmp, traces)
    tmp.replace(path)
    return traces
