"""Per-tensor and per-channel FP8 (``--quant fp8-tensor`` / ``fp8-channel``) planned from vLLM's
loader traced on the checkpoint form, checked against vLLM's own ``load_weights`` of the version's
FP8 checkpoint (made by :mod:`weight_transfer.convert.quant_scaled`, the transfer's quantizer) on a CPU
skeleton at TP 2: every byte of every parameter the loader fills on both ranks -- the
``float8_e4m3fn`` weights, their ``weight_scale``, the BF16 tensors -- equals what the recipes
write. The TP-split per-tensor weights and the row-parallel per-channel ones gather (their
recipes read more of the source than they write, and the plan line says so)."""
from __future__ import annotations

import json

import pytest
import torch

from weight_transfer.engines.vllm.engine import vllm_available

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make vllm)")]


def _written(recipes, tensors, rank) -> dict:
    """What the recipes write on inference ``rank`` from ``tensors``: {parameter: tensor}."""
    from weight_transfer.convert.transforms import recipe_outputs
    from weight_transfer.plan.recipes import expected_dests
    from weight_transfer.types import torch_dtype

    out = {n: torch.zeros(s, dtype=torch_dtype(dt)) for (r, n), (s, dt) in expected_dests(recipes).items() if r == rank}
    for rec in recipes.for_rank(rank):
        for o, t in zip(rec.outputs, recipe_outputs(rec, tensors.__getitem__)):
            out[o.tensor][tuple(slice(a, b) for a, b in o.box)] = t.view([b - a for a, b in o.box])
    return out


def _differ(a: dict, b: dict) -> list[str]:
    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    return sorted(n for n in a if a[n].dtype != b[n].dtype or not torch.equal(raw(a[n]), raw(b[n])))


@pytest.mark.parametrize("quant", ["fp8-tensor", pytest.param("fp8-channel", marks=pytest.mark.long)])
# fp8-channel's vLLM cross-check (two vLLM child processes, ~26 s) is `long`: CI runs per-tensor,
# which gathers more; tests/plan/test_scaled.py checks per-channel's recipes and bytes without vLLM
def test_scaled_fp8_recipes_equal_vllm_load_weights_at_tp2(tmp_path, quant):
    from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors, hf_config
    from weight_transfer.engines.vllm.trace.fp8 import fp8_checkpoint, quantized_config
    from weight_transfer.engines.vllm.trace.loader import loaded_params_subprocess, trace_subprocess
    from weight_transfer.plan.scaled import scaled_gather_line
    from weight_transfer.plan.traced import recipes_from_traces
    from weight_transfer.testing.catalog import load_config, param_specs
    from weight_transfer.testing.tiny import TINY_FP8
    from weight_transfer.types import InferenceLayout

    cfg = load_config("llama-3.2-1b", **TINY_FP8["llama-3.2-1b"])
    sources = {p.name: (tuple(p.shape), p.dtype) for p in param_specs(cfg)}
    (tmp_path / "config.json").write_text(json.dumps(quantized_config(hf_config(cfg), quant, sources)))
    traces = trace_subprocess(str(tmp_path), sources, ["2"])["2"]
    assert "checkpoint form" in traces[0].source and len(traces[0].quantized) == 7 * cfg.num_layers
    layout = InferenceLayout(tp=2, quant=quant)
    rs = recipes_from_traces(traces, layout, model=cfg.label, source_dtypes={n: dt for n, (_, dt) in sources.items()})
    kind = quant.replace("-", "_")
    mine = [r for r in rs if r.transform == kind]
    gathers = [r for r in mine if r.shape != tuple(b - a for a, b in r.outputs[0].box)]
    if quant == "fp8-tensor":  # one recipe per checkpoint tensor per rank; all TP-split: all gather
        assert len(mine) == 7 * cfg.num_layers * 2 and gathers == mine
        assert "FP8 per-tensor: 28 recipe(s) read the rest of their checkpoint tensor" in scaled_gather_line(rs)
    else:  # qkv / gate_up whole rows (no gather); o_proj / down_proj: their other columns
        assert len(mine) == 4 * cfg.num_layers * 2
        assert sorted({r.outputs[0].tensor.rsplit(".", 2)[-2] for r in gathers}) == ["down_proj", "o_proj"]
        assert "FP8 per-channel: 8 recipe(s) read the other columns" in scaled_gather_line(rs)
    tensors = checkpoint_tensors(cfg, step=2, seed=57)
    down = "model.layers.0.mlp.down_proj.weight"
    k = tensors[down].shape[1] // 2
    tensors[down] = torch.cat([tensors[down][:, :k] * 0.5, tensors[down][:, k:]], dim=1)  # rank 0's columns smaller
    written = {r: _written(rs, tensors, r) for r in (0, 1)}
    oracle = loaded_params_subprocess(str(tmp_path), "2", fp8_checkpoint(tensors, traces[0].quantized, quant),
                                      {r: sorted(written[r]) for r in (0, 1)})
    for r in (0, 1):
        got = oracle[r]
        assert set(got) == set(written[r]), r
        assert _differ(written[r], got) == [], r
        scales = [n for n in got if n.endswith("weight_scale")]
        assert len(scales) == 4 * cfg.num_layers and all(got[n].dtype == torch.float32 for n in scales)
    # the check can fail: the scale of rank 0's own columns only (no gather) is not vLLM's
    name = "model.layers.0.mlp.down_proj.weight_scale"
    own = tensors[down][:, :k].float().abs()  # down_proj is row-parallel: rank 0 holds columns [0, k) of every row
    amax = own.amax(dim=-1, keepdim=True) if quant == "fp8-channel" else own.amax().view(1)
    assert _differ(dict(written[0]) | {name: amax / 448.0}, oracle[0]) == [name]
