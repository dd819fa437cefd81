"""Benchmarks (not tests): each prints an nccl-tests-style table and writes a results CSV.
Subcommands of the one CLI, their options generated from each module's config dataclass
(:mod:`weight_transfer.experiments.cli`):

    weight-transfer bench-quant        # FP8 block quantization vs memcpy   (bench/quant.py)
    weight-transfer bench-pipeline     # pipelined vs serialized, watermark (bench/pipeline.py)
    weight-transfer bench-transports   # transports vs memcpy               (bench/transports.py)
    weight-transfer bench-peers        # reference vs awex, Mooncake (same tensors)  (bench/peers.py)
    weight-transfer bench-delta        # full vs delta updates, change fractions  (bench/delta.py)
    weight-transfer bench-stall        # the engine's stall: pause-based vs shadow targets  (bench/stall.py)
    weight-transfer bench-control      # the authenticated control plane vs the opt-out  (bench/control.py)
    weight-transfer bench-verify       # end-to-end fingerprints off / sample / full  (bench/verify.py)
    weight-transfer bench-trl          # TRL async GRPO: rollouts during syncs, pause vs shadow  (bench/trl.py)
"""
from __future__ import annotations

BENCHMARKS: dict[str, tuple[str, str, str]] = {
    "bench-quant": ("weight_transfer.experiments.bench.quant", "QuantBenchConfig", "FP8 block quantization throughput beside memcpy"),
    "bench-pipeline": ("weight_transfer.experiments.bench.pipeline", "PipelineBenchConfig",
                       "pipelined vs stage-serialized executor, overlap efficiency, watermark sweep (real trials)"),
    "bench-transports": ("weight_transfer.experiments.bench.transports", "TransportBenchConfig",
                         "one-sided write bandwidth of each transport beside memcpy"),
    "bench-peers": ("weight_transfer.experiments.bench.peers", "PeersBenchConfig",
                    "the same tensor set and world through the reference, awex, Mooncake and torchstore, verified (docs/PEERS.md)"),
    "bench-delta": ("weight_transfer.experiments.bench.delta", "DeltaBenchConfig",
                    "full vs delta updates on the main job at given change fractions, verified (docs/DELTA.md)"),
    "bench-stall": ("weight_transfer.experiments.bench.stall", "StallBenchConfig",
                    "the engines' stall per update with a generation load: pause-based vs shadow targets, verified"),
    "bench-control": ("weight_transfer.experiments.bench.control", "ControlBenchConfig",
                      "the authenticated control plane against the opt-out: store round trips, the main job's p50 "
                      "(docs/SECURITY.md)"),
    "bench-verify": ("weight_transfer.experiments.bench.verify", "VerifyBenchConfig",
                     "the main job with end-to-end fingerprints off, sample and full: p50 and ratios (docs/VERIFY.md)"),
    "bench-trl": ("weight_transfer.experiments.bench.trl", "TrlBenchConfig",
                  "TRL async GRPO through vLLM: rollout tokens/s during weight syncs, pause-based vs shadow targets, "
                  "verified"),
}
"""Subcommand -> (module, config dataclass, one-line help); the module's ``main(cfg)`` runs it."""
