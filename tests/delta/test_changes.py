"""weight_transfer.delta.changes: what a step changes at every delta granularity, counted exactly."""
from __future__ import annotations

import pytest
import torch

from weight_transfer.convert.quant import quantize_fp8_block
from weight_transfer.delta.changes import INDEX_BYTES, changes_by_kind, count_changes, tensor_kind


def _w(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)


def test_identical_versions_change_nothing():
    w = _w((256, 384))
    c = count_changes(w, w.clone())
    assert all(v == 0 for v in c.changed.values()) and all(v == 0 for v in c.delta_bytes.values())
    assert c.total["bf16_elems"] == 256 * 384 and c.total["fp8_blocks"] == 2 * 3 and c.total["scales"] == 6
    assert c.total["bf16_rows"] == 256 * 384 * 2 // 128 and c.total["fp8_rows"] == 256 * 3
    assert c.full_bytes == {"bf16": 2 * 256 * 384, "fp8": 256 * 384 + 4 * 6}


def test_one_element_changes_one_bf16_unit_and_at_most_its_fp8_block():
    w = _w((256, 384))
    v = w.clone()
    v[130, 200] = v[130, 200] * 1.5 + 0.01  # block (1, 1), row 130 of it
    c = count_changes(w, v)
    assert c.changed["bf16_elems"] == 1 and c.changed["bf16_rows"] == 1
    assert c.delta_bytes["bf16_elems"] == 2 + INDEX_BYTES
    qa, sa = quantize_fp8_block(w)
    qb, sb = quantize_fp8_block(v)
    diff = (qa.view(torch.uint8) != qb.view(torch.uint8))
    assert c.changed["fp8_elems"] == int(diff.sum())
    assert c.changed["scales"] == int((sa != sb).sum()) <= 1
    assert c.changed["fp8_blocks"] == (1 if diff.any() or (sa != sb).any() else 0)
    if diff.any():  # every changed FP8 element is in block (1, 1)
        rows, cols = diff.nonzero(as_tuple=True)
        assert rows.min() >= 128 and cols.min() >= 128 and cols.max() < 256


def test_a_new_block_maximum_moves_the_scale_and_every_element_of_the_block():
    w = _w((128, 128))
    v = w.clone()
    v[5, 7] = 1.0  # a new absmax: the block's scale changes, so its FP8 elements do
    c = count_changes(w, v)
    assert c.changed["bf16_elems"] == 1
    assert c.changed["scales"] == 1 and c.changed["fp8_blocks"] == 1
    assert c.changed["fp8_elems"] > 1000  # far more FP8 than bf16 changes
    assert c.changed["fp8_rows"] > 100


def test_vectors_are_never_fp8_and_shapes_must_agree():
    n = torch.ones(1000, dtype=torch.bfloat16)
    m = n.clone()
    m[999] = 2
    c = count_changes(n, m)
    assert c.changed["fp8_elems"] == c.changed["bf16_elems"] == 1 and c.full_bytes["fp8"] == 2000
    assert c.total["bf16_rows"] == 16  # 2000 bytes: 15 full rows and a short one
    with pytest.raises(ValueError, match="differ"):
        count_changes(n, torch.ones(999))


def test_fp32_masters_are_counted_as_served_bf16():
    a = torch.ones(64, 64)
    b = a + 1e-6  # below bf16 resolution at 1.0: the served weights do not change
    assert count_changes(a, b).changed["bf16_elems"] == 0


@pytest.mark.parametrize("name, kind", [
    ("model.layers.0.self_attn.q_proj.weight", "attention"), ("model.layers.0.self_attn.q_norm.weight", "norms"),
    ("model.layers.1.mlp.experts.3.down_proj.weight", "experts"), ("model.layers.1.mlp.gate.weight", "router"),
    ("model.layers.1.mlp.shared_experts.up_proj.weight", "experts"), ("model.layers.0.mlp.gate_proj.weight", "mlp"),
    ("model.embed_tokens.weight", "embeddings"), ("lm_head.weight", "embeddings"), ("model.norm.weight", "norms"),
])
def test_tensor_kinds(name, kind):
    assert tensor_kind(name) == kind


def test_changes_by_kind_adds_up():
    old = {"model.layers.0.self_attn.q_proj.weight": _w((128, 256)), "model.norm.weight": torch.ones(256)}
    new = {k: v.clone() for k, v in old.items()}
    new["model.norm.weight"][0] = 3
    out = changes_by_kind(old, new)
    assert out["norms"].changed["bf16_elems"] == 1 and out["attention"].changed["bf16_elems"] == 0
    assert out["all"].total["bf16_elems"] == 128 * 256 + 256 and out["all"].tensors == 2
    assert out["all"].fraction("bf16_elems") == pytest.approx(1 / (128 * 256 + 256))
    with pytest.raises(KeyError, match="not in the new"):
        changes_by_kind(old, {})
