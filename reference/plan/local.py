"""Shard-local prepare: which recipes a training rank can make from its own shard.

FSDP2 shards a parameter by rows (``Shard(0)``; ``Replicate`` on an HSDP axis): each rank holds
a row range. A destination tensor's recipe is a concatenation of row bands of sources (fused
``qkv_proj``: ``[q rows; k rows; v rows]``; ``gate_up_proj`` and an expert slot of
``w13_weight``: ``[gate rows; up rows]``; a row-sharded ``o_proj`` / ``w2_weight`` column slice:
rows of one source). Cut where the rows change hands, every band is held whole by one rank,
which makes it from ``to_local()`` with no ``full_tensor()``.

Block FP8 (``"fp8_block"``) quantizes 128 x 128 blocks of the destination. A band whose cuts lie
on 128-row boundaries of the destination holds whole blocks: its rank quantizes them alone and
writes its rows of the weight and of ``weight_scale_inv``, byte-identical to quantizing the
whole tensor (each block's scale depends on that block only). FSDP2's even sharding of a
4096-row weight over 2 to 32 ranks cuts at multiples of 128.

What still needs ``full_tensor()`` (the recipe is gathered whole, as before):

- a quantized recipe whose rows change hands inside a 128-row block (C7's odd head counts);
- a per-tensor FP8 recipe (``"fp8_tensor"``) whose source rows several ranks hold: its scale is the
  whole tensor's (a per-channel one is cut into row bands like a copy: each row's scale is its own);
- a piece whose source rows do not run along the recipe's cut dimension (a transpose, a
  column-sharded placement: ``Shard(1)``), or a source with no row-range shards;
- a recipe smaller than ``min_bytes`` whose rows span several ranks, when cutting it would cost
  more than ``max_writes`` writes (bands x receiving ranks x outputs: a norm over 256 FSDP ranks
  into 128 receivers); with fewer, it is cut, since a ``full_tensor()`` is a barrier of the
  whole mesh whose price is the ranks' skew, not its few KB;
- an output in an engine's runtime layout (:mod:`weight_transfer.convert.layouts`) whose rows change
  hands inside one of the layout's row blocks (16 or 32 rows of vLLM's CPU prepack), or whose
  layout is never cut (``"transposed"``, the MoE router's float32 transpose) and whose rows lie
  on several ranks. A band of whole row blocks is one byte range in the runtime order, so the
  rank holding those rows builds and writes its blocks itself (:func:`~weight_transfer.convert.layouts.layout_box_ok`).

:func:`localize_group` says which of these applies to each gathered recipe (``reasons=``; the
plan's :attr:`~weight_transfer.types.Schedule.gathers`, printed in its summary).

Only the planner calls this (:func:`localize_group`); it is a pure function of the recipes and
the shards' row ranges.
"""
from __future__ import annotations

from ..convert.layouts import has_runtime_layout, recipe_row_block
from ..convert.quant import QUANT_BLOCK
from ..convert.transforms import split_dim, split_recipe_bands
from ..types import Recipe

__all__ = ["localize_group", "localize_recipe"]

Owners = dict[str, list[tuple[int, int, int]]]
"""source name -> [(first row, end row, rank)] of its non-empty shards (dim 0 row ranges)."""


def _holders(piece, owners: Owners, mesh: frozenset[int]) -> frozenset[int] | None:
    """Ranks whose shard holds every source row of ``piece`` (``mesh`` for a zero piece);
    None when the source has no row-range shards (then the piece cannot be made locally)."""
    if piece.source is None:
        return mesh
    own = owners.get(piece.source)
    if own is None or not piece.src_box:
        return None
    sa, sb = piece.src_box[0]
    return frozenset(r for oa, ob, r in own if oa <= sa and sb <= ob)


def _block_dim(rec: Recipe, d: int) -> bool:
    return rec.transform == "fp8_block" and d >= len(rec.shape) - 2


def localize_recipe(rec: Recipe, owners: Owners, mesh: frozenset[int]) -> list[tuple[Recipe, frozenset[int]]] | None:
    """``rec`` cut into bands along :func:`~weight_transfer.convert.transforms.split_dim`, each with the
    non-empty set of ranks holding all its rows; None when some band would need rows of
    several ranks (see the module docstring). Bands are as few as possible: consecutive
    stretches held by a common rank stay one band. Bands of a quantized recipe along a
    quantized dimension start and end on 128-row boundaries (or the tensor's end)."""
    cut = _cut(rec, owners, mesh)
    kind, x = cut
    if kind == "gather":
        return None
    if kind == "whole":
        return [(rec, x)]
    if kind == "slots":
        out = []
        for part in split_recipe_bands(rec, x):
            sub = localize_recipe(part, owners, mesh)
            if sub is None:
                return None
            out += sub
        return out
    parts = split_recipe_bands(rec, [(a, b) for a, b, _ in x])
    return [(part, h) for part, (_, _, h) in zip(parts, x)]


def _cut(rec: Recipe, owners: Owners, mesh: frozenset[int]):
    """Where :func:`localize_recipe` cuts ``rec`` along its split dim: ``("gather", why)``,
    ``("whole", holders)`` (some rank holds all of it), ``("bands", [(first row, end row,
    holders)])``, or ``("slots", [(first row, end row)])`` (cut between expert slots, each part
    localized on its own). A function of what :func:`_shape_key` covers only."""
    hs = []
    for p in rec.pieces:
        h = _holders(p, owners, mesh)
        if h is None:
            return ("gather", "a source without row-range shards (not Shard(0) on its mesh)")
        hs.append(h)
    common = frozenset.intersection(*hs) if hs else mesh
    if common:
        return ("whole", common)
    if rec.transform == "fp8_tensor":
        return ("gather", "FP8 per-tensor: the scale is the whole tensor's, whose rows several ranks hold")
    if not rec.shape:
        return ("gather", "a scalar whose holders differ")
    d = split_dim(rec)
    n = rec.shape[d]
    if n <= 1:
        return ("gather", "one row along its split dim, held by several ranks")
    if rec.transform == "fp8_channel" and d >= len(rec.shape) - 1:
        return ("gather", "FP8 per-channel: a row's scale needs all its columns, which several ranks hold")
    # atomic cuts: piece boundaries along d, and shard boundaries inside a piece's rows
    cuts = {0, n}
    slot_dim = False
    for p in rec.pieces:
        da, db = p.dst_box[d]
        cuts.update((da, db))
        if p.source is None:
            continue
        k = len(p.dst_box) - len(p.src_box)  # leading unit dims of the dst box (expert slot)
        if d < k:
            slot_dim = True  # cutting between slots: each slot is localized on its own
            continue
        if d != k:
            return ("gather", "transpose: the source's rows run along another destination dim")  # the source's rows run along another destination dim (transpose)
        sa, sb = p.src_box[0]
        if sb - sa != db - da:
            return ("gather", "a piece whose source and destination rows differ in length")
        cuts.update(da + x - sa for oa, ob, _ in owners[p.source] for x in (oa, ob) if sa < x < sb)
    atoms = sorted(c for c in cuts if 0 <= c <= n)
    bands = list(zip(atoms, atoms[1:]))
    if slot_dim:
        return ("slots", bands)
    # holders of each atomic band, then merge consecutive atoms while a rank holds them all
    merged: list[tuple[int, int, frozenset[int]]] = []
    for a, b in bands:
        h = mesh
        for p in rec.pieces:
            pa, pb = p.dst_box[d]
            if pa >= b or pb <= a or p.source is None:
                continue
            sa = p.src_box[0][0] + (a - pa)
            sb = p.src_box[0][0] + (b - pa)
            h = h & frozenset(r for oa, ob, r in owners[p.source] if oa <= sa and sb <= ob)
        if not h:
            return ("gather", "a band needs rows of several ranks")
        if merged and merged[-1][2] & h:
            a0, _, h0 = merged[-1]
            merged[-1] = (a0, b, h0 & h)
        else:
            merged.append((a, b, h))
    if _block_dim(rec, d) and any(a % QUANT_BLOCK for a, _, _ in merged):
        return ("gather", "FP8: rows change hands inside a 128-row quantization block")  # rows change hands inside a quantization block: gather
    if has_runtime_layout(rec):
        rb = recipe_row_block(rec)
        if d != len(rec.shape) - 2 or rb == 0 or any(a % rb for a, _, _ in merged):
            return ("gather", _layout_reason(rec, d))  # rows change hands inside a runtime-layout row block (or along K): gather
    return ("bands", merged)


def _shape_key(rec: Recipe, owners: Owners, mesh: frozenset[int], owner_keys: dict) -> tuple:
    """What :func:`localize_recipe`'s verdict depends on: the recipe's shape, transform and
    pieces' boxes, its sources' shards (row ranges and ranks) and the mesh -- not its name,
    receivers or outputs. Thousands of Kimi-K2 experts share one key."""
    pk = []
    for p in rec.pieces:
        if p.source is None:
            pk.append((None, p.dst_box))
            continue
        ok = owner_keys.get(p.source)
        if ok is None:
            own = owners.get(p.source)
            ok = owner_keys[p.source] = () if own is None else tuple(own)
        pk.append((ok, p.src_box, p.dst_box))
    return (rec.shape, rec.transform, tuple(o.layout for o in rec.outputs), mesh, tuple(pk))


def localize_group(group: list[Recipe], owners: Owners, mesh: tuple[int, ...], min_bytes: int = 0,
                   cache: dict | None = None, owner_keys: dict | None = None, reasons: dict | None = None,
                   max_writes: int = 0) -> tuple[list[tuple[Recipe, tuple[int, ...]]], list[Recipe]]:
    """Split a fusion group into (local bands with their candidate senders, recipes to gather).

    Each recipe is localized whole or not at all (:func:`localize_recipe`); a recipe whose
    output is under ``min_bytes`` is localized only when one rank holds all of it (no cut) or
    its cut costs at most ``max_writes`` writes (bands x receiving ranks x outputs).
    Candidate senders are sorted rank tuples. ``cache``: a dict kept across the calls of one
    plan (it must not outlive ``owners``): where a recipe is cut (:func:`_cut`) is decided
    once per :func:`_shape_key` -- thousands of Kimi-K2 experts share one -- and only the
    cutting itself (:func:`~weight_transfer.convert.transforms.split_recipe_bands`) is done per recipe.
    ``owner_keys``: source name -> a key equal for two names only when their ``owners`` lists
    are (:func:`weight_transfer.plan.owners.row_owners` gives one); by default the lists themselves.
    ``reasons`` (optional dict): filled with recipe name -> why it is gathered, for each gathered recipe."""
    ms = frozenset(mesh)
    local, gathered = [], []
    cuts = None
    if cache is not None:
        cuts = cache.setdefault("cuts", {})
        if owner_keys is None:
            owner_keys = cache.setdefault("owner_keys", {})
    for rec in group:
        if cuts is None:
            v = _verdict(rec, owners, ms)
        else:
            key = _shape_key(rec, owners, ms, owner_keys)
            v = cuts.get(key, _UNSEEN)
            if v is _UNSEEN:
                v = cuts[key] = _verdict(rec, owners, ms)
        kind, x, cands = v
        if kind == "gather":
            gathered.append(rec)
            if reasons is not None:
                reasons[rec.name] = x
            continue
        if kind == "whole":
            local.append((rec, cands))
            continue
        if kind == "slots":
            bands = localize_recipe(rec, owners, ms)
            if bands is None or _tiny(rec, len(bands), min_bytes, max_writes):
                gathered.append(rec)
                if reasons is not None:
                    reasons[rec.name] = ("an expert slot whose rows need several ranks" if bands is None else
                                         _tiny_why(min_bytes, max_writes))
            else:
                local.extend((part, tuple(sorted(h))) for part, h in bands)
            continue
        if _tiny(rec, len(x), min_bytes, max_writes):
            gathered.append(rec)
            if reasons is not None:
                reasons[rec.name] = _tiny_why(min_bytes, max_writes)
        else:
            local.extend(zip(split_recipe_bands(rec, x), cands))
    return local, gathered


_UNSEEN = object()


def _tiny(rec: Recipe, bands: int, min_bytes: int, max_writes: int) -> bool:
    """True when ``rec``, cut into ``bands`` row bands, is gathered instead: under ``min_bytes``,
    on several ranks, and its cut would cost more than ``max_writes`` writes."""
    return bands > 1 and rec.output_nbytes < min_bytes and bands * len(rec.ranks) * len(rec.outputs) > max_writes


def _tiny_why(min_bytes: int, max_writes: int) -> str:
    return f"under {min_bytes} B, on several ranks, cut into more than {max_writes} writes (one collective beats many tiny writes)"


def _verdict(rec: Recipe, owners: Owners, mesh: frozenset[int]):
    """:func:`_cut` as :func:`localize_group` uses it: ``("gather", why, None)``, ``("whole",
    None, candidates)``, ``("bands", [(a, b)], [candidates])`` or ``("slots", None, None)``;
    candidates are sorted rank tuples."""
    kind, x = _cut(rec, owners, mesh)
    if kind == "gather":
        return ("gather", x, None)
    if kind == "whole":
        return ("whole", None, tuple(sorted(x)))
    if kind == "slots":
        return ("slots", None, None)
    return ("bands", [(a, b) for a, b, _ in x], [tuple(sorted(h)) for _, _, h in x])


def _layout_reason(rec: Recipe, d: int) -> str:
    layouts = ", ".join(sorted({o.layout for o in rec.outputs if o.layout != "identity"}))
    rb = recipe_row_block(rec)
    if rb == 0:
        return f"runtime layout {layouts}: never cut, and its rows lie on several ranks"
    if d != len(rec.shape) - 2:
        return f"runtime layout {layouts}: the rows change hands along K"
    return f"runtime layout {layouts}: rows change hands inside a {rb}-row block"


_UNSEEN = object()
