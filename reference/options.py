"""The options of one weight transfer: what the reference method reads, and all it reads.

:class:`TransferOptions` is the typed seam between the reference method and whatever drives it
(the trial harness in ``experiments/``, a training framework). It composes one small options
object per component:

- :class:`PlanOptions` -- the planner's (chunk size, shard-local prepare), handed to
  :func:`weight_transfer.plan.plan`;
- :class:`ExecutorOptions` -- the executor's (pipeline, watermark, offload, trace), handed
  whole to :class:`weight_transfer.pipeline.executor.Executor`;
- :class:`TransportOptions` -- the data plane's back end;
- :class:`ControlOptions` -- the control plane's timeout;
- :class:`VerifyOptions` -- the end-to-end fingerprint check (``verify=off|sample|full``).

The harness's ``weight_transfer.experiments.config.TrialConfig`` composes a ``TransferOptions``
with the trial's model and worlds; the method contexts (:mod:`weight_transfer.method`) carry it.

Config dataclasses in torchtitan's style: ``kw_only``, ``slots``, one docstring per field,
checks in ``__post_init__`` (ValueError naming the field and the value). A field's
``metadata`` says how it reads on the command line (``flag``, ``unit``, ``scale``: see
``weight_transfer.experiments.cli``); the library itself never parses a command line. Checks
that depend on the host a transfer runs on (the transport's library imports, the trace
directory can be written) are in :meth:`TransferOptions.preflight`, which a launcher calls
before it starts any process (C18).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
from dataclasses import dataclass, field

MiB = 1 << 20

AUTO_TRANSPORT = "auto"
"""The transport name :meth:`TransportOptions.resolve` replaces with a back end."""


@dataclass(kw_only=True, slots=True)
class PlanOptions:
    """The planner's options (bytes)."""

    max_chunk_bytes: int = field(default=64 << 20, metadata={"flag": "--max-chunk-mb", "unit": "MiB", "scale": MiB})
    """Recipe outputs larger than this are split into row bands spread over senders (bytes; on
    the command line MiB)."""
    local_writes: bool = field(default=True, metadata={"negate": "--gather-all"})
    """Shard-local prepare: recipes are cut at shard boundaries and made by the ranks that
    already hold the rows, from ``to_local()``, with no ``full_tensor()`` -- plain copies, fused
    row bands (``qkv_proj``, ``gate_up_proj``, ``w13_weight``) and block-FP8 recipes whose cuts
    fall on 128-row block boundaries (:mod:`weight_transfer.plan.local`); only the rest is gathered.
    False gathers every task's sources first (the published design, ``--gather-all``)."""
    local_min_bytes: int = field(default=256 << 10, metadata={"unit": "bytes"})
    """A recipe smaller than this (bytes per receiver) whose rows span several ranks is gathered
    rather than cut (norms, biases, a router: one collective for a few KB beats many tiny
    writes), unless cutting it costs at most ``local_max_writes`` writes; one held whole by a
    rank is always local."""
    local_max_writes: int = 16
    """A recipe under ``local_min_bytes`` whose rows span several ranks is still cut, with no
    collective, when that costs at most this many writes in all (its row bands x its receiving
    ranks x its outputs; a few microseconds each). A ``full_tensor()`` is a barrier of the
    source's whole mesh: each rank waits there for the others to finish the tasks before it, so
    its price is the ranks' skew, not its bytes (the RL loop's 2 training ranks into one vLLM
    worker, 9 norm gathers per update: 18-53 ms of each rank's prepare stage, against 0.8-5 ms cut;
    docs/DELTA.md). Past it (a norm over 256 FSDP ranks into 128 receivers: 32768 writes) the
    collective is cheaper. 0: gather every such recipe."""

    def __post_init__(self):
        if self.max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes={self.max_chunk_bytes}: bytes >= 1")
        if self.local_min_bytes < 0:
            raise ValueError(f"local_min_bytes={self.local_min_bytes}: bytes >= 0")
        if self.local_max_writes < 0:
            raise ValueError(f"local_max_writes={self.local_max_writes}: writes >= 0")


@dataclass(kw_only=True, slots=True)
class ExecutorOptions:
    """The executor's options (bytes)."""

    pipeline: bool = field(default=True, metadata={"negate": "--serial"})
    """Run the executor's stages concurrently (stage threads with FIFO queues); ``False``
    (``--serial``) runs every stage of a task before the next task starts (stage-serialized)."""
    watermark: int | None = field(default=None, metadata={"flag": "--watermark-mb", "unit": "MiB", "scale": MiB})
    """Temporaries (gathered sources + outputs) the tasks in flight on one training rank may
    hold (bytes; on the command line MiB); none = unbounded. A task larger than this runs alone.
    It also sizes the executor's output pool, registered once: the watermark plus the largest
    task's built outputs (none: 256 MiB, at least the largest task's, at most the plan's)."""
    offload: bool = False
    """Training shards live in host memory (pinned on CUDA hosts) and are copied to the device
    buffer in the executor's ``h2d`` stage; metadata says ``offloaded=True``."""
    trace_dir: str | None = field(default=None, metadata={"flag": "--trace", "metavar": "DIR"})
    """Directory for one Chrome trace per update and rank (``step{N}.rank{r}.json``); the CLI
    merges them into ``step{N}.json`` per update (Perfetto, ``weight-transfer timeline``)."""
    delta: bool = False
    """Delta updates (:mod:`weight_transfer.delta.runs`): each update writes only the byte runs of each
    output that differ from what this sender wrote there last (exact comparison against a shadow
    copy, one per byte of the rank's outputs); the first update, and the one after a failed or
    incomplete update or a re-registered receiver, is full (C26)."""
    delta_granularity: int | None = field(default=None, metadata={"unit": "bytes"})
    """Block size the delta comparison works in (bytes, counted from each output's first byte):
    a changed byte sends its whole block. None: 1 when the delta may pack (``delta_mode``
    packed or auto and a receiver published a landing region: a packed run costs its bytes plus
    a ~2-byte index entry, and a small step changes only the low byte of most bf16 elements),
    else 8 (a scattered run costs a remote segment whatever its length)
    (:func:`weight_transfer.delta.runs.default_granularity`, docs/DELTA.md)."""
    delta_merge_gap: int = field(default=0, metadata={"unit": "bytes"})
    """Changed runs separated by at most this many unchanged bytes are written as one run
    (bytes; 0: only adjacent changed blocks coalesce)."""
    delta_op_cost: int | None = field(default=None, metadata={"unit": "bytes"})
    """What one more run costs, in bytes at the transport's bandwidth: an output whose runs cost
    more than writing it whole is written whole (:mod:`weight_transfer.delta.runs`). None: the
    transport's measured cost (cma 1024, shm 64, others 12288:
    :func:`weight_transfer.transport.runs.segment_cost_bytes`); 0: never (fewest bytes)."""
    delta_mode: str = field(default="auto", metadata={"choices": ("auto", "scattered", "packed")})
    """How a delta writes each changed output (:mod:`weight_transfer.delta.cost`): ``auto`` the
    cost model's cheapest of scattered runs, one packed record (into the receiver's landing
    region, scattered at its commit: :mod:`weight_transfer.delta.packed`) or the whole output;
    ``scattered`` never packed (runs or whole); ``packed`` packed whenever it fits."""
    delta_format: str = field(default="auto", metadata={"choices": ("auto", "runs", "masks")})
    """How a packed record carries an output's changes (:mod:`weight_transfer.delta.packed`):
    ``runs`` (format 2: a varint index of runs, ~2 bytes per run; the fewest bytes), ``masks``
    (format 3: a 64-bit byte mask per changed 64-byte chunk, 12 bytes of index per changed chunk,
    found and applied with a vector compare, compress and expand: the least CPU), ``auto`` the
    cost model's choice from the wire's bandwidth and the transport's run cost
    (:meth:`weight_transfer.delta.cost.CostModel.pack_format`: masks above ~0.25-0.4 GB/s, e.g.
    on one host or a NIC; runs on a slow link)."""
    delta_wire_gbps: float | None = field(default=None, metadata={"unit": "GB/s"})
    """The cost model's wire bandwidth (GB/s, 1e9 bytes/s); None: the transport's default
    (:data:`weight_transfer.delta.cost.WIRE_GBPS`: cma 3, shm 6, nixl/verbs 12.5). A slow link
    (a rate-limited veth) makes packed deltas win."""
    delta_landing: float = 0.25
    """Landing region a receiver registers for packed deltas, as a fraction of its target
    bytes (receivers started by this project's launchers: the one_sided vLLM backend); a packed
    record that would not fit goes scattered or whole. 0: none (no packed deltas)."""
    delta_fused: bool = True
    """Fuse the comparison into the prepare stage's fp32 -> bf16 cast where an output is one
    contiguous cast of one source (:mod:`weight_transfer.delta.fused`): one pass casts,
    compares, updates the shadow and emits the runs."""
    delta_max_bytes: int | None = field(default=None, metadata={"flag": "--delta-max-mb", "unit": "MiB", "scale": MiB})
    """Most bytes of shadow copy one training rank may hold for delta updates (bytes; on the
    command line MiB); a plan needing more is refused when the executor is built. None: no bound
    (the shadow is the rank's output bytes, printed at setup)."""

    def __post_init__(self):
        if self.watermark is not None and self.watermark < 0:
            raise ValueError(f"watermark={self.watermark}: bytes >= 0, or None for unbounded")
        if self.delta_granularity is not None and self.delta_granularity < 1:
            raise ValueError(f"delta_granularity={self.delta_granularity}: bytes >= 1, or None for the mode's default")
        if self.delta_merge_gap < 0:
            raise ValueError(f"delta_merge_gap={self.delta_merge_gap}: bytes >= 0")
        if self.delta_op_cost is not None and self.delta_op_cost < 0:
            raise ValueError(f"delta_op_cost={self.delta_op_cost}: bytes >= 0, or None for the transport's")
        if self.delta_mode not in ("auto", "scattered", "packed"):
            raise ValueError(f"delta_mode={self.delta_mode!r}: auto, scattered or packed")
        if self.delta_format not in ("auto", "runs", "masks"):
            raise ValueError(f"delta_format={self.delta_format!r}: auto, runs or masks")
        if self.delta_wire_gbps is not None and not self.delta_wire_gbps > 0:
            raise ValueError(f"delta_wire_gbps={self.delta_wire_gbps}: GB/s > 0, or None for the transport's")
        if not 0 <= self.delta_landing <= 4:
            raise ValueError(f"delta_landing={self.delta_landing}: a fraction of the target bytes in [0, 4]")
        if self.delta_max_bytes is not None and self.delta_max_bytes < 0:
            raise ValueError(f"delta_max_bytes={self.delta_max_bytes}: bytes >= 0, or None for unbounded")


@dataclass(kw_only=True, slots=True)
class TransportOptions:
    """The data plane."""

    name: str = field(default="cma", metadata={"flat": "transport"})
    """Back end (``weight_transfer.transport.TRANSPORTS``): ``cma``, ``nixl``, ``verbs``,
    ``cuda_ipc`` or ``shm`` (docs/TRANSPORTS.md); or ``auto``, which the launcher that knows
    the receiving memory replaces with one (:meth:`resolve`: ``shm`` into memory the
    receivers allocate through the transport, ``cma`` into any other process's CPU memory,
    ``cuda_ipc`` into GPU memory)."""

    def __post_init__(self):
        from .transport import TRANSPORTS

        if self.name not in TRANSPORTS and self.name != AUTO_TRANSPORT:
            raise ValueError(f"transport={self.name!r}: unknown; known: {', '.join(sorted(TRANSPORTS))}, "
                             f"or {AUTO_TRANSPORT!r}")

    def resolve(self, *, device: str = "cpu", receiver_allocates: bool = False) -> TransportOptions:
        """These options with ``auto`` replaced by a back end; a named back end is returned as
        it is. ``device``: where the receiving memory lives (``"cpu"`` or ``"cuda"``);
        ``receiver_allocates``: every receiver allocates the memory it publishes through
        ``Transport.allocate`` (the stand-in engine's arenas; not a vLLM engine's tensors,
        which vLLM allocates). ``auto`` becomes ``cuda_ipc`` on ``cuda``; on the CPU ``shm``
        when the receivers allocate (a write is one user-space ``memcpy`` into the mapped
        segment, streamed; 75-100% of a one-thread memcpy on the project's 2-core VM,
        docs/PEERS.md), else ``cma`` (``process_vm_writev`` reaches any process's memory;
        the kernel copies page by page with regular stores, about half a streamed memcpy).
        ValueError for a ``device`` other than those two."""
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}: 'cpu' or 'cuda'")
        if self.name != AUTO_TRANSPORT:
            return self
        if device == "cuda":
            return TransportOptions(name="cuda_ipc")
        return TransportOptions(name="shm" if receiver_allocates else "cma")


@dataclass(kw_only=True, slots=True)
class ControlOptions:
    """The control plane (seconds)."""

    timeout: float = field(default=120.0, metadata={"unit": "s"})
    """Seconds a control-plane wait may take before the missing ranks are named."""

    def __post_init__(self):
        if not (isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r}: seconds > 0")


VERIFY_MODES = ("off", "sample", "full")
"""``verify=`` values: no check, a rotating subset, every byte (:mod:`weight_transfer.control.fingerprint`)."""
VERIFY_ALGOS = ("auto", "xxh3", "fold64")
"""The fingerprints' hash: ``auto`` (by where the receivers' memory is), XXH3-64 on the host, or a
torch fold computed on the bytes' own device."""


@dataclass(kw_only=True, slots=True)
class VerifyOptions:
    """The end-to-end check of every update (:mod:`weight_transfer.control.fingerprint`, C31): the
    training side hashes the bytes it sends, the inference side the same ranges of its memory
    after they landed, the coordinator compares them before it publishes ``complete v``. On
    the harness's command line ``--fingerprints`` / ``--fingerprint-cycle`` (its ``--verify``
    is the harness's own byte comparison against a fresh engine)."""

    mode: str = field(default_factory=lambda: os.environ.get("WEIGHT_TRANSFER_VERIFY", "off"),
                      metadata={"flat": "fingerprints", "choices": VERIFY_MODES})
    """``"off"``; ``"sample"``: the planned writes of one residue class per version, every byte
    once in ``cycle`` consecutive versions; ``"full"``: every byte of every update. The default
    is the environment's ``WEIGHT_TRANSFER_VERIFY`` where it is set (a job-wide switch for
    operators: it is read where the options are built, i.e. by the coordinator), else ``"off"``."""
    cycle: int = field(default=32, metadata={"flat": "fingerprint_cycle"})
    """``"sample"``: consecutive versions per full coverage (>= 1); a fault that persists is
    caught within this many updates. The cost per update goes as 1/cycle: on the project's
    2-core VM the main job measured 1.16-1.22x ``"off"`` at 8, 1.05-1.12x at 16
    (``weight-transfer bench-verify``, docs/VERIFY.md); 32 keeps it within 5%."""

    algo: str = field(default="auto", metadata={"flat": "fingerprint_algo", "choices": VERIFY_ALGOS})
    """The hash (:func:`weight_transfer.control.fingerprint.hash_pieces`): ``"xxh3"`` (XXH3-64 on the
    host; GPU bytes are copied to it first), ``"fold64"`` (a position-weighted 64-bit sum in torch
    ops, computed where the bytes are: a GPU hashes its own memory), or ``"auto"``: ``fold64``
    when a receiver's memory is on a GPU (its region's transport is ``cuda_ipc``), else ``xxh3``.
    Every member of a job uses the one the coordinator publishes with the plan."""

    def __post_init__(self):
        if self.algo not in VERIFY_ALGOS:
            raise ValueError(f"verify algo={self.algo!r} (--fingerprint-algo): one of {', '.join(VERIFY_ALGOS)}")
        if self.mode not in VERIFY_MODES:
            raise ValueError(f"verify={self.mode!r} (--fingerprints): one of {', '.join(VERIFY_MODES)}")
        if not isinstance(self.cycle, int) or isinstance(self.cycle, bool) or self.cycle < 1:
            raise ValueError(f"verify cycle={self.cycle!r} (--fingerprint-cycle): an int >= 1")


@dataclass(kw_only=True, slots=True)
class TransferOptions:
    """How the reference moves weights: one options object per component. Every field has a
    default; the defaults are the README's main job."""

    plan: PlanOptions = field(default_factory=PlanOptions)
    """The planner's options."""
    executor: ExecutorOptions = field(default_factory=ExecutorOptions)
    """The executor's options (handed whole to the executor)."""
    transport: TransportOptions = field(default_factory=TransportOptions)
    """The data plane's back end."""
    control: ControlOptions = field(default_factory=ControlOptions)
    """The control plane's timeout."""
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    """The end-to-end fingerprint check of every update (off by default)."""

    def resolve(self, *, device: str = "cpu", receiver_allocates: bool = False) -> TransferOptions:
        """These options with an ``auto`` transport replaced by a back end
        (:meth:`TransportOptions.resolve`, same arguments); ``self`` when it names one."""
        transport = self.transport.resolve(device=device, receiver_allocates=receiver_allocates)
        return self if transport is self.transport else dataclasses.replace(self, transport=transport)

    def preflight(self) -> None:
        """Checks that need this host, run before any process starts; raise ValueError with a
        one-line cause: the transport's library is importable here (``nixl``: NIXL's Python
        API; ``verbs``: pyverbs; ``cuda_ipc``: a CUDA torch with a GPU; ``cma``, ``shm``: Linux), and
        ``executor.trace_dir`` (when set) is a directory this process can create and write a file in.
        An unresolved ``auto`` transport is refused (:meth:`resolve` first)."""
        if self.transport.name == AUTO_TRANSPORT:
            raise ValueError("transport 'auto' is not resolved: TransferOptions.resolve(device=..., "
                             "receiver_allocates=...) picks the back end")
        why = transport_unavailable(self.transport.name)
        if why:
            raise ValueError(f"transport {self.transport.name!r} is not available here: {why}")
        trace_dir = self.executor.trace_dir
        if trace_dir is not None:
            try:
                os.makedirs(trace_dir, exist_ok=True)
                with tempfile.TemporaryFile(dir=trace_dir):
                    pass
            except OSError as e:
                raise ValueError(f"trace_dir={trace_dir!r} is not writable: {e.strerror or e}") from None


def transport_unavailable(name: str) -> str | None:
    """Why back end ``name`` cannot run in this process (first line of the loader's error),
    or None when it can. Imports the back end's library the way the back end itself does
    (``weight_transfer.transport.nixl.load_nixl``, ``verbs.load_pyverbs``,
    ``cuda_ipc.cuda_available``); raises ValueError for an unknown name."""
    from .transport import TRANSPORTS

    if name not in TRANSPORTS:
        raise ValueError(f"transport={name!r}: unknown; known: {', '.join(sorted(TRANSPORTS))}")
    try:
        if name == "cma":
            return None if sys.platform.startswith("linux") else f"process_vm_writev needs Linux, not {sys.platform}"
        if name == "shm":
            return None if hasattr(os, "memfd_create") else f"memfd_create needs Linux, not {sys.platform}"
        if name == "nixl":
            from .transport.nixl import load_nixl

            load_nixl()
        elif name == "verbs":
            from .transport.verbs import load_pyverbs

            load_pyverbs()
        elif name == "cuda_ipc":
            from .transport.cuda_ipc import INSTALL_HINT, cuda_available

            if not cuda_available():
                return INSTALL_HINT.splitlines()[0]
    except ImportError as e:
        return (str(e).splitlines() or [type(e).__name__])[0]
    return None
