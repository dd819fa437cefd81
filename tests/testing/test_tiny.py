"""The tiny catalog models of the live-vLLM tests (weight_transfer.testing.tiny): what they load
as, that their overrides cannot be changed in place, and their command-line form."""
import pytest

from weight_transfer.experiments.cli import key_value
from weight_transfer.testing.catalog import load_config
from weight_transfer.testing.tiny import TINY_QWEN3, TINY_QWEN3_MOE, override_args


def test_tiny_qwen3_moe_loads_as_the_small_qwen3_moe():
    name, ov = TINY_QWEN3_MOE
    cfg = load_config(name, **ov)
    assert name == "qwen3-30b-a3b" and cfg.architecture == "Qwen3MoeForCausalLM"
    assert {k: cfg.hf[k] for k in ov} == dict(ov)
    assert (cfg.num_layers, cfg.hf["num_experts"], cfg.hidden_size, cfg.vocab_size) == (2, 8, 256, 1024)


def test_tiny_qwen3_loads_as_the_small_dense_qwen3_with_tied_embeddings():
    name, ov = TINY_QWEN3
    cfg = load_config(name, **ov)
    assert name == "qwen3-0.6b" and cfg.architecture == "Qwen3ForCausalLM"
    assert {k: cfg.hf[k] for k in ov} == dict(ov) and cfg.tie_word_embeddings
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (2, 256, 1024)


@pytest.mark.parametrize("model", [TINY_QWEN3, TINY_QWEN3_MOE], ids=["qwen3", "qwen3_moe"])
def test_overrides_are_read_only_and_copy_out(model):
    _, ov = model
    before = dict(ov)
    with pytest.raises(TypeError):
        ov["num_hidden_layers"] = 3
    mine = dict(ov)
    mine["num_hidden_layers"] = 3
    assert dict(ov) == before and ov["num_hidden_layers"] == 2


@pytest.mark.parametrize("model", [TINY_QWEN3, TINY_QWEN3_MOE], ids=["qwen3", "qwen3_moe"])
def test_override_args_read_back_as_the_same_overrides(model):
    _, ov = model
    args = override_args(ov)
    assert args[0::2] == ["--override"] * len(ov)
    assert dict(key_value(a) for a in args[1::2]) == dict(ov)
    assert override_args(ov) is not args
