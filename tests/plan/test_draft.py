"""The speculative-decoding draft (DeepSeek MTP, ``InferenceLayout(draft="mtp")``): the recipes
of reference/plan/rules/mtp.py against the stand-in engine's own layout (engines/draft.py, the
oracle), byte for byte, and what the plan says about the tensors the draft shares with the
target. Issue 57 (3); case C33 (a stale draft) is caught by verification below."""
from __future__ import annotations

import pytest
import torch

from weight_transfer.convert.transforms import recipe_outputs
from weight_transfer.engines import Engine, engine_tensor_metas, expected_from_checkpoint
from weight_transfer.experiments.verify import compare_engines
from weight_transfer.plan import PlanError, build_recipes, validate
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.tiny import TINY_DEEPSEEK
from weight_transfer.testing.weights import SyntheticCheckpoint
from weight_transfer.types import InferenceLayout, box_flat_range


def mla(**kw):
    return load_config(TINY_DEEPSEEK[0], **{**TINY_DEEPSEEK[1], **kw})


LAYOUTS = [InferenceLayout(tp=2, draft="mtp"), InferenceLayout(tp=2, ep=True, quant="fp8", draft="mtp"),
           InferenceLayout(tp=2, ep=True, dp_attention=True, draft="mtp")]


def _write_planned(eng: Engine, rs, get) -> None:
    """Write every recipe output of ``eng``'s rank into its tensors (what the senders write)."""
    params = eng.named_parameters()
    for r in rs.for_rank(eng.rank):
        for o, t in zip(r.outputs, recipe_outputs(r, get)):
            dst = params[o.tensor]
            a, b = box_flat_range(o.box, tuple(dst.shape))
            dst.view(-1).view(torch.uint8)[a * dst.element_size():b * dst.element_size()] = t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda l: l.describe())
def test_draft_planned_bytes_equal_engine_load(lay):
    """Every destination byte of target and draft, planned from the trainer's tensors (MTP layer
    included), equals what the stand-in engine's load_weights makes of the checkpoint."""
    cfg = mla()
    specs = param_specs(cfg, "mtp")
    rs = build_recipes(cfg, lay, source_dtypes={p.name: p.dtype for p in specs})
    dests = {(m.rank, m.name): m for r in range(lay.world_size) for m in engine_tensor_metas(cfg, lay, r)}
    validate(rs, {p.name: (p.shape, p.dtype) for p in specs}, dests)  # every byte once, every source used/ignored
    ck = SyntheticCheckpoint(specs, step=1, seed=0)
    for rank in range(lay.world_size):
        live = Engine(cfg, lay, rank)
        _write_planned(live, rs, ck.__getitem__)
        exp = expected_from_checkpoint(cfg, lay, rank, ck.__getitem__, ck.names(), strict=True)
        res = compare_engines(live, exp)
        assert res["ok"], res["mismatches"]
        draft = [n for n in exp.named_parameters() if n.startswith("draft.")]
        assert "draft.model.layers.2.mtp_block.mlp.experts.routed_experts.w13_weight" in draft
        skipped = sorted(n for n in exp.skipped_names if ".experts." not in n)  # EP: other ranks' experts
        assert skipped == ["model.layers.2.embed_tokens.weight", "model.layers.2.shared_head.head.weight"]


def test_draft_names_shared_tensors_and_dtypes():
    cfg = mla()
    lay = InferenceLayout(tp=2, quant="fp8", draft="mtp")
    specs = param_specs(cfg, "mtp")
    rs = build_recipes(cfg, lay, source_dtypes={p.name: p.dtype for p in specs})
    assert rs.shared == {"model.layers.2.embed_tokens.weight": "model.embed_tokens.weight",
                         "model.layers.2.shared_head.head.weight": "lm_head.weight"}
    assert rs.ignored == set(rs.shared)  # written once, as the target's
    metas = {m.name: m for m in engine_tensor_metas(cfg, lay, 0)}
    assert metas["draft.model.layers.2.eh_proj.weight"].dtype == "bfloat16"  # nn.Linear: never quantized
    assert metas["draft.model.layers.2.eh_proj.weight"].shape == (256, 512)
    assert metas["draft.model.layers.2.mtp_block.self_attn.o_proj.weight"].dtype == "float8_e4m3fn"
    assert "draft.model.layers.2.mtp_block.self_attn.o_proj.weight_scale_inv" in metas
    target = {n for n in metas if not n.startswith("draft.")}
    assert target == {m.name for m in engine_tensor_metas(cfg, InferenceLayout(tp=2, quant="fp8"), 0)}
    assert lay.describe() == "TP2-fp8+mtp"


def test_without_draft_mtp_layers_stay_ignored():
    cfg = mla()
    specs = param_specs(cfg, "mtp")  # the trainer holds them, the engine serves no draft
    rs = build_recipes(cfg, InferenceLayout(tp=2), source_dtypes={p.name: p.dtype for p in specs})
    assert rs.ignored == {p.name for p in specs if p.name.startswith("model.layers.2.")} and not rs.shared
    assert len(param_specs(cfg)) < len(specs)


def test_draft_refused_for_models_without_mtp():
    qwen = load_config("qwen3-0.6b", num_hidden_layers=1)
    kimi = load_config("kimi-k2", num_hidden_layers=2, num_experts=4)  # num_nextn_predict_layers 0
    for cfg in (qwen, kimi):
        with pytest.raises(PlanError, match="draft 'mtp' needs"):
            build_recipes(cfg, InferenceLayout(tp=1, draft="mtp"))
        with pytest.raises(ValueError, match="draft 'mtp' needs"):
            param_specs(cfg, "mtp")
        with pytest.raises(ValueError, match="draft 'mtp' needs"):
            engine_tensor_metas(cfg, InferenceLayout(tp=1, draft="mtp"), 0)
    with pytest.raises(ValueError, match="unknown draft"):
        InferenceLayout(draft="eagle")


def test_stale_draft_tensor_named_by_verification():
    """C33: version 2 lands for the target but one draft tensor still holds version 1's bytes
    (speculative acceptance would collapse silently): verification names that tensor."""
    cfg = mla()
    lay = InferenceLayout(tp=2, quant="fp8", draft="mtp")
    specs = param_specs(cfg, "mtp")
    rs = build_recipes(cfg, lay, source_dtypes={p.name: p.dtype for p in specs})
    v1, v2 = (SyntheticCheckpoint(specs, step=s, seed=0) for s in (1, 2))
    live = Engine(cfg, lay, 1)
    _write_planned(live, rs, v2.__getitem__)
    exp = expected_from_checkpoint(cfg, lay, 1, v2.__getitem__, v2.names())
    assert compare_engines(live, exp)["ok"]
    stale = "draft.model.layers.2.mtp_block.self_attn.q_b_proj.weight"
    old = expected_from_checkpoint(cfg, lay, 1, v1.__getitem__, v1.names())
    live.named_parameters()[stale].copy_(old.named_parameters()[stale])
    res = compare_engines(live, exp)
    assert not res["ok"] and [m[0] for m in res["mismatches"]] == [stale]
