"""The per-output cost model of delta updates: ``scattered``, ``packed`` or ``full``
(:mod:`weight_transfer.delta`, ``ExecutorOptions.delta_mode``).

Once an output's changed runs are known (``m`` runs carrying ``c`` bytes of its ``n``), each
way of writing it costs, in seconds (``w`` the wire's seconds per byte):

- ``full``: ``n x w`` (the whole output, one write);
- ``scattered``: ``m x run + c x w`` (one remote segment per run:
  :class:`weight_transfer.transport.runs.RunsOp`; ``run`` the transport's cost of one more
  segment);
- ``packed``: ``record x w + m x (pack_run + apply_run) + c x (pack_byte + apply_byte) + op``
  with ``record = 64 + index + c`` rounded up to 64 (:mod:`weight_transfer.delta_packed`, format
  2: the sender packs, one write, the receiver scatters at commit). ``index`` is the exact
  varint index of the runs (two LEB128 varints per run in units of the compare block, ~2-2.3
  bytes per run on a real RL step) when the caller sized it (:class:`weight_transfer.delta.DeltaState`
  does, in C, before choosing), else :meth:`CostModel.index_estimate` (runs spread uniformly).

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

__all__ = ["MODES", "CostModel", "WIRE_GBPS", "RUN_NS"]

MODES = ("auto", "scattered", "packed")
"""``ExecutorOptions.delta_mode`` values: ``auto`` the cheapest of the three per output,
``scattered`` never packed (runs or whole, the first delta's behaviour), ``packed`` packed
whenever it fits the landing region (else runs or whole by cost)."""

WIRE_GBPS = {"cma": 3.0, "shm": 6.0, "nixl": 12.5, "verbs": 12.5, "cuda_ipc": 100.0}
"""Default wire bandwidth per transport (GB/s, 1e9 bytes/s): cma and shm measured here (a
memcpy in another process's memory: cma 2.4-3.0 GB/s at 64 KiB under load in the op table, shm ~5); nixl / verbs a 100 Gb/s NIC."""
RUN_NS = {"cma": 300.0, "shm": 20.0, "nixl": 1000.0, "verbs": 100.0, "cuda_ipc": 5000.0}
"""Default cost of one more scattered run per transport (ns): cma pins the remote pages of
every iovec (~300 ns measured), shm a memcpy call, nixl one transfer descriptor (~1 us through
its Python binding, measured per op), verbs one work request, cuda_ipc one copy launch."""


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
    """Seconds to pack one run (its index entry and its bytes' memcpy; measured ~18 ns/run at 8 B
    runs on the loaded 2-core VM, ``bench-delta --ops-only``)."""
    pack_byte_s: float = 0.1e-9
    apply_run_s: float = 10e-9
    """Seconds the receiver's scatter spends per run (measured ~9 ns/run at 8 B runs)."""
    apply_byte_s: float = 0.1e-9
    mode: str = "auto"
    """One of :data:`MODES`."""

    @classmethod
    def for_transport(cls, name: str, *, mode: str = "auto", wire_gbps: float | None = None,
                      op_cost_bytes: int | None = None) -> CostModel:
        """The defaults of transport ``name``; ``wire_gbps`` (GB/s) overrides the wire,
        ``op_cost_bytes`` (bytes at the wire per run, the first delta's ``delta_op_cost``) the
        run cost."""
        if mode not in MODES:
            raise ValueError(f"delta_mode={mode!r}: one of {MODES}")
        w = 1.0 / ((wire_gbps if wire_gbps is not None else WIRE_GBPS.get(name, 12.5)) * 1e9)
        run = op_cost_bytes * w if op_cost_bytes is not None else RUN_NS.get(name, 3000.0) * 1e-9
        return cls(wire_s_per_byte=w, run_s=run, mode=mode)

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
        rec = -(-(64 + index_bytes + changed) // 64) * 64
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
