"""Which training rank holds which rows: the input of shard-local prepare (:mod:`.local`).

At Kimi-K2 scale 256 ranks publish 2.4 million :class:`~weight_transfer.types.ParamMeta` records, 2.2
million of them expert shards. :func:`row_owners` reads their first-row offsets and sizes
with C-level passes per rank (``map`` over ``attrgetter`` / ``itemgetter``) instead of a
Python loop over the records, and shares one owner list between the names whose shards sit
on the same rows of the same ranks (thousands of experts of one shape): a name's *owner key*
says which list it has, so :func:`weight_transfer.plan.local.localize_group` decides once per key
(and shape) where it used to compare 32-entry tuples per recipe.

Ranks publishing the same names in the same order share a :class:`~.sources._NameSequence`
(eight at Kimi-K2 scale, one per expert column); per sequence, ``zip`` turns the ranks'
lists of first rows, row counts and zero-dim flags into one tuple per name, and a dict of
those tuples gives the distinct row patterns. Only names in ``names`` whose placements cut dim 0 alone (``Shard(0)``
/ ``Replicate``: a shard is a row range) get owners.
"""
from __future__ import annotations

from collections import defaultdict
from itertools import count, repeat
from operator import attrgetter, contains, itemgetter

from ..types import ParamMeta
from .sources import _SourceIndex

__all__ = ["row_owners", "ROW_PLACEMENTS"]

ROW_PLACEMENTS = frozenset({"Shard(dim=0)", "Replicate()"})
_LOFF, _LSHAPE, _FIRST = attrgetter("local_offset"), attrgetter("local_shape"), itemgetter(0)


def _first(tuples: list[tuple]) -> list[int]:
    """First element of each tuple (0 for an empty one: a 0-d parameter), in C."""
    try:
        return list(map(_FIRST, tuples))
    except IndexError:
        return list(map(next, map(iter, tuples), repeat(0)))


def row_owners(ix: _SourceIndex, names: set[str]) -> tuple[dict[str, list[tuple[int, int, int]]], dict[str, tuple]]:
    """``(owners, keys)`` for the parameters in ``names`` whose placements only cut dim 0 (and
    whose global shape has a dim): ``owners[name]`` = ``[(first row, end row, rank)]`` of its
    shards with elements, ranks ascending (the same list object for names of one key);
    ``keys[name]``: hashable, equal for two names only when their owner lists are equal.
    ``ix``: :func:`~.sources._index_sources`'s index (its sequences say which ranks publish
    which names at which positions). Equal to reading every record's ``local_offset[0]``,
    ``local_shape[0]`` and ``all(local_shape)`` one by one."""
    first, views, seq_of = ix
    rows_only: dict[tuple, bool] = {}  # placements -> whether they cut dim 0 alone
    ok = set()
    for n in names:
        m = first.get(n)
        if m is None or not m.global_shape:
            continue
        r = rows_only.get(m.placements)
        if r is None:
            r = rows_only[m.placements] = set(m.placements) <= ROW_PLACEMENTS
        if r:
            ok.add(n)
    seq_ranks: dict[int, list[int]] = defaultdict(list)
    seqs = {}
    for r in sorted(views):
        s = seq_of[r]
        seqs[id(s)] = s
        seq_ranks[id(s)].append(r)
    name_key: dict[str, list] = defaultdict(list)
    pattern_rows: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (seq no., pattern) -> [(rank, a, b)]
    for si, (sid, seq) in enumerate(seqs.items()):
        ranks = seq_ranks[sid]
        at = [(n, i) for n, i in seq.position.items() if n in ok]
        if not at:
            continue
        pick = None if len(at) == len(seq.names) else itemgetter(*[i for _, i in at])
        cols = []
        for r in ranks:
            ms: list[ParamMeta] = views[r][1]
            shapes = list(map(_LSHAPE, ms))
            c = (_first(list(map(_LOFF, ms))), _first(shapes), list(map(contains, shapes, repeat(0))))
            if pick is not None:
                c = tuple(x if isinstance(x, tuple) else (x,) for x in map(pick, c))
            cols += c
        patterns: dict[tuple, int] = {}
        ids = list(map(patterns.setdefault, zip(*cols), count()))  # per name of ``at``, its row pattern's number
        for row, p in patterns.items():
            pattern_rows[(si, p)] = [(r, row[3 * k], row[3 * k] + row[3 * k + 1]) for k, r in enumerate(ranks)
                                     if row[3 * k + 1] > 0 and not row[3 * k + 2]]
        for (n, _), p in zip(at, ids):
            name_key[n].append((si, p))
    owners: dict[str, list[tuple[int, int, int]]] = {}
    keys: dict[str, tuple] = {}
    by_key: dict[tuple, list[tuple[int, int, int]]] = {}
    for n in first:  # the index's order (ranks ascending, each rank's order), as reading the records
        k = name_key.get(n)
        if k is None:
            continue
        k = keys[n] = tuple(k)
        own = by_key.get(k)
        if own is None:
            rows = sorted(x for sp in k for x in pattern_rows[sp])
            own = by_key[k] = [(a, b, r) for r, a, b in rows]
        if own:
            owners[n] = own
    return owners, keys


def local_offset(ix: _SourceIndex, name: str, rank: int) -> int:
    """First row of ``rank``'s shard of ``name`` (its ``local_offset[0]``)."""
    pos, ms = ix.views[rank]
    return ms[pos[name]].local_offset[0]
