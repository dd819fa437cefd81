"""Synthetic weights: deterministic, sliceable, different at every step (C1 input)."""
import torch

from weight_transfer.testing.weights import SyntheticCheckpoint, full_param, param_box, step_mask


def test_deterministic_across_calls_and_slices():
    a = full_param("w", (300, 70), step=3, seed=1, dtype="bfloat16")
    b = full_param("w", (300, 70), step=3, seed=1, dtype="bfloat16")
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    rows = param_box("w", (300, 70), ((17, 123), (0, 70)), step=3, seed=1, dtype="bfloat16")
    assert torch.equal(rows, a[17:123])
    sub = param_box("w", (300, 70), ((5, 9), (3, 50)), step=3, seed=1, dtype="bfloat16")
    assert torch.equal(sub, a[5:9, 3:50])


def test_every_element_changes_between_consecutive_steps():
    for dtype in ("bfloat16", "float32"):
        for s in range(0, 6):
            a = full_param("x", (64, 33), step=s, seed=0, dtype=dtype)
            b = full_param("x", (64, 33), step=s + 1, seed=0, dtype=dtype)
            ib = torch.int16 if dtype == "bfloat16" else torch.int32
            assert (a.view(ib) != b.view(ib)).all(), (dtype, s)
            assert torch.isfinite(b.float()).all()


def test_names_and_seeds_differ():
    a = full_param("a", (128, 8), step=0, seed=0, dtype="bfloat16")
    b = full_param("b", (128, 8), step=0, seed=0, dtype="bfloat16")
    c = full_param("a", (128, 8), step=0, seed=1, dtype="bfloat16")
    assert not torch.equal(a, b) and not torch.equal(a, c)


def test_mask_bounded_to_mantissa():
    for s in range(300):
        assert 1 <= step_mask("n", s, torch.bfloat16) < 128
        assert step_mask("n", s, torch.bfloat16) != step_mask("n", s + 1, torch.bfloat16)


def test_odd_sizes_and_unaligned_out():
    # odd element counts take the tail path of the 64-bit XOR
    for n in (1, 3, 5, 7, 9):
        a = full_param("o", (n,), step=2, seed=0, dtype="bfloat16")
        b = full_param("o", (n,), step=1, seed=0, dtype="bfloat16")
        assert (a.view(torch.int16) != b.view(torch.int16)).all()
    big = torch.empty(11, dtype=torch.bfloat16)
    out = big[1:]  # 2-byte aligned view
    param_box("o", (10,), ((0, 10),), step=4, seed=0, dtype="bfloat16", out=out)
    assert torch.equal(out, full_param("o", (10,), step=4, seed=0, dtype="bfloat16"))


def test_checkpoint_fp32_override():
    from weight_transfer.model_config import ParamSpec

    specs = [ParamSpec(name="a", shape=(4, 4)), ParamSpec(name="b", shape=(4,), dtype="float32")]
    ck = SyntheticCheckpoint(specs, step=1, seed=0, dtype_override="float32")
    assert ck["a"].dtype == torch.float32 and ck["b"].dtype == torch.float32
    assert [n for n, _ in ck] == ["a", "b"]
