"""Shard-local prepare (issue 17): fused and block-FP8 recipes made from the ranks' own shards.

Each schedule is executed in this process the way the executor does it (``full_tensor()``
stands in as the full source, ``to_local()`` as the rank's rows), and every inference rank's
bytes are compared with (a) the same world planned with ``local_writes=False`` (the published
gather-all path) and (b) the engine's own ``load_weights`` on the full checkpoint (the oracle).
"""

import pytest
import torch

from tests.helpers.planning import MOE, SMALL, check_exact_cover, dest_metas, fsdp_metas
from weight_transfer.engines.engine import expected_from_checkpoint
from weight_transfer.pipeline.executor import gather_sources, prepare_outputs
from weight_transfer.plan import build_recipes, plan
from weight_transfer.plan.local import localize_recipe
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.types import InferenceLayout, Output, Piece, Recipe, torch_dtype


def _sources(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {p.name: torch.randn(p.shape, generator=g).to(torch_dtype(p.dtype)) for p in param_specs(cfg)}


def _run(sched, metas, dests, full):
    """Execute ``sched`` in-process; returns per inference rank its region's bytes."""
    size = {r: max((m.offset + m.nbytes for m in ms), default=0) for r, ms in dests.items()}
    region = {r: torch.zeros(n, dtype=torch.uint8) for r, n in size.items()}
    for r, rp in sched.rank_plans.items():
        local = {}
        for m in metas[r]:
            sl = tuple(slice(o, o + s) for o, s in zip(m.local_offset, m.local_shape))
            local[m.name] = full[m.name][sl]
        for t in rp.tasks:
            params = {n: full[n] for n in t.sources} | {n: local[n] for n in t.local_sources}
            outs = prepare_outputs(t, gather_sources(t, params))
            for a, os_ in zip(t.assignments, outs):
                for w in a.writes:
                    b = os_[w.output].reshape(-1).view(torch.uint8)
                    assert b.numel() == w.length
                    region[w.dst_rank][w.remote_offset:w.remote_offset + w.length] = b
    return region


def _check(cfg, layout, metas, *, expect_local_quant=None, **kw):
    dests = dest_metas(cfg, layout)
    rs = build_recipes(cfg, layout)
    full = _sources(cfg)
    loc = plan(rs, metas, dests, **kw)
    gat = plan(rs, metas, dests, local_writes=False)
    check_exact_cover(loc, dests)
    got, want = _run(loc, metas, dests, full), _run(gat, metas, dests, full)
    for r in dests:
        assert torch.equal(got[r], want[r]), f"inference rank {r}: local prepare differs from gather-all"
        oracle = expected_from_checkpoint(cfg, layout, r, full.__getitem__, full)
        n = got[r].numel()
        assert torch.equal(got[r], oracle.arena[:n]), f"inference rank {r}: differs from load_weights"
    assert loc.gather_bytes < gat.gather_bytes
    if expect_local_quant is not None:
        n_q = sum(1 for rp in loc.rank_plans.values() for t in rp.tasks if t.local_sources
                  for a in t.assignments if a.recipe.transform == "fp8_block")
        assert (n_q > 0) == expect_local_quant
    return loc, gat


DENSE_128 = dict(SMALL, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=128)


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("tp", [2, 4])
def test_c4_fused_qkv_gate_up_local_bit_exact(quant, tp):
    """C4: GQA qkv_proj and gate_up_proj at TP 2 and 4, from 2 FSDP ranks, with and without FP8:
    every band written from the rank that holds it, bytes equal to gather-all and the oracle."""
    cfg = load_config("qwen3-0.6b", **DENSE_128)
    loc, _ = _check(cfg, InferenceLayout(tp=tp, quant=quant), fsdp_metas(cfg, 2),
                    expect_local_quant=True if quant else None)
    fused = [a.recipe.name for rp in loc.rank_plans.values() for t in rp.tasks if t.local_sources
             for a in t.assignments if "qkv_proj" in a.recipe.name or "gate_up_proj" in a.recipe.name]
    assert fused


def test_fp8_moe_experts_local_bit_exact():
    """w13_weight / w2_weight slots under FP8 (2 FSDP ranks, 128-row aligned shards): local."""
    cfg = load_config("qwen3-30b-a3b", **dict(MOE, moe_intermediate_size=256, head_dim=128))
    loc, gat = _check(cfg, InferenceLayout(tp=2, quant="fp8"), fsdp_metas(cfg, 2), expect_local_quant=True,
                      local_min_bytes=0)
    gathered = {a.recipe.name for rp in loc.rank_plans.values() for t in rp.tasks if t.sources for a in t.assignments}
    assert not [n for n in gathered if "experts" in n or "proj" in n], gathered


def test_c7_unaligned_quant_blocks_are_gathered_rest_local():
    """C7: a qkv_proj whose rows change hands inside a 128-row block (3 FSDP ranks over odd row
    counts) is gathered; the result is still bit-exact."""
    cfg = load_config("qwen3-0.6b", **dict(SMALL, num_attention_heads=3, num_key_value_heads=1, head_dim=64))
    loc, _ = _check(cfg, InferenceLayout(tp=1, quant="fp8"), fsdp_metas(cfg, 3))
    gathered = {a.recipe.name for rp in loc.rank_plans.values() for t in rp.tasks if t.sources for a in t.assignments}
    assert any("qkv_proj" in n for n in gathered)


def test_uneven_shards_and_c12():
    """Uneven shards (3 ranks, vocab 1001), 30 ranks with an empty last shard, [Shard(0), Shard(0)]
    on a 2x2 mesh: bit-exact, FP8 and BF16."""
    cfg = load_config("qwen3-0.6b", **{**DENSE_128, "vocab_size": 1001})
    for quant in (None, "fp8"):
        lay = InferenceLayout(tp=2, quant=quant)
        _check(cfg, lay, fsdp_metas(cfg, 3))
        _check(cfg, lay, fsdp_metas(cfg, 4, placements=("Shard(dim=0)", "Shard(dim=0)"), mesh_shape=(2, 2)))
    small = load_config("qwen3-0.6b", **dict(SMALL, hidden_size=64, intermediate_size=128, head_dim=16,
                                              num_hidden_layers=1, vocab_size=120))
    _check(small, InferenceLayout(tp=2), fsdp_metas(small, 30), local_min_bytes=0)


def _rec(pieces, shape, transform="copy"):
    outs = (Output("w", tuple((0, n) for n in shape), "bfloat16"),)
    if transform == "fp8_block":
        outs = (Output("w", tuple((0, n) for n in shape), "float8_e4m3fn"),
                Output("s", tuple((0, -(-n // 128)) for n in shape), "float32"))
    return Recipe("r", (0,), shape, "bfloat16", tuple(pieces), transform, outs)


def test_localize_recipe_rules():
    """Bands merge while one rank holds them; unaligned FP8 cuts, transposed pieces and
    column-sharded sources need the gather."""
    owners = {"a": [(0, 256, 0), (256, 512, 1)], "b": [(0, 128, 0), (128, 256, 1)]}
    mesh = frozenset({0, 1})
    fused = _rec([Piece("a", ((0, 256), (0, 64)), ((0, 256), (0, 64))),
                  Piece("b", ((0, 128), (0, 64)), ((256, 384), (0, 64)))], (384, 64))
    assert [(p.shape, h) for p, h in localize_recipe(fused, owners, mesh)] == [((384, 64), frozenset({0}))]
    split = _rec([Piece("a", ((128, 384), (0, 64)), ((0, 256), (0, 64)))], (256, 64), "fp8_block")
    bands = localize_recipe(split, owners, mesh)
    assert [(p.shape, h) for p, h in bands] == [((128, 64), frozenset({0})), ((128, 64), frozenset({1}))]
    assert bands[1][0].outputs[1].box == ((1, 2), (0, 1))
    unaligned = _rec([Piece("a", ((200, 400), (0, 64)), ((0, 200), (0, 64)))], (200, 64), "fp8_block")
    assert localize_recipe(unaligned, owners, mesh) is None
    assert localize_recipe(_rec([Piece("a", ((200, 400), (0, 64)), ((0, 200), (0, 64)))], (200, 64)), owners, mesh)
    transposed = _rec([Piece("a", ((0, 512), (0, 64)), ((0, 64), (0, 512)))], (64, 512))
    assert localize_recipe(transposed, owners, mesh) is None
    assert localize_recipe(fused, {"a": owners["a"]}, mesh) is None  # "b" has no row shards


def _with_runtime_layouts(rs, expert_layout):
    """``rs`` with vLLM CPU's runtime layouts on its outputs (engines/vllm/worker/runtime.py): experts in
    ``expert_layout``, the MoE router ``gate`` transposed, dense linears ``blocked:32x2``."""
    from dataclasses import replace

    from weight_transfer.plan.recipes import RecipeSet

    def lay(o):
        t = o.tensor
        if t.endswith(("w13_weight", "w2_weight")):
            return expert_layout
        if t.endswith("mlp.gate.weight"):
            return "transposed"
        if t.endswith(("qkv_proj.weight", "o_proj.weight")):
            return "blocked:32x2"
        return o.layout

    recs = [replace(r, outputs=tuple(replace(o, layout=lay(o)) for o in r.outputs)) for r in rs.recipes]
    return RecipeSet(recs, rs.ignored, layout=rs.layout, model=rs.model)


@pytest.mark.parametrize("expert_layout", ["blocked:16x1", "blocked:16x2"])
def test_runtime_layouts_made_from_the_shards(expert_layout):
    """Issue 43: outputs in vLLM CPU's runtime layouts (MoE prepack blocks, packed linears) are cut
    at shard boundaries in whole row blocks and built by the rank holding the rows, bit-exact
    with the gather-all plan; what still needs rows of several ranks (the router's transpose) is
    gathered and the schedule names why; shards that change hands inside a 16-row block gather."""
    from weight_transfer.convert.layouts import apply_layout

    cfg = load_config("qwen3-30b-a3b", **MOE)
    layout = InferenceLayout(tp=1)
    rs = _with_runtime_layouts(build_recipes(cfg, layout), expert_layout)
    dests = dest_metas(cfg, layout)
    full = _sources(cfg)
    metas = fsdp_metas(cfg, 2)
    loc = plan(rs, metas, dests, local_min_bytes=0)  # the tiny model's experts are KBs
    gat = plan(rs, metas, dests, local_writes=False)
    check_exact_cover(loc, dests)
    got, want = _run(loc, metas, dests, full), _run(gat, metas, dests, full)
    assert torch.equal(got[0], want[0])
    # and against load_weights, each runtime tensor rearranged into its layout
    oracle = expected_from_checkpoint(cfg, layout, 0, full.__getitem__, full)
    lays = {o.tensor: o.layout for r in rs.recipes for o in r.outputs}
    for m in dests[0]:
        t = oracle.named_parameters()[m.name]
        want_b = apply_layout(t, lays[m.name]) if lays.get(m.name, "identity") != "identity" else t
        assert torch.equal(got[0][m.offset:m.offset + m.nbytes], want_b.contiguous().reshape(-1).view(torch.uint8)), m.name
    gathered = {a.recipe.name for rp in loc.rank_plans.values() for t in rp.tasks if t.sources for a in t.assignments}
    assert not [n for n in gathered if "experts" in n or "proj" in n], gathered
    assert loc.gather_bytes < gat.gather_bytes / 20
    reasons = {why for why, _, _, _ in loc.gathers}
    assert any("transposed: never cut" in w for w in reasons), loc.gathers
    assert "transposed" in loc.summary() and "e.g. model.layers." in loc.summary()
    # 3 ranks: 128 expert rows cut 43/43/42, inside 16-row blocks: those slots are gathered, bit-exact still
    metas3 = fsdp_metas(cfg, 3)
    loc3, gat3 = plan(rs, metas3, dests, local_min_bytes=0), plan(rs, metas3, dests, local_writes=False)
    assert torch.equal(_run(loc3, metas3, dests, full)[0], _run(gat3, metas3, dests, full)[0])
    assert any("16-row block" in why for why, _, _, _ in loc3.gathers), loc3.gathers


def test_layout_box_rules():
    """A band of whole row blocks of a runtime layout is one byte range; anything else is refused."""
    from weight_transfer.convert.layouts import layout_box_ok, recipe_row_block

    assert layout_box_ok("blocked:16x1", ((2, 3), (32, 64), (0, 8)), (4, 70, 8))
    assert layout_box_ok("blocked:16x1", ((0, 1), (64, 70), (0, 8)), (4, 70, 8))  # the short last block
    assert not layout_box_ok("blocked:16x1", ((0, 1), (8, 32), (0, 8)), (4, 70, 8))
    assert not layout_box_ok("blocked:16x1", ((0, 1), (0, 32), (0, 4)), (4, 70, 8))  # part of K
    assert layout_box_ok("transposed", ((0, 8), (0, 4)), (8, 4))
    assert not layout_box_ok("transposed", ((0, 4), (0, 4)), (8, 4))
    rec = _rec([Piece("a", ((0, 64), (0, 64)), ((0, 64), (0, 64)))], (64, 64))
    from dataclasses import replace
    assert recipe_row_block(rec) == 1
    assert recipe_row_block(replace(rec, outputs=(replace(rec.outputs[0], layout="blocked:32x2"),))) == 32
    assert recipe_row_block(replace(rec, outputs=(replace(rec.outputs[0], layout="transposed"),))) == 0
