"""The ``one_sided`` backend's names and init/update infos (:mod:`weight_transfer.engines.vllm.backend.plugin`):
the backend's name, the weight-version label of a failed update, the engine-core utility's name,
the store key of a deployment's engine, the worker's :class:`OneSidedInitInfo` and
:class:`OneSidedUpdateInfo`, and the trainer's :class:`OneSidedTrainerInitInfo` with its
:func:`transfer_options`. Shared by the worker side (:mod:`~weight_transfer.engines.vllm.backend.worker`),
the trainer side (:mod:`~weight_transfer.engines.vllm.backend.trainer`) and the clients
(:mod:`~weight_transfer.engines.vllm.backend.clients`); importing it needs vLLM.
"""
from __future__ import annotations

import dataclasses
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo, WeightTransferUpdateInfo

__all__ = ["BACKEND", "INCOMPLETE", "TARGETS", "GO_LIVE_UTILITY", "OneSidedInitInfo", "OneSidedUpdateInfo",
           "OneSidedTrainerInitInfo", "engine_key", "transfer_options"]

BACKEND = "one_sided"
"""The name both vLLM registries know this backend by (``weight_transfer_config={"backend": BACKEND}``)."""
INCOMPLETE = "incomplete:{version}"
"""vLLM's weight version after a failed update to ``version``: the bytes are a mix, so no
complete version is present (C14); outputs carry this label until a later update completes."""
TARGETS = ("auto", "staged", "direct")
"""As :data:`weight_transfer.engines.vllm.engine.TARGETS`."""
GO_LIVE_UTILITY = "wt_go_live"
"""The engine-core utility (``engine_core.call_utility_async(GO_LIVE_UTILITY, version, reset)``)
that makes a shadow update live (C27), added to vLLM's ``EngineCore`` by
:func:`weight_transfer.engines.vllm.backend.plugin.register`."""


def engine_key(first_rank: int) -> str:
    """Store key under which the worker at inference rank ``first_rank`` of a deployment says
    what it serves (``{"hf_config", "layout", "name", "n_workers", "vllm"}``):
    :data:`weight_transfer.api.ENGINE_KEY` for the first deployment (``first_rank`` 0: the
    coordinator plans from it), ``ENGINE_KEY/{first_rank}`` for one that joins later
    (:meth:`OneSidedTrainerEngine.add_engine` checks it serves the same model and layout)."""
    from weight_transfer.api import ENGINE_KEY

    return ENGINE_KEY if first_rank == 0 else f"{ENGINE_KEY}/{first_rank}"


def _first_line(e: BaseException) -> str:
    """``Type: first line of the message`` of ``e`` (how the errors here quote a cause); for an
    HTTP error of a vLLM server (``requests``' HTTPError, whose message is only the status) the
    server's own reason is added: ``(the server says: ...)``."""
    s = str(e)
    out = f"{type(e).__name__}: {s.splitlines()[0]}" if s else type(e).__name__
    resp = getattr(e, "response", None)
    if resp is not None and hasattr(resp, "status_code"):
        why = server_message(resp)
        if why and why not in out:
            out += f" (the server says: {why.splitlines()[0]})"
    return out


@dataclass
class OneSidedInitInfo(WeightTransferInitInfo):
    """What training rank 0 hands every worker (``init_weight_transfer_engine(init_info)``):
    the side channel vLLM's API lacks.

    ``store_host`` / ``store_port``: the control-plane store (a
    :class:`weight_transfer.security.secure_store.SecureStore` in training rank 0) the worker connects to
    and publishes its region descriptor, destination metadata and runtime layout in;
    ``secret_file``: the path of a file holding the job secret (hex, mode 0600, owned by the user
    reading it: :meth:`weight_transfer.security.secret.JobSecret.from_file`) -- the path only, never the
    secret, which does not cross vLLM's HTTP routes; the worker takes the secret from its own
    environment (``WEIGHT_TRANSFER_SECRET`` / ``WEIGHT_TRANSFER_SECRET_FILE``) first, else from
    this file (None: from the environment only; :func:`weight_transfer.engines.vllm.backend.worker.worker_secret`); ``first_rank``: the inference rank of this deployment's worker 0 (worker
    ``w`` of data-parallel replica ``d`` is inference rank ``first_rank + d * world_size + w``);
    ``targets``: ``"auto"`` (staged only where vLLM keeps the runtime bytes opaque), ``"staged"``
    (every post-processed layer staged) or ``"direct"`` (nothing staged: opaque layers are refused
    at plan time), as :class:`weight_transfer.engines.vllm.VllmEngine`; ``transport``: the data
    plane the trainers write with: ``"auto"`` (the worker chooses from its tensors' memory:
    ``cma`` for host memory, ``cuda_ipc`` for CUDA memory on one host,
    :func:`~weight_transfer.engines.vllm.worker.state.choose_transport`) or a transport's name
    (``"nixl"`` for trainers on other hosts; refused at init, naming the tensor and its device,
    when it cannot register the worker's tensors); the trainer engine passes its options'
    transport (``auto`` unless set) and its senders follow the workers' choice; ``timeout``:
    seconds a store call may block; ``shadow``: ``"off"``, ``"copy"`` or ``"flip"`` -- shadow
    targets (C27, :mod:`weight_transfer.engines.vllm.worker.shadow`): the writes land in a shadow while
    vLLM keeps generating, ``update_weights`` is the go-live; ``"auto"``: flip where every direct
    target is a parameter vLLM reads at call time, copy otherwise (said on stderr). ValueError (vLLM's
    ``parse_init_info`` passes it on) for a bad value."""

    store_host: str
    store_port: int
    first_rank: int = 0
    targets: str = "auto"
    transport: str = "auto"
    timeout: float = 120.0
    shadow: str = "off"
    delta_landing: float = 0.0
    """Packed delta updates: register a landing region of this fraction of the worker's target
    bytes (:mod:`weight_transfer.engines.vllm.worker.delta_apply`); 0: none."""
    secret_file: str | None = None
    """Path of the job secret's file (see above); None: the worker's environment only."""

    def __post_init__(self):
        if not isinstance(self.store_host, str) or not self.store_host:
            raise ValueError(f"store_host={self.store_host!r}: a host name or address")
        if not isinstance(self.store_port, int) or not 0 < self.store_port < 65536:
            raise ValueError(f"store_port={self.store_port!r}: a TCP port 1..65535")
        if self.secret_file is not None and (not isinstance(self.secret_file, str) or not self.secret_file):
            raise ValueError(f"secret_file={self.secret_file!r}: the path of the job secret's file, or None")
        if not isinstance(self.first_rank, int) or self.first_rank < 0:
            raise ValueError(f"first_rank={self.first_rank!r}: an inference rank >= 0")
        if self.targets not in TARGETS:
            raise ValueError(f"targets={self.targets!r}: one of {', '.join(TARGETS)}")
        from weight_transfer.transport import TRANSPORTS

        if self.transport != "auto" and self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}: 'auto' or one of {', '.join(sorted(TRANSPORTS))}")
        if not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r}: seconds > 0")
        from weight_transfer.api.shadow import check_mode

        if self.shadow != "auto":  # auto: each worker picks flip where it can, else copy (engines/vllm/worker/shadow.py)
            check_mode(self.shadow, where="shadow")


@dataclass
class OneSidedUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights(update_info={"version": v})``: commit the update to version ``v``
    (whose bytes the trainers wrote one-sidedly)."""

    version: int

    def __post_init__(self):
        try:
            self.version = int(self.version)
        except (TypeError, ValueError):
            raise ValueError(f"version={self.version!r}: an int") from None


def transfer_options(options=None):
    """A :class:`weight_transfer.options.TransferOptions` from ``None`` (the defaults, with
    transport ``"auto"``: the vLLM workers choose from their tensors' memory and the senders
    follow), a ``TransferOptions`` (taken as it is), or a dict of flat overrides of those
    defaults (a leaf field's name, or its ``flat`` name: ``{"transport": "cma", "watermark":
    64 << 20, "timeout": 60}``). TypeError names an unknown key; ValueError comes from the
    options' own checks."""
    from weight_transfer.options import AUTO_TRANSPORT, TransferOptions, TransportOptions

    base = TransferOptions(transport=TransportOptions(name=AUTO_TRANSPORT))
    if options is None:
        return base
    if isinstance(options, TransferOptions):
        return options
    if not isinstance(options, Mapping):
        raise TypeError(f"options: a dict of TransferOptions overrides or a TransferOptions, not {type(options).__name__}")
    where: dict[str, tuple[str, str]] = {}
    for part in dataclasses.fields(base):
        for leaf in dataclasses.fields(getattr(base, part.name)):
            where[leaf.metadata.get("flat", leaf.name)] = (part.name, leaf.name)
    unknown = sorted(k for k in options if k not in where)
    if unknown:
        raise TypeError(f"options: no TransferOptions field {', '.join(map(repr, unknown))}; known: {', '.join(sorted(where))}")
    changes: dict[str, dict] = {}
    for k, v in options.items():
        part, leaf = where[k]
        changes.setdefault(part, {})[leaf] = v
    return dataclasses.replace(base, **{p: dataclasses.replace(getattr(base, p), **c) for p, c in changes.items()})


@dataclass
class OneSidedTrainerInitInfo(TrainerInitInfo):
    """Every training rank's init info (``WeightTransferTrainerFactory.trainer_init``).

    ``rank`` (keyword, from vLLM's base): this training rank; ``world_size``: training ranks
    (each calls ``trainer_init`` and ``send_weights``); ``store_host`` / ``store_port``: where
    training rank 0 starts the control-plane store and where the vLLM workers and other ranks
    reach it (``store_port=0``: a free port, sent to the other ranks with
    :func:`weight_transfer.control.collectives.broadcast_data` (msgpack, no pickle) over the default process group, which must exist
    when ``world_size > 1``; with a default process group the path of the job secret's file goes
    the same way, :func:`job_secret`); ``n_infer``: inference ranks (None: every worker of the engine the
    client drives, as it reports); ``options``: :func:`transfer_options` (a dict of flat
    ``TransferOptions`` overrides, a ``TransferOptions``, or None; the transport is ``"auto"``
    unless set: the workers choose it from their tensors' memory and every rank's sender writes
    with what they chose); ``timeout``: seconds any rank
    may take to answer (None: ``options``' control timeout); ``targets``: the workers' targets
    (:class:`OneSidedInitInfo`); ``shadow``: the workers' shadow targets (``"off"``, ``"copy"``,
    ``"flip"``, ``"auto"``; C27): with them no caller pauses generation, each update's commit is the
    go-live, sent with the weight version label and the prefix-cache reset in one window
    between two engine steps (:meth:`AsyncLLMClient.go_live`); ``metrics``: training rank 0's
    coordinator's Prometheus metrics (:class:`weight_transfer.api.Coordinator`'s ``metrics=``: None
    off, a port to serve, a ``CollectorRegistry`` or a :class:`weight_transfer.metrics.UpdateMetrics`;
    docs/METRICS.md); ``verify``: ``"off"``, ``"sample"`` or ``"full"``, the end-to-end fingerprints
    of every update (None: ``options``' ``fingerprints``, itself ``"off"`` unless
    ``WEIGHT_TRANSFER_VERIFY`` says otherwise; :mod:`weight_transfer.control.fingerprint`, docs/VERIFY.md):
    each worker hashes the planned ranges of its memory after ``update_weights`` (with shadow
    targets in the shadow, before the go-live), training rank 0's coordinator compares them with
    what the training ranks sent before vLLM's weight version is set; a mismatch fails the
    update naming the tensor and both ranks."""

    backend: ClassVar[str] = BACKEND

    world_size: int = 1
    store_host: str = "127.0.0.1"
    store_port: int = 0
    n_infer: int | None = None
    options: Any = None
    timeout: float | None = None
    targets: str = "auto"
    shadow: str = "off"
    metrics: Any = None
    verify: str | None = None

    def __post_init__(self):
        from weight_transfer.api.shadow import check_mode
        from weight_transfer.options import VERIFY_MODES

        if self.verify is not None and self.verify not in VERIFY_MODES:
            raise ValueError(f"verify={self.verify!r}: one of {', '.join(VERIFY_MODES)}, or None (the options')")

        if self.shadow != "auto":  # auto: each worker picks flip where it can, else copy (engines/vllm/worker/shadow.py)
            check_mode(self.shadow, where="shadow")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size={self.world_size!r}: training ranks >= 1")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank!r}: 0 <= rank < world_size={self.world_size}")
        if not isinstance(self.store_port, int) or not 0 <= self.store_port < 65536:
            raise ValueError(f"store_port={self.store_port!r}: a TCP port (0: a free one)")
        if self.n_infer is not None and (not isinstance(self.n_infer, int) or self.n_infer < 1):
            raise ValueError(f"n_infer={self.n_infer!r}: inference ranks >= 1, or None (from the engine)")
        if self.timeout is not None and not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise ValueError(f"timeout={self.timeout!r}: seconds > 0, or None")
        if self.targets not in TARGETS:
            raise ValueError(f"targets={self.targets!r}: one of {', '.join(TARGETS)}")
        transfer_options(self.options)  # unknown keys / bad values refused here, before any process is reached


def store_alive(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at the store's ``host:port`` within ``timeout``
    seconds (a killed trainer's store refuses: its process is gone). A new store on the same
    port would count as alive: :func:`worker_release` then keeps the registration and names it."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def server_message(r) -> str:
    """A vLLM server's own reason in an error response (``{"error": {"message"}}``, FastAPI's
    ``{"detail"}``), else the first 300 characters of the body."""
    try:
        body = r.json()
        if isinstance(body, dict):
            err = body.get("error")
            msg = err.get("message") if isinstance(err, dict) else (err or body.get("detail") or body.get("message"))
            if msg:
                return str(msg).strip()
    except Exception:
        pass
    return (r.text or "").strip()[:300]
