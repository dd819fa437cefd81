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
from reference.executor import Executor
from reference.training import build_fsdp_model, collect_metas, load_step, named_dtensors
from reference.transport import make_transport

from .config import TrialConfig


def log(prefix: str, msg: str) -> None:
    print(f"[{prefix}] {msg}", file=sys.stderr, flush=True)


def _connect(addr: tuple[str, int], timeout: float) -> dist.TCPStore:
    return control.make_store(addr[0], addr[1], is_master=False, timeout=timeout)


def trainer_main(cfg: TrialConfig, rank: int, addr: tuple[str, int]) -> None:
    """Training rank ``rank``: FSDP2 shards, publish metadata, run the plan on every "go"."""
    torch.set_num_threads(1)
    tag = f"train {rank}"
    store = _connect(addr, cfg.timeout)
    client = control.TrainerClient(store, rank, timeout=max(cfg.timeout, 600.0))
    try:
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=cfg.n_train)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (cfg.n_train,), mesh_dim_names=("fsdp",))
        model = build_fsdp_model(cfg.model_config(), mesh, dtype_override=cfg.dtype_override)
        params = named_dtensors(model)
        client.publish_meta(collect_metas(params))
        plan, descriptors = client.get_plan()
        transport = make_transport(cfg.transport)
        transport.connect(list(descriptors.values()))
        ex = Executor(plan, params, transport, descriptors, group_barrier=dist.barrier)
        log(tag, f"plan: {len(plan.tasks)} tasks, {plan.n_writes} writes, {plan.send_bytes / 1e9:.3f} GB to send")
    except Exception as e:  # noqa: BLE001
        store.set("abort", f"training rank {rank} failed during setup: {e}".encode())
        traceback.print_exc()
        raise
    step = 1
    while client.next_command(step) == "load":
        load_step(params, step=step, seed=cfg.seed)
        client.ready(step)
        client.wait_go(step)
        try:
            stats = ex.run()
            client.done(step, ok=True, stats=stats)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            client.done(step, ok=False, error=f"{type(e).__name__}: {e}")
        step += 1
    dist.destroy_process_group()


def inference_main(cfg: TrialConfig, rank: int, addr: tuple[str, int]) -> None:
    """Inference rank ``rank``: allocate the engine's parameters, register them once, publish
    the descriptor, then do nothing per step except (as the harness) verify each published
    version against the oracle."""
    torch.set_num_threads(1)
    from engines import Engine

    from .verify import verify_engine

    tag = f"infer {rank}"
    store = _connect(addr, cfg.timeout)
    client = control.InferenceClient(store, rank, timeout=max(cfg.timeout, 600.0))
    try:
        mcfg = cfg.model_config()
        engine = Engine(mcfg, cfg.layout, rank)
        if cfg.poison:
            engine.arena.fill_(0xA5)
        transport = make_transport(cfg.transport)
        region = transport.register(engine.arena)
        client.publish_meta(region.descriptor(), engine.tensor_metas())
    except Exception as e:  # noqa: BLE001
        store.set("abort", f"inference rank {rank} failed during setup: {e}".encode())
        traceback.print_exc()
        raise
    gaps = engine_gap_snapshot(engine)
    last = -1
    while True:
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
