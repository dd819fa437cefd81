"""Options of ``weight-transfer simulate`` (:mod:`weight_transfer.experiments.sim.run`,
``--map``: :mod:`weight_transfer.experiments.sim.layout_map`), a config dataclass the command
generates its flags from."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..paths import project_dir
from .fractions import GRANULARITIES


@dataclass(kw_only=True, slots=True)
class SimulateOptions:
    """What to simulate and what to write."""

    list: bool = False
    """List the simulation configs."""
    csv: str = field(default=str(project_dir() / "results" / "simulated.csv"), metadata={"metavar": "CSV"})
    """CSV to append rows to."""
    no_csv: bool = False
    """Do not append rows to the CSV."""
    gather_all: bool = False
    """Plan with ``full_tensor()`` of every source (the published executor) instead of shard-local prepare."""
    moe_width: int | None = None
    """Override the config's MoE mesh width (``two_group``: nodes per expert sub-mesh); the row's
    config name gets a ``_w<W>`` suffix."""
    layers: int | None = None
    """Truncate the model to this many decoder layers (a quicker look; the row's config name
    gets an ``_L<N>`` suffix)."""
    map: bool = False
    """Kimi-K2 map: predicted time against MoE mesh width x inference layout
    (results/sim_kimi_map.csv; extrapolated from truncated models, see experiments/sim/layout_map.py)."""
    sensitivity: bool = False
    """Also re-run the cost model with every assumed parameter halved and doubled (same schedule)."""
    bench_planner: bool = False
    """Time ``plan()`` and its peak RSS, each run in a fresh subprocess."""
    repeat: int = 3
    """``--bench-planner`` runs (min / median / max reported)."""
    received: bool = False
    """``--bench-planner`` on metadata encoded and decoded per rank, as the controller receives it."""
    replan_without: int = 0
    """``--bench-planner``: time the replan after this many inference ranks left (C24: the
    schedule recomputed for the remaining membership only)."""
    checks: str = field(default="auto", metadata={"choices": ("auto", "forked", "in-process")})
    """``--bench-planner``: ``plan(parallel_checks=None / True / False)``; ``auto`` forks the
    checks at Kimi-K2 scale."""
    delta_fractions: str | None = field(default=None, metadata={"metavar": "PATH"})
    """Delta mode: measured fractions changed per RL step, per tensor kind and granularity
    (``weight-transfer rl --changes``'s CSV, results/rl_changes.csv); with ``--delta-lr``.
    Predicts a delta update on the same schedule beside the full one (docs/SIMULATION.md, "Delta mode")."""
    delta_lr: tuple[float, ...] = ()
    """Delta mode: learning rates of ``--delta-fractions`` to predict for, comma-separated (the
    median over that lr's steps)."""
    delta_fraction: tuple[float, ...] = ()
    """Delta mode: uniform fractions of bf16 elements changed per step, for every tensor kind
    (0..1, comma-separated; e.g. 0.0002 for the published 0.02%)."""
    delta_granularity: tuple[str, ...] = ("rows",)
    """Delta mode: compare units, comma-separated: ``elems`` (one element), ``rows`` (128 bytes,
    the executor's default), ``blocks`` (128x128 FP8 blocks)."""
    delta_merge_gap: tuple[int, ...] = field(default=(4096,), metadata={"unit": "bytes"})
    """Delta mode: runs separated by at most this many unchanged bytes are one write (the
    executor's ``--delta-merge-gap``), comma-separated."""
    delta_post_us: tuple[float, ...] = ()
    """Delta mode: also predict with the per-WRITE posting cost (``rdma_msg_us``, 1 us) set to
    each of these, comma-separated (microseconds; e.g. 0.1 for work requests posted in batches)."""
    delta_costs: str | None = field(default=None, metadata={"metavar": "PATH"})
    """Delta mode: measured passes per byte of the compare, pack and apply
    (``python -m weight_transfer.experiments.sim.delta_costs``: results/delta_costs.csv); every
    scenario is also predicted at the executor's 8-byte blocks with these costs, scattered (one
    WRITE per run) and packed (one record per output and receiver, applied at the receiver's
    commit) (docs/SIMULATION.md section 8, "With the measured costs")."""

    shadow: bool = False
    """Shadow targets: per inference GPU, the memory of one extra copy of the bytes it receives,
    whether it fits, and the stall per update of pause / flip / copy go-live
    (results/sim_<config>_shadow.csv; docs/SIMULATION.md, "Shadow targets")."""
    shadow_reserve: float = 0.2
    """``--shadow``: fraction of each inference GPU's memory kept for KV cache and activations
    (0..1); the weights and the shadow must fit in the rest."""
    shadow_copy_efficiency: float = 0.75
    """``--shadow``: achieved fraction of the HBM datasheet rate for the copy go-live (read and
    write traffic counted; 0.75 measured on H100, experiments/sim/shadow.py)."""

    @property
    def delta(self) -> bool:
        """Whether a delta mode option asks for a prediction."""
        return bool(self.delta_fractions or self.delta_fraction)

    def __post_init__(self):
        for name in ("moe_width", "layers"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} {v}: must be >= 1")
        if self.replan_without < 0:
            raise ValueError(f"--replan-without {self.replan_without}: must be >= 0")
        if self.repeat < 1:
            raise ValueError(f"--repeat {self.repeat}: must be >= 1")
        self._check_delta()
        if not 0.0 <= self.shadow_reserve < 1.0:
            raise ValueError(f"--shadow-reserve {self.shadow_reserve}: must be in [0, 1)")
        if not 0.0 < self.shadow_copy_efficiency <= 1.0:
            raise ValueError(f"--shadow-copy-efficiency {self.shadow_copy_efficiency}: must be in (0, 1]")
        if self.shadow and (self.map or self.bench_planner):
            raise ValueError("--shadow with --map or --bench-planner is not supported")

    def _check_delta(self):
        for f in self.delta_fraction:
            if not 0.0 <= f <= 1.0:  # NaN too
                raise ValueError(f"--delta-fraction {f}: must be in [0, 1] (a fraction of bf16 elements per step)")
        bad = [g for g in self.delta_granularity if g not in GRANULARITIES]
        if bad or not self.delta_granularity:
            raise ValueError(f"--delta-granularity {','.join(bad) or '(empty)'}: expected {', '.join(GRANULARITIES)}")
        if not self.delta_merge_gap or any(g < 0 for g in self.delta_merge_gap):
            raise ValueError(f"--delta-merge-gap {','.join(map(str, self.delta_merge_gap)) or '(empty)'}: "
                             "must be >= 0 bytes")
        for u in self.delta_post_us:
            if not u > 0.0:
                raise ValueError(f"--delta-post-us {u}: must be > 0 microseconds")
        if self.delta_costs:
            if not self.delta:
                raise ValueError("--delta-costs needs --delta-fractions or --delta-fraction (the steps it prices)")
            from .delta_costs import load_costs

            load_costs(self.delta_costs)
        if self.delta_lr and not self.delta_fractions:
            raise ValueError("--delta-lr needs --delta-fractions (the CSV whose steps it selects)")
        if self.delta_fractions:
            from .fractions import check_fractions_csv, load_fractions

            if not self.delta_lr:
                raise ValueError("--delta-fractions needs --delta-lr (e.g. --delta-lr 1e-6,1e-5)")
            rows = check_fractions_csv(self.delta_fractions)
            for lr in self.delta_lr:
                load_fractions(self.delta_fractions, lr, rows)
        if self.delta and (self.map or self.bench_planner):
            raise ValueError("delta mode (--delta-fractions / --delta-fraction) with --map or --bench-planner is not supported")
