"""Every check a plan passes before it is returned, in one place: the recipes against both
sides (:func:`validate`), the training metadata's consistency (:func:`_check_sources`, from
:mod:`.sources`), and the machinery that runs them in a forked child process while the
schedule is built (:class:`_ForkedChecks`).

:func:`validate` refuses, before any byte moves and naming the tensors: a destination byte
written by no recipe or twice, a source the training side lacks (C3), a training tensor no
recipe reads (C2), an unplanned cast (C8), malformed recipes. :func:`_check_sources` refuses
training ranks that disagree on a parameter (shape, dtype, mesh, placements), ranks of a mesh
that did not publish a parameter, and shards that do not tile it. Both raise
:class:`~weight_transfer.types.PlanError`.

:func:`validate` runs a fast screen first (:mod:`.screen`: each distinct recipe structure
checked once, what differs per recipe per recipe, the exact cover with numpy) and its
exhaustive pass only when the screen cannot vouch for the set; every refusal and its wording
come from the exhaustive pass.
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from collections.abc import Mapping
from functools import partial
from typing import Any

from ..convert.layouts import check_layout, layout_box_ok, layout_row_block
from ..convert.quant import scale_shape
from ..types import Box, DestTensorMeta, Output, ParamMeta, PlanError, Recipe, box_flat_range, box_shape, numel
from .recipes import RecipeSet
from .screen import screen
from .sources import _check_sources, _index_sources, _IndexUnconfirmed, _SourceIndex  # noqa: F401 (re-exported)

CASTABLE_FLOAT = frozenset({"bfloat16", "float16", "float32"})
"""Dtypes a planned cast may read from or write to (``.to(dtype)``, round to nearest even)."""
FP8 = "float8_e4m3fn"
F32 = "float32"
BF16 = "bfloat16"


# ============================================================================================
# the recipes against both sides


_MAX_LISTED = 20


class _Problems:
    def __init__(self):
        self.kinds: Counter[str] = Counter()
        self.lines: list[str] = []

    def add(self, kind: str, msg: str):
        self.kinds[kind] += 1
        if len(self.lines) < _MAX_LISTED:
            self.lines.append(msg)

    def raise_if_any(self, what: str):
        n = sum(self.kinds.values())
        if not n:
            return
        kinds = ", ".join(f"{c} {k}" for k, c in self.kinds.most_common())
        body = "\n".join(f"  - {m}" for m in self.lines)
        more = f"\n  ... and {n - len(self.lines)} more" if n > len(self.lines) else ""
        raise PlanError(f"weight plan refused for {what}: {n} problem(s) ({kinds})\n{body}{more}")


def _src_meta(v: Any) -> tuple[tuple[int, ...], str]:
    """Accept ``(shape, dtype)``, a ParamSpec (``.shape``) or a ParamMeta (``.global_shape``)."""
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], str):
        return tuple(v[0]), v[1]
    shape = getattr(v, "global_shape", None) or v.shape
    return tuple(shape), v.dtype


def _in_bounds(box: Box, shape: tuple[int, ...]) -> bool:
    if len(box) != len(shape):
        return False
    for (a, b), s in zip(box, shape):
        if not (0 <= a <= b <= s):
            return False
    return True


def _numel_inside(box: Box, shape: tuple[int, ...]) -> int:
    """Elements of ``box``, or -1 when it is not inside ``shape`` (:func:`_in_bounds` and the
    element count in one pass: every piece of 51k recipes at Kimi-K2 scale)."""
    if len(box) != len(shape):
        return -1
    n = 1
    for (a, b), s in zip(box, shape):
        if not (0 <= a <= b <= s):
            return -1
        n *= b - a
    return n


def _compatible(src_box: Box, dst_box: Box) -> bool:
    """A piece's source slice fills its dst box: equal shapes, or the dst box has extra leading
    dims of extent 1 (a 2-D expert matrix into slot ``[j:j+1]`` of a 3-D slab)."""
    k = len(dst_box) - len(src_box)
    if k < 0:
        return False
    for a, b in dst_box[:k]:
        if b - a != 1:
            return False
    for (a, b), (c, d) in zip(src_box, dst_box[k:]):
        if b - a != d - c:
            return False
    return True


def _boxes_overlap(a: Box, b: Box) -> bool:
    for (a0, a1), (b0, b1) in zip(a, b):
        if max(a0, b0) >= min(a1, b1):
            return False
    return True


def _check_recipe(r: Recipe, sources, probs: _Problems, missing: dict[str, list[str]], used: set, extent: dict):
    name = r.name
    shape = r.shape
    ranks = r.ranks
    if not ranks:
        probs.add("bad-recipe", f"recipe {name!r} has no destination ranks")
    elif len(ranks) > 1 and len(set(ranks)) != len(ranks):
        probs.add("bad-recipe", f"recipe {name!r} lists a rank twice: {ranks}")
    adt = r.assembled_dtype
    if adt not in CASTABLE_FLOAT:
        probs.add("dtype", f"recipe {name!r}: assembled dtype {adt} is not a float dtype a cast can produce")
    outs = r.outputs
    tr = r.transform
    for o in outs:
        if o.layout != "identity":
            try:
                check_layout(o.layout, box_shape(o.box), f"recipe {name!r} output {o.tensor!r}")
            except ValueError as e:
                probs.add("layout", str(e))
    if tr == "copy":
        if len(outs) != 1:
            probs.add("bad-recipe", f"copy recipe {name!r} has {len(outs)} outputs (needs 1)")
        for o in outs:
            if o.dtype not in CASTABLE_FLOAT:
                probs.add(
                    "dtype",
                    f"copy recipe {name!r} would cast {adt} into {o.dtype} tensor {o.tensor!r}: "
                    f"refused, a {o.dtype} destination needs the fp8_block transform (with its scales)",
                )
    elif tr == "fp8_block":
        if len(outs) != 2:
            probs.add("bad-recipe", f"fp8_block recipe {name!r} has {len(outs)} outputs (needs weight, weight_scale_inv)")
        else:
            w, sc = outs
            if adt != BF16:
                probs.add("dtype", f"fp8_block recipe {name!r} must quantize the served BF16 tensor, assembles {adt}")
            if w.dtype != FP8 or sc.dtype != F32:
                probs.add("dtype", f"fp8_block recipe {name!r}: outputs {w.tensor!r} {w.dtype} / {sc.tensor!r} {sc.dtype}, need {FP8} / {F32}")
            if len(shape) >= 2:
                want = scale_shape(shape)
                if box_shape(sc.box) != want:
                    probs.add("shape", f"fp8_block recipe {name!r}: scale box {sc.box} of {sc.tensor!r} has shape {box_shape(sc.box)}, need {want}")
            else:
                probs.add("shape", f"fp8_block recipe {name!r}: shape {shape} has < 2 dims")
    elif tr in ("fp8_tensor", "fp8_channel"):
        if len(outs) != 2:
            probs.add("bad-recipe", f"{tr} recipe {name!r} has {len(outs)} outputs (needs weight, weight_scale)")
        else:
            w, sc = outs
            ws = box_shape(w.box)
            if adt != BF16 or w.dtype != FP8 or sc.dtype != F32:
                probs.add("dtype", f"{tr} recipe {name!r}: assembles {adt} into {w.dtype} / {sc.dtype}, need {BF16} "
                                   f"into {FP8} / {F32}")
            if len(shape) != 2 or len(ws) != 2 or any(e > n for e, n in zip(ws, shape)):
                probs.add("shape", f"{tr} recipe {name!r}: weight box {w.box} is not a corner of its 2-D assembled "
                                   f"shape {shape}")
            elif numel(box_shape(sc.box)) != (1 if tr == "fp8_tensor" else ws[0]) or (
                    tr == "fp8_channel" and ws[0] != shape[0]):
                probs.add("shape", f"{tr} recipe {name!r}: scale box {sc.box} does not hold its weight's "
                                   f"{'one scale' if tr == 'fp8_tensor' else f'{ws[0]} row scales'}")
    else:
        probs.add("bad-recipe", f"recipe {name!r}: unknown transform {tr!r}")
    if outs and tr not in ("fp8_tensor", "fp8_channel") and box_shape(outs[0].box) != tuple(shape):
        probs.add("shape", f"recipe {name!r}: output box {outs[0].box} of {outs[0].tensor!r} does not have the assembled shape {shape}")
    # pieces
    total = numel(shape)
    covered = 0
    pieces = r.pieces
    for pc in pieces:
        dbox = pc.dst_box
        k = _numel_inside(dbox, shape)
        if k < 0:
            probs.add("shape", f"recipe {name!r}: piece of {pc.source!r} dst box {dbox} outside assembled shape {shape}")
            continue
        covered += k
        src = pc.source
        if src is None:
            if pc.src_box != ():
                probs.add("bad-recipe", f"recipe {name!r}: zero piece with a source box {pc.src_box}")
            continue
        used.add(src)
        meta = sources.get(src)
        if meta is None:
            missing.setdefault(src, []).append(name)
            continue
        sshape, sdt = meta
        if sdt not in CASTABLE_FLOAT:
            probs.add(
                "dtype",
                f"source {src!r} has dtype {sdt}, which recipe {name!r} cannot cast to {adt} "
                f"(only {', '.join(sorted(CASTABLE_FLOAT))} sources are cast as planned)",
            )
        sb = pc.src_box
        ext = extent.get(src)
        if ext is None:
            extent[src] = [list(x) for x in sb]
        elif len(ext) == len(sb):
            for e, (a, b) in zip(ext, sb):
                if a < e[0]:
                    e[0] = a
                if b > e[1]:
                    e[1] = b
        if not _in_bounds(sb, sshape):
            probs.add("shape", f"recipe {name!r}: slice {pc.src_box} of source {src!r} is outside its shape {sshape}")
        elif not _compatible(pc.src_box, dbox):
            probs.add("shape", f"recipe {name!r}: slice {pc.src_box} of {src!r} does not fit dst box {dbox}")
    n = len(pieces)
    overlap = False
    for i in range(n - 1):
        bi = pieces[i].dst_box
        for j in range(i + 1, n):
            if _boxes_overlap(bi, pieces[j].dst_box):
                overlap = True
                probs.add("cover", f"recipe {name!r}: pieces of {pieces[i].source!r} and {pieces[j].source!r} overlap in the assembled tensor")
    if not overlap and covered != total:
        probs.add("cover", f"recipe {name!r}: pieces cover {covered} of {total} elements of the assembled shape {shape}")


def _check_cover(iv: list[tuple[int, int, str]], n: int, where: str, probs: _Problems):
    """``iv`` sorted (start, stop, recipe) flat ranges must tile ``[0, n)`` exactly."""
    pos = 0
    for a, b, who in iv:
        if a == b:
            continue
        if a > pos:
            probs.add("gap", f"destination {where}: elements [{pos}, {a}) written by no recipe")
        elif a < pos:
            probs.add("overlap", f"destination {where}: elements [{a}, {min(b, pos)}) written twice (again by {who!r})")
        if b > pos:
            pos = b
    if pos < n:
        probs.add("gap", f"destination {where}: elements [{pos}, {n}) written by no recipe")


def validate(
    recipeset: RecipeSet,
    sources: Mapping[str, Any],
    dests: Mapping[tuple[int, str], DestTensorMeta],
) -> None:
    """Check a recipe set against the training side's tensors and the inference side's
    parameters, before any byte moves. Raises :class:`PlanError` listing every problem found
    (the first 20), each naming its tensors:

    - a destination tensor that no recipe writes, or whose bytes are written twice or partly
      (exact cover per (rank, tensor), from the outputs' flat element ranges);
    - an output whose dtype differs from the destination's, or whose box is outside the
      destination's shape or not one contiguous range; an output to a tensor the rank lacks;
    - a source the training side lacks ("training side lacks parameter X needed by ...", C3);
    - a training tensor no recipe reads and not in ``recipeset.ignored`` (C2), or one whose
      extent the recipes do not reach (e.g. a larger vocabulary than the model config's);
    - a piece slice outside its source, pieces not covering the assembled tensor exactly once;
    - a cast that is not planned (C8): sources must be bf16/fp16/fp32 (cast to the assembled
      dtype), and a float8 destination can only be produced by ``fp8_block``, never a copy.

    ``sources`` maps name -> ``(shape, dtype)`` (or a ParamSpec / ParamMeta); ``dests`` maps
    ``(rank, name)`` -> :class:`DestTensorMeta`.

    Cost is linear in recipes + outputs + destination tensors. A fast screen goes first
    (:func:`weight_transfer.plan.screen.screen`: each distinct recipe structure checked once,
    per-recipe names and offsets per recipe, the exact cover with numpy); when it cannot vouch
    for the set, the exhaustive pass (``_validate_all``) finds and names every problem. The
    screen only ever says "no problem" where the exhaustive pass would; it never refuses.
    """
    _validate(recipeset, {k: _src_meta(v) for k, v in sources.items()}, dests)


def _validate(recipeset: RecipeSet, srcs: Mapping[str, tuple[tuple[int, ...], str]],
              dests: Mapping[tuple[int, str], DestTensorMeta]) -> None:
    """:func:`validate` with ``srcs`` already name -> ``(shape, dtype)``."""
    if screen(recipeset.recipes, recipeset.ignored, srcs, dests, partial(_recipe_ok, srcs=srcs)):
        return
    _validate_all(recipeset, srcs, dests)


def _recipe_ok(r: Recipe, srcs: Mapping[str, tuple[tuple[int, ...], str]]) -> bool:
    """Whether :func:`_check_recipe` finds no problem in ``r`` (whose sources ``srcs`` has)."""
    probs = _Problems()
    _check_recipe(r, srcs, probs, {}, set(), {})
    return not probs.kinds


def _validate_all(recipeset: RecipeSet, srcs: Mapping[str, tuple[tuple[int, ...], str]],
                  dests: Mapping[tuple[int, str], DestTensorMeta]) -> None:
    """:func:`validate`'s exhaustive pass: every check on every recipe, output and destination,
    every problem collected; raises PlanError listing them (the first 20). Outputs are grouped
    by (tensor, rank set) first, so DP replicas and TP-replicated tensors are checked once."""
    probs = _Problems()
    missing: dict[str, list[str]] = {}
    used: set[str] = set()
    extent: dict[str, list[list[int]]] = {}  # source -> bounding box of the slices read

    # 1. recipes on their own; outputs grouped by (tensor, rank set)
    groups: dict[tuple[str, tuple[int, ...]], list[tuple[Output, str, str]]] = defaultdict(list)
    for r in recipeset.recipes:
        _check_recipe(r, srcs, probs, missing, used, extent)
        for o in r.outputs:
            groups[(o.tensor, r.ranks)].append((o, r.name, r.transform))

    for s, users in missing.items():
        more = f" (and {len(users) - 1} more recipes)" if len(users) > 1 else ""
        probs.add("missing-source", f"training side lacks parameter {s!r} needed by {users[0]!r}{more}")
    ignored = recipeset.ignored
    for s in srcs:
        if s not in used and s not in ignored:
            probs.add("unused-source", f"training parameter {s!r} is used by no recipe and not declared ignored")

    for s, ext in extent.items():
        sshape = srcs[s][0]
        if len(ext) == len(sshape) and any(e != [0, n] for e, n in zip(ext, sshape)):
            box = tuple(tuple(e) for e in ext)
            probs.add(
                "partly-used-source",
                f"training parameter {s!r} has shape {sshape} but the recipes read only {box} of it "
                f"(shape differs from the model config?)",
            )

    # 2. each group against the destination tensor on each of its ranks
    per_dest: dict[tuple[int, str], list[int]] = defaultdict(list)  # -> group ids
    group_iv: list[list[tuple[int, int, str]]] = []
    group_where: list[str] = []
    for (tensor, ranks), outs in groups.items():
        metas: dict[tuple[tuple[int, ...], str], list[int]] = {}
        for rank in ranks:
            d = dests.get((rank, tensor))
            if d is None:
                probs.add("unknown-dest", f"{outs[0][1]!r} writes {tensor!r} on rank {rank}, which that rank does not have")
                continue
            metas.setdefault((tuple(d.shape), d.dtype), []).append(rank)
        for (dshape, ddt), rks in metas.items():
            iv = []
            for o, rname, tr in outs:
                if o.dtype != ddt:
                    hint = " (a float8 destination needs fp8_block)" if ddt.startswith("float8") and tr == "copy" else ""
                    probs.add("dtype", f"{rname!r} writes {o.dtype} into {tensor!r} ({ddt}) on ranks {rks}{hint}")
                    continue
                try:
                    a, b = box_flat_range(o.box, dshape)
                except ValueError as e:
                    probs.add("shape", f"{rname!r} output to {tensor!r} {dshape} on ranks {rks}: {e}")
                    continue
                if o.layout != "identity" and not layout_box_ok(o.layout, o.box, dshape):
                    probs.add("layout", f"{rname!r} writes part {o.box} of {tensor!r} {dshape} in runtime layout "
                                        f"{o.layout}: a runtime layout is written in whole row blocks of whole "
                                        f"[N, K] rows ({layout_row_block(o.layout) or 'the whole N'} rows)")
                    continue
                iv.append((a, b, rname))
            gid = len(group_iv)
            iv.sort()
            group_iv.append(iv)
            group_where.append(f"{tensor!r} on rank{'s' if len(rks) > 1 else ''} {rks if len(rks) > 1 else rks[0]}")
            for rank in rks:
                per_dest[(rank, tensor)].append(gid)

    # 3. exact cover of every destination tensor
    checked: set[int] = set()
    for key, d in dests.items():
        n = numel(d.shape)
        gids = per_dest.get(key)
        if not gids:
            if n:
                probs.add("uncovered", f"destination {key[1]!r} on rank {key[0]} ({tuple(d.shape)} {d.dtype}) is written by no recipe")
            continue
        if len(gids) == 1:
            g = gids[0]
            if g not in checked:  # identical for every rank of the group
                checked.add(g)
                _check_cover(group_iv[g], n, group_where[g], probs)
            continue
        iv = sorted(x for g in gids for x in group_iv[g])
        _check_cover(iv, n, f"{key[1]!r} on rank {key[0]}", probs)

    what = recipeset.model or "recipe set"
    if recipeset.layout is not None:
        what += f" -> {recipeset.layout.describe()}"
    probs.raise_if_any(what)


# ============================================================================================
# all checks, in-process or in a forked child


PARALLEL_CHECKS_MIN_RECORDS = 200_000
"""``plan(parallel_checks=None)`` checks in a forked child process from this many training
records on (all ranks together; Kimi-K2 256 -> 128 publishes 357k with the DPA + EP32
inference layout, 2.4 million with TP16 and 8-node expert FSDP). Below it forking costs more
than it saves, and small worlds (tests, the demo) keep the plain sequential path. Measured
after the screen (issue 16) on this project's 2-core VM, fresh subprocesses: the DPA + EP32
plan took 11.6-11.8 s forked against 16.0-16.2 s in-process on a quiet machine (the checks
themselves ~0.75 s, and the schedule built after them in-process ~1 s slower); with both
cores saturated by other jobs in-process won (26.2 s against 27.9 s median), and a single
later quiet-ish run too (10.3 s against 11.2 s). The evidence is mixed, so the threshold is
kept where it was before the screen."""


_CHECKS_WAIT_S = 60.0
""":meth:`_ForkedChecks.join` waits this long plus 4x the time the child has had before it
gives up on the child and checks in-process (the checks take ~2 s CPU at Kimi-K2 scale)."""


def _run_checks(recipes: RecipeSet, train_metas: dict[int, list[ParamMeta]], ix: _SourceIndex,
                dests: dict[tuple[int, str], DestTensorMeta], *, confirm_index: bool = False) -> None:
    """Every check :func:`weight_transfer.plan.plan` makes before it returns a schedule; raises PlanError.
    ``confirm_index``: ``ix`` was made with ``exact=False``; raise :class:`_IndexUnconfirmed`
    if it does not hold."""
    _check_sources(train_metas, ix, confirm_index=confirm_index)
    _validate(recipes, {n: (tuple(m.global_shape), m.dtype) for n, m in ix.first.items()}, dests)


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
    except BaseException:  # anything else: the parent checks in-process
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
