"""The per-output cost model of delta updates: ``scattered``, ``packed`` or ``full``
(:mod:`weight_transfer.delta.runs`, ``ExecutorOptions.delta_mode``).

Once an output's changed runs are known (``m`` runs carrying ``c`` bytes of its ``n``), each
way of writing it costs, in seconds (``w`` the wire's seconds per byte):

- ``full``: ``n x w`` (the whole output, one write);
- ``scattered``: ``m x run + c x w`` (one remote segment per run:
  :class:`weight_transfer.transport.runs.RunsOp`; ``run`` the transport's cost of one more
  segment);
- ``packed``: ``record x w + m x (pack_run + apply_run) + c x (pack_byte + apply_byte) + op``
  with ``record = 64 + index + c`` rounded up to 64 (:mod:`weight_transfer.delta.packed`, format
  2: the sender packs, one write, the receiver scatters at commit). ``index`` is the exact
  varint index of the runs (two LEB128 varints per run in units of the compare block, ~2-2.3
  bytes per run on a real RL step) when the caller sized it (:class:`weight_transfer.delta.runs.DeltaState`
  does, in C, before choosing), else :meth:`CostModel.index_estimate` (runs spread uniformly).

**The packed record's format** (:meth:`CostModel.pack_format`, once per executor: the fused
pass must know it before it compares): ``runs`` (format 2 above) or ``masks`` (format 3: per
changed 64-byte chunk a 64-bit byte mask and a 4-byte chunk index, then the changed bytes;
``record = 64 + 8 x chunks + 4 x chunks`` (rounded up to 8) ``+ c``, rounded up to 64). Per run
of a real RL step, runs cost ``encode_run + pack_run + apply_run`` of CPU and ~2.2 index bytes
on the wire (or ``encode_run + run`` scattered, with ``mode`` auto); masks cost
``chunks_per_run x (chunk + 12 x w)`` (0.8 changed chunks per run on uniformly scattered bf16
changes at 1-byte compare; the vector compare, compress and expand ~15 ns per changed chunk,
sender and receiver together). Masks win above ~0.25 GB/s at cma's, NIXL's and verbs' run
costs (~0.37 GB/s on shm, whose scattered runs cost 20 ns): every transport's default wire
(one host, a NIC); runs on a slower link (the rate-limited veth of docs/DELTA.md, where format
2 measured 0.078x of a full push against format 3's 0.139x). Per output,
masks are packed or written whole (:meth:`CostModel.choose_masks`); there is no scattered
masks mode.

The comparison itself is the same for all three (it is what finds ``m`` and ``c``) and is not
part of the choice. ``w`` is the one parameter that moves the choice most: on one host, where
the "wire" is a memcpy, ``w`` is ~0.1-0.3 ns/B and ``full`` is hard to beat; over a link of a
few GB/s (NIXL over TCP, a rate-limited veth: ``delta_wire_gbps``) bytes dominate and packed
wins. Defaults per transport (:data:`WIRE_GBPS`, :data:`RUN_NS`) come from this machine's
measurements (docs/DELTA.md); pack and apply costs from the packed microbenchmark
(``weight-transfer bench-delta --ops-only``: C loops, ~10-20 ns per run of 8 bytes).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .masks import masks_index_bytes

__all__ = ["MODES", "FORMATS", "CostModel", "WIRE_GBPS", "RUN_NS"]

MODES = ("auto", "scattered", "packed")
"""``ExecutorOptions.delta_mode`` values: ``auto`` the cheapest of the three per output,
``scattered`` never packed (runs or whole, the first delta's behaviour), ``packed`` packed
whenever it fits the landing region (else runs or whole by cost)."""

FORMATS = ("auto", "runs", "masks")
"""``ExecutorOptions.delta_format`` values (the packed record's format: :meth:`CostModel.pack_format`)."""

WIRE_GBPS = {"cma": 3.0, "shm": 6.0, "nixl": 12.5, "verbs": 12.5, "cuda_ipc": 100.0}
"""Default wire bandwidth per transport (GB/s, 1e9 bytes/s): cma and shm measured here (a
memcpy in another process's memory: cma 2.4-3.0 GB/s at 64 KiB under load in the op table, shm ~5); nixl / verbs a 100 Gb/s NIC."""
RUN_NS = {"cma": 300.0, "shm": 20.0, "nixl": 1000.0, "verbs": 100.0, "cuda_ipc": 5000.0}
"""Default cost of one more scattered run per transport (ns): cma pins the remote pages of
every iovec (~300 ns measured), shm a memcpy call, nixl one transfer descriptor (~1 us through
its Python binding, measured per op), verbs one work request, cuda_ipc one copy launch."""


def _record_bytes(index_bytes: int, changed: int) -> int:
    """A packed record's bytes (:func:`weight_transfer.delta.packed.record_size`, which this
    module cannot import: that module imports the executor's delta state, which imports this)."""
    return -(-(64 + index_bytes + changed) // 64) * 64


@dataclass(kw_only=True, slots=True)
class CostModel:
    """Seconds per unit of each phase; :meth:`choose` picks the cheapest mode."""

    wire_s_per_byte: float
    """Seconds one more byte on the wire costs."""
    run_s: float
    """Seconds one more scattered run costs (:class:`~weight_transfer.transport.runs.RunsOp`)."""
    op_s: float = 3e-6
    """Seconds of one more write op (a packed record's write)."""
    pack_run_s: float = 15e-9
    """Seconds to pack one run (its index entry and its bytes' memcpy; ``bench-delta --ops-only``
    measures 6-17 ns per 8-byte run across its runs on the 2-core VMs, results/delta_phases.md)."""
    pack_byte_s: float = 0.1e-9
    apply_run_s: float = 10e-9
    """Seconds the receiver's scatter spends per run (the same benchmark: 5-8 ns per 8-byte run)."""
    apply_byte_s: float = 0.1e-9
    encode_run_s: float = 18e-9
    """Seconds the fused cast + compare spends per run it emits for a format-2 record, over the
    cast itself (``weight-transfer bench-delta --ops-only``, rows ``fused-runs`` - ``cast``: 18-34
    ns per run on the 2-core VMs, results/delta_phases.md; the lower end)."""
    chunk_s: float = 15e-9
    """Seconds a format-3 record costs per changed 64-byte chunk: encode, check and apply (the same
    benchmark: ``fused-masks`` no slower than ``cast``, ``check-masks`` ~1 ns, ``apply-masks``
    ~5 ns per chunk alone; 15 ns is the RL loop's commit inside vLLM, apply p50 6.8 ms for ~0.5 M
    chunks, results/rl_delta.md)."""
    chunks_per_run: float = 0.8
    """Changed 64-byte chunks per run of changed bytes on a real RL step's bf16 changes at 1-byte
    compare (0.82 in the benchmark: 88.5 k chunks for 107 k runs at 1.28% of the elements)."""
    mode: str = "auto"
    """One of :data:`MODES`."""
    format: str = "auto"
    """One of :data:`FORMATS`."""

    @classmethod
    def for_transport(cls, name: str, *, mode: str = "auto", wire_gbps: float | None = None,
                      op_cost_bytes: int | None = None, fmt: str = "auto") -> CostModel:
        """The defaults of transport ``name``; ``wire_gbps`` (GB/s) overrides the wire,
        ``op_cost_bytes`` (bytes at the wire per run, the first delta's ``delta_op_cost``) the
        run cost, ``fmt`` the packed format (:data:`FORMATS`). ValueError for an unknown mode or
        format."""
        if mode not in MODES:
            raise ValueError(f"delta_mode={mode!r}: one of {MODES}")
        if fmt not in FORMATS:
            raise ValueError(f"delta_format={fmt!r}: one of {FORMATS}")
        w = 1.0 / ((wire_gbps if wire_gbps is not None else WIRE_GBPS.get(name, 12.5)) * 1e9)
        run = op_cost_bytes * w if op_cost_bytes is not None else RUN_NS.get(name, 3000.0) * 1e-9
        return cls(wire_s_per_byte=w, run_s=run, mode=mode, format=fmt)

    def full(self, n: int) -> float:
        """Seconds to write ``n`` bytes whole."""
        return n * self.wire_s_per_byte

    def scattered(self, runs: int, changed: int) -> float:
        """Seconds to write ``runs`` runs of ``changed`` bytes as remote segments."""
        return runs * self.run_s + changed * self.wire_s_per_byte

    @staticmethod
    def index_estimate(n: int, runs: int, changed: int) -> int:
        """Bytes of a packed record's index for ``runs`` runs of ``changed`` bytes spread
        uniformly over ``n`` bytes, in 1-byte units (an upper estimate for larger units): per
        run one varint of the gap and one of the length, each ``1 + sum_k P(value >= 128^k)``
        bytes with geometrically distributed values of the run's mean."""
        if runs <= 0:
            return 0
        per = 0.0
        for mean in (max(n - changed, 0) / runs, changed / runs):
            per += 1.0 + sum(math.exp(-(128 ** k) / mean) for k in range(1, 9)) if mean > 0 else 1.0
        return int(math.ceil(runs * per))

    def packed(self, runs: int, changed: int, index_bytes: int | None = None, n: int | None = None) -> float:
        """Seconds to pack, write and apply a record of ``runs`` runs and ``changed`` bytes with
        ``index_bytes`` of index (None: :meth:`index_estimate` over ``n`` bytes, default
        ``changed`` x 64)."""
        if index_bytes is None:
            index_bytes = self.index_estimate(n if n is not None else 64 * changed, runs, changed)
        rec = _record_bytes(index_bytes, changed)
        return (rec * self.wire_s_per_byte + self.op_s + runs * (self.pack_run_s + self.apply_run_s)
                + changed * (self.pack_byte_s + self.apply_byte_s))

    def max_runs(self, n: int, packable: bool) -> int | None:
        """Most runs at which a delta of an ``n``-byte output can still beat writing it whole
        (the comparison stops past it); None when unbounded (a run costs nothing)."""
        per = [self.run_s] if self.mode != "packed" or not packable else []
        if packable and self.mode != "scattered":
            per.append(3 * self.wire_s_per_byte + self.pack_run_s + self.apply_run_s)  # >= 2 B index + 1 B data
        best = min(per) if per else self.run_s
        if best <= 0:
            return None
        return int(self.full(n) / best) + 1

    def choose(self, n: int, runs: int, changed: int, packable: bool, index_bytes: int | None = None) -> str:
        """``"full"``, ``"scattered"`` or ``"packed"`` for an ``n``-byte output with ``runs``
        changed runs of ``changed`` bytes; ``packable``: a landing region can take it;
        ``index_bytes``: its packed record's index (None: estimated)."""
        costs = {"full": self.full(n)}
        if self.mode != "packed" or not packable:
            costs["scattered"] = self.scattered(runs, changed)
        if packable and self.mode != "scattered":
            costs["packed"] = self.packed(runs, changed, index_bytes, n)
        if self.mode == "packed" and packable:
            return "packed"  # forced whenever it fits
        return min(costs, key=lambda k: (costs[k], k != "full"))

    def pack_format(self) -> str:
        """``"runs"`` or ``"masks"``: :attr:`format`, or for ``auto`` the cheaper per run of a
        real RL step (the module docstring): runs, the cheaper of packed ``encode_run + pack_run
        + apply_run + 2.2 x w`` and scattered ``encode_run + run`` (unless :attr:`mode` forces
        one), against masks ``chunks_per_run x (chunk + 12 x w)``. Runs when a scattered run
        costs nothing (``delta_op_cost`` 0 asks for the fewest bytes; format 3 has no scattered
        mode)."""
        if self.format != "auto":
            return self.format
        if self.run_s <= 0 and self.mode != "packed":
            return "runs"
        w = self.wire_s_per_byte
        runs = self.encode_run_s + self.pack_run_s + self.apply_run_s + 2.2 * w
        if self.mode == "auto":
            runs = min(runs, self.encode_run_s + self.run_s)
        masks = self.chunks_per_run * (self.chunk_s + 12 * w)
        return "masks" if masks < runs else "runs"

    def packed_masks(self, chunks: int, changed: int) -> float:
        """Seconds to encode, write, check and apply a format-3 record of ``chunks`` changed
        64-byte chunks carrying ``changed`` bytes."""
        rec = _record_bytes(masks_index_bytes(chunks), changed)
        return rec * self.wire_s_per_byte + self.op_s + chunks * self.chunk_s + changed * self.apply_byte_s

    def max_chunks(self, n: int) -> int | None:
        """Most changed chunks at which a format-3 record of an ``n``-byte output can still beat
        writing it whole (the comparison stops counting past it); None when unbounded."""
        per = 12 * self.wire_s_per_byte + self.chunk_s
        if self.mode == "packed" or per <= 0:
            return None
        return int(self.full(n) / per) + 1

    def choose_masks(self, n: int, chunks: int, changed: int, packable: bool) -> str:
        """``"packed"`` or ``"full"`` for an ``n``-byte output whose changes are ``chunks``
        changed chunks of ``changed`` bytes (format 3 has no scattered mode)."""
        if not packable:
            return "full"
        if self.mode == "packed":
            return "packed"
        return "packed" if self.packed_masks(chunks, changed) < self.full(n) else "full"
