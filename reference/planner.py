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

import gc
import heapq
import math
from bisect import insort
from collections import defaultdict
from dataclasses import dataclass, field

from .mapping import PlanError, RecipeSet, fusion_groups, validate
from .transforms import split_dim, split_recipe, split_recipe_bands
from .types import (DestTensorMeta, ParamMeta, Piece, Recipe, box_flat_range, box_numel, itemsize, numel)


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
    local_sources: tuple[str, ...] = ()
    """A *local* task (no ``sources``): its recipes read only this rank's own shards
    (``to_local()``, piece boxes already in local coordinates); no collective, no gather."""

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
    n_groups: int | None = None
    """Mesh groups of the whole schedule: every rank issues ``n_groups - 1`` barriers, also
    ranks with no task in some group. None when unknown (the executor then agrees on it)."""

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


_WS_NEW = object.__new__
_WS_SET = tuple(WriteSpec.__dict__[f].__set__ for f in ("output", "dst_rank", "remote_offset", "length"))


def _write_spec(output: int, dst_rank: int, remote_offset: int, length: int) -> WriteSpec:
    """``WriteSpec(...)`` without the frozen dataclass's ``object.__setattr__`` per field (the
    planner makes millions at Kimi-K2 scale); equal to the constructed one."""
    w = _WS_NEW(WriteSpec)
    a, b, c, d = _WS_SET
    a(w, output); b(w, dst_rank); c(w, remote_offset); d(w, length)  # noqa: E702
    return w


def _consistent_sources(train_metas: dict[int, list[ParamMeta]]) -> dict[str, ParamMeta]:
    """One ParamMeta per name; every rank of its mesh must have published it, identically.

    Linear in the metas (2.4 million for Kimi-K2 on 256 ranks): identical tuples are compared
    by identity first, and per-placements / per-mesh facts are computed once."""
    first: dict[str, ParamMeta] = {}
    seen: dict[str, set[int]] = {}
    boxes: dict[str, int] = defaultdict(int)
    sharded: dict[tuple, bool] = {}
    problems: list[str] = []
    prod = math.prod
    for rank in sorted(train_metas):
        for m in train_metas[rank]:
            name = m.name
            f = first.get(name)
            if f is None:
                first[name] = f = m
                seen[name] = {rank}
            else:
                seen[name].add(rank)
                if f is not m and not (
                        (f.global_shape is m.global_shape or f.global_shape == m.global_shape) and f.dtype == m.dtype
                        and (f.mesh_ranks is m.mesh_ranks or f.mesh_ranks == m.mesh_ranks)
                        and (f.placements is m.placements or f.placements == m.placements)):
                    problems.append(f"{m.name}: rank {rank} publishes shape {m.global_shape} {m.dtype} mesh {m.mesh_ranks} "
                                    f"{m.placements}, other ranks {f.global_shape} {f.dtype} mesh {f.mesh_ranks} {f.placements}")
            pl = m.placements
            sh = sharded.get(pl)
            if sh is None:
                sh = sharded[pl] = all(p.startswith("Shard") for p in pl)
            if sh:
                boxes[name] += prod(m.local_shape)
    flat: dict[tuple, frozenset] = {}
    for name, f in first.items():
        mf = flat.get(f.mesh_ranks)
        if mf is None:
            mf = flat[f.mesh_ranks] = frozenset(f.mesh_flat)
        s = seen[name]
        if len(s) < len(mf) or not mf <= s:
            missing = sorted(mf - s)
            if missing:
                problems.append(f"{name}: mesh ranks {missing} did not publish it")
        if sharded[f.placements] and boxes[name] != numel(f.global_shape):
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
    rows = recipe.shape[split_dim(recipe)]
    row_bytes = max(1, per_rank // max(rows, 1))
    max_rows = max(1, max_chunk_bytes // row_bytes)
    if recipe.transform == "fp8_block":
        max_rows = max(128, (max_rows // 128) * 128)
    if max_rows >= rows:
        return [recipe]
    return split_recipe(recipe, max_rows)


_ROW_PLACEMENTS = frozenset({"Shard(dim=0)", "Replicate()"})


def _owners(train_metas: dict[int, list[ParamMeta]], sources: dict[str, ParamMeta], names: set[str]):
    """For the parameters in ``names`` whose placements only cut dim 0 (``Shard(0)`` /
    ``Replicate``: a shard is a row range): name -> [(first row, end row, rank)] of the
    non-empty shards, and (name, rank) -> first row of that rank's shard. One pass over the
    metadata, touching only those names (at Kimi-K2 scale: 2.4M records, a few hundred names)."""
    ok = {n for n in names if n in sources and set(sources[n].placements) <= _ROW_PLACEMENTS
          and sources[n].global_shape}
    owners: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    offsets: dict[tuple[str, int], int] = {}
    if not ok:
        return owners, offsets
    for r, ms in train_metas.items():
        for m in ms:
            if m.name in ok:
                a = m.local_offset[0]
                offsets[(m.name, r)] = a
                if m.local_shape[0] > 0 and all(m.local_shape):
                    owners[m.name].append((a, a + m.local_shape[0], r))
    return owners, offsets


def _localize(group: list[Recipe], owners, mesh: tuple[int, ...], min_band_bytes: int = 0):
    """Cut the copy recipes of a fusion group at shard boundaries so every band reads rows
    that one rank already holds. Returns [(band recipe, candidate senders)] or None when the
    group needs the gather (a transform other than copy, a placement that cuts columns, a
    band whose pieces no single rank holds, or bands smaller than ``min_band_bytes``: a norm cut
    into 8 writes of 2 KB per receiver costs more in per-message overhead than gathering it)."""
    out = []
    for rec in group:
        if rec.transform != "copy":
            return None
        d = split_dim(rec)
        n = rec.shape[d] if rec.shape else 1
        cuts = {0, n}
        for p in rec.pieces:
            if p.source is None:
                continue
            k = len(p.dst_box) - len(p.src_box)
            if p.source not in owners or k < 0 or d - k != 0:
                return None
            (sa, sb), (da, db) = p.src_box[0], p.dst_box[d]
            if sb - sa != db - da:
                return None
            cuts.update((da, db))
            cuts.update(da + x - sa for oa, ob, _ in owners[p.source] for x in (oa, ob) if sa < x < sb)
        cuts = sorted(c for c in cuts if 0 <= c <= n)
        bands = list(zip(cuts, cuts[1:]))
        if len(bands) > 1 and rec.output_nbytes < min_band_bytes * len(bands):
            return None
        parts = split_recipe_bands(rec, bands) if len(bands) > 1 else [rec]
        for part in parts:
            cand = set(mesh)
            for p in part.pieces:
                if p.source is None:
                    continue
                sa, sb = p.src_box[0]
                cand &= {r for oa, ob, r in owners[p.source] if oa <= sa and sb <= ob}
            if not cand:
                return None
            out.append((part, tuple(sorted(cand))))
    return out


def _rebase(rec: Recipe, offsets: dict[str, int]) -> Recipe:
    """``rec`` with every piece's source rows shifted into the sender's local shard."""
    pieces = tuple(p if p.source is None else
                   Piece(p.source, ((p.src_box[0][0] - offsets[p.source], p.src_box[0][1] - offsets[p.source]),)
                         + tuple(p.src_box[1:]), p.dst_box) for p in rec.pieces)
    return Recipe(rec.name, rec.ranks, rec.shape, rec.assembled_dtype, pieces, rec.transform, rec.outputs)


def _assign_local(tid, group, mesh, recs, cands, send, pair, recv, by_rank, per_rank, local_off, n_slots) -> None:
    """Assign a local task's writes: each (band, receiver) to the least-loaded rank among those
    holding the band's rows (ties: fewest bytes to that receiver, lowest rank); recipes are
    rebased into the sender's local coordinates."""
    mine: dict[int, dict[int, list[WriteSpec]]] = defaultdict(dict)
    items = sorted((-rec.output_nbytes, ri, dst) for ri, rec in enumerate(recs) for dst in rec.ranks)
    for negb, ri, dst in items:
        nbytes = -negb
        pl = pair.get(dst)
        if pl is None:
            pl = pair[dst] = [0] * n_slots
        sender = min(cands[ri], key=lambda r: (send[r], pl[r], r))
        send[sender] += nbytes
        pl[sender] += nbytes
        recv[dst] += nbytes
        ws = mine[sender].setdefault(ri, [])
        rec = recs[ri]
        for oi, out in enumerate(rec.outputs):
            d = by_rank[dst][out.tensor]
            isz = itemsize(out.dtype)
            fa, fb = box_flat_range(out.box, d.shape)
            ws.append(_write_spec(oi, dst, d.offset + fa * isz, (fb - fa) * isz))
    for r in sorted(mine):
        assigns = []
        for ri in sorted(mine[r]):
            rec = recs[ri]
            offs = {p.source: local_off[(p.source, r)] for p in rec.pieces if p.source is not None}
            assigns.append(Assignment(_rebase(rec, offs), tuple(mine[r][ri])))
        used = tuple(dict.fromkeys(p.source for a in assigns for p in a.recipe.pieces if p.source is not None))
        out_bytes = sum(a.recipe.output_nbytes for a in assigns)
        per_rank[r].append(Task(tid, group, (), tuple(mesh), tuple(assigns), 0, out_bytes, used))


def plan(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], dest_metas: dict[int, list[DestTensorMeta]],
         *, max_chunk_bytes: int = 64 << 20, local_writes: bool = True, local_min_bytes: int = 1 << 20) -> Schedule:
    """Compute the static schedule (see module docstring).

    ``train_metas``: per training rank, what it publishes; ``dest_metas``: per inference rank,
    its tensors in its region. ``max_chunk_bytes`` bounds one recipe output before it is split
    into row bands spread over senders. Raises PlanError naming tensors or ranks.

    The cyclic GC is paused meanwhile: the schedule is millions of small acyclic objects at
    Kimi-K2 scale, and each full collection would rescan all of them and the metadata."""
    was = gc.isenabled()
    gc.disable()
    try:
        return _plan(recipes, train_metas, dest_metas, max_chunk_bytes=max_chunk_bytes, local_writes=local_writes,
                     local_min_bytes=local_min_bytes)
    finally:
        if was:
            gc.enable()


def _plan(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], dest_metas: dict[int, list[DestTensorMeta]],
          *, max_chunk_bytes: int = 64 << 20, local_writes: bool = True, local_min_bytes: int = 1 << 20) -> Schedule:
    """Compute the static schedule (see module docstring).

    ``train_metas``: per training rank, what it publishes; ``dest_metas``: per inference rank,
    its tensors in its region. ``max_chunk_bytes`` bounds one recipe output before it is split
    into row bands spread over senders. Raises PlanError naming tensors or ranks."""
    sources = _consistent_sources(train_metas)
    dests = {(m.rank, m.name): m for ms in dest_metas.values() for m in ms}
    validate(recipes, {n: (m.global_shape, m.dtype) for n, m in sources.items()}, dests)

    groups = fusion_groups(recipes.recipes)
    order = {n: i for i, n in enumerate(sources)}
    copy_sources = {p.source for r in recipes.recipes if r.transform == "copy" for p in r.pieces
                    if p.source is not None} if local_writes else set()
    owners, local_off = _owners(train_metas, sources, copy_sources)
    flat_of: dict[tuple, tuple[int, ...]] = {}

    def mesh_flat(name: str) -> tuple[int, ...]:
        m = sources[name].mesh_ranks
        f = flat_of.get(m)
        if f is None:
            f = flat_of[m] = sources[name].mesh_flat
        return f

    task_defs = []
    for g in groups:
        srcs = sorted({s for r in g for s in r.sources}, key=lambda n: order[n])
        meshes = {mesh_flat(s) for s in srcs}
        if len(meshes) > 1:
            raise PlanError("fusion group mixes DeviceMeshes: " + ", ".join(f"{s} on {sources[s].mesh_flat}" for s in srcs))
        mesh = meshes.pop() if meshes else tuple(sorted(train_metas))[:1]
        loc = _localize(g, owners, mesh, local_min_bytes) if local_writes and srcs else None
        if loc is None:
            task_defs.append((srcs, mesh, [c for r in g for c in _split_big(r, max_chunk_bytes)], None))
        else:
            parts = [(c, cand) for r, cand in loc for c in _split_big(r, max_chunk_bytes)]
            task_defs.append((srcs, mesh, [c for c, _ in parts], [cand for _, cand in parts]))

    gid = mesh_groups([t[1] for t in task_defs])
    task_defs.sort(key=lambda t: (gid[t[1]], order[t[0][0]] if t[0] else -1))

    send = defaultdict(int, {r: 0 for r in train_metas})
    n_slots = 1 + max([r for r in train_metas] + [r for t in task_defs for r in t[1]], default=0)
    pair: dict[int, list[int]] = {}
    """dst -> bytes each training rank sends to it (a list indexed by training rank)"""
    by_rank: dict[int, dict[str, DestTensorMeta]] = defaultdict(dict)
    for (rk, nm), d in dests.items():
        by_rank[rk][nm] = d
    recv = defaultdict(int, {r: 0 for r in dest_metas})
    per_rank: dict[int, list[Task]] = {r: [] for r in train_metas}
    isz_of: dict[str, int] = {}
    for tid, (srcs, mesh, recs, cands) in enumerate(task_defs):
        if cands is not None:
            _assign_local(tid, gid[mesh], mesh, recs, cands, send, pair, recv, by_rank, per_rank, local_off, n_slots)
            continue
        src_bytes = sum(numel(sources[s].global_shape) * itemsize(sources[s].dtype) for s in srcs)
        mine: dict[int, dict[int, list[WriteSpec]]] = {r: {} for r in mesh}
        items = []
        rec_bytes = [rec.output_nbytes for rec in recs]
        for ri, rec in enumerate(recs):
            nb = rec_bytes[ri]
            for dst in rec.ranks:
                items.append((-nb, ri, dst))
        items.sort()
        # The sender of each write is argmin over the mesh of (send[r], pair[r, dst], r), as
        # `min(mesh, key=...)` would pick it, found in buckets of ranks by bytes sent (a heap
        # of the distinct byte counts, each bucket sorted by rank): the least-loaded bucket's
        # first rank wins unless it already sends to dst, then the bucket is compared on pair.
        buckets: dict[int, list[int]] = {}
        for r in sorted(mesh):
            buckets.setdefault(send[r], []).append(r)
        levels = list(buckets)
        heapq.heapify(levels)
        flat_cache: dict[tuple[int, int], tuple] = {}
        for negb, ri, dst in items:
            nbytes = -negb
            pl = pair.get(dst)
            if pl is None:
                pl = pair[dst] = [0] * n_slots
            s0 = levels[0]
            bk = buckets[s0]
            if len(bk) == 1 or not pl[bk[0]]:
                sender = bk.pop(0)
            else:
                ps = list(map(pl.__getitem__, bk))
                sender = bk.pop(ps.index(min(ps)))
            if not bk:
                del buckets[s0]
                heapq.heappop(levels)
            s1 = s0 + nbytes
            nb_ = buckets.get(s1)
            if nb_ is None:
                buckets[s1] = [sender]
                heapq.heappush(levels, s1)
            else:
                insort(nb_, sender)
            send[sender] = s1
            pl[sender] += nbytes
            recv[dst] += nbytes
            rec = recs[ri]
            ws = mine[sender].get(ri)
            if ws is None:
                ws = mine[sender][ri] = []
            dr = by_rank[dst]
            for oi, out in enumerate(rec.outputs):
                d = dr[out.tensor]
                c = flat_cache.get((ri, oi))
                if c is None or (c[0] is not d.shape and c[0] != d.shape):
                    isz = isz_of.get(out.dtype)
                    if isz is None:
                        isz = isz_of[out.dtype] = itemsize(out.dtype)
                    fa, fb = box_flat_range(out.box, d.shape)
                    c = flat_cache[(ri, oi)] = (d.shape, fa * isz, (fb - fa) * isz)
                ws.append(_write_spec(oi, dst, d.offset + c[1], c[2]))
        g_ = gid[mesh]
        srcs_t, mesh_t = tuple(srcs), tuple(mesh)
        idle = None  # ranks with nothing to send share one Task (it is frozen)
        for r in mesh:
            m_r = mine[r]
            if not m_r:
                if idle is None:
                    idle = Task(tid, g_, srcs_t, mesh_t, (), src_bytes, src_bytes)
                per_rank[r].append(idle)
                continue
            ris = sorted(m_r)
            assigns = tuple(Assignment(recs[ri], tuple(m_r[ri])) for ri in ris)
            out_bytes = sum(rec_bytes[ri] for ri in ris)
            per_rank[r].append(Task(tid, g_, srcs_t, mesh_t, assigns, src_bytes, src_bytes + out_bytes))

    n_groups = len(set(gid.values()))
    rank_plans = {r: RankPlan(r, tuple(ts), tuple(sorted({t.group for t in ts})), n_groups) for r, ts in per_rank.items()}
    return Schedule(rank_plans, dict(send), dict(recv), len(task_defs), len(set(gid.values())))
