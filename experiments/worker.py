"""The processes of a trial: training ranks and inference ranks.

Each is a real OS process connected to the controller's store (:func:`weight_transfer.connect_store`:
the job secret comes from the environment the launcher handed down). Every log line is prefixed
``[train r]`` / ``[infer i]``. Entry points take the trial config, the rank and the store
address, so the same functions run under the local launcher, submitit or SLURM.
"""
from __future__ import annotations

import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from weight_transfer.control import clients
from weight_transfer.control import protocol as control
from weight_transfer.control import store as store_api
from weight_transfer.plan.metadata import collect_metas, named_dtensors
from weight_transfer.testing.training import build_fsdp_model, load_step

from .config import TrialConfig
from .draft import frozen_sources
from .methods import serve_active_step


def log(prefix: str, msg: str) -> None:
    print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)


def _connect(addr: tuple[str, int], timeout: float) -> dist.Store:
    return store_api.make_store(addr[0], addr[1], is_master=False, timeout=timeout)


def build_training_params(cfg: TrialConfig, rank: int) -> dict:
    """This rank's DTensor parameters in the trial's training layout (see TrialConfig), on
    ``cfg.device`` (the DeviceMesh's device type; with ``cuda`` the current device, which
    :func:`trainer_main` set, holds the shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from weight_transfer.testing.training import build_dtensor_params, build_two_group_params

    mcfg = cfg.model_config()
    dev = cfg.run.device
    if cfg.train.layout == "fsdp":
        mesh = init_device_mesh(dev, (cfg.train.n_train,), mesh_dim_names=("fsdp",))
        return named_dtensors(build_fsdp_model(mcfg, mesh, dtype_override=cfg.train.dtype_override, specs=cfg.train_specs()))
    if cfg.train.layout == "two_group":
        return build_two_group_params(mcfg, *cfg.train.mesh, dtype_override=cfg.train.dtype_override, specs=cfg.train_specs(),
                                      device=dev)
    mesh = init_device_mesh(dev, tuple(cfg.train.mesh), mesh_dim_names=("dp_outer", "dp_inner"))
    return build_dtensor_params(cfg.train_specs(), lambda s: (mesh, (Shard(0), Shard(0))),
                                dtype_override=cfg.train.dtype_override)


def local_rank_from_env() -> int | None:
    """This task's index among the tasks of its node, as a job launcher sets it
    (``LOCAL_RANK``: torchrun; ``SLURM_LOCALID``: srun / submitit), or None when neither is
    set. Used by tasks launched one per rank (:func:`weight_transfer.experiments.trial.run_task`), not by the
    local launcher, whose ranks inherit the launching shell's variables."""
    for var in ("LOCAL_RANK", "SLURM_LOCALID"):
        v = os.environ.get(var, "")
        if v.isdigit():
            return int(v)
    return None


def local_cuda_device(cfg: TrialConfig, role: str, rank: int, *, n_devices: int,
                      local_rank: int | None = None) -> int:
    """Index of the GPU a rank process uses (``role`` ``"train"`` or ``"infer"``), among
    ``n_devices`` visible ones: ``local_rank % n_devices`` when the launcher gave the task's
    index on its node (one task per GPU on a cluster), else the local launcher's numbering,
    where every rank of the trial runs on this host: training rank ``r`` on ``r``, inference
    rank ``i`` on ``n_train + i``, both modulo ``n_devices`` (one GPU: every process shares
    device 0; ``n_train + n_infer`` GPUs: one each). ValueError when ``n_devices < 1``."""
    if n_devices < 1:
        raise ValueError(f"device='cuda' but no CUDA device is visible (torch.cuda.device_count() = {n_devices})")
    if local_rank is not None:
        return local_rank % n_devices
    return (rank if role == "train" else cfg.train.n_train + rank) % n_devices


def training_backend(device: str, device_ids: list[str]) -> str:
    """The ``torch.distributed`` backend of the training world: ``"gloo"`` on the CPU; on CUDA
    ``"cpu:gloo,cuda:nccl"`` (NCCL for the CUDA collectives -- ``full_tensor()``'s all-gather
    -- and Gloo for the CPU ones, as torch's mixed backends do) when every training rank has
    a GPU of its own, and ``"gloo"`` when some share one (``device_ids``: each rank's GPU, e.g.
    its UUID, in rank order): NCCL refuses a communicator with two ranks on one device
    ("Duplicate GPU detected", ncclInvalidUsage), while Gloo's CUDA collectives stage the
    tensors through pinned host memory and work whatever the placement (ProcessGroupGloo:
    ``_allgather_base`` -> ``allgather`` -> its CUDA work). The one-GPU check
    (scripts/gpu_check.sh) is the shared case: Gloo."""
    if device != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if len(set(device_ids)) == len(device_ids) else "gloo"


def _setup_cuda(cfg: TrialConfig, role: str, rank: int, local_rank: int | None) -> torch.device:
    """Select this process's GPU (:func:`local_cuda_device`) and return it."""
    idx = local_cuda_device(cfg, role, rank, n_devices=torch.cuda.device_count(), local_rank=local_rank)
    torch.cuda.set_device(idx)
    return torch.device("cuda", idx)


def _agree_backend(cfg: TrialConfig, store, rank: int, gen: int, device: torch.device | None) -> str:
    """Every training rank publishes its GPU's UUID in the store and reads the others', so all
    of them pick the same :func:`training_backend` whatever launched them."""
    if device is None:
        return "gloo"
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    prefix = f"train_device/{gen}/"
    store.set(f"{prefix}{rank}", uuid.encode())
    keys = [f"{prefix}{r}" for r in range(cfg.train.n_train)]
    store.wait(keys)
    return training_backend("cuda", [control.get_text(store, k) for k in keys])


def _exit_with_parent(parent: int | None) -> None:
    """Local launcher: this process gets SIGKILL when its parent (the controller) dies, so a
    killed controller leaves nothing behind (Linux ``PR_SET_PDEATHSIG``), and ignores SIGINT: a
    Ctrl-C in the terminal reaches the whole process group, and ending the ranks is the
    controller's (SIGTERM), so the command prints its one ``error:`` line and no rank a traceback."""
    import signal

    if parent is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl
        os._exit(3)


def trainer_main(cfg: TrialConfig, rank: int, addr: tuple[str, int], *, gen: int = 0, first_step: int = 1,
                 stall: float | None = None, fault=None, parent: int | None = None,
                 local_rank: int | None = None) -> None:
    """Training rank ``rank``: build its shards, publish metadata, set up the method, then on
    every step from ``first_step``: make the step's weights ("load"), wait for "go", transfer,
    report. ``gen`` numbers restarts of the training world (its Gloo group gets a fresh store
    prefix). A heartbeat shows progress to the controller and ends this process when the
    controller stops answering for ``stall`` seconds (default ``cfg.timeout``); ``fault``
    (:class:`weight_transfer.experiments.inject.Fault`) is injected into the write stage; ``parent``: see
    :func:`_exit_with_parent`. Any error that ends the process is reported first
    (``fatal/train{rank}``). With ``cfg.device == "cuda"`` the process first selects its GPU
    (:func:`local_cuda_device`; ``local_rank``: the task's index on its node, from a cluster
    launcher) and the training world's backend follows :func:`training_backend`."""
    from weight_transfer.method import TrainerContext

    from .inject import install_trainer
    from .methods import get_method
    from .rl import push_mode

    _exit_with_parent(parent)
    torch.set_num_threads(1)
    tag = f"train {rank}"
    store = _connect(addr, cfg.transfer.control.timeout)
    hb = control.Heartbeat(addr, f"train{rank}", watch="controller", stall=stall or cfg.transfer.control.timeout)
    client = clients.TrainerClient(store, rank, timeout=max(cfg.transfer.control.timeout, 600.0))
    try:
        try:
            device = _setup_cuda(cfg, "train", rank, local_rank) if cfg.run.device == "cuda" else None
            backend = _agree_backend(cfg, store, rank, gen, device)
            if rank == 0 and device is not None:
                log(tag, f"training world on CUDA, backend {backend!r}")
            dist.init_process_group(backend, store=dist.PrefixStore(f"pg{gen}" if gen else "pg", store), rank=rank,
                                    world_size=cfg.train.n_train)
            params = build_training_params(cfg, rank)
            if cfg.transfer.executor.offload:  # shards live in host memory; the executor's h2d stage copies them in
                from weight_transfer.plan.metadata import offload_to_host

                params = offload_to_host(params)
            client.publish_meta(collect_metas(params, offloaded=cfg.transfer.executor.offload))
            _, trainer_cls, _ = get_method(cfg.run.method)
            side = trainer_cls()
            side.setup(TrainerContext(rank=rank, n_train=cfg.train.n_train, n_infer=cfg.n_infer, params=params, store=store,
                                      transfer=cfg.resolved_transfer, method_options=cfg.baseline,
                                      model_config=cfg.model_config(), layout=cfg.inference,
                                      log=lambda m: log(tag, m), group_barrier=dist.barrier))
            install_trainer(fault, rank, side, store, log=lambda m: log(tag, m))
            if cfg.fleet.active:  # engines killed while an update writes (C24): rank 0 stops half-way for the kill
                from .fleet import install_trainer_hook

                install_trainer_hook(cfg, rank, side, store, log=lambda m: log(tag, m))
        except Exception as e:
            store.set("abort", f"training rank {rank} failed during setup: {type(e).__name__}: {e}".encode())
            raise
        step = first_step
        while client.next_command(step) == "load":
            load_step(params, step=cfg.run.source_step(step), seed=cfg.run.seed,
                      change=cfg.run.change_fraction or None, source=cfg.run.step_source(), frozen=frozen_sources(cfg))
            if cfg.fleet.active:  # the rows show that the trainers never restarted for a membership change
                from .fleet import record_pid

                record_pid(store, step, rank)
            client.ready(step)
            client.wait_go(step)
            try:
                with push_mode(getattr(side, "executor", None), cfg.run.push_mode(step)):  # --delta-pairs
                    stats = side.transfer(step)
                client.done(step, ok=True, stats=stats,
                            fingerprints=getattr(getattr(side, "executor", None), "fingerprints", None))
            except Exception as e:
                if not clients.job_ending(store):
                    traceback.print_exc()
                client.done(step, ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            step += 1
        side.teardown()
        dist.destroy_process_group()
    except BaseException as e:
        if not clients.job_ending(store):
            traceback.print_exc()
        try:
            control.report_fatal(store, f"train{rank}", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        except Exception:
            pass
        raise
    finally:
        hb.stop()


def inference_main(cfg: TrialConfig, rank: int, addr: tuple[str, int], *, stall: float | None = None, fault=None,
                   parent: int | None = None, local_rank: int | None = None) -> None:
    """Inference rank ``rank``: allocate the engine's parameters, set up the method (the
    reference registers the memory once and publishes the descriptor), then per step: nothing
    for passive methods, ``receive`` for active ones; as the harness, verify each published
    version against the oracle (a failed update in between is waited through: the next
    complete version is verified; in an elastic fleet, ``cfg.fleet``, only versions from this
    rank's first update on, and the rank leaves when asked: C24). Heartbeat, ``fault`` and ``parent`` as for
    :func:`trainer_main`. With ``cfg.device == "cuda"`` the engine's arena is allocated on
    this process's GPU (:func:`local_cuda_device`) and verification copies it to the host."""
    torch.set_num_threads(1)
    from .inject import install_watcher

    _exit_with_parent(parent)
    tag = f"infer {rank}"
    store = _connect(addr, cfg.transfer.control.timeout)
    hb = control.Heartbeat(addr, f"infer{rank}", watch="controller", stall=stall or cfg.transfer.control.timeout)
    client = clients.InferenceClient(store, rank, timeout=max(cfg.transfer.control.timeout, 600.0))
    try:
        mcfg, engine, side, landing = _setup_inference(cfg, rank, store, client, local_rank, tag)
        install_watcher(fault, ("infer", rank), addr)
        committer = None
        if landing is not None:  # scatter the packed records at every commit, before `complete v` (C26 on failure)
            from .landing import CommitServer

            committer = CommitServer(engine, landing, _connect(addr, cfg.transfer.control.timeout), rank,
                                     log=lambda m: log(tag, m))
        gaps = engine_gap_snapshot(engine)
        serving = None
        if cfg.serve.active:  # a generation load, go-lives or pauses (C27): experiments/serving.py
            from .serving import StandInServing

            serving = StandInServing(cfg.serve, engine, side, store, rank, seed=cfg.run.seed, log=lambda m: log(tag, m))
        last, step = -1, 1
        while True:
            if side.active:
                if not serve_active_step(client, side, step):
                    break
                step += 1
            if cfg.fleet.active:  # only versions this rank holds (a newcomer's first is its first update); leave on request
                from .fleet import wait_version_or_leave

                v = wait_version_or_leave(store, rank, last, timeout=client.timeout)
            else:
                v = client.wait_version_after(last)
            if v is None:
                break
            last = v
            client.report(v, _check_version(cfg, engine, mcfg, rank, v, gaps, side, serving))
        if serving is not None:
            serving.stop()
        if committer is not None:
            committer.stop()
        if landing is not None:
            landing.close()
        side.teardown()
    except BaseException as e:
        if not clients.job_ending(store):
            traceback.print_exc()
        try:
            control.report_fatal(store, f"infer{rank}", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        except Exception:
            pass
        raise
    finally:
        hb.stop()


def _setup_inference(cfg: TrialConfig, rank: int, store, client, local_rank: int | None, tag: str):
    """Inference rank ``rank``'s setup, once: allocate the engine (poisoned with
    ``cfg.run.poison``), publish its loader trace (C29) and the method's metadata, attach the
    landing region for packed deltas, announce the rank to an elastic fleet. Returns ``(model
    config, engine, inference side, landing region or None)``; on an error the abort key names
    the rank before it propagates."""
    from weight_transfer.engines import Engine
    from weight_transfer.method import InferenceContext

    from .methods import get_method

    try:
        mcfg = cfg.model_config()
        device = _setup_cuda(cfg, "infer", rank, local_rank) if cfg.run.device == "cuda" else "cpu"
        from weight_transfer.transport import TRANSPORTS

        T = TRANSPORTS.get(cfg.transport)
        # a transport that publishes only memory it allocated (shm) allocates the reference's arena
        alloc = T.allocate if (cfg.run.method == "reference" and getattr(T, "publishes_allocated_only", False)) else None
        engine = Engine(mcfg, cfg.inference, rank, device=device, allocate=alloc)
        if not mcfg.hand_written:  # C29: the loader trace the engine's tensors come from, for the plan
            from weight_transfer.engines.vllm.trace.cache import cached_traces
            from weight_transfer.plan.traced import TRACE_KEY

            control.put(store, TRACE_KEY.format(rank=rank), cached_traces(mcfg, cfg.inference)[rank])
        if cfg.run.poison:
            engine.arena.fill_(0xA5)
        _, _, infer_cls = get_method(cfg.run.method)
        side = infer_cls()
        payload = side.setup(InferenceContext(rank=rank, n_train=cfg.train.n_train, n_infer=cfg.n_infer, engine=engine,
                                              store=store, transfer=cfg.resolved_transfer, method_options=cfg.baseline,
                                              model_config=mcfg, layout=cfg.inference,
                                              log=lambda m: log(tag, m),
                                              shadow=None if cfg.serve.shadow == "off" else cfg.serve.shadow))
        landing = None
        if cfg.run.method == "reference":  # packed deltas: a landing region, scattered at each commit
            from .landing import attach

            landing = attach(cfg.resolved_transfer, engine, side.receiver, store, rank,
                             shadow=cfg.serve.shadow != "off", log=lambda m: log(tag, m))
        client.publish_meta(*payload)
        if cfg.fleet.active:  # an elastic fleet (C24): the controller plans a rank in once it announced itself
            from weight_transfer.control import membership

            membership.announce_join(store, rank)
    except Exception as e:
        store.set("abort", f"inference rank {rank} failed during setup: {type(e).__name__}: {e}".encode())
        raise
    return mcfg, engine, side, landing


def _check_version(cfg: TrialConfig, engine, mcfg, rank: int, v: int, gaps, side, serving) -> dict:
    """What inference rank ``rank`` reports for published version ``v``: the oracle's verdict
    (``{"ok": None}`` without ``cfg.run.verify``), timed, and with a generation load the
    engine's stall and any write outside the shadow's halves (C27)."""
    from .verify import verify_engine

    if cfg.run.verify:
        t0 = time.perf_counter()
        keep: dict = {}
        res = verify_engine(engine, mcfg, cfg.inference, rank, step=cfg.run.source_step(v), seed=cfg.run.seed,
                            change=cfg.run.change_fraction or None, source=cfg.run.step_source(),
                            dtype_override=cfg.train.dtype_override, gaps=gaps, keep=keep, frozen=frozen_sources(cfg))
        res["seconds"] = time.perf_counter() - t0
    else:
        res = {"ok": None}
    if serving is not None:
        res["serve"] = serving.stats(v, oracle=keep.get("expected") if cfg.run.verify else None)
        sh = getattr(getattr(side, "receiver", None), "shadow", None)
        if sh is not None and sh.guard_damage():  # a write strayed outside the shadow's halves
            res["ok"], res["shadow_guards"] = False, sh.guard_damage()
    return res


def engine_gap_snapshot(engine) -> list[tuple[int, int, bytes]]:
    """Bytes of the arena that belong to no tensor (alignment gaps, tail): they must never
    change. Returns [(start, stop, bytes)]. Read from a host copy of the arena (one copy
    when the arena is on a GPU)."""
    spans = sorted((m.offset, m.offset + m.nbytes) for m in engine.tensor_metas())
    out, pos = [], 0
    raw = engine.arena.cpu()
    for a, b in spans + [(raw.numel(), raw.numel())]:
        if a > pos:
            out.append((pos, a, bytes(raw[pos:a].tolist())))
        pos = max(pos, b)
    return out
