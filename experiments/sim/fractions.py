"""The measured or assumed change fractions the simulation's delta mode reads (docs/SIMULATION.md,
"Delta mode"; :mod:`weight_transfer.experiments.sim.delta` is the cost model that uses them).

Standard library only, so that :mod:`~weight_transfer.experiments.sim.options` can check
``--delta-fractions`` and ``--delta-granularity`` before any planning without importing numpy or
torch.
"""
from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["GRANULARITIES", "Fractions", "uniform_fractions", "load_fractions", "check_fractions_csv", "ROW_BYTES",
           "MEASURED", "CSV_COLUMNS", "FALLBACK", "FP8_PER_BF16", "SCALES_PER_BF16"]

GRANULARITIES = ("elems", "rows", "blocks")
"""``--delta-granularity`` choices, the compare units: "elems" one element (FP8 1 B, bf16 2 B,
scale 4 B); "rows" 128 bytes (one row of one 128x128 FP8 block, 64 bf16 elements, 32 scales);
"blocks" whole 128x128 FP8 blocks (in memory, 128-byte row segments that change together; bf16
tensors and scales at 128-byte rows)."""

ROW_BYTES = 128
"""Bytes of a ``rows`` unit (reference/delta/changes.py ``ROW_BYTES``; the executor's default
``--delta-granularity``)."""
MEASURED = ("bf16_elems", "bf16_rows", "fp8_elems", "fp8_rows", "fp8_blocks", "scales")
"""Granularities of results/rl_changes.csv (reference/delta/changes.py)."""
CSV_COLUMNS = ("lr", "step", "kind", "granularity", "changed", "total", "fraction")
"""Columns ``--delta-fractions`` needs (``weight-transfer rl --changes`` writes these and more)."""
FALLBACK = {"experts": "mlp", "router": "all", "other": "all", "attention": "all", "mlp": "all",
            "embeddings": "all", "norms": "all"}
"""Kind -> the kind whose fractions stand in when the CSV has none for it: the measured model is
dense, so its MLP stands in for the experts and the whole model ("all") for the router."""
FP8_PER_BF16 = 0.1
"""Uniform mode: FP8 e4m3 elements changed per bf16 element changed. Measured on the RL loop
(results/rl_changes.csv, medians of "all"): 0.110% / 1.23% = 0.089 at lr 1e-6, 0.95% / 9.0% = 0.106
at lr 1e-5 (4 significant bits against 8: a spacing 16x coarser, 0.0625, plus scales that move)."""
SCALES_PER_BF16 = 0.067
"""Uniform mode: ``weight_scale_inv`` entries changed per bf16 element changed. Measured: 0.041% /
1.23% = 0.033 at lr 1e-6, 0.60% / 9.0% = 0.067 at lr 1e-5 (the larger taken)."""


@dataclass
class Fractions:
    """Per tensor kind (:func:`weight_transfer.delta.changes.tensor_kind`, plus ``"all"``), the
    fraction of units one step changes at each :data:`MEASURED` granularity (0..1)."""

    label: str
    """What they are, in words (printed and in the CSV)."""
    by_kind: dict[str, dict[str, float]]
    source: str = ""
    """Where they come from (a path and lr, or "uniform")."""
    used_fallbacks: set = field(default_factory=set)
    """(kind, stand-in) pairs :meth:`get` used."""

    def get(self, kind: str, granularity: str) -> float:
        k = kind
        while k not in self.by_kind or granularity not in self.by_kind[k]:
            nxt = FALLBACK.get(k)
            if nxt is None or nxt == k:
                raise KeyError(f"no {granularity} fraction for tensor kind {kind!r} in {self.label}")
            k = nxt
        if k != kind:
            self.used_fallbacks.add((kind, k))
        return self.by_kind[k][granularity]


def uniform_fractions(f: float) -> Fractions:
    """Every kind changes a fraction ``f`` of its bf16 elements per step (0..1); the other
    granularities follow under uniform scattering: bf16 rows ``1 - (1 - f)^64``, FP8 elements
    ``p8 = 1 - (1 - f)^FP8_PER_BF16`` (``f x FP8_PER_BF16`` at small ``f``, 1 at ``f = 1``), FP8
    rows ``1 - (1 - p8)^128``, FP8 blocks ``1 - (1 - p8)^16384`` (or its scale), scales
    ``1 - (1 - f)^SCALES_PER_BF16``."""
    if not 0.0 <= f <= 1.0:
        raise ValueError(f"--delta-fraction {f}: must be in [0, 1]")
    p8 = 1 - (1 - f) ** FP8_PER_BF16
    ps = 1 - (1 - f) ** SCALES_PER_BF16
    d = {"bf16_elems": f, "bf16_rows": 1 - (1 - f) ** 64, "fp8_elems": p8, "fp8_rows": 1 - (1 - p8) ** 128,
         "fp8_blocks": 1 - (1 - p8) ** 16384 * (1 - ps), "scales": ps}
    return Fractions(label=f"uniform {f:.4%} of bf16 elements", by_kind={"all": d}, source="uniform")


def check_fractions_csv(path: str | Path) -> list[dict]:
    """The rows of a ``weight-transfer rl --changes`` CSV, checked: ValueError naming the path when
    it is not a readable file or lacks a column of :data:`CSV_COLUMNS`."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--delta-fractions {str(p)!r}: no such file (results/rl_changes.csv is written by "
                         "weight-transfer rl --changes)")
    try:
        with p.open(newline="") as f:
            rows = list(csv.DictReader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ValueError(f"--delta-fractions {str(p)!r}: cannot be read ({e})") from None
    cols = set(rows[0]) if rows else set()
    missing = [c for c in CSV_COLUMNS if c not in cols]
    if missing:
        raise ValueError(f"--delta-fractions {str(p)!r}: no column {', '.join(missing)} (needs {', '.join(CSV_COLUMNS)})")
    return rows


def load_fractions(path: str | Path, lr: float, rows: list[dict] | None = None) -> Fractions:
    """Per kind and granularity, the median over the steps of learning rate ``lr`` of
    ``fraction`` in the CSV at ``path`` (:func:`check_fractions_csv`). ValueError when no row
    has that lr (naming the ones there) or a fraction is outside [0, 1]."""
    rows = check_fractions_csv(path) if rows is None else rows
    lrs = sorted({float(r["lr"]) for r in rows})
    got = [r for r in rows if math.isclose(float(r["lr"]), lr, rel_tol=1e-6)]
    if not got:
        raise ValueError(f"--delta-lr {lr:g}: no rows in {path} (learning rates there: {', '.join(f'{x:g}' for x in lrs)})")
    acc: dict[tuple[str, str], list[float]] = {}
    for r in got:
        v = float(r["fraction"])
        if not 0.0 <= v <= 1.0:
            raise ValueError(f"{path}: fraction {v} outside [0, 1] (lr {lr:g}, step {r['step']}, {r['kind']} {r['granularity']})")
        acc.setdefault((r["kind"], r["granularity"]), []).append(v)
    by: dict[str, dict[str, float]] = {}
    for (k, g), vs in acc.items():
        by.setdefault(k, {})[g] = statistics.median(vs)
    steps = len({r["step"] for r in got})
    return Fractions(label=f"lr {lr:g} measured (median of {steps} steps)", by_kind=by, source=f"{path} lr={lr:g}")
