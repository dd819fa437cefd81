"""The schedule: who sends which bytes to whom, and in what order (steps 2-4 of
:mod:`weight_transfer.plan`), from inputs :mod:`weight_transfer.plan.checks` passes (or is checking
concurrently: on inputs the checks would refuse it may raise anything).

1. each fusion group (recipes sharing sources, e.g. q/k/v -> every TP rank's ``qkv_proj``)
   becomes a :class:`_TaskDef`: its sources, its DeviceMesh, its recipes cut into row bands of
   at most ``max_chunk_bytes`` (:func:`_split_big`); recipes whose rows the senders already
   hold -- plain copies, fused row bands, block-FP8 cut on 128-row boundaries -- are cut at
   shard boundaries instead (:func:`weight_transfer.plan.local.localize_group`, a *local* task: no
   gather), and only the rest of the group is gathered (``Schedule.gather_bytes``);
2. task definitions are ordered by mesh group (disjoint meshes run in parallel, groups are
   separated by a barrier; :func:`mesh_groups`), then checkpoint order;
3. every (recipe, receiving rank) write goes to one sender by one policy,
   :func:`weight_transfer.plan.assign.least_loaded`; each sending rank gets one
   :class:`~weight_transfer.types.Task` per task definition (ranks of the mesh with nothing to send
   share one, the all-gather is collective) -- :func:`weight_transfer.plan.assign.assign`, one C
   kernel call for the choices of the whole plan, then the records built from them.

The record types are built with :mod:`weight_transfer.plan.fast` (millions at Kimi-K2 scale).
"""
from __future__ import annotations

from collections import defaultdict
from functools import partial
from operator import attrgetter
from typing import NamedTuple

from ..convert.quant import QUANT_BLOCK
from ..convert.transforms import split_dim, split_recipe
from ..types import (
    DestTensorMeta,
    ParamMeta,
    PlanError,
    RankPlan,
    Recipe,
    Schedule,
)
from .assign import assign
from .local import localize_group
from .owners import local_offset, row_owners
from .recipes import RecipeSet, fusion_groups
from .sources import _SourceIndex

_GROUP = attrgetter("group")
_DEST_LAYOUT = attrgetter("name", "offset", "shape", "dtype")


class _TaskDef(NamedTuple):
    """One fusion group as the schedule will run it, before senders are chosen."""

    sources: list[str]
    """its sources, in checkpoint order (gathered with ``full_tensor()``; empty for a zero recipe)"""
    mesh: tuple[int, ...]
    """the sources' DeviceMesh, flattened (every rank of it runs the task)"""
    recipes: list[Recipe]
    """its recipes, cut into row bands"""
    candidates: list[tuple[int, ...]] | None
    """a local task: per recipe, the ranks holding all its rows (else None: gathered)"""
    out_bytes: list[int]
    """per recipe, its output bytes per receiving rank"""


def mesh_groups(meshes: list[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """Group distinct meshes so that meshes in one group are pairwise disjoint (they run in
    parallel); first-fit in order of appearance."""
    groups: list[set[int]] = []
    out: dict[tuple[int, ...], int] = {}
    for m in meshes:
        if m in out:
            continue
        for gi, used in enumerate(groups):
            if used.isdisjoint(m):
                used.update(m)
                out[m] = gi
                break
        else:
            groups.append(set(m))
            out[m] = len(groups) - 1
    return out


def _split_big(recipe: Recipe, max_chunk_bytes: int) -> list[tuple[Recipe, int]]:
    """``recipe`` cut into row bands of at most ``max_chunk_bytes`` output bytes per receiving
    rank (FP8 bands in whole :data:`~weight_transfer.convert.quant.QUANT_BLOCK`-row quantization blocks, runtime
    layouts in whole row blocks: :func:`~weight_transfer.convert.transforms.split_recipe`), each with its output bytes."""
    per_rank = recipe.output_nbytes
    if per_rank <= max_chunk_bytes or len(recipe.shape) == 0:
        return [(recipe, per_rank)]
    rows = recipe.shape[split_dim(recipe)]
    row_bytes = max(1, per_rank // max(rows, 1))
    max_rows = max(1, max_chunk_bytes // row_bytes)
    if recipe.transform == "fp8_block":
        max_rows = max(QUANT_BLOCK, (max_rows // QUANT_BLOCK) * QUANT_BLOCK)
    if max_rows >= rows:
        return [(recipe, per_rank)]
    return [(r, r.output_nbytes) for r in split_recipe(recipe, max_rows)]


def _layout_ids(dest_metas: dict[int, list[DestTensorMeta]]) -> dict[int, int]:
    """Inference rank -> layout id; ranks with the same tensors at the same offsets (DP
    replicas, ranks of one TP position) share an id."""
    ids: dict[tuple, int] = {}
    return {r: ids.setdefault(tuple(map(_DEST_LAYOUT, ms)), len(ids)) for r, ms in dest_metas.items()}


def _schedule(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], dest_metas: dict[int, list[DestTensorMeta]],
              ix: _SourceIndex, dests: dict[tuple[int, str], DestTensorMeta], *, max_chunk_bytes: int,
              local_writes: bool, local_min_bytes: int, local_max_writes: int = 16) -> Schedule:
    """Build the schedule (steps 2-4 of the module docstring) from checked, or concurrently
    checked, inputs: on inputs the checks would refuse it may raise anything."""
    sources = ix.first

    groups = fusion_groups(recipes.recipes)
    order = {n: i for i, n in enumerate(sources)}
    all_sources = {p.source for r in recipes.recipes for p in r.pieces if p.source is not None} if local_writes else set()
    owners, owner_keys = row_owners(ix, all_sources)
    flat_of: dict[tuple, tuple[int, ...]] = {}
    local_cache: dict = {}  # localize_group's verdicts, shared by recipes of one shape (experts)

    def mesh_flat(name: str) -> tuple[int, ...]:
        m = sources[name].mesh_ranks
        f = flat_of.get(m)
        if f is None:
            f = flat_of[m] = sources[name].mesh_flat
        return f

    task_defs = []
    why: dict[str, str] = {}  # gathered recipe -> why (localize_group)
    gathers: dict[str, tuple[int, int]] = {}  # why -> (recipes, source bytes)
    seen_src: set[str] = set()
    example: dict[str, str] = {}  # why -> the first recipe gathered for it
    for g in groups:
        srcs = sorted({pc.source for r in g for pc in r.pieces if pc.source is not None}, key=order.__getitem__)
        meshes = {mesh_flat(s) for s in srcs}
        if len(meshes) > 1:
            raise PlanError("fusion group mixes DeviceMeshes: " + ", ".join(f"{s} on {sources[s].mesh_flat}" for s in srcs))
        mesh = meshes.pop() if meshes else tuple(sorted(train_metas))[:1]
        if local_writes and srcs:
            loc, gat = localize_group(g, owners, mesh, local_min_bytes, local_cache, owner_keys, why,
                                      max_writes=local_max_writes)
        else:
            loc, gat = [], g
            if srcs:
                why.update((r.name, "shard-local prepare is off (local_writes=False)") for r in g)
        for r in gat:  # the bytes each reason gathers: its recipes' distinct sources, each once
            rs = why.get(r.name, "?")
            example.setdefault(rs, r.name)
            for pc in r.pieces:
                if pc.source is not None and pc.source not in seen_src:
                    seen_src.add(pc.source)
                    gathers[rs] = (gathers.get(rs, (0, 0))[0], gathers.get(rs, (0, 0))[1] + sources[pc.source].nbytes)
            gathers[rs] = (gathers.get(rs, (0, 0))[0] + 1, gathers.get(rs, (0, 0))[1])
        if gat:  # only the recipes that need rows of several ranks; their sources are gathered
            gsrcs = srcs if not loc else sorted({pc.source for r in gat for pc in r.pieces if pc.source is not None},
                                                key=order.__getitem__)
            parts = [c for r in gat for c in _split_big(r, max_chunk_bytes)]
            task_defs.append(_TaskDef(gsrcs, mesh, [c for c, _ in parts], None, [nb for _, nb in parts]))
        if loc:
            parts = [(c, nb, cand) for r, cand in loc for c, nb in _split_big(r, max_chunk_bytes)]
            task_defs.append(_TaskDef(srcs, mesh, [c for c, _, _ in parts], [cand for _, _, cand in parts],
                                      [nb for _, nb, _ in parts]))

    gid = mesh_groups([t.mesh for t in task_defs])
    task_defs.sort(key=lambda t: (gid[t.mesh], order[t.sources[0]] if t.sources else -1))

    n_slots = 1 + max([*train_metas, *(r for m in {t.mesh for t in task_defs} for r in m)], default=0)
    by_rank: dict[int, dict[str, DestTensorMeta]] = defaultdict(dict)
    for (rk, nm), d in dests.items():
        by_rank[rk][nm] = d
    src_nbytes: dict[str, int] = {}
    src_bytes = []  # per task definition, the bytes of its gathered sources
    for t in task_defs:
        b = 0
        if t.candidates is None:
            for s in t.sources:
                n = src_nbytes.get(s)
                if n is None:
                    n = src_nbytes[s] = sources[s].nbytes
                b += n
        src_bytes.append(b)
    per_rank, send, recv = assign(task_defs, [gid[t.mesh] for t in task_defs], src_bytes, n_slots, list(train_metas),
                                  list(dest_metas), by_rank, _layout_ids(dest_metas), partial(local_offset, ix))
    n_groups = len(set(gid.values()))
    rank_plans = {r: RankPlan(r, tuple(ts), tuple(sorted(set(map(_GROUP, ts)))), n_groups) for r, ts in per_rank.items()}
    # every mesh rank published (checked), so the senders are training ranks
    return Schedule(rank_plans, send, recv, len(task_defs), n_groups, sum(src_bytes),
                    tuple(sorted(((w, n, b, example[w]) for w, (n, b) in gathers.items()), key=lambda x: -x[2])))
