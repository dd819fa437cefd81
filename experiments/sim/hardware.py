"""Every hardware and software figure the cost model uses: a named field with its unit and
source. Nothing here is fitted to a published result the model is compared with
(docs/SIMULATION.md lists them again beside the calibration table).

Sources are of three kinds, said in each docstring and in :data:`SOURCES`: a **datasheet**
(vendor specification), a **measurement** someone published (with where), or an
**assumption** (an order of magnitude we chose, with the reason). Every assumption is in
:data:`SENSITIVITY`: ``weight-transfer simulate <config> --sensitivity`` re-runs the cost
model on the same schedule with each one halved and doubled and prints the effect on the
prediction (docs/SIMULATION.md, section 4).

Profiles (functions returning a :class:`Hardware`): :func:`h100_cx7`, :func:`h200_cx7`,
:func:`h200_efa`, :func:`h20_cx7`; :func:`h100`, :func:`h200`, :func:`h20` are the earlier
names of the ConnectX-7 ones.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

TE_PAPER = "TransferEngine paper (Perplexity, arXiv 2510.27656), as cited in issue #7"
NCCL_NVLINK = ("NCCL maintainers on nccl-tests: 'With the protocol overhead (~20%) NCCL can get an effective NVLink "
               "bandwidth of 370GB/s' (github.com/NVIDIA/nccl-tests/issues/212) and, for all_gather_perf busbw on 8 "
               "H100, '360 GB/s is exactly what we'd expect on H100' (github.com/NVIDIA/nccl-tests/issues/326)")
LEQUN_0907 = ("Lequn Chen, 'Journey to 2-second Inter-node RL Weight Transfer' (le.qun.ch/en/blog/2025/09/07/"
              "rl-weight-transfer): AWS EFA, 2 x 200 Gb/s per GPU; one GPU-to-GPU transfer of 16.133 GB in 0.441 s "
              "= 36.5 GB/s (figures as quoted in issue #16)")


@dataclass(kw_only=True, slots=True)
class Hardware:
    """One GPU node type and its fabric. Rates in GB/s are 1e9 B/s; Gb/s are 1e9 bit/s."""

    name: str = "H100 SXM, 8 x ConnectX-7 400 Gb/s"
    gpus_per_node: int = 8
    """GPUs per node (DGX/HGX H100 and H200: 8)."""
    nics_per_node: int = 8
    """RDMA NICs per node, one per GPU on the same PCIe switch (DGX H100 user guide: eight
    single-port ConnectX-7 400 Gb/s for the compute fabric). On EFA nodes, one *logical* NIC
    per GPU made of that GPU's EFA devices (TransferEngine drives the NICs of a GPU as one)."""
    nic_line_gbps: float = 400.0
    """NIC line rate per GPU, Gb/s per direction (ConnectX-7 datasheet: 400 Gb/s NDR). The
    physical floor divides by this."""
    nic_gbps: float = 378.0
    """Achieved RDMA WRITE bandwidth per GPU, Gb/s per direction: 378 Gb/s measured on a
    400 Gb/s ConnectX-7 (TransferEngine paper, arXiv 2510.27656, as cited in issue #7; NCCL's
    maintainers quote 46-48 GB/s = 368-384 Gb/s per NDR NIC, nccl-tests issue #290). The
    prediction uses this rate."""
    rdma_msg_us: float = 1.0
    """Per-WRITE cost at the sender, microseconds: posting the work request and reaping its
    completion in a software loop. Assumption (order of magnitude of ibv_post_send +
    completion polling); in the sensitivity table."""
    rdma_latency_us: float = 5.0
    """Time from the last byte posted to its completion seen by the sender, microseconds.
    Assumption (InfiniBand round trip of a few microseconds); in the sensitivity table."""
    pcie_gbs: float = 63.0
    """Host-to-device copy rate, GB/s: PCIe Gen5 x16 per direction (32 GT/s x 16 lanes,
    128b/130b encoding; PCI-SIG specification). Spec rate, so H2D is optimistic; in the
    sensitivity table (checkpoint-engine's prediction is H2D-bound)."""
    nvlink_line_gbs: float = 450.0
    """NVLink line rate per GPU per direction, GB/s (H100 SXM datasheet: 900 GB/s
    bidirectional). The physical floor divides by this."""
    nvlink_gbs: float = 360.0
    """Achieved NVLink bandwidth of an all-gather, GB/s (nccl-tests busbw): 360 GB/s on 8 x
    H100, per NCCL's maintainers (nccl-tests issues #326 and #212: ~20% protocol overhead
    on the 450 GB/s line rate). ``full_tensor()`` within a node uses this rate."""
    collective_step_us: float = 10.0
    """Latency of one ring step of an all-gather / broadcast, microseconds. Assumption (NCCL
    ring latencies are microseconds per step intra-node and ~10 us across nodes); in the
    sensitivity table."""
    hbm_gbs: float = 3350.0
    """GPU memory bandwidth used for fusion copies and FP8 quantization, GB/s (H100 SXM
    datasheet: 3.35 TB/s). These kernels are memory bound and modeled at the datasheet rate:
    no measured rate of the quantization kernel on this GPU was found, so it is in the
    sensitivity table (x0.5: kernels at half the datasheet rate)."""
    kernel_us: float = 5.0
    """Launch cost of one GPU kernel (one recipe's fusion or quantization), microseconds.
    Assumption (CUDA kernel launch, a few microseconds); in the sensitivity table."""
    barrier_us: float = 1000.0
    """One Gloo barrier over TCP across the training world, microseconds. Assumption:
    log2(256) = 8 rounds of ~100 us TCP round trips, rounded up; in the sensitivity table."""
    release_us: float = 10.0
    """Freeing a task's temporaries (caching allocator, no deregistration: regions are
    registered once), microseconds. Assumption; in the sensitivity table."""
    # ---------------------------------------------------------------- baselines' overheads
    python_call_us: float = 50.0
    """Python-side cost of one ``load_weights`` call for one tensor on one worker
    (weight_loader dispatch, slicing, copy launch), microseconds. Assumption (vLLM's loaders
    are Python per tensor; tens of microseconds); in the sensitivity table."""
    rpc_us: float = 1000.0
    """One RPC round trip from the trainer to an inference worker (serialize, send, dispatch,
    reply), microseconds. Assumption (a Python RPC over TCP on a datacenter LAN: 0.1-1 ms;
    the upper end, since every call carries a tensor header)."""
    nccl_call_us: float = 50.0
    """Fixed cost of one NCCL broadcast call (launch + first-byte latency across nodes),
    microseconds. Assumption; in the sensitivity table."""

    def __post_init__(self):
        for f in ("nic_gbps", "nic_line_gbps", "pcie_gbs", "nvlink_gbs", "nvlink_line_gbs", "hbm_gbs"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Hardware.{f} must be > 0")
        if self.nic_gbps > self.nic_line_gbps:
            raise ValueError(f"Hardware: achieved nic_gbps {self.nic_gbps} above the line rate {self.nic_line_gbps}")
        if self.nvlink_gbs > self.nvlink_line_gbs:
            raise ValueError(f"Hardware: achieved nvlink_gbs {self.nvlink_gbs} above the line rate {self.nvlink_line_gbs}")

    @property
    def nic_Bps(self) -> float:
        """Achieved NIC rate, bytes/s."""
        return self.nic_gbps * 1e9 / 8

    @property
    def nic_line_Bps(self) -> float:
        return self.nic_line_gbps * 1e9 / 8

    def scaled(self, field: str, factor: float) -> Hardware:
        """A copy with ``field`` multiplied by ``factor`` (the sensitivity table). Rates are
        not capped at their line rate here: x2 of an achieved rate is a what-if."""
        if field not in {f.name for f in fields(self)}:
            raise ValueError(f"Hardware has no field {field!r}")
        new = {field: getattr(self, field) * factor}
        line = {"nic_gbps": "nic_line_gbps", "nvlink_gbs": "nvlink_line_gbs"}.get(field)
        if line:  # an achieved rate above its line rate: raise the line rate with it
            new[line] = max(getattr(self, line), new[field])
        return replace(self, **new)


SOURCES: dict[str, tuple[str, str]] = {
    "gpus_per_node": ("datasheet", "DGX/HGX H100 and H200: 8 GPUs per node"),
    "nics_per_node": ("datasheet", "DGX H100 user guide: 8 x ConnectX-7 for the compute fabric; AWS p5en: 16 x 200 Gb/s EFA, "
                                   "2 per GPU, driven as one per GPU"),
    "nic_line_gbps": ("datasheet", "ConnectX-7 NDR 400 Gb/s; EFA 2 x 200 Gb/s per GPU"),
    "nic_gbps": ("measurement", f"CX-7: 378 Gb/s RDMA WRITE, {TE_PAPER}; EFA: 36.5 GB/s = 292 Gb/s GPU to GPU, {LEQUN_0907}"),
    "pcie_gbs": ("datasheet", "PCIe Gen5 x16, 63 GB/s per direction (spec rate)"),
    "nvlink_line_gbs": ("datasheet", "H100/H200/H20 SXM: NVLink 900 GB/s bidirectional"),
    "nvlink_gbs": ("measurement", NCCL_NVLINK),
    "hbm_gbs": ("datasheet", "H100 SXM 3.35 TB/s, H200 4.8 TB/s, H20 4.0 TB/s; no achieved rate of the fusion/FP8 kernels found"),
    "rdma_msg_us": ("assumption", "host-side post + completion per work request"),
    "rdma_latency_us": ("assumption", "InfiniBand completion round trip"),
    "collective_step_us": ("assumption", "NCCL ring step latency"),
    "kernel_us": ("assumption", "CUDA kernel launch"),
    "barrier_us": ("assumption", "Gloo barrier over TCP, log2(256) rounds of ~100 us"),
    "release_us": ("assumption", "caching-allocator free"),
    "python_call_us": ("assumption", "vLLM load_weights Python dispatch per tensor per worker"),
    "rpc_us": ("assumption", "Python RPC round trip over TCP"),
    "nccl_call_us": ("assumption", "NCCL broadcast call fixed cost across nodes"),
}
"""field -> (kind, source) for docs/SIMULATION.md and ``simulate --sources``."""

SENSITIVITY: tuple[str, ...] = ("barrier_us", "rdma_msg_us", "rdma_latency_us", "collective_step_us", "kernel_us",
                                "hbm_gbs", "release_us", "pcie_gbs", "nvlink_gbs", "nic_gbps")
"""Hardware fields the sensitivity table halves and doubles (every assumption the reference's
prediction depends on, the datasheet-rate ``hbm_gbs`` and ``pcie_gbs``, and the two measured
rates for scale); the watermark (a :class:`~weight_transfer.experiments.sim.configs.SimConfig` field) is
varied beside them."""


def h100_cx7() -> Hardware:
    """H100 SXM nodes, 8 x 400 Gb/s ConnectX-7 (DGX H100 class)."""
    return Hardware()


def h200_cx7() -> Hardware:
    """H200 SXM, 8 x 400 Gb/s ConnectX-7: H100's links, 4.8 TB/s HBM3e (H200 datasheet)."""
    return replace(Hardware(), name="H200 SXM, 8 x ConnectX-7 400 Gb/s", hbm_gbs=4800.0)


def h200_efa() -> Hardware:
    """H200 SXM on AWS EFA (p5en class): 2 x 200 Gb/s EFA per GPU = 400 Gb/s line per GPU,
    36.5 GB/s (292 Gb/s) achieved GPU to GPU as measured in Lequn Chen's 2025-09-07 post
    (16.133 GB in 0.441 s); 4.8 TB/s HBM3e."""
    return replace(Hardware(), name="H200 SXM, AWS EFA 2 x 200 Gb/s per GPU", hbm_gbs=4800.0,
                   nic_line_gbps=400.0, nic_gbps=36.5 * 8)


def h20_cx7() -> Hardware:
    """H20 (checkpoint-engine's anchor): 4.0 TB/s HBM3, 900 GB/s NVLink (H20 datasheet; NCCL's
    achieved NVLink rate taken as on H100, same NVLink generation). Assumption: the same
    8 x 400 Gb/s rail fabric as H100 nodes (the anchor does not state the NICs)."""
    return replace(Hardware(), name="H20, 8 x 400 Gb/s (NICs assumed)", hbm_gbs=4000.0)


h100, h200, h20 = h100_cx7, h200_cx7, h20_cx7
PROFILES = {f.__name__: f for f in (h100_cx7, h200_cx7, h200_efa, h20_cx7)}
