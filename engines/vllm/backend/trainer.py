"""The ``one_sided`` backend's trainer engine (:mod:`weight_transfer.engines.vllm.backend.plugin`): one per
training rank, built by ``WeightTransferTrainerFactory.trainer_init``. It rendezvouses through
the control-plane store, initializes the engines' workers through their client, plans once and
per update pushes every rank's writes (:class:`weight_transfer.api.Sender`), then commits on
every engine whose update began; rank 0 adds engines between updates. Also the
``WeightSource`` over a rank's own shards (:class:`DTensorSource`) and :class:`Deployment`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    ModuleSource,
    TrainerWeightTransferEngine,
    WeightSource,
    materialize_full_tensor,
)
from vllm.distributed.weight_transfer.base import ParamMeta as VllmParamMeta

from weight_transfer.engines.vllm.backend.config import (
    BACKEND,
    INCOMPLETE,
    OneSidedTrainerInitInfo,
    _first_line,
    engine_key,
    server_message,
    transfer_options,
)
from weight_transfer.engines.vllm.trace.draft import refuse_missing_draft

__all__ = ["DTensorSource", "Deployment", "OneSidedTrainerEngine"]


class DTensorSource(WeightSource):
    """A ``WeightSource`` over a training rank's own parameters: an ``nn.Module`` (FSDP2:
    DTensors) or a mapping ``{checkpoint name: DTensor | tensor}``; ``views`` for training
    tensors that fuse several checkpoint tensors (transformers 5's fused experts: pass
    ``fused_expert_views({n: p.shape for n, p in model.named_parameters()}, config.model_type)``). The one-sided backend reads
    the shards in place (``to_local()``, ``full_tensor()`` only where a recipe needs rows of
    other ranks); iterating yields full tensors like vLLM's ``ModuleSource`` (a collective for
    DTensors), for other backends."""

    def __init__(self, params, *, views=None) -> None:
        if not isinstance(params, (torch.nn.Module, Mapping)):
            raise TypeError(f"DTensorSource: an nn.Module or a mapping name -> tensor, not {type(params).__name__}")
        if views is not None and not isinstance(views, Mapping):
            raise TypeError(f"DTensorSource: views is a mapping checkpoint name -> (tensor name, box), not "
                            f"{type(views).__name__}")
        self.params = params
        self.views = dict(views or {})
        """Checkpoint name -> (training tensor name, box): the checkpoint tensors a fused training
        tensor holds (:func:`weight_transfer.plan.traced.fused_expert_views`), C29."""

    def named(self) -> dict[str, torch.Tensor]:
        return dict(self.params.named_parameters()) if isinstance(self.params, torch.nn.Module) else dict(self.params)

    def metadata(self) -> list[VllmParamMeta]:
        return [VllmParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.named().items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for n, t in self.named().items():
            yield n, materialize_full_tensor(t)


def _params_of(source):
    if isinstance(source, DTensorSource):
        return source.params
    if isinstance(source, ModuleSource):
        return source._module
    if source is None:
        raise TypeError("one_sided trainer_init: source= is required (ModuleSource(model) or DTensorSource(params))")
    raise TypeError(f"one_sided trainer_init: source {type(source).__name__} materializes full tensors; the one-sided "
                    "backend writes from the shards: pass ModuleSource(model) or DTensorSource(module_or_mapping)")


@dataclass
class Deployment:
    """One vLLM engine (a ``LLM``, an ``AsyncLLM``, a server) the trainer engine updates:
    ``client`` (its ``VLLMWeightSyncClient``), ``first_rank`` (the inference rank of its worker
    0), ``n_workers`` (its workers: inference ranks ``first_rank .. first_rank + n_workers - 1``),
    ``since`` (the first version it takes part in; 1 for the engine of ``trainer_init``)."""

    client: Any
    first_rank: int
    n_workers: int
    since: int = 1

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.n_workers)

    def who(self) -> str:
        r = self.ranks
        ranks = f"rank {r[0]}" if len(r) == 1 else f"ranks {r[0]}..{r[-1]}"
        return f"inference {ranks} ({type(self.client).__name__})"


class OneSidedTrainerEngine(TrainerWeightTransferEngine[OneSidedTrainerInitInfo]):
    """The trainer engine (one per training rank). Built by :meth:`trainer_init`; per update
    :meth:`send_weights`; rank 0 may add engines between updates (:meth:`add_engine`).
    Attributes: :attr:`sender` (this rank's :class:`weight_transfer.api.Sender`),
    :attr:`coordinator` (rank 0), :attr:`store`, :attr:`version` (the last version sent or
    attempted), :attr:`last_result` (rank 0: the last :class:`weight_transfer.api.UpdateResult`),
    :attr:`deployments` (rank 0: every engine added, :class:`Deployment`; those with a rank in
    the coordinator's membership are driven at each update, :meth:`active`)."""

    init_info_cls = OneSidedTrainerInitInfo

    def __init__(self, *, client, source=None, is_sender: bool = True, info: OneSidedTrainerInitInfo | None = None,
                 store=None, sender=None, coordinator=None, n_workers: int = 1) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info, self.store, self.sender, self.coordinator = info, store, sender, coordinator
        self.version = 0
        self.last_result = None
        self.deployments: list[Deployment] = [Deployment(client, 0, n_workers)] if is_sender else []
        self.secret_file: str | None = None
        """The path of the job secret's file handed to the vLLM workers in their init info
        (:func:`job_secret`; the same on every rank with a default process group); None under
        the opt-out or when this rank has no file to name."""
        self._made_secret_file: str | None = None

    @classmethod
    def trainer_init(cls, init_info: OneSidedTrainerInitInfo, *, client, source=None) -> OneSidedTrainerEngine:
        """Rendezvous (see the module docstring) and plan once.

        The job secret (:mod:`weight_transfer.security.secret`): training rank 0 takes the one of its
        environment or makes one (:func:`job_secret`), serves the store with it and hands the
        vLLM workers the path of a file holding it (``secret_file`` in their init info; a file
        :func:`write_secret_file` wrote, removed by :meth:`shutdown`, unless the environment
        named one) -- never the secret itself; a worker takes its own environment's secret
        first. The other training ranks take their environment's, else that file (its path sent
        with the store's address over the default process group, when there is one).

        Raises RuntimeError naming the inference side when ``client.init_weight_transfer_engine``
        fails (e.g. the server is not up), :class:`weight_transfer.security.secret.AuthenticationError`
        when its workers (or a training rank) could not join the store for want of the job
        secret (naming ``WEIGHT_TRANSFER_SECRET`` and the secret file), ValueError for a secret
        in the environment that is none, :class:`weight_transfer.plan.PlanError` naming a tensor
        the plan cannot target, ControlError when a rank does not answer within the timeout,
        TypeError for a ``source`` the backend cannot write from."""
        import torch.distributed as dist

        from weight_transfer.api import ENGINE_KEY, Coordinator, Sender, serve_store
        from weight_transfer.control import protocol as control
        from weight_transfer.engines.vllm.worker import runtime  # noqa: F401 -- registers the workers' RuntimeLayout (read by the coordinator)

        params = _params_of(source)
        opts = transfer_options(init_info.options)
        timeout = float(init_info.timeout if init_info.timeout is not None else opts.control.timeout)
        rank, world = init_info.rank, init_info.world_size
        host, port = init_info.store_host, init_info.store_port
        store, secret, secret_file, made = None, None, None, None
        if rank == 0:
            secret, secret_file = job_secret()
            store = serve_store(host, port, timeout=max(timeout, 60.0), secret=secret)  # None: the opt-out
            port = int(store.port)
            if secret is not None and secret_file is None:  # the workers read it from a file of this user's
                secret_file = made = write_secret_file(secret, port)
        if world > 1 and (init_info.store_port == 0 or dist.is_initialized()):
            if not dist.is_initialized():
                raise RuntimeError(f"training {rank}: store_port=0 with world_size={world} needs the default process "
                                   "group to send rank 0's store address (or give store_port)")
            from weight_transfer.control.collectives import broadcast_data

            # the secret file's path, never the secret; data, not a pickle
            host, port, secret_file = broadcast_data((host, port, secret_file), 0, type_=tuple[str, int, str | None])
        if store is None:
            store = _connect_rank(rank, host, port, secret_file, timeout=max(timeout, 60.0))
        coordinator, n_workers = None, 1
        if rank == 0:
            try:
                names = _publish_sources(store, params, getattr(source, "views", None) or {})
                _init_inference(client, _worker_info(host, port, 0, init_info, opts, timeout, secret_file))
                if not store.check([ENGINE_KEY]):
                    raise RuntimeError(f"training 0: init_weight_transfer_engine returned but no worker published "
                                       f"{ENGINE_KEY!r}: is the engine's backend {BACKEND!r}?")
                eng = control.get(store, ENGINE_KEY)
                refuse_missing_draft(eng, names)  # an engine serving an MTP draft needs its tensors in the source
                n_workers = int(eng["n_workers"])
                n_infer = init_info.n_infer or n_workers
                coordinator = Coordinator(store, n_train=world, n_infer=n_infer, options=opts, timeout=timeout,
                                          metrics=init_info.metrics, verify=init_info.verify)
            except BaseException as e:
                store.set("abort", f"training 0: trainer_init failed: {_first_line(e)}".encode())  # other ranks stop
                remove_secret_file(made)
                raise
        try:
            sender = Sender(params, rank=rank, world_size=world, store=store, coordinator=coordinator, options=opts,
                            timeout=timeout, views=getattr(source, "views", None) or None)
        except BaseException:
            remove_secret_file(made)
            raise
        self = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info, store=store,
                   sender=sender, coordinator=coordinator, n_workers=n_workers)
        self._worker_addr, self._opts, self._timeout = (host, port), opts, timeout
        self.secret_file, self._made_secret_file = secret_file, made
        try:
            sender.plan()  # plan once, now: a refusal (PlanError naming the tensor and vLLM's step) reaches the trainer here
        except BaseException:
            remove_secret_file(made)
            raise
        return self

    # ------------------------------------------------------------------ membership (rank 0)
    def add_engine(self, client, *, first_rank: int | None = None) -> Deployment:
        """Rank 0, between updates: a vLLM engine joins (a new one, or a restarted one with
        fresh memory) -- another ``LLM`` or server started with the ``one_sided`` backend,
        driven by ``client`` (an :class:`LLMClient`, an :class:`AsyncLLMClient`, vLLM's
        ``HTTPVLLMWeightSyncClient``). Its workers register through
        ``client.init_weight_transfer_engine`` at inference ranks ``first_rank ..`` (None: after
        every rank used so far) and announce the join; the coordinator replans for the new
        membership before the next update's "go" (the training ranks follow the new plan
        epoch; none restarts), and that update is the newcomer's first: written in full, its
        weight version the update's. Returns the :class:`Deployment`.

        Raises RuntimeError naming the inference side when its init fails, ValueError when it
        serves another model or parallel layout than the first engine (its registration is
        then withdrawn: it is never planned in)."""
        from weight_transfer.api import ENGINE_KEY
        from weight_transfer.control import membership
        from weight_transfer.control import protocol as control

        if not self.is_sender or self.coordinator is None:
            raise RuntimeError("add_engine: on training rank 0 (it hosts the coordinator) only")
        lay = self.coordinator.layout
        if lay.ep:
            raise ValueError("add_engine: the first engine is expert-parallel (experts sharded across its DP ranks): "
                             "a joining engine would be another EP group, which one plan does not cover")
        if first_rank is None:
            first_rank = max(r for d in self.deployments for r in d.ranks) + 1
        if first_rank % lay.tp:
            raise ValueError(f"add_engine: first_rank={first_rank}: a multiple of the engines' TP size {lay.tp} "
                             "(inference rank = replica * TP + TP rank)")
        used = {r for d in self.deployments for r in d.ranks if r in self.coordinator.members}
        if first_rank in used:
            raise ValueError(f"add_engine: first_rank={first_rank} is inference rank of a member engine "
                             f"(members: {sorted(used)})")
        host, port = self._worker_addr
        _init_inference(client, _worker_info(host, port, first_rank, self.info, self._opts, self._timeout,
                                             self.secret_file))
        key = engine_key(first_rank)
        if not self.store.check([key]):
            raise RuntimeError(f"training 0: init_weight_transfer_engine returned but no worker published {key!r}: is "
                               f"the new engine's backend {BACKEND!r}?")
        new, first = control.get(self.store, key), control.get(self.store, ENGINE_KEY)
        dep = Deployment(client, first_rank, int(new["n_workers"]), since=self.version + 1)
        why = [f"{k}: {new.get(k)!r} != {first.get(k)!r}" for k in ("layout", "n_workers", "transport")
               if new.get(k) != first.get(k)]
        why += [f"hf_config[{k!r}]: {new['hf_config'].get(k)!r} != {v!r}" for k, v in first["hf_config"].items()
                if k not in ("_name_or_path", "name_or_path") and new["hf_config"].get(k) != v][:3]
        if why:
            for r in dep.ranks:  # its receivers published and announced a join: withdraw them before any plan
                membership.announce_leave(self.store, r)
            with contextlib.suppress(Exception):
                getattr(client, "shutdown_weight_transfer_engine", lambda: None)()
            raise ValueError(f"add_engine: {dep.who()} serves another model or layout than inference rank 0's: "
                             + "; ".join(why))
        # one plan covers every engine as data-parallel replicas of the first one's layout: room for the
        # newcomer's (the coordinator plans the members only, so replicas that left cost nothing)
        dp = max(lay.dp, (dep.ranks[-1] + 1 + lay.tp - 1) // lay.tp)
        if dp != lay.dp:
            self.coordinator.layout = dataclasses.replace(lay, dp=dp)
        self.deployments.append(dep)
        return dep

    def active(self) -> list[Deployment]:
        """The engines an update drives: each with a rank in the coordinator's membership.
        Called before the update's "go", after the coordinator followed the membership: an
        engine added since the last update is in it (its first update), one that died or left
        is not (dropped after the update it failed in, C24). An engine whose join the
        coordinator did not take is never started or committed (its bytes were not written)."""
        if self.coordinator is None:
            return list(self.deployments)
        members = self.coordinator.members
        return [d for d in self.deployments if any(r in members for r in d.ranks)]

    # ------------------------------------------------------------------ per update
    def send_weights(self, version: int | None = None):
        """One update, on every training rank: a collective call (see the module docstring)
        with :meth:`weight_transfer.api.Sender.push`'s contract. ``version``: an int (None: the
        last version attempted + 1, from 1). Returns this rank's
        :class:`weight_transfer.pipeline.executor.StepStats` (rank 0: :attr:`last_result` holds the
        update's :class:`weight_transfer.api.UpdateResult`).

        Raises, on every training rank alike (one decision for all of them, C28):

        - before any byte moves (no engine is started, its bytes and weight version stay as
          they are, :attr:`version` is unchanged): VersionError when ``version`` does not
          increase (a repeated version included), TypeError when a rank's ``version`` is not an
          int, ValueError when the ranks asked for different versions;
        - ControlError when the update failed -- a training rank raising in any stage (on that
          rank the stage's exception is the ``__cause__``), a vLLM worker that died (``inference
          rank(s) [r] gone``; the next update drives the engines still alive), an engine's
          ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` failing, a rank
          that did not answer within the timeout -- naming role, rank and cause, after vLLM's
          weight version was set to :data:`INCOMPLETE` (rank 0) on every engine whose update
          began and that still answers. :attr:`version` is then the failed version, so the next
          default is above it (the coordinator refuses a failed version again)."""
        from weight_transfer.control.protocol import ControlError, VersionError

        v = self.version + 1 if version is None else version  # push checks it (TypeError on every rank alike)
        started: list[Deployment] = []

        def before_go(ver: int) -> None:  # after the decision "go" and the membership: only live engines
            deps = self.active()
            for d in deps:
                try:
                    d.client.start_weight_update()
                except Exception as e:
                    why = f"{d.who()}: start_weight_update failed: {_first_line(e)}"
                    if len(deps) == 1:
                        self.store.set("abort", why.encode())  # the only engine: this trainer engine is done
                    raise RuntimeError(f"training 0: {why}") from e
                started.append(d)

        def commit(ver: int) -> dict:
            if self.info is not None and self.info.shadow not in (None, "off"):
                from weight_transfer.engines.vllm.worker.shadow import trainer_go_live

                return trainer_go_live(self.store, started, ver, timeout=self._timeout)
            t0 = time.perf_counter()
            for d in started:
                try:
                    d.client.update_weights({"version": ver})
                except Exception as e:
                    raise RuntimeError(f"{d.who()}: update_weights(version={ver}) failed: {_first_line(e)}") from e
            t1 = time.perf_counter()
            if self.coordinator is not None:  # fingerprints (verify=): after the commit, before vLLM's label
                self.coordinator.verify_update(ver)
            t2 = time.perf_counter()
            for d in started:
                try:
                    d.client.finish_weight_update(weight_version=str(ver))
                except Exception as e:
                    raise RuntimeError(f"{d.who()}: finish_weight_update failed: {_first_line(e)}") from e
            return {"update_weights_s": t1 - t0, "verify_s": t2 - t1, "finish_weight_update_s": time.perf_counter() - t2,
                    "engines": [d.first_rank for d in started]}

        try:
            if self.is_sender:
                stats = self.sender.push(v, commit=commit, before_go=before_go)
            else:
                stats = self.sender.push(v)
        except BaseException as e:
            if isinstance(e, ControlError) and not isinstance(e, VersionError) and isinstance(v, int):
                self.version = max(self.version, int(v))  # a failed update: the next default is above it
            if self._served_intact():  # shadow targets, failed before any go-live: the label stays
                self._close_sessions(started)
            else:
                self._mark_incomplete(v, started)  # only engines whose update began (none for a refusal)
            raise
        self.version = operator.index(v)
        if self.is_sender:
            self.last_result = self.sender.last_update
        return stats

    def _served_intact(self) -> bool:
        """With shadow targets: the store still says ``complete`` (the update failed before any
        go-live, so every engine serves the last complete version untouched)."""
        if self.info is None or self.info.shadow in (None, "off") or self.store is None:
            return False
        from weight_transfer.control.protocol import read_state

        try:
            return read_state(self.store).complete
        except Exception:
            return False

    def _close_sessions(self, deps: list[Deployment]) -> None:
        """Close the update session of every engine in ``deps`` without changing its weight
        version (``finish_weight_update()``); one that does not answer is said on stderr."""
        for d in deps:
            try:
                d.client.finish_weight_update()
            except Exception as e:
                print(f"[rank 0] one_sided: could not close the update session of {d.who()}: {_first_line(e)}",
                      file=sys.stderr, flush=True)

    def _mark_incomplete(self, v: int, deps: list[Deployment]) -> None:
        """After a failed update: vLLM's weight version :data:`INCOMPLETE` on every engine whose
        update began (``deps``), closing its update session whether or not its workers closed it
        (their ``update_weights`` raising closes it). An engine that does not answer (dead) is
        said on stderr; the caller gets the update's own error."""
        label = INCOMPLETE.format(version=v)
        for d in deps:
            try:
                d.client.finish_weight_update(weight_version=label)
                continue
            except Exception:
                pass
            try:
                d.client.start_weight_update()
                d.client.finish_weight_update(weight_version=label)
            except Exception as e:
                print(f"[rank 0] one_sided: could not set the weight version of {d.who()} to {label!r}: "
                      f"{_first_line(e)}", file=sys.stderr, flush=True)

    def shutdown(self) -> None:
        """Release this rank's transport (rank 0: and tell every rank the job ends, and remove
        the job secret's file when this engine wrote it, :func:`write_secret_file`)."""
        try:
            if self.sender is not None:
                self.sender.close()
            if self.coordinator is not None:
                self.coordinator.shutdown()
        finally:
            made, self._made_secret_file = self._made_secret_file, None
            remove_secret_file(made)


def _publish_sources(store, params, views) -> dict:
    """Training rank 0's checkpoint names, global shapes and dtypes (fused tensors replaced by
    the checkpoint tensors their ``views`` hold), for the workers to trace their loader with
    (:data:`weight_transfer.plan.traced.SOURCES_KEY`, C29); returned too."""
    from weight_transfer.control import protocol as control
    from weight_transfer.plan.traced import SOURCES_KEY, expand_sources

    named = dict(params.named_parameters()) if isinstance(params, torch.nn.Module) else dict(params)
    held = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named.items()}
    out = expand_sources(held, views)
    control.put(store, SOURCES_KEY, out)
    return out


def _worker_info(host: str, port: int, first_rank: int, info: OneSidedTrainerInitInfo, opts, timeout: float,
                 secret_file: str | None) -> dict:
    """The :class:`OneSidedInitInfo` (as a dict) rank 0 hands one engine's workers (the job
    secret's file as a path only: it crosses vLLM's HTTP routes)."""
    return {"store_host": host, "store_port": port, "first_rank": first_rank, "targets": info.targets,
            "transport": opts.transport.name, "timeout": timeout, "shadow": info.shadow or "off",
            "delta_landing": opts.executor.delta_landing if opts.executor.delta and opts.executor.delta_mode != "scattered" else 0.0,
            "secret_file": secret_file}


# ------------------------------------------------------------------ the job secret (training rank 0 makes it)


def job_secret():
    """Training rank 0's job secret and the file the vLLM workers may read it from:
    ``(secret, path)``. The secret is the trainer's environment's
    (:data:`~weight_transfer.security.secret.ENV_SECRET`, else the file
    :data:`~weight_transfer.security.secret.ENV_SECRET_FILE` names: then ``path`` is that file's
    absolute path), else a fresh one (``path`` None: :func:`write_secret_file` writes it once the
    store's port is known). ``(None, None)`` under the opt-out
    (:data:`~weight_transfer.security.secret.ENV_INSECURE`). ValueError naming the variable when it
    holds no secret."""
    from weight_transfer.security.secret import ENV_SECRET, ENV_SECRET_FILE, JobSecret, insecure_requested

    if insecure_requested():
        return None, None
    sec = JobSecret.from_env()
    if sec is not None and not os.environ.get(ENV_SECRET) and os.environ.get(ENV_SECRET_FILE):
        return sec, os.path.abspath(os.environ[ENV_SECRET_FILE])
    return sec or JobSecret.generate(), None


SECRET_DIR = os.path.join("weight-transfer", "secrets")
"""Where :func:`write_secret_file` puts a job secret's file, under ``$XDG_CACHE_HOME`` (default
``~/.cache``): a directory of mode 0700."""


def write_secret_file(secret, port: int) -> str:
    """Write ``secret`` (a :class:`~weight_transfer.security.secret.JobSecret`) to a file of this user's,
    ``<cache>/weight-transfer/secrets/<port>-<random>.key`` (directory 0700, file 0600; a fresh
    ``tempfile.mkdtemp`` directory when the cache is not writable), for the vLLM workers of this
    host (or of a shared home) to read; removed by :meth:`OneSidedTrainerEngine.shutdown` and at
    exit. Returns its absolute path."""
    import atexit
    import secrets as _secrets
    import tempfile

    name = f"{int(port)}-{_secrets.token_hex(6)}.key"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    d = os.path.join(cache, SECRET_DIR)
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        if os.stat(d).st_uid == os.getuid():
            os.chmod(d, 0o700)
        path = secret.write_file(os.path.join(d, name))
    except OSError:
        path = secret.write_file(os.path.join(tempfile.mkdtemp(prefix="weight-transfer-secret-"), name))
    atexit.register(remove_secret_file, path)
    return os.path.abspath(path)


def remove_secret_file(path: str | None) -> None:
    """Remove a file :func:`write_secret_file` wrote (None, or a file already gone: nothing)."""
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _connect_rank(rank: int, host: str, port: int, secret_file: str | None, *, timeout: float):
    """A training rank other than 0 joins the store: with the secret of its own environment, else
    of ``secret_file`` (training 0's, sent over the default process group). AuthenticationError
    naming the rank and how to pass the secret when it has neither (or cannot read the file)."""
    from weight_transfer.api import connect_store
    from weight_transfer.security.secret import (
        ENV_SECRET,
        ENV_SECRET_FILE,
        AuthenticationError,
        JobSecret,
        insecure_requested,
    )

    secret = None
    if not insecure_requested():
        how = (f"set {ENV_SECRET} (the hex secret) or {ENV_SECRET_FILE} (a file only this user can read) in every "
               "training rank's environment, or initialize the default process group before trainer_init so training "
               "0 sends the path of its secret file (readable on the same host, or with a shared home)")
        try:
            secret = JobSecret.from_env() or (JobSecret.from_file(secret_file) if secret_file else None)
        except ValueError as e:
            raise AuthenticationError(f"training {rank}: no usable job secret for the store at {host}:{port}: {e}; "
                                      f"{how}") from None
        if secret is None:
            raise AuthenticationError(f"training {rank}: no job secret for the store at {host}:{port}: {how}")
    try:
        return connect_store((host, port), timeout=timeout, secret=secret)
    except AuthenticationError as e:
        raise AuthenticationError(f"training {rank}: {e}") from None


SECRET_MARK = "WEIGHT_TRANSFER_SECRET"
"""What every job-secret failure of a worker names (:func:`_init_inference` tells them apart)."""


def _server_reason(e: BaseException) -> str:
    """The inference side's own reason for ``e``: a vLLM server's error response behind
    ``requests``' ``HTTPError`` (:func:`~weight_transfer.engines.vllm.backend.config.server_message`)
    when there is one, else ``""``."""
    resp = getattr(e, "response", None)
    return "" if resp is None else server_message(resp)


def _init_inference(client, worker_info: dict) -> None:
    """``client.init_weight_transfer_engine(worker_info)``; when it fails, an error naming the
    inference side with the workers' own reason (a vLLM server's error response included):
    :class:`weight_transfer.security.secret.AuthenticationError` when a worker could not prove it is a
    member of the job (no job secret, an unreadable secret file, another secret: the reason
    names ``WEIGHT_TRANSFER_SECRET``), RuntimeError otherwise, with what to check (e.g. the
    server is not up yet)."""
    from weight_transfer.security.secret import AuthenticationError

    base = getattr(client, "base_url", None)
    if base:  # a server: release what a training run that is gone left there (C32), then init
        _recover_stale(base, timeout=float(getattr(client, "timeout", 120)))
    try:
        client.init_weight_transfer_engine(worker_info)
    except Exception as e:
        first = worker_info["first_rank"]
        where = (f"training 0: the inference side{f' at rank {first}' if first else ''}"
                 f"{f' ({base})' if base else ''} did not initialize the "
                 f"{BACKEND!r} backend (client.init_weight_transfer_engine via {type(client).__name__})")
        server = _server_reason(e)
        reason = _first_line(e)
        if isinstance(e, AuthenticationError) or SECRET_MARK in str(e) or SECRET_MARK in server:
            raise AuthenticationError(
                f"{where}: its workers could not join the job's control plane: {reason}. The vLLM workers need the "
                f"job secret: {SECRET_MARK} or {SECRET_MARK}_FILE in the vLLM server's environment, or the init "
                f"info's secret_file ({worker_info.get('secret_file')!r}) readable by the vLLM server's user "
                "(docs/VLLM.md)") from e
        if server or "(vLLM worker pid " in reason:  # a server's or our worker engine's own reason: the cause
            raise RuntimeError(f"{where}: {reason}") from e
        raise RuntimeError(
            f"{where}: {reason}. "
            "Is vLLM up and started with weight_transfer_config={'backend': 'one_sided'} "
            "(server: --weight-transfer-config '{\"backend\": \"one_sided\"}', VLLM_SERVER_DEV_MODE=1)?"
        ) from e


def _recover_stale(base_url: str, *, timeout: float) -> None:
    """Before training rank 0 initializes a vLLM server: release what a training run that is
    gone left in its workers (:func:`weight_transfer.engines.vllm.backend.recover.recover_http` with
    ``stale_only``: registration, shadows, staging, an update session left open; the pause
    state is the caller's: not touched), said on stderr when it released anything. A server that refuses (no dev mode, an older
    plugin) is left to ``init_weight_transfer_engine``'s own error."""
    from weight_transfer.engines.vllm.backend.recover import ServerError, recover_http

    try:
        out = recover_http(base_url, stale_only=True, resume=False, timeout=timeout)
    except ServerError:
        return
    if out.get("released"):
        print(f"[rank 0] one_sided: {base_url}: released the state of a training run that is gone (weight version "
              f"{out.get('label')!r})", file=sys.stderr,
              flush=True)
