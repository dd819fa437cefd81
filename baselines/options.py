"""The baselines' own options (bucket size, RPC timeout): a config dataclass the trial config
contains (``TrialConfig.baseline``) and the CLI sets (``--bucket-bytes``, ``--rpc-timeout``).

The methods receive it as ``ctx.method_options``; the control-plane timeout they also use is
``ctx.transfer.control.timeout`` (:class:`weight_transfer.options.TransferOptions`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_BUCKET_BYTES = 512 << 20
"""Funnel bucket size (bytes): tensors are packed into flat buffers of at most this size, the
default of OpenRLHF / verl style bucketed broadcasts."""
DEFAULT_RPC_TIMEOUT = 60.0
"""Seconds one RPC may wait for every worker's reply when ``rpc_timeout`` is not set (capped at
half the control-plane timeout so that the error reaches the controller first)."""


@dataclass(kw_only=True, slots=True)
class BaselineOptions:
    """Options of the rank-0 funnel and the per-tensor RPC baselines."""

    bucket_bytes: int = field(default=DEFAULT_BUCKET_BYTES, metadata={"unit": "bytes"})
    """Rank-0 funnel: largest flat broadcast bucket (bytes); a larger tensor gets a bucket of
    its own."""
    rpc_timeout: float | None = field(default=None, metadata={"unit": "s"})
    """RPC baseline: seconds one ``update_weight`` RPC may wait for every worker's reply;
    not given: min(60 s, half the control-plane timeout), at least 1 s."""

    def __post_init__(self):
        if self.bucket_bytes < 1:
            raise ValueError(f"bucket_bytes={self.bucket_bytes}: bytes >= 1")
        if self.rpc_timeout is not None and not self.rpc_timeout > 0:
            raise ValueError(f"rpc_timeout={self.rpc_timeout}: seconds > 0, or None for the default")
