"""Shadow targets in the at-scale simulation (``weight-transfer simulate <config> --shadow``;
docs/SIMULATION.md, "Shadow targets").

Each inference GPU keeps one extra copy (the *shadow*) of the bytes it receives per update.
The one-sided writes land in the shadow while the engine keeps serving the old version; a
go-live between two engine steps then makes the new version live, by a **flip** (live and
shadow swap storage pointers) or a **copy** (one device-local copy shadow -> live). Without a
shadow the engine **pauses** for the whole transfer. This module computes, on the real
schedule's per-rank destination bytes, the memory each inference GPU needs for the shadow,
whether it fits, and the stall per update of the three; nothing here is a measurement.

Every figure is a named constant with its source (or stated as an assumption) below and in
:func:`assumptions`.
"""
from __future__ import annotations

from dataclasses import dataclass

from weight_transfer.testing.catalog import load_config

from . import metadata, model
from .configs import SimConfig
from .hardware import Hardware

HBM_BYTES: dict[str, float] = {"H100": 80e9, "H200": 141e9, "H20": 96e9}
"""GPU memory capacity per GPU, bytes, by the first word of :attr:`Hardware.name`: NVIDIA
datasheets (H100 SXM 80 GB, H200 141 GB, H20 96 GB), read as decimal GB. On the safe side:
``nvidia-smi`` lists an H200 at 143,771 MiB = 150.8e9 B (NVIDIA/cuda-samples issue #311)."""
HBM_SOURCE = "NVIDIA datasheets: H100 SXM 80 GB, H200 141 GB, H20 96 GB (read as 1e9 B)"

COPY_EFFICIENCY = 0.75
"""Achieved fraction of the datasheet HBM rate (``Hardware.hbm_gbs``) for a device-local copy,
read and write traffic counted: CUDA's p2pBandwidthLatencyTest copies a buffer to itself on
each GPU and counts both the read and the write (its source: ``gb *= 2; // must count both
the read and the write here``); on 8 x H100 SXM it printed 2,475-2,515 GB/s (NVIDIA/nccl issue
#1264), 74-75% of the 3,350 GB/s datasheet rate. Taken for every GPU (no H200 figure found)."""
COPY_SOURCE = ("p2pBandwidthLatencyTest device-local copy on H100 SXM, 2475-2515 GB/s read+write of 3350 "
               "(NVIDIA/nccl issue #1264)")

FLIP_US_PER_TENSOR = 1.0
"""A flip's cost per destination tensor, microseconds: re-pointing one parameter at the other
buffer (``param.data = other``). Assumption, rounded up from 0.17 us per assignment measured
on this project's 2-core VM (torch 2.13 CPU tensors, 1,339 parameters, the median of 50 passes;
the assignment changes host-side metadata only, so the device does not enter)."""

DEFAULT_RESERVE = 0.2
"""Fraction of HBM kept for everything but the weights and the shadow: KV cache, activations,
CUDA graphs, the allocator, and what vLLM's ``gpu_memory_utilization`` (0.9 by default) leaves
unused. Assumption (``--shadow-reserve``)."""

MODES = ("pause", "flip", "copy")


def hbm_bytes(hw: Hardware) -> float:
    """GPU memory capacity of ``hw``'s GPU (:data:`HBM_BYTES`); ValueError when unknown."""
    key = hw.name.split()[0].rstrip(",") if hw.name else ""
    if key not in HBM_BYTES:
        raise ValueError(f"shadow targets: no GPU memory capacity known for hardware {hw.name!r} "
                         f"(known: {', '.join(HBM_BYTES)})")
    return HBM_BYTES[key]


def copy_seconds(nbytes: int | float, hw: Hardware, efficiency: float = COPY_EFFICIENCY) -> float:
    """A device-local copy of ``nbytes``: each byte is read once and written once, so
    ``2 x nbytes`` of HBM traffic at ``hbm_gbs x efficiency``. Launches (one per destination
    tensor or one per region, a few microseconds each, queued back to back) overlap the copies
    and are not counted."""
    return 2 * nbytes / (hw.hbm_gbs * 1e9 * efficiency)


def flip_seconds(n_tensors: int) -> float:
    """A flip on a GPU holding ``n_tensors`` destination tensors (:data:`FLIP_US_PER_TENSOR`)."""
    return n_tensors * FLIP_US_PER_TENSOR * 1e-6


@dataclass
class ShadowSpec:
    """What ``simulate --shadow`` assumes (``--shadow-reserve``, ``--shadow-copy-efficiency``)."""

    reserve: float = DEFAULT_RESERVE
    copy_efficiency: float = COPY_EFFICIENCY

    @classmethod
    def from_options(cls, opts) -> ShadowSpec | None:
        """From :class:`~weight_transfer.experiments.sim.options.SimulateOptions` or the parsed
        arguments (same names); None without ``--shadow``."""
        if not getattr(opts, "shadow", False):
            return None
        return cls(float(getattr(opts, "shadow_reserve", DEFAULT_RESERVE)),
                   float(getattr(opts, "shadow_copy_efficiency", COPY_EFFICIENCY)))

    def usable(self, hw: Hardware) -> float:
        """Bytes per GPU left to the weights and the shadow."""
        return (1.0 - self.reserve) * hbm_bytes(hw)

    def check(self, cfg: SimConfig, dests: dict | None = None) -> None:
        """Refuse (ValueError, one line naming the rank and its bytes) when ``cfg`` runs no
        reference schedule, its GPU's capacity is unknown, or the weights plus their shadow of
        some inference rank exceed :meth:`usable`. ``dests``: the destination metadata
        (default: synthesized here, seconds at Kimi-K2 scale, before any planning)."""
        if "reference" not in cfg.methods:
            raise ValueError(f"--shadow: config {cfg.name} runs no reference schedule (methods: {', '.join(cfg.methods)})")
        hw = infer_hw(cfg)
        cap, usable = hbm_bytes(hw), self.usable(hw)
        if dests is None:
            dests = metadata.dest_metas(load_config(cfg.model, **cfg.overrides), cfg.layout)
        w = {r: metadata.region_bytes(ms) for r, ms in dests.items()}
        r = max(sorted(w), key=lambda k: w[k])
        if 2 * w[r] > usable:
            raise ValueError(
                f"--shadow does not fit: inference rank {r} holds {w[r]} B ({w[r] / 1e9:.2f} GB) of weights; with its "
                f"shadow it needs {2 * w[r]} B ({2 * w[r] / 1e9:.2f} GB), above the {usable / 1e9:.2f} GB left of its "
                f"{cap / 1e9:g} GB ({hw.name.split(',')[0]}) after {self.reserve:.0%} kept for KV cache and activations "
                f"(--shadow-reserve {self.reserve:g})")


def infer_hw(cfg: SimConfig) -> Hardware:
    """The inference GPUs' hardware."""
    return cfg.infer_hardware or cfg.hardware


def shadow_rows(cfg: SimConfig, head: model.SimResult, dests: dict, spec: ShadowSpec) -> list[dict]:
    """One row per mode (:data:`MODES`) for the schedule simulated as ``head``: the shadow of
    inference rank ``r`` is the bytes the schedule writes into it (``head.rank_bytes
    ["infer_recv"]``, the schedule's per-rank destination bytes); its live weights are its
    registered region (:func:`metadata.region_bytes` of ``dests[r]``)."""
    hw = infer_hw(cfg)
    recv = head.rank_bytes.get("infer_recv", {})
    ranks = sorted(dests)
    shadow = {r: int(recv.get(r, 0)) for r in ranks}
    weights = {r: metadata.region_bytes(dests[r]) for r in ranks}
    n_tensors = max(len(dests[r]) for r in ranks)
    cap, usable = hbm_bytes(hw), spec.usable(hw)
    s_max, w_max = max(shadow.values()), max(weights.values())
    after = {r: weights[r] + shadow[r] for r in ranks}
    busiest = max(ranks, key=lambda r: after[r])
    stall = {"pause": head.seconds, "flip": flip_seconds(n_tensors), "copy": copy_seconds(s_max, hw, spec.copy_efficiency)}
    golive = {"pause": "engine paused for the whole transfer", "flip": "live and shadow swap storage pointers",
              "copy": "one device-local copy shadow -> live"}
    out = []
    for m in MODES:
        extra = 0 if m == "pause" else 1
        mem = max(weights[r] + extra * shadow[r] for r in ranks)
        out.append({
            "config": cfg.name, "method": head.method, "mode": m, "go_live": golive[m], "transfer_s": head.seconds,
            "stall_s": stall[m], "stall_vs_pause": stall[m] / head.seconds if head.seconds else float("nan"),
            "new_version_live_s": head.seconds + (0.0 if m == "pause" else stall[m]),
            "shadow_bytes_max": extra * s_max, "shadow_bytes_mean": extra * sum(shadow.values()) / len(ranks),
            "shadow_bytes_min": extra * min(shadow.values()), "weights_bytes_max": w_max,
            "weights_bytes_mean": sum(weights.values()) / len(ranks), "mem_bytes_max": mem,
            "busiest_rank": busiest, "hbm_bytes": cap, "reserve": spec.reserve, "usable_bytes": usable,
            "free_bytes_min": cap - mem, "fits": mem <= usable, "n_infer": len(ranks), "n_tensors_max": n_tensors,
            "hbm_gbs": hw.hbm_gbs, "copy_efficiency": spec.copy_efficiency, "flip_us_per_tensor": FLIP_US_PER_TENSOR,
            "hardware": hw.name, "simulated": True})
    return out


def assumptions(rows: list[dict]) -> list[str]:
    """What the shadow rows assume, with the figures' sources."""
    r = rows[0]
    return [
        f"memory: {HBM_SOURCE}; {r['reserve']:.0%} of it kept for KV cache, activations, CUDA graphs and the allocator "
        "(--shadow-reserve); the shadow holds every byte a GPU receives per update (a full update rewrites all of them)",
        f"flip: {FLIP_US_PER_TENSOR:g} us per destination tensor ({r['n_tensors_max']} on the busiest GPU) to re-point it "
        "(0.17 us measured per `param.data = other` on this project's VM, rounded up); needs kernels that read the "
        "weights through pointers the flip can change: CUDA graphs captured on the live addresses must be captured for "
        "both buffers",
        f"copy: 2 x bytes (each byte read and written) / ({r['hbm_gbs']:g} GB/s x {r['copy_efficiency']:g}); "
        f"{r['copy_efficiency']:g}: {COPY_SOURCE}; the copies' launches overlap them and are not counted",
        "the wait for the engine's step boundary is not a stall (the engine finishes its step in every mode, the pause "
        "waits for the same boundary) and is not counted",
        "not modeled: while the engine serves, the incoming writes share each inference GPU's NIC with the engine's own "
        "inter-node traffic (expert-parallel all-to-all) and its HBM (the writes' ~36.5 GB/s); decode steps in that "
        "window are slower by an amount this model does not predict",
        "delta updates (section 8) write only changed bytes, so the shadow must hold the current version first: a copy "
        "go-live leaves shadow = live; after a flip the shadow is two versions old and must also receive the previous "
        "update's changes",
    ]


def format_shadow(rows: list[dict]) -> str:
    """The short table printed after the main one."""
    if not rows:
        return ""
    r0 = rows[0]
    L = [f"# shadow targets (SIMULATED; transfer = the {r0['method']} prediction, {r0['transfer_s']:.3f} s; "
         f"{r0['n_infer']} inference GPUs, {r0['hbm_bytes'] / 1e9:g} GB each, {r0['usable_bytes'] / 1e9:.1f} GB usable "
         f"for weights + shadow):",
         f"# per GPU: weights {r0['weights_bytes_max'] / 1e9:.2f} GB max / {r0['weights_bytes_mean'] / 1e9:.2f} GB mean; "
         f"shadow = the bytes it receives per update: {rows[1]['shadow_bytes_max'] / 1e9:.2f} GB max / "
         f"{rows[1]['shadow_bytes_mean'] / 1e9:.2f} GB mean",
         f"{'mode':>6} {'go-live':>38} {'memory/GPU':>11} {'free':>8} {'fits':>5} {'stall':>9} {'stall/':>7} {'new version':>12}",
         f"{'':>6} {'':>38} {'(GB, max)':>11} {'(GB)':>8} {'':>5} {'(ms)':>9} {'pause':>7} {'live (s)':>12}"]
    for r in rows:
        L.append(f"{r['mode']:>6} {r['go_live']:>38} {r['mem_bytes_max'] / 1e9:>11.2f} {r['free_bytes_min'] / 1e9:>8.2f} "
                 f"{'yes' if r['fits'] else 'no':>5} {r['stall_s'] * 1e3:>9.2f} {r['stall_vs_pause']:>7.4f} "
                 f"{r['new_version_live_s']:>12.3f}")
    L += [f"# assumption: {a}" for a in assumptions(rows)]
    return "\n".join(L)
