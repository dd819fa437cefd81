"""The training side: a module built from the catalog, sharded with FSDP2 on a DeviceMesh, and
the metadata each rank publishes.

Two ways to place parameters, both giving DTensors:

- :func:`build_fsdp_model` (default): an ``nn.Module`` tree whose parameter names are the
  Hugging Face checkpoint names, built on the meta device, each decoder layer and then the root
  wrapped with FSDP2 ``fully_shard`` (``Shard(0)`` on a 1-D mesh, or HSDP
  ``(Replicate(), Shard(0))`` on a 2-D mesh), then materialized with ``to_empty`` so a rank
  only ever allocates its own shards. This is what an FSDP2 trainer (torchtitan, verl, slime)
  holds.
- :func:`build_dtensor_params`: ``distribute_tensor``-style placement for layouts FSDP2 does
  not produce (``[Shard(0), Shard(0)]`` on a 2x2 mesh, C12; expert sub-meshes), built from
  local shards with ``DTensor.from_local`` so no rank materializes a full tensor.

Shards follow DTensor's uneven rule (``torch.chunk``): chunk size ``ceil(d / n)``, trailing
shards short or empty. :func:`shard_box` computes a rank's box for any placements and is
tested against DTensor's own local shapes.

Weights are the synthetic ones of :mod:`weight_transfer.testing.weights`: :func:`load_step` rewrites every
local shard in place for a training step (the stand-in for ``optimizer.step()``).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from weight_transfer.testing.catalog import param_specs
from weight_transfer.testing.weights import frozen_step, param_box

from ..model_config import ModelConfig, ParamSpec
from ..plan.metadata import shard_box


class _Holder(nn.Module):
    """A bare module node; parameters are attached by dotted checkpoint name."""


def _build_tree(specs: Iterable[ParamSpec], dtype_override: str | None) -> nn.Module:
    root = _Holder()
    for s in specs:
        *path, leaf = s.name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, _Holder())
            mod = getattr(mod, part)
        dt = dtype_override if (dtype_override and s.dtype == "bfloat16") else s.dtype
        mod.register_parameter(leaf, nn.Parameter(torch.empty(s.shape, dtype=getattr(torch, dt), device="meta")))
    return root


def build_fsdp_model(cfg: ModelConfig, mesh: DeviceMesh, *, dtype_override: str | None = None,
                     specs: list[ParamSpec] | None = None) -> nn.Module:
    """FSDP2-sharded module with the checkpoint's parameter names. Each decoder layer is its
    own FSDP unit (``fully_shard(model.layers[i])``) and the root takes the rest, as trainers
    do. Storage is allocated uninitialized on the mesh's device type (``"cpu"``, or
    ``"cuda"``: the current CUDA device, which the caller selects with
    ``torch.cuda.set_device`` first); call :func:`load_step` to fill it.
    ``dtype_override="float32"`` keeps fp32 master weights (C8)."""
    from torch.distributed.fsdp import fully_shard

    specs = param_specs(cfg) if specs is None else specs
    with torch.device("meta"):
        model = _build_tree(specs, dtype_override)
    layers = model.get_submodule(decoder_layers_path(specs))  # model.layers; OPT: model.decoder.layers
    for i in range(cfg.num_layers):
        if hasattr(layers, str(i)):
            fully_shard(getattr(layers, str(i)), mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    model.to_empty(device=mesh_device(mesh))
    return model


def decoder_layers_path(specs: Iterable[ParamSpec]) -> str:
    """The dotted path of the decoder layers' container in the checkpoint names
    (``model.layers``; ``model.decoder.layers`` for OPT): the prefix of the first
    ``<path>.<int>.`` name whose last part is ``layers``. ValueError when there is none."""
    import re

    for s in specs:
        m = re.match(r"^(.*?\blayers)\.\d+\.", s.name)
        if m:
            return m.group(1)
    raise ValueError("no decoder layers (<path>.layers.<i>.) among the checkpoint names")


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """Where a rank of ``mesh`` keeps its shards: the CPU for a ``"cpu"`` mesh, else the current
    device of the mesh's device type (``torch.device("cuda", torch.cuda.current_device())``)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    mod = getattr(torch, mesh.device_type)
    return torch.device(mesh.device_type, mod.current_device())


def build_dtensor_params(specs: Iterable[ParamSpec], mesh_for, *, dtype_override: str | None = None) -> dict[str, DTensor]:
    """DTensor parameters placed by ``mesh_for(spec) -> (DeviceMesh, placements)``. Every rank
    allocates only its own shard (``DTensor.from_local`` with the global shape and stride), on
    the mesh's device (:func:`mesh_device`)."""
    out: dict[str, DTensor] = {}
    for s in specs:
        mesh, placements = mesh_for(s)
        coord = mesh.get_coordinate()
        box = shard_box(s.shape, tuple(mesh.mesh.shape), tuple(coord), tuple(placements))
        dt = dtype_override if (dtype_override and s.dtype == "bfloat16") else s.dtype
        local = torch.empty(tuple(b - a for a, b in box), dtype=getattr(torch, dt), device=mesh_device(mesh))
        stride = tuple(int(torch.tensor(s.shape[i + 1:]).prod()) if i + 1 < len(s.shape) else 1 for i in range(len(s.shape)))
        out[s.name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(s.shape), stride=stride)
    return out


def is_expert_param(name: str) -> bool:
    """Routed-expert weights (``...mlp.experts.{e}...``); shared experts are not."""
    return ".mlp.experts." in name


def expert_id(name: str) -> int:
    return int(name.split(".mlp.experts.", 1)[1].split(".", 1)[0])


def two_group_mesh_for(mesh2d: DeviceMesh, columns: list[DeviceMesh], groups: int = 1):
    """Placement rule of the two mesh groups on a 2-D ``(inter, intra)`` mesh of
    ``nodes x gpus_per_node`` ranks:

    - non-expert parameters: the whole 2-D mesh, ``(Replicate(), Shard(0))`` -- sharded over
      the GPUs of a node, replicated across nodes (HSDP); ``full_tensor()`` gathers within a
      node (NVLink on a cluster);
    - routed expert ``e``: expert-parallel over the ``gpus_per_node`` GPUs of a node (intra
      rank ``j = e % gpus_per_node``) and over ``groups`` node groups (group
      ``k = (e // gpus_per_node) % groups``), FSDP ``(Shard(0),)`` across the ``nodes / groups``
      nodes of its group -- the *MoE mesh width*; ``full_tensor()`` gathers across those nodes
      (the RDMA fabric). ``groups=1``: every expert sharded across all nodes.

    The expert meshes are disjoint, so expert tasks form one mesh group that runs in parallel
    on every sub-mesh; the non-expert tasks form the other. ``columns[k * gpus_per_node + j]``
    is the 1-D mesh of global ranks ``{(k * w + i) * gpus_per_node + j : i < w}`` (``w`` the
    MoE mesh width), created on every rank in the same order (:func:`two_group_columns`).

    Source of the structure: Lequn Chen, "RL weight transfer 2" (le.qun.ch, 2025-09-17):
    non-MoE FSDP within a node over NVLink, MoE FSDP across nodes over RDMA; the post gives
    no width, so it is a parameter here."""
    g = mesh2d.mesh.shape[1]
    if len(columns) != groups * g:
        raise ValueError(f"two_group_mesh_for: {len(columns)} expert meshes for {groups} group(s) x {g} GPUs per node")

    def mesh_for(spec):
        if is_expert_param(spec.name):
            e = expert_id(spec.name)
            return columns[((e // g) % groups) * g + e % g], (Shard(0),)
        return mesh2d, (Replicate(), Shard(0))

    return mesh_for


def two_group_columns(nodes: int, gpus_per_node: int, moe_width: int | None = None) -> list[list[int]]:
    """Global ranks of every expert sub-mesh, in creation order (``k * gpus_per_node + j``):
    group ``k`` of ``moe_width`` consecutive nodes, intra-node rank ``j``. ``moe_width`` None:
    all nodes (one group). Raises ValueError unless ``moe_width`` divides ``nodes``."""
    w = nodes if moe_width is None else moe_width
    if w < 1 or nodes % w:
        raise ValueError(f"MoE mesh width {w} must divide the {nodes} training nodes")
    return [[(k * w + i) * gpus_per_node + j for i in range(w)] for k in range(nodes // w) for j in range(gpus_per_node)]


def build_two_group_params(cfg: ModelConfig, nodes: int, gpus_per_node: int, moe_width: int | None = None, *,
                           dtype_override: str | None = None, specs: list[ParamSpec] | None = None,
                           device: str = "cpu") -> dict[str, DTensor]:
    """DTensor parameters in the two-mesh-group layout (see :func:`two_group_mesh_for`) on
    ``nodes * gpus_per_node`` ranks (the default process group must have that size), experts
    FSDP-sharded over ``moe_width`` nodes (None: all of them). A rank holds only the experts
    of its sub-mesh. ``device``: the meshes' device type (``"cpu"`` or ``"cuda"``)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh2d = init_device_mesh(device, (nodes, gpus_per_node), mesh_dim_names=("inter", "intra"))
    cols = two_group_columns(nodes, gpus_per_node, moe_width)
    columns = [DeviceMesh(device, c, mesh_dim_names=("inter",)) for c in cols]
    mesh_for = two_group_mesh_for(mesh2d, columns, len(cols) // gpus_per_node)
    me = torch.distributed.get_rank()
    specs = [s for s in (param_specs(cfg) if specs is None else specs) if me in mesh_for(s)[0].mesh.flatten().tolist()]
    return build_dtensor_params(specs, mesh_for, dtype_override=dtype_override)


def load_step(params: dict[str, DTensor], *, step: int, seed: int, change=None, source=None,
              frozen: tuple[str, ...] = ()) -> int:
    """Overwrite every local shard with the synthetic weights of ``step`` (in place: the
    memory a transfer reads is the memory the trainer updates). Returns bytes written.
    ``change``: per-step fractions of elements that change, cycled (e.g. ``(0.01,)``: 1% of the
    elements of every tensor per step; :mod:`weight_transfer.testing.weights`); None: all.
    ``source``: read the weights from it instead (an object with ``param_box(name, shape, box, *,
    step, dtype, out)``, e.g. :class:`weight_transfer.testing.replay.ReplaySteps`: an RL run's
    saved steps); ``seed`` and ``change`` are then unused. ``frozen``: name prefixes of
    parameters the trainer does not train (a frozen draft): they keep their step-0 weights
    (:func:`weight_transfer.testing.weights.frozen_step`)."""
    total = 0
    with torch.no_grad():
        total = _load_step(params, step, seed, change, source, frozen)
    return total


def _load_step(params, step, seed, change=None, source=None, frozen=()) -> int:
    total = 0
    host = getattr(params, "host", None) or {}  # offloaded: the trainer updates the host copies
    for name, p in params.items():
        mesh = p.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:
            continue
        local = host.get(name, p.to_local())
        if local.numel() == 0:
            continue
        box = shard_box(tuple(p.shape), tuple(mesh.mesh.shape), tuple(coord), tuple(p.placements))
        if source is not None:
            source.param_box(name, tuple(p.shape), box, step=step, dtype=local.dtype, out=local)
        else:
            param_box(name, tuple(p.shape), box, step=frozen_step(name, step, frozen), seed=seed, dtype=local.dtype,
                      out=local, change=change)
        total += local.nbytes
    return total


