"""Tracing vLLM's own weight loader: which checkpoint bytes land where (C29).

vLLM knows how every model it serves is loaded: the model's ``load_weights``, its
``stacked_params_mapping``, each parameter's ``weight_loader`` (TP/EP sharding, fused
``qkv_proj`` / ``gate_up_proj``, expert placement, vocabulary padding). :func:`trace_load` runs
that code once on a **meta** skeleton of the model (no memory, never the live weights) with
``meta`` tensors of the trainer's checkpoint names and shapes, inside a
``TorchDispatchMode`` (vLLM's own layerwise reload counts copies the same way,
``model_loader/reload/meta.py: CopyCounter``), and records at the aten level:

- ``copy_(dst, src)`` where ``dst`` is a view of a parameter and ``src`` a view of a checkpoint
  tensor (or a cast of one): a :class:`~weight_transfer.types.Piece`, both views turned into boxes
  from their storage offset, sizes and strides (narrow, select, chunk, slicing: any view that is
  a box of its tensor);
- ``fill_(0)`` / ``zero_`` of a parameter view: a zero piece (vocabulary padding);
- anything else that writes a parameter, or a copy from a tensor computed from checkpoint bytes
  (arithmetic, concatenation, a transpose into the parameter, a broadcast): the parameter is
  **refused**, naming the aten op, and the plan refuses it (:mod:`weight_transfer.plan.traced`).

Checkpoint tensors the loader consumes without writing (a tied ``lm_head.weight``, another EP
rank's experts) are ``skipped``. The result is one :class:`~weight_transfer.plan.traced.LoaderTrace`
per inference rank; :func:`weight_transfer.plan.traced.recipes_from_traces` makes the recipes. A
block-FP8 model is traced on its FP8 checkpoint form (:mod:`weight_transfer.engines.vllm.trace.fp8`).

The skeleton is built inside a vLLM worker (:func:`trace_worker`: the worker's own ``vllm_config``
and parallel state, exactly this rank's loader) or in a process of its own (:func:`trace_layout`,
``python -m weight_transfer.engines.vllm.trace.loader``) for a model directory (``config.json`` only),
with a one-process gloo group whose TP/EP rank and size are set to each rank's in turn (the
loaders read them at construction and load): the stand-in engine, the simulation, the cross-check.
"""
from __future__ import annotations

import copy
import os
import time
from collections.abc import Mapping
from typing import TypedDict

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from weight_transfer.control import wire
from weight_transfer.engines.vllm.trace.fp8 import meta_kernels, trace_quantized
from weight_transfer.plan.traced import LoaderTrace, TracedParam
from weight_transfer.types import Box, new_piece, torch_dtype

__all__ = ["trace_load", "trace_worker", "trace_layout", "trace_subprocess", "trace_many_subprocess", "loaded_params", "loaded_params_subprocess", "meta_model", "view_box", "parse_layout",
           "layout_spec"]

_aten = torch.ops.aten
_FILLS = {_aten.fill_.Scalar, _aten.zero_.default}
_CASTS = {_aten._to_copy.default, _aten.clone.default}


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def view_box(t: torch.Tensor, shape: tuple[int, ...]) -> Box | None:
    """The box of a contiguous tensor of ``shape`` that the view ``t`` is (its storage offset,
    sizes and strides), as a box over ``shape`` with each of ``t``'s dims of extent > 1 on one
    dim of ``shape`` in increasing order; None when ``t`` is not such a box (a transpose, a
    reshape across dims, a broadcast)."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    off = t.storage_offset()
    start = []
    for s in strides:  # the view's first element, as an index into shape
        start.append(off // s)
        off %= s
    if off or any(a >= n for a, n in zip(start, shape) if n):
        return None
    ext = [1] * len(shape)
    bd = 0
    for size, stride in zip(t.shape, t.stride()):
        if size == 1:
            continue
        if stride == 0:
            return None
        while bd < len(shape) and (strides[bd] != stride or shape[bd] == 1):
            bd += 1
        if bd >= len(shape) or ext[bd] != 1:
            return None
        ext[bd] = size
        bd += 1
    if any(a + e > n for a, e, n in zip(start, ext, shape)):
        return None
    return tuple((a, a + e) for a, e in zip(start, ext))


class _Recorder(TorchDispatchMode):
    """Records the loader's writes into parameters (module docstring)."""

    def __init__(self, params: Mapping[int, tuple[str, tuple[int, ...]]], sources: Mapping[int, tuple[str, tuple]]):
        super().__init__()
        self.params = params
        self.sources = dict(sources)  # storage -> (checkpoint name, shape of the storage's tensor, box or None)
        self.computed: dict[int, str] = {}  # storage -> the aten op that computed it from checkpoint bytes
        self.pieces: dict[str, list] = {}
        self.refused: dict[str, str] = {}
        self.used: set[str] = set()

    def _src_box(self, t: torch.Tensor):
        """(checkpoint name, box over it) of a view of a checkpoint tensor or of a cast of one."""
        ent = self.sources.get(_key(t))
        if ent is None:
            return None
        name, shape, within = ent
        box = view_box(t, shape)
        if box is None:
            return name, None
        if within is not None:  # a cast of a box of the checkpoint tensor: compose
            box = tuple((w0 + a, w0 + b) for (w0, _), (a, b) in zip(within, box))
        return name, box

    def _refuse(self, pname: str, why: str) -> None:
        self.refused.setdefault(pname, why)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        pent = self.params.get(_key(dst))
        if pent is None:
            return
        pname, pshape = pent
        dbox = view_box(dst, pshape)
        if dbox is None:
            return self._refuse(pname, f"aten.copy_ into a view of it that is not a box (sizes {list(dst.shape)}, "
                                       f"strides {list(dst.stride())})")
        sb = self._src_box(src)
        if sb is None:
            op = self.computed.get(_key(src))
            if op is None:  # a tensor the loader made itself (constants): not checkpoint bytes
                return self._refuse(pname, f"aten.copy_ from a tensor the loader built ({list(src.shape)})")
            return self._refuse(pname, f"aten.copy_ of checkpoint bytes computed by aten.{op}")
        name, sbox = sb
        self.used.add(name)
        if sbox is None or tuple(src.shape) != tuple(dst.shape):
            return self._refuse(pname, f"aten.copy_ from {name} through a view that is not a box of it "
                                       f"(sizes {list(src.shape)}, strides {list(src.stride())}) or broadcast")
        dext = [b - a for a, b in dbox]
        sext = [b - a for a, b in sbox]
        k = len(dext) - len(sext)
        if k < 0 or dext[k:] != sext or any(e != 1 for e in dext[:k]):
            return self._refuse(pname, f"aten.copy_ from {name}{sext} into {dext}: a reshape, not a slice copy")
        self._add(pname, new_piece(name, sbox, dbox))

    def _add(self, pname: str, piece) -> None:
        """Later writes replace earlier ones they cover whole; a partial overwrite is refused."""
        lst = self.pieces.setdefault(pname, [])
        keep = []
        for q in lst:
            ov = all(max(a, c) < min(b, d) for (a, b), (c, d) in zip(q.dst_box, piece.dst_box))
            if not ov:
                keep.append(q)
            elif not all(c <= a and b <= d for (a, b), (c, d) in zip(q.dst_box, piece.dst_box)):
                return self._refuse(pname, "the loader overwrites part of an earlier write")
        keep.append(piece)
        self.pieces[pname] = keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _aten.copy_.default:
            if args[0].numel():
                self._copy(args[0], args[1])
        elif func in _FILLS:
            pent = self.params.get(_key(args[0]))
            if pent is not None and args[0].numel():
                value = args[1] if len(args) > 1 else 0
                dbox = view_box(args[0], pent[1])
                if value != 0 or dbox is None:
                    self._refuse(pent[0], f"aten.{func.__name__} with {value!r}")
                else:
                    self._add(pent[0], new_piece(None, (), dbox))
        else:
            self._derive(func, args, out)
        return out

    def _derive(self, func, args, out) -> None:
        ins = [a for a in _flat(args) if isinstance(a, torch.Tensor)]
        mutated = func._schema.is_mutable
        for a in ins:
            k = _key(a)
            if mutated and k in self.params and not getattr(func, "is_view", False):
                self._refuse(self.params[k][0], f"aten.{func.__name__} writes it")
        src = [a for a in ins if _key(a) in self.sources or _key(a) in self.computed]
        if not src:
            return
        outs = [o for o in _flat(out) if isinstance(o, torch.Tensor)]
        for o in outs:
            k = _key(o)
            if any(k == _key(a) for a in ins):
                continue  # a view: same storage, already known
            if func in _CASTS and len(src) == 1 and src[0] is args[0]:
                sb = self._src_box(args[0])
                if sb is not None and sb[1] is not None and tuple(o.shape) == tuple(args[0].shape) and o.is_contiguous():
                    name, box = sb
                    self.sources[k] = (name, tuple(o.shape), _expand(box, o.shape))
                    continue
            self.computed[k] = func.__name__


def _expand(box: Box, shape) -> Box | None:
    """``box`` (over the checkpoint tensor) as the ``within`` of a cast whose result has
    ``shape``: only when the box's extents are ``shape`` itself (same dims)."""
    if [b - a for a, b in box] != list(shape):
        return None
    return box


def _flat(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flat(y)
    else:
        yield x


def trace_load(model: torch.nn.Module, sources: Mapping[str, tuple[tuple[int, ...], str]], *,
               label: str = "") -> LoaderTrace:
    """Run ``model.load_weights`` (a meta skeleton: every parameter on ``meta``) on ``meta``
    tensors of ``sources`` (checkpoint name -> (global shape, dtype name)) and return what it
    wrote where (module docstring). The loader raising is returned as ``error`` (one line), not
    raised. ValueError when ``model`` has a parameter that is not on ``meta`` (the live weights
    are never traced)."""
    t0 = time.perf_counter()
    params: dict[int, tuple[str, tuple[int, ...]]] = {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for n, p in model.named_parameters():
        if p.device.type != "meta":
            raise ValueError(f"trace_load: parameter {n} is on {p.device}, not meta: the loader is traced on a "
                             "meta skeleton, never on the live weights")
        params[_key(p)] = (n, tuple(p.shape))
        shapes[n] = (tuple(p.shape), str(p.dtype).removeprefix("torch."))
    metas = {}
    for name, (shape, dtype) in sources.items():
        t = torch.empty(tuple(shape), dtype=torch_dtype(dtype), device="meta")
        metas[name] = t
    rec = _Recorder(params, {_key(t): (n, tuple(t.shape), None) for n, t in metas.items()})
    error = ""
    try:
        with rec, torch.no_grad():
            model.load_weights(iter(list(metas.items())))
    except Exception as e:  # the loader's own refusal: an unknown name, a shape it does not take
        error = f"{type(e).__name__} in {type(model).__name__}.load_weights: {str(e).splitlines()[0] if str(e) else ''}"
    out = {n: TracedParam(shapes[n][0], shapes[n][1], tuple(rec.pieces[n])) for n in shapes if n in rec.pieces}
    skipped = tuple(n for n in sources if n not in rec.used)
    import sys

    vllm = sys.modules.get("vllm")  # a real model's loader imported it; a toy loader did not
    who = f"vllm {getattr(vllm, '__version__', '?')}" if vllm is not None else "a loader without vllm:"
    return LoaderTrace(params=out, refused=dict(rec.refused), skipped=skipped, error=error,
                       source=f"{who} {type(model).__name__}.load_weights" + (f" {label}" if label else ""),
                       seconds=time.perf_counter() - t0)


_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.arange, torch.tensor, torch.randn, torch.rand,
              torch.empty_strided, torch.linspace}


class _MetaWeights(TorchFunctionMode):
    """While a skeleton is built: tensors made without a device go to ``meta`` when they are
    floating point (weights, rotary caches) and to the CPU when they are integers or booleans
    (index tables the loaders read, such as FusedMoE's expert map, whose ``.item()`` a meta
    tensor cannot answer)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES and kwargs.get("device") is None:
            dt = kwargs.get("dtype")
            if dt is None and func in (torch.arange, torch.tensor, torch.full):
                integral = not any(isinstance(a, float) or (isinstance(a, torch.Tensor) and a.is_floating_point())
                                   for a in _flat(args))
            else:
                integral = dt is not None and not (dt.is_floating_point or dt.is_complex)
            kwargs["device"] = "cpu" if integral else "meta"
        return func(*args, **kwargs)


def _isolated(vllm_config):
    """A shallow copy of ``vllm_config`` whose compilation config has empty layer registries
    (``static_forward_context``, ``static_all_moe_layers``): the skeleton's layers register
    there, not beside the live engine's (a deep copy would copy the live layers, KV cache
    included)."""
    cfg = copy.copy(vllm_config)
    cc = copy.copy(vllm_config.compilation_config)
    object.__setattr__(cc, "static_forward_context", {})
    object.__setattr__(cc, "static_all_moe_layers", [])
    object.__setattr__(cfg, "compilation_config", cc)
    return cfg


def meta_model(vllm_config, model_config=None) -> torch.nn.Module:
    """A skeleton of ``vllm_config``'s model (``model_config``: another model of it, the draft's)
    with every parameter on ``meta`` (integer index tables on the CPU, :class:`_MetaWeights`),
    built by vLLM's ``initialize_model`` from a copy of the config with empty layer registries
    (:func:`_isolated`: the layers register themselves there, not beside the live engine's)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    cfg = _isolated(vllm_config)
    with set_current_vllm_config(cfg), set_default_torch_dtype(cfg.model_config.dtype), _MetaWeights(), meta_kernels():
        return initialize_model(vllm_config=cfg, model_config=model_config, prefix="")


def trace_worker(vllm_config, sources: Mapping[str, tuple[tuple[int, ...], str]]) -> LoaderTrace:
    """This vLLM worker's loader, traced (:func:`trace_load` on :func:`meta_model`; a block-FP8
    model on its FP8 checkpoint form, :func:`weight_transfer.engines.vllm.trace.fp8.trace_quantized`;
    an MTP draft's beside it, :func:`weight_transfer.engines.vllm.trace.draft.with_draft`): run
    inside the worker, whose parallel state says its TP/EP rank. A failure to build the skeleton
    is returned as the trace's ``error``."""
    from weight_transfer.engines.vllm.trace.draft import draft_model_config, with_draft

    try:
        t = trace_quantized(lambda: meta_model(vllm_config), sources, trace_load)
        if (dmc := draft_model_config(vllm_config)) is not None:
            t = with_draft(t, trace_quantized(lambda: meta_model(vllm_config, dmc), sources, trace_load))
        return t
    except Exception as e:
        return LoaderTrace(params={}, error=f"building a meta skeleton of the model: {type(e).__name__}: "
                                            f"{str(e).splitlines()[0] if str(e) else ''}")


def _one_process_group(vllm_config) -> None:
    """A one-process gloo world (once per process) and vLLM's model-parallel groups over it, made
    again for each model (vLLM makes the EP group for MoE models only)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if not torch.distributed.is_initialized():
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                        distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
    ps.destroy_model_parallel()
    with set_current_vllm_config(vllm_config):
        ps.initialize_model_parallel(1, 1)


def _as_rank(group, rank: int, size: int) -> None:
    group.world_size, group.rank_in_group = size, rank


def engine_config(model_dir: str, *, tp: int = 1, ep: bool = False, dtype: str = "bfloat16", draft=None):
    """vLLM's ``VllmConfig`` for the model directory ``model_dir`` (its ``config.json`` is enough)
    at tensor-parallel size ``tp`` (expert-parallel with ``ep``), serving the speculative-decoding
    ``draft`` (``"mtp"``: :data:`weight_transfer.engines.vllm.trace.draft.SPECULATIVE`): what a
    worker of that engine would build its models from."""
    from vllm.engine.arg_utils import EngineArgs

    from weight_transfer.engines.vllm.trace.draft import SPECULATIVE

    ea = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype=dtype, load_format="dummy", enforce_eager=True,
                    max_model_len=256, speculative_config=SPECULATIVE[draft] if draft else None)
    cfg = ea.create_engine_config()
    cfg.parallel_config.tensor_parallel_size = tp
    cfg.parallel_config.enable_expert_parallel = ep
    return cfg


def trace_layout(model_dir: str, layout, sources: Mapping[str, tuple[tuple[int, ...], str]]) -> dict:
    """Inference rank -> :class:`~weight_transfer.plan.traced.LoaderTrace` for every rank of
    ``layout`` (an :class:`~weight_transfer.types.InferenceLayout`; TP, EP, DP replicas), traced
    in this process (module docstring): each TP rank's skeleton is built with vLLM's TP (and EP)
    group set to that rank, and DP replicas share their TP rank's trace. ``model_dir``'s
    ``config.json`` says the quantization (block FP8: ``trace_fp8.quantized_config``). ValueError
    for data-parallel attention."""
    from vllm.distributed import parallel_state as ps

    if layout.dp_attention:
        raise ValueError("trace_layout: data-parallel attention is not traced in one process (trace in the workers)")
    cfg = engine_config(model_dir, tp=layout.tp, ep=layout.ep, dtype=layout.dtype, draft=layout.draft)
    _one_process_group(cfg)
    per_tp = {}
    for r in range(layout.tp):
        _as_rank(ps.get_tp_group(), r, layout.tp)
        ep_group = getattr(ps, "_EP", None)
        if ep_group is not None:
            _as_rank(ep_group, r if layout.ep else 0, layout.tp if layout.ep else 1)
        try:
            per_tp[r] = trace_worker(cfg, sources)
        finally:
            _as_rank(ps.get_tp_group(), 0, 1)
            if ep_group is not None:
                _as_rank(ep_group, 0, 1)
    return {i: per_tp[i % layout.tp] for i in range(layout.world_size)}


def loaded_params(model_dir: str, layout, tp_rank: int, tensors: Mapping[str, torch.Tensor],
                  names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """What vLLM's own ``load_weights`` makes of the checkpoint ``tensors`` at TP rank
    ``tp_rank`` of ``layout``: a skeleton of the model built on the CPU (real memory: for small
    models), loaded, before any post-processing -- the load layout a staged layer's staging bytes
    must equal. Returns ``{parameter name: tensor}`` (``names``: only those); an MTP draft's
    (``layout.draft``) under ``draft.``, less what the target serves it with (``trace_draft``).
    In this process, with the TP/EP group set as :func:`trace_layout` does."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from weight_transfer.engines.vllm.trace.draft import DRAFT_PREFIX, draft_model_config, shared_with_target

    cfg = engine_config(model_dir, tp=layout.tp, ep=layout.ep, dtype=layout.dtype, draft=layout.draft)
    _one_process_group(cfg)
    _as_rank(ps.get_tp_group(), tp_rank, layout.tp)
    ep_group = getattr(ps, "_EP", None)
    if ep_group is not None:
        _as_rank(ep_group, tp_rank if layout.ep else 0, layout.tp if layout.ep else 1)
    try:
        out = {}
        for prefix, mc in (("", None), (DRAFT_PREFIX, draft_model_config(cfg))):
            if prefix and mc is None:
                continue
            c = _isolated(cfg)
            with set_current_vllm_config(c), set_default_torch_dtype(c.model_config.dtype), torch.no_grad():
                with meta_kernels(c.model_config.quantization is not None):  # loaded, never computed with
                    model = initialize_model(vllm_config=c, model_config=mc, prefix="")
                model.load_weights(iter(list(tensors.items())))
            out |= {prefix + n: p.detach().clone() for n, p in model.named_parameters()
                    if (names is None or prefix + n in names) and not (prefix and shared_with_target(n, out))}
        return out
    finally:
        _as_rank(ps.get_tp_group(), 0, 1)
        if ep_group is not None:
            _as_rank(ep_group, 0, 1)


def loaded_params_subprocess(model_dir: str, layout_spec: str, tensors: Mapping[str, torch.Tensor],
                             want: Mapping[int, list[str]], *, timeout: float = 600.0) -> dict[int, dict]:
    """:func:`loaded_params` in a child process for each TP rank in ``want`` (TP rank -> parameter
    names): ``{tp rank: {name: tensor}}``. RuntimeError with the child's last lines on failure."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "tensors.pt"), os.path.join(d, "loaded.pt")
        torch.save({"tensors": dict(tensors), "want": {int(k): list(v) for k, v in want.items()}}, src)
        p = subprocess.run([sys.executable, "-m", "weight_transfer.engines.vllm.trace.loader", model_dir, src, out,
                            "--layouts", layout_spec, "--load"], capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"vLLM's load_weights for {model_dir} failed in the child (exit {p.returncode}):\n{tail}")
        return torch.load(out, weights_only=True)  # tensors, names and ints only: no pickle


def parse_layout(spec: str, dtype: str = "bfloat16"):
    """``"T"``, ``"TxD"``, either with ``"+ep"`` (TP size, DP replicas, expert-parallel; e.g.
    ``"8x2+ep"``), then ``"+mtp"`` for an MTP draft, as an :class:`~weight_transfer.types.InferenceLayout`.
    ValueError for another form."""
    from weight_transfer.types import InferenceLayout

    s = spec.strip().lower()
    draft = "mtp" if s.endswith("+mtp") else None
    s = s.removesuffix("+mtp")
    ep = s.endswith("+ep")
    s = s.removesuffix("+ep")
    tp, _, dp = s.partition("x")
    if not tp.isdigit() or (dp and not dp.isdigit()):
        raise ValueError(f"layout {spec!r}: 'T' or 'TxD', either with '+ep' (e.g. '2', '2+ep', '2x2', '8x2+ep')")
    return InferenceLayout(tp=int(tp), dp=int(dp or 1), ep=ep, dtype=dtype, draft=draft)


Sources = dict[str, tuple[tuple[int, ...], str]]  # {checkpoint name: (shape, dtype name)}: what is traced
Traces = dict[str, dict[int, LoaderTrace]]  # {layout spec: {inference rank: LoaderTrace}}: what main() writes


class TraceJob(TypedDict):
    """One model of :func:`trace_many_subprocess`: its directory, sources and layout specs."""

    model_dir: str
    sources: Sources
    layouts: list[str]


def write_data(path, obj) -> None:
    """Write ``obj`` (dicts, lists, tuples, the library's dataclasses) to ``path``: msgpack, no pickle."""
    with open(path, "wb") as f:
        f.write(wire.encode(obj))


def read_data(path, type_):
    """What :func:`write_data` wrote, decoded strictly as ``type_`` (an unknown or ill-typed field refused)."""
    with open(path, "rb") as f:
        return wire.decode(f.read(), f"file {os.fspath(path)}", type_)


def main(argv=None) -> int:
    """``python -m weight_transfer.engines.vllm.trace.loader MODEL_DIR SOURCES OUT --layouts
    "1 2 2+ep 2x2"``: :func:`trace_layout` in a process of its own (vLLM's global state stays
    there) for each layout (:func:`parse_layout`); ``SOURCES`` holds :data:`Sources` (``MODEL_DIR``
    ``-``: a list of :class:`TraceJob`), ``OUT`` gets :data:`Traces` (a list of them), both in the
    data-only encoding (:func:`write_data`). ``--load``: ``SOURCES`` is a ``torch.save`` of
    ``{"tensors", "want"}`` and ``OUT`` gets ``{tp rank: {name: tensor}}`` (read with
    ``torch.load(weights_only=True)``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m weight_transfer.engines.vllm.trace.loader")
    ap.add_argument("model_dir")
    ap.add_argument("sources")
    ap.add_argument("out")
    ap.add_argument("--layouts", default="1", help="space-separated: 'T', 'T+ep' or 'TxD'")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--load", action="store_true", help="SOURCES is a torch.save of {'tensors', 'want'}: "
                    "write {tp rank: {name: tensor}} as vLLM's load_weights makes them (loaded_params)")
    a = ap.parse_args(argv)
    if a.load:
        job = torch.load(a.sources, weights_only=True)
        layout = parse_layout(a.layouts.split()[0], a.dtype)
        torch.save({r: loaded_params(a.model_dir, layout, r, job["tensors"], names) for r, names in job["want"].items()},
                   a.out)
        return 0
    if a.model_dir == "-":  # SOURCES holds a list of jobs (trace_many_subprocess)
        out = [{spec: trace_layout(j["model_dir"], parse_layout(spec, a.dtype), j["sources"]) for spec in j["layouts"]}
               for j in read_data(a.sources, list[TraceJob])]
    else:
        sources = read_data(a.sources, Sources)
        out = {spec: trace_layout(a.model_dir, parse_layout(spec, a.dtype), sources) for spec in a.layouts.split()}
    write_data(a.out, out)
    return 0


def trace_subprocess(model_dir: str, sources: Mapping[str, tuple[tuple[int, ...], str]], layouts: list[str], *,
                     timeout: float = 600.0) -> dict:
    """:func:`main` in a child process (``{layout spec: {rank: LoaderTrace}}``): vLLM's global
    state (its process group, the current config) stays out of the caller. RuntimeError with
    the child's last lines when it fails."""
    return _child(model_dir, dict(sources), " ".join(layouts), timeout)


def trace_many_subprocess(jobs: list[dict], *, timeout: float = 900.0) -> list[dict]:
    """:func:`trace_subprocess` for several models in one child (vLLM imported once): ``jobs``
    are ``{"model_dir", "sources", "layouts": [spec, ...]}``; one ``{spec: {rank: LoaderTrace}}``
    per job, in order."""
    return _child("-", [TraceJob(model_dir=str(j["model_dir"]), sources=dict(j["sources"]), layouts=list(j["layouts"]))
                        for j in jobs], "1", timeout)


def _child(model_dir: str, payload, layouts: str, timeout: float):
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src, out = os.path.join(d, "sources.msgpack"), os.path.join(d, "traces.msgpack")
        write_data(src, payload)
        p = subprocess.run([sys.executable, "-m", "weight_transfer.engines.vllm.trace.loader", model_dir, src, out,
                            "--layouts", layouts], capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-5:])
            raise RuntimeError(f"tracing vLLM's loader for {model_dir} failed (exit {p.returncode}):\n{tail}")
        return read_data(out, list[Traces] if model_dir == "-" else Traces)


def layout_spec(layout) -> str:
    """``"T"`` or ``"TxD"``, with ``"+ep"``: the inverse of :func:`parse_layout`."""
    return (f"{layout.tp}" + (f"x{layout.dp}" if layout.dp > 1 else "") + ("+ep" if layout.ep else "")
            + (f"+{layout.draft}" if layout.draft else ""))


if __name__ == "__main__":
    raise SystemExit(main())
