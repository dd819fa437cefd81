"""A fast screen in front of :func:`weight_transfer.plan.checks.validate`'s exhaustive pass.

:func:`screen` returns True only when the exhaustive pass (``_validate_all``) would find no
problem; False (or a problem the screen does not take apart) sends the caller to that pass,
which names every problem as before. The screen decides nothing else: every refusal, its
wording and its order come from the exhaustive pass, whose checks stay as they were.

Why it is cheaper. At Kimi-K2 scale 46,813 recipes write 93,259 outputs into 171,392
destination tensors, and nearly all are alike: the 69,975 expert tensors differ in names and
offsets only. So

- a recipe's *structure* -- shape, dtypes, transform, every piece's source and destination
  slice and its source's (shape, dtype), the outputs' dtypes, layouts and box shapes -- is
  checked once per distinct structure, by the exhaustive per-recipe check itself
  (``_check_recipe``), and remembered under a key of those values (boxes and shapes by
  object identity: the recipe builder shares them; equal but distinct objects only cost a
  second check). What differs per recipe is checked per recipe: that every source exists (a
  name lookup), which sources and which slices of them are read (C2), and each output box's
  shape against the structure's (vectorized below);
- every output box is checked against its destination and turned into a flat element range
  with numpy (in bounds, flat-contiguous, the structure's box shape), and the exact cover of
  every destination tensor (every element written exactly once) is one sort of those ranges
  by (destination, start) and a comparison of each range's start with its predecessor's
  stop, instead of a Python loop over boxes;
- a destination tensor is compared once per (tensor, rank set) group: every rank of the
  group must hold it with the same shape and dtype, and a tensor's groups must have disjoint
  rank sets (so each destination tensor is written by exactly one group, whose cover is then
  its cover). Anything else -- ranks that differ, overlapping rank sets, an untouched
  destination -- is left to the exhaustive pass, which handles every case.

The structure check is the exhaustive one, applied to the first recipe of each structure; the
per-recipe part reads every recipe, piece, output and destination. A test mutates one expert
among many (a shifted box, a wrong slice, a source of another shape or dtype, a destination of
another shape) and asserts the screen says False (tests/plan/test_screen.py).
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import chain

import numpy as np

from ..types import DestTensorMeta, Recipe, box_shape, numel


def screen(recipes: Sequence[Recipe], ignored: Collection[str], srcs: Mapping[str, tuple[tuple[int, ...], str]],
           dests: Mapping[tuple[int, str], DestTensorMeta], recipe_ok: Callable[[Recipe], bool]) -> bool:
    """True when ``recipes`` pass every check of ``validate`` against ``srcs`` (name ->
    ``(shape, dtype)``) and ``dests`` ((rank, name) -> meta), ``ignored`` naming the sources
    left unused on purpose; False when the exhaustive pass must look (a problem, or a case
    the screen does not take apart). ``recipe_ok(r)``: the exhaustive per-recipe check, whose
    sources all exist, as a bool. Raises nothing for bad input."""
    get = srcs.get
    kinds: dict[tuple, tuple[tuple[int, ...], tuple[bool, ...]]] = {}  # structure -> (box shape ids, full-read flags)
    shape_id: dict[tuple[int, ...], int] = {}  # expected output box shape -> id
    used: set[str] = set()
    full_read: set[str] = set()
    extent: dict[str, list[list[int]]] = {}  # sources read in slices only: bounding box so far
    gid_of: dict[tuple[str, tuple[int, ...]], int] = {}
    g_shape: list[tuple[int, ...]] = []
    g_dtype: list[str] = []
    g_ranks: dict[str, list[tuple[int, ...]]] = {}  # tensor -> rank sets of its groups
    boxes: list = []
    row_g: list[int] = []
    row_e: list[int] = []
    for r in recipes:
        pcs = r.pieces
        outs = r.outputs
        key = [r.shape, r.assembled_dtype, r.transform, len(pcs)]
        for pc in pcs:
            src = pc.source
            if src is None:
                key += (None, pc.src_box, pc.dst_box)
            else:
                m = get(src)
                if m is None:
                    return False
                key += (m, pc.src_box, pc.dst_box)
        for o in outs:
            key += (o.dtype, o.layout)
        key = tuple(key)
        kind = kinds.get(key)
        if kind is None:
            if not outs or not recipe_ok(r):
                return False
            exp = []
            for o in outs:
                s = box_shape(o.box)
                exp.append(shape_id.setdefault(s, len(shape_id)))
            full = tuple(pc.source is None or pc.src_box == tuple((0, n) for n in get(pc.source)[0]) for pc in pcs)
            kind = kinds[key] = (tuple(exp), full)
        exp, full = kind
        for pc, f in zip(pcs, full):
            src = pc.source
            if src is None:
                continue
            used.add(src)
            if f:
                full_read.add(src)
                continue
            ext = extent.get(src)
            if ext is None:
                extent[src] = [list(x) for x in pc.src_box]
            else:
                for e, (a, b) in zip(ext, pc.src_box):
                    if a < e[0]:
                        e[0] = a
                    if b > e[1]:
                        e[1] = b
        ranks = r.ranks
        for o, e in zip(outs, exp):
            t = o.tensor
            g = gid_of.get((t, ranks))
            if g is None:
                g = _new_group(t, ranks, dests, g_shape, g_dtype, g_ranks)
                if g < 0:
                    return False
                gid_of[(t, ranks)] = g
            if o.dtype != g_dtype[g]:
                return False
            if o.layout != "identity":
                ds = g_shape[g]
                if len(ds) < 2 or tuple(o.box[-2:]) != ((0, ds[-2]), (0, ds[-1])):
                    return False
            boxes.append(o.box)
            row_g.append(g)
            row_e.append(e)

    # sources: every one read (or ignored), every one read whole or in slices that reach its extent
    if len(used) != len(srcs) and not all(s in ignored for s in srcs.keys() - used):
        return False
    for s, ext in extent.items():
        if s not in full_read and any(e != [0, n] for e, n in zip(ext, get(s)[0])):
            return False
    # destinations: a tensor's groups on disjoint ranks, and every non-empty destination written
    touched = 0
    for rks in g_ranks.values():
        n = sum(map(len, rks))
        if len(rks) > 1 and len(set().union(*rks)) != n:
            return False
        touched += n
    if touched != len(dests):
        hit = {(rk, t) for t, rks in g_ranks.items() for rr in rks for rk in rr}
        if any(numel(d.shape) for k, d in dests.items() if k not in hit):
            return False
    return _cover(boxes, np.array(row_g, dtype=np.int64), np.array(row_e, dtype=np.int64), list(shape_id), g_shape)


def _new_group(tensor: str, ranks: tuple[int, ...], dests, g_shape: list, g_dtype: list, g_ranks: dict) -> int:
    """Register group (tensor, ranks): its id, or -1 when a rank lacks the tensor, holds it with
    another shape or dtype than the group's first rank, or the rank set is empty or repeats."""
    if not ranks or len(set(ranks)) != len(ranks):
        return -1
    get = dests.get
    d = get((ranks[0], tensor))
    if d is None:
        return -1
    shape, dtype = tuple(d.shape), d.dtype
    for rk in ranks[1:]:
        d = get((rk, tensor))
        if d is None or d.dtype != dtype or tuple(d.shape) != shape:
            return -1
    g_shape.append(shape)
    g_dtype.append(dtype)
    g_ranks.setdefault(tensor, []).append(ranks)
    return len(g_shape) - 1


def _table(shapes: list[tuple[int, ...]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(ndim per shape, shapes right-aligned in a [len, width] int64 array, padded with 1)."""
    nd = np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes))
    tab = np.ones((len(shapes), width), dtype=np.int64)
    for i, s in enumerate(shapes):
        if s:
            tab[i, width - len(s):] = s
    return nd, tab


def _cover(boxes: list, row_g: np.ndarray, row_e: np.ndarray, exp_shapes: list, g_shape: list) -> bool:
    """Every output box (row ``i``: ``boxes[i]`` into group ``row_g[i]``, expected box shape
    ``exp_shapes[row_e[i]]``) has the expected shape, lies inside the group's destination shape
    and is flat-contiguous there (as :func:`weight_transfer.types.box_flat_range` requires), and the
    boxes' flat ranges tile each group's destination exactly: every element written once."""
    n_rows = len(boxes)
    if not n_rows:
        return all(numel(s) == 0 for s in g_shape)
    width = max(max(map(len, exp_shapes)), max(map(len, g_shape)), 1)
    e_nd, e_tab = _table(exp_shapes, width)
    g_nd, g_tab = _table(g_shape, width)
    nd = e_nd[row_e]
    lens = np.fromiter(map(len, boxes), dtype=np.int64, count=n_rows)
    if not (np.array_equal(lens, nd) and np.array_equal(g_nd[row_g], nd)):
        return False
    n_dims = int(lens.sum())
    pairs = np.fromiter(map(len, chain.from_iterable(boxes)), dtype=np.int64, count=n_dims)
    if not (pairs == 2).all():
        return False
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(boxes)), dtype=np.int64, count=2 * n_dims)
    offsets = np.zeros(n_rows, dtype=np.int64)
    np.cumsum(2 * lens[:-1], out=offsets[1:])
    start = np.empty(n_rows, dtype=np.int64)
    count = np.empty(n_rows, dtype=np.int64)
    for k in np.unique(nd).tolist():
        rows = np.flatnonzero(nd == k)
        if k == 0:  # a 0-dim box: one element at 0
            start[rows], count[rows] = 0, 1
            continue
        x = flat[offsets[rows][:, None] + np.arange(2 * k)].reshape(-1, k, 2)
        a, b = x[:, :, 0], x[:, :, 1]
        s = g_tab[row_g[rows], width - k:]
        ext = b - a
        if not ((ext == e_tab[row_e[rows], width - k:]).all() and (a >= 0).all() and (ext >= 0).all() and (b <= s).all()):
            return False
        # flat-contiguous: a dimension that is cut forces extent 1 on every dimension outside it
        cut = ~((a == 0) & (b == s))
        cut_inside = np.zeros_like(cut)
        cut_inside[:, :-1] = np.logical_or.accumulate(cut[:, :0:-1], axis=1)[:, ::-1]
        cnt = ext.prod(axis=1)
        if ((cut_inside & (ext != 1)).any(axis=1) & (cnt > 0)).any():
            return False
        stride = np.ones_like(s)
        stride[:, :-1] = np.cumprod(s[:, :0:-1], axis=1)[:, ::-1]
        start[rows] = (a * stride).sum(axis=1)
        count[rows] = cnt
    keep = count > 0
    g, a = row_g[keep], start[keep]
    b = a + count[keep]
    order = np.lexsort((a, g))
    g, a, b = g[order], a[order], b[order]
    n_of = np.fromiter(map(numel, g_shape), dtype=np.int64, count=len(g_shape))
    first = np.ones(len(g), dtype=bool)
    first[1:] = g[1:] != g[:-1]
    last = np.ones(len(g), dtype=bool)
    last[:-1] = first[1:]
    if not ((a[first] == 0).all() and (a[~first] == b[np.flatnonzero(~first) - 1]).all()
            and (b[last] == n_of[g[last]]).all()):
        return False
    written = np.zeros(len(g_shape), dtype=bool)
    written[g] = True
    return bool((n_of[~written] == 0).all())
