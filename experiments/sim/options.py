"""Options of ``weight-transfer simulate`` (:mod:`weight_transfer.experiments.sim.run`,
``--map``: :mod:`weight_transfer.experiments.sim.layout_map`), a config dataclass the command
generates its flags from."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..paths import project_dir


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
    """``--bench-planner`` on metadata pickled per rank, as the controller receives it."""
    replan_without: int = 0
    """``--bench-planner``: time the replan after this many inference ranks left (C24: the
    schedule recomputed for the remaining membership only)."""
    checks: str = field(default="auto", metadata={"choices": ("auto", "forked", "in-process")})
    """``--bench-planner``: ``plan(parallel_checks=None / True / False)``; ``auto`` forks the
    checks at Kimi-K2 scale."""

    def __post_init__(self):
        for name in ("moe_width", "layers"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} {v}: must be >= 1")
        if self.replan_without < 0:
            raise ValueError(f"--replan-without {self.replan_without}: must be >= 0")
        if self.repeat < 1:
            raise ValueError(f"--repeat {self.repeat}: must be >= 1")
