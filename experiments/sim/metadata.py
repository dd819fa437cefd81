"""Synthetic metadata at full scale: what every rank would publish, computed without weights.

Training side (:func:`train_metas`): ``nodes x gpus_per_node`` ranks holding the catalog
model's parameters as DTensors, in one of two layouts:

- ``"two_group"``: exactly :func:`weight_transfer.testing.training.two_group_mesh_for` (two mesh groups):
  non-expert parameters on the 2-D ``(inter, intra)`` mesh with placements
  ``(Replicate(), Shard(0))`` (sharded over a node's GPUs, replicated across nodes), routed
  expert ``e`` on the sub-mesh of intra-node rank ``e % gpus_per_node`` in node group
  ``(e // gpus_per_node) % (nodes / moe_width)``, ``(Shard(0),)`` across the ``moe_width``
  nodes of that group (``moe_width`` None: all nodes, one group). Each rank publishes the
  parameters whose mesh contains it, in
  parameter order, with the box :func:`weight_transfer.plan.metadata.shard_box` gives -- the same
  :class:`~weight_transfer.types.ParamMeta` that :func:`weight_transfer.plan.metadata.collect_metas` returns on
  a real world (tests/experiments/sim/test_run.py checks this on a 2x2 gloo world).
- ``"expert_whole"``: non-expert parameters as above; every routed expert held whole by one
  rank (a 1-rank mesh, ``(Shard(0),)``), the ``k``-th expert tensor triple (in checkpoint order)
  on rank ``k mod world``. This is expert-parallel training storage: ``full_tensor()`` of an
  expert moves no bytes. Not produced by :mod:`weight_transfer.testing.training`; it exists to show what the
  training layout costs (docs/SIMULATION.md).

``offloaded=True`` marks every shard as living in host memory (``ParamMeta.offloaded``).

Inference side (:func:`dest_metas`): :func:`weight_transfer.engines.engine.engine_tensor_metas` for every
inference rank. Ranks of different replicas hold the same tensors at the same offsets
(``_plan`` depends on ``rank % tp`` only), so the metas are computed once per TP rank and
copied with the rank changed. :func:`regions` fakes one :class:`~weight_transfer.types.RegionDescriptor`
per inference rank with transport ``"sim"``.

Tuples shared between ranks (shapes, meshes, placements) are the same objects, which keeps the
Kimi-K2 training side (about 2.4 million ParamMeta on 256 ranks) near 1 GB.
"""
from __future__ import annotations

import math
from dataclasses import replace

from weight_transfer.model_config import ModelConfig
from weight_transfer.plan.metadata import shard_box
from weight_transfer.testing.catalog import param_specs
from weight_transfer.testing.training import expert_id, is_expert_param
from weight_transfer.types import DestTensorMeta, InferenceLayout, ParamMeta, RegionDescriptor

SHARD0 = "Shard(dim=0)"
REPLICATE = "Replicate()"
TRAIN_LAYOUTS = ("two_group", "expert_whole")


_new = object.__new__
_F = {f: ParamMeta.__dict__[f].__set__ for f in ParamMeta.__slots__}
_S_NAME, _S_SHAPE, _S_DT, _S_MESH, _S_NAMES, _S_PL, _S_OFF, _S_LSH, _S_OFFL = (
    _F["name"], _F["global_shape"], _F["dtype"], _F["mesh_ranks"], _F["mesh_dim_names"], _F["placements"],
    _F["local_offset"], _F["local_shape"], _F["offloaded"])


def _meta(name, shape, dt, mesh, names, pl, off, lsh, offloaded) -> ParamMeta:
    """``ParamMeta(...)`` without the frozen dataclass's per-field ``object.__setattr__`` calls
    (3x faster; 2.4 million of them for Kimi-K2). Equal to the constructed one (tested)."""
    o = _new(ParamMeta)
    _S_NAME(o, name); _S_SHAPE(o, shape); _S_DT(o, dt); _S_MESH(o, mesh); _S_NAMES(o, names)  # noqa: E702
    _S_PL(o, pl); _S_OFF(o, off); _S_LSH(o, lsh); _S_OFFL(o, offloaded)  # noqa: E702
    return o


def train_metas(cfg: ModelConfig, nodes: int, gpus_per_node: int, *, layout: str = "two_group",
                offloaded: bool = False, dtype: str | None = None, moe_width: int | None = None,
                draft: str | None = None) -> dict[int, list[ParamMeta]]:
    """Per training rank (``n * gpus_per_node + j`` for node ``n``, GPU ``j``), the
    :class:`ParamMeta` list it publishes, in parameter order (see module docstring).
    ``dtype`` overrides the BF16 parameters' dtype (e.g. ``"float32"`` masters);
    ``moe_width``: the MoE mesh width of ``two_group`` (nodes per expert sub-mesh; must
    divide ``nodes``; None: all nodes); ``draft`` ``"mtp"``: the trainer also holds the MTP
    layers (:func:`weight_transfer.testing.catalog.param_specs`), sharded like the other layers."""
    from weight_transfer.testing.training import two_group_columns

    if layout not in TRAIN_LAYOUTS:
        raise ValueError(f"unknown training layout {layout!r}; known: {', '.join(TRAIN_LAYOUTS)}")
    g, world = gpus_per_node, nodes * gpus_per_node
    w = nodes if moe_width is None else moe_width
    mesh2d = tuple(tuple(n * g + j for j in range(g)) for n in range(nodes))
    columns = [tuple(c) for c in two_group_columns(nodes, g, w)]  # index k * g + j
    n_groups = nodes // w
    singles = [(r,) for r in range(world)]
    pl2d, pl1d = (REPLICATE, SHARD0), (SHARD0,)
    names2d, names1d = ("inter", "intra"), ("inter",)
    # Pass 1, per parameter: its mesh and which ranks hold it. Pass 2, per rank: its records in
    # parameter order, allocated one rank after the other -- as the controller holds them after
    # unpickling each rank's list, rather than interleaved across ranks (which makes every
    # per-rank scan a cache miss per record).
    info = []
    shared_lists: dict[object, list[int]] = {}  # "all" / ("col", j) / ("rank", r) -> parameter indices
    k_expert = 0
    last_expert: tuple[str, int] | None = None
    for i, s in enumerate(param_specs(cfg, draft)):
        dt = dtype if (dtype and s.dtype == "bfloat16") else s.dtype
        if is_expert_param(s.name):
            if layout == "two_group":
                e = expert_id(s.name)
                c = ((e // g) % n_groups) * g + e % g
                info.append((s.name, s.shape, dt, columns[c], names1d, pl1d, (w,), 1))
                shared_lists.setdefault(("col", c), []).append(i)
            else:
                key = (s.name.split(".mlp.experts.")[0], expert_id(s.name))
                if last_expert is not None and key != last_expert:
                    k_expert += 1
                last_expert = key
                r = k_expert % world
                info.append((s.name, s.shape, dt, singles[r], names1d, pl1d, (1,), 0))
                shared_lists.setdefault(("rank", r), []).append(i)
        else:
            info.append((s.name, s.shape, dt, mesh2d, names2d, pl2d, (nodes, g), 2))
            shared_lists.setdefault("all", []).append(i)
    everyone = shared_lists.get("all", [])
    held: dict[object, list[int]] = {}  # ranks of one column hold the same parameters
    out: dict[int, list[ParamMeta]] = {}
    box_cache: dict[tuple, tuple] = {}
    for r in range(world):
        out[r] = lst = []
        n, j = divmod(r, g)
        coord_of = {2: (n, j), 1: (n % w,), 0: (0,)}
        key = ("col", (n // w) * g + j) if layout == "two_group" else ("rank", r)
        if key not in held:
            held[key] = sorted(everyone + shared_lists.get(key, []))
        for i in held[key]:
            name, shape, dt, mesh, names, pl, mshape, kind = info[i]
            coord = coord_of[kind]
            key = (shape, mshape, coord, pl)
            got = box_cache.get(key)
            if got is None:
                box = shard_box(shape, mshape, coord, pl)
                got = box_cache[key] = (tuple(a for a, _ in box), tuple(b - a for a, b in box))
            lst.append(_meta(name, shape, dt, mesh, names, pl, got[0], got[1], offloaded))
    return out


def dest_metas(cfg: ModelConfig, layout: InferenceLayout) -> dict[int, list[DestTensorMeta]]:
    """Per inference rank, its tensors (:func:`weight_transfer.engines.engine.engine_tensor_metas`), computed
    once per TP rank and copied to the other replicas with the rank changed."""
    from weight_transfer.engines.engine import engine_tensor_metas

    base = {t: engine_tensor_metas(cfg, layout, t) for t in range(layout.tp)}
    out: dict[int, list[DestTensorMeta]] = {}
    for r in range(layout.world_size):
        t = r % layout.tp
        out[r] = base[t] if r == t else [replace(m, rank=r) for m in base[t]]
    return out


def region_bytes(metas: list[DestTensorMeta]) -> int:
    """Bytes of one inference rank's registered region (end of its last tensor)."""
    return max((m.offset + m.nbytes for m in metas), default=0)


def regions(dests: dict[int, list[DestTensorMeta]], gpus_per_node: int = 8) -> dict[int, RegionDescriptor]:
    """One fake region per inference rank (transport ``"sim"``; host ``infer-node<n>``)."""
    return {r: RegionDescriptor(transport="sim", host=f"infer-node{r // gpus_per_node}", pid=0, addr=0,
                                length=region_bytes(ms), key=r) for r, ms in dests.items()}


def local_bytes(metas: list[ParamMeta]) -> int:
    """Bytes a training rank stores (its shards)."""
    from weight_transfer.types import itemsize

    return sum(math.prod(m.local_shape) * itemsize(m.dtype) for m in metas)
