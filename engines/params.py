"""One inference rank's parameter list in the stand-in engine: vLLM's names, module order and
load-time shapes for a model and a layout, and their offsets in the rank's arena.

:class:`_Builder` writes the hand-written rules (Qwen3 dense and MoE, DeepSeek-V3 / Kimi-K2 MLA,
block FP8); an architecture without them takes vLLM's traced loader (:func:`_traced_params`).
:func:`_plan` lays the parameters out 16-byte aligned; :class:`weight_transfer.engines.Engine`
allocates its arena from it and :func:`engine_tensor_metas` returns the same metadata without
allocating. See :mod:`weight_transfer.engines.engine` for the vLLM behaviour matched.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from weight_transfer.model_config import ModelConfig
from weight_transfer.types import DestTensorMeta, InferenceLayout, torch_dtype

ALIGN = 16
"""Byte alignment of every tensor's offset in the arena."""
VOCAB_PAD = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: vocab rows are padded to a multiple of this."""
FP8_BLOCK = 128
"""Block size of block FP8: one float32 ``weight_scale_inv`` per ``FP8_BLOCK x FP8_BLOCK`` block."""


@dataclass(slots=True)
class _Param:
    """One engine tensor: its vLLM name, local shape, dtype, how checkpoint tensors load into
    it (``kind`` + ``info``) and which shards must be loaded for it to be complete."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    """replicated | vocab | column | row | merged | qkv | w13 | w2 | scale"""
    info: dict = field(default_factory=dict)
    shards: frozenset = frozenset({None})
    """Shard keys a full load writes (``None`` for a plain tensor)."""
    quantized: bool = False
    """FP8 weight: loads go to a BF16 staging tensor, quantized after loading."""


def _div(tensor: str, what: str, a: int, b: int) -> int:
    if b <= 0 or a % b:
        raise ValueError(f"{tensor}: {what}={a} is not divisible by tp={b}")
    return a // b


class _Builder:
    """Builds one rank's ordered parameter list (vLLM module order)."""

    def __init__(self, cfg: ModelConfig, layout: InferenceLayout, tp_rank: int):
        # non-expert tensors: TP rank r of T (data-parallel attention: whole, as rank 0 of 1);
        # routed experts: EP / TP over the layout's tp ranks (self.er of self.ET)
        self.cfg, self.layout = cfg, layout
        self.er, self.ET = tp_rank, layout.tp
        self.r, self.T = (0, 1) if layout.dp_attention else (tp_rank, layout.tp)
        self.fp8 = layout.quant == "fp8"
        self.dt = layout.dtype
        self.params: list[_Param] = []

    # generic adders ---------------------------------------------------------------------------
    def plain(self, name, shape, kind="replicated", dtype=None, **info):
        self.params.append(_Param(name, tuple(shape), dtype or self.dt, kind, info))

    def linear(self, name, shape, kind, shards=frozenset({None}), **info):
        """A linear layer's ``weight`` (+ FP8 ``weight_scale_inv``)."""
        n, k = shape
        w = f"{name}.weight"
        if self.fp8:
            self.params.append(_Param(w, (n, k), "float8_e4m3fn", kind, info, frozenset(shards), True))
            self.params.append(_Param(f"{name}.weight_scale_inv",
                                      (math.ceil(n / FP8_BLOCK), math.ceil(k / FP8_BLOCK)),
                                      "float32", "scale", {"weight": w}))
        else:
            self.params.append(_Param(w, (n, k), self.dt, kind, info, frozenset(shards)))

    def mlp(self, p: str, inter: int):
        """Dense (or shared-expert) MLP: MergedColumnParallel gate_up + RowParallel down."""
        H = self.cfg.hidden_size
        il = _div(f"{p}.gate_up_proj.weight", "intermediate_size", inter, self.T)
        self.linear(f"{p}.gate_up_proj", (2 * il, H), "merged", {0, 1},
                    sizes=(inter, inter), in_features=H)
        self.linear(f"{p}.down_proj", (H, il), "row", full=(H, inter))

    # architecture pieces -------------------------------------------------------------------
    def qwen3_attn(self, p: str):
        cfg, T, H = self.cfg, self.T, self.cfg.hidden_size
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = f"{p}.qkv_proj.weight"
        nhl = _div(qkv, "num_attention_heads", nh, T)
        if T <= nkv:
            kvr = _div(qkv, "num_key_value_heads", nkv, T)
            replicas = 1
        else:
            if T % nkv:
                raise ValueError(f"{qkv}: tp={T} > num_key_value_heads={nkv} and tp is not a "
                                 f"multiple of it (KV heads cannot be replicated evenly)")
            kvr, replicas = 1, T // nkv
        self.linear(f"{p}.qkv_proj", ((nhl + 2 * kvr) * hd, H), "qkv", {"q", "k", "v"},
                    nh=nh, nkv=nkv, hd=hd, nhl=nhl, kvr=kvr, replicas=replicas, in_features=H)
        self.linear(f"{p}.o_proj", (H, nhl * hd), "row", full=(H, nh * hd))
        self.plain(f"{p}.q_norm.weight", (hd,))
        self.plain(f"{p}.k_norm.weight", (hd,))

    def mla_attn(self, p: str):
        cfg, T, H = self.cfg, self.T, self.cfg.hidden_size
        nh = cfg.num_heads
        qlr, kvlr = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
        nope, rope, vd = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
        qk = nope + rope
        if qlr:
            nhl = _div(f"{p}.q_b_proj.weight", "num_attention_heads", nh, T)
            self.linear(f"{p}.fused_qkv_a_proj", (qlr + kvlr + rope, H), "merged_replicated",
                        {0, 1}, sizes=(qlr, kvlr + rope), in_features=H)
            self.plain(f"{p}.q_a_layernorm.weight", (qlr,))
            self.linear(f"{p}.q_b_proj", (nhl * qk, qlr), "column", full=(nh * qk, qlr))
        else:
            nhl = _div(f"{p}.q_proj.weight", "num_attention_heads", nh, T)
            self.linear(f"{p}.q_proj", (nhl * qk, H), "column", full=(nh * qk, H))
            self.linear(f"{p}.kv_a_proj_with_mqa", (kvlr + rope, H), "replicated")
        self.plain(f"{p}.kv_a_layernorm.weight", (kvlr,))
        self.linear(f"{p}.kv_b_proj", (nhl * (nope + vd), kvlr), "column", full=(nh * (nope + vd), kvlr))
        self.linear(f"{p}.o_proj", (H, nhl * vd), "row", full=(H, nh * vd))

    def moe(self, p: str):
        cfg, T, H = self.cfg, self.ET, self.cfg.hidden_size
        E, mI, S = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_shared_experts
        self.plain(f"{p}.gate.weight", (E, H))
        if cfg.is_mla:
            self.plain(f"{p}.gate.e_score_correction_bias", (E,), dtype="float32")
        if S:
            self.mlp(f"{p}.shared_experts", S * mI)
        w13, w2 = f"{p}.experts.routed_experts.w13_weight", f"{p}.experts.routed_experts.w2_weight"
        if self.layout.ep:
            el = _div(w13, "num_experts", E, T)
            first, il = self.er * el, mI
        else:
            el, first = E, 0
            il = _div(w13, "moe_intermediate_size", mI, T)
        local = range(first, first + el)
        info = dict(E=E, el=el, first=first, il=il, mI=mI, H=H, tp_slice=not self.layout.ep)
        wdt = "float8_e4m3fn" if self.fp8 else self.dt
        self.params.append(_Param(w13, (el, 2 * il, H), wdt, "w13", info,
                                  frozenset((e, s) for e in local for s in ("w1", "w3")), self.fp8))
        self.params.append(_Param(w2, (el, H, il), wdt, "w2", info,
                                  frozenset((e, "w2") for e in local), self.fp8))
        if self.fp8:
            b = FP8_BLOCK
            self.params.append(_Param(f"{w13}_scale_inv", (el, math.ceil(2 * il / b), math.ceil(H / b)),
                                      "float32", "scale", {"weight": w13}))
            self.params.append(_Param(f"{w2}_scale_inv", (el, math.ceil(H / b), math.ceil(il / b)),
                                      "float32", "scale", {"weight": w2}))

    def vocab(self, name: str):
        V, H = self.cfg.vocab_size, self.cfg.hidden_size
        vp = math.ceil(V / VOCAB_PAD) * VOCAB_PAD
        vl = _div(name, "padded vocab_size", vp, self.T)
        self.plain(name, (vl, H), "vocab", V=V, start=self.r * vl)

    def layer(self, p: str, i: int) -> None:
        """Decoder layer ``i``'s tensors under the name prefix ``p`` (an MTP block's too)."""
        cfg, H = self.cfg, self.cfg.hidden_size
        if cfg.is_mla:
            self.mla_attn(f"{p}.self_attn")
        else:
            self.qwen3_attn(f"{p}.self_attn")
        if cfg.is_moe_layer(i):
            self.moe(f"{p}.mlp")
        else:
            self.mlp(f"{p}.mlp", cfg["intermediate_size"])
        self.plain(f"{p}.input_layernorm.weight", (H,))
        self.plain(f"{p}.post_attention_layernorm.weight", (H,))

    def build(self) -> list[_Param]:
        cfg, H = self.cfg, self.cfg.hidden_size
        self.vocab("model.embed_tokens.weight")
        for i in range(cfg.num_layers):
            self.layer(f"model.layers.{i}", i)
        self.plain("model.norm.weight", (H,))
        if not cfg.tie_word_embeddings:
            self.vocab("lm_head.weight")
        if self.layout.draft == "mtp":  # the speculative-decoding draft, after the target
            from .draft import add_params

            add_params(self)
        return self.params


def _plan(cfg: ModelConfig, layout: InferenceLayout, rank: int) -> list[tuple[_Param, int, int]]:
    """``(param, byte offset, nbytes)`` per tensor of ``rank``, in order, offsets 16-aligned."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} out of range for layout {layout.describe()} "
                         f"({layout.world_size} ranks)")
    out, off = [], 0
    params = _Builder(cfg, layout, rank % layout.tp).build() if cfg.hand_written else _traced_params(cfg, layout, rank)
    for p in params:
        off = -(-off // ALIGN) * ALIGN
        nbytes = math.prod(p.shape) * torch_dtype(p.dtype).itemsize
        out.append((p, off, nbytes))
        off += nbytes
    return out


def _traced_params(cfg: ModelConfig, layout: InferenceLayout, rank: int) -> list[_Param]:
    """An architecture without hand-written rules (C29): the parameters of ``rank`` as vLLM's
    own loader fills them (names, load-time shapes and dtypes, in the loader's order), from the
    trace of :func:`weight_transfer.engines.vllm.trace.cache.cached_traces` (needs vLLM). ValueError
    naming what the trace refused."""
    from .vllm.engine import vllm_available

    if not vllm_available():
        raise ValueError(f"model {cfg.label}: architecture {cfg.architecture!r} has no stand-in rules; its "
                         "parameters come from vLLM's traced loader and vLLM is not installed (make vllm)")
    from .vllm.trace.cache import cached_traces

    t = cached_traces(cfg, layout)[rank]
    if t.error or t.refused:
        raise ValueError(f"model {cfg.label}: vLLM's loader was not traced cleanly on inference rank {rank}: "
                         + (t.error or "; ".join(f"{k}: {v}" for k, v in sorted(t.refused.items())[:3])))
    return [_Param(n, tuple(tp.shape), tp.dtype, "traced") for n, tp in t.params.items()]


def engine_tensor_metas(cfg: ModelConfig, layout: InferenceLayout, rank: int) -> list[DestTensorMeta]:
    """What :meth:`Engine.tensor_metas` returns, computed without allocating the arena (for
    planning at the scale of Kimi-K2, where one rank's arena is many GB)."""
    return [DestTensorMeta(rank=rank, name=p.name, shape=p.shape, dtype=p.dtype, offset=o, nbytes=n)
            for p, o, n in _plan(cfg, layout, rank)]
