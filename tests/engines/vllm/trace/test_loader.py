"""C29 cross-check: the recipes traced from vLLM's own loader
(weight_transfer.engines.vllm.trace.loader, in a process of its own) and the hand-written rules
(weight_transfer.plan.rules) produce identical bytes on every inference rank, for the three
hand-written families (Qwen3, Qwen3-MoE, DeepSeek-V3; BF16, load layout) on TP 1, TP 2, TP 2 with
expert parallelism and TP 2 x DP 2. Two independent derivations: the rules were written from
docs/LAYOUTS.md, the traces are what vLLM's code does; any difference is a bug in one of them.

Bytes, not only structure: every destination tensor of every rank is assembled from the same
random source tensors through both recipe sets (weight_transfer.convert.transforms.assemble) and
compared with ``torch.equal`` -- 100% of the destination bytes of the load layout."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from weight_transfer.engines.vllm.engine import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make vllm)")

MODELS = {
    "qwen3": ("qwen3-0.6b", dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=64, vocab_size=1000)),
    "qwen3_tied_lm_head_saved": ("qwen3-0.6b", dict(num_hidden_layers=1, hidden_size=128, intermediate_size=256,
                                                    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                                    vocab_size=200)),
    "qwen3_moe": ("qwen3-30b-a3b", dict(num_hidden_layers=2, num_experts=8, hidden_size=256, moe_intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1000)),
    "deepseek_v3": ("deepseek-v3", dict(num_hidden_layers=2, first_k_dense_replace=1, num_experts=8, hidden_size=256,
                                        moe_intermediate_size=128, intermediate_size=256, num_attention_heads=4,
                                        vocab_size=1000, q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32,
                                        qk_rope_head_dim=32, v_head_dim=32, n_group=1, topk_group=1)),
}
MODELS["deepseek_v3_mtp"] = MODELS["deepseek_v3"]  # + its MTP layer served as the speculative-decoding draft
LAYOUTS = ["1", "2", "2+ep", "2x2"]


def _specs(key, cfg, lays):
    """(checkpoint sources, config.json dict, layout specs) of ``key``: an ``_mtp`` key's engine
    serves the MTP draft (its trainer holds the MTP layer; ``+mtp`` layouts)."""
    from weight_transfer.engines.vllm.checkpoint import hf_config
    from weight_transfer.testing.catalog import param_specs

    draft = "mtp" if key.endswith("_mtp") else None
    sources = {p.name: (p.shape, p.dtype) for p in param_specs(cfg, draft)}
    return sources, hf_config(cfg, draft=draft), [s + ("+mtp" if draft else "") for s in lays]


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """model -> (cfg, sources, {layout spec: {rank: LoaderTrace}}), each model traced in one child."""
    from weight_transfer.engines.vllm.trace.loader import trace_many_subprocess
    from weight_transfer.testing.catalog import load_config

    jobs, cfgs = [], {}
    for key, (name, ov) in MODELS.items():
        cfg = load_config(name, **ov)
        d = tmp_path_factory.mktemp(key)
        sources, hf, lays = _specs(key, cfg, [s for s in LAYOUTS if "ep" not in s or cfg.num_experts])
        (d / "config.json").write_text(json.dumps(hf))
        if key == "qwen3_tied_lm_head_saved":  # a trainer that saves the tied head anyway: the loader skips it
            sources["lm_head.weight"] = sources["model.embed_tokens.weight"]
        jobs.append({"model_dir": str(d), "sources": sources, "layouts": lays})
        cfgs[key] = (cfg, sources)
    traced = trace_many_subprocess(jobs)  # one child: vLLM imported once
    return {key: (*cfgs[key], t) for key, t in zip(MODELS, traced)}


def _dest_bytes(recipes, sources) -> dict:
    """(rank, tensor) -> the destination tensor the recipes make from ``sources``."""
    from weight_transfer.convert.transforms import assemble
    from weight_transfer.plan.recipes import expected_dests
    from weight_transfer.types import torch_dtype

    out = {k: torch.full(shape, float("nan"), dtype=torch_dtype(dt)) for k, (shape, dt) in expected_dests(recipes).items()}
    for r in recipes:
        o = r.outputs[0]
        t = assemble(r, sources.__getitem__).to(torch_dtype(o.dtype))
        for rank in r.ranks:
            out[(rank, o.tensor)][tuple(slice(a, b) for a, b in o.box)] = t.view([b - a for a, b in o.box])
    return out


@pytest.mark.parametrize("key", list(MODELS))
def test_c29_traced_recipes_equal_the_hand_written_ones_byte_for_byte(traced, key):
    from weight_transfer.plan import build_recipes
    from weight_transfer.plan.traced import compare_recipes, recipes_from_traces

    cfg, sources, per_layout = traced[key]
    dtypes = {n: dt for n, (_, dt) in sources.items()}
    g = torch.Generator().manual_seed(0)
    src = {n: torch.randn(shape, generator=g).to(getattr(torch, dt)) for n, (shape, dt) in sources.items()}
    for spec, traces in per_layout.items():
        assert all(not t.error and not t.refused for t in traces.values()), (spec, traces[0].error, traces[0].refused)
        lay = next(iter(traces.values()))  # the layout's ranks: 0 .. world_size-1
        from weight_transfer.engines.vllm.trace.loader import parse_layout

        layout = parse_layout(spec)
        assert sorted(traces) == list(range(layout.world_size))
        rs = recipes_from_traces(traces, layout, model=cfg.label, source_dtypes=dtypes)
        hand = build_recipes(cfg, layout, source_dtypes=dtypes)
        assert compare_recipes(hand, rs) == [], spec
        assert rs.ignored == hand.ignored and rs.shared == hand.shared, spec
        assert any(r.name.startswith("draft.") for r in rs) == key.endswith("_mtp"), spec
        a, b = _dest_bytes(hand, src), _dest_bytes(rs, src)
        assert a.keys() == b.keys(), spec
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (spec, k)
        assert lay.source.startswith("vllm ") and ".load_weights" in lay.source
        print(f"[{key} {spec}] {len(rs)} traced recipes = {len(hand)} hand-written; {len(a)} destination tensors, "
              f"{sum(t.numel() * t.element_size() for t in a.values())} bytes equal; traced in {lay.seconds:.2f} s")
    if key == "qwen3_tied_lm_head_saved":
        assert "lm_head.weight" in rs.ignored


MODELS_FP8 = {  # wider, so that every TP-2 slice of every linear weight is whole 128x128 blocks, as vLLM's FP8 requires
    key: (MODELS[key][0], {**MODELS[key][1], **wider}) for key, wider in {
        "qwen3": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=4),
        "qwen3_moe": dict(hidden_size=512, moe_intermediate_size=256, num_attention_heads=8, num_key_value_heads=4),
        "deepseek_v3": dict(moe_intermediate_size=256, intermediate_size=512, num_attention_heads=8),
    }.items()}
MODELS_FP8["deepseek_v3_mtp"] = MODELS_FP8["deepseek_v3"]


@pytest.fixture(scope="module")
def traced_fp8(tmp_path_factory):
    """model -> (cfg, sources, {layout spec: {rank: LoaderTrace}}) of the block-FP8 engine (its
    ``config.json`` with DeepSeek-V3's ``quantization_config``), traced on the FP8 checkpoint form."""
    from weight_transfer.engines.vllm.trace.fp8 import quantized_config
    from weight_transfer.engines.vllm.trace.loader import trace_many_subprocess
    from weight_transfer.testing.catalog import load_config

    jobs, cfgs = [], {}
    for key, (name, ov) in MODELS_FP8.items():
        cfg = load_config(name, **ov)
        d = tmp_path_factory.mktemp(key + "_fp8")
        sources, hf, lays = _specs(key, cfg, [s for s in LAYOUTS if "ep" not in s or cfg.num_experts])
        (d / "config.json").write_text(json.dumps(quantized_config(hf, "fp8", sources)))
        jobs.append({"model_dir": str(d), "sources": sources, "layouts": lays})
        cfgs[key] = (cfg, sources)
    return {key: (*cfgs[key], t) for key, t in zip(MODELS_FP8, trace_many_subprocess(jobs))}


def _dest_outputs(recipes, sources) -> dict:
    """(rank, tensor) -> the destination tensor (FP8 weights and their scales too) the recipes make."""
    from weight_transfer.convert.transforms import apply_transform, assemble
    from weight_transfer.plan.recipes import expected_dests
    from weight_transfer.types import torch_dtype

    out = {k: torch.zeros(shape, dtype=torch_dtype(dt)) for k, (shape, dt) in expected_dests(recipes).items()}
    for r in recipes:
        for o, t in zip(r.outputs, apply_transform(r, assemble(r, sources.__getitem__))):
            for rank in r.ranks:
                out[(rank, o.tensor)][tuple(slice(a, b) for a, b in o.box)] = t.view([b - a for a, b in o.box])
    return out


@pytest.mark.parametrize("key", list(MODELS_FP8))
def test_issue57_fp8_traced_recipes_equal_the_hand_written_ones_byte_for_byte(traced_fp8, key):
    """Block FP8 (e4m3 + weight_scale_inv at 128x128) planned from vLLM's loader traced on the FP8
    checkpoint form equals the hand-written FP8 rules on every destination byte: every FP8 weight,
    every scale, every BF16 tensor, on every rank of TP 1, TP 2, TP 2 + EP and TP 2 x DP 2; the KV-cache
    scales vLLM's Fp8KVCacheMethod adds are named as kept (the trainer holds none)."""
    from weight_transfer.engines.vllm.trace.loader import parse_layout
    from weight_transfer.plan import build_recipes
    from weight_transfer.plan.traced import compare_recipes, kept_line, recipes_from_traces

    cfg, sources, per_layout = traced_fp8[key]
    dtypes = {n: dt for n, (_, dt) in sources.items()}
    g = torch.Generator().manual_seed(0)
    src = {n: torch.randn(shape, generator=g).to(getattr(torch, dt)) for n, (shape, dt) in sources.items()}
    for spec, traces in per_layout.items():
        assert all(not t.error and not t.refused for t in traces.values()), (spec, traces[0].error, traces[0].refused)
        layout = dataclasses.replace(parse_layout(spec), quant="fp8")
        rs = recipes_from_traces(traces, layout, model=cfg.label, source_dtypes=dtypes)
        hand = build_recipes(cfg, layout, source_dtypes=dtypes)
        assert sum(r.transform == "fp8_block" for r in rs) == sum(r.transform == "fp8_block" for r in hand) > 0, spec
        assert compare_recipes(hand, rs) == [], spec
        assert rs.ignored == hand.ignored and rs.shared == hand.shared, spec
        a, b = _dest_outputs(hand, src), _dest_outputs(rs, src)
        assert a.keys() == b.keys(), (spec, sorted(set(a) ^ set(b))[:4])
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (spec, k)
        kept = traces[0].kept  # vLLM 0.32's MLA attention has no KV-cache scale parameters
        assert all(n.rsplit(".", 1)[-1] in ("q_scale", "k_scale", "v_scale", "prob_scale") for n in kept)
        assert bool(kept) == (not cfg.is_mla) and (f"{len(rs.kept)} quantization-state tensor(s)" in kept_line(rs)
                                                    or not kept)
        n_fp8 = sum(t.numel() for (rk, n), t in a.items() if t.dtype == torch.float8_e4m3fn)
        print(f"[{key} fp8 {spec}] {len(rs)} traced recipes, {len(hand)} hand-written; {len(a)} destination tensors "
              f"({n_fp8} FP8 weight bytes) equal; kept: {len(rs.kept)}")
