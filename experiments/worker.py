"""The processes of a trial: training ranks and inference ranks.

Each is a real OS process connected to the controller's TCPStore. Every log line is prefixed
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

from reference import control
from reference.training import build_fsdp_model, collect_metas, load_step, named_dtensors

from .config import TrialConfig


def log(prefix: str, msg: str) -> None:
    print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)


def _connect(addr: tuple[str, int], timeout: float) -> dist.TCPStore:
    return control.make_store(addr[0], addr[1], is_master=False, timeout=timeout)


def build_training_params(cfg: TrialConfig, rank: int) -> dict:
    """This rank's DTensor parameters in the trial's training layout (see TrialConfig)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from reference.catalog import param_specs
    from reference.training import build_dtensor_params, build_two_group_params

    mcfg = cfg.model_config()
    if cfg.train_layout == "fsdp":
        mesh = init_device_mesh("cpu", (cfg.n_train,), mesh_dim_names=("fsdp",))
        return named_dtensors(build_fsdp_model(mcfg, mesh, dtype_override=cfg.dtype_override, specs=cfg.train_specs()))
    if cfg.train_layout == "two_group":
        return build_two_group_params(mcfg, *cfg.train_mesh, dtype_override=cfg.dtype_override, specs=cfg.train_specs())
    mesh = init_device_mesh("cpu", tuple(cfg.train_mesh), mesh_dim_names=("dp_outer", "dp_inner"))
    return build_dtensor_params(cfg.train_specs(), lambda s: (mesh, (Shard(0), Shard(0))),
                                dtype_override=cfg.dtype_override)


def trainer_main(cfg: TrialConfig, rank: int, addr: tuple[str, int]) -> None:
    """Training rank ``rank``: build its shards, publish metadata, set up the method, then on
    every step: make the step's weights ("load"), wait for "go", transfer, report."""
    from reference.method import TrainerContext

    from .methods import get_method

    torch.set_num_threads(1)
    tag = f"train {rank}"
    store = _connect(addr, cfg.timeout)
    client = control.TrainerClient(store, rank, timeout=max(cfg.timeout, 600.0))
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=cfg.n_train)
        params = build_training_params(cfg, rank)
        if cfg.offload:  # shards live in host memory; the executor's h2d stage copies them in
            from reference.training import offload_to_host

            params = offload_to_host(params)
        client.publish_meta(collect_metas(params, offloaded=cfg.offload))
        _, trainer_cls, _ = get_method(cfg.method)
        side = trainer_cls()
        side.setup(TrainerContext(rank=rank, n_train=cfg.n_train, n_infer=cfg.n_infer, params=params, store=store,
                                  transfer=cfg.transfer, method_options=cfg.baseline, model_config=cfg.model_config(), layout=cfg.layout,
                                  log=lambda m: log(tag, m), group_barrier=dist.barrier))
    except Exception as e:  # noqa: BLE001
        store.set("abort", f"training rank {rank} failed during setup: {type(e).__name__}: {e}".encode())
        traceback.print_exc()
        raise
    step = 1
    while client.next_command(step) == "load":
        load_step(params, step=step, seed=cfg.seed)
        client.ready(step)
        client.wait_go(step)
        try:
            stats = side.transfer(step)
            client.done(step, ok=True, stats=stats)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            client.done(step, ok=False, error=f"{type(e).__name__}: {e}")
        step += 1
    side.teardown()
    dist.destroy_process_group()


def inference_main(cfg: TrialConfig, rank: int, addr: tuple[str, int]) -> None:
    """Inference rank ``rank``: allocate the engine's parameters, set up the method (the
    reference registers the memory once and publishes the descriptor), then per step: nothing
    for passive methods, ``receive`` for active ones; as the harness, verify each published
    version against the oracle."""
    torch.set_num_threads(1)
    from engines import Engine
    from reference.method import InferenceContext

    from .methods import get_method
    from .verify import verify_engine

    tag = f"infer {rank}"
    store = _connect(addr, cfg.timeout)
    client = control.InferenceClient(store, rank, timeout=max(cfg.timeout, 600.0))
    try:
        mcfg = cfg.model_config()
        engine = Engine(mcfg, cfg.layout, rank)
        if cfg.poison:
            engine.arena.fill_(0xA5)
        _, _, infer_cls = get_method(cfg.method)
        side = infer_cls()
        payload = side.setup(InferenceContext(rank=rank, n_train=cfg.n_train, n_infer=cfg.n_infer, engine=engine,
                                              store=store, transfer=cfg.transfer, method_options=cfg.baseline, model_config=mcfg, layout=cfg.layout,
                                              log=lambda m: log(tag, m)))
        client.publish_meta(*payload)
    except Exception as e:  # noqa: BLE001
        store.set("abort", f"inference rank {rank} failed during setup: {type(e).__name__}: {e}".encode())
        traceback.print_exc()
        raise
    gaps = engine_gap_snapshot(engine)
    last, step = -1, 1
    while True:
        if side.active:
            if not client.wait_go(step):
                break
            try:
                client.done(step, ok=True, stats=side.receive(step))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                client.done(step, ok=False, error=f"{type(e).__name__}: {e}")
            step += 1
        v = client.wait_version_after(last)
        if v is None:
            break
        last = v
        if cfg.verify:
            t0 = time.perf_counter()
            res = verify_engine(engine, mcfg, cfg.layout, rank, step=v, seed=cfg.seed,
                                dtype_override=cfg.dtype_override, gaps=gaps)
            res["seconds"] = time.perf_counter() - t0
        else:
            res = {"ok": None}
        client.report(v, res)
    side.teardown()


def engine_gap_snapshot(engine) -> list[tuple[int, int, bytes]]:
    """Bytes of the arena that belong to no tensor (alignment gaps, tail): they must never
    change. Returns [(start, stop, bytes)]."""
    spans = sorted((m.offset, m.offset + m.nbytes) for m in engine.tensor_metas())
    out, pos = [], 0
    raw = engine.arena
    for a, b in spans + [(raw.numel(), raw.numel())]:
        if a > pos:
            out.append((pos, a, bytes(raw[pos:a].tolist())))
        pos = max(pos, b)
    return out
