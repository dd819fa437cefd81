"""Planner inputs and checks shared by the plan tests: small model overrides (:data:`SMALL`,
:data:`MOE`), what FSDP ranks publish computed with ``shard_box`` (:func:`fsdp_metas`), the
stand-in engine's destination metadata (:func:`dest_metas`) and the exact-cover check."""
from collections import defaultdict

from weight_transfer.engines.engine import engine_tensor_metas
from weight_transfer.plan.metadata import shard_box
from weight_transfer.testing.catalog import param_specs
from weight_transfer.types import ParamMeta

SMALL = dict(num_hidden_layers=2, vocab_size=1000, hidden_size=256, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)
MOE = dict(num_hidden_layers=2, num_experts=16, hidden_size=256, moe_intermediate_size=128,
           num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)


def fsdp_metas(cfg, n, *, placements=("Shard(dim=0)",), mesh_shape=None, drop=(), extra=()):
    """What n FSDP ranks publish (mesh of all ranks), computed with shard_box."""
    mesh_shape = mesh_shape or (n,)
    specs = [s for s in param_specs(cfg) if s.name not in drop] + list(extra)
    ranks = list(range(n))
    mesh = tuple(ranks) if len(mesh_shape) == 1 else tuple(tuple(ranks[i * mesh_shape[1]:(i + 1) * mesh_shape[1]])
                                                           for i in range(mesh_shape[0]))
    out = {}
    for r in ranks:
        coord = (r,) if len(mesh_shape) == 1 else (r // mesh_shape[1], r % mesh_shape[1])
        ms = []
        for s in specs:
            box = shard_box(s.shape, mesh_shape, coord, placements)
            ms.append(ParamMeta(name=s.name, global_shape=s.shape, dtype=s.dtype, mesh_ranks=mesh,
                                placements=placements, local_offset=tuple(a for a, _ in box),
                                local_shape=tuple(b - a for a, b in box)))
        out[r] = ms
    return out


def dest_metas(cfg, layout):
    return {i: engine_tensor_metas(cfg, layout, i) for i in range(layout.world_size)}


def check_exact_cover(sched, dests):
    """Every byte of every destination tensor written exactly once."""
    writes = defaultdict(list)
    for rp in sched.rank_plans.values():
        for t in rp.tasks:
            assert rp.rank in t.mesh
            for a in t.assignments:
                for w in a.writes:
                    writes[w.dst_rank].append((w.remote_offset, w.remote_offset + w.length))
    for rank, metas in dests.items():
        iv = sorted(writes[rank])
        spans = sorted((m.offset, m.offset + m.nbytes) for m in metas if m.nbytes)
        # merge adjacent writes; must equal the tensors' spans exactly, no overlap
        merged = []
        for a, b in iv:
            assert not merged or a >= merged[-1][1], f"rank {rank}: overlapping writes at {a}"
            if merged and a == merged[-1][1]:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        covered = sum(b - a for a, b in iv)
        assert covered == sum(b - a for a, b in spans), rank
        for a, b in iv:  # every write inside one tensor
            assert any(s <= a and b <= e for s, e in spans), (rank, a, b)
