"""What a training rank publishes about its parameters, once: one :class:`ParamMeta` per
DTensor (global shape, dtype, DeviceMesh ranks, placements, this rank's box), the box a mesh
coordinate holds under any placements (:func:`shard_box`, DTensor's uneven ``torch.chunk``
rule), and host offload (:class:`OffloadedParams`: shards that live in host memory between
updates, copied in by the executor's ``h2d`` stage).

This is the trainer-facing half of the library: call :func:`collect_metas` on your own
``{checkpoint name: DTensor}`` (``named_dtensors(model)`` of an FSDP2 module) and hand the
list to the controller. It reads DTensor metadata only; no collective, no byte moves.
"""
from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor, Shard

from ..types import Box, ParamMeta, dtype_name

_SHARD_RE = re.compile(r"(?:Shard\(dim=|S\()(\d+)\)")


def shard_box(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
              placements: tuple) -> Box:
    """Box of the global tensor held by the mesh coordinate ``coord`` under ``placements``
    (DTensor semantics: mesh dims applied in order, ``Shard(d)`` chunks dim ``d`` of what the
    previous mesh dims left, ``torch.chunk`` sizes, empty trailing chunks)."""
    box = [[0, s] for s in global_shape]
    for mdim, pl in enumerate(placements):
        d = shard_dim(pl)
        if d is not None:
            lo, hi = box[d]
            size = hi - lo
            n = mesh_shape[mdim]
            chunk = -(-size // n) if size else 0
            a = min(lo + coord[mdim] * chunk, hi)
            b = min(a + chunk, hi)
            box[d] = [a, b]
    return tuple((a, b) for a, b in box)


def shard_dim(pl) -> int | None:
    """Tensor dim a placement shards (``Shard(1)``, ``"Shard(dim=1)"``, ``"S(1)"``), else None."""
    if isinstance(pl, Shard):
        return pl.dim
    if isinstance(pl, str):
        m = _SHARD_RE.fullmatch(pl.strip())
        return int(m.group(1)) if m else None
    return None


def _placement_strs(placements) -> tuple[str, ...]:
    """Placements as ``repr`` strings (``"Shard(dim=0)"``, ``"Replicate()"``) for metadata."""
    return tuple(repr(p) for p in placements)


def meta_of(name: str, p: DTensor, *, offloaded: bool = False) -> ParamMeta:
    """The :class:`ParamMeta` this rank publishes for DTensor parameter ``p``."""
    mesh = p.device_mesh
    coord = mesh.get_coordinate()
    box = shard_box(tuple(p.shape), tuple(mesh.mesh.shape), tuple(coord), tuple(p.placements))
    local = p.to_local()
    if tuple(local.shape) != tuple(b - a for a, b in box):
        raise RuntimeError(f"[{name}] local shard shape {tuple(local.shape)} != computed box {box}")
    return ParamMeta(
        name=name,
        global_shape=tuple(p.shape),
        dtype=dtype_name(p.dtype),
        mesh_ranks=tuple(map(tuple, mesh.mesh.tolist())) if mesh.ndim > 1 else tuple(mesh.mesh.tolist()),
        mesh_dim_names=mesh.mesh_dim_names,
        placements=_placement_strs(p.placements),
        local_offset=tuple(a for a, _ in box),
        local_shape=tuple(local.shape),
        offloaded=offloaded,
    )


def named_dtensors(model_or_params) -> dict[str, DTensor]:
    """``{checkpoint name: DTensor}`` from an FSDP module or a dict of DTensors."""
    if isinstance(model_or_params, dict):
        return dict(model_or_params)
    return {n: p for n, p in model_or_params.named_parameters()}


def whole_metas(params: dict[str, torch.Tensor], rank: int = 0) -> list[ParamMeta]:
    """Metadata of plain tensors that training rank ``rank`` holds whole (a 1-rank mesh):
    what a trainer without DTensors publishes (the public API's ``Sender`` with
    ``world_size == 1``, the vLLM loopback updater)."""
    return [ParamMeta(name=n, global_shape=tuple(t.shape), dtype=dtype_name(t.dtype), mesh_ranks=(rank,),
                      placements=("Shard(dim=0)",), local_offset=(0,) * t.dim(), local_shape=tuple(t.shape))
            for n, t in params.items()]


def collect_metas(params: dict[str, DTensor], *, offloaded: bool = False) -> list[ParamMeta]:
    """Metadata this rank publishes once, in parameter order (``offloaded`` is set for
    :class:`OffloadedParams` whatever the argument says)."""
    offloaded = offloaded or bool(getattr(params, "host", None))
    return [meta_of(n, p, offloaded=offloaded) for n, p in params.items() if p.device_mesh.get_coordinate() is not None]


# --------------------------------------------------------------------------------------------
# host offload


class OffloadedParams(dict):
    """``{checkpoint name: DTensor}`` whose shards live in host memory between updates.

    ``host[name]`` is the host copy of this rank's local shard (pinned when CUDA is available):
    what the trainer updates (:func:`load_step` writes it) -- the state of a trainer with CPU
    offload (FSDP2 ``CPUOffloadPolicy``, optimizer offload). The DTensor's own local tensor is
    the device buffer that ``full_tensor()`` reads; the executor's ``h2d`` stage copies host ->
    device buffer for each task's sources before its prepare. On a CPU run both live in host
    memory, but the copy is still real: skipping it would send the previous step's weights.
    """

    def __init__(self, params: dict[str, DTensor], host: dict[str, torch.Tensor]):
        super().__init__(params)
        self.host = host


def offload_to_host(params: dict[str, DTensor]) -> OffloadedParams:
    """Give every local shard a host copy (pinned when CUDA is available), initialised from the
    shard; returns the params with ``host`` attached (see :class:`OffloadedParams`)."""
    pin = torch.cuda.is_available()
    host: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in params.items():
            if p.device_mesh.get_coordinate() is None:
                continue
            local = p.to_local()
            h = torch.empty(tuple(local.shape), dtype=local.dtype, device="cpu", pin_memory=pin)
            h.copy_(local)
            host[name] = h
    return OffloadedParams(params, host)
