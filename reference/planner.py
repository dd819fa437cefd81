"""The static schedule: who sends which bytes to whom, and in what order. Computed once.

:func:`plan` is a pure function of (training metadata, recipes, inference metadata). It

1. checks the training side is consistent (every rank agrees on a parameter's global shape,
   dtype, mesh and placements; the shards of each parameter tile it) and validates the recipes
   against both sides (:func:`reference.mapping.validate`: every destination byte covered once,
   missing / unused / mismatched tensors named) -- all before any byte moves;
2. turns each fusion group (recipes sharing sources, e.g. q/k/v -> every TP rank's
   ``qkv_proj``) into a :class:`Task`; every rank of the sources' DeviceMesh runs the task's
   ``full_tensor()`` calls in the same order, so any of them can make any output;
3. splits outputs larger than ``max_chunk_bytes`` into row bands and assigns each
   (recipe, receiving rank) write to one rank of the mesh, greedily to the least-loaded sender
   (bytes), ties to the one that sends least to that receiver: the busiest NIC sets the time;
4. orders tasks by mesh group (disjoint meshes run in parallel; groups are separated by a
   barrier) then checkpoint order.

Deterministic: same inputs, same schedule. Errors are :class:`reference.mapping.PlanError`
naming the tensors or ranks.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from .mapping import PlanError, RecipeSet, fusion_groups, validate
from .transforms import split_recipe
from .types import (DestTensorMeta, ParamMeta, Recipe, box_flat_range, box_numel, itemsize, numel)


@dataclass(frozen=True, slots=True)
class WriteSpec:
    """One one-sided write: output ``output`` of the recipe (all its bytes) to inference rank
    ``dst_rank`` at byte ``remote_offset`` of that rank's region, ``length`` bytes."""

    output: int
    dst_rank: int
    remote_offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Assignment:
    """A recipe this rank prepares, and the writes it posts from the outputs."""

    recipe: Recipe
    writes: tuple[WriteSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(w.length for w in self.writes)


@dataclass(frozen=True, slots=True)
class Task:
    """One fusion group as one training rank runs it.

    ``sources`` are gathered with ``full_tensor()`` in this order by every rank of ``mesh``
    (including ranks with nothing to send: the all-gather is collective). ``temp_bytes`` is
    what the task holds on this rank between prepare and release (gathered sources plus its
    outputs), the quantity the executor's watermark bounds."""

    id: int
    group: int
    sources: tuple[str, ...]
    mesh: tuple[int, ...]
    assignments: tuple[Assignment, ...]
    source_bytes: int
    temp_bytes: int

    @property
    def send_bytes(self) -> int:
        return sum(a.nbytes for a in self.assignments)


@dataclass(frozen=True, slots=True)
class RankPlan:
    """Everything one training rank executes per step, in order."""

    rank: int
    tasks: tuple[Task, ...]
    groups: tuple[int, ...]
    """Mesh groups this rank takes part in, in execution order."""

    @property
    def send_bytes(self) -> int:
        return sum(t.send_bytes for t in self.tasks)

    @property
    def n_writes(self) -> int:
        return sum(len(a.writes) for t in self.tasks for a in t.assignments)


@dataclass(frozen=True)
class Schedule:
    """The whole plan: one :class:`RankPlan` per training rank plus totals."""

    rank_plans: dict[int, RankPlan]
    send_bytes: dict[int, int]
    recv_bytes: dict[int, int]
    n_tasks: int
    n_groups: int

    @property
    def total_bytes(self) -> int:
        """Bytes written into inference memory per update (all ranks, replicas included)."""
        return sum(self.recv_bytes.values())

    @property
    def n_writes(self) -> int:
        return sum(p.n_writes for p in self.rank_plans.values())

    def summary(self) -> str:
        s, r = self.send_bytes, self.recv_bytes
        return (f"{self.n_tasks} tasks in {self.n_groups} mesh group(s), {self.n_writes} writes, "
                f"{self.total_bytes / 1e9:.3f} GB; busiest sender {max(s.values(), default=0) / 1e9:.3f} GB, "
                f"busiest receiver {max(r.values(), default=0) / 1e9:.3f} GB")


def _consistent_sources(train_metas: dict[int, list[ParamMeta]]) -> dict[str, ParamMeta]:
    """One ParamMeta per name; every rank of its mesh must have published it, identically."""
    first: dict[str, ParamMeta] = {}
    seen: dict[str, set[int]] = defaultdict(set)
    boxes: dict[str, int] = defaultdict(int)
    problems: list[str] = []
    for rank in sorted(train_metas):
        for m in train_metas[rank]:
            f = first.setdefault(m.name, m)
            if (f.global_shape, f.dtype, f.mesh_ranks, f.placements) != (m.global_shape, m.dtype, m.mesh_ranks, m.placements):
                problems.append(f"{m.name}: rank {rank} publishes shape {m.global_shape} {m.dtype} mesh {m.mesh_ranks} "
                                f"{m.placements}, other ranks {f.global_shape} {f.dtype} mesh {f.mesh_ranks} {f.placements}")
            seen[m.name].add(rank)
            if all(p.startswith("Shard") for p in m.placements):
                boxes[m.name] += numel(m.local_shape)
    for name, f in first.items():
        missing = sorted(set(f.mesh_flat) - seen[name])
        if missing:
            problems.append(f"{name}: mesh ranks {missing} did not publish it")
        if all(p.startswith("Shard") for p in f.placements) and boxes[name] != numel(f.global_shape):
            problems.append(f"{name}: shards hold {boxes[name]} elements, the tensor has {numel(f.global_shape)}")
    if problems:
        raise PlanError(f"training metadata inconsistent ({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:20]))
    return first


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


def _split_big(recipe: Recipe, max_chunk_bytes: int) -> list[Recipe]:
    per_rank = recipe.output_nbytes
    if per_rank <= max_chunk_bytes or len(recipe.shape) == 0:
        return [recipe]
    # first dim with extent > 1 is the one split_recipe cuts
    d = 0
    while d < len(recipe.shape) - 1 and recipe.shape[d] == 1:
        d += 1
    rows = recipe.shape[d]
    row_bytes = max(1, per_rank // max(rows, 1))
    max_rows = max(1, max_chunk_bytes // row_bytes)
    if recipe.transform == "fp8_block":
        max_rows = max(128, (max_rows // 128) * 128)
    if max_rows >= rows:
        return [recipe]
    return split_recipe(recipe, max_rows)


def plan(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], dest_metas: dict[int, list[DestTensorMeta]],
         *, max_chunk_bytes: int = 64 << 20) -> Schedule:
    """Compute the static schedule (see module docstring).

    ``train_metas``: per training rank, what it publishes; ``dest_metas``: per inference rank,
    its tensors in its region. ``max_chunk_bytes`` bounds one recipe output before it is split
    into row bands spread over senders. Raises PlanError naming tensors or ranks."""
    sources = _consistent_sources(train_metas)
    dests = {(m.rank, m.name): m for ms in dest_metas.values() for m in ms}
    validate(recipes, {n: (m.global_shape, m.dtype) for n, m in sources.items()}, dests)

    groups = fusion_groups(recipes.recipes)
    order = {n: i for i, n in enumerate(sources)}
    task_defs = []
    for g in groups:
        srcs = sorted({s for r in g for s in r.sources}, key=lambda n: order[n])
        meshes = {sources[s].mesh_flat for s in srcs}
        if len(meshes) > 1:
            raise PlanError("fusion group mixes DeviceMeshes: " + ", ".join(f"{s} on {sources[s].mesh_flat}" for s in srcs))
        mesh = meshes.pop() if meshes else tuple(sorted(train_metas))[:1]
        task_defs.append((srcs, mesh, [c for r in g for c in _split_big(r, max_chunk_bytes)]))

    gid = mesh_groups([m for _, m, _ in task_defs])
    task_defs.sort(key=lambda t: (gid[t[1]], order[t[0][0]] if t[0] else -1))

    send = defaultdict(int, {r: 0 for r in train_metas})
    pair = defaultdict(int)
    recv = defaultdict(int, {r: 0 for r in dest_metas})
    per_rank: dict[int, list[Task]] = {r: [] for r in train_metas}
    for tid, (srcs, mesh, recs) in enumerate(task_defs):
        src_bytes = sum(numel(sources[s].global_shape) * itemsize(sources[s].dtype) for s in srcs)
        mine: dict[int, dict[int, list[WriteSpec]]] = {r: {} for r in mesh}
        items = []
        for ri, rec in enumerate(recs):
            for dst in rec.ranks:
                items.append((rec.output_nbytes, ri, dst))
        items.sort(key=lambda x: (-x[0], x[1], x[2]))
        for nbytes, ri, dst in items:
            sender = min(mesh, key=lambda r: (send[r], pair[r, dst], r))
            send[sender] += nbytes
            pair[sender, dst] += nbytes
            recv[dst] += nbytes
            rec = recs[ri]
            ws = mine[sender].setdefault(ri, [])
            for oi, out in enumerate(rec.outputs):
                d = dests[(dst, out.tensor)]
                a, b = box_flat_range(out.box, d.shape)
                isz = itemsize(out.dtype)
                ws.append(WriteSpec(oi, dst, d.offset + a * isz, (b - a) * isz))
        for r in mesh:
            assigns = tuple(Assignment(recs[ri], tuple(ws)) for ri, ws in sorted(mine[r].items()))
            out_bytes = sum(a.recipe.output_nbytes for a in assigns)
            per_rank[r].append(Task(tid, gid[mesh], tuple(srcs), tuple(mesh), assigns, src_bytes, src_bytes + out_bytes))

    rank_plans = {r: RankPlan(r, tuple(ts), tuple(sorted({t.group for t in ts}))) for r, ts in per_rank.items()}
    return Schedule(rank_plans, dict(send), dict(recv), len(task_defs), len(set(gid.values())))
