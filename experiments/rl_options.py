"""The options of the RL loop (``weight-transfer rl``, ``examples/rl_loop.py``): :class:`RLOptions`,
read from a command line (:func:`options_from_argv`) and turned into the one_sided backend's
transfer options (:func:`transfer_overrides`). The loop's pieces are :mod:`weight_transfer.experiments.rl`
(which re-exports these names).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .paths import project_dir

RESULTS = project_dir() / "results"
CHANGES_CSV = "rl_changes.csv"
"""Item 2's tidy table (one row per lr x step x kind x granularity), in ``out_dir``."""


@dataclass(kw_only=True, slots=True)
class RLOptions:
    """The RL loop's options (``weight-transfer rl --help``; ``examples/rl_loop.py`` takes the same flags)."""

    steps: int = 30
    """Optimizer steps; each: a rollout of the current version, one AdamW step, one push (version + 1)."""
    lr: float = 5e-4
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay (torch's default)."""
    group: int = 8
    """Samples per prompt (the group its advantages are normalized in)."""
    values: int = 4
    """Distinct prompt tokens: the prompts are all values**2 pairs (a, b) of token ids first_token .. + values - 1."""
    first_token: int = 100
    """Token id of the first prompt value."""
    clip: float = 0.2
    """PPO clip range of the importance ratio: [1 - clip, 1 + clip]."""
    model: str = "qwen3-0.6b"
    """Catalog model (Qwen3 architecture; dense)."""
    layers: int = 2
    """num_hidden_layers override."""
    vocab: int = 8192
    """vocab_size override."""
    seed: int = 0
    """Model init and sampling seed."""
    changes: bool = False
    """Measure what each step changes (weight_transfer.delta.changes on the gathered weights, rank 0) and write out_dir/rl_changes.csv rows for this lr."""
    verify: bool = True
    """Check every push against the reload oracle (a second vLLM in rank 1) and the final weights against a fresh vLLM."""
    out_dir: str = field(default=str(RESULTS), metadata={"metavar": "DIR"})
    """Where rl_<tag>.csv, rl_<tag>.png (and rl_changes.csv) go."""
    tag: str = ""
    """Run name in file names (default: lr<lr>)."""
    timeout: float = 300.0
    """Seconds a push may take before the update fails."""
    delta: bool = False
    """Push every step's weights twice, as a delta update and as a full one (the same executor,
    its delta state set aside), alternating which goes first, both verified: one row per push in
    out_dir/rl_delta.csv and the full-vs-delta table (issue 26 item 4)."""
    save_steps: str = field(default="", metadata={"metavar": "DIR"})
    """Save every version's weights as served (bf16, checkpoint names; the fp32 master cast once,
    the bytes each push sends) into DIR: ``step_00000.safetensors`` the initial model, then one
    file per optimizer step, and ``manifest.json`` (:mod:`weight_transfer.testing.replay`;
    ~80 MB per step for the default model). A trial replays them with ``--replay DIR``
    (docs/DELTA.md, "On a wire-bound link"); empty: nothing saved."""
    delta_granularity: int = 0
    """--delta: block size of the comparison (bytes); 0: the delta mode's default (1 when it may
    pack, else 8: :func:`weight_transfer.delta.runs.default_granularity`)."""
    delta_op_cost: int = -1
    """--delta: what one scattered run costs, in bytes at the wire (the cost model's run cost);
    0: runs are free (scattered always beats packed and whole: the fewest bytes), -1: the
    transport's measured cost (cma ~300 ns)."""
    delta_mode: str = field(default="auto", metadata={"choices": ("auto", "scattered", "packed")})
    """--delta: how each changed output is written (``ExecutorOptions.delta_mode``): ``auto`` the
    cost model's cheapest of scattered runs, one packed record (scattered by vLLM's worker at
    ``update_weights``) or whole; ``scattered``; ``packed``."""
    delta_format: str = field(default="auto", metadata={"choices": ("auto", "runs", "masks")})
    """--delta: how a packed record carries the changes (``ExecutorOptions.delta_format``):
    ``runs`` (format 2, fewest bytes), ``masks`` (format 3, least CPU) or ``auto`` (the cost
    model's choice from the wire's bandwidth: masks over cma)."""
    delta_wire_gbps: float = 0.0
    """--delta: the cost model's wire bandwidth (GB/s); 0: the transport's default."""
    delta_landing: float = 0.25
    """--delta: the landing region each vLLM worker registers for packed records (a fraction of
    its target bytes)."""
    delta_settle: float = 1.1
    """--delta: seconds each push waits before it starts, so that both pushes of a pair start as
    a push of the plain loop does, after training, with vLLM's workers idle: a worker busy-polls
    its message queue for 1 s after each call (``SpinCondition(busy_loop_s=1)`` in vLLM's
    ``shm_broadcast``), and the check after the first push calls both engines, so on a small
    host the second push would share the CPUs with two spinning workers. 0: no wait."""

    fingerprints: str = field(default="off", metadata={"choices": ("off", "sample", "full")})
    """End-to-end fingerprints of every push (``verify=``, docs/VERIFY.md): each vLLM worker hashes
    the planned ranges of its memory after ``update_weights``, the coordinator compares them with
    what the trainer sent before vLLM's weight version is set; ``off``, ``sample`` (every byte once
    in 32 pushes) or ``full``."""
    metrics_port: int = -1
    """Serve the coordinator's Prometheus metrics of every push (training rank 0,
    ``weight_transfer.metrics``, docs/METRICS.md) at http://127.0.0.1:PORT/metrics; 0: a free port,
    printed as ``metrics: http://127.0.0.1:PORT/metrics``; -1: off. Each push's scrape (and
    --vllm-metrics-port's) is appended to out_dir/rl_<tag>_metrics.jsonl."""
    vllm_metrics_port: int = -1
    """Serve vLLM's own metrics registry (what a vLLM server's /metrics serves:
    ``vllm.v1.metrics.prometheus.get_prometheus_registry()``, multiprocess mode, so the vLLM
    workers' ``weight_transfer_worker_*`` metrics are in it) from training rank 0 at
    http://127.0.0.1:PORT/metrics -- the loop's vLLM is an offline LLM, without a server; 0: a free
    port, printed as ``vllm metrics: http://127.0.0.1:PORT/metrics``; -1: off."""

    def __post_init__(self):
        if not -1 <= self.metrics_port < 65536 or not -1 <= self.vllm_metrics_port < 65536:
            raise ValueError(f"--metrics-port {self.metrics_port}, --vllm-metrics-port {self.vllm_metrics_port}: "
                             "a TCP port, 0 (a free one) or -1 (off)")
        for name in ("steps", "group", "values", "layers", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(self, name)}: at least 1")
        if self.group < 2:
            raise ValueError(f"--group {self.group}: at least 2 (advantages are normalized within a group)")
        if not self.lr > 0 or not 0 < self.clip < 1 or self.timeout <= 0:
            raise ValueError(f"--lr {self.lr} > 0, 0 < --clip {self.clip} < 1, --timeout {self.timeout} > 0")
        if self.delta_granularity < 0 or self.delta_op_cost < -1 or not 0 <= self.delta_settle <= 60:
            raise ValueError(f"--delta-granularity {self.delta_granularity} >= 0 (0: the mode's default), "
                             f"--delta-op-cost {self.delta_op_cost} >= -1, 0 <= --delta-settle {self.delta_settle} <= 60")
        if self.first_token + self.values > self.vocab:
            raise ValueError(f"--first-token {self.first_token} + --values {self.values} > --vocab {self.vocab}")

    @property
    def name(self) -> str:
        return self.tag or f"lr{self.lr:g}"

    @property
    def n_prompts(self) -> int:
        return self.values ** 2

    def model_config(self):
        from weight_transfer.testing.catalog import load_config

        return load_config(self.model, num_hidden_layers=self.layers, vocab_size=self.vocab)


def options_from_argv(argv: list[str] | None = None, prog: str = "rl_loop.py") -> RLOptions:
    """:class:`RLOptions` from a command line (the flags ``weight-transfer rl`` has)."""
    import argparse

    from .cli import add_dataclass_options, dataclass_from_args

    ap = argparse.ArgumentParser(prog=prog, description=RLOptions.__doc__)
    add_dataclass_options(ap, RLOptions)
    return dataclass_from_args(RLOptions, ap.parse_args(argv))


def transfer_overrides(o: RLOptions) -> dict | None:
    """The one_sided backend's ``options`` (flat TransferOptions overrides) for ``o``: delta
    updates with ``--delta``, the fingerprints with ``--fingerprints``, else None (the defaults)."""
    fp = {"fingerprints": o.fingerprints} if o.fingerprints != "off" else {}
    if not o.delta:
        return fp or None
    return {**fp, "delta": True, "delta_granularity": o.delta_granularity or None,
            "delta_op_cost": None if o.delta_op_cost < 0 else o.delta_op_cost, "delta_mode": o.delta_mode,
            "delta_format": o.delta_format, "delta_wire_gbps": o.delta_wire_gbps or None, "delta_landing": o.delta_landing}
