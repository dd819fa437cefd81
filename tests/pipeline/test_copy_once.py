"""Copy once (issue 29 item 2): outputs that are nothing but their sources' bytes in order are
written straight from the shards, with no copy on the trainer: fused bands (``qkv_proj``,
``gate_up_proj``) as one write op per source range, TP slices along dim 1 (``o_proj``,
``down_proj`` column slices of row-major shards) as one op with a segment per row
(:class:`weight_transfer.transport.base.Segments`). Every update bit-exact against the engine's
own ``load_weights`` (the loopback's oracle), through cma and shm."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.loopback import Loopback
from weight_transfer.pipeline.memory import _Parts, _Slot, direct_runs
from weight_transfer.testing.catalog import load_config
from weight_transfer.transport.base import Segments, WriteOp
from weight_transfer.types import InferenceLayout, new_output, new_piece, new_recipe

pytestmark = [pytest.mark.timeout(120)]

# vocabulary divisible by tp: no zero-filled padding rows (those are built in the pool)
TINY = dict(num_hidden_layers=1, vocab_size=512, hidden_size=256, intermediate_size=256,
            num_attention_heads=8, num_key_value_heads=2, head_dim=32)


def _ckpt(cfg, step):
    from weight_transfer.testing.catalog import param_specs
    from weight_transfer.testing.weights import SyntheticCheckpoint

    return {n: t for n, t in SyntheticCheckpoint(param_specs(cfg), step=step, seed=0)}


def _kinds(ex):
    out = {"parts": 0, "segments": 0, "slots": 0}
    for per_a in ex.memory.places:
        for places in per_a:
            for p in places:
                if isinstance(p, _Parts):
                    out["parts"] += 1
                    out["segments"] += sum(1 for part in p.parts if part[4] is not None)
                elif isinstance(p, _Slot):
                    out["slots"] += 1
    return out


@pytest.mark.parametrize("transport", ["cma", "shm"])
def test_bf16_tp2_copies_nothing_on_the_trainer_and_is_bit_exact(transport):
    """BF16 into TP=2: every output is a view of a shard or written from the shards in pieces;
    three updates copy 0 bytes outside the writes, post exactly the planned writes (a planned
    write of several pieces counts once) and land bit-exact; nothing is pooled."""
    cfg = load_config("qwen3-0.6b", **TINY)
    lb = Loopback(cfg, InferenceLayout(tp=2), transport=transport)
    ex = lb.setup(_ckpt(cfg, 1))
    k = _kinds(ex)
    assert k["slots"] == 0 and k["parts"] >= 4 and k["segments"] >= 2  # fused q/k/v, gate/up; o_proj, down_proj
    s = ex.setup_stats
    assert s.pooled_bytes == 0 and s.direct_bytes > 0 and ex.memory.pool is None
    assert "written from the shards in pieces" in s.summary()
    for step in (1, 2, 3):
        src = _ckpt(cfg, step)
        st = lb.transfer(src)
        assert lb.verify(src) == [], step
        assert st.copy_bytes == 0 and sum(r.gather_bytes for r in st.records) == 0
        assert st.n_writes == lb.schedule.n_writes
        assert st.bytes_sent == sum(m.nbytes for e in lb.engines for m in e.tensor_metas())


def test_fp8_and_float32_masters_are_still_built():
    """Quantization and the fp32 -> bf16 cast are real work: those outputs stay in the pool."""
    cfg = load_config("qwen3-0.6b", **TINY)
    lb = Loopback(cfg, InferenceLayout(tp=2, quant="fp8"))
    ex = lb.setup(_ckpt(cfg, 1))
    assert _kinds(ex)["parts"] == 0 and ex.setup_stats.pooled_bytes > 0
    src = {n: t.float() for n, t in _ckpt(cfg, 2).items()}
    lb32 = Loopback(cfg, InferenceLayout(tp=2))
    st = lb32.transfer(src)
    assert lb32.verify(src) == [] and _kinds(lb32.executor)["parts"] == 0 and st.copy_bytes > 0


def test_a_source_of_a_piecewise_output_reallocated_is_refused_naming_it():
    cfg = load_config("qwen3-0.6b", **TINY)
    lb = Loopback(cfg, InferenceLayout(tp=2))
    ex = lb.setup(_ckpt(cfg, 1))
    name = "model.layers.0.self_attn.k_proj.weight"  # a piece of the fused qkv_proj
    lb.sources[name] = lb.sources[name].clone()
    with pytest.raises(RuntimeError, match=r"written from the storage of model\.layers\.0\.self_attn\.k_proj\.weight "
                                           r"registered at setup .*update shards in place"):
        ex.run()


def test_direct_runs_of_fused_strided_and_refused_recipes():
    """:func:`direct_runs`: a fused band's pieces in output order; a column slice as one run per
    row (adjacent runs of one storage merged); None for a cast, a zero piece, pieces that leave
    a gap."""
    a = torch.arange(6 * 8, dtype=torch.bfloat16).view(6, 8)
    b = torch.arange(2 * 8, dtype=torch.bfloat16).view(2, 8) + 1000
    get = {"a": a, "b": b}.__getitem__
    fused = new_recipe("f", (0,), (4, 8), "bfloat16",
                       (new_piece("a", ((2, 4), (0, 8)), ((0, 2), (0, 8))), new_piece("b", ((0, 2), (0, 8)), ((2, 4), (0, 8)))),
                       "copy", (new_output("t", ((0, 4), (0, 8)), "bfloat16"),))
    runs = direct_runs(fused, get)
    assert [(r[1], r[2], r[3]) for r in runs] == [(2 * 8 * 2, 0, 32), (0, 32, 32)]
    col = new_recipe("c", (0,), (6, 3), "bfloat16", (new_piece("a", ((0, 6), (4, 7)), ((0, 6), (0, 3))),),
                     "copy", (new_output("t", ((0, 6), (0, 3)), "bfloat16"),))
    runs = direct_runs(col, get)
    assert [(r[1], r[2], r[3]) for r in runs] == [(16 * i + 8, 6 * i, 6) for i in range(6)]
    whole_rows = new_recipe("w", (0,), (2, 8), "bfloat16", (new_piece("a", ((1, 2), (0, 8)), ((0, 1), (0, 8))),
                                                           new_piece("a", ((2, 3), (0, 8)), ((1, 2), (0, 8)))),
                            "copy", (new_output("t", ((0, 2), (0, 8)), "bfloat16"),))
    assert [(r[1], r[2], r[3]) for r in direct_runs(whole_rows, get)] == [(16, 0, 32)]  # merged
    cast = new_recipe("x", (0,), (6, 3), "bfloat16", col.pieces, "copy", (new_output("t", ((0, 6), (0, 3)), "float32"),))
    zero = new_recipe("z", (0,), (4, 8), "bfloat16", (fused.pieces[0], new_piece(None, (), ((2, 4), (0, 8)))),
                      "copy", fused.outputs)
    gap = new_recipe("g", (0,), (4, 8), "bfloat16", fused.pieces[:1], "copy", fused.outputs)
    assert direct_runs(cast, get) is None and direct_runs(zero, get) is None and direct_runs(gap, get) is None


def test_segments_of_a_strided_view():
    t = torch.empty(4, 6, 10, dtype=torch.float32)
    v = t[1:3, :, 2:5]
    sg = Segments.strided(v.shape, v.stride(), 4, v.storage_offset() * 4)
    assert sg.count == 12 and sg.nbytes == v.numel() * 4 and list(sg.lengths) == [12] * 12
    assert int(sg.offsets[0]) == v.storage_offset() * 4 and int(sg.offsets[1]) - int(sg.offsets[0]) == 40
    assert Segments.strided(t[1:3].shape, t[1:3].stride(), 4) is None  # contiguous: a plain write
    assert WriteOp(None, 0, None, 0, 48, sg).segments is sg
