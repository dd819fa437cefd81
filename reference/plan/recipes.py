"""Recipes: Hugging Face checkpoint names -> the inference engine's tensors.

For a model (:class:`~weight_transfer.model_config.ModelConfig`) and an inference world
(:class:`~weight_transfer.types.InferenceLayout`) :func:`build_recipes` says, for every parameter
tensor of every inference rank, which checkpoint tensors (and which slices of them) it is made
of, and how it is transformed on the way (a cast, or FP8 block quantization). The rules are the
ones of ``docs/LAYOUTS.md`` (vLLM's names and shard rules), one module per model family in
:mod:`weight_transfer.plan.rules`; they are written from that document alone, independently of
``engines/`` (the oracle they are verified against). This module walks a model's layers and
calls them, and derives what follows from the recipes: fusion groups (the unit a trainer
materializes together) and the destination tensors they imply.

Granularity
-----------
One :class:`~weight_transfer.types.Recipe` per (destination tensor, distinct content):

- a TP-sharded tensor gets one recipe per TP rank; the DP replicas of that TP rank are extra
  ``ranks`` of the same recipe;
- a replicated tensor (norms, router, MLA's ``fused_qkv_a_proj``) is one recipe whose ``ranks``
  are every inference rank;
- MoE experts get one recipe per expert slot (the box ``[j:j+1, :, :]`` of ``w13_weight`` /
  ``w2_weight``, and the matching box of the ``*_scale_inv`` tensor under FP8); the assembled
  shape is ``[1, N, K]`` and the 2-D source slices fill it (a piece's ``dst_box`` may have extra
  leading dims of extent 1, see :mod:`weight_transfer.convert.transforms`);
- vocab padding rows (``Vp = ceil(V/64)*64``) are a zero :class:`~weight_transfer.types.Piece`.

Under ``quant="fp8"`` every linear weight is an ``"fp8_block"`` recipe assembled in BF16 (the
sources are cast to BF16 first, then quantized) with two outputs: the ``float8_e4m3fn`` weight
and its float32 ``weight_scale_inv``. Everything else is a ``"copy"`` recipe assembled and
written in ``layout.dtype`` (float32 for DeepSeek's ``e_score_correction_bias``).

Invariants every recipe here satisfies (and :func:`weight_transfer.plan.checks.validate` checks):
``outputs[0].box`` has the shape ``recipe.shape``; every output box is flat-contiguous in its
destination tensor (one byte range per receiving rank); the pieces' ``dst_box`` cover
``recipe.shape`` exactly once.

Beyond LAYOUTS.md (vLLM's rule, documented in :mod:`weight_transfer.plan.rules.mla`): MLA without
``q_lora_rank`` gets a row-sharded ``self_attn.q_proj.weight`` and a replicated, unfused
``self_attn.kv_a_proj_with_mqa.weight``.

Example::

    cfg = load_config("qwen3-0.6b", num_hidden_layers=2)
    rs = build_recipes(cfg, InferenceLayout(tp=2))
    validate(rs, {p.name: (p.shape, p.dtype) for p in param_specs(cfg)}, dests)  # weight_transfer.plan.checks
"""
from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from ..convert.quant import QUANT_BLOCK, cdiv
from ..model_config import ModelConfig
from ..types import DestTensorMeta, InferenceLayout, PlanError, Recipe, itemsize, numel
from .rules import mtp
from .rules.base import VOCAB_PAD, RecipeBuilder
from .rules.layer import decoder_layer

__all__ = [
    "RecipeSet",
    "build_recipes",
    "fusion_groups",
    "expected_dest_shapes",
    "expected_dests",
    "make_dest_metas",
    "VOCAB_PAD",
    "QUANT_BLOCK",
]


class RecipeSet:
    """The recipes of one (model, layout), plus the training tensors deliberately left unused.

    ``recipes`` are in checkpoint order of their first source. ``ignored`` names training-side
    tensors that map nowhere on purpose (see :func:`build_recipes`); :func:`~weight_transfer.plan.checks.validate` refuses
    any other unused source. ``kept`` names engine tensors no recipe writes on purpose: the
    quantization state (KV-cache, activation scales) an engine keeps at its own value when the
    trainer does not hold it (recipes traced from a block-FP8 loader); the plan line names them.
    Lookups (:meth:`for_source`, :meth:`for_rank`) are built lazily.
    """

    __slots__ = ("recipes", "ignored", "shared", "layout", "model", "kept", "_by_source", "_by_rank")

    def __init__(
        self,
        recipes: Sequence[Recipe],
        ignored: Iterable[str] = (),
        *,
        layout: InferenceLayout | None = None,
        model: str = "",
        kept: Iterable[str] = (),
        shared: Mapping[str, str] | None = None,
    ):
        self.recipes: tuple[Recipe, ...] = tuple(recipes)
        self.ignored: frozenset[str] = frozenset(ignored)
        self.shared: dict[str, str] = dict(shared or {})
        """Training tensor -> the destination tensor that serves it, for tensors a draft model
        shares with the target (:func:`weight_transfer.plan.rules.mtp.shared_sources`): written
        once, as the target's; each is also in :attr:`ignored` when the trainer holds it."""
        self.layout = layout
        self.model = model
        self.kept: tuple[str, ...] = tuple(kept)
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


def _build(b: RecipeBuilder) -> list[Recipe]:
    """Every recipe of ``b``'s (model, layout), in checkpoint order: embeddings, per layer its
    norms, attention (:mod:`.rules.mla` or :mod:`.rules.dense`) and MLP (:mod:`.rules.moe` or
    :mod:`.rules.dense`), the final norm, an untied ``lm_head``; under ``layout.draft="mtp"`` the
    draft's MTP layers last (:mod:`.rules.mtp`)."""
    cfg = b.cfg
    H = cfg.hidden_size
    b.vocab("model.embed_tokens.weight")
    for i in range(cfg.num_layers):
        decoder_layer(b, f"model.layers.{i}", i)
    b.replicated("model.norm.weight", (H,))
    if not cfg.tie_word_embeddings:
        b.vocab("lm_head.weight")
    if b.L.draft == "mtp":
        mtp.draft_layers(b)
    return b.recipes


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def _ignorable(cfg: ModelConfig, name: str, layout: InferenceLayout | None = None) -> bool:
    """Training tensors vLLM's loaders skip on purpose (so may be unused without error): with a
    draft (``layout.draft="mtp"``) only the MTP tensors the draft shares with the target."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return True  # tied: vLLM's lm_head *is* embed_tokens; a saved copy is skipped
    if layout is not None and layout.draft == "mtp":
        return name in mtp.shared_sources(cfg)  # served by the target's tensor (vLLM's proposer)
    if cfg.is_mla:  # DeepSeek multi-token-prediction layers are loaded separately, by a draft model
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
    saved ``lm_head.weight``, ``rotary_emb.inv_freq``, DeepSeek MTP layers without a draft; with
    ``layout.draft="mtp"`` the MTP layers are planned (:mod:`.rules.mtp`) and only their
    ``embed_tokens`` / ``shared_head.head``, which vLLM serves with the target's tensors, are
    ignored, and listed in :attr:`RecipeSet.shared`). Any other unused
    tensor is left for :func:`weight_transfer.plan.checks.validate` to refuse (C2). Source dtypes do
    not change the recipes: every source is cast to the assembled dtype (a planned cast,
    checked by :func:`weight_transfer.plan.checks.validate`).

    Raises :class:`PlanError` naming the tensor and sizes when the layout does not divide the
    model (heads, intermediate sizes, experts, padded vocab), and for an architecture without
    hand-written rules (``cfg.hand_written`` False): those are planned from recipes traced from
    vLLM's loader (:func:`weight_transfer.plan.traced.recipes_from_traces`), and for per-tensor /
    per-channel FP8 (``"fp8-tensor"``, ``"fp8-channel"``), planned from traces only.
    """
    if layout.quant not in (None, "fp8"):
        raise PlanError(f"model {cfg.label}: quant {layout.quant!r}: the hand-written rules know BF16 and block FP8 "
                        "('fp8'); per-tensor / per-channel FP8 is planned from vLLM's traced loader only")
    if layout.draft == "mtp" and not (cfg.is_mla and cfg.get("num_nextn_predict_layers")):
        raise PlanError(f"model {cfg.label}: draft 'mtp' needs DeepSeek-V3-style MTP layers (num_nextn_predict_layers "
                        f">= 1, DeepseekV3ForCausalLM); it has architecture {cfg.architecture}, "
                        f"num_nextn_predict_layers={cfg.get('num_nextn_predict_layers')!r}")
    if not cfg.hand_written:
        from ..model_config import ARCHITECTURES

        raise PlanError(f"model {cfg.label}: architecture {cfg.architecture!r} has no hand-written recipes "
                        f"({', '.join(ARCHITECTURES)}) and no inference rank published recipes traced from "
                        "vLLM's loader (the vLLM backend's workers do; a stand-in engine cannot)")
    recipes = _build(RecipeBuilder(cfg, layout))
    ignored: frozenset[str] = frozenset()
    if source_dtypes:
        used = set()
        for r in recipes:
            for pc in r.pieces:
                used.add(pc.source)
        ignored = frozenset(n for n in source_dtypes if n not in used and _ignorable(cfg, n, layout))
    shared = mtp.shared_sources(cfg) if layout.draft == "mtp" else None
    if shared and not source_dtypes:  # declared whether or not the trainer holds them (served by the target's)
        ignored = frozenset(shared)
    return RecipeSet(recipes, ignored, layout=layout, model=cfg.label, shared=shared)


# ============================================================================================
# fusion groups


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


def make_dest_metas(
    shapes: Mapping[tuple[int, str], tuple[tuple[int, ...], str]], align: int = 16
) -> dict[tuple[int, str], DestTensorMeta]:
    """Lay ``(rank, name) -> (shape, dtype)`` out back to back per rank (offsets aligned to
    ``align`` bytes, in the mapping's order), as an engine's arena would. For tests and
    simulation; a real engine publishes its own :class:`DestTensorMeta`."""
    offs: dict[int, int] = defaultdict(int)
    out = {}
    for (rank, name), (shape, dt) in shapes.items():
        nbytes = numel(shape) * itemsize(dt)
        off = cdiv(offs[rank], align) * align
        out[(rank, name)] = DestTensorMeta(rank=rank, name=name, shape=tuple(shape), dtype=dt, offset=off, nbytes=nbytes)
        offs[rank] = off + nbytes
    return out
