"""The public API: the reference inside your own trainer and your own inference engine.

Three objects, one per role; each talks to the others only through a ``torch.distributed``
``TCPStore`` (the control plane, :mod:`weight_transfer.control`) and one-sided writes (the data
plane, :mod:`weight_transfer.transport`)::

    # the store: one master, anywhere every process can reach (here: the launching process)
    store = weight_transfer.serve_store("0.0.0.0", 0)          # store.port: the port picked

    # every inference rank: register its tensors once; nothing runs here per update
    rx = weight_transfer.Receiver(engine_tensors, rank=i, store=(host, port))
    state, weights = rx.read_consistent(lambda: copy_or_forward())   # never a mixed version

    # every training rank, after its FSDP2 module exists
    coord = weight_transfer.Coordinator((host, port), n_train=2, n_infer=2, model_config=cfg,
                                        layout=InferenceLayout(tp=2)) if rank == 0 else None
    tx = weight_transfer.Sender(model, rank=rank, world_size=2, store=(host, port), coordinator=coord)
    for step in ...:
        loss.backward(); optimizer.step()
        stats = tx.push(version=step)         # every rank; returns when version ``step`` is published

- :class:`Sender`: one per training rank, built once from an FSDP2 module or a
  ``{checkpoint name: DTensor}`` mapping (plain tensors with ``world_size == 1``). It publishes
  its parameters' metadata (global shape, dtype, DeviceMesh, placements, its shard's box: no
  byte moves), receives its part of the static schedule once, and on every :meth:`Sender.push`
  replays it through the pipelined executor (``full_tensor()`` only where a recipe needs rows
  of other ranks, fusion, cast -- an fp32 master with bf16 served weights is a planned cast --
  and FP8 block quantization, one-sided writes).
- :class:`Coordinator`: plans once against the receivers' registered layouts (and a live
  engine's runtime layout, when one was published), then per update publishes ``writing v``,
  says "go", waits until every write of every rank completed (and every engine commit), and
  only then publishes ``complete v``; any failure publishes ``incomplete v`` and names role,
  rank and cause. It lives in training rank 0 (pass it to that rank's :class:`Sender`) or in a
  process of its own (:meth:`Coordinator.serve`).
- :class:`Receiver`: one per inference rank, for any engine's named tensors: registers their
  memory once (one region spanning them), publishes the region descriptor and the tensors'
  metadata (inference-side names), and offers the version state and seqlock reads
  (:meth:`Receiver.read_consistent`).

The harness (``weight_transfer.experiments``) is one user of these objects, the vLLM
weight-transfer backend (``weight_transfer.engines.vllm.backend``) another, and
``examples/train_and_push.py`` a third.

Errors: bad arguments raise ``ValueError``/``TypeError`` naming the argument before any byte
moves; a plan the receivers cannot take raises :class:`weight_transfer.plan.PlanError` naming the
tensor; a failed, dead or stalled rank raises :class:`weight_transfer.control.ControlError`
naming role, rank and cause, within the control timeout; a version that does not increase
raises :class:`weight_transfer.control.VersionError`.
"""
from __future__ import annotations

import os
import pickle
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from . import control, membership
from .options import TransferOptions
from .store import connect_store, runtime_layouts, serve_store
from .types import InferenceLayout, Schedule

__all__ = ["Sender", "Receiver", "Coordinator", "UpdateResult", "serve_store", "connect_store", "plan_against",
           "PUSH_KEY", "WORLD_KEY", "ENGINE_KEY", "COORDINATOR_KEY", "TRAIN_PROC_KEY",
           "PLAN_ERROR_KEY"]

PUSH_KEY = "push/{n}/{what}"
"""The keys of the ``n``-th push (from 0; every training rank counts its own pushes, a
collective call), values pickled: ``ready/{r}`` (training rank ``r``: ``{"version", "refuse"}``,
``refuse`` a refusal of its own as ``(type name, message)``), ``decision`` (the coordinator:
``{"go", "version", "error"}``, one decision for every rank), ``outcome`` (``{"ok", "error"}``,
set once with ``compare_set``: by the coordinator, or by a training rank that gave up waiting --
whichever comes first holds, so every rank returns or raises alike)."""
COORDINATOR_KEY = "meta/coordinator"
"""``{"host", "pid"}`` of the coordinator's process (published when it plans)."""
TRAIN_PROC_KEY = "meta/train_proc/{rank}"
"""``{"host", "pid"}`` of a training rank's process (published at its first push)."""
PLAN_ERROR_KEY = "plan/error"
"""``(type name, message)`` of a refused plan: every training rank raises it alike."""
WHERE_KEY = "step/{version}/where/{rank}"
"""``{"prepare": (task, seconds) | None, "collective": (task, seconds) | None, "time": wall
seconds}`` (pickled): what training rank ``rank``'s update to ``version`` was doing, republished
every 0.25 s while it runs (:meth:`weight_transfer.executor.Executor.activity`); the coordinator
names a rank that holds the others up from it when the update times out."""
REFUSALS = ("ValueError", "TypeError", "PlanError", "VersionError", "ControlError")
"""The documented error types, handed between ranks as themselves (anything else arrives as ControlError)."""


def _first_line(s: str) -> str:
    return s.splitlines()[0] if s else ""


def _shared(e: BaseException) -> BaseException:
    """Mark ``e`` as an error every training rank raises alike (a refusal or a failed update)."""
    e._wt_shared = True  # type: ignore[attr-defined]
    return e


def _claim_outcome(store, n: int, outcome: dict) -> dict:
    """Set push ``n``'s outcome to ``outcome`` unless one is set; return the one that holds."""
    want = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    return pickle.loads(store.compare_set(PUSH_KEY.format(n=n, what="outcome"), "", want))
WORLD_KEY = "meta/world"
"""The coordinator publishes ``{"n_train", "n_infer"}`` here (pickled) when it starts: how many
training ranks report each update (an engine that commits checks every one of them itself)."""
ENGINE_KEY = "meta/engine"
"""An inference side that knows the model may publish ``{"hf_config": dict, "layout":
InferenceLayout, "name": str}`` here (the vLLM backend does); a :class:`Coordinator` built
without ``model_config`` / ``layout`` reads them from it."""


def _named_params(params) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` from an ``nn.Module`` (``named_parameters()``: checkpoint names; a
    tied weight once, under its first name) or a mapping. TypeError for anything else."""
    if isinstance(params, torch.nn.Module):
        out = dict(params.named_parameters())
    elif isinstance(params, Mapping):
        out = dict(params)
    else:
        raise TypeError(f"params: an nn.Module or a mapping name -> DTensor/tensor, not {type(params).__name__}")
    if not out:
        raise ValueError("params: no parameters")
    bad = [n for n, t in out.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"params: {bad[:3]} are not tensors")
    return out


# --------------------------------------------------------------------------------------------
# the coordinator


@dataclass(kw_only=True)
class UpdateResult:
    """One completed update, as the coordinator saw it. Bytes are bytes, seconds wall seconds."""

    version: int
    """The version now published complete."""
    seconds: float
    """From "go" to the last write completion or engine commit (the update's transfer time)."""
    write_seconds: float
    """From "go" to the last training rank's completion."""
    bytes: int
    """Bytes that landed in inference memory (sum over training ranks)."""
    n_writes: int
    """One-sided writes posted (sum over training ranks)."""
    stats: dict[int, Any] = field(default_factory=dict)
    """Training rank -> its :class:`weight_transfer.method.UpdateStats`."""
    commits: dict = field(default_factory=dict)
    """Engine commits: ``("commit", i)`` -> inference rank ``i``'s report, ``("commit", "call")``
    -> what a commit callable returned."""

    @property
    def gbps(self) -> float:
        """Algorithm bandwidth of the update: ``bytes / seconds / 1e9`` (GB/s)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


class Coordinator:
    """Plans once, then drives every update and publishes the weight versions.

    ``store``: the control-plane store (see :func:`connect_store`); ``n_train`` / ``n_infer``:
    training and inference ranks (each publishes its metadata once); ``model_config``: the
    model (:class:`weight_transfer.model_config.ModelConfig`, a Hugging Face ``config.json`` path
    or its dict); ``layout``: the inference side's parallelism and quantization
    (:class:`weight_transfer.types.InferenceLayout`). Without them both come from an inference side
    that published :data:`ENGINE_KEY` (the vLLM backend). ``options``: the transfer's
    (:class:`weight_transfer.options.TransferOptions`); ``timeout``: seconds any rank may take to
    answer (default ``options.control.timeout``); ``liveness_train`` / ``liveness_infer``:
    callables returning ``{rank: reason}`` for ranks known dead (a launcher's view; optional);
    ``stall``: heartbeat deadline in seconds (None: no heartbeat monitor).

    Raises ValueError for non-positive world sizes."""

    def __init__(self, store, *, n_train: int, n_infer: int, model_config=None, layout: InferenceLayout | None = None,
                 options: TransferOptions | None = None, timeout: float | None = None,
                 liveness_train: Callable[[], dict] | None = None, liveness_infer: Callable[[], dict] | None = None,
                 stall: float | None = None, log: Callable[[str], None] | None = None):
        if n_train < 1 or n_infer < 1:
            raise ValueError(f"Coordinator: n_train={n_train}, n_infer={n_infer}: both >= 1")
        self.options = options if options is not None else TransferOptions()
        self.timeout = self.options.control.timeout if timeout is None else timeout
        self.store = connect_store(store, timeout=max(self.timeout, 600.0))
        self.n_train, self.n_infer = n_train, n_infer
        self.model_config = _model_config(model_config) if model_config is not None else None
        self.layout = layout
        self.log = log or (lambda m: None)
        self.ctl = control.Controller(self.store, n_train, n_infer, timeout=self.timeout, liveness_train=liveness_train,
                                      liveness_infer=liveness_infer, stall=stall)
        control.put(self.store, WORLD_KEY, {"n_train": n_train, "n_infer": n_infer})
        self.schedule: Schedule | None = None
        self.commit_ranks: tuple[int, ...] = ()
        """Inference ranks whose engine commits each update (staged targets)."""
        self.bytes_staged = 0
        """Bytes per update into staged targets (post-processed by the engine at commit)."""
        self.plan_seconds: float | None = None
        self.members: set[int] = set(range(n_infer))
        """Inference ranks in the current plan (C24: engines may join and leave between updates)."""
        self.epoch = 0
        """The plan's epoch: 0 the first plan, +1 at each membership change."""
        self.replans: list[dict] = []
        """One entry per membership change: ``{"version", "epoch", "members", "gone", "joined", "seconds"}``."""
        self.liveness_infer = liveness_infer
        self._served = 0
        self._joins_seen = 0
        self._train_metas: dict = {}
        self._payloads: dict = {}
        self._plan_error: tuple[str, str] | None = None
        self._procs: dict = {}
        self._last_go = -1
        self.failures: list[tuple[int, BaseException]] = []
        """:meth:`serve`: ``(push index, error)`` of each push that was refused or failed."""

    def plan(self) -> Schedule:
        """Once: wait for every rank's metadata, build the recipes (aimed at a live engine's
        runtime layout where one was published), compute the static schedule and hand each
        training rank its part. Returns the :class:`weight_transfer.types.Schedule`. Raises
        PlanError naming what cannot be planned, ValueError when neither ``model_config`` /
        ``layout`` nor an engine's :data:`ENGINE_KEY` says what to plan, ControlError when a
        rank does not publish within the timeout. A refusal is published under
        :data:`PLAN_ERROR_KEY`: every training rank waiting for its part raises the same type
        and message, and the job ends (the store's ``abort``); a later call raises it again."""
        if self.schedule is not None:
            return self.schedule
        if self._plan_error is not None:
            raise _shared(control.decode_error(*self._plan_error))
        control.put(self.store, COORDINATOR_KEY, {"host": socket.gethostname(), "pid": os.getpid()})
        if self.ctl.live_t is None:  # training ranks of this host whose process is gone are named at once
            self.ctl.live_t = self._training_gone
        t0 = time.perf_counter()
        try:
            train_metas, infer_payloads = self.ctl.collect()
            if self.model_config is None or self.layout is None:
                if not self.store.check([ENGINE_KEY]):
                    raise ValueError("Coordinator: no model_config/layout given and no inference side published "
                                     f"{ENGINE_KEY!r}")
                eng = control.get(self.store, ENGINE_KEY)
                self.model_config = self.model_config or _model_config(eng["hf_config"], name=eng.get("name"))
                self.layout = self.layout or eng["layout"]
            _, self._joins_seen = membership.new_joins(self.store, 0)  # the initial ranks' announcements
            self.schedule, extra = plan_against(self.store, self.model_config, self.layout, train_metas,
                                                infer_payloads, self.options)
            self._train_metas, self._payloads = train_metas, dict(infer_payloads)
            for i in infer_payloads:
                membership.set_member(self.store, i, 0)
        except BaseException as e:
            kind, msg = control.encode_error(e)
            if kind not in REFUSALS:
                kind, msg = "ControlError", f"coordinator: plan failed: {kind}: {msg}"
            self._plan_error = (kind, msg)
            control.put(self.store, PLAN_ERROR_KEY, (kind, msg))
            self.ctl.shutdown(reason=f"coordinator: plan failed: {kind}: {_first_line(msg)}")
            if kind == type(e).__name__:
                _shared(e)
                raise
            raise _shared(control.ControlError(msg)) from e
        self.commit_ranks, self.bytes_staged = extra["commit_ranks"], extra["bytes_staged"]
        self.plan_seconds = time.perf_counter() - t0
        self.log(f"plan: {self.schedule.summary()} ({self.plan_seconds:.2f} s)")
        return self.schedule

    def _training_gone(self) -> dict[int, str]:
        """``{training rank: reason}`` for ranks whose process (published under
        :data:`TRAIN_PROC_KEY` at their first push) is on this host and gone."""
        out = {}
        for r in range(self.n_train):
            proc = self._procs.get(r)
            if proc is None:
                key = TRAIN_PROC_KEY.format(rank=r)
                if not self.store.check([key]):
                    continue
                proc = self._procs[r] = SimpleNamespace(**control.get(self.store, key))
            if membership.process_gone(proc):
                out[r] = f"process {proc.pid} on {proc.host} is gone (killed or exited)"
        return out

    def update(self, version: int, *, commit: Callable[[int], object] | None = None,
               before_go: Callable[[int], None] | None = None) -> UpdateResult:
        """Drive the next update, the one every training rank asks for with ``push(version)``
        (the coordinator of a process of its own: :meth:`serve` calls it for each push; in a
        training rank, :meth:`Sender.push` does): wait until every training rank is ready,
        take one decision for all of them (go, or a refusal every rank raises alike: the
        ranks asked for different versions, ``version`` does not increase, a rank refused its
        own arguments), run ``before_go(version)`` if given (e.g. pause the engines), publish
        ``writing version``, "go", wait for every write, the engines' commits (staged targets,
        through the store) or, if given, ``commit(version)`` instead (a caller that commits the
        engines itself, e.g. through vLLM's ``update_weights``; bounded by the timeout), then
        publish ``complete version`` and the update's outcome every rank returns or raises
        with. Raises ControlError naming the failure (the weights are then published
        ``incomplete``; the original error as ``__cause__``), VersionError if ``version`` does
        not increase, ValueError / TypeError when the ranks' arguments were refused."""
        n = self._served
        self._served += 1
        return self._drive(n, version=version, commit=commit, before_go=before_go)

    def _drive(self, n: int, *, version: int | None = None, commit: Callable[[int], object] | None = None,
               before_go: Callable[[int], None] | None = None) -> UpdateResult:
        """Push ``n`` (the n-th push of every training rank, from 0): the decision, then the update."""
        decided = False
        try:
            self.plan()
            ready = self._wait_ready(n)
            v, refusal = self._decide(n, ready, version)
            if refusal is not None:
                self._put(n, "decision", {"go": False, "version": v, "error": control.encode_error(refusal)})
                decided = True
                raise refusal
            self._put(n, "decision", {"go": True, "version": v, "error": None})
            decided = True
        except BaseException as e:
            if not decided:  # the ranks waiting for the decision get the same error
                kind, msg = control.encode_error(e)
                if kind not in REFUSALS:
                    kind, msg = "ControlError", f"coordinator: {kind}: {msg}"
                self._put(n, "decision", {"go": False, "version": version, "error": (kind, msg)})
            raise
        return self._update(n, v, commit=commit, before_go=before_go)

    def _wait_ready(self, n: int) -> dict[int, dict]:
        """Every training rank's readiness for push ``n`` (``{rank: {"version", "refuse"}}``);
        ControlError naming the ranks that did not answer within the timeout, or died."""
        keys = {r: PUSH_KEY.format(n=n, what=f"ready/{r}") for r in range(self.n_train)}
        control.wait_keys(self.store, keys, timeout=self.timeout, what=f"push {n}: training ranks ready",
                          liveness=self.ctl.live_t, failure=self.ctl._failure())
        return {r: control.get(self.store, k) for r, k in keys.items()}

    def _decide(self, n: int, ready: dict[int, dict], version: int | None):
        """``(version, refusal or None)`` for push ``n``: one decision for every rank."""
        for r, p in sorted(ready.items()):
            if p.get("refuse"):
                kind, msg = p["refuse"]
                return p.get("version"), _shared(control.decode_error(kind, msg if msg.startswith("training")
                                                                      else f"training {r}: {msg}"))
        asked = {r: p["version"] for r, p in ready.items()}
        if len(set(asked.values())) > 1:
            return None, _shared(ValueError(f"push {n}: the training ranks asked for different versions {asked}; "
                                            "every rank pushes the same version"))
        v = next(iter(asked.values()))
        if version is not None and v != version:
            return v, _shared(ValueError(f"Coordinator.update(version={version}): the training ranks pushed "
                                         f"version {v}"))
        cur = self.ctl.state()
        if v <= cur.version:
            return v, _shared(control.VersionError(f"version {v} refused: the weights are {cur}; versions only "
                                                   "increase"))
        if v <= self._last_go:
            return v, _shared(control.VersionError(f"version {v} refused: version {self._last_go} was already "
                                                   "pushed (it failed before its writes); versions only increase"))
        return v, None

    def _put(self, n: int, what: str, obj) -> None:
        control.put(self.store, PUSH_KEY.format(n=n, what=what), obj)

    def _claim(self, n: int, ok: bool, error: tuple[str, str] | None = None) -> dict:
        """Set push ``n``'s outcome unless a training rank claimed it first (one that gave up
        waiting claims a failure: every rank must reach the same decision). Returns the
        outcome that holds."""
        return _claim_outcome(self.store, n, {"ok": ok, "error": error})

    def _update(self, n: int, version: int, *, commit, before_go) -> UpdateResult:
        self._last_go = version
        try:
            self._follow_membership(version)
            if before_go is not None:
                try:
                    before_go(version)
                except Exception as e:
                    raise control.ControlError(f"coordinator: before go of version {version}: {type(e).__name__}: "
                                               f"{_first_line(str(e))}") from e
            # a commit callable replaces the store-driven commits of staged engines (it commits them itself)
            commit_ranks = () if commit is not None else self.commit_ranks

            def claim() -> str | None:
                out = self._claim(n, True)
                return None if out["ok"] else out["error"][1]
            try:
                seconds, results = self.ctl.transfer(version, commit_ranks=commit_ranks, commit=commit, claim=claim)
            except control.ControlError as e:
                msg = str(e)
                if "no answer within" in msg:  # which rank holds the others up, as they said
                    msg += self._who_holds(version)
                gone = self._gone()
                if gone:  # name the engines whose loss failed the update (C15); the next update plans without them
                    msg += (f"; inference rank(s) {sorted(gone)} gone (process no longer runs, left or stalled): "
                            "planned without them from the next update")
                if msg == str(e):
                    raise
                raise control.ControlError(msg) from e
        except BaseException as e:
            msg = str(e) if isinstance(e, control.ControlError) else f"coordinator: {type(e).__name__}: {e}"
            out = self._claim(n, False, ("ControlError", msg))
            if out["ok"]:  # cannot happen: ok is claimed only once every write completed
                raise
            if isinstance(e, control.ControlError) and out["error"][1] == msg:
                raise
            raise control.ControlError(out["error"][1]) from e
        stats = {r: res["stats"] for r, res in results.items() if not isinstance(r, tuple)}
        commits = {r: res.get("stats") for r, res in results.items() if isinstance(r, tuple) and r[0] == "commit"}
        return UpdateResult(version=version, seconds=seconds, write_seconds=self.ctl.last_write_seconds or seconds,
                            bytes=sum(s.bytes_sent for s in stats.values()),
                            n_writes=sum(s.n_writes for s in stats.values()), stats=stats, commits=commits)

    def _who_holds(self, version: int) -> str:
        """"; training r: ..." for each training rank that did not complete ``version``, from
        what it last said it was doing (:data:`WHERE_KEY`): a rank in a ``full_tensor()``
        waits for its peers; one outside any collective, or silent (stopped), holds them up."""
        parts = []
        now = time.time()
        for r in range(self.n_train):
            if self.store.check([f"step/{version}/done/{r}"]):
                continue
            key = WHERE_KEY.format(version=version, rank=r)
            if not self.store.check([key]):
                parts.append(f"training {r}: said nothing since go (stopped or stalled)")
                continue
            a = control.get(self.store, key)
            age = now - a["time"]
            if age > 2.0:
                parts.append(f"training {r}: silent for {age:.1f} s (its process stopped or stalled)")
            elif a.get("collective"):
                parts.append(f"training {r}: in full_tensor() of task {a['collective'][0]} for "
                             f"{a['collective'][1]:.1f} s (waiting for its peers)")
            elif a.get("prepare"):
                parts.append(f"training {r}: stalled in prepare of task {a['prepare'][0]} for {a['prepare'][1]:.1f} s, "
                             "outside any collective (holding the others up)")
            else:
                parts.append(f"training {r}: writing")
        return "".join(f"; {p}" for p in parts)

    def _gone(self) -> set[int]:
        """Members that left, died or stalled (:mod:`weight_transfer.membership`), each with
        every rank of its TP group (an engine instance of ``layout.tp`` ranks is one unit: a
        tensor-parallel engine whose rank died serves nothing, C28)."""
        gone = membership.left(self.store, self.members)
        gone |= {i for i in self.members if membership.process_gone(self._payloads[i][0])}
        if self.liveness_infer is not None:
            gone |= {i for i in self.liveness_infer() if i in self.members}
        if self.ctl.monitor is not None:
            gone |= {k[1] for k in self.ctl.monitor.stalled() if isinstance(k, tuple) and k[1] in self.members}
        tp = max(1, getattr(self.layout, "tp", 1) or 1)
        return {r for g in gone for r in range(g // tp * tp, g // tp * tp + tp) if r in self.members}

    def _follow_membership(self, version: int) -> None:
        """Before the "go" of ``version``: drop members that are gone, take ranks that joined
        (a newcomer, or a member that re-registered: fresh memory), and when the membership
        changed recompute the plan for it (a new epoch the senders follow before they write)
        and mark each newcomer a member from ``version`` on. ControlError when no inference
        rank is left."""
        gone = self._gone()
        joins, self._joins_seen = membership.new_joins(self.store, self._joins_seen)
        added = {}
        for r in dict.fromkeys(joins):
            payload = control.get(self.store, f"meta/infer/{r}")
            if r in self.members and r not in gone and payload[0] == self._payloads[r][0]:
                continue  # the registration already planned against
            if membership.process_gone(payload[0]) or self.store.check([f"infer/leave/{r}"]):
                continue
            added[r] = payload
        if not gone and not added:
            return
        t0 = time.perf_counter()
        ch = membership.change_members(
            self.store, self.ctl, members=self.members, payloads=self._payloads, gone=gone, added=added,
            plan=lambda payloads, epoch: plan_against(self.store, self.model_config, self.layout, self._train_metas,
                                                      payloads, self.options, epoch=epoch),
            epoch=self.epoch, version=version, where=f"version {version}")
        self.epoch, self.schedule, self.members, self._payloads = ch.epoch, ch.schedule, ch.members, ch.payloads
        self.commit_ranks, self.bytes_staged = ch.extra["commit_ranks"], ch.extra["bytes_staged"]
        rec = {"version": version, "epoch": self.epoch, "members": sorted(ch.members), "gone": sorted(ch.dropped),
               "joined": sorted(added), "seconds": time.perf_counter() - t0}
        self.replans.append(rec)
        self.log(f"membership before version {version}: {rec['members']} (gone {rec['gone']}, joined {rec['joined']}); "
                 f"replanned in {rec['seconds']:.3f} s: {ch.schedule.summary()}")

    def serve(self, *, count: int | None = None, commit: Callable[[int], object] | None = None) -> list[UpdateResult]:
        """The coordinator in a process of its own: plan, then drive each push of the training
        ranks (:meth:`update`) until ``count`` pushes were served or the store says shutdown.
        A push that is refused or fails raises on every training rank and is kept in
        :attr:`failures` (``(push index, exception)``); serving goes on with the next one.
        Returns the results of the updates that completed; raises what :meth:`plan` raises."""
        self.plan()
        out: list[UpdateResult] = []
        served = 0
        while count is None or served < count:
            n = self._served
            keys = [PUSH_KEY.format(n=n, what=f"ready/{r}") for r in range(self.n_train)]
            for _ in control.backoff(None, 0.01):  # the first rank's readiness: the push has begun
                if any(self.store.check([k]) for k in keys):
                    break
                if self.store.check(["shutdown"]):
                    return out
            self._served += 1
            served += 1
            try:
                out.append(self._drive(n, commit=commit))
            except (control.ControlError, ValueError, TypeError) as e:
                self.failures.append((n, e))
                self.log(f"push {n}: {type(e).__name__}: {_first_line(str(e))}")
        return out

    def state(self) -> control.WeightsState:
        """The published :class:`weight_transfer.control.WeightsState`."""
        return self.ctl.state()

    def shutdown(self, reason: str | None = None) -> None:
        """Tell every rank the job ends (``reason``: an abort reason every waiter raises with)."""
        self.ctl.shutdown(reason)


def _model_config(mc, *, name: str | None = None):
    from .model_config import ModelConfig

    if isinstance(mc, ModelConfig):
        return mc
    if isinstance(mc, Mapping):
        return ModelConfig(name=name or str(mc.get("_name_or_path") or mc.get("model_type") or "model"), hf=dict(mc))
    return ModelConfig.from_file(mc)


def plan_against(store, model_config, layout: InferenceLayout, train_metas: dict, infer_payloads: dict,
                 options: TransferOptions, *, epoch: int = 0) -> tuple[Schedule, dict]:
    """The coordinator's planning step on its own (the harness's controller calls it): recipes
    for ``model_config`` on ``layout`` (fp32 sources to bf16 destinations are a cast), aimed at
    the runtime layouts inference ranks published under
    :data:`weight_transfer.store.RUNTIME_KEY` (refused, named, where a runtime tensor cannot be
    written), the static schedule, and each training rank's part published under ``plan/{r}``.
    Returns ``(schedule, {"commit_ranks", "bytes_staged"})``. ``epoch``: the plan's epoch
    (0 the first plan, ``plan/{r}``; later ones after a membership change,
    :func:`weight_transfer.membership.plan_key`)."""
    from .plan import build_recipes, gc_paused, plan

    sources = {m.name: m.dtype for ms in train_metas.values() for m in ms}
    with gc_paused():
        recipes = build_recipes(model_config, layout, source_dtypes=sources)
        recipes = only_ranks(recipes, set(infer_payloads))
        runtime = runtime_layouts(store, infer_payloads)
        if runtime:  # a live engine reported what it computes with: aim there, or refuse (C20)
            from .retarget import retarget

            recipes = retarget(recipes, runtime)
        sched = plan(recipes, train_metas, {i: metas for i, (_, metas) in infer_payloads.items()},
                     max_chunk_bytes=options.plan.max_chunk_bytes, local_writes=options.plan.local_writes,
                     local_min_bytes=options.plan.local_min_bytes, parallel_checks=None)
    descriptors = {i: desc for i, (desc, _) in infer_payloads.items()}
    for r, rp in sched.rank_plans.items():
        control.put(store, membership.plan_key(epoch, r), (rp, descriptors))
    extra = {"commit_ranks": tuple(sorted(i for i, lay in runtime.items() if getattr(lay, "needs_commit", False))),
             "bytes_staged": sum(getattr(lay, "staged_bytes", 0) for lay in runtime.values())}
    return sched, extra


def only_ranks(recipes, ranks: set[int]):
    """``recipes`` (a :class:`weight_transfer.plan.RecipeSet`) writing only to inference ``ranks``:
    the fleet's current members when it is smaller than the layout (engines that left, replicas
    not started yet, C24). The same set when every rank of the layout is a member."""
    from .plan import RecipeSet
    from .types import new_recipe

    if all(k in ranks for r in recipes for k in r.ranks):
        return recipes
    kept = [new_recipe(r.name, tuple(k for k in r.ranks if k in ranks), r.shape, r.assembled_dtype, r.pieces,
                       r.transform, r.outputs) for r in recipes if any(k in ranks for k in r.ranks)]
    return RecipeSet(kept, recipes.ignored, layout=recipes.layout, model=recipes.model)


# --------------------------------------------------------------------------------------------
# the training side


class Sender:
    """One training rank's side: publish metadata once, take its part of the schedule once,
    write one-sidedly on every :meth:`push`.

    ``params``: an FSDP2 module (``named_parameters()``: checkpoint names, DTensors) or a mapping
    ``{checkpoint name: DTensor}``; plain tensors only with ``world_size == 1`` (this rank holds
    them whole). The bytes sent are those the parameters hold at :meth:`push` (after
    ``optimizer.step()``); nothing is copied in between. ``rank`` / ``world_size``: this rank in
    the training world (explicit, as vLLM's ``TrainerInitInfo``: a trainer has several process
    groups). ``store``: see :func:`connect_store`. ``coordinator``: on the rank that hosts it (rank
    0), the :class:`Coordinator`; :meth:`push` then also drives the update and returns its
    :class:`UpdateResult` in ``last_update``. ``options``: :class:`TransferOptions` (the
    coordinator's should be the same). ``group_barrier``: the barrier between mesh groups
    (default ``torch.distributed.barrier`` when a default process group exists and more than one
    rank trains). ``offloaded``: the shards live in host memory
    (:class:`weight_transfer.metadata.OffloadedParams`). ``publish``: publish the metadata now
    (False when the caller already did).

    Raises TypeError / ValueError for bad ``params`` or ranks, before anything is published."""

    def __init__(self, params, *, rank: int, world_size: int, store, coordinator: Coordinator | None = None,
                 options: TransferOptions | None = None, group_barrier: Callable[[], None] | None = None,
                 timeout: float | None = None, log: Callable[[str], None] | None = None, publish: bool = True):
        from torch.distributed.tensor import DTensor

        from .metadata import collect_metas, whole_metas

        if not (0 <= rank < world_size):
            raise ValueError(f"Sender: rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        self.params = params if isinstance(params, Mapping) and hasattr(params, "host") else _named_params(params)
        self.rank, self.world_size = rank, world_size
        self.options = options if options is not None else TransferOptions()
        self.timeout = self.options.control.timeout if timeout is None else timeout
        self.coordinator = coordinator
        self.log = log or (lambda m: None)
        dts = [isinstance(t, DTensor) for t in self.params.values()]
        if all(dts):
            metas = collect_metas(self.params, offloaded=self.options.executor.offload)
        elif not any(dts) and world_size == 1:
            metas = whole_metas(self.params, rank)
        else:
            raise TypeError("Sender: params must all be DTensors (an FSDP2 module), or all plain tensors with "
                            f"world_size == 1 (got world_size={world_size}, {sum(dts)} of {len(dts)} DTensors)")
        if group_barrier is None and world_size > 1 and dist.is_initialized():
            group_barrier = dist.barrier
        self.group_barrier = group_barrier
        self.store = connect_store(store, timeout=max(self.timeout, 600.0))
        self.client = control.TrainerClient(self.store, rank, timeout=max(self.timeout, 600.0))
        self.metas = metas
        if publish:
            self.client.publish_meta(metas)
        self.executor = self.transport = None
        self.epoch = 0
        """The plan epoch this rank runs (a membership change of the receivers starts a new one)."""
        self.last_update: UpdateResult | None = None
        self._pushes = 0
        self._proc_published = False
        self._running = None  # (thread, version) of a writer left blocked in a collective
        self._coord_proc = None

    def plan(self) -> None:
        """Once (the first :meth:`push` calls it): get this rank's part of the schedule (the
        coordinator plans once every rank published), connect the transport to every
        receiver's region, and build the executor. Raises the coordinator's refusal
        (PlanError, ValueError: the same type and message on every training rank) or
        ControlError when no plan comes within the timeout (or the coordinator's process is
        gone)."""
        if self.executor is not None:
            return
        if not self._proc_published:
            control.put(self.store, TRAIN_PROC_KEY.format(rank=self.rank),
                        {"host": socket.gethostname(), "pid": os.getpid()})
            self._proc_published = True
        if self.coordinator is not None:
            self.coordinator.plan()
        if self.epoch == 0:
            key = membership.plan_key(0, self.rank)
            self._wait_for(lambda: self.store.check([key]), what=f"training {self.rank}: no plan",
                           bound=2 * self.timeout + 5, plan=True)
            rank_plan, descriptors = control.get(self.store, key)
        else:  # reopened after close(): the plan of the epoch this rank follows
            rank_plan, descriptors = control.get(self.store, membership.plan_key(self.epoch, self.rank))
        self._build(rank_plan, descriptors)

    def _build(self, rank_plan, descriptors) -> None:
        """Connect a transport to ``descriptors`` and build the executor of ``rank_plan``."""
        from .executor import Executor
        from .transport import lease, make_transport

        self.transport = make_transport(self.options.transport.name)
        lease.attach(self.transport, self.store)  # receivers' deregister waits for our batch in flight (C17)
        self.transport.connect(list(descriptors.values()))
        self.executor = Executor(rank_plan, self.params, self.transport, descriptors, options=self.options.executor,
                                 group_barrier=self.group_barrier)
        su = getattr(self.executor, "setup_stats", None)
        reg = (f"; registered once: {su.n_regions} region(s), {su.registered_bytes / 1e6:.1f} MB in "
               f"{su.register_seconds * 1e3:.1f} ms ({su.transport})" if su is not None else "")
        self.log(f"plan: {len(rank_plan.tasks)} tasks, {rank_plan.n_writes} writes, "
                 f"{rank_plan.send_bytes / 1e9:.3f} GB to send{reg}")

    def send(self, version: int):
        """Run this rank's writes of the update to ``version`` now, outside the push protocol
        (a caller whose own control loop already said "go", e.g. the harness). Returns this
        rank's :class:`weight_transfer.executor.StepStats`; raises the executor's error."""
        self.plan()
        check_published(self.executor, self.store)  # delta: full after a version not published complete (C26)
        return self.executor.run(version)

    def push(self, version: int, *, commit: Callable[[int], object] | None = None,
             before_go: Callable[[int], None] | None = None):
        """After ``optimizer.step()``, on every training rank: update the inference weights to
        ``version``. Every rank says it is ready, the coordinator takes one decision for all
        of them, every rank writes its part, and every rank returns only once ``complete
        version`` is published (on the coordinator's rank :attr:`last_update` then holds its
        :class:`UpdateResult`). Returns this rank's :class:`weight_transfer.executor.StepStats`.
        A collective call: every training rank calls it, the same number of times, with the
        same version.

        Raises, on every training rank alike (C28):

        - before any byte moves: VersionError when ``version`` does not increase; TypeError
          when a rank's ``version`` is not an int; ValueError when the ranks asked for
          different versions; the coordinator's PlanError at the first push; the message
          names the rank and argument;
        - ControlError when the update failed anywhere -- a training rank's stage (prepare,
          write, release, the barrier between mesh groups), a receiver that died (named; the
          next push plans without its TP group), the engines' commit, a rank that did not
          answer within the timeout or whose process is gone. The message names role, rank and
          cause; the weights are published ``incomplete`` and the next push restores a complete
          version. On the failing rank the stage's exception is the ``__cause__``.

        Every wait is bounded by the timeout. A rank that fails keeps taking part in the rest
        of the update's ``full_tensor()`` collectives and barriers without writing, so the
        other ranks are not left blocked in them. A *killed* or stopped training rank cannot
        take part: the others still raise ControlError within the timeout, but their writer
        thread may stay blocked in a collective of your training world (your Gloo/NCCL group,
        whose own timeout the library does not own); such a rank refuses the next push with
        ControlError while it stays blocked. ``commit`` and ``before_go``: handed to
        :meth:`Coordinator.update` on the coordinator's rank (ignored elsewhere)."""
        n = self._pushes
        self._pushes += 1
        refusal: BaseException | None = None
        if isinstance(version, int) and not isinstance(version, bool):
            version = int(version)
        elif hasattr(version, "__index__") and not isinstance(version, bool):  # a numpy integer
            version = version.__index__()
        else:
            refusal = TypeError(f"training {self.rank}: push(version={version!r}): version is a "
                                f"{type(version).__name__}; an int is required"
                                + (" (from os.environ? convert it with int())" if isinstance(version, str) else ""))
        try:
            self.plan()
        except BaseException as e:
            if getattr(e, "_wt_shared", False) or not isinstance(e, Exception):
                raise  # every rank raises it (a refused plan)
            refusal = refusal or control.ControlError(f"training {self.rank}: setting up the plan failed: "
                                                      f"{type(e).__name__}: {_first_line(str(e))}")
            refusal.__cause__ = e
        if refusal is None and (busy := self._busy()):
            refusal = control.ControlError(busy)
        ready = {"version": version if refusal is None else None,
                 "refuse": control.encode_error(refusal) if refusal is not None else None}
        control.put(self.store, PUSH_KEY.format(n=n, what=f"ready/{self.rank}"), ready)
        box: dict = {}
        thread = None
        if self.coordinator is not None:
            self.coordinator._served = n + 1

            def drive():
                try:
                    box["result"] = self.coordinator._drive(n, commit=commit, before_go=before_go)
                except BaseException as e:  # the outcome every rank reads says it
                    box["error"] = e
            thread = threading.Thread(target=drive, name=f"wt-coordinator-push{n}", daemon=True)
            thread.start()
        try:
            stats = self._push(n, refusal)
        except control.ControlError as e:
            if thread is not None:
                thread.join(self.timeout + 5)
                if e.__cause__ is None and box.get("error") is not None and box["error"] is not e:
                    e.__cause__ = box["error"]  # the coordinator's own account (a failed commit, before_go)
            raise
        finally:
            if thread is not None:
                thread.join(self.timeout + 5)
        self.last_update = box.get("result")
        return stats

    def _push(self, n: int, refusal: BaseException | None):
        decision = self._wait_key(PUSH_KEY.format(n=n, what="decision"), what=f"no decision on push {n}",
                                  bound=2 * self.timeout + 5)
        if not decision["go"]:
            raise _shared(control.decode_error(*decision["error"])) from refusal
        v = decision["version"]
        outcome_key = PUSH_KEY.format(n=n, what="outcome")
        # "go", or the outcome: the update failed before it (membership, before_go)
        self._wait_for(lambda: self.store.check([f"step/{v}/go"]) or self.store.check([outcome_key]),
                       what=f"training {self.rank}: no go for version {v}", bound=2 * self.timeout + 5)
        if not self.store.check([f"step/{v}/go"]):
            out = control.get(self.store, outcome_key)
            raise control.ControlError(out["error"][1])
        t_go = time.monotonic()
        local: BaseException | None = None
        stats = None
        try:
            self._follow_plan()
            check_published(self.executor, self.store)  # delta: full after a version not published complete (C26)
        except Exception as e:
            local = e
        if local is None:
            stats, local, cancelled = self._run_watched(n, v, t_go)
        else:
            cancelled = False
        if local is not None:
            self.client.done(v, ok=False, error=f"{type(local).__name__}: {_first_line(str(local))}",
                             cancelled=cancelled)
        else:
            self.client.done(v, ok=True, stats=stats)
        out = self._wait_outcome(n, v, local)
        if out["ok"]:
            return stats
        raise control.ControlError(out["error"][1]) from local

    def _run_watched(self, n: int, v: int, t_go: float):
        """Run the executor for version ``v`` in a thread while watching the update: a
        failure anywhere (``step/{v}/failed``, the outcome, the abort, a coordinator gone)
        cancels it (no write after that; its collectives go on so the other ranks' complete).
        Returns ``(stats, error, cancelled)``; the executor is left behind, still blocked in a
        collective of the training world, when it has not ended ``grace`` seconds after the
        cancel (the error then says so, and the next push refuses while it runs)."""
        from .executor import UpdateCancelled

        cancel = threading.Event()
        box: dict = {}

        def run():
            try:
                box["stats"] = self.executor.run(v, cancel=cancel)
            except BaseException as e:
                box["error"] = e
        th = threading.Thread(target=run, name=f"wt-train{self.rank}-v{v}", daemon=True)
        th.start()
        grace = min(5.0, self.timeout)
        until = None
        checked = told = 0.0
        for _ in control.backoff(None, 0.005):
            if not th.is_alive():
                break
            now = time.monotonic()
            if now - told >= 0.25:  # what this rank is doing, for the coordinator's account of a timeout
                told = now
                control.put(self.store, WHERE_KEY.format(version=v, rank=self.rank),
                            {**self.executor.activity(), "time": time.time()})
            if until is None and now - checked >= control.FAILURE_CHECK_S:
                checked = now
                why = self._failed_elsewhere(n, v)
                if why is None and now - t_go > self.timeout + grace:  # the coordinator fails it by now
                    why = f"no completion within {self.timeout:.0f} s"
                if why is not None:
                    cancel.set()
                    until = now + grace
            if until is not None and now > until:
                self._running = (th, v)
                return None, control.ControlError(
                    f"training {self.rank}: the writes of version {v} were cancelled but are still blocked after "
                    f"{grace:.0f} s (in a collective of the training world whose peer died or stopped: its own "
                    "timeout applies)"), True
        if "error" in box:
            e = box["error"]
            return None, e, isinstance(e, UpdateCancelled)
        return box["stats"], None, False

    def _failed_elsewhere(self, n: int, v: int) -> str | None:
        """Why update ``v`` (push ``n``) failed elsewhere, as far as the store says; None."""
        if self.store.check([f"step/{v}/failed"]) or self.store.check([PUSH_KEY.format(n=n, what="outcome")]):
            return "failed elsewhere"
        if self.store.check(["abort"]):
            return "aborted"
        return self._coordinator_gone()

    def _wait_outcome(self, n: int, v: int, local: BaseException | None) -> dict:
        """Push ``n``'s outcome (``{"ok", "error"}``), as the coordinator claimed it; when it
        does not come within the timeout (or the coordinator is gone) this rank claims a
        failure itself, so that no rank returns success for an update another rank gave up on."""
        key = PUSH_KEY.format(n=n, what="outcome")
        try:
            return self._wait_key(key, what=f"no outcome of version {v}", bound=self.timeout + 5)
        except control.ControlError as e:
            return _claim_outcome(self.store, n, {"ok": False, "error": ("ControlError", str(e))})

    def _busy(self) -> str | None:
        """Why this rank cannot take part in a new update (its previous writer is still
        blocked in a collective after waiting up to half the timeout for it), or None."""
        if self._running is None:
            return None
        th, v = self._running
        th.join(self.timeout / 2)
        if th.is_alive():
            return (f"training {self.rank}: the writes of version {v} are still blocked in a collective of the "
                    "training world (a peer died or stopped); this rank cannot push until they end")
        self._running = None
        return None

    def _coordinator_gone(self) -> str | None:
        if self._coord_proc is None:
            if not self.store.check([COORDINATOR_KEY]):
                return None
            self._coord_proc = SimpleNamespace(**control.get(self.store, COORDINATOR_KEY))
        if membership.process_gone(self._coord_proc):
            return f"coordinator: process {self._coord_proc.pid} on {self._coord_proc.host} is gone"
        return None

    def _wait_for(self, ready: Callable[[], bool], *, what: str, bound: float, plan: bool = False) -> None:
        """Poll ``ready()`` up to ``bound`` seconds; ControlError naming ``what`` on expiry, the
        store's abort, or a coordinator process gone; the coordinator's plan refusal (its
        type) with ``plan``. A store that stopped answering is a ControlError too."""
        checked = 0.0
        try:
            for expired in control.backoff(bound, 0.002):
                if ready():
                    return
                now = time.monotonic()
                if now - checked < 0.2 and not expired:
                    continue
                checked = now
                if plan and self.store.check([PLAN_ERROR_KEY]):
                    raise _shared(control.decode_error(*control.get(self.store, PLAN_ERROR_KEY)))
                if self.store.check(["abort"]):
                    raise control.ControlError(f"{what}: aborted: {self.store.get('abort').decode()}")
                if (gone := self._coordinator_gone()) is not None:
                    raise control.ControlError(f"{what}: {gone}")
                if expired:
                    raise control.ControlError(f"{what} within {bound:.0f} s")
        except (control.ControlError, ValueError, TypeError):
            raise
        except RuntimeError as e:  # torch's DistNetworkError / DistStoreError: the store is gone
            raise control.ControlError(f"{what}: the control-plane store stopped answering: {_first_line(str(e))}") from e

    def _wait_key(self, key: str, *, what: str, bound: float):
        self._wait_for(lambda: self.store.check([key]), what=f"training {self.rank}: {what}", bound=bound)
        return control.get(self.store, key)

    def _follow_plan(self) -> None:
        """After "go": when the coordinator published a new plan epoch (the receivers changed),
        release this rank's registrations and connections and rebuild from its new part."""
        if not self.store.check([membership.EPOCH_KEY]):
            return
        epoch = int(self.store.get(membership.EPOCH_KEY).decode())
        if epoch == self.epoch:
            return
        rank_plan, descriptors = control.get(self.store, membership.plan_key(epoch, self.rank))
        self.close()
        self._build(rank_plan, descriptors)
        self.epoch = epoch

    def close(self) -> None:
        """Deregister the memory the writes read from (registered once at :meth:`plan`) and
        release the transport (the receivers' regions stay theirs)."""
        if self.executor is not None and hasattr(self.executor, "close"):
            self.executor.close()
            self.executor = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None


from .delta import check_published  # noqa: E402 -- delta updates (ExecutorOptions.delta)
from .receiver import Receiver  # noqa: E402 -- the inference side, re-exported here
