"""Peers side by side: the same tensor set and world through our reference and other systems.

    weight-transfer bench-peers                       # the default, every peer installed
    weight-transfer bench-peers --peers reference,mooncake --steps 3
    weight-transfer bench-peers --peers reference,torchstore --torchstore-transports shm
    pip install -e '.[peers]'                               # awex + Mooncake (docs/PEERS.md)
    bash scripts/install_torchstore.sh                      # torchstore, its own venv (docs/PEERS.md)

World: 2 training processes -> 2 inference processes (one TP=2 engine), BF16, the main job's
default model (``weight_transfer.experiments.config.main_job_default`` with ``quant=None``; ``--model`` and
``--override`` pick another). What lands per update is the TP=2 engine's tensors: their names,
shapes and bytes (``weight_transfer.engines.engine.engine_tensor_metas``), about 1.9 GB.

Rows (each a fresh set of processes, run one after the other in this command):

- ``reference``: this project's trial (``weight_transfer.experiments.trial.run_trial``): FSDP2 training ranks,
  the static plan, one-sided ``process_vm_writev`` writes into the engine's memory, every update
  verified against the engine's own ``load_weights`` on the full checkpoint.
- ``awex``: awex 0.9.0's ``MooncakeTransport`` (Mooncake transfer engine over TCP, one-sided
  *reads* by the inference side, a static ``TransferPlanBuilder`` plan computed once). Each
  engine tensor's global (pre-TP) tensor is held by the training ranks as even ``dim 0`` shards
  (FSDP's cut) and by the inference ranks as TP shards on vLLM's TP dimension (column-parallel
  tensors on dim 0, ``o_proj``/``down_proj``/``w2_weight`` on the last, ``w13_weight`` on 1,
  replicated ones whole): awex computes the overlaps and moves them. awex converts names and
  fuses projections in its own converters (Megatron -> SGLang/vLLM); those are not exercised
  here, only its plan and data path on the same bytes.
- ``mooncake``: the Mooncake transfer engine alone over TCP, the transport floor with no
  resharding: training rank ``r`` holds inference rank ``r``'s image and writes it with one
  ``batch_transfer_sync_write`` per update (one op per engine tensor, memory registered once).
- ``torchstore``: meta-pytorch/torchstore (git, pinned in ``scripts/install_torchstore.sh``) with
  torchmonarch 0.7.0, one row per transport it has on a CPU machine (``--torchstore-transports``):
  shared memory (its same-host default), monarch RDMA over its TCP fallback, DirectWeightSync
  (one-hop reads of the trainers' registered shards, same fallback), gloo, monarch RPC. The
  trainer ranks hold FSDP's even ``dim 0`` shards as DTensors and ``ts.put_batch`` them, the
  generators ``ts.get_batch`` their TP DTensors in place (torchstore reshards), same keys every
  update, one storage volume per trainer in the trainer's process. torchstore's 0.1.2 release
  pins ``torch==2.9.0``, so it lives in its own virtual environment (default
  ``/opt/wt-torchstore``, the project's torch 2.13.0); this command runs that row in that
  interpreter as a subprocess (``experiments/bench/torchstore_peer.py``, whose docstring says
  what it does), with the same tensor set, pattern and verification.

Every peer row is verified: each step's bytes are a pattern of (tensor, global index, step)
that the receivers recompute on their own and compare bit for bit (as int16, so NaN patterns
compare too). ``time`` is the controller's wall clock from "go" to the last rank's "done"
(TCPStore keys), per update; p50 over the measured updates. memcpy is measured in this command
before every row (one thread, 256 MiB, best of 3; the median of those is printed). A peer that
is not installed, or fails, is listed under the table with the reason.

Output: an nccl-tests-style table on stdout; tidy rows in ``--csv`` (raw bytes and seconds).
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import multiprocessing as mp
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass

import torch

PEERS = ("reference", "awex", "mooncake", "torchstore")
TORCHSTORE_TRANSPORTS = ("shm", "direct_tcp", "rdma_tcp", "gloo", "rpc")  # torchstore_peer.TRANSPORTS
TORCHSTORE_LABEL = {"shm": "shm, same keys", "direct_tcp": "direct, rdma tcp fallback", "rdma_tcp": "rdma tcp fallback",
                    "gloo": "gloo", "rpc": "monarch rpc"}
TORCHSTORE_VENV = "/opt/wt-torchstore"  # scripts/install_torchstore.sh
_P = (7919, 104729, 1299709, 15485863)  # per-dimension pattern multipliers (primes)


# --------------------------------------------------------------------------------------------
# the tensor set


@dataclass(frozen=True, slots=True)
class PeerTensor:
    """One engine tensor as a global (pre-TP) BF16 tensor: ``tp_dim`` None = replicated on
    every inference rank (each gets the whole tensor), else each TP rank gets an even slice
    of ``global_shape`` along ``tp_dim``."""

    tid: int
    name: str
    global_shape: tuple[int, ...]
    tp_dim: int | None

    def infer_box(self, rank: int, tp: int) -> tuple[tuple[int, int], ...]:
        """(start, end) per dim of the part inference rank ``rank`` holds."""
        box = [(0, n) for n in self.global_shape]
        if self.tp_dim is not None:
            n = self.global_shape[self.tp_dim] // tp
            box[self.tp_dim] = (rank * n, (rank + 1) * n)
        return tuple(box)

    def train_box(self, rank: int, n_train: int) -> tuple[tuple[int, int], ...]:
        """(start, end) per dim of training rank ``rank``'s even dim-0 shard."""
        n0 = self.global_shape[0]
        per = -(-n0 // n_train)
        a, b = min(n0, rank * per), min(n0, (rank + 1) * per)
        return ((a, b),) + tuple((0, n) for n in self.global_shape[1:])


def _tp_dim(name: str, ndim: int) -> int:
    if any(k in name for k in ("o_proj", "down_proj", "w2_weight")):
        return ndim - 1
    if "w13_weight" in name:
        return 1
    return 0


def tensor_set(cfg) -> list[PeerTensor]:
    """The engine tensors of ``cfg`` (a TrialConfig, BF16, tp ranks of one instance) as
    :class:`PeerTensor` s, in the engine's order. Replicated = the recipes that write it send
    every inference rank the same bytes."""
    from weight_transfer.engines.engine import engine_tensor_metas
    from weight_transfer.plan import build_recipes

    mcfg, layout = cfg.model_config(), cfg.inference
    rs = build_recipes(mcfg, layout)
    n = layout.world_size
    replicated = {o.tensor for r in rs.recipes if len(r.ranks) == n for o in r.outputs}
    out = []
    for i, m in enumerate(engine_tensor_metas(mcfg, layout, 0)):
        if m.name in replicated:
            out.append(PeerTensor(i, m.name, tuple(m.shape), None))
        else:
            d = _tp_dim(m.name, len(m.shape))
            g = list(m.shape)
            g[d] *= layout.tp
            out.append(PeerTensor(i, m.name, tuple(g), d))
    return out


def pattern(box: tuple[tuple[int, int], ...], tid: int, step: int) -> torch.Tensor:
    """The BF16 bytes of ``box`` of tensor ``tid`` at ``step``: element value bits =
    (sum over dims of global index * prime + tid * 31 + step * 977) mod 2^16. Any rank can
    compute any part on its own (the receivers' independent check)."""
    shape = tuple(b - a for a, b in box)
    out = torch.empty(shape, dtype=torch.int16)
    if out.numel() == 0:
        return out.view(torch.bfloat16)
    nd = len(box)
    rows = max(1, (1 << 22) // max(1, out[0].numel() if nd > 1 else 1))
    tail = torch.zeros((), dtype=torch.int32)
    for d in range(1, nd):
        a, b = box[d]
        ix = (torch.arange(a, b, dtype=torch.int32) * _P[d % 4]) % 65536
        tail = tail.unsqueeze(-1) + ix if tail.dim() else ix
    c = (tid * 31 + step * 977) % 65536
    for r0 in range(0, shape[0], rows):
        r1 = min(shape[0], r0 + rows)
        ix0 = (torch.arange(box[0][0] + r0, box[0][0] + r1, dtype=torch.int32) * _P[0]) % 65536 + c
        v = ix0.view((-1,) + (1,) * (nd - 1)) + tail if nd > 1 else ix0
        out[r0:r1] = (v & 0xFFFF).to(torch.int16)
    return out.view(torch.bfloat16)


def _check(t: torch.Tensor, box, tid: int, step: int) -> bool:
    return torch.equal(t.contiguous().view(torch.int16), pattern(box, tid, step).view(torch.int16))


# --------------------------------------------------------------------------------------------
# process harness: a TCPStore, one process per rank, "go" / "done" per update


class _StoreMeta:
    """awex's metadata-client interface (``put_object`` / ``get_object`` / ``delete_if_exists``)
    on torch's TCPStore, so awex's rendezvous runs across processes without its HTTP meta
    server."""

    def __init__(self, store):
        self.store = store

    def put_object(self, key, value):
        self.store.set(key, pickle.dumps(value))

    def get_object(self, key, timeout=0):
        try:
            self.store.wait([key], dt.timedelta(seconds=max(float(timeout), 1.0)))
        except Exception as e:  # TCPStore raises RuntimeError/DistStoreError on timeout
            raise TimeoutError(f"{key}: {e}") from e
        return pickle.loads(self.store.get(key))

    def delete_if_exists(self, key):
        self.store.delete_key(key)


def _store(port: int | None, master: bool, timeout: float = 600.0):
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", port or 0, None, master, dt.timedelta(seconds=timeout), wait_for_workers=False)


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


def _run_world(kind: str, tensors, n_train: int, tp: int, steps: int, warmup: int, timeout: float) -> list[float | str]:
    """Start the ranks of one peer, time each update from "go" to the last "done"; returns
    per update its seconds, or the error text of a failed verification."""
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
                errs = [store.get(f"error/{x}").decode() for x in names if store.check([f"error/{x}"])]
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
            while store.add(f"ready/{s}", 0) < len(procs):  # a counter: TCPStore.wait cannot wait for a value
                time.sleep(0.002)
                if time.monotonic() > t_end or any(p.exitcode not in (None, 0) for p in procs):
                    wait([f"never/{s}"], f"step {s} ready")  # raises naming the failed rank, or times out
            t0 = time.perf_counter()
            store.set(f"go/{s}", "1")
            wait([f"done/{s}/{x}" for x in names], f"step {s}")
            sec = time.perf_counter() - t0
            wait([f"ok/{s}/{x}" for x in names], f"step {s} verify")
            bad = [f"{x}: {store.get(f'ok/{s}/{x}').decode()}" for x in names if store.get(f"ok/{s}/{x}")]
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
            bad = [name for name, (t, box) in boxes.items() if not _check(target[name], box, t.tid, s)]
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
        store.set(f"mc/{rank}", pickle.dumps((f"127.0.0.1:{eng.get_rpc_port()}", arena.data_ptr())))

        def verify(s):
            store.wait([f"done/{s}/train{rank}"])  # the writer's batch completed (one-sided: nothing to receive)
            bad = [t.name for (t, box), v in zip(boxes, views) if not _check(v, box, t.tid, s)]
            return True if not bad else f"{len(bad)} tensors differ, first {bad[0]}"

        _steps(store, role, rank, n_steps, lambda s: None, lambda s: None, verify)
        store.wait([f"mc_exit/{rank}"])
    else:
        store.wait([f"mc/{rank}"])
        session, base = pickle.loads(store.get(f"mc/{rank}"))
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


# --------------------------------------------------------------------------------------------
# torchstore: its own interpreter, experiments/bench/torchstore_peer.py as a subprocess


def torchstore_python(explicit: str = "") -> str | None:
    """The interpreter that imports torchstore and monarch: ``explicit``, else
    ``$WT_TORCHSTORE_PYTHON``, else ``/opt/wt-torchstore/bin/python`` (the install script's
    default), else this interpreter if it has torchstore; None if none exists."""
    from importlib.util import find_spec

    explicit = explicit or os.environ.get("WT_TORCHSTORE_PYTHON", "")
    if explicit:
        return explicit if os.path.exists(explicit) else None
    default = os.path.join(TORCHSTORE_VENV, "bin", "python")
    if os.path.exists(default):
        return default
    return sys.executable if find_spec("torchstore") and find_spec("monarch") else None


def _torchstore_probe(py: str) -> tuple[str | None, dict]:
    """(None, versions) if ``py`` imports torchstore and monarch, else (why not, {})."""
    code = ("import json, importlib.metadata as m, torchstore, monarch.actor, torch; "
            "print(json.dumps({d: m.version(d) for d in ('torchstore', 'torchmonarch', 'torch')}))")
    try:
        r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{py}: {type(e).__name__}: {e}", {}
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{py} cannot import torchstore/monarch ({tail}); scripts/install_torchstore.sh (docs/PEERS.md)", {}
    try:
        vers = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        vers = {}
    commit = os.path.join(os.path.dirname(os.path.dirname(py)), "torchstore.commit")
    if os.path.exists(commit):
        vers["commit"] = open(commit).read().strip()[:7]
    return None, vers


def _run_torchstore(py: str, transport: str, tensors, n_train: int, tp: int, steps: int, warmup: int,
                    timeout: float) -> tuple[list[float | str], list[dict]]:
    """One torchstore row: the runner in torchstore's interpreter, its own process group (killed
    whole on a timeout). Returns per update its seconds or the verification error, and the
    per-update put/get phases."""
    runner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchstore_peer.py")
    with tempfile.TemporaryDirectory(prefix="wt-torchstore-") as d:
        spec, out, log = (os.path.join(d, x) for x in ("spec.json", "out.json", "log.txt"))
        with open(spec, "w") as f:
            json.dump(dict(tensors=[[t.tid, t.name, list(t.global_shape), t.tp_dim] for t in tensors], n_train=n_train,
                           tp=tp, steps=steps, warmup=warmup, transport=transport, timeout=timeout), f)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "VIRTUAL_ENV")}
        with open(log, "w") as lf:
            p = subprocess.Popen([py, runner, spec, out], stdout=lf, stderr=subprocess.STDOUT, cwd=d, env=env,
                                 start_new_session=True)
            try:
                rc = p.wait(timeout=120 + timeout * (steps + warmup + 1))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                raise RuntimeError(f"torchstore {transport}: no result within {120 + timeout * (steps + warmup + 1):.0f} s") from None
            finally:
                try:  # monarch's proc meshes are children of the runner: none may outlive it
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        res = json.load(open(out)) if os.path.exists(out) else {}
        if "seconds" not in res:  # the runner writes its numbers before it exits
            why = res.get("failed") or (open(log).read().strip().splitlines() or [f"exit {rc}"])[-1]
            raise RuntimeError(f"torchstore {transport}: {why}")
    return [float(x) if isinstance(x, (int, float)) else str(x) for x in res["seconds"]], res.get("phases", [])


# --------------------------------------------------------------------------------------------
# the command


def _available(peer: str, ts_python: str = "") -> str | None:
    """None if ``peer`` can run here, else why not."""
    from importlib import import_module
    from importlib.metadata import PackageNotFoundError, version

    try:
        if peer == "awex":
            version("awex")
            for m in ("mooncake.engine", "transformers", "psutil", "megatron.core"):
                import_module(m)
        elif peer == "mooncake":
            import_module("mooncake.engine")
        elif peer == "torchstore":
            py = torchstore_python(ts_python)
            if py is None:
                where = ts_python or os.environ.get("WT_TORCHSTORE_PYTHON") or TORCHSTORE_VENV + "/bin/python"
                return (f"not installed: no {where} (torchstore 0.1.2 pins "
                        "torch==2.9.0, so it gets its own environment: scripts/install_torchstore.sh, docs/PEERS.md)")
            return _torchstore_probe(py)[0]
    except (PackageNotFoundError, ImportError) as e:
        if isinstance(e, PackageNotFoundError):
            return f"not installed ({e}); pip install -e '.[peers]' (docs/PEERS.md)"
        return f"cannot import ({e}); pip install -e '.[peers]', apt-get install libibverbs1 (docs/PEERS.md)"
    return None


def _version(dist: str) -> str:
    from importlib.metadata import version

    for d in (dist, f"{dist}-non-cuda"):
        try:
            return version(d)
        except Exception:
            pass
    return "-"


REFERENCE_LABEL = {"cma": "cma (process_vm_writev)", "shm": "shm (memcpy into mapping)"}
"""The reference's rows (``--reference-transports``): transport name -> table label."""


@dataclass(kw_only=True, slots=True)
class PeersBenchConfig:
    """Options of ``weight-transfer bench-peers``."""

    peers: tuple[str, ...] = PEERS
    """Peers to run, comma-separated, in this order (reference, awex, mooncake, torchstore)."""
    model: str | None = None
    """Catalog model; default: the main job's (Qwen3-30B-A3B architecture, served BF16 here)."""
    override: tuple[str, ...] = ()
    """HF-config overrides ``KEY=VALUE``, comma-separated (on top of the main job's)."""
    steps: int = 3
    """Measured updates per peer."""
    warmup: int = 1
    """Updates before the measured ones, per peer (connections, registration, plans)."""
    timeout: float = 600.0
    """Seconds one update (or a rank's start) may take before the peer is reported failed."""
    csv: str = "results/peers.csv"
    """CSV the tidy rows are appended to (raw bytes and seconds); empty for none."""
    torchstore_transports: tuple[str, ...] = TORCHSTORE_TRANSPORTS
    """torchstore rows, one per transport, comma-separated (shm, direct_tcp, rdma_tcp, gloo, rpc)."""
    torchstore_python: str = ""
    """Interpreter with torchstore + torchmonarch; default $WT_TORCHSTORE_PYTHON, else /opt/wt-torchstore/bin/python."""
    reference_transports: tuple[str, ...] = ("shm", "cma")
    """Reference rows, one per transport, comma-separated: shm (a memcpy into the receiver's
    shared segment, mapped once; what ``weight-transfer run`` picks for these receivers), cma
    (process_vm_writev, what it writes into vLLM's tensors with)."""

    def __post_init__(self):
        if self.steps < 1 or self.warmup < 0:
            raise ValueError(f"steps={self.steps}, warmup={self.warmup}: need steps >= 1, warmup >= 0")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ValueError(f"unknown peer(s) {unknown}; choose from {', '.join(PEERS)}")
        badr = [t for t in self.reference_transports if t not in REFERENCE_LABEL]
        if badr or not self.reference_transports:
            raise ValueError(f"unknown reference transport(s) {badr}; choose from {', '.join(REFERENCE_LABEL)}")
        bad = [t for t in self.torchstore_transports if t not in TORCHSTORE_TRANSPORTS]
        if bad or not self.torchstore_transports:
            raise ValueError(f"unknown torchstore transport(s) {bad}; choose from {', '.join(TORCHSTORE_TRANSPORTS)}")
        for kv in self.override:
            if "=" not in kv:
                raise ValueError(f"override {kv!r}: wants KEY=VALUE")


def main(a: PeersBenchConfig) -> int:
    """Run each peer in turn, print the table, append ``a.csv``. Returns 0 when every peer that
    ran was verified, 1 otherwise (or when none ran)."""
    # imported here: torchstore's own environment loads this file by path for PeerTensor/pattern only
    from weight_transfer.experiments.cli import key_value
    from weight_transfer.experiments.config import TrialConfig, main_job_default
    from weight_transfer.experiments.env import environment, measure_memcpy_gbps
    from weight_transfer.experiments.report import percentile
    from weight_transfer.experiments.trial import run_trial

    peers = list(a.peers)
    base = main_job_default() if a.model is None else TrialConfig.from_flat(model=a.model)
    ov = dict(base.model.overrides)
    ov.update(dict(key_value(s) for s in a.override))
    cfg = base.replace(overrides=ov, quant=None, steps=a.steps, warmup=a.warmup, method="reference",
                       timeout=max(base.transfer.control.timeout, a.timeout))
    tensors = tensor_set(cfg)
    tp, n_train = cfg.inference.tp, cfg.train.n_train
    nbytes = sum(2 * int(torch.Size(b - a for a, b in t.infer_box(r, tp)).numel()) for t in tensors for r in range(tp))
    env = environment()
    run_id, stamp = uuid.uuid4().hex[:8], dt.datetime.now().isoformat(timespec="seconds")
    mcfg = cfg.model_config()
    print(f"# bench-peers: the same tensor set and world through each system; run {run_id}, git {env['git_sha']}, {stamp}")
    ts_py, ts_vers = torchstore_python(a.torchstore_python), {}
    if "torchstore" in peers and ts_py:
        ts_vers = _torchstore_probe(ts_py)[1]
    ts_desc = (f"torchstore {ts_vers.get('commit') or ts_vers.get('torchstore', '-')} (torchmonarch "
               f"{ts_vers.get('torchmonarch', '-')}, torch {ts_vers.get('torch', '-')}, {ts_py})") if ts_vers else "torchstore -"
    print(f"# host {env['host']}: {env['cpus']} cpus, torch {env['torch']}, python {env['python']}; "
          f"awex {_version('awex')}, mooncake-transfer-engine {_version('mooncake-transfer-engine')}, {ts_desc}")
    print(f"# model: {mcfg.label}; {n_train} training ranks -> {tp} inference ranks (TP={tp}), BF16, "
          f"{len(tensors)} engine tensors, {nbytes} B per update")
    print(f"# {a.warmup} warm-up + {a.steps} measured updates per peer, every update verified bit-exact; "
          f"time = 'go' to the last rank done")
    print("#")
    print(f"# {'peer':>10} {'transport':>26} {'bytes':>12} {'cold':>8} {'p50':>8} {'p95':>8} {'min':>8} {'max':>8} "
          f"{'algbw':>7} {'%memcpy':>8} {'ref/peer':>8} {'verified':>9}")
    print(f"# {'':>10} {'':>26} {'(B)':>12} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'(s)':>8} {'(GB/s)':>7} {'':>8} "
          f"{'(x)':>8} {'':>9}")
    rows, skipped, memcpys = [], [], []
    ref_rows: list[tuple[str, list[dict]]] = []
    transport = {"reference": "cma (process_vm_writev)", "awex": "mooncake tcp, reads", "mooncake": "tcp, writes, 1 pair/rank"}
    jobs = [(p, t) for p in peers for t in (a.torchstore_transports if p == "torchstore" else
                                            a.reference_transports if p == "reference" else (None,))]
    why_not: dict[str, str | None] = {}
    for peer, ts_tr in jobs:
        if peer not in why_not:
            why_not[peer] = None if peer == "reference" else _available(peer, a.torchstore_python)
            if why_not[peer]:
                skipped.append((peer, why_not[peer]))
        if why_not[peer]:
            continue
        label = (REFERENCE_LABEL[ts_tr] if peer == "reference" else TORCHSTORE_LABEL[ts_tr] if ts_tr
                 else transport.get(peer, "-"))
        memcpys.append(measure_memcpy_gbps())
        phases: list[dict] = []
        try:
            if peer == "torchstore":
                secs, phases = _run_torchstore(ts_py, ts_tr, tensors, n_train, tp, a.steps, a.warmup, a.timeout)
                warm = [i < a.warmup for i in range(len(secs))]
                got_bytes = nbytes
            elif peer == "reference":
                res = run_trial(cfg.replace(transport=ts_tr))
                secs = [float(r["seconds"]) if r["verified"] else (r.get("verify_error") or "not verified")
                        for r in res.rows]
                warm = [r["warmup"] for r in res.rows]
                got_bytes = res.rows[0]["bytes"]
                ref_rows.append((label, [r for r in res.rows if not r["warmup"]]))
            else:
                secs = _run_world(peer, tensors, n_train, tp, a.steps, a.warmup, a.timeout)
                warm = [i < a.warmup for i in range(len(secs))]
                got_bytes = nbytes
        except Exception as e:
            skipped.append((peer if not ts_tr else f"{peer} {ts_tr}",
                            f"failed: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"))
            continue
        meas = [x for x, w in zip(secs, warm) if not w]
        ok = all(isinstance(x, float) for x in secs)
        times = [x for x in meas if isinstance(x, float)]
        rows.append(dict(peer=peer, transport=label, bytes=got_bytes, times=times, ok=ok,
                         errors=[x for x in secs if not isinstance(x, float)], memcpy=memcpys[-1],
                         phases=[ph for ph, w in zip(phases, warm) if not w], cold=secs[0] if secs else None))
    mem = statistics.median(memcpys) if memcpys else measure_memcpy_gbps()
    ref = next((r for r in rows if r["peer"] == "reference" and r["times"]), None)
    ref_gbps = ref["bytes"] / statistics.median(ref["times"]) / 1e9 if ref else None
    out_rows = []
    for r in rows:
        if not r["times"]:
            print(f"  {r['peer']:>10} {r['transport'][:26]:>26} {r['bytes']:>12} {'-':>8} {'-':>8} {'-':>8} {'-':>8} "
                  f"{'-':>8} {'-':>7} {'-':>8} {'-':>8} {'NO':>9}")
            continue
        p50 = statistics.median(r["times"])
        gbps = r["bytes"] / p50 / 1e9
        ratio = f"{ref_gbps / gbps:.2f}" if ref_gbps else "-"
        cold = f"{r['cold']:>8.3f}" if isinstance(r["cold"], float) else f"{'-':>8}"
        print(f"  {r['peer']:>10} {r['transport'][:26]:>26} {r['bytes']:>12} {cold} {p50:>8.3f} "
              f"{percentile(r['times'], 95):>8.3f} {min(r['times']):>8.3f} "
              f"{max(r['times']):>8.3f} {gbps:>7.3f} {100 * gbps / mem:>7.1f}% {ratio:>8} {'yes' if r['ok'] else 'NO':>9}")
        for i, s in enumerate(r["times"]):
            out_rows.append(dict(run_id=run_id, git_sha=env["git_sha"], timestamp=stamp, host=env["host"], peer=r["peer"],
                                 transport=r["transport"], model=mcfg.label, n_train=n_train, n_infer=tp, step=i,
                                 bytes=r["bytes"], seconds=f"{s:.6f}", memcpy_gbps=f"{r['memcpy']:.3f}", verified=r["ok"]))
    print("#")
    print(f"# memcpy on this machine (same run, 1 thread, 256 MiB, median of {len(memcpys)}): {mem:.2f} GB/s")
    if ref_rows:  # the reference's own phases, slowest sender and receiver, extra memory (docs/PERFORMANCE.md)
        from weight_transfer.experiments.report import phase_lines

        for lab, rr in ref_rows:
            print("\n".join(line.replace("# ", f"# reference {lab}: ", 1) for line in phase_lines(rr, mem)))
    ts_rows = [r for r in rows if r["peer"] == "torchstore" and r["times"] and r["ok"]]
    for r in ts_rows:
        put = statistics.median(ph["put"] for ph in r["phases"]) if r["phases"] else float("nan")
        get = statistics.median(ph["get"] for ph in r["phases"]) if r["phases"] else float("nan")
        cold = f"{r['cold']:.3f} s" if isinstance(r["cold"], float) else "-"
        print(f"# torchstore {r['transport']}: p50 put {put:.3f} s (trainers) + get {get:.3f} s (generators); "
              f"cold first update {cold}")
    if ts_rows and ref_gbps:
        best = min(ts_rows, key=lambda r: statistics.median(r["times"]))
        best_gbps = best["bytes"] / statistics.median(best["times"]) / 1e9
        for r in [r for r in rows if r["peer"] == "reference" and r["times"] and r["ok"]]:
            g = r["bytes"] / statistics.median(r["times"]) / 1e9
            print(f"# reference {r['transport']} / best torchstore ({best['transport']}): {g / best_gbps:.2f}x "
                  f"({g:.3f} vs {best_gbps:.3f} GB/s, same run, both verified)")
    n_bad = sum(not r["ok"] for r in rows)
    print(f"# verified bit-exact: {len(rows) - n_bad}/{len(rows)} peers" + ("" if not n_bad else "  <-- FAILED"))
    for r in rows:
        for e in r["errors"][:2]:
            print(f"#   {r['peer']}: {e}")
    for peer, why in skipped:
        print(f"# not run: {peer}: {why}")
    if a.csv and out_rows:
        os.makedirs(os.path.dirname(a.csv) or ".", exist_ok=True)
        new = not os.path.exists(a.csv)
        with open(a.csv, "a", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out_rows[0]))
            if new:
                w.writeheader()
            w.writerows(out_rows)
        print(f"# results: {a.csv} (+{len(out_rows)} rows)")
    return 0 if rows and not n_bad else 1


if __name__ == "__main__":  # python -m weight_transfer.experiments.bench.peers [options] = weight-transfer bench-peers
    from weight_transfer.experiments.cli import add_dataclass_options, dataclass_from_args

    _ap = argparse.ArgumentParser(prog="python -m weight_transfer.experiments.bench.peers", description=__doc__.split("\n")[0])
    add_dataclass_options(_ap, PeersBenchConfig)
    try:
        _cfg = dataclass_from_args(PeersBenchConfig, _ap.parse_args())
    except ValueError as _e:
        print(f"error: {_e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(_cfg))
