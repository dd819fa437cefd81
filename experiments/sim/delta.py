"""Delta mode of the at-scale simulation (``weight-transfer simulate <config> --delta-...``;
docs/SIMULATION.md, "Delta mode"): what an update that writes only what one RL step changed
costs on the real planner's schedule, under the same cost model (:func:`.model.simulate` with
``delta=``) as the full update.

What a delta update does (reference/delta/runs.py, the executor's ``--delta``): the plan stays
static; after preparing an output (gather, fusion, FP8 quantization: all unchanged, on the full
shard), each training rank compares it exactly with its *shadow* (a copy of what it wrote there
last) in units of ``granularity``, coalesces changed units into runs, merges runs separated by at
most ``merge_gap`` unchanged bytes, and posts **one RDMA WRITE per run** per receiver of the
output. The receiver stays passive; the version protocol and the mesh-group barrier are unchanged.

What it costs here, per write of the schedule (every figure from
:class:`~weight_transfer.experiments.sim.hardware.Hardware` or stated below):

- **wire bytes**: the expected bytes of the runs (changed units plus the merged gaps) plus
  :data:`RDMA_HEADER_BYTES` per run (the headers of one more RDMA WRITE), at both ends;
- **ops**: the expected number of runs; each costs the sender ``rdma_msg_us`` (posting the work
  request and reaping its completion: the same per-WRITE cost a full update pays per write);
- **compare** (in the prepare stage, once per distinct output per rank): read the output and the
  shadow, write the changed units into the shadow, ``(2 x output + changed bytes) / hbm_gbs``,
  plus 3 kernel launches (compare, run compaction, run list to the host) and the run list
  (:data:`RUN_DESCRIPTOR_BYTES` per run) over PCIe;
- unchanged: every ``full_tensor()`` (the trainer needs the whole tensor to quantize it), the
  fusion and quantization, the releases, the barrier between mesh groups.

The expected runs and bytes assume each unit changes independently with the given probability
(uniform scattering): :func:`expected_runs_and_units`. The measured RL steps are close to that
(docs/DELTA.md: at lr 1e-6, 1.23% of bf16 elements predict 1 - (1 - 0.0123)^64 = 54.7% of 128-byte
rows, 53.2% measured; 0.110% of FP8 elements predict 13.1% of FP8 rows, 12.5% measured).

Fractions (:class:`Fractions`) come from ``weight-transfer rl --changes``'s tidy CSV
(results/rl_changes.csv: the median over the steps of one learning rate, per tensor kind and
measured granularity) or are one uniform fraction of bf16 elements per step for every kind (the
published figures: 0.02-0.05% Qwen3-235B-A22B, ~1% PULSE), from which the other granularities are
derived (:func:`uniform_fractions`).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from weight_transfer.delta.changes import tensor_kind
from weight_transfer.types import Recipe, itemsize

from .fractions import (  # noqa: F401
    CSV_COLUMNS,
    FALLBACK,
    FP8_PER_BF16,
    GRANULARITIES,
    MEASURED,
    ROW_BYTES,
    SCALES_PER_BF16,
    Fractions,
    check_fractions_csv,
    load_fractions,
    uniform_fractions,
)
from .hardware import Hardware

__all__ = ["GRANULARITIES", "DeltaModel", "Fractions", "uniform_fractions", "load_fractions", "check_fractions_csv",
           "expected_runs_and_units", "assumptions"]

RDMA_HEADER_BYTES = 64
"""Wire bytes one more RDMA WRITE costs besides its payload, bytes. Assumption: InfiniBand's
LRH + BTH + RETH + ICRC + VCRC are 42 bytes, RoCEv2's Ethernet + IP + UDP + BTH + RETH + ICRC + FCS
78 (plus preamble and gap); EFA's SRD headers are not published. The full update's writes are
megabytes, where the achieved ``nic_gbps`` already includes the per-packet headers."""
RUN_DESCRIPTOR_BYTES = 16
"""Bytes per run copied from the GPU to the host to post its WRITE (an 8-byte offset and an
8-byte length)."""


# ------------------------------------------------------------------------------ expected runs


@functools.lru_cache(maxsize=256)
def _series(p: float, g: int) -> tuple[np.ndarray, np.ndarray]:
    """Prefix sums over j = 0..g of ``j p^2 q^j`` and ``j^2 p^2 q^j`` (q = 1 - p)."""
    j = np.arange(0, g + 1, dtype=np.float64)
    w = p * p * np.power(1.0 - p, j)
    return np.cumsum(j * w), np.cumsum(j * j * w)


def expected_runs_and_units(n: int, p: float, gap_units: int) -> tuple[float, float]:
    """(expected runs, expected units written) over ``n`` units each changed independently with
    probability ``p``, changed units coalesced and runs separated by at most ``gap_units``
    unchanged units merged (reference/delta/runs.py ``changed_runs``: ``merge_gap // granularity``).

    A run starts at a changed unit with no changed unit among the ``gap_units + 1`` before it:
    ``E[runs] = (1 - q^min(n, g+1)) + p q^(g+1) max(0, n - g - 1)``. Written: the changed units,
    plus the ``j`` unchanged units between two changed ones ``j + 1`` apart when ``j <= g``:
    ``E[units] = n p + sum_{j=1..min(g, n-2)} j (n - 1 - j) p^2 q^j``. Exact for these
    assumptions; p = 0 gives (0, 0), p = 1 gives (1, n)."""
    if n <= 0 or p <= 0.0:
        return 0.0, 0.0
    if p >= 1.0:
        return 1.0, float(n)
    q = 1.0 - p
    g = gap_units
    runs = (1.0 - q ** min(n, g + 1)) + p * q ** (g + 1) * max(0, n - g - 1)
    m = min(g, n - 2)
    merged = 0.0
    if m >= 1:
        a, b = _series(p, g)
        merged = (n - 1) * a[m] - b[m]
    return runs, min(float(n), n * p + merged)


# ------------------------------------------------------------------------------ the delta model


BLOCK_BYTES = 8
"""The executor's compare unit since issue 26 (``--delta-granularity 8``): granularity ``block8``."""
MODES = ("scattered", "packed", "masks")
"""How a delta's changed units reach the receiver: one RDMA WRITE per run, or one packed record
per output and receiver scattered by the receiver at its commit -- ``packed``: format 2 (64-byte
header + a varint index of :func:`index_per_run` bytes per run + the changed bytes, 64-byte
aligned: :mod:`weight_transfer.delta.packed`), ``masks``: format 3 (:func:`masks_record`), the
format the executor's cost model packs on a NIC."""
CHUNK_BYTES = 64
"""Format 3's chunk: one 64-bit byte mask and a 4-byte index per changed 64-byte chunk."""


def masks_record(nbytes: int, elem_bytes: int, p: float) -> tuple[float, float, float]:
    """(expected record bytes, changed chunks, changed bytes) of a format-3 record of an output of
    ``nbytes`` bytes of ``elem_bytes``-byte elements, each changed independently with probability
    ``p``: a chunk changes when any of its ``64 / elem_bytes`` elements does; the changed bytes are
    counted as every byte of a changed element (an upper-side estimate: a bf16 step usually moves
    its low byte only); ``record = 64 + 8 x chunks + 4 x chunks`` (padded to 8) ``+ changed``,
    rounded up to 64 (:mod:`weight_transfer.delta.packed`)."""
    if p <= 0 or nbytes <= 0:
        return 0.0, 0.0, 0.0
    from weight_transfer.delta.masks import masks_index_bytes
    from weight_transfer.delta.packed import record_size

    per = max(1, CHUNK_BYTES // elem_bytes)
    chunks = -(-nbytes // CHUNK_BYTES) * (1.0 - (1.0 - p) ** per)
    changed = min(float(nbytes), nbytes * p)
    return float(record_size(masks_index_bytes(chunks), changed)), chunks, changed


def _vlen(v: float) -> int:
    """LEB128 bytes of a value ``v`` >= 0 (rounded up)."""
    return max(1, (int(math.ceil(v)).bit_length() + 6) // 7)


def index_per_run(n: float, runs: float, units: float) -> float:
    """Bytes of packed index per run of an output of ``n`` compare units with ``runs`` expected
    runs covering ``units`` units (format 2, :mod:`weight_transfer.delta.packed`: two LEB128
    varints per run, the gap since the previous run and the length, in units), at the mean gap
    ``(n - units) / runs`` and the mean length ``units / runs``. An estimate: a varint's size is
    a step function of its value, so the mean of the sizes can exceed the size at the mean (the
    executor's packed records of the RL loop's lr 1e-6 steps average ~2-2.3 bytes per run)."""
    if runs <= 0:
        return 0.0
    return float(_vlen(max(0.0, n - units) / runs) + _vlen(units / runs))


def _unit(recipe: Recipe, out_index: int, dtype: str, granularity: str) -> tuple[str, int, int]:
    """(measured granularity, unit bytes, measured units per unit) of one output."""
    if recipe.transform == "fp8_block" and out_index == 1:  # weight_scale_inv, float32
        if granularity == "block8":
            return "scales", BLOCK_BYTES, BLOCK_BYTES // 4
        return ("scales", 4, 1) if granularity == "elems" else ("scales", ROW_BYTES, ROW_BYTES // 4)
    sz = itemsize(dtype)
    if granularity == "block8":  # from the element fractions: a block changes when any element does
        return ("fp8_elems" if sz == 1 else "bf16_elems"), BLOCK_BYTES, max(1, BLOCK_BYTES // sz)
    if sz == 1:  # FP8 e4m3 weight
        return {"elems": ("fp8_elems", 1, 1), "rows": ("fp8_rows", ROW_BYTES, 1),
                "blocks": ("fp8_blocks", ROW_BYTES, 1)}[granularity]
    if granularity == "elems":
        return "bf16_elems", sz, 1
    if sz == 2:
        return "bf16_rows", ROW_BYTES, 1
    return "bf16_elems", ROW_BYTES, max(1, ROW_BYTES // sz)  # float32 outputs: rows from elements


class DeltaModel:
    """Per-write and per-output costs of a delta update (module docstring): used by
    :func:`weight_transfer.experiments.sim.model.simulate` (``delta=``). Values are expectations
    (floats); cached per (kind, unit, length)."""

    def __init__(self, fractions: Fractions, hw: Hardware, *, granularity: str = "rows", merge_gap: int = 4096,
                 header_bytes: int = RDMA_HEADER_BYTES, mode: str = "scattered", costs=None):
        """``mode``: :data:`MODES`; ``costs``: measured passes per byte
        (:class:`~weight_transfer.experiments.sim.delta_costs.DeltaCosts`) for the compare, pack
        and apply, scaled by its rule; None: the compare's read-and-write count, ``(2 x output +
        changed) / hbm`` (``packed`` needs ``costs``)."""
        if mode not in MODES:
            raise ValueError(f"delta mode {mode!r}: expected one of {', '.join(MODES)}")
        if mode in ("packed", "masks") and costs is None:
            raise ValueError(f"delta mode {mode}: needs measured costs (--delta-costs)")
        self.mode, self.costs = mode, costs
        if granularity not in (*GRANULARITIES, "block8", "chunk64"):
            raise ValueError(f"delta granularity {granularity!r}: expected one of "
                             f"{', '.join((*GRANULARITIES, 'block8', 'chunk64'))}")
        if merge_gap < 0:
            raise ValueError(f"delta merge gap {merge_gap}: must be >= 0 bytes")
        self.fractions, self.hw, self.granularity, self.merge_gap = fractions, hw, granularity, merge_gap
        self.header_bytes = header_bytes
        self._kind: dict[str, str] = {}
        self._cost: dict[tuple, tuple[float, float, float]] = {}
        self._cmp: dict[tuple, float] = {}

    def _output_cost(self, recipe: Recipe, i: int, nbytes: int) -> tuple[float, float, float]:
        """(wire bytes, runs, payload bytes) of writing output ``i`` (``nbytes``) as a delta."""
        o = recipe.outputs[i]
        kind = self._kind.get(o.tensor)
        if kind is None:
            kind = self._kind[o.tensor] = tensor_kind(o.tensor)
        key = (kind, recipe.transform == "fp8_block" and i == 1, o.dtype, nbytes)
        got = self._cost.get(key)
        if got is None and self.mode == "masks":  # 1-byte compare in 64-byte chunks, from the element fractions
            meas, unit, _ = _unit(recipe, i, o.dtype, "elems")
            rec, chunks, changed = masks_record(nbytes, unit, self.fractions.get(kind, meas))
            got = self._cost[key] = (rec, min(1.0, chunks), changed, chunks)
        if got is None:
            meas, unit, sub = _unit(recipe, i, o.dtype, self.granularity)
            p = self.fractions.get(kind, meas)
            if sub > 1:
                p = 1.0 - (1.0 - p) ** sub
            n = -(-nbytes // unit)
            runs, units = expected_runs_and_units(n, p, self.merge_gap // unit)
            payload = min(float(nbytes), units * unit)
            if self.mode == "packed":  # one record: header + varint index + the changed bytes, 64-aligned
                rec = -(-(64 + runs * index_per_run(n, runs, units) + payload) // 64) * 64 if runs > 0 else 0.0
                got = self._cost[key] = (rec, min(1.0, runs), payload, runs)
            else:
                got = self._cost[key] = (payload + runs * self.header_bytes, runs, payload, runs)
        return got

    def apply_seconds(self, received: float) -> float:
        """Seconds a receiver's commit spends scattering ``received`` packed bytes (0 unless
        packed): ``apply_passes x 2 x bytes / hbm``."""
        if self.mode == "scattered":
            return 0.0
        return self.costs.seconds(self.costs.apply, received, self.hw.hbm_gbs)

    def write(self, recipe: Recipe, out_index: int, length: int) -> tuple[float, float]:
        """(wire bytes, ops) of one write of the schedule (all ``length`` bytes of output
        ``out_index``) as a delta."""
        b, n, _, _ = self._output_cost(recipe, out_index, length)
        return b, n

    def compare_seconds(self, recipe: Recipe) -> float:
        """Seconds the trainer spends comparing the recipe's outputs with its shadow and
        building the run list (once per rank, however many receivers)."""
        key = (recipe.transform, tuple(recipe.outputs[i].tensor for i in range(len(recipe.outputs))), recipe.shape)
        got = self._cmp.get(key)
        if got is None:
            hw = self.hw
            got = 0.0
            for i, o in enumerate(recipe.outputs):
                nb = itemsize(o.dtype)
                for a, b in o.box:
                    nb *= b - a
                wire, _, payload, runs = self._output_cost(recipe, i, nb)
                c = self.costs
                cmp_s = (c.seconds(c.compare, nb, hw.hbm_gbs) if c is not None
                         else (2 * nb + payload) / (hw.hbm_gbs * 1e9))
                if self.mode != "scattered":  # pack the record on the GPU: no run list crosses PCIe
                    got += cmp_s + c.seconds(c.pack, wire, hw.hbm_gbs) + 4 * hw.kernel_us * 1e-6
                else:
                    got += cmp_s + 3 * hw.kernel_us * 1e-6 + runs * RUN_DESCRIPTOR_BYTES / (hw.pcie_gbs * 1e9)
            self._cmp[key] = got
        return got


def assumptions(header_bytes: int = RDMA_HEADER_BYTES) -> list[str]:
    """The delta mode's assumptions, one line each (printed with the prediction)."""
    return [
        "the plan, every full_tensor(), fusion and FP8 quantization run as in a full update, on the full shard "
        "(the trainer needs the whole tensor to quantize it)",
        "the trainer compares every output byte with its shadow: (2 x output + changed bytes) / hbm_gbs, 3 kernel "
        f"launches per output, {RUN_DESCRIPTOR_BYTES} B per run to the host over PCIe; once per rank per output",
        f"one RDMA WRITE per run: rdma_msg_us each at the sender, +{header_bytes} B of headers on the wire at both "
        f"ends; runs at most the row's merge gap apart are one run (the executor's --delta-merge-gap)",
        "units change independently (uniform scattering) with the measured fraction of their kind and granularity; "
        "expected runs and bytes per write",
        "the measured toy model is dense: its MLP stands in for the experts, the whole model for the router "
        "(fallbacks listed per row); its fractions are an upper-side estimate for a pretrained model (docs/DELTA.md)",
        "the receiver stays passive (no apply); the barrier between mesh groups and the releases are unchanged; the "
        "shadow (one byte per distinct output byte per rank) is persistent memory, outside the watermark",
        "left out, as for the full update: switch congestion and incast, the receiver NIC's message rate, the "
        "control plane's go/complete round trip",
    ]


def packed_assumptions(costs) -> list[str]:
    """The measured-cost rows' assumptions (``--delta-costs``), one line each."""
    return [
        f"measured costs ({costs.source}): compare {costs.compare:.2f} passes per output byte, pack {costs.pack:.2f} and "
        f"apply {costs.apply:.2f} per packed byte (a pass = one memcpy of the bytes on the measuring machine)",
        "scaling rule: a pass over B bytes costs 2 B / hbm_gbs on the simulated GPU (read + write at the datasheet "
        "bandwidth, as the fusion copies are charged); the CPU loop's ratio to a copy is assumed for the GPU kernel",
        "scattered (measured): the executor's 8-byte blocks, gap 0, one RDMA WRITE per run; packed: one record per "
        "output and receiver (format 2: 64 B header + a varint index, ~2 B per run, + changed bytes), one WRITE each, "
        "the compare and the pack in the prepare stage, the receiver's apply at its commit before the version is "
        "published (the busiest receiver's apply added to the update; off the critical path with shadow targets, "
        "section 9); masks: the same with format 3 (64 B header + 12 B per changed 64-byte chunk + every byte of each "
        "changed element), the record the executor's cost model packs on a NIC, with format 3's measured passes",
    ]
