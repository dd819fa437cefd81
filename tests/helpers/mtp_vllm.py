"""vLLM 0.32's own MTP draft (``DeepSeekMTP``, built as its proposer builds it: the draft model
config of ``--speculative-config '{"method": "mtp"}'``) loaded on the CPU from a synthetic
checkpoint, compared tensor by tensor with the stand-in engine's ``draft.*`` tensors at one
TP/EP rank. A script (``python -m tests.helpers.mtp_vllm TP RANK EP``; it makes a one-process gloo
world), used by tests/engines/vllm/test_draft.py; prints one JSON object."""
from __future__ import annotations

import json
import sys
import tempfile

import torch

from weight_transfer.testing.tiny import TINY_DEEPSEEK

TINY = TINY_DEEPSEEK[1]


def compare(tp: int, rank: int, ep: bool) -> dict:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from weight_transfer.engines import expected_from_checkpoint
    from weight_transfer.engines.vllm.checkpoint import hf_config
    from weight_transfer.engines.vllm.trace import loader as T
    from weight_transfer.testing.catalog import load_config, param_specs
    from weight_transfer.testing.weights import SyntheticCheckpoint
    from weight_transfer.types import InferenceLayout

    cfg = load_config("deepseek-v3", **TINY)
    hf = hf_config(cfg)
    hf["num_nextn_predict_layers"] = cfg["num_nextn_predict_layers"]  # the training config's 0: no draft there
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump(hf, f)
        ea = EngineArgs(model=d, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy", enforce_eager=True,
                        max_model_len=256, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
        c = ea.create_engine_config()
    c.parallel_config.tensor_parallel_size, c.parallel_config.enable_expert_parallel = tp, ep
    T._one_process_group(c)
    T._as_rank(ps.get_tp_group(), rank, tp)
    if getattr(ps, "_EP", None) is not None:
        T._as_rank(ps._EP, rank if ep else 0, tp if ep else 1)
    ck = SyntheticCheckpoint(param_specs(cfg, "mtp"), step=1, seed=0)
    cc = T._isolated(c)
    with set_current_vllm_config(cc), set_default_torch_dtype(torch.bfloat16), torch.no_grad():
        model = initialize_model(vllm_config=cc, model_config=c.speculative_config.draft_model_config, prefix="")
        model.load_weights(iter([(n, ck[n]) for n in ck.names()]))
    theirs = {f"draft.{n}": p.detach() for n, p in model.named_parameters()}
    eng = expected_from_checkpoint(cfg, InferenceLayout(tp=tp, ep=ep, draft="mtp"), rank, ck.__getitem__, ck.names())
    ours = {n: t for n, t in eng.named_parameters().items() if n.startswith("draft.")}
    differ = [n for n, t in ours.items() if n in theirs and (tuple(t.shape) != tuple(theirs[n].shape) or not torch.equal(
        t.contiguous().view(-1).view(torch.uint8), theirs[n].contiguous().view(-1).view(torch.uint8)))]
    return {"architecture": c.speculative_config.draft_model_config.hf_config.architectures[0],
            "only_vllm": sorted(set(theirs) - set(ours)), "only_stand_in": sorted(set(ours) - set(theirs)),
            "differ": differ, "compared": len(set(ours) & set(theirs)),
            "same_order": list(ours) == [n for n in theirs if n in ours]}


if __name__ == "__main__":
    tp, rank, ep = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    print("RESULT " + json.dumps(compare(tp, rank, ep)))
