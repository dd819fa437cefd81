"""A live vLLM engine serving an MTP draft, updated through the ``one_sided`` backend (C33).

The model is the tiny GLM-4.5-Air (``Glm4MoeForCausalLM``, catalog ``glm-4.5-air`` with
``TINY_TRACED``) with its MTP layer ``model.layers.2.*``, served with ``{"method": "mtp",
"num_speculative_tokens": 1}``. Its weights (:func:`agree_tensors`) make the draft's acceptance
depend on the draft being the same version as the target: every attention ``o_proj`` and MLP
``down_proj`` is zero (target and draft: each token's logits are ``lm_head(norm(embed(t)))``),
the draft's ``eh_proj`` is ``[I | 0]`` and its ``enorm`` / ``hnorm`` ones, so the draft predicts
``lm_head(shared_head.norm(embed(t)))``; ``model.norm.weight`` and the draft's
``shared_head.norm.weight`` are the same step-dependent vector. A draft of the right version
then agrees with the target (accepted), a stale one predicts with the previous step's norm
(mostly rejected). Every other tensor is the synthetic checkpoint of that step.

Run as a child (in-process engine core; ``OMP_NUM_THREADS`` as the oracle's; the test sets
``WT_VLLM_HIDE_AMX=1`` so that an AMX host takes the same oneDNN path, with staged linears)::

    python -m tests.helpers.draft_live OUT.pt CKPT_ROOT

``CKPT_ROOT/step{s}`` are the checkpoints of :func:`write_agree_checkpoints`. The engine starts
from step 0; a trainer (world size 1, the full tensors of target and draft) updates it to steps
1 and 2 (versions 1 and 2) and shuts down (with vLLM's ``shutdown_weight_transfer_engine``); a
second trainer, with shadow targets (``auto``), updates the same engine to steps 1 and 2 again
(versions 3 and 4) (:data:`PHASES`). Every update runs with end-to-end fingerprints
(``verify="full"``).

``OUT.pt`` (``torch.save``; tensors, lists, numbers, strings):

- ``"snaps"``: {version: snapshot (:func:`weight_transfer.engines.vllm.verify.snapshot`, with
  ``"label"``: vLLM's weight version)}; ``"step"``, ``"shadow"``: {version: step, shadow mode};
- ``"staging_expected"``: {version: {rank: {name: tensor}}}, vLLM's ``load_weights`` of the
  step (versions without shadow targets);
- ``"coverage"``: {version: :func:`~weight_transfer.engines.vllm.verify.coverage` of the layouts};
- ``"verified"``: {version: (fingerprint mode, bytes fingerprinted, bytes written)};
- ``"report"``: the worker's report after init (names only); ``"recipes"``: {shadow mode: the
  planner's line};
- ``"draft_session"``: the error of vLLM's ``start_draft_weight_update`` after the last update;
  ``"label_after"``: vLLM's weight version after it.

``WT_DRAFT_LIVE_MP=1``: a multi-process engine (engine core and worker in processes of their own)
instead of the in-process one.
"""
from __future__ import annotations

import os
import sys

SPEC = {"method": "mtp", "num_speculative_tokens": 1}
"""The engine's ``speculative_config``."""
MODEL = "glm-4.5-air"
STEPS = (0, 1, 2)
MAX_TOKENS = 12


def config():
    from weight_transfer.testing.catalog import load_config
    from weight_transfer.testing.tiny import TINY_TRACED

    return load_config(MODEL, **TINY_TRACED[MODEL])


def agree_tensors(cfg, step: int, *, draft_step: int | None = None) -> dict:
    """Checkpoint name -> full tensor of ``step`` (module docstring); ``draft_step``: the MTP
    layer's tensors of that step instead (a stale draft)."""
    import torch

    from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors

    t = checkpoint_tensors(cfg, step=step, seed=0, draft="mtp")
    L, H = cfg.num_layers, cfg.hidden_size
    mtp = f"model.layers.{L}."
    if draft_step is not None and draft_step != step:
        old = agree_tensors(cfg, draft_step)
        t.update({n: v for n, v in old.items() if n.startswith(mtp)})
        return t
    for n in t:
        if n.endswith(("o_proj.weight", "down_proj.weight")):
            t[n] = torch.zeros_like(t[n])
    g = torch.Generator().manual_seed(1000 + step)
    norm = (0.25 + 1.5 * torch.rand(H, generator=g)).to(t["model.norm.weight"].dtype)
    t["model.norm.weight"] = norm
    t[mtp + "shared_head.norm.weight"] = norm.clone()
    t[mtp + "enorm.weight"] = torch.ones_like(t[mtp + "enorm.weight"])
    t[mtp + "hnorm.weight"] = torch.ones_like(t[mtp + "hnorm.weight"])
    eh = torch.zeros_like(t[mtp + "eh_proj.weight"])
    eh[:, :H] = torch.eye(H, dtype=eh.dtype)
    t[mtp + "eh_proj.weight"] = eh
    return t


def write_agree_checkpoints(root, *, stale: bool = True) -> dict:
    """``{key: directory}``: ``step0`` .. ``step2`` (:func:`agree_tensors`) and, with ``stale``,
    ``step2_draft1`` (step 2 with step 1's draft)."""
    from pathlib import Path

    from weight_transfer.engines.vllm.checkpoint import write_checkpoint_tensors

    cfg, out = config(), {}
    for s in STEPS:
        out[f"step{s}"] = write_checkpoint_tensors(cfg, Path(root) / f"step{s}", agree_tensors(cfg, s), draft="mtp")
    if stale:
        out["step2_draft1"] = write_checkpoint_tensors(cfg, Path(root) / "step2_draft1",
                                                       agree_tensors(cfg, 2, draft_step=1), draft="mtp")
    return out


def prompts(vocab: int) -> list[list[int]]:
    from weight_transfer.engines.vllm.verify import fixed_prompts

    return fixed_prompts(vocab) + [[(13 * i + 5) % (vocab - 1) + 1 for i in range(9)]]


PHASES = (("off", ((1, 1), (2, 2))), ("auto", ((3, 1), (4, 2))))
"""(the workers' shadow targets, ((version, step), ...)): one trainer per phase, the second
initialized on the same engine after the first's ``shutdown``."""


def main(out: str, root: str) -> int:
    if os.environ.get("WT_DRAFT_LIVE_MP") != "1":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from weight_transfer.engines.vllm.backend.plugin import DTensorSource, LLMClient, OneSidedTrainerInitInfo
    from weight_transfer.engines.vllm.engine import VllmEngine
    from weight_transfer.engines.vllm.verify import coverage, snapshot, staging_oracle
    from weight_transfer.engines.vllm.worker.runtime import runtime_layout

    cfg = config()
    ps = prompts(cfg.vocab_size)
    eng = VllmEngine(os.path.join(root, "step0"), targets="direct", weight_transfer_config={"backend": "one_sided"},
                     speculative_config=SPEC)
    params = {n: t.clone() for n, t in agree_tensors(cfg, 0).items()}
    res = {"snaps": {}, "staging_expected": {}, "step": {}, "shadow": {}, "recipes": {}, "coverage": {}, "verified": {}}
    try:
        for shadow, updates in PHASES:
            trainer = WeightTransferTrainerFactory.trainer_init(
                OneSidedTrainerInitInfo(rank=0, timeout=120, shadow=shadow, verify="full"), client=LLMClient(eng.llm),
                source=DTensorSource(params))
            try:
                rep = eng.reports()[0]
                res["report"] = {"params": [p["name"] for p in rep["params"]], "aliases": dict(rep["aliases"]),
                                 "staged": [s["module"] for s in rep["staged"]], "isa": rep["isa"]}
                res["recipes"][shadow] = str(trainer.coordinator.recipes_from)  # where the recipes came from
                for v, step in updates:
                    new = agree_tensors(cfg, step)
                    for n, t in new.items():
                        params[n].copy_(t)
                    trainer.send_weights(version=v)
                    lays = {r["tp_rank"]: runtime_layout(r, r["tp_rank"]) for r in eng.reports()}
                    res["snaps"][v] = snapshot(eng, lays, ps, max_tokens=MAX_TOKENS)
                    res["snaps"][v]["label"] = eng.llm.get_weight_version()
                    res["step"][v], res["shadow"][v] = step, shadow
                    lr = trainer.last_result  # the update's end-to-end fingerprints (verify="full")
                    res["verified"][v] = (str(lr.verify), int(lr.verified_bytes or 0), int(lr.bytes))
                    res["coverage"][v] = coverage(lays)  # fractions of the engine's bytes each check can cover
                    if shadow == "off":  # with shadow targets the live layers are rebuilt clones, not the staging
                        res["staging_expected"][v] = staging_oracle(cfg, lays, new.__getitem__, new, tp=1,
                                                                    draft="mtp")
                try:  # vLLM's own draft session: the draft is written with the target, so it is refused by name
                    eng.llm.start_draft_weight_update()
                    res["draft_session"] = "accepted"
                except Exception as e:
                    res["draft_session"] = str(e)
                res["label_after"] = eng.llm.get_weight_version()
            finally:
                trainer.shutdown()
                eng.llm.shutdown_weight_transfer_engine()  # vLLM's release: the next trainer inits afresh
    finally:
        eng.close()
    torch.save(res, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
