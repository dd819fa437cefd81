"""Per-tensor and per-channel FP8 (``"fp8_tensor"`` / ``"fp8_channel"``): the torch reference
quantizers, the transform's corner-and-scale outputs, and the recipes planned from (synthetic)
loader traces of a TP-2 engine -- a TP-split per-tensor weight gathers its whole tensor and the
plan line says so; a row-parallel per-channel weight gathers its rows' other columns; a
column-parallel one does not; MoE experts are refused by name. The bytes the recipes write equal
the checkpoint's quantized whole and sliced as vLLM's loader slices it (the TP-2 cross-check
against vLLM itself is tests/engines/vllm/trace/test_fp8_scaled.py)."""
from __future__ import annotations

import pytest
import torch

from weight_transfer.convert.quant_scaled import (
    dequantize_fp8_scaled,
    quantize_fp8_channel_reference,
    quantize_fp8_tensor_reference,
)
from weight_transfer.convert.transforms import recipe_outputs
from weight_transfer.plan.scaled import scaled_gather_line
from weight_transfer.plan.traced import LoaderTrace, TracedParam, recipes_from_traces
from weight_transfer.types import InferenceLayout, PlanError, new_piece

FP8, F32 = "float8_e4m3fn", "float32"
SHAPES = {"q": (8, 4), "k": (4, 4), "v": (4, 4), "o": (4, 8)}


def _p(src, sbox, dbox):
    return new_piece(src, tuple(sbox), tuple(dbox))


def _trace(rank: int, quant: str) -> LoaderTrace:
    """What vLLM's loader does at TP rank ``rank`` of 2 with a fused qkv_proj (q 8 rows, k / v 4)
    and a row-parallel o_proj [4, 8], per-tensor or per-channel (the shapes of the real trace)."""
    r = rank
    qkv = (_p("q.weight", ((4 * r, 4 * r + 4), (0, 4)), ((0, 4), (0, 4))),
           _p("k.weight", ((2 * r, 2 * r + 2), (0, 4)), ((4, 6), (0, 4))),
           _p("v.weight", ((2 * r, 2 * r + 2), (0, 4)), ((6, 8), (0, 4))))
    o = (_p("o.weight", ((0, 4), (4 * r, 4 * r + 4)), ((0, 4), (0, 4))),)
    if quant == "fp8-tensor":
        qkv_s = TracedParam((3,), F32, tuple(_p(f"{x}.weight_scale", (), ((i, i + 1),)) for i, x in enumerate("qkv")))
        o_s = TracedParam((1,), F32, (_p("o.weight_scale", (), ((0, 1),)),))
    else:
        qkv_s = TracedParam((8, 1), F32, tuple(_p(p.source + "_scale", (p.src_box[0], (0, 1)), (p.dst_box[0], (0, 1)))
                                               for p in qkv))
        o_s = TracedParam((4, 1), F32, (_p("o.weight_scale", ((0, 4), (0, 1)), ((0, 4), (0, 1))),))
    params = {"qkv.weight": TracedParam((8, 4), FP8, qkv), "qkv.weight_scale": qkv_s,
              "o.weight": TracedParam((4, 4), FP8, o), "o.weight_scale": o_s}
    return LoaderTrace(params=params, quantized={f"{x}.weight": s for x, s in SHAPES.items()})


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {f"{x}.weight": torch.randn(s, generator=g).to(torch.bfloat16) for x, s in SHAPES.items()}


def _expected(quant: str, rank: int, tensors) -> dict:
    """The checkpoint quantized whole (the oracle's form), sliced as the loader slices it."""
    fn = quantize_fp8_tensor_reference if quant == "fp8-tensor" else quantize_fp8_channel_reference
    ck = {n: fn(t) for n, t in tensors.items()}
    out = {}
    for n, tp in _trace(rank, quant).params.items():
        t = torch.zeros(tp.shape, dtype=torch.float8_e4m3fn if tp.dtype == FP8 else torch.float32)
        for p in tp.pieces:
            if p.source.endswith("_scale"):
                src = ck[p.source.removesuffix("_scale")][1]
            else:
                src = ck[p.source][0]
            src = src[tuple(slice(a, b) for a, b in p.src_box)] if p.src_box else src.view(1)
            t[tuple(slice(a, b) for a, b in p.dst_box)] = src
        out[n] = t
    return out


def test_reference_quantizers_scale_semantics():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [3.0, 0.25, -0.5]], dtype=torch.bfloat16)
    q, s = quantize_fp8_tensor_reference(x)
    assert s.shape == () and s.dtype == torch.float32 and s.item() == pytest.approx(3.0 / 448)
    assert q.dtype == torch.float8_e4m3fn and q[2, 0].float().item() == 448.0  # the maximum maps to 448
    qc, sc = quantize_fp8_channel_reference(x)
    assert sc.shape == (3, 1) and torch.equal(sc[:, 0], torch.tensor([2 / 448, 1e-12 / 448, 3 / 448]))
    assert (qc[1].float() == 0).all() and qc[0, 1].float().item() == -448.0
    assert torch.allclose(dequantize_fp8_scaled(qc, sc), x.float(), rtol=0.07)
    with pytest.raises(ValueError):
        quantize_fp8_channel_reference(torch.ones(3))


@pytest.mark.parametrize("quant", ["fp8-tensor", "fp8-channel"])
def test_recipes_write_the_whole_checkpoint_quantized_and_sliced(quant):
    traces = {r: _trace(r, quant) for r in (0, 1)}
    rs = recipes_from_traces(traces, InferenceLayout(tp=2, quant=quant), model="toy")
    tensors = _tensors()
    for rank in (0, 1):
        want = _expected(quant, rank, tensors)
        got = {n: torch.zeros_like(t) for n, t in want.items()}
        for rec in rs.for_rank(rank):
            for o, t in zip(rec.outputs, recipe_outputs(rec, tensors.__getitem__)):
                got[o.tensor][tuple(slice(a, b) for a, b in o.box)] = t
        for n in want:
            assert torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8)), (rank, n)
    # and with the executor's output buffers
    rec = next(r for r in rs if r.outputs[0].tensor == "o.weight")
    bufs = [torch.empty(n, dtype=torch.uint8) for n in (16, 4 * (1 if quant == "fp8-tensor" else 4))]
    a = recipe_outputs(rec, tensors.__getitem__, out=bufs)
    b = recipe_outputs(rec, tensors.__getitem__)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def test_per_tensor_split_weights_gather_and_say_so():
    rs = recipes_from_traces({r: _trace(r, "fp8-tensor") for r in (0, 1)}, InferenceLayout(tp=2, quant="fp8-tensor"))
    assert {r.transform for r in rs} == {"fp8_tensor"} and len(rs) == 8  # q, k, v, o per rank
    for r in rs:  # every one reads its whole checkpoint tensor, writes its rank's slice
        src = r.pieces[0].source
        assert r.shape == SHAPES[src[0]] and r.shape != tuple(b - a for a, b in r.outputs[0].box)
        assert sorted(p.src_box for p in r.pieces)[0][0][0] == 0  # the other rank's rows / columns too
    q1 = next(r for r in rs if r.ranks == (1,) and r.pieces[0].source == "q.weight")
    assert q1.pieces[0].src_box == ((4, 8), (0, 4)) and q1.pieces[0].dst_box == ((0, 4), (0, 4))  # own rows first
    assert q1.outputs[1].box == ((0, 1),) and q1.outputs[1].tensor == "qkv.weight_scale"
    line = scaled_gather_line(rs)
    assert line.startswith("; FP8 per-tensor: 8 recipe(s) read the rest of their checkpoint tensor for its scale")


def test_per_channel_row_parallel_gathers_column_parallel_does_not():
    rs = recipes_from_traces({r: _trace(r, "fp8-channel") for r in (0, 1)}, InferenceLayout(tp=2, quant="fp8-channel"))
    by = {(r.outputs[0].tensor, r.ranks): r for r in rs}
    qkv = by[("qkv.weight", (1,))]
    assert qkv.shape == (8, 4) and qkv.outputs[1].box == ((0, 8), (0, 1)) and len(qkv.pieces) == 3  # no gather
    o = by[("o.weight", (1,))]
    assert o.shape == (4, 8) and o.outputs[0].box == ((0, 4), (0, 4))  # its 4 columns of rows of 8
    assert [p.src_box for p in o.pieces] == [((0, 4), (4, 8)), ((0, 4), (0, 4))]
    assert "FP8 per-channel: 2 recipe(s) read the other columns of their rows" in scaled_gather_line(rs)


def test_scaled_recipes_cut_along_rows_only():
    from weight_transfer.convert.transforms import split_recipe, split_recipe_bands

    rs = recipes_from_traces({r: _trace(r, "fp8-channel") for r in (0, 1)}, InferenceLayout(tp=2, quant="fp8-channel"))
    o = next(r for r in rs if r.outputs[0].tensor == "o.weight" and r.ranks == (0,))
    parts = split_recipe(o, 2)
    tensors = _tensors()
    whole = recipe_outputs(o, tensors.__getitem__)
    for i, p in enumerate(parts):  # row bands of a per-channel recipe: the same bytes
        w, s = recipe_outputs(p, tensors.__getitem__)
        assert torch.equal(w.view(torch.uint8), whole[0][2 * i:2 * i + 2].view(torch.uint8))
        assert torch.equal(s, whole[1][2 * i:2 * i + 2]) and p.outputs[1].box == ((2 * i, 2 * i + 2), (0, 1))
    rt = recipes_from_traces({r: _trace(r, "fp8-tensor") for r in (0, 1)}, InferenceLayout(tp=2, quant="fp8-tensor"))
    q = next(iter(rt))
    assert split_recipe(q, 1) == [q]
    with pytest.raises(ValueError, match="not cut"):
        split_recipe_bands(q, [(0, 4), (4, 8)])


def test_moe_experts_refused_by_name():
    t = _trace(0, "fp8-tensor")
    experts = TracedParam((2, 8, 4), FP8, (_p("e0.weight", ((0, 8), (0, 4)), ((0, 1), (0, 8), (0, 4))),
                                          _p("e1.weight", ((0, 8), (0, 4)), ((1, 2), (0, 8), (0, 4)))))
    params = dict(t.params) | {"experts.w13_weight": experts,
                               "experts.w13_weight_scale": TracedParam((2, 1), F32, ())}
    bad = LoaderTrace(params=params, quantized=dict(t.quantized) | {"e0.weight": (8, 4), "e1.weight": (8, 4)})
    with pytest.raises(PlanError, match=r"experts.w13_weight \[2, 8, 4\]: .*MoE experts are not planned"):
        recipes_from_traces({0: bad}, InferenceLayout(quant="fp8-tensor"))


def test_local_plan_gathers_a_per_tensor_weight_whose_rows_two_ranks_hold():
    from weight_transfer.plan.local import _cut

    rs = recipes_from_traces({r: _trace(r, "fp8-tensor") for r in (0, 1)}, InferenceLayout(tp=2, quant="fp8-tensor"))
    q = next(r for r in rs if r.pieces[0].source == "q.weight")
    owners = {"q.weight": [(0, 4, 0), (4, 8, 1)]}
    assert _cut(q, owners, frozenset({0, 1})) == (
        "gather", "FP8 per-tensor: the scale is the whole tensor's, whose rows several ranks hold")
    assert _cut(q, {"q.weight": [(0, 8, 0)]}, frozenset({0, 1}))[0] == "whole"


def test_hand_written_rules_refuse_scaled_fp8():
    from weight_transfer.plan import build_recipes
    from weight_transfer.testing.catalog import load_config

    cfg = load_config("qwen3-0.6b")
    with pytest.raises(PlanError, match="'fp8-tensor': the hand-written rules know BF16 and block FP8"):
        build_recipes(cfg, InferenceLayout(quant="fp8-tensor"))


@pytest.mark.parametrize("quantization, config, want", [
    (None, {}, None),
    ("fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]}, "fp8"),
    ("fp8", {"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8-tensor"),
    ("compressed-tensors", None, "fp8-channel"),
])
def test_layout_quant(quantization, config, want):
    from weight_transfer.engines.vllm.trace.fp8 import FP8_CHANNEL_CONFIG, layout_quant

    assert layout_quant(quantization, FP8_CHANNEL_CONFIG if config is None else config) == want


def test_layout_quant_refuses_what_it_does_not_know():
    from weight_transfer.engines.vllm.trace.fp8 import FP8_CHANNEL_CONFIG, layout_quant

    tensor = {**FP8_CHANNEL_CONFIG, "config_groups": {"g": {"weights": {"type": "float", "num_bits": 8,
                                                                         "strategy": "tensor"}}}}
    with pytest.raises(ValueError, match=r"compressed-tensors' with weight schemes \[\('float', 8, 'tensor'\)\]"):
        layout_quant("compressed-tensors", tensor)
    with pytest.raises(ValueError, match="quantization 'awq'"):
        layout_quant("awq", {})


def test_quantized_config_and_checkpoint_forms():
    from weight_transfer.engines.vllm.trace.fp8 import fp8_checkpoint, fp8_sources, quantized_config

    names = ["model.layers.0.mlp.gate.weight", "x.weight"]
    assert quantized_config({}, "fp8-tensor", names)["quantization_config"] == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["model.layers.0.mlp.gate"]}
    assert quantized_config({}, "fp8-channel", names)["quantization_config"]["ignore"] == ["lm_head",
                                                                                          "model.layers.0.mlp.gate"]
    src = {"x.weight": ((6, 4), "bfloat16"), "n.weight": ((4,), "bfloat16")}
    assert fp8_sources(src, {"x.weight"}, "fp8-tensor")["x.weight_scale"] == ((), "float32")
    assert fp8_sources(src, {"x.weight"}, "fp8-channel")["x.weight_scale"] == ((6, 1), "float32")
    ck = fp8_checkpoint({"x.weight": torch.ones(6, 4), "n.weight": torch.ones(4)}, {"x.weight"}, "fp8-channel")
    assert ck["x.weight"].dtype == torch.float8_e4m3fn and ck["x.weight_scale"].shape == (6, 1)
