"""Weight mapping: Hugging Face checkpoint names -> the inference engine's tensors ("recipes").

For a model (:class:`~reference.catalog.ModelConfig`) and an inference world
(:class:`~reference.types.InferenceLayout`) :func:`build_recipes` says, for every parameter
tensor of every inference rank, which checkpoint tensors (and which slices of them) it is made
of, and how it is transformed on the way (a cast, or FP8 block quantization). The rules are the
ones of ``docs/LAYOUTS.md`` (vLLM's names and shard rules); this module is written from that
document alone, independently of ``engines/`` (the oracle it is verified against).

Granularity
-----------
One :class:`~reference.types.Recipe` per (destination tensor, distinct content):

- a TP-sharded tensor gets one recipe per TP rank; the DP replicas of that TP rank are extra
  ``ranks`` of the same recipe;
- a replicated tensor (norms, router, MLA's ``fused_qkv_a_proj``) is one recipe whose ``ranks``
  are every inference rank;
- MoE experts get one recipe per expert slot (the box ``[j:j+1, :, :]`` of ``w13_weight`` /
  ``w2_weight``, and the matching box of the ``*_scale_inv`` tensor under FP8); the assembled
  shape is ``[1, N, K]`` and the 2-D source slices fill it (a piece's ``dst_box`` may have extra
  leading dims of extent 1, see :mod:`reference.transforms`);
- vocab padding rows (``Vp = ceil(V/64)*64``) are a zero :class:`~reference.types.Piece`.

Under ``quant="fp8"`` every linear weight is an ``"fp8_block"`` recipe assembled in BF16 (the
sources are cast to BF16 first, then quantized) with two outputs: the ``float8_e4m3fn`` weight
and its float32 ``weight_scale_inv``. Everything else is a ``"copy"`` recipe assembled and
written in ``layout.dtype`` (float32 for DeepSeek's ``e_score_correction_bias``).

Invariants every recipe here satisfies (and :func:`validate` checks): ``outputs[0].box`` has
the shape ``recipe.shape``; every output box is flat-contiguous in its destination tensor (one
byte range per receiving rank); the pieces' ``dst_box`` cover ``recipe.shape`` exactly once.

Beyond LAYOUTS.md (vLLM's rule, documented here): MLA without ``q_lora_rank`` gets a row-sharded
``self_attn.q_proj.weight`` and a replicated, unfused ``self_attn.kv_a_proj_with_mqa.weight``.

Example::

    cfg = load_config("qwen3-0.6b", num_hidden_layers=2)
    rs = build_recipes(cfg, InferenceLayout(tp=2))
    validate(rs, {p.name: (p.shape, p.dtype) for p in param_specs(cfg)}, dests)
"""
from __future__ import annotations

import gc
import re
from contextlib import contextmanager
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .catalog import ModelConfig
from .types import (
    Box,
    DestTensorMeta,
    InferenceLayout,
    Output,
    Piece,
    Recipe,
    box_flat_range,
    itemsize,
)

__all__ = [
    "PlanError",
    "RecipeSet",
    "build_recipes",
    "fusion_groups",
    "validate",
    "expected_dest_shapes",
    "expected_dests",
    "make_dest_metas",
    "VOCAB_PAD",
    "QUANT_BLOCK",
]

VOCAB_PAD = 64
"""vLLM pads the vocabulary to a multiple of 64 rows (``pad_vocab_size``)."""
QUANT_BLOCK = 128
"""FP8 block size (DeepSeek-V3 ``weight_block_size`` [128, 128])."""

FP8 = "float8_e4m3fn"
F32 = "float32"
BF16 = "bfloat16"
CASTABLE_FLOAT = frozenset({"bfloat16", "float16", "float32"})
"""Dtypes a planned cast may read from or write to (``.to(dtype)``, round to nearest even)."""


class PlanError(ValueError):
    """A weight plan that cannot be executed correctly. The message names the tensors: its first
    line is a one-line summary, then one line per problem (the first 20)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@contextmanager
def _no_gc():
    """Pause the cyclic GC while building many small tuples (it would rescan the growing heap
    over and over; nothing built here is cyclic)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ============================================================================================
# RecipeSet


class RecipeSet:
    """The recipes of one (model, layout), plus the training tensors deliberately left unused.

    ``recipes`` are in checkpoint order of their first source. ``ignored`` names training-side
    tensors that map nowhere on purpose (see :func:`build_recipes`); :func:`validate` refuses
    any other unused source. Lookups (:meth:`for_source`, :meth:`for_rank`) are built lazily.
    """

    __slots__ = ("recipes", "ignored", "layout", "model", "_by_source", "_by_rank")

    def __init__(
        self,
        recipes: Sequence[Recipe],
        ignored: Iterable[str] = (),
        *,
        layout: InferenceLayout | None = None,
        model: str = "",
    ):
        self.recipes: tuple[Recipe, ...] = tuple(recipes)
        self.ignored: frozenset[str] = frozenset(ignored)
        self.layout = layout
        self.model = model
        self._by_source: dict[str, tuple[Recipe, ...]] | None = None
        self._by_rank: dict[int, tuple[Recipe, ...]] | None = None

    def __len__(self) -> int:
        return len(self.recipes)

    def __iter__(self):
        return iter(self.recipes)

    def __repr__(self) -> str:
        lay = self.layout.describe() if self.layout else "?"
        return f"RecipeSet({self.model} {lay}: {len(self.recipes)} recipes, {len(self.ignored)} ignored)"

    @property
    def by_source(self) -> dict[str, tuple[Recipe, ...]]:
        """Source name -> the recipes reading it (in recipe order)."""
        if self._by_source is None:
            d: dict[str, list[Recipe]] = defaultdict(list)
            for r in self.recipes:
                for s in r.sources:
                    d[s].append(r)
            self._by_source = {k: tuple(v) for k, v in d.items()}
        return self._by_source

    @property
    def by_rank(self) -> dict[int, tuple[Recipe, ...]]:
        """Inference rank -> the recipes writing to it (in recipe order)."""
        if self._by_rank is None:
            d: dict[int, list[Recipe]] = defaultdict(list)
            for r in self.recipes:
                for k in r.ranks:
                    d[k].append(r)
            self._by_rank = {k: tuple(v) for k, v in sorted(d.items())}
        return self._by_rank

    def for_source(self, name: str) -> tuple[Recipe, ...]:
        return self.by_source.get(name, ())

    def for_rank(self, rank: int) -> tuple[Recipe, ...]:
        return self.by_rank.get(rank, ())

    @property
    def sources(self) -> tuple[str, ...]:
        """Every source used, in order of first use (checkpoint order)."""
        return tuple(self.by_source)

    def fusion_groups(self) -> list[list[Recipe]]:
        return fusion_groups(self.recipes)


# ============================================================================================
# building


class _Builder:
    """Accumulates recipes for one (cfg, layout); helpers per tensor kind."""

    def __init__(self, cfg: ModelConfig, layout: InferenceLayout):
        self.cfg = cfg
        self.L = layout
        self.T = layout.tp
        self.fp8 = layout.quant == "fp8"
        self.dtype = layout.dtype
        self.all_ranks = tuple(range(layout.world_size))
        self.tp_ranks = [layout.ranks_of_tp_rank(r) for r in range(self.T)]
        self.recipes: list[Recipe] = []

    # -- checks ----------------------------------------------------------------------------
    def divide(self, what: str, n: int, d: int, dname: str = "tp") -> int:
        if d <= 0 or n % d:
            raise PlanError(
                f"layout {self.L.describe()} does not fit {self.cfg.label}: {what} = {n} is not "
                f"divisible by {dname} = {d}"
            )
        return n // d

    # -- recipe constructors ----------------------------------------------------------------
    def copy(self, dest: str, ranks, shape, pieces, *, dtype: str | None = None, name: str | None = None):
        dt = dtype or self.dtype
        self.recipes.append(
            Recipe(
                name or dest,
                ranks,
                shape,
                dt,
                tuple(pieces),
                "copy",
                (Output(dest, tuple((0, s) for s in shape), dt),),
            )
        )

    def linear(self, base: str, ranks, shape, pieces, *, name: str):
        """A linear layer's weight ``base + '.weight'`` (full destination tensor)."""
        if not self.fp8:
            self.copy(base + ".weight", ranks, shape, pieces, name=name)
            return
        N, K = shape
        sshape = (_cdiv(N, QUANT_BLOCK), _cdiv(K, QUANT_BLOCK))
        self.recipes.append(
            Recipe(
                name,
                ranks,
                shape,
                BF16,
                tuple(pieces),
                "fp8_block",
                (
                    Output(base + ".weight", ((0, N), (0, K)), FP8),
                    Output(base + ".weight_scale_inv", ((0, sshape[0]), (0, sshape[1])), F32),
                ),
            )
        )

    def expert_outputs(self, base: str, which: str, N: int, K: int):
        """Per-slot output factory for ``base.{which}_weight`` ``[El, N, K]`` (and its scale
        under FP8): returns ``slot j -> outputs`` with the constant parts built once."""
        wname = f"{base}.{which}_weight"
        nk = ((0, N), (0, K))
        if not self.fp8:
            dt = self.dtype
            return lambda j: (Output(wname, ((j, j + 1),) + nk, dt),)
        sname = f"{base}.{which}_weight_scale_inv"
        sb = ((0, _cdiv(N, QUANT_BLOCK)), (0, _cdiv(K, QUANT_BLOCK)))
        return lambda j: (Output(wname, ((j, j + 1),) + nk, FP8), Output(sname, ((j, j + 1),) + sb, F32))

    def replicated(self, name: str, shape, *, dtype: str | None = None):
        """A tensor copied whole to every rank under the same name (norms, router)."""
        self.copy(name, self.all_ranks, shape, (Piece(name, tuple((0, s) for s in shape), tuple((0, s) for s in shape)),), dtype=dtype)

    def row_stack(self, base: str, parts_per_rank, K: int):
        """Row-sharded linear: for TP rank r, ``parts_per_rank(r)`` lists ``(source, a, b)`` row
        ranges stacked in order (full ``K`` columns)."""
        for r in range(self.T):
            pieces = []
            off = 0
            for src, a, b in parts_per_rank(r):
                n = b - a
                pieces.append(Piece(src, ((a, b), (0, K)), ((off, off + n), (0, K))))
                off += n
            self.linear(base, self.tp_ranks[r], (off, K), pieces, name=f"{base}.weight@tp{r}")

    def col_shard(self, base: str, src: str, N: int, K: int):
        """Column-sharded linear (``o_proj``, ``down_proj``): rank r gets columns
        ``[r*K/T, (r+1)*K/T)`` of ``src`` ``[N, K]``."""
        k = self.divide(f"{src} in_features", K, self.T)
        for r in range(self.T):
            self.linear(
                base, self.tp_ranks[r], (N, k),
                (Piece(src, ((0, N), (r * k, (r + 1) * k)), ((0, N), (0, k))),),
                name=f"{base}.weight@tp{r}",
            )

    # -- model parts ------------------------------------------------------------------------
    def vocab(self, name: str):
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        Vp = _cdiv(V, VOCAB_PAD) * VOCAB_PAD
        rows = self.divide(f"{name} padded vocab (ceil({V}/{VOCAB_PAD})*{VOCAB_PAD})", Vp, self.T)
        for r in range(self.T):
            a, b = r * rows, (r + 1) * rows
            real = min(b, V)
            pieces = []
            if real > a:
                pieces.append(Piece(name, ((a, real), (0, H)), ((0, real - a), (0, H))))
            if b > V:
                z = max(a, V)
                pieces.append(Piece(None, (), ((z - a, b - a), (0, H))))
            self.copy(name, self.tp_ranks[r], (rows, H), pieces, name=f"{name}@tp{r}")

    def qwen3_attention(self, p: str):
        cfg, T = self.cfg, self.T
        H, hd, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        qh = self.divide(f"{p}.self_attn num_attention_heads", nh, T)
        if T <= nkv:
            kvr = self.divide(f"{p}.self_attn num_key_value_heads", nkv, T)

            def kv_head0(r):
                return r * kvr
        else:
            rep = T // nkv
            if T % nkv:
                raise PlanError(
                    f"layout {self.L.describe()} does not fit {cfg.label}: tp = {T} > "
                    f"num_key_value_heads = {nkv} but not a multiple of it ({p}.self_attn.qkv_proj)"
                )
            kvr = 1

            def kv_head0(r):
                return r // rep

        q, k, v = (f"{p}.self_attn.{x}_proj.weight" for x in "qkv")

        def parts(r):
            h0 = kv_head0(r)
            return (
                (q, r * qh * hd, (r + 1) * qh * hd),
                (k, h0 * hd, (h0 + kvr) * hd),
                (v, h0 * hd, (h0 + kvr) * hd),
            )

        self.row_stack(f"{p}.self_attn.qkv_proj", parts, H)
        self.col_shard(f"{p}.self_attn.o_proj", f"{p}.self_attn.o_proj.weight", H, nh * hd)
        self.replicated(f"{p}.self_attn.q_norm.weight", (hd,))
        self.replicated(f"{p}.self_attn.k_norm.weight", (hd,))

    def mla_attention(self, p: str):
        cfg, T = self.cfg, self.T
        H, nh = cfg.hidden_size, cfg.num_heads
        qlr, kvlr = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
        nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        hl = self.divide(f"{p}.self_attn num_attention_heads", nh, T)
        a = f"{p}.self_attn"
        kv_a = f"{a}.kv_a_proj_with_mqa.weight"
        if qlr:
            q_a = f"{a}.q_a_proj.weight"
            n = qlr + kvlr + rope
            self.linear(
                f"{a}.fused_qkv_a_proj", self.all_ranks, (n, H),
                (
                    Piece(q_a, ((0, qlr), (0, H)), ((0, qlr), (0, H))),
                    Piece(kv_a, ((0, kvlr + rope), (0, H)), ((qlr, n), (0, H))),
                ),
                name=f"{a}.fused_qkv_a_proj.weight",
            )
            self.replicated(f"{a}.q_a_layernorm.weight", (qlr,))
            qb = f"{a}.q_b_proj.weight"
            w = hl * (nope + rope)
            self.row_stack(f"{a}.q_b_proj", lambda r: ((qb, r * w, (r + 1) * w),), qlr)
        else:  # vLLM: q_proj row-sharded, kv_a_proj_with_mqa replicated and unfused
            qp = f"{a}.q_proj.weight"
            w = hl * (nope + rope)
            self.row_stack(f"{a}.q_proj", lambda r: ((qp, r * w, (r + 1) * w),), H)
            self.linear(
                f"{a}.kv_a_proj_with_mqa", self.all_ranks, (kvlr + rope, H),
                (Piece(kv_a, ((0, kvlr + rope), (0, H)), ((0, kvlr + rope), (0, H))),),
                name=kv_a,
            )
        self.replicated(f"{a}.kv_a_layernorm.weight", (kvlr,))
        kvb = f"{a}.kv_b_proj.weight"
        w2 = hl * (nope + vd)
        self.row_stack(f"{a}.kv_b_proj", lambda r: ((kvb, r * w2, (r + 1) * w2),), kvlr)
        self.col_shard(f"{a}.o_proj", f"{a}.o_proj.weight", H, nh * vd)

    def dense_mlp(self, prefix: str, inter: int):
        """``prefix.gate_up_proj`` (gate rows; up rows of the rank's slice) and ``down_proj``."""
        H = self.cfg.hidden_size
        il = self.divide(f"{prefix} intermediate size", inter, self.T)
        g, u = f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"
        self.row_stack(
            f"{prefix}.gate_up_proj",
            lambda r: ((g, r * il, (r + 1) * il), (u, r * il, (r + 1) * il)),
            H,
        )
        self.col_shard(f"{prefix}.down_proj", f"{prefix}.down_proj.weight", H, inter)

    def moe(self, p: str):
        cfg, T = self.cfg, self.T
        H, E, mI = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        m = f"{p}.mlp"
        self.replicated(f"{m}.gate.weight", (E, H))
        if cfg.is_mla:
            self.replicated(f"{m}.gate.e_score_correction_bias", (E,), dtype=F32)
        base = f"{m}.experts"
        if self.L.ep:
            El = self.divide(f"{base} num_experts (expert parallel)", E, T)
            Il = mI
        else:
            Il = self.divide(f"{base} moe_intermediate_size", mI, T)
        out13 = self.expert_outputs(base, "w13", 2 * Il, H)
        out2 = self.expert_outputs(base, "w2", H, Il)
        tr = "fp8_block" if self.fp8 else "copy"
        adt = BF16 if self.fp8 else self.dtype
        sh13, sh2 = (1, 2 * Il, H), (1, H, Il)
        cH = (0, H)
        d_g, d_u, d_d = ((0, 1), (0, Il), cH), ((0, 1), (Il, 2 * Il), cH), ((0, 1), cH, (0, Il))
        n13, n2 = f"{base}.w13_weight", f"{base}.w2_weight"
        add = self.recipes.append
        for e in range(E):
            pre = f"{base}.{e}."
            g, u, d = pre + "gate_proj.weight", pre + "up_proj.weight", pre + "down_proj.weight"
            if self.L.ep:
                placements = ((e // El, e % El, 0),)
            else:
                placements = tuple((r, e, r * Il) for r in range(T))
            for r, j, i0 in placements:
                ranks = self.tp_ranks[r]
                rows = (i0, i0 + Il)
                add(Recipe(f"{n13}[{j}]@tp{r}", ranks, sh13, adt,
                           (Piece(g, (rows, cH), d_g), Piece(u, (rows, cH), d_u)), tr, out13(j)))
                add(Recipe(f"{n2}[{j}]@tp{r}", ranks, sh2, adt,
                           (Piece(d, (cH, rows), d_d),), tr, out2(j)))
        if cfg.num_shared_experts:
            self.dense_mlp(f"{m}.shared_experts", mI * cfg.num_shared_experts)

    def build(self):
        cfg = self.cfg
        H = cfg.hidden_size
        self.vocab("model.embed_tokens.weight")
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            self.replicated(f"{p}.input_layernorm.weight", (H,))
            if cfg.is_mla:
                self.mla_attention(p)
            else:
                self.qwen3_attention(p)
            self.replicated(f"{p}.post_attention_layernorm.weight", (H,))
            if cfg.is_moe_layer(i):
                self.moe(p)
            else:
                self.dense_mlp(f"{p}.mlp", cfg["intermediate_size"])
        self.replicated("model.norm.weight", (H,))
        if not cfg.tie_word_embeddings:
            self.vocab("lm_head.weight")
        return self.recipes


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _ignorable(cfg: ModelConfig, name: str) -> bool:
    """Training tensors vLLM's loaders skip on purpose (so may be unused without error)."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return True  # tied: vLLM's lm_head *is* embed_tokens; a saved copy is skipped
    if cfg.is_mla:  # DeepSeek multi-token-prediction layers are loaded separately
        m = _LAYER_RE.match(name)
        if m:
            i = int(m.group(1))
            return cfg.num_layers <= i < cfg.num_layers + (cfg.get("num_nextn_predict_layers") or 0)
    return False


def build_recipes(
    cfg: ModelConfig,
    layout: InferenceLayout,
    *,
    source_dtypes: Mapping[str, str] | None = None,
) -> RecipeSet:
    """Every destination tensor of every inference rank of ``layout``, as recipes over the
    Hugging Face checkpoint tensors of ``cfg`` (see the module docstring and docs/LAYOUTS.md).

    ``source_dtypes`` (training-side name -> dtype), when given, decides ``ignored``: the
    training tensors that no recipe reads *and* that vLLM skips on purpose (a tied model's
    saved ``lm_head.weight``, ``rotary_emb.inv_freq``, DeepSeek MTP layers). Any other unused
    tensor is left for :func:`validate` to refuse (C2). Source dtypes do not change the recipes:
    every source is cast to the assembled dtype (a planned cast, checked by :func:`validate`).

    Raises :class:`PlanError` naming the tensor and sizes when the layout does not divide the
    model (heads, intermediate sizes, experts, padded vocab).
    """
    with _no_gc():
        recipes = _Builder(cfg, layout).build()
    ignored: frozenset[str] = frozenset()
    if source_dtypes:
        used = set()
        for r in recipes:
            for pc in r.pieces:
                used.add(pc.source)
        ignored = frozenset(n for n in source_dtypes if n not in used and _ignorable(cfg, n))
    return RecipeSet(recipes, ignored, layout=layout, model=cfg.label)


# ============================================================================================
# fusion groups


@_no_gc()
def fusion_groups(recipes: Sequence[Recipe] | RecipeSet) -> list[list[Recipe]]:
    """Connected components of recipes that share a source (``q,k,v`` -> every TP rank's
    ``qkv_proj`` recipe; ``gate_e, up_e`` -> the ``w13`` slots of expert ``e``). A group is
    the unit a trainer materializes together (one ``full_tensor()`` per source).

    Groups come in order of their first source's first use in ``recipes`` (recipes are built in
    checkpoint order, so this is checkpoint order); recipes inside a group keep their order.
    Recipes without sources (all zero) are groups of their own.
    """
    recs = recipes.recipes if isinstance(recipes, RecipeSet) else tuple(recipes)
    parent = list(range(len(recs)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first_user: dict[str, int] = {}
    src_index: dict[str, int] = {}
    for i, r in enumerate(recs):
        for pc in r.pieces:
            s = pc.source
            if s is None:
                continue
            j = first_user.get(s)
            if j is None:
                first_user[s] = i
                src_index[s] = len(src_index)
            else:
                a, b = find(i), find(j)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[Recipe]] = {}
    key: dict[int, int] = {}
    big = len(src_index)
    for i, r in enumerate(recs):
        root = find(i)
        groups.setdefault(root, []).append(r)
        srcs = [src_index[pc.source] for pc in r.pieces if pc.source is not None]
        k = min(srcs) if srcs else big + i
        if k < key.get(root, 1 << 62):
            key[root] = k
    return [groups[root] for root in sorted(groups, key=lambda g: (key[g], g))]


# ============================================================================================
# destination shapes (derived from the recipes)


@_no_gc()
def expected_dests(recipeset: RecipeSet) -> dict[tuple[int, str], tuple[tuple[int, ...], str]]:
    """``(rank, tensor) -> (shape, dtype)`` of every destination tensor the recipes write,
    derived from their output boxes (a tensor's extent is the largest ``stop`` per dim)."""
    per: dict[tuple[str, tuple[int, ...]], tuple[list[int], str]] = {}
    order: list[tuple[str, tuple[int, ...]]] = []
    for r in recipeset.recipes:
        for o in r.outputs:
            k = (o.tensor, r.ranks)
            cur = per.get(k)
            if cur is None:
                per[k] = ([b for _, b in o.box], o.dtype)
                order.append(k)
            else:
                ext = cur[0]
                for d, (_, b) in enumerate(o.box):
                    if b > ext[d]:
                        ext[d] = b
    out: dict[tuple[int, str], tuple[tuple[int, ...], str]] = {}
    for k in order:
        ext, dt = per[k]
        for rank in k[1]:
            key = (rank, k[0])
            prev = out.get(key)
            shape = tuple(ext)
            if prev is not None:
                shape = tuple(max(a, b) for a, b in zip(prev[0], shape))
            out[key] = (shape, dt)
    return dict(sorted(out.items(), key=lambda kv: kv[0][0]))  # stable: rank, then first write


def expected_dest_shapes(
    cfg: ModelConfig, layout: InferenceLayout, rank: int, *, recipeset: RecipeSet | None = None
) -> dict[str, tuple[tuple[int, ...], str]]:
    """Destination tensors of inference ``rank``: name -> (shape, dtype), derived from the
    recipes' outputs (so a test can compare them with LAYOUTS.md's hand-written shapes)."""
    rs = recipeset or build_recipes(cfg, layout)
    sub = RecipeSet(rs.for_rank(rank), layout=layout)
    return {name: v for (rk, name), v in expected_dests(sub).items() if rk == rank}


@_no_gc()
def make_dest_metas(
    shapes: Mapping[tuple[int, str], tuple[tuple[int, ...], str]], align: int = 16
) -> dict[tuple[int, str], DestTensorMeta]:
    """Lay ``(rank, name) -> (shape, dtype)`` out back to back per rank (offsets aligned to
    ``align`` bytes, in the mapping's order), as an engine's arena would. For tests and
    simulation; a real engine publishes its own :class:`DestTensorMeta`."""
    offs: dict[int, int] = defaultdict(int)
    out = {}
    for (rank, name), (shape, dt) in shapes.items():
        n = 1
        for s in shape:
            n *= s
        nbytes = n * itemsize(dt)
        off = _cdiv(offs[rank], align) * align
        out[(rank, name)] = DestTensorMeta(rank=rank, name=name, shape=tuple(shape), dtype=dt, offset=off, nbytes=nbytes)
        offs[rank] = off + nbytes
    return out


# ============================================================================================
# validation


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
    shape = getattr(v, "global_shape", None) or getattr(v, "shape")
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


def _bshape(box: Box) -> tuple[int, ...]:
    return tuple([b - a for a, b in box])


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
                want = (*shape[:-2], _cdiv(shape[-2], QUANT_BLOCK), _cdiv(shape[-1], QUANT_BLOCK))
                if _bshape(sc.box) != want:
                    probs.add("shape", f"fp8_block recipe {name!r}: scale box {sc.box} of {sc.tensor!r} has shape {_bshape(sc.box)}, need {want}")
            else:
                probs.add("shape", f"fp8_block recipe {name!r}: shape {shape} has < 2 dims")
    else:
        probs.add("bad-recipe", f"recipe {name!r}: unknown transform {tr!r}")
    if outs and _bshape(outs[0].box) != tuple(shape):
        probs.add("shape", f"recipe {name!r}: output box {outs[0].box} of {outs[0].tensor!r} does not have the assembled shape {shape}")
    # pieces
    total = 1
    for x in shape:
        total *= x
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


@_no_gc()
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

    Cost is linear in recipes + outputs + destination tensors: outputs are grouped by
    (tensor, rank set) first, so DP replicas and TP-replicated tensors are checked once.
    """
    probs = _Problems()
    srcs = {k: _src_meta(v) for k, v in sources.items()}
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
        n = 1
        for x in d.shape:
            n *= x
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
