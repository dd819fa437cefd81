"""Named at-scale configurations: functions returning a :class:`SimConfig`, named after model
and hardware (torchtitan style). ``python -m experiments simulate --list`` shows them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from reference.types import InferenceLayout

from .hardware import Hardware, h20, h100

METHODS = ("reference", "rank0_funnel", "nccl_broadcast_funnel", "rpc_update_weight", "ckpt_engine_broadcast")


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One simulated cluster and what to predict on it."""

    name: str
    model: str
    """Catalog name (reference/configs/<model>.json)."""
    overrides: dict = field(default_factory=dict)
    """HF-config overrides (small variants for tests)."""
    train_nodes: int = 32
    """Training nodes; ranks = train_nodes x hardware.gpus_per_node."""
    train_layout: str = "two_group"
    """``two_group`` (reference.training.two_group_mesh_for) or ``expert_whole``
    (experiments/sim/metadata.py)."""
    offloaded: bool = False
    """Training shards live in host memory (ParamMeta.offloaded): an h2d stage per task."""
    layout: InferenceLayout = field(default_factory=lambda: InferenceLayout(tp=16, dp=8, ep=True, quant="fp8"))
    hardware: Hardware = field(default_factory=h100)
    infer_hardware: Hardware | None = None
    """Inference nodes' hardware when it differs (only its NIC rate matters here)."""
    watermark: int | None = 8 << 30
    """Executor temporary-memory bound per training rank, bytes (assumption: 8 GiB of an
    80 GB H100 left to the transfer)."""
    max_chunk_bytes: int = 64 << 20
    """Planner: recipe outputs above this are split into row bands (bytes)."""
    methods: tuple[str, ...] = ("reference", "rank0_funnel", "nccl_broadcast_funnel", "rpc_update_weight")
    anchors: dict = field(default_factory=dict)
    """method -> (published seconds, source): the calibration anchors."""
    note: str = ""

    def __post_init__(self):
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise ValueError(f"SimConfig {self.name}: unknown methods {bad}; known: {', '.join(METHODS)}")
        if self.train_nodes < 1:
            raise ValueError(f"SimConfig {self.name}: train_nodes must be >= 1")

    @property
    def n_train(self) -> int:
        return self.train_nodes * self.hardware.gpus_per_node

    @property
    def n_infer(self) -> int:
        return self.layout.world_size


PPLX = "Perplexity, 'Weight Transfer for RL Post-Training in under 2 seconds' (research.perplexity.ai, Sep 2025)"


def kimi_k2_256xh100_to_128xh100_fp8() -> SimConfig:
    """The headline anchor: Kimi-K2 (1T) from 256 BF16 training GPUs (32 nodes, the seed's two
    mesh groups) to 128 FP8 inference GPUs (8 instances x TP16 with expert parallelism)."""
    return SimConfig(name="kimi_k2_256xh100_to_128xh100_fp8", model="kimi-k2",
                     anchors={"reference": (1.3, PPLX),
                              "nccl_broadcast_funnel": (53.3, "SGLang, NCCL-broadcast update of Kimi-K2 on 32 H100 nodes "
                                                        "(as cited in issue #7)")})


def kimi_k2_256xh100_to_128xh100_fp8_expert_whole() -> SimConfig:
    """Same cluster, experts held whole by one training GPU each (expert-parallel storage):
    ``full_tensor()`` of an expert moves nothing."""
    return SimConfig(name="kimi_k2_256xh100_to_128xh100_fp8_expert_whole", model="kimi-k2",
                     train_layout="expert_whole", methods=("reference",), anchors={"reference": (1.3, PPLX)})


def kimi_k2_256xh100_to_128xh100_fp8_offload() -> SimConfig:
    """The headline cluster with the training shards offloaded to host memory (h2d stage)."""
    return SimConfig(name="kimi_k2_256xh100_to_128xh100_fp8_offload", model="kimi-k2", offloaded=True,
                     methods=("reference",), anchors={"reference": (1.3, PPLX)})


def qwen3_235b_128_to_32() -> SimConfig:
    """The post's first result: Qwen3-235B-A22B from 128 training GPUs (16 nodes) to 32
    inference GPUs. Assumed layout (not published): 4 instances x TP8 with EP, BF16."""
    return SimConfig(name="qwen3_235b_128_to_32", model="qwen3-235b-a22b", train_nodes=16,
                     layout=InferenceLayout(tp=8, dp=4, ep=True), anchors={"reference": (2.0, PPLX + "; 1.7 s steady state")})


def deepseek_v3_256xh100_to_128xh100_fp8() -> SimConfig:
    """DeepSeek-V3 (671B) on the Kimi-K2 cluster shape (no published anchor)."""
    return SimConfig(name="deepseek_v3_256xh100_to_128xh100_fp8", model="deepseek-v3")


def kimi_k2_256xh20_ckpt_engine() -> SimConfig:
    """checkpoint-engine's published number: Kimi-K2 FP8 broadcast-updated on 256 H20
    (16 instances x TP16 assumed). The reference is not run (no training side in that setup)."""
    return SimConfig(name="kimi_k2_256xh20_ckpt_engine", model="kimi-k2", hardware=h20(),
                     layout=InferenceLayout(tp=16, dp=16, quant="fp8"), methods=("ckpt_engine_broadcast",),
                     anchors={"ckpt_engine_broadcast": (16.0, "MoonshotAI checkpoint-engine README: Kimi-K2 FP8, "
                                                         "256 x H20, broadcast")})


def tiny_qwen3_moe_2x2() -> SimConfig:
    """A small world for tests and a quick look: Qwen3-30B-A3B with 2 layers, 8 experts, 2x2
    training ranks, 2 x TP2 inference ranks."""
    return SimConfig(name="tiny_qwen3_moe_2x2", model="qwen3-30b-a3b",
                     overrides={"num_hidden_layers": 2, "num_experts": 8}, train_nodes=2,
                     hardware=Hardware(gpus_per_node=2, nics_per_node=2),
                     layout=InferenceLayout(tp=2, dp=2, quant="fp8"), watermark=256 << 20)


CONFIGS: dict[str, Callable[[], SimConfig]] = {f.__name__: f for f in (
    kimi_k2_256xh100_to_128xh100_fp8, kimi_k2_256xh100_to_128xh100_fp8_expert_whole,
    kimi_k2_256xh100_to_128xh100_fp8_offload, qwen3_235b_128_to_32, deepseek_v3_256xh100_to_128xh100_fp8,
    kimi_k2_256xh20_ckpt_engine, tiny_qwen3_moe_2x2)}


def get_config(name: str) -> SimConfig:
    try:
        return CONFIGS[name]()
    except KeyError:
        raise ValueError(f"unknown simulation config {name!r}; known: {', '.join(CONFIGS)}") from None
