"""Named experiment configs and sweeps, torchtitan style: each is a function returning a
:class:`~weight_transfer.experiments.config.TrialConfig` (one trial) or a :class:`Sweep` (a list of them),
named after the model and the hardware it is sized for.

    weight-transfer sweep --list                         # what is here
    weight-transfer sweep qwen3_cpu_small --cluster local # run one (docs/SWEEPS.md)

``cpu`` configs are sized for a 2-core development box (the ``auto`` transport: shared memory into
the stand-in engine's arenas, cross-memory attach into vLLM's tensors; every rank a process);
``h100`` configs are for a SLURM cluster with one GPU per rank (``--cluster slurm``). Model
variants keep the published architecture and shrink it with overrides (fewer layers, experts,
a smaller vocabulary) so one trial takes seconds, not minutes.
"""
from __future__ import annotations

from collections.abc import Callable

from .config import Sweep, TrialConfig, trial_key

METHODS = ("reference", "rank0_funnel", "rpc")
"""Every transfer method a sweep can compare (experiments/methods.py)."""

MiB = 1 << 20


def _small_qwen3(layers: int = 4, **kw) -> TrialConfig:
    """Qwen3-0.6B's architecture (GQA 16/8 heads, head_dim 128, tied embeddings) with
    ``layers`` layers and an 8192-token vocabulary (the real one, 151936, is a 311 MB
    embedding that would dwarf the layers on a CPU box)."""
    kw.setdefault("steps", 3)
    return TrialConfig.from_flat(model="qwen3-0.6b", overrides={"num_hidden_layers": layers, "vocab_size": 8192}, **kw)


# ---------------------------------------------------------------- single trials (named configs)


def qwen3_30b_a3b_cpu_fp8_tp2() -> TrialConfig:
    """The README's main job: Qwen3-30B-A3B architecture (2 layers, 32 experts), 2 FSDP2 ranks
    -> block-FP8 TP=2, ~1.6 GB per update (weight_transfer.experiments.config.main_job_default)."""
    from .config import main_job_default

    return main_job_default()


def qwen3_0_6b_cpu_tp2() -> TrialConfig:
    """Full Qwen3-0.6B (1.19 GB BF16), 2 FSDP2 ranks -> TP=2, CMA."""
    return TrialConfig.from_flat(model="qwen3-0.6b", n_train=2, tp=2)


def qwen3_0_6b_cpu_small() -> TrialConfig:
    """Qwen3-0.6B architecture, 4 layers, 8k vocabulary (143 MB), 2 -> TP=2: seconds per update."""
    return _small_qwen3(4)


def qwen3_0_6b_cpu_tiny() -> TrialConfig:
    """2 layers, 8k vocabulary (80 MB), 1 -> TP=1: the smallest meaningful world (CI)."""
    return _small_qwen3(2, n_train=1, tp=1)


def qwen3_30b_a3b_cpu_small() -> TrialConfig:
    """Qwen3-30B-A3B architecture (MoE, 128 -> 8 experts, 2 layers, 8k vocabulary), 2 -> TP=2
    with experts expert-parallel."""
    return TrialConfig.from_flat(model="qwen3-30b-a3b", overrides={"num_hidden_layers": 2, "num_experts": 8,
                                                         "vocab_size": 8192}, tp=2, ep=True, steps=3)


def qwen3_8b_h100_tp8() -> TrialConfig:
    """Full Qwen3-8B from 8 training GPUs (FSDP2) to one TP=8 instance, one GPU per rank
    (a 2-node SLURM job: 17 tasks). Needs a GPU transport (``transport="cuda_ipc"`` on one
    node, ``"verbs"`` / ``"nixl"`` across nodes); every rank's tensors on its GPU."""
    return TrialConfig.from_flat(model="qwen3-8b", n_train=8, tp=8, transport="nixl", device="cuda", steps=10, warmup=2)


CONFIGS: dict[str, Callable[[], TrialConfig]] = {f.__name__: f for f in (
    qwen3_30b_a3b_cpu_fp8_tp2, qwen3_0_6b_cpu_tp2, qwen3_0_6b_cpu_small, qwen3_0_6b_cpu_tiny, qwen3_30b_a3b_cpu_small, qwen3_8b_h100_tp8)}


# ---------------------------------------------------------------- sweeps


def _dedup(trials: list[TrialConfig]) -> list[TrialConfig]:
    seen, out = set(), []
    for t in trials:
        k = trial_key(t)
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def ci_cpu_regression() -> Sweep:
    """CI (tests/experiments/test_configs.py): a tiny Qwen3 (2 layers, 8k vocabulary, 80 MB), 2 -> TP2,
    5 measured updates, the reference's executor bounded by a 16 MiB watermark; every method
    verified, and the reference's speedup over the rank-0 funnel measured in the same run."""
    base = _small_qwen3(2, n_train=2, tp=2, steps=5, watermark=16 * MiB, timeout=90.0)
    return Sweep(name="ci_cpu_regression", description="tiny Qwen3, 2 -> TP2, watermark 16 MiB, every method (CI)",
                 trials=[base.replace(method=m) for m in METHODS])


def qwen3_dense_cpu_size() -> Sweep:
    """Update latency vs model size: Qwen3 dense with 2 / 4 / 8 layers, every method, 2 -> TP=2."""
    return Sweep(name="qwen3_dense_cpu_size", description="Qwen3 dense 2/4/8 layers x every method, 2 -> TP2",
                 trials=[_small_qwen3(n, method=m) for n in (2, 4, 8) for m in METHODS])


def qwen3_cpu_world() -> Sweep:
    """Bandwidth vs GPU (here: process) counts: training ranks 1/2/4 and inference TP 1/2 / DP 2."""
    shapes = ((1, 1, 1), (2, 1, 1), (2, 2, 1), (4, 2, 1), (2, 2, 2), (2, 1, 2))
    return Sweep(name="qwen3_cpu_world", description="n_train 1/2/4 x TP 1/2 x DP 1/2, reference and rank-0 funnel",
                 trials=[_small_qwen3(4, n_train=n, tp=tp, dp=dp, method=m) for n, tp, dp in shapes
                         for m in ("reference", "rank0_funnel")])


def qwen3_cpu_watermark() -> Sweep:
    """Watermark vs update time and peak temporary memory (reference, pipelined executor)."""
    marks = (None, 4 * MiB, 16 * MiB, 64 * MiB)
    return Sweep(name="qwen3_cpu_watermark", description="reference, watermark unbounded / 4 / 16 / 64 MiB",
                 trials=[_small_qwen3(4, watermark=w) for w in marks])


def qwen3_30b_a3b_cpu_layouts() -> Sweep:
    """Inference layouts of a small Qwen3-MoE: TP2, TP2+EP, TP2+EP FP8, TP1xDP2; reference
    and the rank-0 funnel."""
    base = qwen3_30b_a3b_cpu_small()
    layouts = (dict(tp=2, ep=False), dict(tp=2, ep=True), dict(tp=2, ep=True, quant="fp8"), dict(tp=1, dp=2, ep=False))
    return Sweep(name="qwen3_30b_a3b_cpu_layouts", description="Qwen3-MoE small: TP2 / TP2+EP / TP2+EP-fp8 / DP2",
                 trials=[base.replace(method=m, **lay) for lay in layouts
                         for m in ("reference", "rank0_funnel")])


def qwen3_cpu_small() -> Sweep:
    """The README's sweep, sized for a 2-core box (~20 min): model size x every method, world
    shapes x {reference, funnel}, and the watermark, on Qwen3 dense variants."""
    size = [_small_qwen3(n, method=m) for n in (2, 4, 8) for m in METHODS]
    world = [_small_qwen3(4, n_train=n, tp=tp, dp=dp, method=m) for n, tp, dp in ((1, 1, 1), (4, 2, 1), (2, 2, 2))
             for m in ("reference", "rank0_funnel")]
    marks = [_small_qwen3(4, watermark=w) for w in (4 * MiB, 16 * MiB)]
    return Sweep(name="qwen3_cpu_small", description="Qwen3 dense: size x method, world shapes, watermark (README)",
                 trials=_dedup(size + world + marks))


def qwen3_8b_h100_world() -> Sweep:
    """Cluster sweep (SLURM, one GPU per rank): full Qwen3-8B, training GPUs 8/16 to TP 4/8,
    the reference with every rank's tensors on its GPU. Run with ``--cluster slurm --nodes N
    --gpus-per-node 8``. The baselines are not in it: ``--device cuda`` runs the reference only
    (TrialConfig refuses a baseline method there: their update group is not wired for device
    tensors), and a host-tensor baseline beside a GPU reference would not be a like-for-like
    comparison."""
    base = qwen3_8b_h100_tp8()
    return Sweep(name="qwen3_8b_h100_world",
                 description="Qwen3-8B, 8/16 training GPUs -> TP4/TP8, reference on the GPUs (baselines: not wired for --device cuda)",
                 trials=[base.replace(n_train=n, tp=tp) for n in (8, 16) for tp in (4, 8)])


SWEEPS: dict[str, Callable[[], Sweep]] = {f.__name__: f for f in (
    qwen3_cpu_small, qwen3_dense_cpu_size, qwen3_cpu_world, qwen3_cpu_watermark, qwen3_30b_a3b_cpu_layouts,
    ci_cpu_regression, qwen3_8b_h100_world)}


def get_sweep(name: str) -> Sweep:
    """The sweep ``name``, or a one-trial sweep around the named config ``name``. Raises
    ValueError listing the known names."""
    if name in SWEEPS:
        return SWEEPS[name]()
    if name in CONFIGS:
        return Sweep(name=name, description=CONFIGS[name].__doc__.strip().splitlines()[0], trials=[CONFIGS[name]()])
    raise ValueError(f"unknown sweep {name!r}; sweeps: {', '.join(SWEEPS)}; configs: {', '.join(CONFIGS)}")


def list_text() -> str:
    """The ``sweep --list`` table: every sweep (trial count, description), then every named
    config."""
    lines = ["# sweeps (weight-transfer sweep NAME)", f"{'name':<28} {'trials':>6}  description"]
    for name, f in SWEEPS.items():
        sw = f()
        lines.append(f"{name:<28} {len(sw):>6}  {sw.description}")
    lines += ["#", "# single-trial configs (also accepted as NAME)"]
    for name, f in CONFIGS.items():
        lines.append(f"{name:<28} {1:>6}  {f.__doc__.strip().splitlines()[0]}")
    return "\n".join(lines)
