"""The recipe builder shared by the per-family rules: one constructor per tensor kind.

A :class:`RecipeBuilder` accumulates the :class:`~weight_transfer.types.Recipe` list of one
(model, inference layout). Its methods are the shard rules every family uses (vLLM's
``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding`` / replicated
tensors, see ``docs/LAYOUTS.md``); the per-family modules (:mod:`.dense`, :mod:`.moe`,
:mod:`.mla`) call them with their tensor names, as torchtitan's per-model state-dict adapters do.

Under ``quant="fp8"`` :meth:`RecipeBuilder.linear` makes an ``"fp8_block"`` recipe assembled
in BF16 with two outputs (the ``float8_e4m3fn`` weight and its float32 ``weight_scale_inv`` of
:func:`weight_transfer.convert.quant.scale_shape`); everything else is a ``"copy"`` in ``layout.dtype``.
"""
from __future__ import annotations

from ...convert.quant import cdiv, scale_shape
from ...model_config import ModelConfig
from ...types import InferenceLayout, Output, Piece, PlanError, Recipe, full_box

VOCAB_PAD = 64
"""vLLM pads the vocabulary to a multiple of 64 rows (``pad_vocab_size``)."""

FP8 = "float8_e4m3fn"
F32 = "float32"
BF16 = "bfloat16"


class RecipeBuilder:
    """Accumulates recipes for one (cfg, layout); one constructor per tensor kind.

    ``T`` is the TP size of the non-expert tensors, ``tp_ranks[r]`` the inference ranks holding
    their TP rank ``r`` (one per DP replica); ``TE`` and ``ep_ranks[r]`` the same for the routed
    experts (EP or TP over the layout's ``tp`` ranks). They agree except under data-parallel
    attention (:attr:`InferenceLayout.dp_attention`): then ``T = 1`` and ``tp_ranks[0]`` is every
    inference rank (non-expert tensors whole everywhere). ``all_ranks`` is every inference
    rank. Errors: :class:`PlanError` naming the tensor and sizes when the layout does not
    divide the model."""

    def __init__(self, cfg: ModelConfig, layout: InferenceLayout):
        self.cfg = cfg
        self.L = layout
        self.fp8 = layout.quant == "fp8"
        self.dtype = layout.dtype
        self.all_ranks = tuple(range(layout.world_size))
        self.TE = layout.tp
        self.ep_ranks = [layout.ranks_of_tp_rank(r) for r in range(self.TE)]
        self.T = layout.dense_tp
        self.tp_ranks = [self.all_ranks] if layout.dp_attention else self.ep_ranks
        self.recipes: list[Recipe] = []
        self.rename: tuple[str, str] | None = None
        """``(source prefix, destination prefix)`` while the rules of one layer are reused for a
        module vLLM names differently (the MTP layer's ``mtp_block``, :mod:`.mtp`): every
        destination tensor (and recipe name) starting with the source prefix gets the
        destination prefix instead; the pieces keep the checkpoint names."""

    def dest(self, name: str) -> str:
        """Destination name of the rules' tensor ``name`` under :attr:`rename`."""
        r = self.rename
        return r[1] + name[len(r[0]):] if r is not None and name.startswith(r[0]) else name

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
        dest = self.dest(dest)
        self.recipes.append(
            Recipe(
                self.dest(name) if name else dest,
                ranks,
                shape,
                dt,
                tuple(pieces),
                "copy",
                (Output(dest, full_box(shape), dt),),
            )
        )

    def linear(self, base: str, ranks, shape, pieces, *, name: str):
        """A linear layer's weight ``base + '.weight'`` (full destination tensor)."""
        if not self.fp8:
            self.copy(base + ".weight", ranks, shape, pieces, name=name)
            return
        N, K = shape
        sshape = scale_shape(shape)
        base = self.dest(base)
        self.recipes.append(
            Recipe(
                self.dest(name),
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
        base = self.dest(base)
        wname = f"{base}.{which}_weight"
        nk = ((0, N), (0, K))
        if not self.fp8:
            dt = self.dtype
            return lambda j: (Output(wname, ((j, j + 1),) + nk, dt),)
        sname = f"{base}.{which}_weight_scale_inv"
        sb = full_box(scale_shape((N, K)))
        return lambda j: (Output(wname, ((j, j + 1),) + nk, FP8), Output(sname, ((j, j + 1),) + sb, F32))

    def replicated(self, name: str, shape, *, dtype: str | None = None):
        """A tensor copied whole to every rank under the same name (norms, router)."""
        self.copy(name, self.all_ranks, shape, (Piece(name, full_box(shape), full_box(shape)),), dtype=dtype)

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

    def vocab(self, name: str):
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        Vp = cdiv(V, VOCAB_PAD) * VOCAB_PAD
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
