"""The options of one weight transfer: what the reference method reads, and all it reads.

:class:`TransferOptions` is the typed seam between the reference method and whatever drives it
(the trial harness in ``experiments/``, a training framework): chunk size, local writes, the
transport, the control-plane timeout and the executor's options (pipeline, watermark, offload,
trace). The harness's ``weight_transfer.experiments.config.TrialConfig`` extends it with the trial's model and
world; the method contexts (:mod:`weight_transfer.method`) carry a plain ``TransferOptions``.

Config dataclass in torchtitan's style: ``kw_only``, ``slots``, one docstring per field,
checks in ``__post_init__`` (ValueError naming the field and the value). Checks that depend on
the host a transfer runs on (the transport's library imports, the trace directory can be
written) are in :meth:`TransferOptions.preflight`, which a launcher calls before it starts any
process (C18).
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class TransferOptions:
    """How the reference moves weights (bytes, seconds). Every field has a default; the
    defaults are the README's main job."""

    transport: str = "cma"
    """Data-plane back end (``weight_transfer.transport.TRANSPORTS``): ``cma``, ``nixl``, ``verbs``
    or ``cuda_ipc`` (docs/TRANSPORTS.md)."""
    timeout: float = 120.0
    """Seconds a control-plane wait may take before the missing ranks are named."""
    max_chunk_bytes: int = 64 << 20
    """Recipe outputs larger than this are split into row bands spread over senders (bytes)."""
    local_writes: bool = True
    """Shard-local prepare: recipes are cut at shard boundaries and made by the ranks that
    already hold the rows, from ``to_local()``, with no ``full_tensor()`` -- plain copies, fused
    row bands (``qkv_proj``, ``gate_up_proj``, ``w13_weight``) and block-FP8 recipes whose cuts
    fall on 128-row block boundaries (:mod:`weight_transfer.plan.local`); only the rest is gathered.
    False gathers every task's sources first (the published design, ``--gather-all``)."""
    local_min_bytes: int = 256 << 10
    """A recipe smaller than this (bytes per receiver) whose rows span several ranks is gathered
    rather than cut (norms, biases, a router: one collective for a few KB beats several tiny
    writes per receiver); one held whole by a rank is always local."""
    pipeline: bool = True
    """Run the executor's stages concurrently (stage threads with FIFO queues); ``False``
    runs every stage of a task before the next task starts (stage-serialized)."""
    watermark: int | None = None
    """Bytes of temporaries (gathered sources + outputs) the tasks in flight on one training
    rank may hold; ``None`` = unbounded. A task larger than this runs alone."""
    offload: bool = False
    """Training shards live in host memory (pinned on CUDA hosts) and are copied to the device
    buffer in the executor's ``h2d`` stage; metadata says ``offloaded=True``."""
    trace_dir: str | None = None
    """Directory for one Chrome trace per update and rank (``step{N}.rank{r}.json``); the CLI
    merges them into ``step{N}.json`` per update."""

    def __post_init__(self):
        TransferOptions.check(self)

    def check(self) -> None:
        """Raise ValueError naming the first field out of range (called by ``__post_init__``;
        subclasses call it from theirs): an unknown transport name, a timeout that is not a
        positive number of seconds, a chunk size < 1 byte, negative byte counts."""
        from .transport import TRANSPORTS

        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: unknown; known: {', '.join(sorted(TRANSPORTS))}")
        if not (isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r}: seconds > 0")
        if self.max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes={self.max_chunk_bytes}: bytes >= 1")
        if self.local_min_bytes < 0:
            raise ValueError(f"local_min_bytes={self.local_min_bytes}: bytes >= 0")
        if self.watermark is not None and self.watermark < 0:
            raise ValueError(f"watermark={self.watermark}: bytes >= 0, or None for unbounded")

    def preflight(self) -> None:
        """Checks that need this host, run before any process starts; raise ValueError with a
        one-line cause: the transport's library is importable here (``nixl``: NIXL's Python
        API; ``verbs``: pyverbs; ``cuda_ipc``: a CUDA torch with a GPU; ``cma``: Linux), and
        ``trace_dir`` (when set) is a directory this process can create and write a file in."""
        why = transport_unavailable(self.transport)
        if why:
            raise ValueError(f"transport {self.transport!r} is not available here: {why}")
        if self.trace_dir is not None:
            try:
                os.makedirs(self.trace_dir, exist_ok=True)
                with tempfile.TemporaryFile(dir=self.trace_dir):
                    pass
            except OSError as e:
                raise ValueError(f"trace_dir={self.trace_dir!r} is not writable: {e.strerror or e}") from None

    def transfer_options(self) -> TransferOptions:
        """A plain :class:`TransferOptions` with this object's values (a subclass such as the
        harness's TrialConfig hands only these to the method)."""
        return TransferOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(TransferOptions)})

    def executor_options(self) -> dict:
        """Keyword arguments for :class:`weight_transfer.executor.Executor`."""
        return {"pipeline": self.pipeline, "watermark": self.watermark, "offload": self.offload,
                "trace_dir": self.trace_dir}


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
