"""A small world driven through the public API only, with faults injected by role, stage and
kind (tests/api/test_api_faults.py, case C28).

Processes (``spawn``): ``n_train`` FSDP2 training ranks on a Gloo group (the tiny Qwen3, its
shards filled with the synthetic weights of step ``v`` before ``push(v)``), one
:class:`weight_transfer.Receiver` per inference rank over the stand-in engine's arena, and, with
``coordinator="process"``, a coordinator process of its own (:meth:`Coordinator.serve`). The
control-plane store lives in the test's own process, so it outlives every rank.

A scenario is a list of :class:`Push` es run in lockstep: before push ``k`` every training rank
waits for ``next/{k}``, which the test process sets once every receiver checked push ``k-1``.
Each training rank records, per push, what ``push`` returned or raised (type, message, the
cause's type, seconds). Each live receiver records, per push, its state as
:meth:`Receiver.state` reads it, whether its bytes equal a fresh engine's ``load_weights`` of the
published version's checkpoint (every byte of its arena), and a digest of its arena (a push
that was refused must leave it unchanged).

Faults (:class:`Fault`) are injected inside the target process by wrapping the library's own
functions for one version: ``prepare`` wraps :func:`weight_transfer.pipeline.executor.prepare_outputs`,
``write`` the sender's ``transport.write``, ``release`` :meth:`Executor._release`, ``plan``
:meth:`Sender._build` (a training rank) or :func:`weight_transfer.api.coordinator.plan_against` (the
coordinator), ``commit`` the ``commit`` callable the coordinator runs; an inference rank's fault
is made from training rank 0's first write of the version (``kill``: SIGKILL its process,
``stall``: SIGSTOP it for 1.5 s, ``raise``: it closes its region, as an engine that shuts
down). Kinds: ``raise`` (an exception), ``kill`` (the process ends at once), ``stall`` (sleep
``timeout + 3`` seconds, longer than the control timeout).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import signal
import threading
import time
from dataclasses import dataclass, field

CFG = ("qwen3-0.6b", dict(num_hidden_layers=1, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, vocab_size=1024))
"""The tiny dense Qwen3 of the world (catalog name, overrides)."""


@dataclass(frozen=True)
class Fault:
    role: str
    """``"train"``, ``"coord"`` or ``"infer"``."""
    rank: int
    stage: str
    """``plan``, ``prepare``, ``write``, ``release``, ``commit``."""
    kind: str
    """``raise``, ``kill``, ``stall``."""


@dataclass(frozen=True)
class Push:
    version: object
    """The version every training rank pushes, or ``{rank: version}``."""
    fault: Fault | None = None
    last: bool = False
    """The world ends after this push (a killed rank, a refused plan)."""

    def version_of(self, rank: int):
        return self.version[rank] if isinstance(self.version, dict) else self.version


@dataclass
class World:
    pushes: list[Push]
    n_train: int = 2
    tp: int = 2
    dp: int = 1
    timeout: float = 4.0
    coordinator: str = "rank0"
    """``rank0`` (hosted by training rank 0) or ``process`` (its own, :meth:`Coordinator.serve`)."""
    shadow: str | None = None
    """Shadow targets of every receiver (``flip`` / ``copy``; C27): each serves its go-lives."""
    results: dict = field(default_factory=dict)

    @property
    def n_infer(self) -> int:
        return self.tp * self.dp


def _cfg():
    from weight_transfer.testing.catalog import load_config

    return load_config(CFG[0], **CFG[1])


def _layout(w: World):
    from weight_transfer.types import InferenceLayout

    return InferenceLayout(tp=w.tp, dp=w.dp)


def _step_of(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


_OUTSIDER: dict = {}
"""Where an ``outsider`` fault's process aims: ``addr``, ``out`` (the world's folder), ``n`` and
``v`` (the push and version under way); set by each process's main."""


def _outsider(kind: str, what: str) -> None:
    """Run tests/helpers/outsider.py in a process of its own that holds only the store address
    (no job secret in its environment), now, inside this stage of the update; wait for it."""
    from tests.helpers.outsider import run_outsider

    o = _OUTSIDER
    flags = kind.split("+")[1:]
    run_outsider(o["addr"][0], o["addr"][1], what, f"{o['out']}/outsider.jsonl", n=o["n"], v=o["v"],
                 marker=f"{o['out']}/OUTSIDER_CODE_RAN", tcpstore="tcpstore" in flags, flood="flood" in flags)


def _forge(key: str) -> None:
    """Ask the test process, which serves the store, to put a value no member sealed under
    ``key`` (``forge-request/{key}``), and wait until it says it did (``forged/{key}``)."""
    import weight_transfer as wt

    s = wt.connect_store(_OUTSIDER["addr"], timeout=10)
    s.set(f"forge-request/{key}", b"1")
    _wait(s, f"forged/{key}", 10)


def _act(kind: str, timeout: float, what: str):
    if kind.startswith("outsider"):
        _outsider(kind, what)
        return
    if kind.startswith("forge:"):
        _forge(kind.split(":", 1)[1])
        return
    if kind == "raise":
        raise RuntimeError(f"injected: {what}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stall":
        time.sleep(timeout + 3)


def _save(path: str, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)


def _wait(store, key: str, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if store.check([key]):
            return True
        time.sleep(0.01)
    return False


# ------------------------------------------------------------------------------- training rank


def train_main(rank: int, addr, w: World, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import weight_transfer as wt
    import weight_transfer.api.coordinator as api_coord
    import weight_transfer.api.sender as api_sender
    import weight_transfer.pipeline.executor as executor
    from weight_transfer.testing.training import build_fsdp_model, load_step

    torch.set_num_threads(1)
    store = wt.connect_store(addr, timeout=30)
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=w.n_train)
    cfg = _cfg()
    model = build_fsdp_model(cfg, init_device_mesh("cpu", (w.n_train,)))
    params = dict(model.named_parameters())
    coord = None
    if rank == 0 and w.coordinator == "rank0":
        coord = wt.Coordinator(store, n_train=w.n_train, n_infer=w.n_infer, model_config=cfg, layout=_layout(w),
                               timeout=w.timeout)
    tx = wt.Sender(params, rank=rank, world_size=w.n_train, store=store, coordinator=coord, timeout=w.timeout)
    _OUTSIDER.update(addr=addr, out=out)
    rec: dict = {}
    path = f"{out}/train{rank}.pkl"
    for k, p in enumerate(w.pushes):
        if not _wait(store, f"next/{k}", 120):
            rec["lost"] = k
            break
        v = p.version_of(rank)
        _OUTSIDER.update(n=k, v=_step_of(v))
        load_step(params, step=_step_of(v), seed=0)
        f = p.fault
        undo = []
        commit = None
        if f is not None and f.role == "train" and f.rank == rank:
            undo = _inject_train(f, tx, executor, api_sender, w.timeout)
        if f is not None and f.role == "coord" and coord is not None:
            if f.stage == "commit":
                def commit(ver, f=f):
                    _act(f.kind, w.timeout, f"coordinator commit of version {ver}")
            else:
                undo = _inject_coord(f, api_coord, w.timeout)
        if f is not None and f.role == "infer" and rank == 0:
            undo = _inject_infer(f, tx, store, w)
        t0 = time.monotonic()
        try:
            tx.push(v, commit=commit)
            r = {"ok": True}
        except Exception as e:
            r = {"ok": False, "type": type(e).__name__, "msg": str(e),
                 "cause": type(e.__cause__).__name__ if e.__cause__ is not None else None}
        r["seconds"] = time.monotonic() - t0
        for u in undo:
            u()
        rec[k] = r
        _save(path, rec)
        store.set(f"pushed/{k}/{rank}", b"1")
        if p.last:
            break
    _save(path, rec)
    os._exit(0)  # a peer may be dead: no collective teardown (its Gloo group would wait for it)


def _nth(n: int, fn, act):
    """``fn`` wrapped: the ``n``-th call runs ``act()`` first."""
    calls = {"n": 0}

    def wrapped(*a, **kw):
        calls["n"] += 1
        if calls["n"] == n:
            act()
        return fn(*a, **kw)
    return wrapped


def _inject_train(f: Fault, tx, executor, api, timeout: float) -> list:
    what = f"training rank {f.rank} {'in' if f.kind.startswith(('outsider', 'forge')) else 'fails in'} {f.stage}"
    act = lambda: _act(f.kind, timeout, what)  # noqa: E731
    if f.stage == "prepare":
        real = executor.prepare_outputs
        executor.prepare_outputs = _nth(3, real, act)
        return [lambda: setattr(executor, "prepare_outputs", real)]
    if f.stage == "write":
        tx.plan()
        real = tx.transport.write
        tx.transport.write = _nth(2, real, act)
        return [lambda: setattr(tx.transport, "write", real)]
    if f.stage == "release":
        real = executor.Executor._release
        executor.Executor._release = _nth(2, real, act)
        return [lambda: setattr(executor.Executor, "_release", real)]
    if f.stage == "plan":
        real = api.Sender._build
        executor_was = tx.executor
        assert executor_was is None, "a plan fault needs the first push"
        api.Sender._build = _nth(1, real, act)
        return [lambda: setattr(api.Sender, "_build", real)]
    raise ValueError(f"no training stage {f.stage!r}")


def _inject_coord(f: Fault, api, timeout: float) -> list:
    if f.stage == "plan":
        from weight_transfer.types import PlanError

        real = api.plan_against

        def refused(*a, **kw):
            if f.kind == "raise":
                raise PlanError("injected: the coordinator's plan is refused")
            _act(f.kind, timeout, "coordinator plan")
            return real(*a, **kw)
        api.plan_against = refused
        return [lambda: setattr(api, "plan_against", real)]
    if f.stage == "decide":  # after every rank said ready, before the coordinator's decision
        real_decide = api.Coordinator._decide

        def decide(self, *a, **kw):
            _act(f.kind, timeout, "coordinator decide")
            return real_decide(self, *a, **kw)
        api.Coordinator._decide = decide
        return [lambda: setattr(api.Coordinator, "_decide", real_decide)]
    raise ValueError(f"no coordinator stage {f.stage!r} in rank 0")


def _inject_infer(f: Fault, tx, store, w: World) -> list:
    """Training rank 0's first write of the version makes inference rank ``f.rank``'s fault."""
    from weight_transfer.control import protocol as control

    tx.plan()
    real = tx.transport.write
    pid = control.get(store, f"meta/infer/{f.rank}")[0].pid

    def act():
        if f.kind == "kill":
            os.kill(pid, signal.SIGKILL)
            store.set(f"dead/{f.rank}", b"1")
            time.sleep(0.3)
        elif f.kind == "stall":
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(1.5, lambda: os.kill(pid, signal.SIGCONT)).start()
        elif f.kind == "raise":  # the engine shuts down: its receiver closes mid-update
            store.set(f"close/{f.rank}", b"1")
            _wait(store, f"closed/{f.rank}", 10)
    tx.transport.write = _nth(1, real, act)
    return [lambda: setattr(tx.transport, "write", real)]


# ------------------------------------------------------------------------------- coordinator


def coord_main(addr, w: World, out: str) -> None:
    import weight_transfer as wt

    store = wt.connect_store(addr, timeout=30)
    # The world's control timeout (seconds) bounds how long a fault goes unnamed in an update, not
    # how long the other processes take to start: on a loaded machine importing torch and building
    # an FSDP2 module alone can take longer. The coordinator is built once every rank's metadata
    # is in (bounded: a rank that never starts fails the world after 120 s, its error named).
    keys = [f"meta/train/{r}" for r in range(w.n_train)] + [f"meta/infer/{i}" for i in range(w.n_infer)]
    deadline = time.monotonic() + 120.0
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(0.05)
    coord = wt.Coordinator(store, n_train=w.n_train, n_infer=w.n_infer, model_config=_cfg(), layout=_layout(w),
                           timeout=w.timeout)
    faults = {k: p.fault for k, p in enumerate(w.pushes) if p.fault is not None and p.fault.role == "coord"}
    served = {"n": 0}
    if faults.get(0) is not None and faults[0].stage == "plan":
        import weight_transfer.api.coordinator as api_coord

        _inject_coord(faults[0], api_coord, w.timeout)

    def commit(ver):
        f = faults.get(served["n"])
        if f is not None and f.stage == "commit":
            _act(f.kind, w.timeout, f"coordinator commit of version {ver}")

    out_rec = {}
    try:
        for k in range(len(w.pushes)):
            served["n"] = k
            coord.serve(count=1, commit=commit)
            out_rec[k] = [type(e).__name__ for _, e in coord.failures]
    except Exception as e:
        out_rec["error"] = f"{type(e).__name__}: {e}"
    _save(f"{out}/coord.pkl", out_rec)
    os._exit(0)


# ------------------------------------------------------------------------------- inference rank


def infer_main(rank: int, addr, w: World, out: str) -> None:
    import torch

    import weight_transfer as wt
    from weight_transfer.engines import Engine, expected_from_checkpoint
    from weight_transfer.testing.catalog import param_specs
    from weight_transfer.testing.weights import SyntheticCheckpoint

    torch.set_num_threads(1)
    store = wt.connect_store(addr, timeout=30)
    cfg, lay = _cfg(), _layout(w)
    engine = Engine(cfg, lay, rank)
    engine.arena.fill_(0xA5)  # canary: no version yet
    rx = wt.Receiver.from_arena(engine.arena, engine.tensor_metas(), rank=rank, store=store, timeout=w.timeout,
                                shadow=w.shadow, adopt=engine.rebind if w.shadow == "flip" else None)
    if w.shadow:
        rx.serve_go_live()
    specs = param_specs(cfg)
    want: dict[int, torch.Tensor] = {}
    rec: dict = {}
    path = f"{out}/infer{rank}.pkl"
    closed = False
    for k in range(len(w.pushes)):
        key = f"check/{k}"
        while not store.check([key]):
            if not closed and store.check([f"close/{rank}"]):
                rx.close()
                closed = True
                store.set(f"closed/{rank}", b"1")
            if store.check(["end"]):
                break
            time.sleep(0.005)
        if not store.check([key]):
            break
        try:
            s = rx.state()
        except Exception as e:  # a state the receiver refused (C30): recorded, never read as a version
            rec[k] = {"state": "refused", "version": None, "error": f"{type(e).__name__}: {e}", "bytes_ok": None,
                      "closed": closed, "live_version": rx.live_version, "canary": None, "digest": None, "seq": None}
            _save(path, rec)
            store.set(f"checked/{k}/{rank}", b"1")
            continue
        ok = None
        if s.complete and s.version >= 0:
            if s.version not in want:
                ck = SyntheticCheckpoint(specs, step=s.version, seed=0)
                want[s.version] = expected_from_checkpoint(cfg, lay, rank, ck.__getitem__, ck.names()).arena
            ok = bool(torch.equal(engine.arena, want[s.version]))
        rec[k] = {"state": s.state, "version": s.version, "seq": s.seq, "bytes_ok": ok, "closed": closed,
                  "live_version": rx.live_version,
                  "digest": hashlib.sha1(engine.arena.numpy().tobytes()).hexdigest(),
                  "canary": bool((engine.arena == 0xA5).all())}
        _save(path, rec)
        store.set(f"checked/{k}/{rank}", b"1")
    _save(path, rec)
    os._exit(0)


# ------------------------------------------------------------------------------- the test's side


def run(w: World, out: str, *, limit: float = 240.0, inspect=None, on_start=None) -> World:
    """Start every process of ``w``, run its pushes in lockstep, collect what each recorded
    into ``w.results``: ``{"train": {rank: {k: result}}, "infer": {rank: {k: check}},
    "coord": ..., "exit": {name: exitcode}, "left": [names still alive at the end]}``;
    ``inspect(store)`` (optional: the store this process serves, at the end) goes to
    ``w.results["inspect"]``; ``on_start(store)`` runs once the store serves, before any process starts."""
    import multiprocessing as mp

    import weight_transfer as wt

    store = wt.serve_store("127.0.0.1", 0)
    addr = ("127.0.0.1", store.port)
    if on_start is not None:
        on_start(store)
    ctx = mp.get_context("spawn")
    procs = {f"infer{i}": ctx.Process(target=infer_main, args=(i, addr, w, out)) for i in range(w.n_infer)}
    procs.update({f"train{r}": ctx.Process(target=train_main, args=(r, addr, w, out)) for r in range(w.n_train)})
    if w.coordinator == "process":
        procs["coord"] = ctx.Process(target=coord_main, args=(addr, w, out))
    for p in procs.values():
        p.start()
    deadline = time.monotonic() + limit
    dead_infer: set[int] = set()
    for k, p in enumerate(w.pushes):
        store.set(f"next/{k}", b"1")
        alive_train = [r for r in range(w.n_train) if procs[f"train{r}"].is_alive()]
        while time.monotonic() < deadline:  # every live training rank finished push k (or died)
            alive_train = [r for r in alive_train if procs[f"train{r}"].is_alive()]
            if all(store.check([f"pushed/{k}/{r}"]) for r in alive_train):
                break
            time.sleep(0.01)
        dead_infer |= {i for i in range(w.n_infer) if store.check([f"dead/{i}"])}
        store.set(f"check/{k}", b"1")
        for i in range(w.n_infer):
            if i in dead_infer:
                continue
            while time.monotonic() < deadline and procs[f"infer{i}"].is_alive():
                if store.check([f"checked/{k}/{i}"]):
                    break
                time.sleep(0.01)
        if p.last:
            break
    store.set("end", b"1")
    for p in procs.values():
        p.join(max(1.0, min(60.0, deadline - time.monotonic())))
    left = [n for n, p in procs.items() if p.is_alive()]
    for p in procs.values():
        if p.is_alive():
            p.kill()
            p.join(5)

    def load(name):
        try:
            with open(f"{out}/{name}.pkl", "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            return {}
    w.results = {"train": {r: load(f"train{r}") for r in range(w.n_train)},
                 "infer": {i: load(f"infer{i}") for i in range(w.n_infer)},
                 "coord": load("coord") if w.coordinator == "process" else None,
                 "exit": {n: p.exitcode for n, p in procs.items()}, "left": left,
                 "inspect": inspect(store) if inspect is not None else None}
    store.close()
    return w
