"""The coordinator of the public API (:mod:`weight_transfer.api`): plans once against the
receivers' registered layouts, then drives every push -- one decision for every training rank,
the update, the published weight version and the outcome -- in training rank 0 or in a process
of its own (:meth:`Coordinator.serve`). Also the planning step on its own
(:func:`plan_against`), which the harness's controller calls too."""
from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace

from ..args import check_callable, check_int, check_seconds, check_type
from ..control import membership
from ..control import protocol as control
from ..control.fingerprint import VERIFY_KEY, Verifier, plan_value
from ..control.store import connect_store, runtime_layouts, shadow_infos
from ..metrics import metrics_arg, record_failure, recorded
from ..options import TransferOptions, VerifyOptions
from ..types import InferenceLayout, PlanError, Schedule
from .update import (
    COORDINATOR_KEY,
    ENGINE_KEY,
    PLAN_ERROR_KEY,
    PUSH_KEY,
    REFUSALS,
    TRAIN_PROC_KEY,
    WHERE_KEY,
    WORLD_KEY,
    UpdateResult,
    _claim_outcome,
    _first_line,
    _shared,
)


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
    ``stall``: heartbeat deadline in seconds (None: no heartbeat monitor); ``log``: a callable
    taking one line; ``verify``: ``"off"``, ``"sample"`` or ``"full"``, the end-to-end
    fingerprint check of every update (:mod:`weight_transfer.control.fingerprint`; default
    ``options.verify.mode``, itself ``"off"``): a range whose bytes in inference memory differ
    from what the training rank sent fails the update with ControlError naming the tensor and
    both ranks, before ``complete`` is published. ``metrics``: Prometheus metrics of every update (:attr:`metrics`,
    docs/METRICS.md): None (off), a port to serve (0: a free one), a ``CollectorRegistry`` or an UpdateMetrics.

    Every argument is checked before the store is reached and before anything is published:
    TypeError for a wrong type (``n_train``/``n_infer`` not an int -- a ``str`` from
    ``os.environ`` included --, ``layout`` not an InferenceLayout, ``options`` not
    TransferOptions, ``model_config`` neither a ModelConfig, a mapping nor a path, ``timeout``/
    ``stall`` not a number, a liveness or ``log`` callback not callable); ValueError for
    ``n_train``/``n_infer`` < 1, ``timeout``/``stall`` not > 0, an unknown ``verify`` mode, a ``model_config`` path that
    does not exist or is not a readable config.json (naming the path), a malformed ``store``
    address; :class:`weight_transfer.control.protocol.ControlError` naming ``host:port`` when no store
    answers within ``timeout`` seconds."""

    def __init__(self, store, *, n_train: int, n_infer: int, model_config=None, layout: InferenceLayout | None = None,
                 options: TransferOptions | None = None, timeout: float | None = None, metrics=None,
                 liveness_train: Callable[[], dict] | None = None, liveness_infer: Callable[[], dict] | None = None,
                 stall: float | None = None, log: Callable[[str], None] | None = None, verify: str | None = None):
        w = "Coordinator"  # every argument is checked (model_config loaded) before the store is reached
        n_train, n_infer = check_int(n_train, "n_train", where=w, lo=1), check_int(n_infer, "n_infer", where=w, lo=1)
        check_type(layout, "layout", InferenceLayout, where=w, allow_none=True)
        check_type(options, "options", TransferOptions, where=w, allow_none=True)
        timeout = check_seconds(timeout, "timeout", where=w, allow_none=True)
        stall = check_seconds(stall, "stall", where=w, allow_none=True)
        for name, f in (("liveness_train", liveness_train), ("liveness_infer", liveness_infer), ("log", log)):
            check_callable(f, name, where=w)
        self.model_config = _model_config(model_config, where=w) if model_config is not None else None
        self.options = options if options is not None else TransferOptions()
        if verify is not None:  # the shortcut for options.verify.mode
            check_type(verify, "verify", str, where=w)
            import dataclasses

            self.options = dataclasses.replace(self.options, verify=VerifyOptions(mode=verify,
                                                                                  cycle=self.options.verify.cycle))
        self.timeout = self.options.control.timeout if timeout is None else timeout
        self.metrics, serve_metrics = metrics_arg(metrics, where=w)  # checked (TypeError/ValueError) before the store
        self.store = connect_store(store, timeout=self.timeout)
        serve_metrics()  # metrics=<port>: served once the store answered
        self.n_train, self.n_infer = n_train, n_infer
        self.layout = layout
        self.log = log or (lambda m: None)
        self.ctl = control.Controller(self.store, n_train, n_infer, timeout=self.timeout, liveness_train=liveness_train,
                                      liveness_infer=liveness_infer, stall=stall)
        control.put(self.store, WORLD_KEY, {"n_train": n_train, "n_infer": n_infer})
        self.schedule: Schedule | None = None
        self.commit_ranks: tuple[int, ...] = ()
        """Inference ranks whose engine commits each update (staged targets)."""
        self.bytes_staged = 0
        self.recipes_from = ""
        """Where the plan's recipes come from (:func:`choose_recipes`), set by :meth:`plan`."""
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
        if self.ctl.live_i is None:  # so are members whose engine process is gone: the root cause, first
            self.ctl.live_i = self._inference_gone
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
            v = self.options.verify  # before the training ranks' parts: they read it with theirs
            control.put(self.store, VERIFY_KEY, plan_value(v, infer_payloads))
            self.schedule, extra = plan_against(self.store, self.model_config, self.layout, train_metas,
                                                infer_payloads, self.options)
            self.ctl.verifier = Verifier(v, self.schedule, {i: p[1] for i, p in infer_payloads.items()})
            ex = self.options.executor  # packed delta records land beside the targets and are applied at the commit
            self.ctl.verify_after_commit = ex.delta and ex.delta_mode != "scattered"
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
        self.ctl.shadow = extra["shadow"]
        self.plan_seconds = time.perf_counter() - t0
        self.recipes_from = extra["recipes"]
        self.log(f"plan: {self.schedule.summary()} ({self.plan_seconds:.2f} s); {self.recipes_from}")
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

    def _inference_gone(self) -> dict[int, str]:
        """``{inference rank: reason}`` for members of the current plan whose process (their
        region's descriptor) is on this host and gone."""
        out = {}
        for i in sorted(self.members):
            d = self._payloads.get(i, (None,))[0]
            if d is not None and membership.process_gone(d):
                out[i] = f"process {getattr(d, 'pid', '?')} on {getattr(d, 'host', '?')} is gone (killed or exited)"
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
            record_failure(self.metrics, e, before_go=True)
            if not decided:  # the ranks waiting for the decision get the same error
                kind, msg = control.encode_error(e)
                if kind not in REFUSALS:
                    kind, msg = "ControlError", f"coordinator: {kind}: {msg}"
                self._put(n, "decision", {"go": False, "version": version, "error": (kind, msg)})
            raise
        return recorded(self.metrics, lambda: self._update(n, v, commit=commit, before_go=before_go))

    def _wait_ready(self, n: int) -> dict[int, dict]:
        """Every training rank's readiness for push ``n`` (``{rank: {"version", "refuse"}}``);
        ControlError naming the ranks that did not answer within the timeout, or died."""
        keys = {r: PUSH_KEY.format(n=n, what=f"ready/{r}") for r in range(self.n_train)}
        # training ranks' liveness only: an engine that died since the last update is dropped after the decision
        def dead() -> str | None:
            gone = self.ctl.live_t() if self.ctl.live_t is not None else {}
            missing = {r: why for r, why in sorted(gone.items()) if r in keys and not self.store.check([keys[r]])}
            return "; ".join(f"training {r}: {why}" for r, why in missing.items()) or None
        control.wait_keys(self.store, keys, timeout=self.timeout, what=f"push {n}: training ranks ready", failure=dead)
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
            return None, _shared(ValueError(f"push(version=...): the training ranks asked for different versions "
                                            f"{asked} (rank: version, at their push number {n + 1}); every rank "
                                            "pushes the same version"))
        v = next(iter(asked.values()))
        if version is not None and v != version:
            return v, _shared(ValueError(f"Coordinator.update(version={version}): the training ranks pushed "
                                         f"version {v}"))
        cur = self.ctl.state()
        if v <= cur.version:
            return v, _shared(control.VersionError(f"push(version={v}): version {v} refused on every training rank: "
                                                   f"the weights are {cur}; versions only increase"))
        if v <= self._last_go:
            return v, _shared(control.VersionError(f"push(version={v}): version {v} refused on every training rank: "
                                                   f"version {self._last_go} was already pushed (it failed before its "
                                                   "writes); versions only increase"))
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
        ver = self.ctl.last_verify
        return UpdateResult(version=version, seconds=seconds, write_seconds=self.ctl.last_write_seconds or seconds,
                            bytes=sum(s.bytes_sent for s in stats.values()),
                            n_writes=sum(s.n_writes for s in stats.values()), stats=stats, commits=commits,
                            verify=ver["mode"], verified_bytes=ver["bytes"], verify_seconds=ver["seconds"])

    def verify_update(self, version: int) -> dict:
        """For a ``commit`` callable of :meth:`update` / ``Sender.push`` that labels the version
        itself (an engine's own version label): the end-to-end fingerprint check of ``version``
        now, between its commit and its label, so that no reader sees the label over bytes that
        fail it (:meth:`weight_transfer.control.protocol.Controller.verify_now`). Returns ``{"mode",
        "bytes", "seconds"}``; ControlError naming the mismatched ranges."""
        return self.ctl.verify_now(version)

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
                parts.append(f"training {r}: in neither prepare nor a collective (writing, or waiting for its writes)")
        return "".join(f"; {p}" for p in parts)

    def _gone(self) -> set[int]:
        """Members that left, died or stalled (:mod:`weight_transfer.control.membership`), each with
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
        self.ctl.verifier = Verifier(self.options.verify, ch.schedule, {i: p[1] for i, p in ch.payloads.items()})
        self.commit_ranks, self.bytes_staged = ch.extra["commit_ranks"], ch.extra["bytes_staged"]
        self.ctl.shadow = ch.extra["shadow"]
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
            wake = (lambda sec, ks=[*keys, "shutdown"]: control.watch(self.store, ks, sec)) \
                if control.can_watch(self.store) else None
            for _ in control.backoff(None, 0.01 if wake is None else 0.1, wake=wake):  # a rank ready: the push began
                if control.any_exists(self.store, keys):
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
        """The published :class:`weight_transfer.control.protocol.WeightsState`."""
        return self.ctl.state()

    def shutdown(self, reason: str | None = None) -> None:
        """Tell every rank the job ends (``reason``: an abort reason every waiter raises with)."""
        self.ctl.shutdown(reason)


def _model_config(mc, *, name: str | None = None, where: str = "Coordinator"):
    """A ModelConfig from one, a config dict or a ``config.json`` path (a file or its directory).
    TypeError for another type, ValueError naming the path when it cannot be read as a config."""
    from ..model_config import ModelConfig

    if isinstance(mc, ModelConfig):
        return mc
    if isinstance(mc, Mapping):
        return ModelConfig(name=name or str(mc.get("_name_or_path") or mc.get("model_type") or "model"), hf=dict(mc))
    check_type(mc, "model_config", (str, os.PathLike), where=where, allow_none=True,
               what="a ModelConfig, a config.json path or its dict")
    try:
        return ModelConfig.from_file(mc)
    except (OSError, ValueError, TypeError, AttributeError) as e:  # missing, unreadable, not JSON, not a config
        raise ValueError(f"{where}: model_config={os.fspath(mc)!r} is not a readable Hugging Face config.json: "
                         f"{type(e).__name__}: {_first_line(str(e))}") from e


def plan_against(store, model_config, layout: InferenceLayout, train_metas: dict, infer_payloads: dict,
                 options: TransferOptions, *, epoch: int = 0) -> tuple[Schedule, dict]:
    """The coordinator's planning step on its own (the harness's controller calls it): recipes
    for ``model_config`` on ``layout`` (fp32 sources to bf16 destinations are a cast), aimed at
    the runtime layouts inference ranks published under
    :data:`weight_transfer.control.store.RUNTIME_KEY` (refused, named, where a runtime tensor cannot be
    written), the static schedule, and each training rank's part published under ``plan/{r}``.
    Returns ``(schedule, {"commit_ranks", "bytes_staged", "shadow", "recipes"})`` (``recipes``: where
    the recipes come from, :func:`choose_recipes`; ``shadow``: inference
    rank -> its shadow targets' info, :data:`weight_transfer.control.store.SHADOW_KEY`; those ranks go
    live at the commit, so they are commit ranks). PlanError when some ranks have shadow targets
    and others not, or with flip shadows and delta updates (a flip shadow holds the version
    before last, not the base a delta needs). ``epoch``: the plan's epoch
    (0 the first plan, ``plan/{r}``; later ones after a membership change,
    :func:`weight_transfer.control.membership.plan_key`)."""
    from ..plan import gc_paused, plan
    from ..plan.traced import SOURCE_VIEWS_KEY, apply_source_views, expand_sources

    views = control.get(store, SOURCE_VIEWS_KEY) if store.check([SOURCE_VIEWS_KEY]) else {}
    held = {m.name: (tuple(m.global_shape), m.dtype) for ms in train_metas.values() for m in ms}
    sources = {n: dt for n, (_, dt) in expand_sources(held, views).items()}  # the checkpoint names
    with gc_paused():
        recipes, how = choose_recipes(store, model_config, layout, sources, set(infer_payloads))
        recipes = apply_source_views(recipes, views)  # fused training tensors (C29): their slices
        recipes = only_ranks(recipes, set(infer_payloads))
        runtime = runtime_layouts(store, infer_payloads)
        if runtime:  # a live engine reported what it computes with: aim there, or refuse (C20)
            from ..plan.retarget import retarget

            recipes = retarget(recipes, runtime)
        sched = plan(recipes, train_metas, {i: metas for i, (_, metas) in infer_payloads.items()},
                     max_chunk_bytes=options.plan.max_chunk_bytes, local_writes=options.plan.local_writes,
                     local_min_bytes=options.plan.local_min_bytes,
                     local_max_writes=options.plan.local_max_writes, parallel_checks=None)
    descriptors = {i: desc for i, (desc, _) in infer_payloads.items()}
    for r, rp in sched.rank_plans.items():
        control.put(store, membership.plan_key(epoch, r), (rp, descriptors))
    shadow = check_shadows(store, infer_payloads, options)
    commit = {i for i, lay in runtime.items() if getattr(lay, "needs_commit", False)} | set(shadow)
    extra = {"commit_ranks": tuple(sorted(commit)), "shadow": shadow, "recipes": how,
             "bytes_staged": sum(getattr(lay, "staged_bytes", 0) for lay in runtime.values())}
    return sched, extra


def _trace_problem(traces: dict) -> str:
    for r, t in sorted(traces.items()):
        if t.error:
            return f"inference rank {r}: {t.error}"
        for name, why in sorted(t.refused.items()):
            return f"inference rank {r}: {name}: {why}"
    return ""


def loader_traces(store, ranks) -> dict:
    """Inference rank -> its published :class:`weight_transfer.plan.traced.LoaderTrace`, for the ranks in ``ranks`` that
    published one (``{}`` when none did)."""
    from ..plan.traced import TRACE_KEY

    keys = {i: TRACE_KEY.format(rank=i) for i in ranks}
    return {i: control.get(store, k) for i, k in keys.items() if store.check([k])}


def choose_recipes(store, model_config, layout: InferenceLayout, sources: dict, ranks: set[int]):
    """The recipes to plan with and a line saying where they come from (C29): the recipes
    traced from vLLM's loader (:func:`weight_transfer.plan.traced.recipes_from_traces`) when
    every inference rank in ``ranks`` published a trace (:data:`weight_transfer.plan.traced.TRACE_KEY`)
    (BF16, or block FP8 traced on its checkpoint form) -- cross-checked against the hand-written rules where
    the architecture has them (a difference is named in the line: vLLM's loader is what the
    engine does); else the hand-written rules (:func:`weight_transfer.plan.build_recipes`).
    PlanError for an architecture without hand-written rules and without (usable) traces, or
    what :func:`~weight_transfer.plan.traced.recipes_from_traces` refuses (a loader step that
    computes, a parameter the trainer's tensors do not fill)."""
    from ..plan import build_recipes
    from ..plan.scaled import scaled_gather_line
    from ..plan.traced import compare_recipes, kept_line, recipes_from_traces

    traces = loader_traces(store, ranks)
    whole = bool(traces) and set(traces) >= ranks
    label = model_config.label
    if not whole or (model_config.hand_written and any(t.error or t.refused for t in traces.values())):
        if not traces:  # an engine without a vLLM (the stand-in, your own): the rules, nothing to explain
            return build_recipes(model_config, layout, source_dtypes=sources), "recipes: hand-written rules"
        why = ("not every inference rank traced its loader" if not whole else
               "vLLM's loader was not traced cleanly: " + _trace_problem(traces))
        return build_recipes(model_config, layout, source_dtypes=sources), f"recipes: hand-written rules ({why})"
    traced = recipes_from_traces(traces, layout, model=label, source_dtypes=sources)
    src = next(iter(traces.values())).source
    how = f"recipes: traced from {src} on {len(traces)} inference rank(s)"
    if model_config.hand_written:
        diff = compare_recipes(build_recipes(model_config, layout, source_dtypes=sources), traced, max_problems=3)
        how += ("; equal to the hand-written rules, every destination byte" if not diff else
                f"; DIFFERENT from the hand-written rules (vLLM's loader is used): {'; '.join(diff)}")
    return traced, how + kept_line(traced) + scaled_gather_line(traced)


def check_shadows(store, infer_payloads: dict, options: TransferOptions) -> dict[int, dict]:
    """The inference ranks' published shadow infos (:func:`weight_transfer.control.store.shadow_infos`),
    checked before anything is planned: every rank has shadow targets or none does, and flip
    shadows go without delta updates. PlanError naming the ranks otherwise."""
    shadow = shadow_infos(store, infer_payloads)
    if shadow and len(shadow) != len(infer_payloads):
        without = sorted(set(infer_payloads) - set(shadow))
        raise PlanError(f"shadow targets on inference rank(s) {sorted(shadow)} but not on {without}: every rank "
                        "goes live at the same commit, so all of them or none must have shadow targets")
    flips = sorted(i for i, info in shadow.items() if info.get("mode") == "flip")
    if flips and options.executor.delta:
        raise PlanError(f"inference rank(s) {flips} have flip shadow targets and delta updates are on: a flip "
                        "shadow holds the version before last, not the base a delta is computed against; "
                        "use copy shadows (or no delta)")
    return shadow


def only_ranks(recipes, ranks: set[int]):
    """``recipes`` (a :class:`weight_transfer.plan.RecipeSet`) writing only to inference ``ranks``:
    the fleet's current members when it is smaller than the layout (engines that left, replicas
    not started yet, C24). The same set when every rank of the layout is a member."""
    from ..plan import RecipeSet
    from ..types import new_recipe

    if all(k in ranks for r in recipes for k in r.ranks):
        return recipes
    kept = [new_recipe(r.name, tuple(k for k in r.ranks if k in ranks), r.shape, r.assembled_dtype, r.pieces,
                       r.transform, r.outputs) for r in recipes if any(k in ranks for k in r.ranks)]
    return RecipeSet(kept, recipes.ignored, layout=recipes.layout, model=recipes.model, kept=recipes.kept)
