"""Named at-scale configurations: functions returning a :class:`SimConfig`, named after model
and hardware (torchtitan style). ``weight-transfer simulate --list`` shows them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from weight_transfer.types import InferenceLayout

from .hardware import Hardware, h20_cx7, h100_cx7, h200_efa

METHODS = ("reference", "overlapped_writes", "rank0_funnel", "nccl_broadcast_funnel", "rpc_update_weight", "ckpt_engine_broadcast",
           "sglang_pp_broadcast")


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One simulated cluster and what to predict on it."""

    name: str
    model: str
    """Catalog name (reference/testing/configs/<model>.json)."""
    overrides: dict = field(default_factory=dict)
    """HF-config overrides (small variants for tests)."""
    train_nodes: int = 32
    """Training nodes; ranks = train_nodes x hardware.gpus_per_node."""
    train_layout: str = "two_group"
    """``two_group`` (weight_transfer.testing.training.two_group_mesh_for) or ``expert_whole``
    (experiments/sim/metadata.py)."""
    moe_width: int | None = None
    """MoE mesh width of ``two_group``: training nodes each routed expert is FSDP-sharded
    across (None: all ``train_nodes``). Not published for the anchors: see docs/SIMULATION.md."""
    label: str = ""
    """What the row is, in words, with what is assumed (printed and in the CSV)."""
    calibration: str = "comparison"
    """``"like-for-like"`` when every input the model takes is stated by the anchor's source
    (none is fitted either way), else ``"comparison"`` (the note says what is assumed)."""
    offloaded: bool = False
    """Training shards live in host memory (ParamMeta.offloaded): an h2d stage per task."""
    layout: InferenceLayout = field(default_factory=lambda: InferenceLayout(tp=16, dp=8, ep=True, quant="fp8"))
    hardware: Hardware = field(default_factory=h100_cx7)
    infer_hardware: Hardware | None = None
    """Inference nodes' hardware when it differs (only its NIC rate matters here)."""
    watermark: int | None = 8 << 30
    """Executor temporary-memory bound per training rank, bytes (assumption: 8 GiB of an
    80 GB H100 left to the transfer)."""
    max_chunk_bytes: int = 64 << 20
    """Planner: recipe outputs above this are split into row bands (bytes)."""
    local_writes: bool = True
    """Planner: shard-local prepare (this project's default: copies, fused bands and 128-row
    aligned FP8 blocks made from the ranks' own shards, no ``full_tensor()``); False:
    ``full_tensor()`` of every source, as the published executor does ("MoE full_tensor() is
    visibly slower", 2025-09-17 post). ``simulate --gather-all``."""
    methods: tuple[str, ...] = ("reference", "overlapped_writes", "rank0_funnel", "nccl_broadcast_funnel", "rpc_update_weight")
    """``reference``: the schedule through this project's executor (one task's writes in flight
    per rank); ``overlapped_writes``: the same schedule through the published executor's write
    semantics (every prepared task's writes in flight, bounded by the watermark;
    :data:`weight_transfer.experiments.sim.model.WRITES_IN_FLIGHT`); the others are baselines."""
    anchors: dict = field(default_factory=dict)
    """method -> (published seconds, source): the calibration anchors (``overlapped_writes``
    shares ``reference``'s unless given)."""
    note: str = ""

    def __post_init__(self):
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"SimConfig {self.name}: unknown methods {bad}; known: {', '.join(METHODS)}")
        if self.train_nodes < 1:
            raise ValueError(f"SimConfig {self.name}: train_nodes must be >= 1")
        if self.moe_width is not None and (self.moe_width < 1 or self.train_nodes % self.moe_width):
            raise ValueError(f"SimConfig {self.name}: MoE mesh width {self.moe_width} must divide train_nodes={self.train_nodes}")
        if self.calibration not in ("like-for-like", "comparison"):
            raise ValueError(f"SimConfig {self.name}: calibration must be 'like-for-like' or 'comparison'")

    def anchor(self, method: str):
        """(published seconds, source) for ``method``, or None."""
        got = self.anchors.get(method)
        if got is None and method == "overlapped_writes":
            got = self.anchors.get("reference")
        return got

    @property
    def n_train(self) -> int:
        return self.train_nodes * self.hardware.gpus_per_node

    @property
    def n_infer(self) -> int:
        return self.layout.world_size

    @property
    def train_layout_text(self) -> str:
        if self.train_layout != "two_group":
            return self.train_layout
        w = self.moe_width or self.train_nodes
        return f"two_group, MoE mesh width {w} node(s)"


PPLX = "Perplexity, 'Weight Transfer for RL Post-Training in under 2 seconds' (research.perplexity.ai, Sep 2025)"
PPLX_K2 = ("Lequn Chen, le.qun.ch/en/blog/2025/09/17/rl-weight-transfer-2: Kimi-K2, 256 BF16 training GPUs -> 128 FP8 "
           "inference GPUs, 'a bit over 1.2 seconds' in the profile, '< 1.3 s'")
PPLX_QWEN = ("Lequn Chen, le.qun.ch/en/blog/2025/09/07/rl-weight-transfer: Qwen3-235B, 128 -> 32 H200 on AWS EFA, "
             "FP8 inference, data-parallel attention + expert parallelism, 1.69-1.70 s in production (as quoted in "
             "issue #16)")
LMSYS = ("lmsys.org/blog/2026-04-29-p2p-update: Kimi-K2 NCCL-broadcast update 53 s (Megatron TP8/PP8/CP4/EP32 -> SGLang "
         "TP32/EP32, per issue #16); mechanism per jd-unleashed.com/blog/rdma-transfer")
CKPT = "MoonshotAI checkpoint-engine README: Kimi-K2 FP8, 256 x H20, broadcast, 8 GiB buckets"


def kimi_k2_256xh100_to_128xh100_fp8() -> SimConfig:
    """Kimi-K2, MoE mesh width 32 (the widest reading of the two mesh groups), 8 x TP16 on
    ConnectX-7: excluded by its own floor."""
    return SimConfig(name="kimi_k2_256xh100_to_128xh100_fp8", model="kimi-k2", moe_width=32,
                     label="widest reading: experts FSDP-sharded across all 32 training nodes (MoE width 32); "
                           "8 x TP16+EP inference (unsourced); H100 + ConnectX-7 -- excluded by its floor",
                     methods=("reference", "overlapped_writes", "rank0_funnel", "nccl_broadcast_funnel",
                              "rpc_update_weight"),
                     anchors={"reference": (1.25, PPLX_K2)})


PPLX_EFA = ("Perplexity, research.perplexity.ai/articles/enabling-trillion-parameter-models-on-aws-efa (and arXiv "
            "2510.27656): Kimi-K2 does not fit one 8 x H200 node with room for KV caches, so it is served multi-node with "
            "expert parallelism on AWS EFA")


def kimi_k2_256xh200efa_to_128_dpa_ep32() -> SimConfig:
    """Headline: Kimi-K2 256 -> 128 in the most plausible published layout: H200 + EFA, MoE
    mesh width 2, 4 instances of data-parallel attention + EP32, FP8."""
    return SimConfig(name="kimi_k2_256xh200efa_to_128_dpa_ep32", model="kimi-k2", moe_width=2, hardware=h200_efa(),
                     layout=InferenceLayout(tp=32, dp=4, ep=True, quant="fp8", dp_attention=True),
                     label="most plausible published layout: H200 + EFA (the posts' cluster); data-parallel attention + "
                           "multi-node EP (Perplexity's engine and EFA kernels); EP32 = smallest multi-node EP whose "
                           "floor is below the published time (EP16 x 8: 78 GB per GPU, floor 1.55 s); MoE width 2 "
                           "(smallest width whose MoE full_tensor() crosses the fabric, as the profile shows)",
                     anchors={"reference": (1.25, PPLX_K2)})


def kimi_k2_256xh200efa_to_128_dpa_ep16() -> SimConfig:
    """Kimi-K2 on H200 + EFA, 8 x (data-parallel attention + EP16), MoE width 2: excluded by
    its floor (78 GB into every inference GPU)."""
    return SimConfig(name="kimi_k2_256xh200efa_to_128_dpa_ep16", model="kimi-k2", moe_width=2, hardware=h200_efa(),
                     layout=InferenceLayout(tp=16, dp=8, ep=True, quant="fp8", dp_attention=True),
                     label="8 x (DP attention + EP16) FP8 on H200 + EFA, MoE width 2 -- excluded by its floor: every "
                           "inference GPU receives 78 GB (64 GB of experts + 13 GB replicated), 1.55 s at line rate",
                     anchors={"reference": (1.25, PPLX_K2)})


def kimi_k2_256xh200efa_to_128_dpa_ep64() -> SimConfig:
    """Kimi-K2 on H200 + EFA, 2 x (data-parallel attention + EP64), MoE width 2 (a map cell run
    at full size)."""
    return SimConfig(name="kimi_k2_256xh200efa_to_128_dpa_ep64", model="kimi-k2", moe_width=2, hardware=h200_efa(),
                     layout=InferenceLayout(tp=64, dp=2, ep=True, quant="fp8", dp_attention=True),
                     label="2 x (DP attention + EP64) FP8 on H200 + EFA, MoE width 2 (map cell at full size)",
                     anchors={"reference": (1.25, PPLX_K2)})


def kimi_k2_256xh200efa_to_128_dpa_ep128() -> SimConfig:
    """Kimi-K2 on H200 + EFA, one instance of data-parallel attention + EP128, MoE width 2 (a
    map cell run at full size)."""
    return SimConfig(name="kimi_k2_256xh200efa_to_128_dpa_ep128", model="kimi-k2", moe_width=2, hardware=h200_efa(),
                     layout=InferenceLayout(tp=128, dp=1, ep=True, quant="fp8", dp_attention=True),
                     label="1 x (DP attention + EP128) FP8 on H200 + EFA, MoE width 2 (map cell at full size)",
                     anchors={"reference": (1.25, PPLX_K2)})


def kimi_k2_256xh100_to_128xh100_fp8_expert_whole() -> SimConfig:
    """Same cluster, experts held whole by one training GPU each (expert-parallel storage):
    ``full_tensor()`` of an expert moves nothing."""
    return SimConfig(name="kimi_k2_256xh100_to_128xh100_fp8_expert_whole", model="kimi-k2",
                     train_layout="expert_whole", methods=("reference",), anchors={"reference": (1.25, PPLX_K2)},
                     label="experts whole per training GPU (not the published two mesh groups); 8 x TP16+EP; H100 + CX-7")


def kimi_k2_256xh100_to_128xh100_fp8_offload() -> SimConfig:
    """The MoE-width-32 cluster with the training shards offloaded to host memory (h2d stage)."""
    return SimConfig(name="kimi_k2_256xh100_to_128xh100_fp8_offload", model="kimi-k2", offloaded=True, moe_width=32,
                     methods=("reference",), anchors={"reference": (1.25, PPLX_K2)},
                     label="as kimi_k2_256xh100_to_128xh100_fp8, shards offloaded to host memory")


def qwen3_235b_128_to_32() -> SimConfig:
    """Qwen3-235B 128 -> 32 in an assumed layout (4 x TP8+EP, BF16, H100 + CX-7): not the
    published one (see qwen3_235b_128xh200efa_to_32_dpa_ep8)."""
    return SimConfig(name="qwen3_235b_128_to_32", model="qwen3-235b-a22b", train_nodes=16,
                     layout=InferenceLayout(tp=8, dp=4, ep=True), anchors={"reference": (1.7, PPLX_QWEN)},
                     label="assumed layout (not the published one): MoE width 16, 4 x TP8+EP BF16, H100 + CX-7")


def qwen3_235b_128xh200efa_to_32_dpa_ep8() -> SimConfig:
    """Acceptance: Qwen3-235B 128 -> 32, data-parallel attention + EP8 x 4, FP8, H200 + EFA,
    MoE mesh width 2."""
    return SimConfig(name="qwen3_235b_128xh200efa_to_32_dpa_ep8", model="qwen3-235b-a22b", train_nodes=16, moe_width=2,
                     hardware=h200_efa(), layout=InferenceLayout(tp=8, dp=4, ep=True, quant="fp8", dp_attention=True),
                     anchors={"reference": (1.7, PPLX_QWEN)},
                     label="the 09-07 post's layout: 4 x (DP attention + EP8) FP8 on H200 + EFA; MoE width 2 "
                           "(not published; same rule as the Kimi-K2 headline)")


def deepseek_v3_256xh100_to_128xh100_fp8() -> SimConfig:
    """DeepSeek-V3 (671B) on the Kimi-K2 cluster shape (no published anchor)."""
    return SimConfig(name="deepseek_v3_256xh100_to_128xh100_fp8", model="deepseek-v3", moe_width=32,
                     label="no anchor; MoE width 32, 8 x TP16+EP, H100 + CX-7")


def _with_mtp(base: SimConfig, assumed: str) -> SimConfig:
    """``base`` serving the MTP draft too (``layout.draft="mtp"``, issue 57 (3)): the trainer
    holds the MTP layer and the update writes it with the target; ``simulate`` also predicts
    ``base`` and prints what the draft adds (:mod:`~weight_transfer.experiments.sim.draft`)."""
    return replace(base, name=f"{base.name}_mtp", layout=replace(base.layout, draft="mtp"),
                   methods=("reference", "overlapped_writes"), anchors={},  # the published times are without a draft
                   overrides={**base.overrides, "num_nextn_predict_layers": 1},
                   label=f"{base.label}; + the MTP draft ({assumed})")


def kimi_k2_256xh100_to_128xh100_fp8_mtp() -> SimConfig:
    """kimi_k2_256xh100_to_128xh100_fp8 with a DeepSeek-V3-style MTP draft layer (hypothetical:
    Kimi-K2 ships none)."""
    return _with_mtp(kimi_k2_256xh100_to_128xh100_fp8(),
                     "hypothetical: Kimi-K2's config has num_nextn_predict_layers 0; one DeepSeek-V3-style layer at "
                     "Kimi-K2's sizes assumed")


def kimi_k2_256xh200efa_to_128_dpa_ep32_mtp() -> SimConfig:
    """The headline (kimi_k2_256xh200efa_to_128_dpa_ep32) with a DeepSeek-V3-style MTP draft layer
    (hypothetical: Kimi-K2 ships none); under data-parallel attention the draft's non-expert
    tensors are whole on every inference GPU."""
    return _with_mtp(kimi_k2_256xh200efa_to_128_dpa_ep32(),
                     "hypothetical: Kimi-K2's config has num_nextn_predict_layers 0; one DeepSeek-V3-style layer at "
                     "Kimi-K2's sizes assumed")


def deepseek_v3_256xh100_to_128xh100_fp8_mtp() -> SimConfig:
    """deepseek_v3_256xh100_to_128xh100_fp8 with its published MTP layer served as the draft."""
    return _with_mtp(deepseek_v3_256xh100_to_128xh100_fp8(), "DeepSeek-V3's published MTP layer, model.layers.61")


def kimi_k2_256xh20_ckpt_engine() -> SimConfig:
    """checkpoint-engine's published number: Kimi-K2 FP8 broadcast-updated on 256 H20
    (16 instances x TP16 assumed), 8 GiB buckets. The reference is not run (no training side
    in that setup)."""
    return SimConfig(name="kimi_k2_256xh20_ckpt_engine", model="kimi-k2", hardware=h20_cx7(),
                     layout=InferenceLayout(tp=16, dp=16, quant="fp8"), methods=("ckpt_engine_broadcast",),
                     anchors={"ckpt_engine_broadcast": (16.0, CKPT)},
                     label="checkpoint-engine broadcast, 8 GiB buckets, H2D-bound; H20 NICs and TP16 assumed")


def kimi_k2_sglang_megatron_pp8() -> SimConfig:
    """SGLang's NCCL broadcast from Megatron TP8/PP8/CP4/EP32 to SGLang TP32/EP32 (Kimi-K2):
    one broadcast per pipeline stage's head after TP/EP gathers. The reference is not run."""
    return SimConfig(name="kimi_k2_sglang_megatron_pp8", model="kimi-k2", moe_width=32,
                     layout=InferenceLayout(tp=32, dp=4, ep=True, quant="fp8"), methods=("sglang_pp_broadcast",),
                     anchors={"sglang_pp_broadcast": (53.3, LMSYS)},
                     label="per-PP-stage NCCL broadcast after TP8/EP32 gathers, BF16 on the wire; H100 + IB (CX-7 "
                           "rates assumed), 4 x TP32 inference and 1 GiB buckets assumed")


def tiny_qwen3_moe_2x2() -> SimConfig:
    """A small world for tests and a quick look: Qwen3-30B-A3B with 2 layers, 8 experts, 2x2
    training ranks, 2 x TP2 inference ranks."""
    return SimConfig(name="tiny_qwen3_moe_2x2", model="qwen3-30b-a3b",
                     overrides={"num_hidden_layers": 2, "num_experts": 8}, train_nodes=2,
                     hardware=Hardware(gpus_per_node=2, nics_per_node=2),
                     layout=InferenceLayout(tp=2, dp=2, quant="fp8"), watermark=256 << 20)


def tiny_deepseek_v3_mtp_2x2() -> SimConfig:
    """A small world with the MTP draft, for tests: DeepSeek-V3 with 2 layers (the first dense) and
    its MTP layer, 8 experts, 2x2 training ranks, 2 x TP2+EP FP8 inference ranks."""
    return SimConfig(name="tiny_deepseek_v3_mtp_2x2", model="deepseek-v3",
                     overrides={"num_hidden_layers": 2, "first_k_dense_replace": 1, "num_experts": 8,
                                "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
                                "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 96, "kv_lora_rank": 64,
                                "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "vocab_size": 1000},
                     train_nodes=2, hardware=Hardware(gpus_per_node=2, nics_per_node=2), methods=("reference",),
                     layout=InferenceLayout(tp=2, dp=2, ep=True, quant="fp8", draft="mtp"), watermark=256 << 20)


def glm45_air_64xh100_to_16_traced() -> SimConfig:
    """GLM-4.5-Air (106B, 128 routed experts + a shared one) 64 -> 16: no hand-written rules, the
    recipes traced from vLLM's own loader (C29; needs vLLM). No published anchor."""
    return SimConfig(name="glm45_air_64xh100_to_16_traced", model="glm-4.5-air", train_nodes=8, moe_width=8,
                     layout=InferenceLayout(tp=8, dp=2, ep=True),
                     label="no anchor; recipes traced from vLLM's loader; MoE width 8, 2 x TP8+EP BF16, H100 + CX-7")


def tiny_glm45_2x2_traced() -> SimConfig:
    """A small traced world for tests: GLM-4.5-Air with 2 layers (the first dense), 8 experts,
    2x2 training ranks, 2 x TP2 inference ranks, recipes traced from vLLM's loader."""
    return SimConfig(name="tiny_glm45_2x2_traced", model="glm-4.5-air",
                     overrides={"num_hidden_layers": 2, "num_experts": 8}, train_nodes=2,
                     hardware=Hardware(gpus_per_node=2, nics_per_node=2),
                     layout=InferenceLayout(tp=2, dp=2), watermark=256 << 20)


CONFIGS: dict[str, Callable[[], SimConfig]] = {f.__name__: f for f in (
    kimi_k2_256xh200efa_to_128_dpa_ep32, kimi_k2_256xh200efa_to_128_dpa_ep16, kimi_k2_256xh200efa_to_128_dpa_ep64,
    kimi_k2_256xh200efa_to_128_dpa_ep128, kimi_k2_256xh100_to_128xh100_fp8, kimi_k2_256xh100_to_128xh100_fp8_expert_whole,
    kimi_k2_256xh100_to_128xh100_fp8_offload, qwen3_235b_128xh200efa_to_32_dpa_ep8, qwen3_235b_128_to_32,
    deepseek_v3_256xh100_to_128xh100_fp8, kimi_k2_256xh20_ckpt_engine, kimi_k2_sglang_megatron_pp8, tiny_qwen3_moe_2x2,
    glm45_air_64xh100_to_16_traced, tiny_glm45_2x2_traced, kimi_k2_256xh100_to_128xh100_fp8_mtp,
    kimi_k2_256xh200efa_to_128_dpa_ep32_mtp,
    deepseek_v3_256xh100_to_128xh100_fp8_mtp, tiny_deepseek_v3_mtp_2x2)}


def get_config(name: str) -> SimConfig:
    try:
        return CONFIGS[name]()
    except KeyError:
        raise ValueError(f"unknown simulation config {name!r}; known: {', '.join(CONFIGS)}") from None
