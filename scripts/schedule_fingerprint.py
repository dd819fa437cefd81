"""Print a sha256 fingerprint of the schedule ``plan()`` makes for named configurations.

A refactor of the planner must leave every schedule unchanged; this script says whether it
did. The fingerprint covers every rank plan (rank, groups, n_groups), every task (all fields),
every assignment (the recipe's every field: name, ranks, shape, dtype, pieces, transform,
outputs) and every write (output, dst_rank, remote_offset, length), in the schedule's own
order (ranks ascending, tasks and writes as planned), plus the send / receive totals.

Configurations: the simulation configs of ``experiments/sim/configs.py`` (metadata synthesized
by ``experiments/sim/metadata.py``, as ``weight-transfer simulate`` plans them) and
``main_job_default``, the README's main job (``experiments/config.py``: Qwen3-30B-A3B's
architecture, 2 layers, 32 experts, 2 FSDP2 ranks ``Shard(dim=0)`` -> TP=2 block FP8).

A name ending in ``@gather-all`` plans with ``local_writes=False`` (``--gather-all``: every
source gathered with ``full_tensor()``); without it, shard-local prepare (the default).

Usage::

    python scripts/schedule_fingerprint.py                 # the default set (Kimi-K2 takes ~10 s, 2 GB each)
    python scripts/schedule_fingerprint.py tiny_qwen3_moe_2x2 main_job_default@gather-all
    python scripts/schedule_fingerprint.py --all           # every config, shard-local and gather-all
"""
from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weight_transfer.plan import build_recipes, plan
from weight_transfer.plan.metadata import shard_box
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.types import ParamMeta

DEFAULT = ("tiny_qwen3_moe_2x2", "main_job_default", "qwen3_235b_128_to_32",
           "kimi_k2_256xh100_to_128xh100_fp8", "kimi_k2_256xh100_to_128xh100_fp8_expert_whole")


def _fsdp_metas(cfg, n: int) -> dict[int, list[ParamMeta]]:
    """What ``n`` FSDP2 ranks publish (1-D mesh of all ranks, ``Shard(dim=0)``)."""
    mesh, pl = tuple(range(n)), ("Shard(dim=0)",)
    out = {}
    for r in range(n):
        ms = []
        for s in param_specs(cfg):
            box = shard_box(s.shape, (n,), (r,), pl)
            ms.append(ParamMeta(name=s.name, global_shape=s.shape, dtype=s.dtype, mesh_ranks=mesh,
                                mesh_dim_names=("dp_shard",), placements=pl,
                                local_offset=tuple(a for a, _ in box), local_shape=tuple(b - a for a, b in box)))
        out[r] = ms
    return out


def inputs(name: str):
    """(recipes, train metas, dest metas, plan kwargs) for a configuration name."""
    from weight_transfer.experiments.sim import metadata

    if name == "main_job_default":
        from weight_transfer.experiments.config import main_job_default

        tc = main_job_default()
        mcfg, layout = tc.model_config(), tc.inference
        tm = _fsdp_metas(mcfg, tc.train.n_train)
        kw = {"max_chunk_bytes": tc.transfer.plan.max_chunk_bytes, "local_writes": tc.transfer.plan.local_writes}
        return build_recipes(mcfg, layout), tm, metadata.dest_metas(mcfg, layout), kw
    from weight_transfer.experiments.sim.configs import get_config

    cfg = get_config(name)
    mcfg = load_config(cfg.model, **cfg.overrides)
    tm = metadata.train_metas(mcfg, cfg.train_nodes, cfg.hardware.gpus_per_node, layout=cfg.train_layout,
                              offloaded=cfg.offloaded, moe_width=cfg.moe_width)  # as weight_transfer.experiments.sim.run.build
    dm = metadata.dest_metas(mcfg, cfg.layout)
    return build_recipes(mcfg, cfg.layout), tm, dm, {"max_chunk_bytes": cfg.max_chunk_bytes}


def fingerprint(sched) -> str:
    """sha256 over every rank plan, task, assignment and write of ``sched`` (see module docstring)."""
    h = hashlib.sha256()
    upd = h.update
    recipe_digest: dict[int, bytes] = {}  # id(recipe) -> repr, once per recipe object
    upd(repr((sched.n_tasks, sched.n_groups, sorted(sched.send_bytes.items()),
              sorted(sched.recv_bytes.items()))).encode())
    for r in sorted(sched.rank_plans):
        p = sched.rank_plans[r]
        upd(repr(("rank", p.rank, p.groups, p.n_groups, len(p.tasks))).encode())
        for t in p.tasks:
            upd(repr(("task", t.id, t.group, t.sources, t.mesh, t.source_bytes, t.temp_bytes,
                      t.local_sources, len(t.assignments))).encode())
            for a in t.assignments:
                rd = recipe_digest.get(id(a.recipe))
                if rd is None:
                    rd = recipe_digest[id(a.recipe)] = repr(a.recipe).encode()
                upd(rd)
                upd(repr(tuple(map(tuple, a.writes))).encode())
    return h.hexdigest()


GATHER_ALL = "@gather-all"


def all_names() -> list[str]:
    """Every configuration this script plans, each shard-local and ``@gather-all``."""
    from weight_transfer.experiments.sim.configs import CONFIGS

    return [n + sfx for n in ("main_job_default", *CONFIGS) for sfx in ("", GATHER_ALL)]


def main(argv: list[str]) -> int:
    names = all_names() if argv == ["--all"] else argv or list(DEFAULT)
    for name in names:
        t0 = time.perf_counter()
        gather_all = name.endswith(GATHER_ALL)
        rs, tm, dm, kw = inputs(name.removesuffix(GATHER_ALL))
        if gather_all:
            kw["local_writes"] = False
        sched = plan(rs, tm, dm, parallel_checks=None, pause_gc=True, **kw)  # as the simulation plans (same schedule)
        t1 = time.perf_counter()
        fp = fingerprint(sched)
        print(f"{name:50s} {fp}  ({sched.n_tasks} tasks, {sched.n_writes} writes; plan {t1 - t0:.1f} s, "
              f"hash {time.perf_counter() - t1:.1f} s)", flush=True)
        del sched, rs, tm, dm
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
