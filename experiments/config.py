"""Trial configuration: one method x one model x one world shape x one watermark."""
from __future__ import annotations

from dataclasses import dataclass, field

from reference.catalog import ModelConfig, load_config
from reference.types import InferenceLayout


@dataclass(kw_only=True, slots=True)
class TrialConfig:
    """Everything a trial needs; every process gets a copy.

    The default is the README's main job: Qwen3-0.6B (the real published architecture: 28
    layers, GQA 16/8 heads, tied embeddings; 1.19 GB in BF16) from 2 FSDP2 training ranks
    to one TP=2 inference instance, over cross-memory attach.
    """

    model: str = "qwen3-0.6b"
    """Catalog name (``reference/configs/<model>.json``)."""
    overrides: dict = field(default_factory=dict)
    """HF-config overrides for a smaller variant, e.g. ``{"num_hidden_layers": 4}``."""
    n_train: int = 2
    """Training ranks (processes)."""
    train_layout: str = "fsdp"
    """How training parameters are placed: ``"fsdp"`` (FSDP2 ``fully_shard`` per layer on a
    1-D mesh of all ranks, ``Shard(0)``), ``"two_group"`` (the seed's two mesh groups on a
    ``train_mesh = (nodes, gpus_per_node)`` 2-D mesh: non-expert parameters sharded within a
    node, experts across nodes), ``"shard_shard"`` (``[Shard(0), Shard(0)]`` on a
    ``train_mesh`` 2-D mesh, C12)."""
    train_mesh: tuple[int, ...] = ()
    """2-D mesh shape for ``two_group`` / ``shard_shard``; its product must be ``n_train``."""
    tp: int = 2
    """Inference tensor-parallel size (ranks per engine instance)."""
    dp: int = 1
    """Inference replicas (engine instances, each receiving a full copy)."""
    ep: bool = False
    """Place MoE experts expert-parallel over each instance's TP ranks."""
    quant: str | None = None
    """``None`` or ``"fp8"`` (block FP8 e4m3 with ``weight_scale_inv``) on the inference side."""
    train_dtype: str = "bfloat16"
    """Training copy dtype: ``"bfloat16"`` or ``"float32"`` (fp32 masters, cast on the way)."""
    method: str = "reference"
    transport: str = "cma"
    steps: int = 5
    """Measured updates."""
    warmup: int = 1
    """Updates before the measured ones (verified, not timed)."""
    seed: int = 0
    local_writes: bool = True
    """Copy recipes (no fusion across shards, no quantization) are cut at shard boundaries and
    written by the ranks that already hold the rows, from ``to_local()``, with no
    ``full_tensor()``; False gathers every task's sources first (the published design)."""
    local_min_bytes: int = 1 << 20
    """Local writes only cut a recipe at shard boundaries when each band is at least this many
    bytes (smaller tensors, e.g. norms, are gathered: fewer, larger writes)."""
    max_chunk_bytes: int = 64 << 20
    """Recipe outputs larger than this are split into row bands spread over senders (bytes)."""
    timeout: float = 120.0
    """Seconds a control-plane wait may take before the missing ranks are named."""
    poison: bool = True
    """Fill inference memory with 0xA5 before the first update (C11: a no-op cannot verify)."""
    verify: bool = True
    pipeline: bool = True
    """Run the executor's stages concurrently (stage threads with FIFO queues); ``False``
    runs every stage of a task before the next task starts (stage-serialized)."""
    watermark: int | None = None
    """Bytes of temporaries (gathered sources + outputs) the tasks in flight on one training
    rank may hold; ``None`` = unbounded. A task larger than this runs alone."""
    offload: bool = False
    """Training shards live in host memory (pinned on CUDA hosts) and are copied to the device
    buffer in the executor's ``h2d`` stage; metadata says ``offloaded=True``."""
    trace_dir: str | None = None
    """Directory for one Chrome trace per update and rank (``step{N}.rank{r}.json``); the CLI
    merges them into ``step{N}.json`` per update."""
    drop_params: tuple[str, ...] = ()
    """Fault injection: checkpoint names the training side does not hold (C3 tests)."""
    extra_params: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Fault injection: (name, shape) BF16 parameters the training side holds on top."""

    def __post_init__(self):
        if self.n_train < 1:
            raise ValueError(f"n_train={self.n_train}: need at least one training rank")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps={self.steps}, warmup={self.warmup}: need steps >= 1, warmup >= 0")
        if self.train_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"train_dtype={self.train_dtype!r}: bfloat16 or float32")
        self.layout  # validates tp/dp/quant
        if self.watermark is not None and self.watermark < 0:
            raise ValueError(f"watermark={self.watermark}: bytes >= 0, or None for unbounded")
        if self.train_layout not in ("fsdp", "two_group", "shard_shard"):
            raise ValueError(f"train_layout={self.train_layout!r}: fsdp, two_group or shard_shard")
        if self.train_layout != "fsdp":
            if len(self.train_mesh) != 2 or self.train_mesh[0] * self.train_mesh[1] != self.n_train:
                raise ValueError(f"train_layout={self.train_layout!r} needs train_mesh=(a, b) with a*b = "
                                 f"n_train={self.n_train}, got {self.train_mesh}")

    def train_specs(self) -> list:
        """The training side's parameters: the catalog's, less ``drop_params``, plus
        ``extra_params``."""
        from reference.catalog import ParamSpec, param_specs

        specs = [s for s in param_specs(self.model_config()) if s.name not in set(self.drop_params)]
        return specs + [ParamSpec(name=n, shape=tuple(sh)) for n, sh in self.extra_params]

    def executor_options(self) -> dict:
        """Keyword arguments for :class:`reference.executor.Executor`."""
        return {"pipeline": self.pipeline, "watermark": self.watermark, "offload": self.offload,
                "trace_dir": self.trace_dir}

    @property
    def layout(self) -> InferenceLayout:
        return InferenceLayout(tp=self.tp, dp=self.dp, ep=self.ep, quant=self.quant)

    @property
    def n_infer(self) -> int:
        return self.tp * self.dp

    def model_config(self) -> ModelConfig:
        return load_config(self.model, **self.overrides)

    @property
    def dtype_override(self) -> str | None:
        return None if self.train_dtype == "bfloat16" else self.train_dtype


def main_job_default() -> TrialConfig:
    """The README's main job (``python -m experiments run`` with no ``--model``):
    Qwen3-30B-A3B's architecture (Qwen3 GQA attention 32/4 heads, 128-expert MoE layers cut to
    32 experts, 2 of its 48 layers, the real 151,936-token vocabulary and untied ``lm_head``),
    trained on 2 FSDP2 ranks in BF16, served block-FP8 by one TP=2 instance: about 1.6 GB
    written per update (BF16 embeddings, FP8 e4m3 linear and expert weights plus
    ``weight_scale_inv``), 1 warm-up and 4 measured updates, every one verified."""
    return TrialConfig(model="qwen3-30b-a3b", overrides={"num_hidden_layers": 2, "num_experts": 32},
                       n_train=2, tp=2, quant="fp8", steps=4, warmup=1)

