"""The static schedule: who sends which bytes to whom, and in what order. Computed once.

:func:`plan` is a pure function of (training metadata, recipes, inference metadata). It

1. checks the training side is consistent (every rank agrees on a parameter's global shape,
   dtype, mesh and placements; the shards of each parameter tile it) and validates the recipes
   against both sides (:func:`reference.mapping.validate`: every destination byte covered once,
   missing / unused / mismatched tensors named) -- all before any byte moves, and before a
   schedule is returned (at Kimi-K2 scale in a forked child process while steps 2-4 run);
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
import math
import multiprocessing
import os
import sys
import time
import traceback
import warnings
from array import array
from bisect import insort
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from functools import partial
from heapq import heapify, heappop, heappush
from itertools import filterfalse, repeat
from operator import attrgetter, eq, itemgetter
from typing import NamedTuple

import numpy as np

from .mapping import PlanError, RecipeSet, fusion_groups, validate
from .transforms import split_dim, split_recipe, split_recipe_bands
from .types import (DestTensorMeta, ParamMeta, Piece, Recipe, box_flat_range, itemsize, numel)


class WriteSpec(NamedTuple):
    """One one-sided write: output ``output`` of the recipe (all its bytes) to inference rank
    ``dst_rank`` at byte ``remote_offset`` of that rank's region, ``length`` bytes.

    A named tuple rather than a frozen dataclass: the planner makes about a million per plan
    at Kimi-K2 scale, and a tuple is built in one C call."""

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


_NEW = object.__new__
_TUPLE_NEW = tuple.__new__
_A_SET = tuple(Assignment.__dict__[f].__set__ for f in Assignment.__slots__)
_T_SET = tuple(Task.__dict__[f].__set__ for f in Task.__slots__)
# The planner makes about half a million of each at Kimi-K2 scale; a frozen dataclass's
# __init__ goes through object.__setattr__ per field, these set the slots directly and make
# objects equal to the constructed ones (tests/test_planner.py checks it).


def _write_spec(output: int, dst_rank: int, remote_offset: int, length: int) -> WriteSpec:
    """``WriteSpec(output, dst_rank, remote_offset, length)``, in one C call."""
    return _TUPLE_NEW(WriteSpec, (output, dst_rank, remote_offset, length))


def _assignment(recipe: Recipe, writes: tuple[WriteSpec, ...]) -> Assignment:
    """``Assignment(recipe, writes)``, fast."""
    a = _NEW(Assignment)
    _A_SET[0](a, recipe)
    _A_SET[1](a, writes)
    return a


def _task(id, group, sources, mesh, assignments, source_bytes, temp_bytes, local_sources) -> Task:
    """``Task(...)`` with every field positional, fast."""
    t = _NEW(Task)
    a, b, c, d, e, f, g, h = _T_SET
    a(t, id)
    b(t, group)
    c(t, sources)
    d(t, mesh)
    e(t, assignments)
    f(t, source_bytes)
    g(t, temp_bytes)
    h(t, local_sources)
    return t


_NAME, _MESH, _LSHAPE, _GROUP = attrgetter("name"), attrgetter("mesh_ranks"), attrgetter("local_shape"), attrgetter("group")
_DEST_LAYOUT = attrgetter("name", "offset", "shape", "dtype")
_RECORD = attrgetter("name", "global_shape", "dtype", "placements", "mesh_ranks")
_RECORD4 = attrgetter("name", "global_shape", "dtype", "placements")
"""What every rank of a parameter's mesh must publish identically (``local_*`` differ per rank)."""


@dataclass(slots=True)
class _NameSequence:
    """The metadata layout shared by training ranks that publish the same names in the same
    order (at Kimi-K2 scale 256 ranks, 8 sequences: one per expert column)."""

    rank: int
    """the first rank publishing this sequence"""
    names: list[str]
    """the names, in the ranks' order"""
    position: dict[str, int]
    """name -> position in the list (the last one, should a rank publish a name twice)"""
    ref: list[ParamMeta]
    """per position, the name's first publisher's meta (what every rank must agree with)"""
    index: np.ndarray
    """per position, the name's index in the order of first appearance (int64)"""
    meshes: dict[int, ParamMeta] = field(default_factory=dict)
    """id(mesh object) -> a ref meta with it, for the distinct mesh objects of ``ref``"""
    records: list[tuple] = field(default_factory=list)
    """per position, ``_RECORD(ref[i])``: (name, shape, dtype, placements, mesh); filled by
    :meth:`prepare` (the checks' part, which may run in another process)"""
    records4: list[tuple] = field(default_factory=list)
    """the same without the mesh"""
    mesh_reps: list[tuple[int, tuple]] = field(default_factory=list)
    """(id, mesh) of one object per distinct mesh value in ``ref``"""
    mesh_at: list[int] = field(default_factory=list)
    """per position, the id in ``mesh_reps`` of ref's mesh value"""

    def prepare(self) -> None:
        """Derive what :meth:`agrees` compares against (once per sequence)."""
        if self.records or not self.ref:
            return
        self.records = list(map(_RECORD, self.ref))
        self.records4 = list(map(_RECORD4, self.ref))
        meshes = list(map(_MESH, self.ref))
        self.meshes = dict(zip(map(id, meshes), self.ref))
        rep_of: dict[int, int] = {}
        for k, m in dict(zip(map(id, meshes), meshes)).items():
            rep_of[k] = next((rk for rk, rm in self.mesh_reps if rm == m), k)
            if rep_of[k] == k:
                self.mesh_reps.append((k, m))
        self.mesh_at = list(map(rep_of.__getitem__, map(id, meshes)))

    def agrees(self, ms: list[ParamMeta]) -> bool:
        """Whether every record of ``ms`` equals the first publisher's in name, global shape,
        dtype, placements and mesh. ``ms`` built in this process shares the mesh objects: one
        pass of tuple equality (identity first). An unpickled rank list holds its own copy of
        each mesh (one per distinct mesh, pickle's memo): its few distinct mesh objects are
        compared by value once, then positions by id -- comparing a 256-rank mesh per record
        would cost more than everything else."""
        self.prepare()
        if len(ms) != len(self.ref):
            return False
        if not ms or ms[0].mesh_ranks is self.ref[0].mesh_ranks:
            return all(map(eq, map(_RECORD, ms), self.records))
        if not all(map(eq, map(_RECORD4, ms), self.records4)):
            return False
        meshes = list(map(_MESH, ms))
        mids = list(map(id, meshes))
        canon = {k: next((rk for rk, rm in self.mesh_reps if rm == m), -1) for k, m in dict(zip(mids, meshes)).items()}
        return list(map(canon.__getitem__, mids)) == self.mesh_at


class _SourceIndex(NamedTuple):
    """The training metadata indexed by name (:func:`_index_sources`)."""

    first: dict[str, ParamMeta]
    """one ParamMeta per name, in order of first appearance (ranks ascending, each rank's order)"""
    views: dict[int, tuple[dict[str, int], list[ParamMeta]]]
    """per rank, (name -> position, its metas)"""
    seq_of: dict[int, _NameSequence]
    """per rank, its name sequence"""


def _index_sources(train_metas: dict[int, list[ParamMeta]], *, exact: bool = True) -> _SourceIndex:
    """Index the training metadata by name without checking it (:func:`_check_sources` does).

    At Kimi-K2 scale 256 ranks publish 2.4 million records. On this project's 2-core VM a
    lookup in a 70k-entry dict costs about as much as reading ten records in order, so ranks
    that publish the same names in the same order share one :class:`_NameSequence` whose
    names are looked up once. ``exact``: a rank joins a sequence when all its names equal the
    sequence's (one C pass per rank, 0.6 s at Kimi-K2 scale); otherwise when its length and
    every ``n // 16``-th name do, and ``_check_sources(confirm_index=True)`` must confirm it before
    the index is trusted (the forked checks do, on the other core)."""
    first: dict[str, ParamMeta] = {}
    index: dict[str, int] = {}
    views: dict[int, tuple[dict[str, int], list[ParamMeta]]] = {}
    seq_of: dict[int, _NameSequence] = {}
    seqs: dict[tuple, list[_NameSequence]] = {}
    for rank in sorted(train_metas):
        ms = train_metas[rank]
        n = len(ms)
        key = (n, *(ms[i].name for i in range(0, n, max(1, n // 16))))
        names = list(map(_NAME, ms)) if exact else None
        seq = next((c for c in seqs.get(key, ()) if names is None or c.names == names), None)
        if seq is None:
            if names is None:
                names = list(map(_NAME, ms))
            position = dict(zip(names, range(n)))
            for x in filterfalse(first.__contains__, position):
                first[x] = ms[position[x]]
                index[x] = len(index)
            seq = _NameSequence(rank, names, position, list(map(first.__getitem__, names)),
                                np.fromiter(map(index.__getitem__, names), dtype=np.int64, count=n))
            seqs.setdefault(key, []).append(seq)
        views[rank] = (seq.position, ms)
        seq_of[rank] = seq
    return _SourceIndex(first, views, seq_of)


def _check_sources(train_metas: dict[int, list[ParamMeta]], ix: _SourceIndex, *, confirm_index: bool = False) -> None:
    """Check the training metadata indexed in ``ix``: every rank of a parameter's mesh must have
    published it, identically (global shape, dtype, mesh, placements), no rank outside the mesh
    may publish it, no rank twice, and the shards of a sharded parameter must hold its
    elements. Raises PlanError naming parameters and ranks.

    Every record is read: a rank is checked with one pass of ``all(map(operator.eq, ...))``
    over (name, shape, dtype, placements, mesh) tuples against its sequence's first
    publishers' (tuple equality tries identity first, so shared objects cost nothing; an
    unpickled rank list holds its own copies, compared by value). The shard sizes are summed
    per name with numpy. Records are visited one by one in Python only to name them in an
    error.

    ``confirm_index``: ``ix`` was made with ``exact=False``; a rank whose names differ from its
    sequence's raises :class:`_IndexUnconfirmed` (the record comparison covers the names, so
    agreeing ranks cost nothing more)."""
    first, views, seq_of = ix
    problems: list[str] = []
    for seq in {id(s): s for s in seq_of.values()}.values():
        if len(seq.position) != len(seq.names):
            dup = sorted(x for x, c in Counter(seq.names).items() if c > 1)
            problems.append(f"rank {seq.rank} publishes {', '.join(dup[:5])} more than once")
    flat_of: dict[int, frozenset] = {}  # id(mesh object) -> its ranks (the objects stay alive meanwhile)
    idx_parts, numel_parts = [], []
    for rank in sorted(train_metas):
        ms = train_metas[rank]
        seq = seq_of[rank]
        ref = seq.ref
        if not seq.agrees(ms):
            if confirm_index and list(map(_NAME, ms)) != seq.names:
                raise _IndexUnconfirmed(f"rank {rank}")
            for m, f in zip(ms, ref):
                if _RECORD(m) != _RECORD(f):
                    problems.append(f"{m.name}: rank {rank} publishes shape {m.global_shape} {m.dtype} mesh {m.mesh_ranks} "
                                    f"{m.placements}, other ranks {f.global_shape} {f.dtype} mesh {f.mesh_ranks} {f.placements}")
        for k, f in seq.meshes.items():
            mf = flat_of.get(k)
            if mf is None:
                mf = flat_of[k] = frozenset(f.mesh_flat)
            if rank not in mf:
                names = [m.name for m, g in zip(ms, ref) if id(g.mesh_ranks) == k]
                problems.append(f"rank {rank} publishes {', '.join(names[:5])} but is not in its mesh {sorted(mf)}")
        idx_parts.append(seq.index)
        numel_parts.append(np.fromiter(map(math.prod, map(_LSHAPE, ms)), dtype=np.int64, count=len(ms)))
    # Every mesh rank published it: rank r published exactly the names whose mesh holds r (each
    # name it published has such a mesh, checked above) iff it published as many (no duplicates).
    n_with: Counter = Counter(id(f.mesh_ranks) for f in first.values())
    missing: dict[str, list[int]] = defaultdict(list)
    for rank in sorted({r for k in n_with for r in flat_of[k]} | set(views)):
        pos = views[rank][0] if rank in views else {}
        if len(pos) < sum(c for k, c in n_with.items() if rank in flat_of[k]):
            for x, f in first.items():
                if x not in pos and rank in flat_of[id(f.mesh_ranks)]:
                    missing[x].append(rank)
    for x, ranks in missing.items():
        problems.append(f"{x}: mesh ranks {ranks} did not publish it")
    held = np.zeros(len(first), dtype=np.int64)
    if idx_parts:
        np.add.at(held, np.concatenate(idx_parts), np.concatenate(numel_parts))
    sharded: dict[tuple, bool] = {}
    for i, f in enumerate(first.values()):
        sh = sharded.get(f.placements)
        if sh is None:
            sh = sharded[f.placements] = all(p.startswith("Shard") for p in f.placements)
        if sh and held[i] != numel(f.global_shape):
            problems.append(f"{f.name}: shards hold {int(held[i])} elements, the tensor has {numel(f.global_shape)}")
    if problems:
        raise PlanError(f"training metadata inconsistent ({len(problems)} problem(s)):\n  " + "\n  ".join(problems[:20]))


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
    rank (FP8 bands in whole 128-row quantization blocks), each with its output bytes."""
    per_rank = recipe.output_nbytes
    if per_rank <= max_chunk_bytes or len(recipe.shape) == 0:
        return [(recipe, per_rank)]
    rows = recipe.shape[split_dim(recipe)]
    row_bytes = max(1, per_rank // max(rows, 1))
    max_rows = max(1, max_chunk_bytes // row_bytes)
    if recipe.transform == "fp8_block":
        max_rows = max(128, (max_rows // 128) * 128)
    if max_rows >= rows:
        return [(recipe, per_rank)]
    return [(r, r.output_nbytes) for r in split_recipe(recipe, max_rows)]


_ROW_PLACEMENTS = frozenset({"Shard(dim=0)", "Replicate()"})


def _owners(views: dict[int, tuple[dict[str, int], list[ParamMeta]]], sources: dict[str, ParamMeta], names: set[str]):
    """For the parameters in ``names`` whose placements only cut dim 0 (``Shard(0)`` /
    ``Replicate``: a shard is a row range): name -> [(first row, end row, rank)] of the
    non-empty shards, and (name, rank) -> first row of that rank's shard. ``views``: per rank,
    (name -> position, metas) from :func:`_index_sources`; only those names are looked up
    (at Kimi-K2 scale a few hundred names on 256 ranks, not 2.4 million records)."""
    ok = [n for n in sources if n in names and set(sources[n].placements) <= _ROW_PLACEMENTS
          and sources[n].global_shape]
    owners: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    offsets: dict[tuple[str, int], int] = {}
    present: dict[int, list[tuple[str, int]]] = {}  # id(position dict) -> [(name, position)] (shared per sequence)
    for r, (pos, ms) in views.items():
        at = present.get(id(pos))
        if at is None:
            at = present[id(pos)] = [(n, pos[n]) for n in ok if n in pos]
        for n, i in at:
            m = ms[i]
            a = m.local_offset[0]
            offsets[(n, r)] = a
            if m.local_shape[0] > 0 and all(m.local_shape):
                owners[n].append((a, a + m.local_shape[0], r))
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


def _assign_local(tid, group, mesh, recs, cands, send, pair, recv, by_rank, per_rank, local_off, n_slots) -> None:
    """Assign a local task's writes: each (band, receiver) to the least-loaded rank among those
    holding the band's rows (ties: fewest bytes to that receiver, lowest rank); recipes are
    rebased into the sender's local coordinates."""
    mine: dict[int, dict[int, list[WriteSpec]]] = defaultdict(dict)
    items = sorted((-rec.output_nbytes, ri, dst) for ri, rec in enumerate(recs) for dst in rec.ranks)
    for negb, ri, dst in items:
        nbytes = -negb
        pl = pair[dst]
        sender = min(cands[ri], key=lambda r: (send[r], pl[r], r))
        send[sender] += nbytes
        pl[sender] += nbytes
        recv[dst] += nbytes
        mine[sender].setdefault(ri, []).extend(_write_spec(oi, dst, off, ln) for oi, off, ln in _spans(recs[ri], by_rank[dst]))
    for r in sorted(mine):
        assigns = []
        for ri in sorted(mine[r]):
            rec = recs[ri]
            offs = {p.source: local_off[(p.source, r)] for p in rec.pieces if p.source is not None}
            assigns.append(Assignment(_rebase(rec, offs), tuple(mine[r][ri])))
        used = tuple(dict.fromkeys(p.source for a in assigns for p in a.recipe.pieces if p.source is not None))
        out_bytes = sum(a.recipe.output_nbytes for a in assigns)
        per_rank[r].append(Task(tid, group, (), tuple(mesh), tuple(assigns), 0, out_bytes, used))


PARALLEL_CHECKS_MIN_RECORDS = 200_000
"""``plan(parallel_checks=None)`` checks in a forked child process from this many training
records on (all ranks together; Kimi-K2 256 -> 128 publishes 2.4 million). Below it forking
costs more than it saves, and small worlds (tests, the demo) keep the plain sequential path."""


_CHECKS_WAIT_S = 60.0
""":meth:`_ForkedChecks.join` waits this long plus 4x the time the child has had before it
gives up on the child and checks in-process (the checks take ~4 s at Kimi-K2 scale)."""


class _IndexUnconfirmed(Exception):
    """A rank's names differ from those of the sequence its sampled names matched (raised by
    the checks, in-process or forked; :func:`plan` then indexes exactly and checks again)."""


def _run_checks(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], ix: _SourceIndex,
                dests: dict[tuple[int, str], DestTensorMeta], *, confirm_index: bool = False) -> None:
    """Every check :func:`plan` makes before it returns a schedule; raises PlanError.
    ``confirm_index``: ``ix`` was made with ``exact=False``; raise :class:`_IndexUnconfirmed`
    if it does not hold."""
    _check_sources(train_metas, ix, confirm_index=confirm_index)
    validate(recipes, {n: (m.global_shape, m.dtype) for n, m in ix.first.items()}, dests)


def _checks_child(fn, conn) -> None:
    """In the forked child: run ``fn`` and send ("ok", None), ("plan-error", message),
    ("unconfirmed", None) or ("crash", traceback)."""
    try:
        fn()
        conn.send(("ok", None))
    except PlanError as e:
        conn.send(("plan-error", str(e)))
    except _IndexUnconfirmed:
        conn.send(("unconfirmed", None))
    except BaseException:  # noqa: BLE001 -- anything else: the parent checks in-process
        conn.send(("crash", traceback.format_exc(limit=8)))
    finally:
        conn.close()


class _ForkedChecks:
    """``fn()`` (the plan's checks) run in a forked child process while the caller builds the
    schedule on the other core; :meth:`join` waits for it and raises its PlanError here.

    ``multiprocessing``'s fork context does the process handling (it flushes stdio before the
    fork and leaves the child with ``os._exit``); fork, not spawn, because the child reads the
    caller's metadata copy-on-write where spawn would pickle 2.4 million records across. The
    child runs pure Python and numpy only (no torch, no collective, no store), so other threads
    of a controller (TCPStore, Gloo) are not touched -- as torch's own DataLoader forks its
    workers from processes that hold such threads. Should the child crash, die, or not answer
    within :data:`_CHECKS_WAIT_S` plus 4x the time it has had, the checks run again in this
    process: a schedule is never returned unchecked."""

    def __init__(self, fn):
        ctx = multiprocessing.get_context("fork")
        self._fn = fn
        self._t0 = time.perf_counter()
        self._conn, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_checks_child, args=(fn, child_end), name="plan-checks", daemon=True)
        try:
            self._proc.start()
        finally:
            child_end.close()

    def join(self) -> None:
        """Wait for the child; raise its PlanError (or :class:`_IndexUnconfirmed`), or run
        ``fn`` here if it gave no answer."""
        if self._proc is None:
            return
        wait = _CHECKS_WAIT_S + 4 * (time.perf_counter() - self._t0)
        try:
            kind, msg = self._conn.recv() if self._conn.poll(wait) else ("timeout", f"no answer within {wait:.0f} s")
        except (EOFError, OSError) as e:
            kind, msg = "died", repr(e)
        self.close()
        if kind == "plan-error":
            raise PlanError(msg)
        if kind == "unconfirmed":
            raise _IndexUnconfirmed
        if kind != "ok":
            warnings.warn(f"plan(): the checks' child process failed ({kind}: {msg}); checking in this process",
                          RuntimeWarning, stacklevel=3)
            self._fn()

    def close(self) -> None:
        """Stop the child if it still runs and reap it (idempotent)."""
        if self._proc is None:
            return
        self._conn.close()
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join()
        self._proc.close()
        self._proc = None


def _fork_checks_by_default(train_metas: dict[int, list[ParamMeta]]) -> bool:
    """Large metadata, Linux, a second CPU to run on, and a process allowed to have children."""
    if sys.platform != "linux" or multiprocessing.current_process().daemon:
        return False
    if len(os.sched_getaffinity(0)) < 2:
        return False
    return sum(map(len, train_metas.values())) >= PARALLEL_CHECKS_MIN_RECORDS


def plan(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], dest_metas: dict[int, list[DestTensorMeta]],
         *, max_chunk_bytes: int = 64 << 20, local_writes: bool = True, local_min_bytes: int = 1 << 20,
         parallel_checks: bool | None = None) -> Schedule:
    """Compute the static schedule (see module docstring).

    ``train_metas``: per training rank, what it publishes; ``dest_metas``: per inference rank,
    its tensors in its region. ``max_chunk_bytes`` bounds one recipe output before it is split
    into row bands spread over senders. Raises PlanError naming tensors or ranks; no schedule
    is returned unless every check passed.

    ``parallel_checks``: run the checks (training metadata consistency, :func:`validate`; about
    40% of the time at Kimi-K2 scale) in a forked child process while this one builds the
    schedule, see :class:`_ForkedChecks`. ``None`` (default): when the metadata has at least
    :data:`PARALLEL_CHECKS_MIN_RECORDS` records, on Linux with two or more usable CPUs. When
    the schedule's construction fails too, the checks' error is raised (it names the cause).
    The schedule is the same either way.

    The cyclic GC is paused meanwhile: the schedule is millions of small acyclic objects at
    Kimi-K2 scale, and each full collection would rescan all of them and the metadata."""
    was = gc.isenabled()
    gc.disable()
    try:
        kw = dict(max_chunk_bytes=max_chunk_bytes, local_writes=local_writes, local_min_bytes=local_min_bytes)
        dests = {(m.rank, m.name): m for ms in dest_metas.values() for m in ms}
        if parallel_checks is None:
            parallel_checks = _fork_checks_by_default(train_metas)
        ix = _index_sources(train_metas, exact=False)  # confirmed by the checks
        if parallel_checks:
            try:
                forked = _ForkedChecks(partial(_run_checks, recipes, train_metas, ix, dests, confirm_index=True))
            except OSError as e:  # cannot fork (memory, process limit): check here
                warnings.warn(f"plan(): cannot fork the checks ({e}); checking in this process", RuntimeWarning, stacklevel=2)
            else:
                try:
                    try:
                        sched = _schedule(recipes, train_metas, dest_metas, ix, dests, **kw)
                    except Exception:
                        forked.join()  # bad input usually breaks the construction too: raise what the checks found
                        raise
                    forked.join()
                    return sched
                except _IndexUnconfirmed:
                    ix = None  # a rank publishes other names than its sampled twin: index exactly, plan again
                finally:
                    forked.close()
        if ix is not None:
            try:
                _run_checks(recipes, train_metas, ix, dests, confirm_index=True)
            except _IndexUnconfirmed:
                ix = None
        if ix is None:
            ix = _index_sources(train_metas)
            _run_checks(recipes, train_metas, ix, dests)
        return _schedule(recipes, train_metas, dest_metas, ix, dests, **kw)
    finally:
        if was:
            gc.enable()


def _schedule(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], dest_metas: dict[int, list[DestTensorMeta]],
              ix: _SourceIndex, dests: dict[tuple[int, str], DestTensorMeta], *, max_chunk_bytes: int,
              local_writes: bool, local_min_bytes: int) -> Schedule:
    """Build the schedule (steps 2-4 of the module docstring) from checked, or concurrently
    checked, inputs: on inputs the checks would refuse it may raise anything."""
    sources, views = ix.first, ix.views

    groups = fusion_groups(recipes.recipes)
    order = {n: i for i, n in enumerate(sources)}
    copy_sources = {p.source for r in recipes.recipes if r.transform == "copy" for p in r.pieces
                    if p.source is not None} if local_writes else set()
    owners, local_off = _owners(views, sources, copy_sources)
    flat_of: dict[tuple, tuple[int, ...]] = {}

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
        loc = _localize(g, owners, mesh, local_min_bytes) if local_writes and srcs else None
        if loc is None:
            parts = [c for r in g for c in _split_big(r, max_chunk_bytes)]
            task_defs.append((srcs, mesh, [c for c, _ in parts], None, [nb for _, nb in parts]))
        else:
            parts = [(c, nb, cand) for r, cand in loc for c, nb in _split_big(r, max_chunk_bytes)]
            task_defs.append((srcs, mesh, [c for c, _, _ in parts], [cand for _, _, cand in parts], None))

    gid = mesh_groups([t[1] for t in task_defs])
    task_defs.sort(key=lambda t: (gid[t[1]], order[t[0][0]] if t[0] else -1))

    send = defaultdict(int, {r: 0 for r in train_metas})
    n_slots = 1 + max([*train_metas, *(r for m in {t[1] for t in task_defs} for r in m)], default=0)
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
    for tid, (srcs, mesh, recs, cands, rec_bytes) in enumerate(task_defs):
        if cands is not None:
            _assign_local(tid, gid[mesh], mesh, recs, cands, send, pair, recv, by_rank, per_rank, local_off, n_slots)
            mesh_state.pop(mesh, None)  # its ranks' loads changed outside the buckets
            continue
        src_bytes = 0
        for s in srcs:
            b = src_nbytes.get(s)
            if b is None:
                b = src_nbytes[s] = sources[s].nbytes
            src_bytes += b
        mine: dict[int, list] = {}
        items = [(-nb, ri, dst) for ri, (nb, rec) in enumerate(zip(rec_bytes, recs)) for dst in rec.ranks]
        items.sort()
        # The sender of each write is argmin over the mesh of (send[r], pair[r, dst], r), as
        # `min(mesh, key=...)` would pick it, found in buckets of ranks by bytes sent (a heap
        # of the distinct byte counts, each bucket sorted by rank): the least-loaded bucket's
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
                wt = (_TUPLE_NEW(WriteSpec, (o0, dst, f0, l0)),)
            elif len(sp) == 2:  # FP8: weight and weight_scale_inv
                (o0, f0, l0), (o1, f1, l1) = sp
                wt = (_TUPLE_NEW(WriteSpec, (o0, dst, f0, l0)), _TUPLE_NEW(WriteSpec, (o1, dst, f1, l1)))
            else:
                wt = tuple([_TUPLE_NEW(WriteSpec, (oi, dst, off, ln)) for oi, off, ln in sp])
            got = mine.get(sender)
            if got is None:
                mine[sender] = [ri, wt]  # recipe, its writes, recipe, its writes, ...
            else:
                got += (ri, wt)
        g_ = gid[mesh]
        srcs_t, mesh_t = tuple(srcs), tuple(mesh)
        a0, a1 = _A_SET
        t0, t1, t2, t3, t4, t5, t6, t7 = _T_SET
        for r, got in mine.items():
            if len(got) == 2:  # the common case: one write set per sending rank and task
                ri = got[0]
                a = _NEW(Assignment)
                a0(a, recs[ri])
                a1(a, got[1])
                assigns = (a,)
                out_bytes = rec_bytes[ri]
            else:
                by_ri: dict[int, list[WriteSpec]] = {}
                for k in range(0, len(got), 2):
                    by_ri.setdefault(got[k], []).extend(got[k + 1])
                ris = sorted(by_ri)
                assigns = tuple([_assignment(recs[ri], tuple(by_ri[ri])) for ri in ris])
                out_bytes = sum([rec_bytes[ri] for ri in ris])
            t = _NEW(Task)  # = Task(tid, g_, srcs_t, mesh_t, assigns, src_bytes, src_bytes + out_bytes, ())
            t0(t, tid)
            t1(t, g_)
            t2(t, srcs_t)
            t3(t, mesh_t)
            t4(t, assigns)
            t5(t, src_bytes)
            t6(t, src_bytes + out_bytes)
            t7(t, ())
            per_rank[r].append(t)
        if len(mine) < len(mesh):  # ranks with nothing to send share one Task (it is frozen); appended in C
            idle = _task(tid, g_, srcs_t, mesh_t, (), src_bytes, src_bytes, ())
            deque(map(list.append, map(per_rank.__getitem__, filterfalse(mine.__contains__, mesh)), repeat(idle)), maxlen=0)

    n_groups = len(set(gid.values()))
    rank_plans = {r: RankPlan(r, tuple(ts), tuple(sorted(set(map(_GROUP, ts)))), n_groups) for r, ts in per_rank.items()}
    return Schedule(rank_plans, dict(send), dict(recv), len(task_defs), len(set(gid.values())))
