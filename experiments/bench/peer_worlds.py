"""bench-peers' awex and Mooncake rows (``experiments/bench/peers.py``): one process per rank
around a store, "go" / "done" per update, timed by the controller from "go" to the last rank's
"done", every update verified by the receivers (:func:`~.peer_tensors.pattern`).

The store is the project's authenticated one (:func:`weight_transfer.serve_store`: the ranks,
spawned after it, inherit the job secret it exports); what the peers exchange through it is
data, msgpack (``msgspec``), never pickles: awex's rendezvous objects (its Mooncake transport
publishes ``(endpoint, [(signature, address, size, shape, dtype), ...])`` tuples and error
strings; arrays come back as tuples, as awex compares them) and Mooncake's
``(session, base address)``.

- ``awex``: awex's ``MooncakeTransport`` with a static ``TransferPlanBuilder`` plan, one-sided
  reads by the inference side from the training ranks' even ``dim 0`` shards into TP shards.
- ``mooncake``: the Mooncake transfer engine alone, training rank ``r`` writing inference rank
  ``r``'s image with one ``batch_transfer_sync_write`` per update.
"""
from __future__ import annotations

import datetime as dt
import multiprocessing as mp
import os
import time
import traceback

import msgspec
import torch

from .peer_tensors import check, pattern


def freeze(x):
    """Decoded msgpack with every array as a tuple (what the peers put were tuples), in maps too."""
    if isinstance(x, list):
        return tuple(freeze(v) for v in x)
    if isinstance(x, dict):
        return {k: freeze(v) for k, v in x.items()}
    return x


def dumps(value) -> bytes:
    """``value`` (numbers, strings, bytes, tuples, lists, dicts, None) as msgpack; TypeError for anything else."""
    return msgspec.msgpack.encode(value)


def loads(raw: bytes):
    """What :func:`dumps` wrote, arrays as tuples."""
    return freeze(msgspec.msgpack.decode(raw))


class _StoreMeta:
    """awex's metadata-client interface (``put_object`` / ``get_object`` / ``delete_if_exists``)
    on the store, so awex's rendezvous runs across processes without its HTTP meta server;
    values as data (:func:`dumps` / :func:`loads`)."""

    def __init__(self, store):
        self.store = store

    def put_object(self, key, value):
        self.store.set(key, dumps(value))

    def get_object(self, key, timeout=0):
        try:
            self.store.wait([key], dt.timedelta(seconds=max(float(timeout), 1.0)))
        except Exception as e:  # the store raises DistStoreError on timeout
            raise TimeoutError(f"{key}: {e}") from e
        return loads(self.store.get(key))

    def delete_if_exists(self, key):
        self.store.delete_key(key)


def _store(port: int | None, master: bool, timeout: float = 600.0):
    """The bench's store: served here (``master``; the secret made and exported for the ranks
    spawned next), or a rank's connection to it (the secret inherited)."""
    from weight_transfer.control.store import connect_store, serve_store

    if master:
        return serve_store("127.0.0.1", 0, timeout=timeout)
    return connect_store(("127.0.0.1", port), timeout=timeout)


def _worker(kind: str, role: str, rank: int, port: int, tensors, n_train: int, tp: int, n_steps: int) -> None:
    torch.set_num_threads(1)
    store = _store(port, False)
    try:
        run = {"awex": _awex_rank, "mooncake": _mooncake_rank}[kind]
        run(store, role, rank, tensors, n_train, tp, n_steps)
    except BaseException:
        store.set(f"error/{role}{rank}", traceback.format_exc(limit=6))
        raise


def _steps(store, role, rank, n_steps, prepare, transfer, verify):
    """Per update: prepare (untimed), ready, wait for go, transfer, done, verify (untimed)."""
    for s in range(n_steps):
        prepare(s)
        store.add(f"ready/{s}", 1)
        store.wait([f"go/{s}"])
        transfer(s)
        store.set(f"done/{s}/{role}{rank}", "1")
        ok = verify(s)
        store.set(f"ok/{s}/{role}{rank}", "" if ok is True else str(ok))


def run_world(kind: str, tensors, n_train: int, tp: int, steps: int, warmup: int, timeout: float) -> list[float | str]:
    """Start the ranks of one peer, time each update from "go" to the last "done"; returns
    per update its seconds, or the error text of a failed verification."""
    from weight_transfer.control import protocol as control

    store = _store(None, True)
    n = warmup + steps
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(kind, role, r, store.port, tensors, n_train, tp, n), daemon=True)
             for role, k in (("infer", tp), ("train", n_train)) for r in range(k)]
    names = [f"{role}{r}" for role, k in (("infer", tp), ("train", n_train)) for r in range(k)]
    for p in procs:
        p.start()

    def wait(keys, what):
        t_end = time.monotonic() + timeout
        while True:
            try:
                store.wait(keys, dt.timedelta(seconds=1))
                return
            except Exception:  # timeout of this slice: check the ranks
                errs = [control.get_text(store, f"error/{x}") for x in names if store.check([f"error/{x}"])]
                dead = [x for x, p in zip(names, procs) if p.exitcode not in (None, 0)]
                if errs or dead:
                    raise RuntimeError(f"{kind}: {what}: " + (errs[0].strip().splitlines()[-1] if errs else
                                                              f"ranks {dead} exited")) from None
                if time.monotonic() > t_end:
                    raise RuntimeError(f"{kind}: {what}: no answer within {timeout:.0f} s") from None

    out: list[float | str] = []
    try:
        for s in range(n):
            t_end = time.monotonic() + timeout
            while store.add(f"ready/{s}", 0) < len(procs):  # a counter: a store's wait cannot wait for a value
                time.sleep(0.002)
                if time.monotonic() > t_end or any(p.exitcode not in (None, 0) for p in procs):
                    wait([f"never/{s}"], f"step {s} ready")  # raises naming the failed rank, or times out
            t0 = time.perf_counter()
            store.set(f"go/{s}", "1")
            wait([f"done/{s}/{x}" for x in names], f"step {s}")
            sec = time.perf_counter() - t0
            wait([f"ok/{s}/{x}" for x in names], f"step {s} verify")
            bad = [f"{x}: {control.get_text(store, f'ok/{s}/{x}')}" for x in names if store.get(f"ok/{s}/{x}")]
            out.append("; ".join(bad) if bad else sec)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return out


# --------------------------------------------------------------------------------------------
# awex


def _awex_metas(tensors, n_train: int, tp: int):
    from awex.meta.weight_meta import ParameterMeta, ParameterReplicaMeta, ParameterShardMeta
    from awex.sharding.param_sharding import ShardingType

    def shard(t, rank, grank, box, world, num, dim, stype):
        shape = tuple(b - a for a, b in box)
        return ParameterShardMeta(tp_rank=rank, attn_tp_rank=rank, pp_rank=0, ep_rank=0, ep_tp_rank=0,
                                  global_rank=grank, world_size=world, engine_rank=0, name=t.name, shape=shape,
                                  numel=int(torch.Size(shape).numel()), dtype=torch.bfloat16,
                                  global_offset=tuple(a for a, _ in box), sharding_type=stype, num_shards=num,
                                  sharding_dim=dim)

    def meta(t, replicas):
        shards = [s for rep in replicas for s in rep]
        return ParameterMeta(name=t.name, global_numel=int(torch.Size(t.global_shape).numel()),
                             global_shape=t.global_shape, dtype=torch.bfloat16, shards=shards,
                             replicas=[ParameterReplicaMeta(shards=list(rep)) for rep in replicas])

    infer, train = [], []
    for t in tensors:
        if t.tp_dim is None:
            reps = [[shard(t, 0, r, t.infer_box(r, tp), tp, 1, 0, ShardingType.NO_SHARDING)] for r in range(tp)]
        else:
            reps = [[shard(t, r, r, t.infer_box(r, tp), tp, tp, t.tp_dim, ShardingType.TP_SHARDING) for r in range(tp)]]
        infer.append(meta(t, reps))
        # training shards carry the training-world rank; awex's transfer rank is tp + that rank
        train.append(meta(t, [[shard(t, r, r, t.train_box(r, n_train), n_train, n_train, 0,
                                     ShardingType.TP_SHARDING) for r in range(n_train)]]))
    return infer, train


def _awex_rank(store, role, rank, tensors, n_train, tp, n_steps):
    os.environ.setdefault("AWEX_MOONCAKE_HOST", "127.0.0.1")
    os.environ.setdefault("AWEX_MOONCAKE_PROTOCOL", "tcp")
    os.environ.setdefault("AWEX_DEVICE_TYPE", "cpu")
    from awex.transfer.mooncake_comm import MooncakeTransport
    from awex.transfer.transfer_plan import TransferPlanBuilder

    infer_meta, train_meta = _awex_metas(tensors, n_train, tp)
    grank = rank if role == "infer" else tp + rank
    plan = TransferPlanBuilder(tp, n_train, 1).build_local_transfer_plan(infer_meta, train_meta, grank)
    transport = MooncakeTransport(_StoreMeta(store), grank, timeout=600)
    if role == "train":
        boxes = {t.name: (t, t.train_box(rank, n_train)) for t in tensors}
        held: dict[str, torch.Tensor] = {}

        def prepare(s):
            for name, (t, box) in boxes.items():
                held[name] = pattern(box, t.tid, s)

        _steps(store, role, rank, n_steps, prepare, lambda s: transport.send(dict(held), plan, s), lambda s: True)
    else:
        boxes = {t.name: (t, t.infer_box(rank, tp)) for t in tensors}
        target = {name: torch.zeros(tuple(b - a for a, b in box), dtype=torch.bfloat16) for name, (t, box) in boxes.items()}

        def verify(s):
            bad = [name for name, (t, box) in boxes.items() if not check(target[name], box, t.tid, s)]
            return True if not bad else f"{len(bad)} tensors differ, first {bad[0]}"

        _steps(store, role, rank, n_steps, lambda s: None, lambda s: transport.receive(target, plan, s), verify)


# --------------------------------------------------------------------------------------------
# Mooncake transfer engine alone


def _mooncake_rank(store, role, rank, tensors, n_train, tp, n_steps):
    from mooncake.engine import TransferEngine

    if n_train != tp:
        raise ValueError("the mooncake row pairs training rank r with inference rank r: needs n_train == tp")
    eng = TransferEngine()
    if eng.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError("Mooncake initialize failed")
    boxes = [(t, t.infer_box(rank, tp)) for t in tensors]
    sizes = [2 * int(torch.Size(tuple(b - a for a, b in box)).numel()) for _, box in boxes]
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    arena = torch.zeros(sum(sizes), dtype=torch.uint8)
    if eng.register_memory(arena.data_ptr(), arena.numel()) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    views = [arena[o:o + n].view(torch.bfloat16).view(tuple(b - a for a, b in box))
             for o, n, (_, box) in zip(offs, sizes, boxes)]
    if role == "infer":
        store.set(f"mc/{rank}", dumps((f"127.0.0.1:{eng.get_rpc_port()}", arena.data_ptr())))

        def verify(s):
            store.wait([f"done/{s}/train{rank}"])  # the writer's batch completed (one-sided: nothing to receive)
            bad = [t.name for (t, box), v in zip(boxes, views) if not check(v, box, t.tid, s)]
            return True if not bad else f"{len(bad)} tensors differ, first {bad[0]}"

        _steps(store, role, rank, n_steps, lambda s: None, lambda s: None, verify)
        store.wait([f"mc_exit/{rank}"])
    else:
        store.wait([f"mc/{rank}"])
        session, base = msgspec.msgpack.decode(store.get(f"mc/{rank}"), type=tuple[str, int], strict=True)
        src = [arena.data_ptr() + o for o in offs]
        dst = [base + o for o in offs]

        def prepare(s):
            for (t, box), v in zip(boxes, views):
                v.copy_(pattern(box, t.tid, s))

        def transfer(s):
            rc = eng.batch_transfer_sync_write(session, src, dst, sizes)
            if rc != 0:
                raise RuntimeError(f"batch_transfer_sync_write returned {rc}")

        _steps(store, role, rank, n_steps, prepare, transfer, lambda s: True)
        store.set(f"mc_exit/{rank}", "1")
