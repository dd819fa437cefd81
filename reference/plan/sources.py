"""The training metadata indexed by name, and its consistency check.

Every training rank publishes one :class:`~weight_transfer.types.ParamMeta` per parameter it holds
(2.4 million records from 256 ranks at Kimi-K2 scale). :func:`_index_sources` indexes them by
name (the schedule reads the index: one meta per name, each rank's positions);
:func:`_check_sources` checks them (every rank of a parameter's mesh published it, identically;
the shards tile it). The check is part of :mod:`weight_transfer.plan.checks` (which runs it, in-process
or in a forked child); it lives here beside the index whose layout it reads.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import filterfalse
from operator import attrgetter
from typing import NamedTuple

import numpy as np

from ..types import ParamMeta, PlanError, numel

_NAME, _MESH, _LSHAPE = attrgetter("name"), attrgetter("mesh_ranks"), attrgetter("local_shape")
_RECORD = attrgetter("name", "global_shape", "dtype", "placements", "mesh_ranks")
"""What every rank of a parameter's mesh must publish identically (``local_*`` differ per rank)."""
_COLUMNS = (attrgetter("global_shape"), attrgetter("dtype"), attrgetter("placements"), _MESH)
"""The fields :meth:`_NameSequence.agrees` compares besides the name, the mesh last."""


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
    columns: list[list] = field(default_factory=list)
    """per field of :data:`_COLUMNS` (global shape, dtype, placements, mesh), ``ref``'s values
    in order; filled by :meth:`prepare` (the checks' part, which may run in another process)"""
    mesh_reps: list[tuple[int, tuple]] = field(default_factory=list)
    """(id, mesh) of one object per distinct mesh value in ``ref``"""
    mesh_at: list[int] = field(default_factory=list)
    """per position, the id in ``mesh_reps`` of ref's mesh value"""

    def prepare(self) -> None:
        """Derive what :meth:`agrees` compares against (once per sequence)."""
        if self.columns or not self.ref:
            return
        self.columns = [list(map(get, self.ref)) for get in _COLUMNS]
        meshes = self.columns[-1]
        self.meshes = dict(zip(map(id, meshes), self.ref))
        rep_of: dict[int, int] = {}
        for k, m in dict(zip(map(id, meshes), meshes)).items():
            rep_of[k] = next((rk for rk, rm in self.mesh_reps if rm == m), k)
            if rep_of[k] == k:
                self.mesh_reps.append((k, m))
        self.mesh_at = list(map(rep_of.__getitem__, map(id, meshes)))

    def agrees(self, ms: list[ParamMeta]) -> bool:
        """Whether every record of ``ms`` equals the first publisher's in name, global shape,
        dtype, placements and mesh. One C pass per field: a list of the field's values compared
        with ``ref``'s (list equality tries identity first, so shared objects cost nothing; one
        pass per field is cheaper than building a tuple per record). ``ms`` built in this
        process shares the mesh objects. An unpickled rank list holds its own copy of each mesh
        (one per distinct mesh, pickle's memo): its few distinct mesh objects are compared by
        value once, then positions by id -- comparing a 256-rank mesh per record would cost
        more than everything else."""
        self.prepare()
        if len(ms) != len(self.ref):
            return False
        if not ms:
            return True
        if list(map(_NAME, ms)) != self.names:
            return False
        for get, want in zip(_COLUMNS[:-1], self.columns):
            if list(map(get, ms)) != want:
                return False
        meshes = list(map(_MESH, ms))
        if ms[0].mesh_ranks is self.ref[0].mesh_ranks:
            return meshes == self.columns[-1]
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

    Every record is read: a rank is checked with one C pass per field (name, shape, dtype,
    placements, mesh) against its sequence's first publishers' (:meth:`_NameSequence.agrees`;
    list equality tries identity first, so shared objects cost nothing; an unpickled rank list
    holds its own copies, compared by value). The shard sizes are summed per name with numpy;
    a rank whose list of shard shapes equals an earlier rank's of the same sequence (one list
    comparison) reuses that rank's element counts. Records are visited one by one in Python
    only to name them in an error.

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
    variants: dict[int, list[list]] = {}  # id(sequence) -> [shard shapes, their numels, ranks more than once]
    seq_index = {id(s): s.index for s in seq_of.values()}
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
        shapes = list(map(_LSHAPE, ms))
        seen = variants.setdefault(id(seq), [])
        v = next((v for v in seen if v[0] == shapes), None)  # most ranks of a sequence hold equal shard shapes
        if v is None:
            v = [shapes, np.fromiter(map(math.prod, shapes), dtype=np.int64, count=len(ms)), 0]
            if len(seen) < _SHAPE_VARIANTS:
                seen.append(v)
            idx_parts.append(seq.index)
            numel_parts.append(v[1])
        else:
            v[2] += 1
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
    for sid, seen in variants.items():
        for _, n_of, more in seen:
            if more:
                idx_parts.append(seq_index[sid])
                numel_parts.append(n_of * more)
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


_SHAPE_VARIANTS = 4
"""Distinct shard-shape lists remembered per name sequence (even sharding has one per
sequence, uneven a few: the last ranks' shards are smaller or empty)."""


class _IndexUnconfirmed(Exception):
    """A rank's names differ from those of the sequence its sampled names matched (raised by
    the checks, in-process or forked; :func:`plan` then indexes exactly and checks again)."""
