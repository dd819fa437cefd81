"""The training side of the public API (:mod:`weight_transfer.api`): :class:`Sender`, one per
training rank -- metadata once, its part of the static schedule once, one-sided writes on every
:meth:`Sender.push`, with the push protocol's one decision for every rank
(:mod:`weight_transfer.api.update`)."""
from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..args import check_bool, check_callable, check_int, check_seconds, check_type
from ..control import clients, membership
from ..control import protocol as control
from ..control.fingerprint import verify_options
from ..control.store import connect_store
from ..control.wire import WireError
from ..delta.runs import check_published
from ..options import TransferOptions
from ..security.secret import AuthenticationError
from .coordinator import Coordinator
from .update import (
    COORDINATOR_KEY,
    PLAN_ERROR_KEY,
    PUSH_KEY,
    TRAIN_PROC_KEY,
    WHERE_KEY,
    WORLD_KEY,
    UpdateResult,
    _claim_outcome,
    _first_line,
    _shared,
)


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


def receivers_transport(name: str, descriptors: Mapping) -> str:
    """The transport to write with: ``name``, or for ``auto`` the one every receiver's region
    descriptor names (a receiver chose it from its memory: e.g. the vLLM backend's workers,
    ``cuda_ipc`` for GPU tensors, ``cma`` for host memory). ValueError when ``auto`` finds
    receivers on different transports (naming two of their ranks) or none."""
    from ..options import AUTO_TRANSPORT

    if name != AUTO_TRANSPORT:
        return name
    by = {}
    for rank, d in sorted(descriptors.items()):
        by.setdefault(d.transport, rank)
    if len(by) != 1:
        raise ValueError("transport 'auto': " + ("no receiver descriptor to follow" if not by else
                         "the receivers registered with different transports ("
                         + ", ".join(f"inference {r}: {t!r}" for t, r in by.items()) + "); name one transport"))
    return next(iter(by))


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
    coordinator's should be the same; transport ``auto``: the one every receiver registered
    with, read from their descriptors when the plan comes). ``group_barrier``: the barrier between mesh groups
    (default ``torch.distributed.barrier`` when a default process group exists and more than one
    rank trains). ``offloaded``: the shards live in host memory
    (:class:`weight_transfer.plan.metadata.OffloadedParams`). ``publish``: publish the metadata now
    (False when the caller already did). ``views``: checkpoint name -> (name of the training tensor
    holding it, box of that tensor), for training tensors that fuse several checkpoint tensors
    (transformers 5's ``mlp.experts.gate_up_proj`` ``[E, 2I, H]``:
    :func:`weight_transfer.plan.traced.fused_expert_views` reads them from transformers'
    conversion mapping); the plan reads the viewed slices in place (rank 0 publishes them).

    Every argument is checked before anything is published: TypeError for a wrong type
    (``params`` not a module/mapping of tensors or mixing DTensors and plain tensors, ``rank``/
    ``world_size`` not an int -- a ``str`` from ``os.environ`` included --, ``coordinator`` not a
    Coordinator, ``options`` not TransferOptions, ``timeout`` not a number, ``group_barrier``/
    ``log`` not callable, ``publish`` not a bool); ValueError for no parameters, ``world_size``
    < 1, ``rank`` outside ``[0, world_size)``, ``timeout`` not > 0 (seconds), a ``world_size``
    other than the Coordinator's ``n_train`` (its own, or the one it published under
    :data:`WORLD_KEY`), a malformed ``store`` address;
    :class:`weight_transfer.control.protocol.ControlError` naming ``host:port`` when no store answers
    within ``timeout`` seconds (default ``options.control.timeout``)."""

    def __init__(self, params, *, rank: int, world_size: int, store, coordinator: Coordinator | None = None,
                 options: TransferOptions | None = None, group_barrier: Callable[[], None] | None = None,
                 timeout: float | None = None, log: Callable[[str], None] | None = None, publish: bool = True,
                 views=None):
        from torch.distributed.tensor import DTensor

        from ..plan.metadata import collect_metas, whole_metas

        w = "Sender"  # every argument is checked before the store is reached
        rank, world_size = check_int(rank, "rank", where=w), check_int(world_size, "world_size", where=w, lo=1)
        if not (0 <= rank < world_size):
            raise ValueError(f"Sender: rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        check_type(coordinator, "coordinator", Coordinator, where=w, allow_none=True)
        check_type(options, "options", TransferOptions, where=w, allow_none=True)
        timeout = check_seconds(timeout, "timeout", where=w, allow_none=True)
        for name, f in (("group_barrier", group_barrier), ("log", log)):
            check_callable(f, name, where=w)
        check_bool(publish, "publish", where=w)
        if coordinator is not None and coordinator.n_train != world_size:
            raise ValueError(f"Sender: world_size={world_size} but the coordinator's n_train={coordinator.n_train}")
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
        self.store = connect_store(store, timeout=self.timeout)
        world = control.get(self.store, WORLD_KEY) if self.store.check([WORLD_KEY]) else None
        if world is not None and world["n_train"] != world_size:  # before this rank publishes anything
            raise ValueError(f"Sender: world_size={world_size} but the Coordinator's n_train={world['n_train']} "
                             f"({WORLD_KEY!r}): every training rank's world_size is n_train")
        self.client = clients.TrainerClient(self.store, rank, timeout=max(self.timeout, 600.0))
        self.metas = metas
        self.views = {}
        if views:  # checkpoint tensors held as slices of fused training tensors (C29)
            from ..plan.traced import SOURCE_VIEWS_KEY, check_views

            self.views = check_views(views, {m.name: tuple(m.global_shape) for m in metas}, where="Sender: views")
            if rank == 0:
                control.put(self.store, SOURCE_VIEWS_KEY, self.views)
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
                           bound=2 * self.timeout + 5, plan=True, wake=[key, PLAN_ERROR_KEY])
            rank_plan, descriptors = control.get(self.store, key)
        else:  # reopened after close(): the plan of the epoch this rank follows
            rank_plan, descriptors = control.get(self.store, membership.plan_key(self.epoch, self.rank))
        self._build(rank_plan, descriptors)

    def _build(self, rank_plan, descriptors) -> None:
        """Connect a transport to ``descriptors`` and build the executor of ``rank_plan``."""
        from ..pipeline.executor import Executor
        from ..transport import lease, make_transport

        self.transport = make_transport(receivers_transport(self.options.transport.name, descriptors))
        lease.attach(self.transport, self.store)  # receivers' deregister waits for our batch in flight (C17)
        self.transport.connect(list(descriptors.values()))
        landing = self._landing(descriptors)
        self.executor = Executor(rank_plan, self.params, self.transport, descriptors, options=self.options.executor,
                                 group_barrier=self.group_barrier, landing=landing, senders=self.world_size)
        self.executor.verify = verify_options(self.store)  # the coordinator's, published with the plan
        su = getattr(self.executor, "setup_stats", None)
        reg = (f"; registered once: {su.n_regions} region(s), {su.registered_bytes / 1e6:.1f} MB in "
               f"{su.register_seconds * 1e3:.1f} ms ({su.transport})" if su is not None else "")
        gathered = {n for t in rank_plan.tasks for n in t.sources}
        gb = sum(self.params[n].numel() * self.params[n].element_size() for n in gathered if n in self.params)
        self.log(f"plan: {len(rank_plan.tasks)} tasks, {rank_plan.n_writes} writes, "
                 f"{rank_plan.send_bytes / 1e9:.3f} GB to send, gathers {gb / 1e6:.1f} MB per update "
                 f"(full_tensor() of {len(gathered)} source(s)){reg}")

    def _landing(self, descriptors) -> dict:
        """Packed deltas: the landing regions the receivers of ``descriptors`` published
        (:data:`weight_transfer.delta.packed.LANDING_KEY`), connected on this transport; one that
        cannot be connected (another transport, a receiver gone) is left out (that receiver gets
        no packed records)."""
        ex = self.options.executor
        if not ex.delta or ex.delta_mode == "scattered":
            return {}
        from ..delta.packed import LANDING_KEY

        out = {}
        for r in descriptors:
            key = LANDING_KEY.format(rank=r)
            if self.store.check([key]):
                d = control.get(self.store, key)
                try:
                    self.transport.connect([d])
                except (ValueError, OSError, RuntimeError) as e:
                    self.log(f"delta: inference rank {r}'s landing region not used: {e}")
                    continue
                out[r] = d
            elif ex.delta_mode == "packed":
                self.log(f"delta: --delta-mode packed but inference rank {r} published no landing region: "
                         "its outputs go scattered or whole")
        return out

    def send(self, version: int):
        """Run this rank's writes of the update to ``version`` now, outside the push protocol
        (a caller whose own control loop already said "go", e.g. the harness). Returns this
        rank's :class:`weight_transfer.pipeline.executor.StepStats`; raises the executor's error."""
        self.plan()
        check_published(self.executor, self.store)  # delta: full after a version not published complete (C26)
        self._set_shift(version)
        return self.executor.run(version)

    def _set_shift(self, version: int) -> None:
        """The controller's ``step/{version}/shift`` (flip shadow targets: the half each such
        receiver does not compute with) onto the executor, after "go"; {} when none."""
        key = f"step/{version}/shift"
        self.executor.shift = control.get(self.store, key) if self.store.check([key]) else {}

    def push(self, version: int, *, commit: Callable[[int], object] | None = None,
             before_go: Callable[[int], None] | None = None):
        """After ``optimizer.step()``, on every training rank: update the inference weights to
        ``version``. Every rank says it is ready, the coordinator takes one decision for all
        of them, every rank writes its part, and every rank returns only once ``complete
        version`` is published (on the coordinator's rank :attr:`last_update` then holds its
        :class:`UpdateResult`). Returns this rank's :class:`weight_transfer.pipeline.executor.StepStats`.
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
        ControlError while it stays blocked, :attr:`writer_blocked` says so, and no collective
        of your own may run on that group until :meth:`wait_writer` returns True (or the
        training world is restarted). ``commit`` and ``before_go``: handed to
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
            try:
                stats = self._push(n, refusal)
            except (AuthenticationError, WireError) as e:  # a store value refused: the other ranks stop now too
                self._claim_failure(n, f"training {self.rank}: {_first_line(str(e))}")
                raise
        except control.ControlError as e:
            if thread is not None:
                thread.join(self.timeout + 5)
                own = box.get("error")
                if e.__cause__ is None and own is not None and own is not e:
                    # the coordinator's own account (a failed commit, before_go); when it says just what the
                    # outcome says, what it was caused by (no copy of the same error as its own cause)
                    e.__cause__ = own if str(own) != str(e) else own.__cause__
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
        self._wait_for(lambda: control.any_exists(self.store, [f"step/{v}/go", outcome_key]),
                       what=f"training {self.rank}: no go for version {v}", bound=2 * self.timeout + 5,
                       wake=[f"step/{v}/go", outcome_key])
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
            self.client.done(v, ok=True, stats=stats, fingerprints=self.executor.fingerprints)
        out = self._wait_outcome(n, v, local)
        if out["ok"]:  # claimed right before "complete v" is published: return once it is

            refused: list[str] = []
            self._weights_seen = None

            def published() -> bool:
                try:
                    s = control.read_state(self.store)
                    self._weights_seen = s.encode() if s.seq else None
                except (AuthenticationError, WireError) as e:  # not the coordinator's: it overwrites it
                    refused[:] = [_first_line(str(e))]
                    return False
                return s.version > v or (s.version == v and s.complete)
            try:
                self._wait_for(published, what=f"training {self.rank}: complete version {v} not published",
                               bound=self.timeout, wake=["weights"], seen=lambda: [self._weights_seen])
            except control.ControlError as e:
                raise control.ControlError(f"{e}" + (f" ({refused[0]})" if refused else "")) from None
            return stats
        raise control.ControlError(out["error"][1]) from local

    def _run_watched(self, n: int, v: int, t_go: float):
        """Run the executor for version ``v`` in a thread while watching the update: a
        failure anywhere (``step/{v}/failed``, the outcome, the abort, a coordinator gone)
        cancels it (no write after that; its collectives go on so the other ranks' complete).
        Returns ``(stats, error, cancelled)``; the executor is left behind, still blocked in a
        collective of the training world, when it has not ended ``grace`` seconds after the
        cancel (the error then says so, and the next push refuses while it runs)."""
        from ..pipeline.executor import UpdateCancelled

        cancel = threading.Event()
        box: dict = {}

        def run():
            try:
                self._set_shift(v)
                box["stats"] = self.executor.run(v, cancel=cancel)
            except BaseException as e:
                box["error"] = e
        th = threading.Thread(target=run, name=f"wt-train{self.rank}-v{v}", daemon=True)
        th.start()
        grace = min(5.0, self.timeout)
        until = None
        checked = told = 0.0
        while True:
            th.join(0.005)  # wakes at once when the writes end
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
                    "timeout applies); run no collective on that group until Sender.wait_writer() returns True, "
                    "or restart the training world"), True
        if "error" in box:
            e = box["error"]
            return None, e, isinstance(e, UpdateCancelled)
        return box["stats"], None, False

    def _failed_elsewhere(self, n: int, v: int) -> str | None:
        """Why update ``v`` (push ``n``) failed elsewhere, as far as the store says; None."""
        if control.any_exists(self.store, [f"step/{v}/failed", PUSH_KEY.format(n=n, what="outcome"), "abort"]):
            return "aborted" if self.store.check(["abort"]) else "failed elsewhere"
        return self._coordinator_gone()

    def _claim_failure(self, n: int, why: str) -> None:
        """Claim push ``n``'s outcome as failed (``why``) unless one holds, so that every rank
        stops at once; a store that refuses even that leaves the others to their timeout."""
        try:
            _claim_outcome(self.store, n, {"ok": False, "error": ("ControlError", why)})
        except (control.ControlError, RuntimeError):
            pass

    def _wait_outcome(self, n: int, v: int, local: BaseException | None) -> dict:
        """Push ``n``'s outcome (``{"ok", "error"}``), as the coordinator claimed it; when it
        does not come within the timeout (or the coordinator is gone) this rank claims a
        failure itself, so that no rank returns success for an update another rank gave up on."""
        key = PUSH_KEY.format(n=n, what="outcome")
        try:  # the coordinator waits up to the timeout for the writes, then up to the timeout for the commit
            return self._wait_key(key, what=f"no outcome of version {v}", bound=2 * self.timeout + 5)
        except control.ControlError as e:
            return _claim_outcome(self.store, n, {"ok": False, "error": ("ControlError", str(e))})

    @property
    def writer_blocked(self) -> bool:
        """True while the writer of an update that failed is still inside a ``full_tensor()``
        collective or barrier of the training world (a peer died or stopped: see :meth:`push`).
        Until it ends, that process group is mid-collective: run no collective of your own on
        it (an FSDP forward/backward would interleave with it), but :meth:`wait_writer` or
        restart the training world."""
        return self._running is not None and self._running[0].is_alive()

    def wait_writer(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: as long as it takes) for the writer left
        blocked by a failed update (:attr:`writer_blocked`) to end; True once none is blocked.
        A stopped peer that resumes lets it finish its collectives (it writes nothing more)."""
        if self._running is None:
            return True
        self._running[0].join(timeout)
        if self._running[0].is_alive():
            return False
        self._running = None
        return True

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

    def _wait_for(self, ready: Callable[[], bool], *, what: str, bound: float, plan: bool = False,
                  wake: list[str] | None = None, seen: Callable[[], list] | None = None) -> None:
        """Poll ``ready()`` up to ``bound`` seconds; ControlError naming ``what`` on expiry, the
        store's abort, or a coordinator process gone; the coordinator's plan refusal (its
        type) with ``plan``. A store that stopped answering is a ControlError too. ``wake``: the
        keys ``ready`` depends on (with ``seen()``: their values as last read; default absent):
        a store that can waits at its server for them to change instead of polling."""
        checked = 0.0
        waker = None
        if wake and control.can_watch(self.store):
            keys = [*wake, "abort"]

            def waker(sec: float) -> None:
                control.watch(self.store, keys, sec, [*(seen() if seen else [None] * len(wake)), None])
        try:
            for expired in control.backoff(bound, 0.002, wake=waker):
                if ready():
                    return
                now = time.monotonic()
                if now - checked < 0.2 and not expired:
                    continue
                checked = now
                if plan and self.store.check([PLAN_ERROR_KEY]):
                    raise _shared(control.decode_error(*control.get(self.store, PLAN_ERROR_KEY)))
                if self.store.check(["abort"]):
                    raise control.ControlError(f"{what}: aborted: {control.get_text(self.store, 'abort')}")
                if (gone := self._coordinator_gone()) is not None:
                    raise control.ControlError(f"{what}: {gone}")
                if expired:
                    raise control.ControlError(f"{what} within {bound:.0f} s")
        except (control.ControlError, ValueError, TypeError):
            raise
        except RuntimeError as e:  # torch's DistNetworkError / DistStoreError: the store is gone
            raise control.ControlError(f"{what}: the control-plane store stopped answering: {_first_line(str(e))}") from e

    def _wait_key(self, key: str, *, what: str, bound: float):
        self._wait_for(lambda: self.store.check([key]), what=f"training {self.rank}: {what}", bound=bound, wake=[key])
        return control.get(self.store, key)

    def _follow_plan(self) -> None:
        """After "go": when the coordinator published a new plan epoch (the receivers changed),
        release this rank's registrations and connections and rebuild from its new part."""
        if not self.store.check([membership.EPOCH_KEY]):
            return
        epoch = control.get_int(self.store, membership.EPOCH_KEY)
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
