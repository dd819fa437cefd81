"""The schedule: who sends which bytes to whom, and in what order (steps 2-4 of
:mod:`reference.plan`), from inputs :mod:`reference.plan.checks` passes (or is checking
concurrently: on inputs the checks would refuse it may raise anything).

1. each fusion group (recipes sharing sources, e.g. q/k/v -> every TP rank's ``qkv_proj``)
   becomes a :class:`_TaskDef`: its sources, its DeviceMesh, its recipes cut into row bands of
   at most ``max_chunk_bytes`` (:func:`_split_big`); recipes whose rows the senders already
   hold -- plain copies, fused row bands, block-FP8 cut on 128-row boundaries -- are cut at
   shard boundaries instead (:func:`reference.plan.local.localize_group`, a *local* task: no
   gather), and only the rest of the group is gathered (``Schedule.gather_bytes``);
2. task definitions are ordered by mesh group (disjoint meshes run in parallel, groups are
   separated by a barrier; :func:`mesh_groups`), then checkpoint order;
3. every (recipe, receiving rank) write goes to one sender by one policy,
   :func:`_least_loaded`; each sending rank gets one :class:`~reference.types.Task` per task
   definition (ranks of the mesh with nothing to send share one, the all-gather is collective).

The record types are built with :mod:`reference.plan.fast` (about a million at Kimi-K2 scale).
"""
from __future__ import annotations

from array import array
from bisect import insort
from collections import defaultdict, deque
from functools import partial
from heapq import heapify, heappop, heappush
from itertools import filterfalse, repeat
from operator import attrgetter, itemgetter
from typing import NamedTuple

from ..layouts import has_runtime_layout
from ..quant import QUANT_BLOCK
from ..transforms import split_dim, split_recipe
from ..types import (
    DestTensorMeta,
    ParamMeta,
    PlanError,
    RankPlan,
    Recipe,
    Schedule,
    Task,
    WriteSpec,
    box_flat_range,
    itemsize,
)
from .fast import _assignment, _piece, _recipe, _task, new_write
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
    rank (FP8 bands in whole :data:`~reference.quant.QUANT_BLOCK`-row quantization blocks), each with its output bytes."""
    per_rank = recipe.output_nbytes
    if per_rank <= max_chunk_bytes or len(recipe.shape) == 0 or has_runtime_layout(recipe):  # layouts: written whole
        return [(recipe, per_rank)]
    rows = recipe.shape[split_dim(recipe)]
    row_bytes = max(1, per_rank // max(rows, 1))
    max_rows = max(1, max_chunk_bytes // row_bytes)
    if recipe.transform == "fp8_block":
        max_rows = max(QUANT_BLOCK, (max_rows // QUANT_BLOCK) * QUANT_BLOCK)
    if max_rows >= rows:
        return [(recipe, per_rank)]
    return [(r, r.output_nbytes) for r in split_recipe(recipe, max_rows)]


def _rebase(rec: Recipe, offsets: dict[str, int]) -> Recipe:
    """``rec`` with every piece's source rows shifted into the sender's local shard."""
    pieces = []
    for p in rec.pieces:
        if p.source is None:
            pieces.append(p)
            continue
        o = offsets[p.source]
        (a, b), *rest = p.src_box
        pieces.append(_piece(p.source, ((a - o, b - o), *rest), p.dst_box))
    return _recipe(rec.name, rec.ranks, rec.shape, rec.assembled_dtype, tuple(pieces), rec.transform, rec.outputs)


def _layout_ids(dest_metas: dict[int, list[DestTensorMeta]]) -> dict[int, int]:
    """Inference rank -> layout id; ranks with the same tensors at the same offsets (DP
    replicas, ranks of one TP position) share an id."""
    ids: dict[tuple, int] = {}
    return {r: ids.setdefault(tuple(map(_DEST_LAYOUT, ms)), len(ids)) for r, ms in dest_metas.items()}


def _spans(rec: Recipe, dst_tensors: dict[str, DestTensorMeta]) -> tuple[tuple[int, int, int], ...]:
    """(output index, byte offset in the destination rank's region, byte length) of each of
    ``rec``'s outputs on a rank whose tensors are ``dst_tensors``."""
    out = []
    for oi, o in enumerate(rec.outputs):
        d = dst_tensors[o.tensor]
        isz = itemsize(o.dtype)
        fa, fb = box_flat_range(o.box, d.shape)
        out.append((oi, d.offset + fa * isz, (fb - fa) * isz))
    return tuple(out)


def _least_loaded(cands, send, pl) -> int:
    """THE sender policy: among ``cands``, the rank that sends the fewest bytes so far
    (``send[r]``), ties to the one that sends least to this receiver (``pl[r]``), then the lowest
    rank. The busiest NIC sets the time, so every write goes to the least-busy candidate.

    This is the definition; the schedule finds the same argmin faster. Local tasks
    (:func:`_assign_local`: candidates differ per band, the ranks holding its rows) read the
    candidates' loads with one ``itemgetter`` call and compare receivers only on a tie. A
    gathered task's writes can go to any rank of the mesh; :func:`_schedule` keeps buckets of
    ranks by bytes sent across the tasks of a mesh (``min`` over 256 ranks per write would cost
    about half the plan at Kimi-K2 scale). ``tests/test_planner.py`` checks both against this."""
    return min(cands, key=lambda r: (send[r], pl[r], r))


def _pick(cands, get, send, pl) -> int:
    """:func:`_least_loaded` of ``cands`` (ascending ranks, two or more; ``get`` is
    ``itemgetter(*cands)``): the first rank sending the fewest bytes, unless another sends as
    few -- then the least to this receiver (``pl``), then the lowest rank."""
    ss = get(send)
    m = min(ss)
    i = ss.index(m)
    if ss.count(m) == 1:
        return cands[i]
    ps = get(pl)
    best, bp = i, ps[i]
    for k in range(i + 1, len(ss)):
        if ss[k] == m and ps[k] < bp:
            best, bp = k, ps[k]
    return cands[best]


def _assign_local(tid, group, mesh, recs, nbs, cands, send, pair, recv, by_rank, layout_of, per_rank, offset_of) -> None:
    """Assign a local task's writes: each (band, receiver), largest first, to
    :func:`_least_loaded` of the ranks holding the band's rows (:func:`_pick`); recipes are
    rebased into the sender's local coordinates (``offset_of(source, rank)``: its shard's
    first row; a band rebased once per distinct shard offsets). Updates ``send``, ``pair``
    (int64 arrays indexed by training rank), ``recv`` and appends one :class:`Task` per sending
    rank to ``per_rank``. ``nbs``: per band, its output bytes per receiving rank."""
    mine: dict[int, dict[int, list[WriteSpec]]] = defaultdict(dict)
    items = sorted([(-nbs[ri], ri, dst) for ri, rec in enumerate(recs) for dst in rec.ranks])
    spans: dict[tuple[int, int], tuple] = {}  # (band, layout id) -> its writes' (output, offset, bytes)
    getters: dict[tuple[int, ...], itemgetter] = {}
    for negb, ri, dst in items:
        pl = pair[dst]
        c = cands[ri]
        if len(c) == 1:
            sender = c[0]
        else:  # _pick, inline
            get = getters.get(c)
            if get is None:
                get = getters[c] = itemgetter(*c)
            ss = get(send)
            m = min(ss)
            i = ss.index(m)
            if ss.count(m) == 1:
                sender = c[i]
            else:
                sender = _pick(c, get, send, pl)
        send[sender] -= negb
        pl[sender] -= negb
        recv[dst] -= negb
        key = (ri, layout_of[dst])
        sp = spans.get(key)
        if sp is None:
            sp = spans[key] = _spans(recs[ri], by_rank[dst])
        got = mine[sender].get(ri)
        if got is None:
            got = mine[sender][ri] = []
        if len(sp) == 1:
            (o0, f0, l0), = sp
            got.append(new_write((o0, dst, f0, l0)))
        else:
            got.extend([new_write((oi, dst, off, ln)) for oi, off, ln in sp])
    rebased: dict[tuple, Recipe] = {}
    srcs_of = [tuple(p.source for p in rec.pieces if p.source is not None) for rec in recs]
    mesh_t = tuple(mesh)
    for r in sorted(mine):
        assigns = []
        got = mine[r]
        for ri in sorted(got):
            offs = tuple([offset_of(x, r) for x in srcs_of[ri]])
            rec = rebased.get((ri, offs))
            if rec is None:
                rec = rebased[(ri, offs)] = _rebase(recs[ri], dict(zip(srcs_of[ri], offs)))
            assigns.append(_assignment(rec, tuple(got[ri])))
        used = tuple(dict.fromkeys(x for ri in sorted(got) for x in srcs_of[ri]))
        out_bytes = sum([nbs[ri] for ri in got])
        per_rank[r].append(_task(tid, group, (), mesh_t, tuple(assigns), 0, out_bytes, used))


def _schedule(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], dest_metas: dict[int, list[DestTensorMeta]],
              ix: _SourceIndex, dests: dict[tuple[int, str], DestTensorMeta], *, max_chunk_bytes: int,
              local_writes: bool, local_min_bytes: int) -> Schedule:
    """Build the schedule (steps 2-4 of the module docstring) from checked, or concurrently
    checked, inputs: on inputs the checks would refuse it may raise anything."""
    sources = ix.first

    groups = fusion_groups(recipes.recipes)
    order = {n: i for i, n in enumerate(sources)}
    all_sources = {p.source for r in recipes.recipes for p in r.pieces if p.source is not None} if local_writes else set()
    owners, owner_keys = row_owners(ix, all_sources)
    flat_of: dict[tuple, tuple[int, ...]] = {}
    local_cache: dict = {}  # localize_group's verdicts, shared by recipes of one shape (experts)
    offset_of = partial(local_offset, ix)

    def mesh_flat(name: str) -> tuple[int, ...]:
        m = sources[name].mesh_ranks
        f = flat_of.get(m)
        if f is None:
            f = flat_of[m] = sources[name].mesh_flat
        return f

    task_defs = []
    for g in groups:
        srcs = sorted({pc.source for r in g for pc in r.pieces if pc.source is not None}, key=order.__getitem__)
        meshes = {mesh_flat(s) for s in srcs}
        if len(meshes) > 1:
            raise PlanError("fusion group mixes DeviceMeshes: " + ", ".join(f"{s} on {sources[s].mesh_flat}" for s in srcs))
        mesh = meshes.pop() if meshes else tuple(sorted(train_metas))[:1]
        if local_writes and srcs:
            loc, gat = localize_group(g, owners, mesh, local_min_bytes, local_cache, owner_keys)
        else:
            loc, gat = [], g
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
    send = array("q", bytes(8 * n_slots))
    """training rank -> bytes it sends so far (int64, indexed by rank: read by ``itemgetter``)"""
    pair: dict[int, array] = {d: array("q", bytes(8 * n_slots)) for d in dest_metas}
    """dst -> bytes each training rank sends to it, indexed by training rank (int64 arrays: the
    sender choice reads ~20 per write, and inline values stay in cache where list items, ints
    allocated all over the heap, do not -- 1.5x faster on the Kimi-K2 plan)"""
    by_rank: dict[int, dict[str, DestTensorMeta]] = defaultdict(dict)
    for (rk, nm), d in dests.items():
        by_rank[rk][nm] = d
    recv = defaultdict(int, {r: 0 for r in dest_metas})
    per_rank: dict[int, list[Task]] = {r: [] for r in train_metas}
    layout_of = _layout_ids(dest_metas)
    mesh_state: dict[tuple, tuple] = {}
    """mesh -> (buckets, levels) of the sender choice below, for meshes of group ``state_group``"""
    state_group = None
    src_nbytes: dict[str, int] = {}
    gather_bytes = 0
    for tid, (srcs, mesh, recs, cands, rec_bytes) in enumerate(task_defs):
        if cands is not None:
            _assign_local(tid, gid[mesh], mesh, recs, rec_bytes, cands, send, pair, recv, by_rank, layout_of, per_rank,
                          offset_of)
            mesh_state.pop(mesh, None)  # its ranks' loads changed outside the buckets
            continue
        src_bytes = 0
        for s in srcs:
            b = src_nbytes.get(s)
            if b is None:
                b = src_nbytes[s] = sources[s].nbytes
            src_bytes += b
        gather_bytes += src_bytes
        mine: dict[int, list] = {}
        items = [(-nb, ri, dst) for ri, (nb, rec) in enumerate(zip(rec_bytes, recs)) for dst in rec.ranks]
        items.sort()
        # The sender of each write is _least_loaded(mesh, send, pair[dst]): argmin over the mesh
        # of (send[r], pair[r, dst], r), found in buckets of ranks by bytes sent (a heap of the
        # distinct byte counts, each bucket sorted by rank): the least-loaded bucket's
        # first rank wins unless it already sends to dst, then the bucket is compared on pair.
        # Kept per mesh across its tasks (a task changes only its own ranks' loads, and the
        # meshes of one group are disjoint); rebuilt after a task on an overlapping mesh.
        if state_group != gid[mesh]:
            mesh_state.clear()
            state_group = gid[mesh]
        state = mesh_state.get(mesh)
        if state is None:
            buckets: dict[int, list[int]] = {}
            for r in sorted(mesh):
                buckets.setdefault(send[r], []).append(r)
            levels = list(buckets)
            heapify(levels)
            mesh_state[mesh] = (buckets, levels)
        else:
            buckets, levels = state
        # per recipe, its writes' (output, offset, length) for the layout last written to
        # (a recipe's destinations are mostly DP replicas, which share one layout)
        last_lid, spans = [-1] * len(recs), [()] * len(recs)
        for negb, ri, dst in items:
            pl = pair[dst]
            s0 = levels[0]
            bk = buckets[s0]
            if len(bk) == 1 or not pl[bk[0]]:
                sender = bk.pop(0)
            else:
                ps = itemgetter(*bk)(pl)  # one C call for the ~20 loads
                i = ps.index(min(ps))  # first minimum: lowest rank among ties
                sender = bk.pop(i)
            if not bk:
                del buckets[s0]
                heappop(levels)
            s1 = s0 - negb
            nb_ = buckets.get(s1)
            if nb_ is None:
                buckets[s1] = [sender]
                heappush(levels, s1)
            else:
                insort(nb_, sender)
            send[sender] = s1
            pl[sender] -= negb
            recv[dst] -= negb
            lid = layout_of[dst]
            if lid != last_lid[ri]:  # (output, byte offset in dst's region, bytes) per output
                last_lid[ri] = lid
                spans[ri] = _spans(recs[ri], by_rank[dst])
            sp = spans[ri]
            if len(sp) == 1:
                (o0, f0, l0), = sp
                wt = (new_write((o0, dst, f0, l0)),)
            elif len(sp) == 2:  # FP8: weight and weight_scale_inv
                (o0, f0, l0), (o1, f1, l1) = sp
                wt = (new_write((o0, dst, f0, l0)), new_write((o1, dst, f1, l1)))
            else:
                wt = tuple([new_write((oi, dst, off, ln)) for oi, off, ln in sp])
            got = mine.get(sender)
            if got is None:
                mine[sender] = [ri, wt]  # recipe, its writes, recipe, its writes, ...
            else:
                got += (ri, wt)
        g_ = gid[mesh]
        srcs_t, mesh_t = tuple(srcs), tuple(mesh)
        for r, got in mine.items():
            if len(got) == 2:  # the common case: one write set per sending rank and task
                ri = got[0]
                assigns = (_assignment(recs[ri], got[1]),)
                out_bytes = rec_bytes[ri]
            else:
                by_ri: dict[int, list[WriteSpec]] = {}
                for k in range(0, len(got), 2):
                    by_ri.setdefault(got[k], []).extend(got[k + 1])
                ris = sorted(by_ri)
                assigns = tuple([_assignment(recs[ri], tuple(by_ri[ri])) for ri in ris])
                out_bytes = sum([rec_bytes[ri] for ri in ris])
            per_rank[r].append(_task(tid, g_, srcs_t, mesh_t, assigns, src_bytes, src_bytes + out_bytes, ()))
        if len(mine) < len(mesh):  # ranks with nothing to send share one Task (it is frozen); appended in C
            idle = _task(tid, g_, srcs_t, mesh_t, (), src_bytes, src_bytes, ())
            deque(map(list.append, map(per_rank.__getitem__, filterfalse(mine.__contains__, mesh)), repeat(idle)), maxlen=0)

    n_groups = len(set(gid.values()))
    rank_plans = {r: RankPlan(r, tuple(ts), tuple(sorted(set(map(_GROUP, ts)))), n_groups) for r, ts in per_rank.items()}
    # every mesh rank published (checked), so the senders are training ranks
    return Schedule(rank_plans, {r: send[r] for r in train_metas}, dict(recv), len(task_defs), n_groups, gather_bytes)
