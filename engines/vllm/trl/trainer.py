"""TRL's asynchronous GRPO trainer drives the ``one_sided`` backend.

Written against **TRL 1.16.0** (``trl.experimental.async_grpo``: ``AsyncGRPOTrainer``, its
``WeightTransferProtocol`` and ``_sync_weight_merged``) and **vLLM 0.32.0** (the server's
``/pause``, ``/resume``, ``/reset_prefix_cache`` and weight-transfer routes). TRL's experimental
API may change in another version: the trainer subclass below overrides a private method.

TRL's ``AsyncGRPOTrainer(weight_transfer=...)`` takes any object with five methods
(``init_weight_transfer``, ``pause``, ``send_weights(iterator)``, ``resume``, ``destroy``);
:class:`OneSidedWeightTransfer` is one, built on the backend's trainer engine
(:class:`~weight_transfer.engines.vllm.backend.plugin.OneSidedTrainerEngine`, via vLLM's
``WeightTransferTrainerFactory.trainer_init`` and its ``HTTPVLLMWeightSyncClient``)::

    # the server (VLLM_SERVER_DEV_MODE=1 for the weight-transfer and pause routes)
    VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server --model DIR \\
        --weight-transfer-config '{"backend": "one_sided"}'

    # one training process: TRL's own trainer, unchanged
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from weight_transfer.engines.vllm.trl.trainer import OneSidedWeightTransfer
    args = AsyncGRPOConfig(output_dir=..., vllm_server_base_url=url, ...)
    trainer = AsyncGRPOTrainer(model=DIR, reward_funcs=..., args=args, train_dataset=...,
                               weight_transfer=OneSidedWeightTransfer(url))
    trainer.train()

    # several training processes (FSDP2; torchrun / accelerate launch): the subclass
    from weight_transfer.engines.vllm.trl.trainer import OneSidedAsyncGRPOTrainer
    trainer = OneSidedAsyncGRPOTrainer(model=DIR, ..., weight_transfer=OneSidedWeightTransfer(url))

What a weight sync does (TRL calls it once at train begin -- version 1, the initial model -- and
after every ``weight_sync_steps`` optimizer steps): ``pause`` (rank 0: ``POST /pause?mode=keep``,
as TRL's own client: requests in flight are frozen, not aborted), then the update (every
training rank writes its own shards one-sidedly into the server's worker memory, in vLLM's
runtime layout, after one static plan made at the first sync; rank 0 drives the server's
``start_weight_update`` / ``update_weights`` / ``finish_weight_update(weight_version=str(v))``),
then ``POST /reset_prefix_cache?reset_running_requests=true`` (the KV blocks cached -- those of
the frozen requests included -- were computed with the old weights: C21, C23), then ``resume``
(``POST /resume``). vLLM labels every output with the version ``v`` (``/weight_info``), the same
number as TRL's ``model_version`` the rollout worker tags its samples with.

**One training rank.** TRL hands the protocol an iterator over the parameters
(``AsyncGRPOTrainer._streaming_iter``: ``param.detach()``, the parameters' own memory on one
rank), not the model. :class:`OneSidedWeightTransfer` sets up lazily at the first
``send_weights``: it takes that stream once as its source (name -> tensor, the parameters
themselves) and plans; later syncs only check that the stream still yields the same tensors
(names and memory: a stream of copies would be refused, naming the tensor) and write from the
parameters in place. :meth:`OneSidedWeightTransfer.bind` gives it the model up front instead
(then no stream is read).

**Several training ranks (FSDP2).** This backend needs ``send_weights`` on *every* training rank,
each writing its own shards, and no gather beyond the ``full_tensor()`` the plan itself needs.
TRL 1.16's ``_sync_weight_merged`` does the opposite: only the main process holds the
``weight_transfer`` object and calls ``send_weights(self._streaming_iter())``, while every other
rank runs ``_streaming_iter`` to take part in a ``full_tensor()`` all-gather of every parameter.
:class:`OneSidedAsyncGRPOTrainer` (a small subclass) overrides that sync: every rank keeps the
``weight_transfer`` object, binds it to its FSDP2 module (its DTensor shards) at the first sync,
and calls :meth:`OneSidedWeightTransfer.push` with the same version; no rank runs
``_streaming_iter``. With one rank it behaves as TRL's own trainer. With TRL's own trainer on
several ranks, :meth:`OneSidedWeightTransfer.init_weight_transfer` refuses at train begin (a
``RuntimeError`` naming the subclass) rather than funnel a gathered model through rank 0.

**Shadow targets** (``shadow="auto"``, ``"copy"``, ``"flip"``; C27): :meth:`~OneSidedWeightTransfer.pause`
and :meth:`~OneSidedWeightTransfer.resume` call nothing -- TRL's rollouts keep generating through
the sync; the go-live, vLLM's label and the prefix-cache reset are one engine-core call between
two engine steps (``wt_go_live`` over the server's ``/collective_rpc``,
:mod:`weight_transfer.engines.vllm.backend.recover`). TRL tags each rollout group with the version at its
start, so a request that crossed a go-live is tagged with its oldest tokens' version.

Failures are the backend's (README: "What push promises inside your trainer"; docs/VLLM.md): a
refused version (``VersionError``/``TypeError``/``ValueError``) on every rank before any byte
moves; a failed update ``ControlError`` on every rank, vLLM's weight version ``incomplete:v``.
Without shadow targets the server then stays paused (``resume`` is not called: TRL's sync raises
before it), as after a failed NCCL sync in TRL's own client: its weights are no complete version
(a note on the error says how to go on). A refused init or a refusal before any byte moved
resumes a server this object paused. A server that does not answer is a ``ControlError`` naming
the URL and the call in progress; an error answer carries the server's own reason. One run
leaves nothing behind (C32): ``destroy`` returns every worker to a fresh server's state, and the
first sync of a run releases what a run that is gone left there (:func:`recover`;
``weight-transfer vllm-recover`` by hand).

Not covered: PEFT models (TRL merges the adapter into the base weights for the sync; which memory
that touches is not checked here: :meth:`OneSidedWeightTransfer.bind` refuses a PEFT model),
vision-language models whose frozen towers TRL does not send (the plan refuses the tensors it
has no source for, naming them).

CPU-only hosts: TRL's packed attention and its MFU helper need CUDA; the opt-in shims are in
:mod:`weight_transfer.engines.vllm.trl.cpu` (never applied by importing this module).
"""
from __future__ import annotations

import inspect
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import trl
from trl.experimental.async_grpo import AsyncGRPOTrainer

from weight_transfer.engines.vllm.backend.plugin import DTensorSource, OneSidedTrainerInitInfo

__all__ = ["TRL_VERSION", "OneSidedWeightTransfer", "OneSidedAsyncGRPOTrainer", "recover", "SHADOW_MODES"]

SHADOW_MODES = ("off", "auto", "copy", "flip")
"""``shadow=``: ``"off"`` (pause-based syncs), or shadow targets -- ``"auto"`` (each worker picks
``flip`` where every target is a parameter vLLM reads at call time, else ``copy``), ``"copy"``,
``"flip"`` (engines/vllm/worker/shadow.py)."""
TRL_SERVER_TIMEOUT = 240.0
"""TRL 1.16's default ``vllm_server_timeout`` (seconds to wait for the server), the default here."""
TRL_REQUEST_TIMEOUT = 600.0
"""TRL 1.16's default ``request_timeout`` (seconds per HTTP call), the default here."""

TRL_VERSION = "1.16.0"
"""The TRL version this module was written and tested against (the ``[trl]`` extra pins it);
importing it with another TRL warns: :class:`OneSidedAsyncGRPOTrainer` overrides a private method."""

if trl.__version__ != TRL_VERSION:
    warnings.warn(f"weight_transfer.engines.vllm.trl.trainer was written against TRL {TRL_VERSION}; TRL {trl.__version__} is "
                  "installed (OneSidedAsyncGRPOTrainer overrides AsyncGRPOTrainer._sync_weight_merged)", stacklevel=2)


def _dist() -> tuple[int, int]:
    """(rank, world size) of the default process group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _named_for_vllm(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{checkpoint name: parameter}`` as TRL names what it sends to vLLM
    (``trl.experimental.async_grpo.async_grpo_trainer._iter_vllm_named_params``: trainable
    parameters, wrapper prefixes removed). The parameters themselves (DTensors under FSDP2)."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    return dict(_iter_vllm_named_params(model))


class OneSidedWeightTransfer:
    """TRL's ``WeightTransferProtocol`` (TRL 1.16.0) over the ``one_sided`` backend of a vLLM
    server (see the module docstring).

    ``base_url``: the vLLM server (started with ``--weight-transfer-config '{"backend":
    "one_sided"}'`` and ``VLLM_SERVER_DEV_MODE=1``); ``rank`` / ``world_size``: this training
    rank and the training ranks (None: the default process group's at setup, or 0 and 1
    without one); ``store_host`` / ``store_port``: where training rank 0 starts the control-plane
    store, an address the server's workers and the other ranks reach (``store_port=0``: a free
    port; the data plane follows the workers' memory: on a host-memory vLLM, ``cma`` into the
    server's processes on this host; the store admits members of the job only: rank 0 hands the
    server's workers the path of the job secret's file, which a server of the same user and host
    reads, while a server on another host or under another user needs ``WEIGHT_TRANSFER_SECRET``
    or ``WEIGHT_TRANSFER_SECRET_FILE`` in its environment, docs/VLLM.md "The job secret");
    ``options``, ``timeout``, ``targets``, ``verify`` (``"off"``, ``"sample"``, ``"full"``: the
    end-to-end fingerprints of every sync, docs/VERIFY.md): as
    :class:`~weight_transfer.engines.vllm.backend.plugin.OneSidedTrainerInitInfo`; ``shadow``: one of
    :data:`SHADOW_MODES` (``"off"``: pause-based syncs; else shadow targets, no pause);
    ``http_timeout``: seconds per HTTP call (pause, resume, prefix-cache reset, and vLLM's
    weight-sync client; None: TRL's ``request_timeout``, default 600); ``server_timeout``: seconds
    to wait for the server's ``/health`` at train begin (None: TRL's ``vllm_server_timeout``,
    default 240); ``reset_prefix_cache``: reset vLLM's prefix cache after each update (C21; only
    turn it off when nothing is cached). ValueError for a bad URL, mode or timeout, and what the
    init info refuses.

    Attributes after the first update: :attr:`http_calls` (the routes this object called on the
    server, in order), :attr:`trainer` (the backend's trainer engine),
    :attr:`version` (the last version sent or attempted), :attr:`last_stats` (this rank's
    :class:`weight_transfer.pipeline.executor.StepStats` of the last update: bytes, writes,
    ``gather_bytes``), :attr:`last_result` (rank 0: the update's
    :class:`weight_transfer.api.UpdateResult`), :attr:`schedule` (rank 0: the plan),
    :attr:`seconds` (per update: wall seconds of the update call on this rank)."""

    def __init__(self, base_url: str, *, rank: int | None = None, world_size: int | None = None,
                 store_host: str = "127.0.0.1", store_port: int = 0, options: Any = None,
                 timeout: float | None = None, targets: str = "auto", http_timeout: float | None = None,
                 server_timeout: float | None = None, reset_prefix_cache: bool = True, verify: str | None = None,
                 shadow: str = "off") -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r}: the vLLM server's URL, http://host:port")
        for name, x in (("http_timeout", http_timeout), ("server_timeout", server_timeout)):
            if x is not None and not (isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0):
                raise ValueError(f"{name}={x!r}: seconds > 0 (or None: TRL's own setting)")
        if shadow not in SHADOW_MODES:
            raise ValueError(f"shadow={shadow!r}: one of {', '.join(map(repr, SHADOW_MODES))}")
        self.base_url = base_url.rstrip("/")
        self._rank, self._world = rank, world_size
        self._init_kw = dict(store_host=store_host, store_port=store_port, options=options, timeout=timeout,
                             targets=targets, verify=verify, shadow=shadow)
        # the init info's own checks, now (rank and world size as far as given)
        OneSidedTrainerInitInfo(rank=0 if rank is None else rank,
                                world_size=(1 if rank is None else rank + 1) if world_size is None else world_size,
                                **self._init_kw)
        self.shadow = shadow
        self._timeouts_given = (http_timeout is not None, server_timeout is not None)
        self.http_timeout = float(http_timeout) if http_timeout is not None else TRL_REQUEST_TIMEOUT
        self.server_timeout = float(server_timeout) if server_timeout is not None else TRL_SERVER_TIMEOUT
        self._paused = False  # this object paused the server and has not resumed it
        self.http_calls: list[str] = []  # the routes this object called on the server, in order (pause, resume, ...)
        self.reset_prefix_cache = bool(reset_prefix_cache)
        self.params: dict[str, torch.Tensor] | None = None
        self._bound_from = None  # "model" (bind) or "stream" (the first send_weights' iterator)
        self.trainer = None
        self.version = 0
        self.last_stats = None
        self.last_result = None
        self.seconds: list[float] = []
        self._all_ranks = False  # set by OneSidedAsyncGRPOTrainer: every rank calls push()

    # ------------------------------------------------------------------ who and where
    @property
    def rank(self) -> int:
        """This training rank (explicit, else the default process group's, else 0)."""
        return self._rank if self._rank is not None else _dist()[0]

    @property
    def world_size(self) -> int:
        """Training ranks (explicit, else the default process group's, else 1)."""
        return self._world if self._world is not None else _dist()[1]

    @property
    def schedule(self):
        """Rank 0: the static plan (:class:`weight_transfer.types.Schedule`; None before the first
        update and on other ranks)."""
        c = getattr(self.trainer, "coordinator", None)
        return None if c is None else c.schedule

    def _post(self, path: str, doing: str, **params) -> dict:
        """``POST {base_url}/{path}`` (:func:`~weight_transfer.engines.vllm.backend.recover.post_route`,
        recorded in :attr:`http_calls`): its JSON answer; ControlError naming the URL and
        ``doing`` when the server does not answer, ServerError with its reason otherwise."""
        from weight_transfer.engines.vllm.backend.recover import post_route

        self.http_calls.append(path)
        return post_route(self.base_url, path, doing, who=f"training {self.rank}", timeout=self.http_timeout,
                          **params)

    def weight_version(self) -> str | None:
        """vLLM's weight version now (``GET /weight_info``); ControlError naming the URL when the
        server does not answer."""
        import requests

        from weight_transfer.errors import ControlError

        try:
            r = requests.get(f"{self.base_url}/weight_info", timeout=self.http_timeout)
            r.raise_for_status()
        except requests.RequestException as e:
            raise ControlError(f"training {self.rank}: the vLLM server at {self.base_url} did not answer GET "
                               f"/weight_info: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        return r.json()["weight_version"]

    def use_trl_args(self, args) -> OneSidedWeightTransfer:
        """Take TRL's own timeouts from ``args`` (an ``AsyncGRPOConfig``) where none was given
        here: ``vllm_server_timeout`` for the wait for the server (:attr:`server_timeout`),
        ``request_timeout`` per HTTP call (:attr:`http_timeout`).
        :class:`OneSidedAsyncGRPOTrainer` calls it; with TRL's own trainer,
        :meth:`init_weight_transfer` finds the trainer's config itself. Returns ``self``."""
        given_http, given_server = self._timeouts_given
        if not given_server and getattr(args, "vllm_server_timeout", None):
            self.server_timeout = float(args.vllm_server_timeout)
        if not given_http and getattr(args, "request_timeout", None):
            self.http_timeout = float(args.request_timeout)
        return self

    # ------------------------------------------------------------------ the source
    def bind(self, model: torch.nn.Module | Mapping[str, torch.Tensor]) -> OneSidedWeightTransfer:
        """Use ``model`` as this rank's source: an ``nn.Module`` (FSDP2: its DTensor shards;
        named as TRL names what it sends, trainable parameters only) or a mapping ``{checkpoint
        name: tensor | DTensor}``. Call before the first update (:class:`OneSidedAsyncGRPOTrainer`
        does, at the first sync, after accelerate wrapped the model); binding the same parameters
        again is a no-op. Returns ``self``.

        Raises TypeError for another type, ValueError for a PEFT model (the adapter merge is not
        covered) or an empty one, RuntimeError when already set up with other parameters (the plan
        was made against them: a new :class:`OneSidedWeightTransfer` is needed)."""
        if isinstance(model, torch.nn.Module):
            if hasattr(model, "peft_config"):
                raise ValueError("OneSidedWeightTransfer.bind: a PEFT model: TRL merges the adapter into the base "
                                 "weights for each sync, which this integration does not cover; merge and unload it, "
                                 "or train without PEFT")
            params = _named_for_vllm(model)
        elif isinstance(model, Mapping):
            params = dict(model)
        else:
            raise TypeError(f"OneSidedWeightTransfer.bind: an nn.Module or a mapping name -> tensor, not "
                            f"{type(model).__name__}")
        if not params:
            raise ValueError("OneSidedWeightTransfer.bind: no parameter to send (every parameter frozen?)")
        self._set_params(params, "model")
        return self

    def _set_params(self, params: dict[str, torch.Tensor], how: str) -> None:
        if self.params is not None:
            same = params.keys() == self.params.keys() and all(params[n] is self.params[n] or _same_memory(
                params[n], self.params[n]) for n in params)
            if same:
                return
            if self.trainer is not None:
                raise RuntimeError(f"training {self.rank}: OneSidedWeightTransfer is set up with other parameters "
                                   "(the plan was made against them); build a new one for another model")
        self.params, self._bound_from = params, how

    def _check_stream(self, iterator) -> None:
        """A later sync's stream (one rank, no bind): the same names and the parameters' own
        memory, else RuntimeError naming the first tensor that differs (a stream of copies:
        the writes would read the first sync's tensors, not the trainer's weights)."""
        seen = []
        for name, t in iterator:
            seen.append(name)
            mine = self.params.get(name)
            if mine is None or not _same_memory(t, mine):
                why = "is new" if mine is None else "is a copy, not the parameter's memory"
                raise RuntimeError(f"training {self.rank}: send_weights: the stream's {name!r} {why}: the one-sided "
                                   "backend writes from the parameters in place; bind(model) instead")
        missing = sorted(set(self.params) - set(seen))
        if missing:
            raise RuntimeError(f"training {self.rank}: send_weights: the stream no longer yields {missing[:3]}")

    # ------------------------------------------------------------------ TRL's protocol
    def init_weight_transfer(self) -> None:
        """TRL calls it once at train begin, on the main process only, before the first sync:
        waits for the server's ``/health`` (``http_timeout``) and checks the training world.
        The rendezvous and the plan come at the first update (a collective of every training
        rank, which this call is not). Raises RuntimeError when several training ranks run
        TRL's own ``AsyncGRPOTrainer`` (it calls ``send_weights`` on the main process only:
        use :class:`OneSidedAsyncGRPOTrainer`), TimeoutError when the server does not answer."""
        if self.world_size > 1 and not self._all_ranks:
            raise RuntimeError(
                f"OneSidedWeightTransfer: {self.world_size} training ranks under TRL's AsyncGRPOTrainer, which calls "
                "send_weights on the main process only while the other ranks all-gather every parameter "
                "(_streaming_iter); the one_sided backend needs every rank to write its own shards: use "
                "weight_transfer.engines.vllm.trl.trainer.OneSidedAsyncGRPOTrainer")
        caller = getattr(getattr(inspect.currentframe(), "f_back", None), "f_locals", {}).get("self")
        trainer = getattr(caller, "_trainer", None)  # TRL 1.16's _TrainBeginCallback: its trainer's config
        if isinstance(trainer, AsyncGRPOTrainer):
            self.use_trl_args(trainer.args)
        self.wait_ready()

    def wait_ready(self, timeout: float | None = None) -> float:
        """Poll ``/health`` until the server answers 200; returns the seconds waited.
        TimeoutError naming the URL after ``timeout`` (default :attr:`server_timeout`: TRL's
        ``vllm_server_timeout``) seconds; RuntimeError at once when something else answers
        there (``/health`` not found: not a vLLM server)."""
        from weight_transfer.engines.vllm.backend.recover import wait_health

        return wait_health(self.base_url, self.server_timeout if timeout is None else float(timeout),
                           who="OneSidedWeightTransfer", setting="server_timeout, default TRL's vllm_server_timeout")

    def pause(self) -> None:
        """Rank 0 (TRL calls it on the main process). Without shadow targets: ``POST
        /pause?mode=keep``, as TRL's own client -- requests in flight are frozen, not aborted,
        and continue after :meth:`resume` under the new weights (their KV is recomputed: the
        prefix-cache reset after the update). With shadow targets: nothing -- the server keeps
        generating through the sync; the go-live is one engine-core call between two steps.
        ControlError naming the URL when the server does not answer; ServerError with its
        reason when it refuses."""
        self._reclaim()
        if self.shadow != "off":
            return
        self._post("pause", "pausing generation for a weight sync", mode="keep")
        self._paused = True

    def _reclaim(self) -> None:
        """Rank 0, once, before the first sync touches the server: release what a training run
        that is gone left there (C32: :func:`recover`, its registration only if its store no
        longer answers) and resume generation it left paused -- before this run pauses.
        Said on stderr when it released anything; a server that refuses is left to the init's
        own error."""
        if self.rank != 0 or self.trainer is not None or getattr(self, "_reclaimed", False):
            return
        from weight_transfer.engines.vllm.backend.recover import ServerError, recover_http

        self._reclaimed = True
        try:
            out = recover_http(self.base_url, stale_only=True, resume=True, timeout=self.http_timeout)
        except ServerError:
            return
        if out.get("released"):
            print(f"[rank 0] OneSidedWeightTransfer: {self.base_url}: released the state of a training run that is "
                  f"gone (weight version {out.get('label')!r}{', generation resumed' if out.get('resumed') else ''})",
                  file=sys.stderr, flush=True)

    def resume(self) -> None:
        """Rank 0: ``POST /resume`` (without shadow targets; with them: nothing). Errors as
        :meth:`pause`."""
        if self.shadow != "off":
            return
        self._post("resume", "resuming generation after a weight sync")
        self._paused = False

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]] | None = None) -> None:
        """TRL's call, on the main process, with ``iterator`` = ``_streaming_iter()``. One
        training rank only (several: :class:`OneSidedAsyncGRPOTrainer` calls :meth:`push` on
        each instead). The first call without :meth:`bind` takes the stream as this rank's
        source (the parameters' own tensors on one rank; nothing is copied) and sets up; later
        calls check the stream (:meth:`_check_stream`) and push. Once bound to a model the
        stream is closed unread. Raises what :meth:`push` raises, RuntimeError for a stream
        that yields copies or when called with several training ranks."""
        if self.world_size > 1:
            if hasattr(iterator, "close"):
                iterator.close()
            raise RuntimeError(f"training {self.rank}: OneSidedWeightTransfer.send_weights with {self.world_size} "
                               "training ranks: TRL's AsyncGRPOTrainer calls it on the main process only; use "
                               "OneSidedAsyncGRPOTrainer (every rank pushes its own shards)")
        if self.params is None:
            if iterator is None:
                raise RuntimeError("OneSidedWeightTransfer.send_weights: no parameters: pass TRL's stream or "
                                   "bind(model) first")
            self._set_params(dict(iterator), "stream")
        elif self._bound_from == "stream" and iterator is not None:
            self._check_stream(iterator)
        elif hasattr(iterator, "close"):
            iterator.close()  # bound to the model: nothing is read from the stream
        self.push()

    def push(self, version: int | None = None):
        """One update, on **every** training rank (a collective call): set up at the first call
        (``WeightTransferTrainerFactory.trainer_init``: rank 0 starts the store and calls the
        server's ``init_weight_transfer_engine`` through vLLM's ``HTTPVLLMWeightSyncClient``;
        the plan is made once), then the trainer engine's ``send_weights(version)`` (None: the
        last version + 1, from 1; vLLM labels its outputs ``str(version)``), then on rank 0 the
        prefix-cache reset. Returns this rank's StepStats.

        Raises RuntimeError when no source is bound or the server refuses the cache reset (its
        ``success`` false: the update completed, but cached blocks may hold old-weight KV);
        :class:`weight_transfer.plan.PlanError` at the first call for a tensor the plan cannot
        target; otherwise what the trainer engine's ``send_weights`` raises, alike on every rank
        (module docstring)."""
        if self.params is None:
            raise RuntimeError(f"training {self.rank}: OneSidedWeightTransfer.push: no source: bind(model) first")
        try:
            if self.trainer is None:
                self._reclaim()  # shadow targets: no pause() came first
                self._setup()
        except BaseException as e:
            self._after_failure(e, intact=True)
            raise
        t0 = time.perf_counter()
        try:
            self.last_stats = self.trainer.send_weights(version)
        except BaseException as e:
            from weight_transfer.control.protocol import VersionError

            refused = isinstance(e, (VersionError, TypeError, ValueError))  # before any byte moved
            self.version = self.trainer.version
            self._after_failure(e, intact=refused or self.shadow != "off")
            raise
        self.version = self.trainer.version
        if self.trainer.is_sender:
            self.last_result = self.trainer.last_result
            if self.reset_prefix_cache and self.shadow == "off":  # with shadow targets the go-live reset it
                ok = self._post("reset_prefix_cache", f"resetting the prefix cache after version {self.version}",
                                reset_running_requests="true").get("success")
                if ok is False:
                    raise RuntimeError(f"training 0: version {self.version} was written, but vLLM refused to reset "
                                       "its prefix cache (/reset_prefix_cache answered success=false): cached "
                                       "blocks may hold KV of the old weights")
        self.seconds.append(time.perf_counter() - t0)
        return self.last_stats

    def _after_failure(self, e: BaseException, *, intact: bool) -> None:
        """Rank 0, after a failed setup or update: when this object paused the server and the
        served weights are intact (a refusal before any byte moved, a refused init, a shadow
        update that failed before its go-live), resume it so generation does not stay stopped;
        otherwise (live bytes of no complete version) it stays paused and the error says how to
        go on (a note on ``e``)."""
        if self.rank != 0 or not self._paused:
            return
        if intact:
            try:
                self.resume()
                e.add_note(f"the vLLM server at {self.base_url} was resumed: its weights are the last complete "
                           "version's (nothing was written)")
            except Exception as r:
                e.add_note(f"the vLLM server at {self.base_url} stays paused: /resume failed ({r}); "
                           f"`weight-transfer vllm-recover --url {self.base_url}` resumes it")
            return
        e.add_note(f"the vLLM server at {self.base_url} stays paused, its weights no complete version (label "
                   f"incomplete:{self.version}): the next sync rewrites every byte and resumes it; to serve the mixed "
                   f"weights anyway POST {self.base_url}/resume; to release the server for another run "
                   f"`weight-transfer vllm-recover --url {self.base_url} --force` (docs/VLLM.md)")

    def _setup(self) -> None:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, WeightTransferTrainerFactory

        rank, world = self.rank, self.world_size
        info = OneSidedTrainerInitInfo(rank=rank, world_size=world, **self._init_kw)
        client = HTTPVLLMWeightSyncClient(self.base_url, timeout=self.http_timeout) if rank == 0 else None
        self.trainer = WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                                 source=DTensorSource(self.params))

    def destroy(self) -> None:
        """Release the transfer (TRL calls it at train end on the main process;
        :class:`OneSidedAsyncGRPOTrainer` on every rank): rank 0 first asks the server to release
        its registration (``shutdown_weight_transfer_engine``, so another trainer can set up
        against the same server), then every rank closes its sender (rank 0: and ends the
        control plane). Idempotent; a server that does not answer is not an error here."""
        tr, self.trainer = self.trainer, None
        if tr is None:
            return
        if tr.is_sender:
            try:
                tr.client.shutdown_weight_transfer_engine()
            except Exception as e:  # an update session left open (a failed sync), or the server is gone
                from weight_transfer.engines.vllm.backend.recover import recover_http

                try:  # this run's own registration: released whatever state it is in (C32)
                    recover_http(self.base_url, stale_only=False, timeout=self.http_timeout)
                except Exception as e2:
                    print(f"[rank 0] OneSidedWeightTransfer.destroy: the server at {self.base_url} did not release "
                          f"this run's registration: {type(e).__name__}: {e}; recovery: {e2}", flush=True)
        tr.shutdown()


def recover(base_url: str, *, force: bool = False, timeout: float = 120.0) -> dict:
    """Return the vLLM server at ``base_url`` to a fresh server's state after a training run
    that did not end cleanly (a killed trainer, C32): every worker's ``one_sided`` state
    released (registration, shadows, staging, landing region, an update session left open),
    vLLM's label ``incomplete:v`` when an interrupted update had begun writing live bytes,
    generation resumed. Without ``force`` a run whose store still answers is kept (named in
    ``kept``). The next trainer's first sync does the same by itself; this is the step by hand
    (``weight-transfer vllm-recover --url URL``). Returns the server's answer
    (:func:`weight_transfer.engines.vllm.backend.recover.engine_core_recover`);
    :class:`~weight_transfer.engines.vllm.backend.recover.ServerError` when it refuses or does not answer."""
    from weight_transfer.engines.vllm.backend.recover import recover_http

    return recover_http(base_url, stale_only=not force, timeout=timeout)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view the same memory the same way (a parameter and its ``detach()``)."""
    from torch.distributed.tensor import DTensor

    if isinstance(a, DTensor) or isinstance(b, DTensor):
        return a is b
    return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


class OneSidedAsyncGRPOTrainer(AsyncGRPOTrainer):
    """TRL 1.16's ``AsyncGRPOTrainer`` whose weight sync runs on **every** training rank
    (module docstring): each rank writes its own FSDP2 shards through ``weight_transfer`` (an
    :class:`OneSidedWeightTransfer`, required), none streams the model (``_streaming_iter`` is
    not called) and none gathers beyond the plan's ``full_tensor()``. Everything else is TRL's:
    rollouts, loss, logging, the sync's metrics (``perf/weight_sync_*``) and its place in the
    loop (train begin, then every ``weight_sync_steps``). One rank: the same as TRL's trainer.

    TypeError when ``weight_transfer`` is not an :class:`OneSidedWeightTransfer`."""

    def __init__(self, *args, weight_transfer: OneSidedWeightTransfer, **kwargs) -> None:
        if not isinstance(weight_transfer, OneSidedWeightTransfer):
            raise TypeError(f"OneSidedAsyncGRPOTrainer: weight_transfer must be an OneSidedWeightTransfer, not "
                            f"{type(weight_transfer).__name__}")
        weight_transfer._all_ranks = True
        super().__init__(*args, weight_transfer=weight_transfer, **kwargs)
        weight_transfer.use_trl_args(self.args)  # TRL's vllm_server_timeout / request_timeout unless given
        self.weight_transfer = weight_transfer  # TRL keeps it on the main process only; every rank pushes

    def _sync_weight_merged(self, t0: float) -> tuple[float, float, float]:
        """TRL's sync (pause on the main process, barrier, transfer, barrier, resume, version
        bump) with the transfer replaced: every rank binds its (wrapped) module at the first
        sync and calls :meth:`OneSidedWeightTransfer.push` with rank 0's ``model_version + 1``
        (broadcast: TRL restores ``model_version`` on the main process only when resuming)."""
        from weight_transfer.control.collectives import broadcast_data

        wt, acc = self.weight_transfer, self.accelerator
        model = acc.unwrap_model(self.model)
        if acc.is_main_process:
            wt.pause()
        t_pause = time.time()
        acc.wait_for_everyone()
        t_barrier = time.time()
        if wt.params is None:
            wt.bind(model)
        version = self.model_version + 1
        if acc.num_processes > 1:
            version = broadcast_data(version, 0, type_=int)  # data, not accelerate's pickle
        wt.push(version)
        t_transfer = time.time()
        acc.wait_for_everyone()
        self.model_version = version  # on every rank (TRL bumps the main process's only)
        if acc.is_main_process:
            wt.resume()
            if self.rollout_worker:
                self.rollout_worker.update_model_version(self.model_version)
        return t_pause, t_barrier, t_transfer

    def _inner_training_loop(self, *args, **kwargs):
        """TRL's loop; at its end every rank releases the transfer (TRL's ``destroy`` runs on the
        main process only)."""
        try:
            return super()._inner_training_loop(*args, **kwargs)
        finally:
            if not self.accelerator.is_main_process:
                self.weight_transfer.destroy()
