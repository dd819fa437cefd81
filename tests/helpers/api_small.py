"""The small one-process API world of tests/api/test_api.py (a 1-layer Qwen3, the stand-in engine as
the receiver), shared with tests/control/test_fingerprint.py and tests/test_metrics.py."""
from __future__ import annotations

import torch

import weight_transfer as wt
from weight_transfer.engines import Engine, expected_from_checkpoint
from weight_transfer.testing.catalog import load_config, param_specs
from weight_transfer.testing.weights import SyntheticCheckpoint

CFG = load_config("qwen3-0.6b", num_hidden_layers=1, vocab_size=1024)
LAYOUT = wt.InferenceLayout(tp=1)


def weights(step: int, dtype=None) -> dict[str, torch.Tensor]:
    ck = SyntheticCheckpoint(param_specs(CFG), step=step, seed=3)
    return {n: ck[n].clone().to(dtype) if dtype else ck[n].clone() for n in ck.names()}


def same(engine: Engine, weights: dict[str, torch.Tensor]) -> int:
    """Bytes checked; asserts every byte of every engine tensor equals a fresh engine's
    load_weights of ``weights``."""
    want = expected_from_checkpoint(CFG, LAYOUT, 0, weights.__getitem__, list(weights)).named_parameters()
    got = engine.named_parameters()
    assert set(got) == set(want)
    n = 0
    for name, t in got.items():
        assert torch.equal(t.view(-1).view(torch.uint8), want[name].view(-1).view(torch.uint8)), name
        n += t.numel() * t.element_size()
    assert n == sum(m.nbytes for m in engine.tensor_metas())  # every byte of the engine
    return n
