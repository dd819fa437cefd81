"""Measured per-byte costs of a delta update's own work -- the exact compare, packing the changed
runs into a record, applying (scattering) a record at the receiver -- on this machine, and the
rule that scales them to the simulated hardware (docs/SIMULATION.md section 8, "With the
measured costs").

    python -m weight_transfer.experiments.sim.delta_costs            # measure, write results/delta_costs.csv
    weight-transfer simulate kimi_k2_256xh200efa_to_128_dpa_ep32 --delta-fractions results/rl_changes.csv \\
        --delta-lr 1e-6,1e-5 --delta-fraction 0,0.0002,0.0005,0.01 --delta-costs results/delta_costs.csv

**What is measured** (one process, one thread, best of ``repeats``): a bf16 output of
``nbytes`` (default 40 MB: the RL loop's model) whose elements change with probability ``p``
(uniformly scattered, as a real step's are: docs/DELTA.md), against its shadow, for each packed
record format (``format`` column):

- ``memcpy``: ``copy_`` of the output (the unit: one *pass* over ``N`` bytes);
- ``runs`` (format 2): ``compare`` the native exact comparison at 8-byte blocks
  (``weight_transfer.delta.runs``'s ``changed_runs_native``: reads the output and the shadow, writes
  the changed blocks into the shadow, emits the runs) over the whole output; ``pack``
  ``wt_pack_runs`` (the varint index and the changed bytes into one record,
  :mod:`weight_transfer.delta.packed`); ``apply`` ``wt_unpack`` (the runs scattered into a target
  of ``N`` bytes);
- ``masks`` (format 3, what the cost model packs above ~0.25 GB/s, i.e. on a NIC):
  ``compare`` ``changed_masks`` at 1-byte granularity (one vector compare per 64-byte chunk, a
  compress per changed chunk; :mod:`weight_transfer.delta.masks`); ``pack`` ``wt_pack_masks``;
  ``apply`` ``wt_unpack_masks`` (an expand per changed chunk).

**Passes per byte**: ``compare_passes = t_compare / t_memcpy(N)`` per output byte;
``pack_passes`` and ``apply_passes = t / t_memcpy(R)`` per record byte ``R`` (format 2: ``64 +
varint index + changed bytes``; format 3: ``64 + 12 x changed chunks + changed bytes``), i.e. how
many memcpys of the bytes each costs here.

**Scaling rule** (stated with every prediction): a pass over ``B`` bytes costs what a memcpy of
them costs on the simulated GPU, ``2 B / hbm_gbs`` (read and write at the datasheet bandwidth,
as the model charges the fusion copies), so ``compare = compare_passes x 2 x output / hbm``,
``pack = pack_passes x 2 x record / hbm`` (the sender, in the prepare stage), ``apply =
apply_passes x 2 x record / hbm`` (each receiver, at its commit, before the version is
published). This keeps the measured *shape* of each loop (branches, per-run overhead at the
measured run density) and assumes a GPU kernel has the CPU loop's ratio to a copy: at the
density of a real step (a run every ~160 bytes) the per-run work makes pack and apply several
copies' worth per byte; a GPU's warps would likely do better (an upper-side estimate).
"""
from __future__ import annotations

import csv
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DeltaCosts", "measure", "load_costs", "write_costs", "COLUMNS"]

COLUMNS = ["fraction", "format", "output_bytes", "runs", "changed_bytes", "record_bytes", "memcpy_gbps", "memcpy_s",
           "compare_s", "pack_s", "apply_s", "compare_passes", "pack_passes", "apply_passes", "native", "timestamp"]
"""``format``: ``runs`` (format 2) or ``masks`` (format 3); ``runs``: runs (format 2) or changed
64-byte chunks (format 3)."""

FORMATS = ("runs", "masks")


@dataclass(frozen=True, slots=True)
class DeltaCosts:
    """Passes per byte (module docstring): ``compare`` per output byte, ``pack`` and ``apply`` per
    record byte; ``source``: where they come from (a CSV and its fraction)."""

    compare: float
    pack: float
    apply: float
    source: str = ""

    def __post_init__(self):
        if min(self.compare, self.pack, self.apply) < 0:
            raise ValueError(f"delta costs {self}: passes per byte must be >= 0")

    def seconds(self, passes: float, nbytes: float, hbm_gbs: float) -> float:
        """The scaling rule: ``passes x 2 x nbytes / (hbm_gbs x 1e9)``."""
        return passes * 2.0 * nbytes / (hbm_gbs * 1e9)


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(nbytes: int = 40 << 20, fraction: float = 0.0128, repeats: int = 3, seed: int = 0,
            fmt: str = "runs") -> dict:
    """One row of :data:`COLUMNS` (seconds, bytes, passes) for a bf16 output of ``nbytes`` bytes
    whose elements change with probability ``fraction``, packed in format ``fmt``
    (:data:`FORMATS`). Raises RuntimeError when the native kernel (``reference/native/_delta.c``; needs a
    C compiler) is not available: the torch fallback's costs are not what the simulation should
    scale; ValueError for an unknown format."""
    import torch

    if fmt not in FORMATS:
        raise ValueError(f"delta costs format {fmt!r}: expected one of {', '.join(FORMATS)}")
    from weight_transfer.delta.packed import HEADER, record_size
    from weight_transfer.delta.runs import KERNEL, changed_runs_native, index_size

    lib = KERNEL.lib()
    if lib is None:
        raise RuntimeError("the native delta kernel is not built here (a C compiler is needed): no costs to measure")
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed)
    n_el = nbytes // 2
    old = (torch.randn(n_el, generator=g) * 0.02).to(torch.bfloat16)
    new = old.clone()
    idx = (torch.rand(n_el, generator=g) < fraction).nonzero().flatten()
    new.view(torch.int16)[idx] ^= 1  # flip the last mantissa bit: a changed element
    nb, ob = new.view(torch.uint8), old.view(torch.uint8)
    dst = torch.empty_like(nb)
    t_copy = _best(lambda: dst.copy_(nb), repeats)
    if fmt == "masks":
        return _measure_masks(lib, nb, ob, t_copy, nbytes, fraction, repeats)
    shadows = [ob.clone() for _ in range(repeats)]
    it = iter(shadows)
    t_cmp = _best(lambda: changed_runs_native(nb, next(it), 8), repeats)
    runs = changed_runs_native(nb, ob.clone(), 8)
    m, c = len(runs), runs.nbytes
    q, nix = index_size(runs, nbytes, 8)
    size = record_size(nix, c)
    rec = torch.zeros(size, dtype=torch.uint8)
    ix, body = rec[HEADER:HEADER + nix], rec[HEADER + nix:HEADER + nix + c]
    t_pack = _best(lambda: lib.wt_pack_runs(nb.data_ptr(), runs.starts.data_ptr(), runs.lens.data_ptr(), m, q,
                                            ix.data_ptr(), body.data_ptr()), repeats)
    target = ob.clone()
    t_apply = _best(lambda: lib.wt_unpack(target.data_ptr(), ix.data_ptr(), nix, body.data_ptr(), m, nbytes, q), repeats)
    if not torch.equal(target, nb):
        raise RuntimeError("delta costs: the applied record does not reproduce the new bytes (kernel bug)")
    return _row("runs", fraction, nbytes, m, c, size, t_copy, t_cmp, t_pack, t_apply)


def _row(fmt: str, fraction: float, nbytes: int, m: int, c: int, size: int, t_copy: float, t_cmp: float,
         t_pack: float, t_apply: float) -> dict:
    """A :data:`COLUMNS` row: the seconds, and the passes (seconds over a memcpy's of the same bytes)."""
    per_byte = t_copy / nbytes
    return {"fraction": fraction, "format": fmt, "output_bytes": nbytes, "runs": m, "changed_bytes": c,
            "record_bytes": size, "memcpy_gbps": nbytes / t_copy / 1e9, "memcpy_s": t_copy, "compare_s": t_cmp,
            "pack_s": t_pack, "apply_s": t_apply, "compare_passes": t_cmp / t_copy,
            "pack_passes": t_pack / (per_byte * size), "apply_passes": t_apply / (per_byte * size), "native": True,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}


def _measure_masks(lib, nb, ob, t_copy: float, nbytes: int, fraction: float, repeats: int) -> dict:
    """:func:`measure`'s format-3 row: compare (``changed_masks``), pack (``wt_pack_masks``) and
    apply (``wt_unpack_masks``) of the same output and shadow."""
    import torch

    from weight_transfer.delta.masks import changed_masks, masks_index_bytes
    from weight_transfer.delta.packed import HEADER, record_size

    shadows = [ob.clone() for _ in range(repeats)]
    it = iter(shadows)
    t_cmp = _best(lambda: changed_masks(nb, next(it)), repeats)
    mk = changed_masks(nb, ob.clone())
    m, c = len(mk), mk.nbytes
    ix = masks_index_bytes(m)
    size = record_size(ix, c)
    rec = torch.zeros(size, dtype=torch.uint8)
    body = rec[HEADER:]
    t_pack = _best(lambda: lib.wt_pack_masks(body.data_ptr(), mk.masks.data_ptr(), mk.chunks.data_ptr(), m,
                                             mk.vals.data_ptr(), c), repeats)
    masks, chunks = body[:8 * m].view(torch.int64), body[8 * m:12 * m].view(torch.int32)
    vals = body[ix:ix + c]
    target = ob.clone()
    t_apply = _best(lambda: lib.wt_unpack_masks(target.data_ptr(), masks.data_ptr(), chunks.data_ptr(), m,
                                                vals.data_ptr(), c, nbytes), repeats)
    if not torch.equal(target, nb):
        raise RuntimeError("delta costs: the applied format-3 record does not reproduce the new bytes (kernel bug)")
    return _row("masks", fraction, nbytes, m, c, size, t_copy, t_cmp, t_pack, t_apply)


def write_costs(rows: list[dict], path: str | Path) -> Path:
    """Write ``rows`` (:data:`COLUMNS`) to ``path`` (overwritten)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return path


def load_costs(path: str | Path, fraction: float | None = None, fmt: str = "runs") -> DeltaCosts | None:
    """:class:`DeltaCosts` from a :func:`write_costs` CSV: among the rows of format ``fmt`` (a CSV
    without a ``format`` column holds format-2 rows), the one whose ``fraction`` is closest to
    ``fraction`` (None: the first). None when the CSV has no row of that format. Raises
    ValueError naming the path for a missing file or column, or a CSV with no rows."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--delta-costs {path}: no such file (python -m weight_transfer.experiments.sim.delta_costs)")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    need = {"fraction", "compare_passes", "pack_passes", "apply_passes"}
    if not rows or not need <= set(rows[0]):
        raise ValueError(f"--delta-costs {path}: needs rows with columns {', '.join(sorted(need))}")
    rows = [r for r in rows if (r.get("format") or "runs") == fmt]
    if not rows:
        return None
    r = rows[0] if fraction is None else min(rows, key=lambda x: abs(float(x["fraction"]) - fraction))
    what = "" if fmt == "runs" else ", format 3"
    return DeltaCosts(float(r["compare_passes"]), float(r["pack_passes"]), float(r["apply_passes"]),
                      source=f"{path.name} (measured at {float(r['fraction']):.2%} of bf16 elements changed{what})")


def main(argv: list[str] | None = None) -> int:
    """Measure at the RL loop's two fractions (lr 1e-6: 1.28%, lr 1e-5: 9%) and write the CSV."""
    import argparse

    from ..paths import project_dir

    ap = argparse.ArgumentParser(prog="python -m weight_transfer.experiments.sim.delta_costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(project_dir() / "results" / "delta_costs.csv"))
    ap.add_argument("--fractions", default="0.0128,0.09")
    ap.add_argument("--mb", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    try:
        fr = [float(x) for x in a.fractions.split(",")]
        if any(not 0 < f < 1 for f in fr) or a.mb < 1 or a.repeats < 1:
            raise ValueError
    except ValueError:
        print(f"error: --fractions {a.fractions!r} in (0, 1), --mb >= 1, --repeats >= 1", flush=True)
        return 2
    rows = [measure(a.mb << 20, f, a.repeats, fmt=fmt) for f in fr for fmt in FORMATS]
    print(f"{'fraction':>9} {'format':>6} {'runs':>9} {'record':>10} {'memcpy':>8} {'compare':>9} {'pack':>9} {'apply':>9} "
          f"{'passes: compare':>16} {'pack':>6} {'apply':>6}")
    for r in rows:
        print(f"{r['fraction']:>9.4f} {r['format']:>6} {r['runs']:>9} {r['record_bytes']:>10} {r['memcpy_gbps']:>6.1f}GB/s "
              f"{r['compare_s']:>9.4f} {r['pack_s']:>9.4f} {r['apply_s']:>9.4f} {r['compare_passes']:>16.2f} "
              f"{r['pack_passes']:>6.2f} {r['apply_passes']:>6.2f}")
    print(f"# written: {write_costs(rows, a.out)}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
