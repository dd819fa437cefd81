"""The ``torchstore`` row of ``weight-transfer bench-peers``: meta-pytorch/torchstore at its
public API, in torchstore's own interpreter.

torchstore needs torchmonarch (its actors); the project's environment does not carry it, so
``scripts/install_torchstore.sh`` builds a separate virtual environment (default
``/opt/wt-torchstore``, the project's torch 2.13.0, torchstore from a pinned source commit,
torchmonarch 0.4.1). ``peers.py`` runs this file in that interpreter as a subprocess::

    /opt/wt-torchstore/bin/python experiments/bench/torchstore_peer.py SPEC.json OUT.json

SPEC.json: ``{"tensors": [[tid, name, global_shape, tp_dim], ...], "n_train", "tp", "steps",
"warmup", "transport", "timeout"}``; OUT.json: ``{"seconds": [...], "phases": [...],
"errors": [...], "versions": {...}}`` (per update: its seconds, or the verification error text).
This file imports only torch, torchstore and monarch, and ``pattern``/``PeerTensor`` from
``peer_tensors.py`` beside it (loaded by path when ``weight_transfer`` is not installed here).

The world, as the other rows: a monarch controller (this process) spawns ``n_train`` trainer
processes and ``tp`` generator processes on this host. Each trainer rank holds its even ``dim 0``
shard of every engine tensor's global form as a DTensor (``Shard(0)`` over a gloo mesh of the
trainers, FSDP's cut); each generator holds its TP part (``Shard(tp_dim)`` over a gloo mesh of
the generators, ``Replicate`` for replicated tensors). torchstore runs with one storage volume
per trainer rank, spawned in the trainer's own process (``LocalRankStrategy``, ``mesh=`` the
trainers: the volume of a trainer is local to it). An update is torchstore's weight-sync
pattern, same keys every update (torchstore reuses each key's storage): every trainer
``ts.put_batch({name: dtensor})``, then every generator ``ts.get_batch({name: dtensor})`` into
its preallocated tensors (torchstore computes the overlaps of the stored slices with the
requested ones and copies them in place). Time = the controller's wall clock from issuing the
puts to the last generator's get returning; the pattern is written into the trainers' shards
before (untimed) and each generator checks its bytes bit for bit after (untimed).

Transports (``transport``): ``shm`` (SharedMemory: the trainer copies into a POSIX shared
segment its volume owns, the generator copies out of it: torchstore's default on one host),
``rdma_tcp`` (MonarchRDMA with monarch's TCP fallback, no ibverbs here), ``gloo``
(torch.distributed gloo send/recv between client and volume), ``rpc`` (MonarchRPC: the tensor
pickled through monarch's actor messages), ``direct_tcp`` (torchstore's DirectWeightSync:
each trainer registers its shards once as monarch RDMABuffers and puts the handles in the store;
each generator reads the trainers' shards directly, one hop, no storage volume, over the same
TCP fallback; a generator whose TP part overlaps a shard only partly reads the whole shard into a
receive buffer and copies the overlap, as torchstore does).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback

import torch

try:
    from weight_transfer.experiments.bench.peer_tensors import PeerTensor, pattern
except ImportError:  # torchstore's own environment: peer_tensors.py beside this file, by path
    import importlib.util

    _spec = importlib.util.spec_from_file_location("_wt_peers", os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer_tensors.py"))
    _peers = importlib.util.module_from_spec(_spec)
    sys.modules["_wt_peers"] = _peers
    _spec.loader.exec_module(_peers)
    PeerTensor, pattern = _peers.PeerTensor, _peers.pattern

TRANSPORTS = ("shm", "rdma_tcp", "gloo", "rpc", "direct_tcp")


def _transport_type(name: str):
    from torchstore.transport import TransportType

    return {"shm": TransportType.SharedMemory, "rdma_tcp": TransportType.MonarchRDMA, "direct_tcp": TransportType.SharedMemory,
            "gloo": TransportType.Gloo, "rpc": TransportType.MonarchRPC}[name]


def _env_for(transport: str) -> None:
    if transport in ("rdma_tcp", "direct_tcp"):
        import monarch

        monarch.configure(rdma_allow_tcp_fallback=True)


try:
    from monarch.actor import Actor, current_rank, endpoint
except ImportError:  # imported for its docstring / constants from the project's environment
    Actor, current_rank = object, None

    def endpoint(f):
        return f


class _Rank(Actor):
    """One trainer or generator process: a gloo group among its role, DTensors over it."""

    def __init__(self, role: str, world: int, port: int, tensors, transport: str):
        torch.set_num_threads(1)
        self.role, self.world, self.rank = role, world, current_rank().rank
        self.tensors = [PeerTensor(int(i), n, tuple(s), d) for i, n, s, d in tensors]
        os.environ["LOCAL_RANK"] = str(self.rank)  # LocalRankStrategy's client id
        os.environ.pop("RANK", None)
        _env_for(transport)
        self.port, self.transport = port, transport
        self.local: dict[str, torch.Tensor] = {}
        self.dt: dict = {}

    @endpoint
    async def setup(self) -> str:
        import datetime as dt

        from torch.distributed import TCPStore
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        store = TCPStore("127.0.0.1", self.port, self.world, self.rank == 0, dt.timedelta(seconds=600))
        torch.distributed.init_process_group("gloo", store=store, rank=self.rank, world_size=self.world)
        mesh = init_device_mesh("cpu", (self.world,))
        for t in self.tensors:
            if self.role == "train":
                box, place = t.train_box(self.rank, self.world), [Shard(0)]
            else:
                box = t.infer_box(self.rank, self.world)
                place = [Replicate()] if t.tp_dim is None else [Shard(t.tp_dim)]
            local = torch.zeros(tuple(b - a for a, b in box), dtype=torch.bfloat16)
            self.local[t.name] = local
            self.dt[t.name] = DTensor.from_local(local, mesh, place, run_check=False, shape=torch.Size(t.global_shape),
                                                 stride=torch.empty(t.global_shape, device="meta").stride())
        if self.transport == "direct_tcp":
            import torchstore as ts
            from torchstore.direct_weight_sync import RDMA_KEY_PREFIX, DirectWeightSyncDest, DirectWeightSyncSource

            if self.role == "train":  # register the shards once; the handles go through the store
                self.source = DirectWeightSyncSource()
                await ts.put(f"{RDMA_KEY_PREFIX}/rank_{self.rank}", self.source.register(dict(self.dt), rank=self.rank))
            else:
                self.dest, self.handles = DirectWeightSyncDest(), None
        return f"{self.role}{self.rank}"

    @endpoint
    async def fetch_handles(self, n_train: int) -> None:
        import torchstore as ts
        from torchstore.direct_weight_sync import RDMA_KEY_PREFIX

        per_rank = [await ts.get(f"{RDMA_KEY_PREFIX}/rank_{r}") for r in range(n_train)]
        self.handles = {name: [h[name] for h in per_rank] for name in self.dt}

    @endpoint
    async def prepare(self, step: int) -> None:
        for t in self.tensors:
            self.local[t.name].copy_(pattern(t.train_box(self.rank, self.world), t.tid, step))

    @endpoint
    async def push(self, step: int) -> float:
        import torchstore as ts

        t0 = time.perf_counter()
        if self.transport != "direct_tcp":  # direct: the generators read the registered shards themselves
            await ts.put_batch(dict(self.dt))
        return time.perf_counter() - t0

    @endpoint
    async def pull(self, step: int) -> float:
        import torchstore as ts

        t0 = time.perf_counter()
        if self.transport == "direct_tcp":
            await self.dest.pull(self.handles, dict(self.dt))
            return time.perf_counter() - t0
        got = await ts.get_batch(dict(self.dt))
        sec = time.perf_counter() - t0
        for name, v in got.items():
            if v is not self.dt[name] and v.to_local().data_ptr() != self.local[name].data_ptr():
                self.local[name].copy_(v.to_local() if hasattr(v, "to_local") else v)  # not in place: count it as received
        return sec

    @endpoint
    async def verify(self, step: int) -> str:
        bad = [t.name for t in self.tensors if not torch.equal(
            self.local[t.name].view(torch.int16), pattern(t.infer_box(self.rank, self.world), t.tid, step).view(torch.int16))]
        return "" if not bad else f"generator{self.rank}: {len(bad)} tensors differ, first {bad[0]}"


async def _run(spec: dict) -> dict:
    import portpicker
    import torchstore as ts
    from monarch.actor import this_host

    transport = spec["transport"]
    _env_for(transport)
    n_train, tp = int(spec["n_train"]), int(spec["tp"])
    n = int(spec["warmup"]) + int(spec["steps"])
    train_mesh = this_host().spawn_procs(per_host={"gpus": n_train}, name="wt_trainers")
    gen_mesh = this_host().spawn_procs(per_host={"gpus": tp}, name="wt_generators")
    await train_mesh.initialized
    await gen_mesh.initialized
    await ts.initialize(num_storage_volumes=n_train, strategy=ts.LocalRankStrategy(default_transport_type=_transport_type(transport)),
                        mesh=train_mesh)
    trainers = train_mesh.spawn("wt_trainer", _Rank, "train", n_train, portpicker.pick_unused_port(), spec["tensors"], transport)
    gens = gen_mesh.spawn("wt_generator", _Rank, "infer", tp, portpicker.pick_unused_port(), spec["tensors"], transport)
    await asyncio.gather(trainers.setup.call(), gens.setup.call())
    if transport == "direct_tcp":
        await gens.fetch_handles.call(n_train)
    seconds, phases, errors = [], [], []
    try:
        for s in range(n):
            await trainers.prepare.call(s)
            t0 = time.perf_counter()
            put = await trainers.push.call(s)
            t1 = time.perf_counter()
            get = await gens.pull.call(s)
            t2 = time.perf_counter()
            bad = [x for _, x in (await gens.verify.call(s)).items() if x]
            seconds.append(t2 - t0 if not bad else "; ".join(bad))
            phases.append(dict(put=t1 - t0, get=t2 - t1, put_max=max(v for _, v in put.items()),
                               get_max=max(v for _, v in get.items())))
    finally:
        try:
            await ts.shutdown()
        except Exception as e:  # teardown noise must not hide the numbers
            errors.append(f"shutdown: {type(e).__name__}: {e}")
        for m in (train_mesh, gen_mesh):
            try:
                await m.stop()
            except Exception:
                pass
    return dict(seconds=seconds, phases=phases, errors=errors)


def versions() -> dict:
    from importlib.metadata import version

    out = {}
    for d in ("torchstore", "torchmonarch", "torch"):
        try:
            out[d] = version(d)
        except Exception:
            out[d] = "-"
    try:
        import torchstore

        out["torchstore_commit"] = open(os.path.join(os.path.dirname(torchstore.__file__), "..", "torchstore.commit")).read().strip()
    except Exception:
        pass
    return out


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    try:
        res = asyncio.run(asyncio.wait_for(_run(spec), timeout=float(spec.get("timeout", 600)) * (int(spec["steps"]) + int(spec["warmup"]) + 1)))
        res["versions"] = versions()
        rc = 0
    except BaseException as e:
        res = dict(failed=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=8))
        rc = 1
    with open(out_path, "w") as f:
        json.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # monarch's runtime threads can abort the interpreter's own teardown ("FATAL: exception not
    # rethrown", SIGABRT) after everything is written: leave without it
    os._exit(rc)


if __name__ == "__main__":
    if __package__ in (None, ""):  # run by path: import this file as a module so monarch can pickle its actor by name
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        os.environ["PYTHONPATH"] = os.path.dirname(os.path.abspath(__file__)) + os.pathsep + os.environ.get("PYTHONPATH", "")
        import torchstore_peer

        sys.exit(torchstore_peer.main(sys.argv[1:]))
    sys.exit(main(sys.argv[1:]))
