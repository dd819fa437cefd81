"""Running a recipe: assemble its tensor from source parameters, transform it, split it.

:func:`assemble` builds a :class:`~weight_transfer.types.Recipe`'s tensor (``recipe.shape``, dtype
``recipe.assembled_dtype``) piece by piece; :func:`apply_transform` makes the outputs that are
written to the inference ranks; :func:`recipe_outputs` does both, into buffers it allocates or
into buffers the caller hands it (``out=``: the executor's registered output pool, so the
writes read memory registered once). :func:`output_view` says when a recipe's output is a view
of one source (a plain recipe: the write reads the source's own memory, nothing is built).
:func:`split_recipe` cuts a big recipe into row bands so the planner can spread one tensor
over several senders.

Piece semantics: ``assembled[dst_box] = source[src_box]``, cast to the assembled dtype with
``copy_`` (round to nearest even, the same as ``.to(dtype)``). The source slice's shape equals
the dst box's shape, except that the dst box may have extra *leading* dims of extent 1 (a 2-D
expert matrix filling slot ``[j:j+1]`` of a ``[1, N, K]`` expert recipe). Sources may be
non-contiguous views (transposed, sliced): values are read through their strides, never as
flat memory (C9). A piece with ``source=None`` is zero fill.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..types import Box, Recipe, box_numel, box_shape, new_output, new_piece, new_recipe, torch_dtype
from .layouts import IDENTITY, apply_layout, recipe_row_block
from .quant import QUANT_BLOCK, cdiv, quantize_fp8_block, scale_shape
from .quant_scaled import quantize_fp8_channel_reference, quantize_fp8_tensor_reference

__all__ = ["assemble", "apply_transform", "output_nbytes", "output_view", "recipe_outputs", "source_view",
           "split_recipe"]


DIRECT = "direct"
"""An ``into`` entry of :func:`weight_transfer.pipeline.tasks.prepare_outputs`: nothing is built for that assignment (its
output is written straight from the shards in pieces, :class:`weight_transfer.pipeline.memory.RegisteredMemory`);
its outputs are ``[]``."""

def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def source_view(recipe: Recipe, get_source: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
    """The view of one source that :func:`assemble` hands out instead of copying: the recipe
    is one piece covering its whole shape, and that piece's slice of the source is contiguous
    in the assembled dtype (a row band of an embedding, a norm). None otherwise."""
    shape = tuple(recipe.shape)
    if len(recipe.pieces) == 1 and recipe.pieces[0].source is not None:
        p = recipe.pieces[0]
        if p.dst_box == tuple((0, n) for n in shape):
            v = get_source(p.source)[_slices(p.src_box)]
            if v.dtype == torch_dtype(recipe.assembled_dtype) and v.is_contiguous() and v.numel() == math.prod(shape):
                return v.view(shape)
    return None


def output_view(recipe: Recipe, get_source: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
    """The recipe's one output when it *is* a view of a source (:func:`source_view`, a
    ``"copy"`` into the same dtype, identity layout): what :func:`recipe_outputs` returns for
    it without building anything. None when the output is built (fused, cast, quantized,
    rearranged, or a strided slice)."""
    if recipe.transform != "copy" or len(recipe.outputs) != 1:
        return None
    o = recipe.outputs[0]
    if o.layout != IDENTITY or o.dtype != recipe.assembled_dtype:
        return None
    return source_view(recipe, get_source)


def output_nbytes(recipe: Recipe) -> list[int]:
    """Bytes of each output :func:`apply_transform` makes (``"copy"``: the assembled shape in
    the output dtype; ``"fp8_block"``: the FP8 weight and its float32 scales; ``"fp8_tensor"`` /
    ``"fp8_channel"``: each output box in its dtype)."""
    n = math.prod(recipe.shape)
    if recipe.transform == "fp8_block":
        return [n, 4 * math.prod(scale_shape(tuple(recipe.shape)))]
    if recipe.transform in SCALED:
        return [box_numel(o.box) * torch_dtype(o.dtype).itemsize for o in recipe.outputs]
    return [n * torch_dtype(o.dtype).itemsize for o in recipe.outputs]


def assemble(
    recipe: Recipe,
    get_source: Callable[[str], torch.Tensor],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The recipe's assembled tensor: ``recipe.shape`` in ``recipe.assembled_dtype``.

    ``get_source(name)`` returns the full (global) source tensor, on any device, contiguous or
    not. ``out`` (optional) is filled in place and returned; it must have the recipe's shape
    and dtype. Zero pieces fill 0.
    """
    dt = torch_dtype(recipe.assembled_dtype)
    shape = tuple(recipe.shape)
    if out is None:
        # zero copy: the recipe is one contiguous slice of one source in the right dtype (a row
        # band of an embedding, a norm): hand out the view, the write reads the source directly
        v = source_view(recipe, get_source)
        if v is not None:
            return v
    if out is None:
        dev = None
        for p in recipe.pieces:
            if p.source is not None:
                dev = get_source(p.source).device
                break
        out = torch.empty(shape, dtype=dt, device=dev)
    elif tuple(out.shape) != shape or out.dtype != dt:
        raise ValueError(
            f"assemble {recipe.name!r}: out is {tuple(out.shape)} {out.dtype}, need {shape} {dt}"
        )
    for p in recipe.pieces:
        dst = out[_slices(p.dst_box)]
        if p.source is None:
            dst.zero_()
            continue
        src = get_source(p.source)[_slices(p.src_box)]
        if src.dim() < dst.dim():  # dst box has extra leading unit dims (expert slot)
            src = src[(None,) * (dst.dim() - src.dim())]
        dst.copy_(src)
    return out


def apply_transform(recipe: Recipe, assembled: torch.Tensor) -> list[torch.Tensor]:
    """The tensors the recipe writes, one per ``recipe.outputs``, each contiguous.

    ``"copy"``: the assembled tensor cast to the output dtype. ``"fp8_block"``: DeepSeek-V3
    block quantization of the assembled BF16 tensor (weight, ``weight_scale_inv``).
    ``"fp8_tensor"`` / ``"fp8_channel"``: per-tensor / per-row FP8 of the whole assembled tensor
    (:mod:`weight_transfer.convert.quant_scaled`); the weight output is its leading corner of the weight
    output box's shape, the scale output the scale (one value; ``[rows, 1]``) in the scale output
    box's shape. An output
    whose ``layout`` is not ``"identity"`` is then rearranged into that runtime order
    (:func:`weight_transfer.convert.layouts.apply_layout`).
    """
    if recipe.transform == "copy":
        (o,) = recipe.outputs
        out = [assembled.to(torch_dtype(o.dtype)).contiguous()]
    elif recipe.transform == "fp8_block":
        q, s = quantize_fp8_block(assembled)
        out = [q, s]
    elif recipe.transform in SCALED:
        out = _scaled(recipe, assembled)
    else:
        raise ValueError(f"recipe {recipe.name!r}: unknown transform {recipe.transform!r}")
    # an engine's post-processed runtime order (weight_transfer.convert.layouts), applied last
    return [t if o.layout == IDENTITY else apply_layout(t, o.layout) for t, o in zip(out, recipe.outputs)]


SCALED = ("fp8_tensor", "fp8_channel")
"""The transforms whose scale needs more of the source than the destination holds (per-tensor,
per-channel FP8): their recipes are never cut along a quantized domain."""


def _scaled(recipe: Recipe, assembled: torch.Tensor) -> list[torch.Tensor]:
    """The weight (leading corner of the assembled tensor) and scale outputs of a ``"fp8_tensor"``
    / ``"fp8_channel"`` recipe (:func:`apply_transform`). ValueError for a weight box larger than
    the assembled tensor or a scale box of another size."""
    w, sc = recipe.outputs
    fn = quantize_fp8_tensor_reference if recipe.transform == "fp8_tensor" else quantize_fp8_channel_reference
    q, s = fn(assembled)
    wshape, sshape = box_shape(w.box), box_shape(sc.box)
    core = wshape[len(wshape) - q.dim():] if len(wshape) >= q.dim() else None
    if core is None or any(e > n for e, n in zip(core, q.shape)):
        raise ValueError(f"recipe {recipe.name!r}: weight box {w.box} is not inside the assembled shape {tuple(q.shape)}")
    q = q[tuple(slice(0, e) for e in core)]
    if recipe.transform == "fp8_channel":
        s = s[: core[-2]] if q.dim() >= 2 else s
    if s.numel() != math.prod(sshape):
        raise ValueError(f"recipe {recipe.name!r}: scale box {sc.box} holds {math.prod(sshape)} values, the "
                         f"quantizer made {s.numel()}")
    return [q.contiguous().view(wshape), s.contiguous().view(sshape)]


def recipe_outputs(recipe: Recipe, get_source: Callable[[str], torch.Tensor],
                   out: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """:func:`assemble` then :func:`apply_transform`.

    ``out`` (optional): one flat ``uint8`` buffer per output (None: allocate that one), each
    exactly :func:`output_nbytes` bytes; the outputs are built in them and returned as typed
    views of them, with the same bytes as without ``out``. A ``"copy"`` in the assembled dtype
    is assembled straight into its buffer, a cast is cast into it, FP8 block quantization
    writes weight and scales there (:func:`weight_transfer.convert.quant.quantize_fp8_block`); only an
    output in a runtime layout other than identity is built first and copied in. ValueError
    when a buffer's size does not match."""
    if out is None or all(b is None for b in out):
        return apply_transform(recipe, assemble(recipe, get_source))
    sizes = output_nbytes(recipe)
    if len(out) != len(sizes):
        raise ValueError(f"recipe_outputs {recipe.name!r}: {len(out)} buffers for {len(sizes)} outputs")
    dev = out[0].device if out[0] is not None else out[-1].device
    bufs = [torch.empty(n, dtype=torch.uint8, device=dev) if b is None else b for b, n in zip(out, sizes)]
    for o, b, n in zip(recipe.outputs, bufs, sizes):
        if b.dtype != torch.uint8 or b.dim() != 1 or b.numel() != n:
            raise ValueError(f"recipe_outputs {recipe.name!r}: buffer for {o.tensor} is {tuple(b.shape)} {b.dtype}, "
                             f"need ({n},) uint8")
    shape = tuple(recipe.shape)
    if any(o.layout != IDENTITY for o in recipe.outputs):
        fused = assemble_in_layout(recipe, get_source, bufs[0]) if recipe.transform == "copy" else None
        if fused is not None:  # one pass: each piece copied (and cast) straight into the runtime order
            return [fused]
        made = apply_transform(recipe, assemble(recipe, get_source))  # built first, then copied in
        for b, t in zip(bufs, made):
            b.copy_(t.contiguous().view(-1).view(torch.uint8))
        return [b.view(t.dtype).view(t.shape) for b, t in zip(bufs, made)]
    if recipe.transform == "copy":
        (o,) = recipe.outputs
        dst = bufs[0].view(torch_dtype(o.dtype)).view(shape)
        if o.dtype == recipe.assembled_dtype:
            assemble(recipe, get_source, out=dst)
        else:
            dst.copy_(assemble(recipe, get_source))  # the cast: copy_ rounds as .to() does
        return [dst]
    if recipe.transform == "fp8_block":
        q = bufs[0].view(torch.float8_e4m3fn).view(shape)
        s = bufs[1].view(torch.float32).view(scale_shape(shape))
        quantize_fp8_block(assemble(recipe, get_source), out=(q, s))
        return [q, s]
    if recipe.transform in SCALED:
        made = apply_transform(recipe, assemble(recipe, get_source))
        for b, t in zip(bufs, made):
            b.copy_(t.reshape(-1).view(torch.uint8))
        return [b.view(t.dtype).view(t.shape) for b, t in zip(bufs, made)]
    raise ValueError(f"recipe {recipe.name!r}: unknown transform {recipe.transform!r}")


def assemble_in_layout(recipe: Recipe, get_source: Callable[[str], torch.Tensor],
                       buf: torch.Tensor) -> torch.Tensor | None:
    """A ``"copy"`` recipe with one output in a runtime layout, built in one pass: each piece's
    source slice is copied (and cast: ``copy_`` rounds as ``.to()`` does) straight into the
    positions ``layout`` gives its elements in ``buf`` (flat ``uint8``, :func:`output_nbytes`
    bytes), with no assembled tensor and no second copy -- the layout transform of issue 43 as
    one strided copy per piece, what :func:`assemble` then
    :func:`~weight_transfer.convert.layouts.apply_layout` make in three passes. Returns the typed view
    of ``buf`` (the output's shape, the runtime order in memory), byte-identical to
    :func:`recipe_outputs` without it; None when a piece does not cover whole ``[N, K]`` rows
    in whole row blocks of ``"blocked:*"`` (or when a leading dim of the recipe is cut by a
    piece), so the caller takes the general path."""
    from .layouts import TRANSPOSED, parse_layout

    (o,) = recipe.outputs
    shape = tuple(recipe.shape)
    if len(shape) < 2:
        return None
    *lead, n, k = shape
    n_lead = math.prod(lead)
    p = parse_layout(o.layout)
    dt = torch_dtype(o.dtype)
    dst = buf.view(dt)
    plan = []
    for pc in recipe.pieces:
        box = pc.dst_box
        if tuple(box[-1]) != (0, k) or any(tuple(b) != (0, e) for b, e in zip(box[:-2], lead)):
            return None  # part of K, or part of the leading dims: the general path
        a, b = box[-2]
        if o.layout != TRANSPOSED and (a % p[0] or (b % p[0] and b != n)):
            return None
        plan.append((pc, a, b))
    for pc, a, b in plan:
        rows = b - a
        if pc.source is None:
            src = None
        else:
            src = get_source(pc.source)[_slices(pc.src_box)].reshape(n_lead, rows, k)
        if o.layout == TRANSPOSED:
            v = dst.view(n_lead, k, n)[:, :, a:b]
            v.zero_() if src is None else v.copy_(src.transpose(1, 2))
            continue
        bn, pair = p
        band = dst.view(n_lead, n * k)[:, a * k:b * k]
        if src is None:
            band.zero_()
            continue
        full = (rows // bn) * bn
        if full:
            band[:, :full * k].view(n_lead, full // bn, k // pair, bn, pair).copy_(
                src[:, :full].reshape(n_lead, full // bn, bn, k // pair, pair).permute(0, 1, 3, 2, 4))
        if full < rows:
            t = rows - full
            band[:, full * k:].view(n_lead, k // pair, t, pair).copy_(
                src[:, full:].reshape(n_lead, t, k // pair, pair).permute(0, 2, 1, 3))
    return dst.view(shape)


# --------------------------------------------------------------------------------------------
# splitting


def split_recipe(recipe: Recipe, max_rows: int) -> list[Recipe]:
    """Cut ``recipe`` into bands of at most ``max_rows`` along its first assembled dimension of
    extent > 1 (so every output box stays flat-contiguous). Pieces are clipped and re-based;
    names get a ``#rows a:b`` suffix. For ``"fp8_block"`` recipes cut along one of the two
    quantized dims, bands are multiples of 128 (at least 128) so no block straddles two bands,
    and the ``weight_scale_inv`` box is cut at ``a/128``; the outputs of the parts are then
    byte-identical to the matching parts of the unsplit recipe's outputs. An output in a runtime
    layout is cut in whole row blocks of that layout (:func:`~weight_transfer.convert.layouts.recipe_row_block`;
    never along K, never for ``"transposed"``). Returns ``[recipe]`` when nothing needs cutting.
    """
    if max_rows < 1:
        raise ValueError(f"split_recipe: max_rows must be >= 1, got {max_rows}")
    shape = recipe.shape
    nd = len(shape)
    d = 0
    while d < nd - 1 and shape[d] == 1:
        d += 1
    if nd == 0 or shape[d] <= 1:
        return [recipe]
    n = shape[d]
    if not _cuttable(recipe, d):
        return [recipe]
    quant = recipe.transform == "fp8_block"
    block_dim = quant and d >= nd - 2
    step = max_rows
    if block_dim:
        step = max(QUANT_BLOCK, (max_rows // QUANT_BLOCK) * QUANT_BLOCK)
    if any(o.layout != IDENTITY for o in recipe.outputs) and d >= nd - 2:
        rb = recipe_row_block(recipe)
        if rb == 0 or d != nd - 2:
            return [recipe]  # a layout never cut, or a cut along K: written whole
        unit = math.lcm(rb, QUANT_BLOCK) if block_dim else rb
        step = max(unit, (step // unit) * unit)
    if n <= step:
        return [recipe]
    return split_recipe_bands(recipe, [(a, min(n, a + step)) for a in range(0, n, step)])


def _cuttable(recipe: Recipe, d: int) -> bool:
    """Whether ``recipe`` may be cut along dim ``d``: anything but a per-tensor FP8 recipe (its
    scale is the whole tensor's) or a per-channel one cut along its last dim (a row's scale is
    all its columns'); per-channel rows are independent."""
    if recipe.transform == "fp8_tensor":
        return False
    return not (recipe.transform == "fp8_channel" and d >= len(recipe.shape) - 1)


def split_dim(recipe: Recipe) -> int:
    """The assembled dimension recipes are cut along: the first one of extent > 1."""
    d = 0
    while d < len(recipe.shape) - 1 and recipe.shape[d] == 1:
        d += 1
    return d


def split_recipe_bands(recipe: Recipe, bands: list[tuple[int, int]]) -> list[Recipe]:
    """Cut ``recipe`` into the given row bands ``[a, b)`` of :func:`split_dim` (they must tile
    it; for ``"fp8_block"`` along a quantized dim, every cut a multiple of 128; for an output in
    a runtime layout, cuts along N at multiples of its row block, none along K). Pieces are
    clipped and re-based, output boxes shifted; names get a ``#rows a:b`` suffix."""
    shape = recipe.shape
    nd = len(shape)
    d = split_dim(recipe)
    if not _cuttable(recipe, d) and list(bands) != [(0, shape[d])]:
        raise ValueError(f"split {recipe.name!r}: a {recipe.transform} recipe is not cut along dim {d} (its scale "
                         "needs all of it)")
    quant = recipe.transform == "fp8_block"
    block_dim = quant and d >= nd - 2
    if any(o.layout != IDENTITY for o in recipe.outputs) and d >= nd - 2:
        rb = recipe_row_block(recipe)
        bad = [(a, b) for a, b in bands if d != nd - 2 or rb == 0 or a % rb or (b % rb and b != shape[d])]
        if bad:
            raise ValueError(f"split {recipe.name!r}: band {bad[0][0]}:{bad[0][1]} cuts a row block of the runtime "
                             f"layout ({', '.join(sorted({o.layout for o in recipe.outputs}))}; "
                             f"{rb or 'no'} row{'s' if rb != 1 else ''} per block)")
    # each piece clipped to [a, b) of dim d and re-based to a (its source slice along with it),
    # each output box shifted, all inline; shard-local prepare cuts 590k bands at Qwen3-235B 128 -> 32 scale
    k_of = [len(p.dst_box) - len(p.src_box) for p in recipe.pieces]
    pre, post = tuple(shape[:d]), tuple(shape[d + 1:])
    outs0 = [(o, o.box[:d], o.box[d][0], o.box[d + 1:]) for o in recipe.outputs]
    parts = []
    for a, b in bands:
        if block_dim and (a % QUANT_BLOCK or (b % QUANT_BLOCK and b != shape[d])):
            raise ValueError(f"split {recipe.name!r}: band {a}:{b} cuts a 128x128 quantization block")
        pieces = []
        for p, k in zip(recipe.pieces, k_of):
            db = p.dst_box
            pa, pb = db[d]
            lo = pa if pa > a else a
            hi = pb if pb < b else b
            if lo >= hi:
                continue
            dst = (*db[:d], (lo - a, hi - a), *db[d + 1:])
            if p.source is None:
                pieces.append(new_piece(None, (), dst))
            elif d >= k:
                sb = p.src_box
                sa = sb[d - k][0]
                pieces.append(new_piece(p.source, (*sb[:d - k], (sa + lo - pa, sa + hi - pa), *sb[d - k + 1:]), dst))
            else:
                pieces.append(new_piece(p.source, p.src_box, dst))
        outs = []
        for i, (o, head, o0, tail) in enumerate(outs0):
            if quant and i == 1 and block_dim:
                box = (*head, (o0 + a // QUANT_BLOCK, o0 + cdiv(b, QUANT_BLOCK)), *tail)
            else:
                box = (*head, (o0 + a, o0 + b), *tail)
            outs.append(new_output(o.tensor, box, o.dtype, o.layout))
        parts.append(new_recipe(f"{recipe.name}#rows{a}:{b}", recipe.ranks, (*pre, b - a, *post), recipe.assembled_dtype,
                            tuple(pieces), recipe.transform, tuple(outs)))
    return parts
