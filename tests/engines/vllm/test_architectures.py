"""C29 against real vLLM: models outside the hand-written families (and a trainer holding fused
experts) updated through the ``one_sided`` backend, planned from the recipes each vLLM worker
traced from its own loader, and verified against a fresh vLLM started from the same step's
checkpoint: every addressable runtime byte, every staging byte against what vLLM's own
``load_weights`` makes of the checkpoint (a CPU skeleton in a child process), and the greedy
tokens and logprobs of fixed prompts (one longer than two KV blocks), for two consecutive
versions.

- ``opt``: OPT, vLLM's own RLHF example's model family (biases, learned positions with an
  offset, tied head) -- in CI;
- ``llama``, ``qwen2``, ``phi3`` (qkv and gate_up fused in the checkpoint), ``gemma3`` (extra
  norms, sliding window), ``glm4_moe`` (routed + shared experts, a dense first layer, a float32
  router bias): ``long`` (an engine each, 1.5-2 min here: ``make test-long``);
- ``qwen3_moe_fused``: Qwen3-MoE from a trainer holding transformers 5's fused
  ``mlp.experts.gate_up_proj`` / ``down_proj``, declared as views (``fused_expert_views``) --
  ``long``.
"""
from __future__ import annotations

import time

import pytest

from weight_transfer.engines.vllm.engine import vllm_available
from weight_transfer.testing.tiny import TINY_QWEN3_MOE, TINY_TRACED

from ...helpers.vllm_server import LIVE_CPU, env_vars

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (make vllm)")

WORLDS = {
    "opt": "opt-125m",
    "llama": "llama-3.2-1b",
    "qwen2": "qwen2.5-0.5b",
    "phi3": "phi-3-mini",
    "gemma3": "gemma-3-1b",
    "glm4_moe": "glm-4.5-air",
    "qwen3_moe_fused": TINY_QWEN3_MOE[0],
}
IN_CI = ("opt",)
STEPS = (1, 2)
MAX_TOKENS = 6


def _cfg(key):
    from weight_transfer.testing.catalog import load_config

    name = WORLDS[key]
    return load_config(name, **(TINY_QWEN3_MOE[1] if key == "qwen3_moe_fused" else TINY_TRACED[name]))


def _fuse(cfg, tensors: dict) -> dict:
    """The per-expert checkpoint tensors as transformers 5 holds them: one [E, 2I, H]
    ``gate_up_proj`` and one [E, H, I] ``down_proj`` per layer (new tensors)."""
    import re

    import torch

    out = {n: t.clone() for n, t in tensors.items() if ".mlp.experts." not in n}
    layers = sorted({int(m.group(1)) for n in tensors if (m := re.match(r"model\.layers\.(\d+)\.mlp\.experts\.", n))})
    for i in layers:
        p = f"model.layers.{i}.mlp.experts."
        E = cfg.num_experts
        out[p + "gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}{e}.gate_proj.weight"],
                                                          tensors[f"{p}{e}.up_proj.weight"]]) for e in range(E)])
        out[p + "down_proj"] = torch.stack([tensors[f"{p}{e}.down_proj.weight"] for e in range(E)])
    return out


class World:
    """One live engine with the backend, two updates, the snapshots after each."""

    def __init__(self, key, root):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

        from weight_transfer.engines.vllm import VllmEngine, write_checkpoint
        from weight_transfer.engines.vllm.backend.plugin import DTensorSource, LLMClient, OneSidedTrainerInitInfo
        from weight_transfer.engines.vllm.checkpoint import checkpoint_tensors
        from weight_transfer.engines.vllm.oracle import fresh_snapshots_subprocess
        from weight_transfer.engines.vllm.verify import fixed_prompts, snapshot
        from weight_transfer.engines.vllm.worker.runtime import runtime_layout
        from weight_transfer.plan.traced import fused_expert_views

        t0 = time.monotonic()
        self.cfg = cfg = _cfg(key)
        self.prompts = fixed_prompts(cfg.vocab_size)
        dirs = {s: write_checkpoint(cfg, root / f"step{s}", step=s, seed=0) for s in (0, *STEPS)}
        wait = fresh_snapshots_subprocess({str(s): {"dir": dirs[s], "prompts": self.prompts} for s in STEPS},
                                          root / "fresh.pt", max_tokens=MAX_TOKENS, wait=False, omp_threads=1)
        with env_vars(VLLM_CPU_OMP_THREADS_BIND=LIVE_CPU):
            self.live = VllmEngine(dirs[0], weight_transfer_config={"backend": "one_sided"})
        self.ck = {s: checkpoint_tensors(cfg, step=s, seed=0) for s in (0, *STEPS)}
        fused = key.endswith("_fused")
        self.params = _fuse(cfg, self.ck[0]) if fused else {n: t.clone() for n, t in self.ck[0].items()}
        views = fused_expert_views({n: tuple(t.shape) for n, t in self.params.items()}, "qwen3_moe") if fused else None
        self.trainer = WeightTransferTrainerFactory.trainer_init(
            OneSidedTrainerInitInfo(rank=0, world_size=1, timeout=60), client=LLMClient(self.live.llm),
            source=DTensorSource(self.params, views=views))
        self.recipes_from = self.trainer.coordinator.recipes_from
        self.snaps, self.results = {}, {}
        for s in STEPS:
            new = _fuse(cfg, self.ck[s]) if fused else self.ck[s]
            for n, t in new.items():
                self.params[n].copy_(t)
            self.trainer.send_weights()
            v = self.trainer.version
            self.results[v] = self.trainer.last_result
            self.layouts = {r["tp_rank"]: runtime_layout(r, r["tp_rank"]) for r in self.live.reports()}
            self.snaps[v] = snapshot(self.live, self.layouts, self.prompts, max_tokens=MAX_TOKENS)
        self.fresh = wait()
        self.seconds = time.monotonic() - t0

    def close(self):
        self.trainer.shutdown()
        self.live.close()


@pytest.fixture(scope="module", params=[pytest.param(k, marks=() if k in IN_CI else pytest.mark.long) for k in WORLDS])
def world(request, tmp_path_factory):
    w = World(request.param, tmp_path_factory.mktemp(request.param))
    yield request.param, w
    w.close()


def test_c29_update_equals_a_fresh_vllm(world):
    from weight_transfer.engines.vllm.verify import compare_snapshots, coverage, staging_oracle

    key, w = world
    assert w.recipes_from.startswith("recipes: traced from vllm "), w.recipes_from
    if w.cfg.hand_written:
        assert "equal to the hand-written rules" in w.recipes_from, w.recipes_from
    for v, step in zip(sorted(w.snaps), STEPS):
        live, fresh = w.snaps[v], w.fresh[str(step)]
        exp = staging_oracle(w.cfg, w.layouts, w.ck[step].__getitem__, list(w.ck[step]), tp=1) if live["staging"] else None
        res = compare_snapshots(live, fresh, staging_expected=exp)
        assert res["bytes_ok"], (v, res["mismatches"])
        assert res["staging_ok"] is not False, (v, res["mismatches"])
        assert res["outputs_ok"], (v, res["output_diffs"])
        assert res["bytes_checked"] > 0
        r = w.results[v]
        assert r.version == v and r.bytes > 0
        cov = coverage(w.layouts, res)
        print(f"\n[{key} v{v}] {w.cfg.architecture}: {r.bytes} bytes in {r.seconds:.3f} s; bytes checked "
              f"{res['bytes_checked']} direct + {res['staging_bytes_checked']} staged; coverage direct "
              f"{cov['direct']:.1%}, staged {cov['staged']:.1%}, outputs only {cov['outputs_only']:.1%}; "
              f"logprob ulps {res['logprob_ulps']}; world {w.seconds:.0f} s")
    assert w.fresh[str(STEPS[0])]["outputs"] != w.fresh[str(STEPS[1])]["outputs"]  # the versions differ
