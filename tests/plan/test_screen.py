"""The fast screen in front of the plan's exhaustive checks (reference/plan/screen.py).

The screen checks each distinct recipe structure once and what differs per recipe (names,
offsets, which sources and slices are read) per recipe. It may only say "no problem" where
the exhaustive pass would: one bad expert among 384 identical ones must still be refused,
with the exhaustive pass's message, whatever the defect. Each case below asserts the screen
itself says False (a screen that cached the check away would say True) and that validate()
raises exactly what the exhaustive pass raises, naming the expert.
"""
from __future__ import annotations

import re
from dataclasses import replace
from functools import partial

import pytest

from weight_transfer.plan import PlanError, RecipeSet, build_recipes, expected_dests, make_dest_metas, validate
from weight_transfer.plan.checks import _recipe_ok, _src_meta, _validate_all
from weight_transfer.plan.screen import screen
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.types import InferenceLayout, Output, Piece

N_EXPERTS = 384
BAD = 217  # the expert made bad, layer 1
LAYOUT = InferenceLayout(tp=4, dp=2, ep=True, quant="fp8")  # expert 217 on ranks 2 and 6, slot 25


def _world(n_experts=N_EXPERTS, layout=LAYOUT, **kw):
    base = dict(num_hidden_layers=2, num_experts=n_experts, hidden_size=256, moe_intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)
    cfg = load_config("qwen3-30b-a3b", **(base | kw))
    rs = build_recipes(cfg, layout)
    srcs = {p.name: (p.shape, p.dtype) for p in param_specs(cfg)}
    return rs, srcs, make_dest_metas(expected_dests(rs))


def _screen(rs, srcs, dests) -> bool:
    s = {k: _src_meta(v) for k, v in srcs.items()}
    return screen(rs.recipes, rs.ignored, s, dests, partial(_recipe_ok, srcs=s))


def _exhaustive_error(rs, srcs, dests) -> str:
    with pytest.raises(PlanError) as e:
        _validate_all(rs, {k: _src_meta(v) for k, v in srcs.items()}, dests)
    return str(e.value)


EXPERT = f"model.layers.1.mlp.experts.{BAD}."
W13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"


def _is_bad(r) -> bool:
    return any(p.source and p.source.startswith(EXPERT) for p in r.pieces)


def _bad_recipe(rs, tensor=W13):
    return next(r for r in rs.recipes if _is_bad(r) and r.outputs[0].tensor == tensor)


def _swap(rs, old, new) -> RecipeSet:
    return RecipeSet([new if r is old else r for r in rs.recipes], rs.ignored, layout=rs.layout, model=rs.model)


def _shift_box(box, d0):
    return ((box[0][0] + d0, box[0][1] + d0), *box[1:])


def _mutate(case, rs, srcs, dests):
    """One expert's recipe, source or destination made bad; returns (rs, srcs, dests, words the
    refusal must contain)."""
    srcs, dests = dict(srcs), dict(dests)
    r = _bad_recipe(rs)
    gate = f"{EXPERT}gate_proj.weight"
    if case == "slice-outside-source":  # same extent, one row down: outside the source
        pc = r.pieces[0]
        r2 = replace(r, pieces=(replace(pc, src_box=_shift_box(pc.src_box, 1)), *r.pieces[1:]))
        return _swap(rs, r, r2), srcs, dests, [gate, "outside its shape"]
    if case == "source-shape":
        shape, dt = srcs[gate]
        srcs[gate] = ((shape[0], shape[1] - 1), dt)
        return rs, srcs, dests, [gate, "outside its shape"]
    if case == "source-dtype":
        srcs[gate] = (srcs[gate][0], "float8_e4m3fn")
        return rs, srcs, dests, [gate, "float8_e4m3fn"]
    if case == "source-partly-read":  # a larger source: the recipe reads its first rows only
        shape, dt = srcs[gate]
        srcs[gate] = ((shape[0] + 8, shape[1]), dt)
        return rs, srcs, dests, [gate, "read only"]
    if case == "source-missing":
        del srcs[gate]
        return rs, srcs, dests, [gate, "lacks parameter"]
    if case == "source-unused":
        srcs[f"{EXPERT}extra_proj.weight"] = ((8, 256), "bfloat16")
        return rs, srcs, dests, [f"{EXPERT}extra_proj.weight", "used by no recipe"]
    if case == "output-overlaps-neighbour":  # the slot of the expert before: written twice, its own a gap
        o = r.outputs[0]
        r2 = replace(r, outputs=(replace(o, box=_shift_box(o.box, -1)), *r.outputs[1:]))
        return _swap(rs, r, r2), srcs, dests, [W13, "written twice"]
    if case == "scale-box-shape":  # the scale box one column short
        w, sc = r.outputs
        box = (*sc.box[:-1], (sc.box[-1][0], sc.box[-1][1] - 1))
        return _swap(rs, r, replace(r, outputs=(w, replace(sc, box=box)))), srcs, dests, [r.name, "scale box"]
    if case == "box-shapes-traded":  # its scale box takes the next slot too, the next expert's is empty:
        nxt = next(x for x in rs.recipes if x.outputs[0].tensor == W13 and x.ranks == r.ranks
                   and x.outputs[0].box[0][0] == r.outputs[0].box[0][0] + 1)  # every element still written once
        (w, sc), (w2, sc2) = r.outputs, nxt.outputs
        grow = ((sc.box[0][0], sc.box[0][1] + 1), *sc.box[1:])
        empty = ((sc2.box[0][1], sc2.box[0][1]), *sc2.box[1:])
        rs = _swap(rs, r, replace(r, outputs=(w, replace(sc, box=grow))))
        return _swap(rs, nxt, replace(nxt, outputs=(w2, replace(sc2, box=empty)))), srcs, dests, [r.name, "scale box"]
    if case == "copy-output-dtype":  # a copy into float32 is a planned cast; the destination is bfloat16
        n = next(x for x in rs.recipes if x.name == "model.layers.1.post_attention_layernorm.weight")
        (o,) = n.outputs
        return _swap(rs, n, replace(n, outputs=(replace(o, dtype="float32"),))), srcs, dests, [n.name, "float32"]
    if case == "dest-shape-one-replica":  # the second replica holds one more slot (never written)
        k = (r.ranks[1], W13)
        d = dests[k]
        dests[k] = replace(d, shape=(d.shape[0] + 1, *d.shape[1:]))
        return rs, srcs, dests, [f"{W13}' on rank {r.ranks[1]}", "written by no recipe"]
    if case == "dest-dtype-one-replica":
        k = (r.ranks[1], W13)
        dests[k] = replace(dests[k], dtype="bfloat16")
        return rs, srcs, dests, [W13, f"on ranks [{r.ranks[1]}]"]
    if case == "output-dtype":
        w, sc = r.outputs
        return _swap(rs, r, replace(r, outputs=(replace(w, dtype="bfloat16"), sc))), srcs, dests, [r.name, "float8"]
    if case == "piece-overlap":  # the up piece over the gate piece's rows
        g, u = r.pieces
        r2 = replace(r, pieces=(g, replace(u, dst_box=g.dst_box)))
        return _swap(rs, r, r2), srcs, dests, [r.name, "overlap"]
    if case == "zero-pieces":  # its up rows zero-filled as the expert before's, but with a source box
        prev = next(x for x in rs.recipes if x.outputs[0].tensor == W13 and x.ranks == r.ranks
                    and x.outputs[0].box[0][0] == r.outputs[0].box[0][0] - 1)
        ups = {x.pieces[1].source for x in (prev, r)}
        rs = _swap(rs, prev, replace(prev, pieces=(prev.pieces[0], Piece(None, (), prev.pieces[1].dst_box))))
        rs = _swap(rs, r, replace(r, pieces=(r.pieces[0], Piece(None, r.pieces[1].src_box, r.pieces[1].dst_box))))
        return RecipeSet(rs.recipes, ups, layout=rs.layout, model=rs.model), srcs, dests, [r.name, "zero piece"]
    if case == "zero-piece-with-source-box":
        g, u = r.pieces
        r2 = replace(r, pieces=(g, Piece(None, u.src_box, u.dst_box)))
        return _swap(rs, r, r2), srcs, dests, [r.name, "zero piece"]
    if case == "dest-shape":  # one rank holds the expert tensor with fewer slots
        k = (r.ranks[0], W13)
        d = dests[k]
        dests[k] = replace(d, shape=(d.shape[0] - 1, *d.shape[1:]))
        return rs, srcs, dests, [W13, "out of bounds"]
    if case == "dest-reshaped":  # (512, 32) where the recipe writes (256, 64): same size, out of bounds
        for rk in r.ranks:
            k = (rk, "model.layers.1.self_attn.o_proj.weight")
            dests[k] = replace(dests[k], shape=(512, 32))
        return rs, srcs, dests, ["model.layers.1.self_attn.o_proj.weight", "out of bounds"]
    if case == "dest-missing":
        del dests[(r.ranks[0], W13)]
        return rs, srcs, dests, [W13, "does not have"]
    if case == "rank-twice-whole-tensor":  # the only recipe of a tensor lists every rank twice
        n = next(x for x in rs.recipes if x.name == "model.layers.1.post_attention_layernorm.weight")
        return _swap(rs, n, replace(n, ranks=n.ranks * 2)), srcs, dests, [n.name, "lists a rank twice"]
    if case == "rank-twice":
        return _swap(rs, r, replace(r, ranks=r.ranks * 2)), srcs, dests, [r.name, "lists a rank twice"]
    if case == "runtime-layout":  # a runtime layout that cannot hold the matrix (K = 256, pairs of 3)
        w, sc = r.outputs
        return _swap(rs, r, replace(r, outputs=(replace(w, layout="blocked:32x3"), sc))), srcs, dests, [r.name, "divisible by 3"]
    raise AssertionError(case)


CASES = ["slice-outside-source", "source-shape", "source-dtype", "source-partly-read", "source-missing",
         "source-unused", "output-overlaps-neighbour", "scale-box-shape", "box-shapes-traded", "output-dtype", "copy-output-dtype", "piece-overlap",
         "zero-piece-with-source-box", "zero-pieces", "dest-shape", "dest-reshaped", "dest-shape-one-replica", "dest-dtype-one-replica", "dest-missing", "rank-twice", "rank-twice-whole-tensor",
         "runtime-layout"]


@pytest.fixture(scope="module")
def world():
    return _world()


def test_the_screen_vouches_for_a_good_set(world):
    rs, srcs, dests = world
    assert len(rs.recipes) > 2 * 2 * N_EXPERTS
    assert _screen(rs, srcs, dests)
    validate(rs, srcs, dests)


@pytest.mark.parametrize("case", CASES)
def test_one_bad_expert_among_384_is_refused(world, case):
    rs, srcs, dests, words = _mutate(case, *world)
    assert not _screen(rs, srcs, dests), f"{case}: the screen let one bad expert through"
    want = _exhaustive_error(rs, srcs, dests)
    with pytest.raises(PlanError) as e:
        validate(rs, srcs, dests)
    assert str(e.value) == want  # the exhaustive pass's refusal, word for word
    for w in words:
        assert w in want, (case, w, want)


@pytest.mark.parametrize("layout", [InferenceLayout(tp=1), InferenceLayout(tp=2, dp=2), InferenceLayout(tp=4, dp=2, ep=True, quant="fp8"),
                                    InferenceLayout(tp=2, ep=True, dp_attention=True, quant="fp8")],
                         ids=lambda x: x.describe())
def test_the_screen_vouches_for_every_layout(layout):
    rs, srcs, dests = _world(16, layout)
    assert _screen(rs, srcs, dests)


def test_a_destination_written_by_two_rank_sets_is_left_to_the_exhaustive_pass():
    """Two recipes with overlapping rank sets writing halves of one tensor: valid, but outside
    what the screen takes apart (it says False); validate() still passes."""
    rs, srcs, dests = _world(16, InferenceLayout(tp=2))
    r = next(r for r in rs.recipes if r.outputs[0].tensor == "model.norm.weight")
    (o,) = r.outputs
    (pc,) = r.pieces
    n = r.shape[0]
    halves = [replace(r, name=f"{r.name}#{i}", ranks=ranks, shape=(n // 2,),
                      pieces=(replace(pc, src_box=((a, a + n // 2),), dst_box=((0, n // 2),)),),
                      outputs=(Output(o.tensor, ((a, a + n // 2),), o.dtype),))
              for i, (ranks, a) in enumerate([((0, 1), 0), ((1, 0), n // 2)])]
    rs2 = RecipeSet([x for x in rs.recipes if x is not r] + halves, rs.ignored, layout=rs.layout)
    assert not _screen(rs2, srcs, dests)
    validate(rs2, srcs, dests)


def _mini(boxes, shape=(2, 64), ranks=((0,),), extra_dests=()):
    """Copy recipes writing ``boxes`` of tensor ``t`` (``shape``, bfloat16) on every rank set of
    ``ranks`` (box ``i`` from its own source ``s<i>``, cut to the box's shape)."""
    from weight_transfer.types import Recipe, box_shape, full_box
    recs, srcs = [], {}
    for j, rks in enumerate(ranks):
        for i, box in enumerate(boxes):
            shp = box_shape(box)
            src = f"s{j}.{i}"
            srcs[src] = (shp, "bfloat16")
            recs.append(Recipe(f"t[{j}.{i}]", rks, shp, "bfloat16", (Piece(src, full_box(shp), full_box(shp)),), "copy",
                               (Output("t", box, "bfloat16"),)))
    names = {(rk, "t"): (shape, "bfloat16") for rks in ranks for rk in rks}
    names.update({(0, n): ((4,), "bfloat16") for n in extra_dests})
    return RecipeSet(recs), srcs, make_dest_metas(names)


MINI = {  # case -> (world, words of the refusal): what only one step of the cover check catches
    "box-past-the-end": (_mini([((0, 1), (0, 96)), ((1, 2), (32, 64))]), ["'t[0.0]' output to 't'", "out of bounds"]),
    "box-before-the-start": (_mini([((0, 1), (0, 32)), ((1, 2), (-32, 32)), ((1, 2), (32, 64))]), ["'t[0.1]'", "out of bounds"]),
    "box-not-contiguous": (_mini([((0, 2), (0, 1)), ((1, 2), (0, 1)), ((1, 2), (1, 2))], shape=(2, 2)),
                           ["'t[0.0]'", "not flat-contiguous"]),
    "rank-in-two-sets": (_mini([((0, 2), (0, 64))], ranks=((0, 1), (1,))), ["'t' on rank 1", "written twice"]),
    "destination-never-written": (_mini([((0, 2), (0, 64))], extra_dests=("u",)), ["'u' on rank 0", "written by no recipe"]),
    "gap-at-the-end": (_mini([((0, 1), (0, 64))]), ["'t' on rank 0", "elements [64, 128) written by no recipe"]),
    "gap-at-the-start": (_mini([((1, 2), (0, 64))]), ["'t' on rank 0", "elements [0, 64) written by no recipe"]),
}


def test_mini_worlds_pass_when_whole():
    rs, srcs, dests = _mini([((0, 1), (0, 64)), ((1, 2), (0, 64))], ranks=((0, 1), (2,)))
    assert _screen(rs, srcs, dests)
    validate(rs, srcs, dests)


@pytest.mark.parametrize("case", list(MINI))
def test_every_step_of_the_cover_check_refuses_alone(case):
    (rs, srcs, dests), words = MINI[case]
    assert not _screen(rs, srcs, dests), f"{case}: the screen let it through"
    want = _exhaustive_error(rs, srcs, dests)
    with pytest.raises(PlanError) as e:
        validate(rs, srcs, dests)
    assert str(e.value) == want
    for w in words:
        assert w in want, (case, w, want)


@pytest.mark.parametrize("n_ranks", [64, 30], ids=["even-shards", "uneven-shards"])
def test_one_short_shard_among_equal_ranks_is_refused(n_ranks):
    """_check_sources reuses the element counts of a rank whose shard shapes equal an earlier
    rank's (even sharding: one list per name sequence; uneven: a few). One rank whose shard of
    one parameter is a row short must still be refused, naming the parameter."""
    from tests.helpers.planning import SMALL, fsdp_metas
    from weight_transfer.plan.sources import _check_sources, _index_sources

    cfg = load_config("qwen3-0.6b", **{**SMALL, "hidden_size": 4096, "num_hidden_layers": 1})
    metas = fsdp_metas(cfg, n_ranks)
    _check_sources(metas, _index_sources(metas))
    name = "model.layers.0.mlp.down_proj.weight"
    r = n_ranks - 3
    i = next(k for k, m in enumerate(metas[r]) if m.name == name)
    m = metas[r][i]
    assert m.local_shape[0] > 0
    metas[r][i] = replace(m, local_shape=(m.local_shape[0] - 1, *m.local_shape[1:]))
    with pytest.raises(PlanError, match=re.escape(name) + ": shards hold"):
        _check_sources(metas, _index_sources(metas))
