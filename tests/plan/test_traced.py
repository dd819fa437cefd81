"""Recipes from loader traces (weight_transfer.plan.traced) and the loader recorder
(weight_transfer.engines.vllm.trace.loader's view boxes and dispatch recorder, which need torch only):
synthetic traces and toy loaders, no vLLM. The traces of vLLM's real loaders are checked in
tests/engines/vllm/trace/test_loader.py."""
from __future__ import annotations

import pytest
import torch

from weight_transfer.engines.vllm.trace.loader import trace_load, view_box
from weight_transfer.plan import build_recipes
from weight_transfer.plan.traced import LoaderTrace, TracedParam, compare_recipes, recipes_from_traces
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.types import InferenceLayout, Piece, PlanError


def _trace(params, **kw):
    return LoaderTrace(params={n: TracedParam(tuple(s), "bfloat16", tuple(ps)) for n, (s, ps) in params.items()}, **kw)


def test_view_box_accepts_slices_and_refuses_reshapes():
    base = torch.empty(6, 4, 8, device="meta")
    assert view_box(base, (6, 4, 8)) == ((0, 6), (0, 4), (0, 8))
    assert view_box(base.narrow(0, 2, 3), (6, 4, 8)) == ((2, 5), (0, 4), (0, 8))
    assert view_box(base[4], (6, 4, 8)) == ((4, 5), (0, 4), (0, 8))           # select: a slot
    assert view_box(base[1, :, 2:6], (6, 4, 8)) == ((1, 2), (0, 4), (2, 6))
    assert view_box(base.chunk(2, dim=2)[1], (6, 4, 8)) == ((0, 6), (0, 4), (4, 8))
    assert view_box(base.transpose(1, 2), (6, 4, 8)) is None                   # a permutation
    assert view_box(base.view(24, 8)[3:9], (6, 4, 8)) is None                  # rows across two slots
    assert view_box(base[0, 0].expand(3, 8), (6, 4, 8)) is None                # a broadcast


class _ToyLoader(torch.nn.Module):
    """A vLLM-style model: a fused qkv parameter filled by narrow + copy_, a padded embedding
    (zero fill), a norm loaded with arithmetic (Gemma-style +1 at load), a transposed copy."""

    def __init__(self, mode: str):
        super().__init__()
        self.mode = mode
        with torch.device("meta"):
            self.qkv = torch.nn.Parameter(torch.empty(12, 4, dtype=torch.bfloat16))
            self.embed = torch.nn.Parameter(torch.empty(8, 4, dtype=torch.bfloat16))
            self.norm = torch.nn.Parameter(torch.empty(4, dtype=torch.bfloat16))

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("q", "k", "v"):
                off = {"q": 0, "k": 4, "v": 8}[name]
                self.qkv.data.narrow(0, off, 4).copy_(w)
            elif name == "embed":
                self.embed.data[: w.shape[0]].copy_(w)
                self.embed.data[w.shape[0]:].fill_(0)
            elif name == "norm":
                self.norm.data.copy_(w + 1 if self.mode == "plus_one" else w)
            elif name == "t" and self.mode == "transpose":
                self.qkv.data[:4].copy_(w.t())
            elif name == "lm_head":
                continue  # tied: the loader skips it


SOURCES = {"q": ((4, 4), "float32"), "k": ((4, 4), "bfloat16"), "v": ((4, 4), "bfloat16"),
           "embed": ((6, 4), "bfloat16"), "norm": ((4,), "bfloat16"), "lm_head": ((6, 4), "bfloat16")}


def test_recorder_turns_a_loader_into_pieces():
    t = trace_load(_ToyLoader("plain"), SOURCES)
    assert not t.error and not t.refused
    assert t.params["qkv"].pieces == (Piece("q", ((0, 4), (0, 4)), ((0, 4), (0, 4))),
                                      Piece("k", ((0, 4), (0, 4)), ((4, 8), (0, 4))),
                                      Piece("v", ((0, 4), (0, 4)), ((8, 12), (0, 4))))
    assert t.params["embed"].pieces == (Piece("embed", ((0, 6), (0, 4)), ((0, 6), (0, 4))),
                                        Piece(None, (), ((6, 8), (0, 4))))
    assert t.skipped == ("lm_head",)
    rs = recipes_from_traces({0: t}, InferenceLayout(), source_dtypes={n: d for n, (_, d) in SOURCES.items()})
    assert [r.name for r in rs] == ["qkv", "embed", "norm"] and rs.ignored == {"lm_head"}


def test_recorder_refuses_what_the_loader_computes_naming_the_step():
    t = trace_load(_ToyLoader("plus_one"), SOURCES)
    assert t.refused == {"norm": "aten.copy_ of checkpoint bytes computed by aten.add.Tensor"}
    with pytest.raises(PlanError, match=r"norm is not a copy of checkpoint bytes \(aten.copy_ of checkpoint bytes "
                                        r"computed by aten.add.Tensor\)"):
        recipes_from_traces({0: t}, InferenceLayout())
    t = trace_load(_ToyLoader("transpose"), {**SOURCES, "t": ((4, 4), "bfloat16")})
    assert "qkv" in t.refused and "not a box" in t.refused["qkv"]


def test_recorder_reports_the_loader_raising_and_never_traces_live_weights():
    class Raises(_ToyLoader):
        def load_weights(self, weights):
            for name, _ in weights:
                raise KeyError(name)
    t = trace_load(Raises("plain"), SOURCES)
    assert t.error.startswith("KeyError in Raises.load_weights") and not t.params
    live = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="weight is on cpu, not meta"):
        trace_load(live, SOURCES)


def test_ranks_with_equal_bytes_merge_and_expert_slots_are_cut():
    norm = ((4,), [Piece("n", ((0, 4),), ((0, 4),))])
    w = ((2, 3, 4), [Piece(f"e{j}", ((0, 3), (0, 4)), ((j, j + 1), (0, 3), (0, 4))) for j in (1, 0)])
    tr = {0: _trace({"norm": norm, "w13": w, "row": ((2, 4), [Piece("r", ((0, 2), (0, 4)), ((0, 2), (0, 4)))])}),
          1: _trace({"norm": norm, "w13": w, "row": ((2, 4), [Piece("r", ((2, 4), (0, 4)), ((0, 2), (0, 4)))])})}
    rs = recipes_from_traces(tr, InferenceLayout(tp=2))
    by = {r.name: r for r in rs}
    assert by["norm"].ranks == (0, 1) and by["row@tp0"].ranks == (0,) and by["row@tp1"].ranks == (1,)
    assert by["w13[0]"].shape == (1, 3, 4) and by["w13[0]"].outputs[0].box == ((0, 1), (0, 3), (0, 4))
    assert by["w13[1]"].pieces == (Piece("e1", ((0, 3), (0, 4)), ((0, 1), (0, 3), (0, 4))),)
    assert len(rs) == 5


def test_partial_fills_fp8_and_missing_traces_are_refused():
    tr = {0: _trace({"x": ((4, 4), [Piece("a", ((0, 2), (0, 4)), ((0, 2), (0, 4)))])})}
    with pytest.raises(PlanError, match=r"fills 8 of the 16 elements of x \[4, 4\].*missing on the training side"):
        recipes_from_traces(tr, InferenceLayout())
    with pytest.raises(PlanError, match="tracing vLLM's loader failed: boom"):
        recipes_from_traces({0: LoaderTrace(params={}, error="boom")}, InferenceLayout())


def test_compare_finds_a_swapped_slice_and_accepts_a_different_cut():
    cfg = load_config("qwen3-0.6b", num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, vocab_size=128)
    lay = InferenceLayout(tp=2)
    hand = build_recipes(cfg, lay)
    assert compare_recipes(hand, hand) == []
    from weight_transfer.convert.transforms import split_recipe

    cut = [p for r in hand for p in split_recipe(r, 8)]  # the same bytes, cut in row bands
    assert compare_recipes(hand, cut) == []
    swapped = []
    for r in hand:
        if r.name.endswith("qkv_proj.weight@tp1"):  # k and v rows swapped: a different byte per element
            ps = list(r.pieces)
            ps[1], ps[2] = (Piece(ps[2].source, ps[2].src_box, ps[1].dst_box), Piece(ps[1].source, ps[1].src_box, ps[2].dst_box))
            r = type(r)(r.name, r.ranks, r.shape, r.assembled_dtype, tuple(ps), r.transform, r.outputs)
        swapped.append(r)
    diff = compare_recipes(hand, swapped)
    assert len(diff) == 1 and "inference rank 1: model.layers.0.self_attn.qkv_proj.weight differs" in diff[0]
    assert {p.name for p in param_specs(cfg)} >= {s for r in hand for s in r.sources}


def test_fused_experts_read_through_views_make_the_same_bytes():
    """A trainer holding transformers 5's fused experts (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]) declares the per-expert checkpoint slices, read from transformers' conversion
    mapping; the recipes read them in place and make the bytes the per-expert tensors make."""
    pytest.importorskip("transformers")
    from weight_transfer.convert.transforms import assemble
    from weight_transfer.plan.traced import apply_source_views, check_views, expand_sources, fused_expert_views

    cfg = load_config("qwen3-30b-a3b", num_hidden_layers=1, num_experts=4, hidden_size=64, moe_intermediate_size=32,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=128)
    g = torch.Generator().manual_seed(1)
    ck = {p.name: torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in param_specs(cfg)}
    pre = "model.layers.0.mlp.experts."
    fused = {n: t for n, t in ck.items() if not n.startswith(pre)}
    fused[pre + "gate_up_proj"] = torch.stack([torch.cat([ck[f"{pre}{e}.gate_proj.weight"], ck[f"{pre}{e}.up_proj.weight"]])
                                               for e in range(4)])
    fused[pre + "down_proj"] = torch.stack([ck[f"{pre}{e}.down_proj.weight"] for e in range(4)])
    shapes = {n: tuple(t.shape) for n, t in fused.items()}
    views = check_views(fused_expert_views(shapes, "qwen3_moe"), shapes)
    assert views[pre + "3.up_proj.weight"] == (pre + "gate_up_proj", ((3, 4), (32, 64), (0, 64)))
    held = {n: (s, "bfloat16") for n, s in shapes.items()}
    assert expand_sources(held, views) == {p.name: (p.shape, "bfloat16") for p in param_specs(cfg)}
    for lay in (InferenceLayout(tp=2), InferenceLayout(tp=2, ep=True)):
        rs = build_recipes(cfg, lay)
        vs = apply_source_views(rs, views)
        assert {s for r in vs for s in r.sources} == set(fused)
        for a, b in zip(rs, vs):
            assert torch.equal(assemble(a, ck.__getitem__), assemble(b, fused.__getitem__)), a.name
    with pytest.raises(ValueError, match="outside its shape"):
        check_views({"x": (pre + "down_proj", ((4, 5), (0, 64), (0, 32)))}, shapes)
    with pytest.raises(ValueError, match="'qwen3_mo': transformers has no checkpoint conversion .*holds fused experts"):
        fused_expert_views(shapes, "qwen3_mo")  # a typo is not "nothing is fused"
    assert fused_expert_views({n: s for n, s in shapes.items() if ".experts." not in n}, "qwen3_mo") == {}


def test_the_planner_chooses_traced_recipes_and_says_why_not():
    """choose_recipes: traced when every rank published a clean trace (cross-checked for a
    hand-written family), the hand-written rules otherwise (saying why), a refusal for an
    architecture with neither."""
    from weight_transfer.api.coordinator import choose_recipes
    from weight_transfer.control import protocol as control
    from weight_transfer.control.store import serve_store
    from weight_transfer.model_config import ModelConfig
    from weight_transfer.plan.traced import TRACE_KEY

    cfg = load_config("qwen3-0.6b", num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, vocab_size=128)
    lay = InferenceLayout(tp=2)
    hand = build_recipes(cfg, lay)
    traces = {}
    for rank in (0, 1):  # a trace that is exactly the hand-written recipes of each rank
        params = {}
        for r in hand:
            if rank in r.ranks:
                o = r.outputs[0]
                params[o.tensor] = TracedParam(tuple(r.shape), o.dtype, r.pieces)
        traces[rank] = LoaderTrace(params=params, source="vllm test Qwen3ForCausalLM.load_weights")
    store = serve_store("127.0.0.1", 0, timeout=10)
    dtypes = {p.name: p.dtype for p in param_specs(cfg)}
    rs, how = choose_recipes(store, cfg, lay, dtypes, {0, 1})
    assert how == "recipes: hand-written rules"
    control.put(store, TRACE_KEY.format(rank=0), traces[0])
    assert "not every inference rank traced" in choose_recipes(store, cfg, lay, dtypes, {0, 1})[1]
    control.put(store, TRACE_KEY.format(rank=1), traces[1])
    rs, how = choose_recipes(store, cfg, lay, dtypes, {0, 1})
    assert how.startswith("recipes: traced from vllm test") and how.endswith("equal to the hand-written rules, every "
                                                                            "destination byte")
    assert compare_recipes(rs, hand) == []
    bad = LoaderTrace(params=traces[1].params, refused={"model.norm.weight": "aten.copy_ of checkpoint bytes computed "
                                                                            "by aten.add.Tensor"})
    control.put(store, TRACE_KEY.format(rank=1), bad)
    rs, how = choose_recipes(store, cfg, lay, dtypes, {0, 1})
    assert "not traced cleanly: inference rank 1: model.norm.weight: aten.copy_" in how
    llama = ModelConfig(name="toy", hf=dict(cfg.hf, architectures=["LlamaForCausalLM"]))
    with pytest.raises(PlanError, match="model.norm.weight is not a copy of checkpoint bytes"):
        choose_recipes(store, llama, lay, dtypes, {0, 1})
    control.put(store, TRACE_KEY.format(rank=1), traces[1])
    rs, how = choose_recipes(store, llama, lay, dtypes, {0, 1})
    assert how.startswith("recipes: traced") and "hand-written" not in how and compare_recipes(rs, hand) == []


def _fp8(shape, pieces, scale_pieces):
    """A block-FP8 parameter and its scale as a loader traced on the FP8 checkpoint form fills them."""
    from weight_transfer.convert.quant import scale_shape

    return {"w": (shape, pieces, "float8_e4m3fn"), "w_scale_inv": (scale_shape(shape), scale_pieces, "float32")}


def _trace_fp8(params, quantized):
    return LoaderTrace(params={n: TracedParam(tuple(s), dt, tuple(p)) for n, (s, p, dt) in params.items()},
                       quantized=quantized, kept=("l.attn.k_scale", "l.attn.v_scale"))


def test_issue57_block_fp8_traces_make_fp8_block_recipes_and_name_what_the_engine_keeps():
    from weight_transfer.plan.traced import kept_line

    # a fused [384, 256] weight: 256 rows of a, then b's 128 rows; scales from the matching blocks of each
    p = _fp8((384, 256), [Piece("a", ((0, 256), (0, 256)), ((0, 256), (0, 256))),
                          Piece("b", ((0, 128), (0, 256)), ((256, 384), (0, 256)))],
             [Piece("a_scale_inv", ((0, 2), (0, 2)), ((0, 2), (0, 2))),
              Piece("b_scale_inv", ((0, 1), (0, 2)), ((2, 3), (0, 2)))])
    rs = recipes_from_traces({0: _trace_fp8(p, {"a": (256, 256), "b": (128, 256)})}, InferenceLayout(quant="fp8"))
    (r,) = rs.recipes
    assert r.transform == "fp8_block" and r.assembled_dtype == "bfloat16" and r.shape == (384, 256)
    assert [(o.tensor, o.box, o.dtype) for o in r.outputs] == [("w", ((0, 384), (0, 256)), "float8_e4m3fn"),
                                                               ("w_scale_inv", ((0, 3), (0, 2)), "float32")]
    assert rs.kept == ("l.attn.k_scale", "l.attn.v_scale")
    assert kept_line(rs) == ("; kept by the engine (the trainer holds none): 2 quantization-state tensor(s) "
                             "(k_scale x1, v_scale x1)")
    # a partial last block is fine where it is the end of both tensors (200 rows of b -> the last rows of w)
    p = _fp8((456, 256), [Piece("a", ((0, 256), (0, 256)), ((0, 256), (0, 256))),
                          Piece("b", ((0, 200), (0, 256)), ((256, 456), (0, 256)))],
             [Piece("a_scale_inv", ((0, 2), (0, 2)), ((0, 2), (0, 2))),
              Piece("b_scale_inv", ((0, 2), (0, 2)), ((2, 4), (0, 2)))])
    assert recipes_from_traces({0: _trace_fp8(p, {"a": (256, 256), "b": (200, 256)})}).recipes[0].transform == "fp8_block"


def test_issue57_block_fp8_traces_that_cut_a_block_or_disagree_on_scales_are_refused():
    # b's 64 rows land mid-block: its checkpoint block is not one block of the destination
    p = _fp8((320, 256), [Piece("a", ((0, 256), (0, 256)), ((0, 256), (0, 256))),
                          Piece("b", ((0, 64), (0, 256)), ((256, 320), (0, 256)))],
             [Piece("a_scale_inv", ((0, 2), (0, 2)), ((0, 2), (0, 2))),
              Piece("b_scale_inv", ((0, 1), (0, 2)), ((2, 3), (0, 2)))])
    with pytest.raises(PlanError, match=r"rows/columns \[\(0, 64\), \(0, 256\)\] of b cut\(s\) a 128x128 quantization"):
        recipes_from_traces({0: _trace_fp8(p, {"a": (256, 256), "b": (128, 256)})})
    # the loader takes a's scale from another block than a's rows
    p = _fp8((256, 256), [Piece("a", ((0, 256), (0, 256)), ((0, 256), (0, 256)))],
             [Piece("a_scale_inv", ((0, 1), (0, 2)), ((0, 1), (0, 2))),
              Piece("a_scale_inv", ((0, 1), (0, 2)), ((1, 2), (0, 2)))])
    with pytest.raises(PlanError, match="vLLM loads w_scale_inv from other blocks than its weight's"):
        recipes_from_traces({0: _trace_fp8(p, {"a": (256, 256)})})
    # an e4m3 weight without any scale (per-tensor / per-channel FP8 have a w_scale: tests/plan/test_scaled.py)
    t = LoaderTrace(params={"w": TracedParam((128, 128), "float8_e4m3fn",
                                             (Piece("a", ((0, 128), (0, 128)), ((0, 128), (0, 128))),))})
    with pytest.raises(PlanError, match="float8_e4m3fn without a scale w_scale_inv or w_scale"):
        recipes_from_traces({0: t})
