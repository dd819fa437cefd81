"""Every hardware and software figure the cost model uses: a named field with its unit and
source. Nothing here is fitted to a published result the model is compared with
(docs/SIMULATION.md lists them again beside the calibration table).

Sources are of three kinds, said in each docstring: a **datasheet** (vendor specification),
a **paper / report** (a measurement someone published), or an **assumption** (an order of
magnitude we chose, with the reason; docs/SIMULATION.md shows how much the prediction moves
when it is doubled).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(kw_only=True, slots=True)
class Hardware:
    """One GPU node type and its fabric. Rates in GB/s are 1e9 B/s; Gb/s are 1e9 bit/s."""

    name: str = "H100 SXM, 8 x ConnectX-7 400 Gb/s"
    gpus_per_node: int = 8
    """GPUs per node (DGX/HGX H100 and H200: 8)."""
    nics_per_node: int = 8
    """RDMA NICs per node, one per GPU on the same PCIe switch (DGX H100 user guide: eight
    single-port ConnectX-7 400 Gb/s for the compute fabric)."""
    nic_line_gbps: float = 400.0
    """NIC line rate, Gb/s per direction (ConnectX-7 datasheet: 400 Gb/s NDR). The physical
    floor divides by this."""
    nic_gbps: float = 378.0
    """Achieved RDMA WRITE bandwidth of one 400 Gb/s ConnectX-7, Gb/s per direction: 378 Gb/s
    as measured in the TransferEngine paper (Perplexity, arXiv 2510.27656), the figure cited
    in issue #7. The prediction uses this rate."""
    rdma_msg_us: float = 1.0
    """Per-WRITE cost at the sender, microseconds: posting the work request and reaping its
    completion in a software loop. Assumption (order of magnitude of ibv_post_send +
    completion polling; ConnectX-7 message rates are far higher, so this is the host side)."""
    rdma_latency_us: float = 5.0
    """Time from the last byte posted to its completion seen by the sender, microseconds.
    Assumption (InfiniBand round trip of a few microseconds)."""
    pcie_gbs: float = 63.0
    """Host-to-device copy rate, GB/s: PCIe Gen5 x16 per direction (32 GT/s x 16 lanes,
    128b/130b encoding; PCI-SIG specification). Spec rate, so H2D is optimistic."""
    nvlink_gbs: float = 450.0
    """NVLink bandwidth per GPU per direction, GB/s (H100 SXM datasheet: 900 GB/s total,
    bidirectional)."""
    collective_step_us: float = 10.0
    """Latency of one ring step of an all-gather / broadcast, microseconds. Assumption (NCCL
    ring latencies are microseconds per step intra-node and ~10 us across nodes)."""
    hbm_gbs: float = 3350.0
    """GPU memory bandwidth, GB/s (H100 SXM datasheet: 3.35 TB/s). Fusion copies and FP8
    quantization are memory bound and modeled at this rate (optimistic: no kernel reaches it)."""
    kernel_us: float = 5.0
    """Launch cost of one GPU kernel (one recipe's fusion or quantization), microseconds.
    Assumption (CUDA kernel launch, a few microseconds)."""
    barrier_us: float = 1000.0
    """One Gloo barrier over TCP across the training world, microseconds. Assumption:
    log2(256) = 8 rounds of ~100 us TCP round trips, rounded up."""
    release_us: float = 10.0
    """Freeing a task's temporaries (caching allocator, no deregistration: regions are
    registered once), microseconds. Assumption."""
    # ---------------------------------------------------------------- baselines' overheads
    python_call_us: float = 50.0
    """Python-side cost of one ``load_weights`` call for one tensor on one worker
    (weight_loader dispatch, slicing, copy launch), microseconds. Assumption (vLLM's loaders
    are Python per tensor; tens of microseconds)."""
    rpc_us: float = 1000.0
    """One RPC round trip from the trainer to an inference worker (serialize, send, dispatch,
    reply), microseconds. Assumption (a Python RPC over TCP on a datacenter LAN: 0.1-1 ms;
    the upper end, since every call carries a tensor header)."""
    nccl_call_us: float = 50.0
    """Fixed cost of one NCCL broadcast call (launch + first-byte latency across nodes),
    microseconds. Assumption."""

    def __post_init__(self):
        for f in ("nic_gbps", "nic_line_gbps", "pcie_gbs", "nvlink_gbs", "hbm_gbs"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Hardware.{f} must be > 0")
        if self.nic_gbps > self.nic_line_gbps:
            raise ValueError("Hardware: achieved nic_gbps above the line rate")

    @property
    def nic_Bps(self) -> float:
        """Achieved NIC rate, bytes/s."""
        return self.nic_gbps * 1e9 / 8

    @property
    def nic_line_Bps(self) -> float:
        return self.nic_line_gbps * 1e9 / 8


def h100() -> Hardware:
    """H100 SXM nodes, 8 x 400 Gb/s ConnectX-7 (the Perplexity anchors' class of machine)."""
    return Hardware()


def h200() -> Hardware:
    """H200 SXM: H100's links, 4.8 TB/s HBM3e (H200 datasheet)."""
    return replace(Hardware(), name="H200 SXM, 8 x ConnectX-7 400 Gb/s", hbm_gbs=4800.0)


def h20() -> Hardware:
    """H20 (checkpoint-engine's anchor): 4.0 TB/s HBM3, 900 GB/s NVLink (H20 datasheet).
    Assumption: the same 8 x 400 Gb/s rail fabric as H100 nodes (the anchor does not state
    the NICs)."""
    return replace(Hardware(), name="H20, 8 x 400 Gb/s (assumed)", hbm_gbs=4000.0)
