"""One-sided updates into an unmodified, running vLLM, verified by vLLM itself (marked ``vllm``;
skipped when vLLM is not installed: ``make vllm``).

Per model, two engine starts (35-150 s each on 2 cores, hence module-scoped fixtures): a fresh
engine from the step-1 checkpoint (its runtime bytes and greedy outputs are the oracle), then a
live engine from step 0 that serves, is updated to step 1 by one-sided writes planned against
the layout it reports, and must then equal the fresh one byte for byte (every tensor vLLM
computes with, packed copies included) and token/logprob for token/logprob on a short prompt
and one longer than two KV blocks (C21). C20: the expert and linear weights land in vLLM's CPU
runtime layouts.
"""
import pytest
import torch

# skipped without vllm, with the reason (tests/conftest.py); the first test of a model includes
# two engine starts (35-150 s each here, much more on a loaded machine)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

MODELS = {
    "qwen3_moe": ("qwen3-30b-a3b", dict(num_hidden_layers=2, num_experts=8, hidden_size=256, moe_intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                                         intermediate_size=512)),
    "qwen3": ("qwen3-0.6b", dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=64, vocab_size=1024)),
}


class World:
    """fresh@1 snapshot, live@0 outputs, the update, live@1 snapshot (see module docstring)."""

    def __init__(self, key, tmp):
        from engines.vllm import VllmEngine, write_checkpoint
        from engines.vllm.checkpoint import checkpoint_tensors
        from engines.vllm.loopback import OneSidedUpdater
        from engines.vllm.verify import fixed_prompts, snapshot
        from reference.catalog import load_config

        name, ov = MODELS[key]
        self.cfg = cfg = load_config(name, **ov)
        p0 = write_checkpoint(cfg, tmp / "step0", step=0, seed=0)
        p1 = write_checkpoint(cfg, tmp / "step1", step=1, seed=0)
        self.prompts = fixed_prompts(cfg.vocab_size)
        fresh = VllmEngine(p1)
        try:
            self.fresh_layouts = fresh.runtime_layouts()
            self.fresh = snapshot(fresh, self.fresh_layouts, self.prompts)
        finally:
            fresh.close()
        self.live = VllmEngine(p0)
        self.before = self.live.generate(self.prompts, max_tokens=6)  # fills the prefix cache (step 0)
        self.updater = OneSidedUpdater(cfg, self.live)
        self.sources = checkpoint_tensors(cfg, step=1, seed=0)
        self.updater.plan(self.sources)
        self.stats = self.updater.update(self.sources)
        self.after = snapshot(self.live, self.updater.layouts, self.prompts)

    def close(self):
        self.updater.close()
        self.live.close()


@pytest.fixture(scope="module", params=list(MODELS))
def world(request, tmp_path_factory):
    w = World(request.param, tmp_path_factory.mktemp(request.param))
    yield w
    w.close()


def test_update_equals_fresh_engine_bytes_and_outputs(world):
    from engines.vllm.verify import compare_snapshots

    res = compare_snapshots(world.after, world.fresh)
    assert res["bytes_ok"], res["mismatches"]
    assert res["bytes_checked"] > 0 and world.stats["bytes"] > 0
    assert res["outputs_ok"], res["output_diffs"]
    # C1: the update changed what the engine computes (step 0 outputs differ from step 1)
    assert world.before != world.fresh["outputs"]


def test_long_prompt_exceeds_kv_block(world):
    from engines.vllm.verify import KV_BLOCK_TOKENS

    assert len(world.prompts[1]) > 2 * KV_BLOCK_TOKENS
    assert world.after["outputs"][1] == world.fresh["outputs"][1]


def test_c20_runtime_layouts_reported_and_targeted(world):
    """The plan targets what vLLM computes with: packed GEMM copies (the linear weights are
    0-byte husks after loading on this CPU) and, for MoE, the prepacked expert weights."""
    lay = next(iter(world.updater.layouts.values()))
    layouts = {t.name: t.layout for t in lay.targets}
    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("layouts below are those of AMX CPUs")
    assert layouts["model.layers.0.self_attn.qkv_proj.cpu_linear.packed_weight"] == "blocked:32x2"
    assert "model.layers.0.self_attn.qkv_proj.weight" in lay.ignored
    if world.cfg.num_experts:
        assert layouts["model.layers.0.mlp.experts.routed_experts.w13_weight"] == "blocked:16x2"
        assert layouts["model.layers.0.mlp.gate.cpu_linear.packed_weight"] == "transposed"
    assert not lay.refused


def test_c21_stale_prefix_cache_without_reset(world):
    """Rewrite step 1 without resetting the prefix cache after generating with step-0 KV...:
    the engine first serves step 2, a write of step 2 without reset keeps the long prompt's
    cached blocks of step 1, and only the reset gives the fresh result. Runs last on the
    live engine (it changes its weights)."""
    from engines.vllm.checkpoint import checkpoint_tensors

    live, up = world.live, world.updater
    s0 = checkpoint_tensors(world.cfg, step=0, seed=0)
    up.update(s0)                                     # back to step 0, cache reset
    assert live.generate(world.prompts, max_tokens=6) == world.before  # step-0 KV now cached
    live.pause()
    from reference.executor import Executor
    Executor(up.schedule.rank_plans[0], world.sources, up.tx, up.descriptors).run()  # step 1, no reset
    live.resume()
    stale = live.generate(world.prompts, max_tokens=6)
    assert stale[0] == world.fresh["outputs"][0]      # short prompt: no full block cached
    assert stale[1] != world.fresh["outputs"][1]      # long prompt reused step-0 KV blocks
    live.reset_prefix_cache()
    assert live.generate(world.prompts, max_tokens=6) == world.fresh["outputs"]


def test_stand_in_names_match_live_vllm(world):
    """engines/engine.py (the stand-in for fast tests) has exactly the live engine's parameter
    names, shapes (as loaded: a packed parameter's logical shape) and dtypes."""
    from engines import Engine
    from reference.types import InferenceLayout

    rep = world.live.reports()[0]
    lay = next(iter(world.updater.layouts.values()))
    live = {}
    for p in rep["params"]:
        shape = tuple(p["shape"])
        if not p["nbytes"]:
            tg = lay.targets_of(p["name"])
            assert tg, f"{p['name']}: 0 bytes and no runtime target"
            shape = tg[0].shape
        live[p["name"]] = (shape, p["dtype"])
    stand_in = {m.name: (tuple(m.shape), m.dtype) for m in Engine(world.cfg, InferenceLayout(tp=1), 0).tensor_metas()}
    assert stand_in == live


def test_baselines_loading_path_equals_fresh_engine(world):
    """The baselines' path (``--method rank0_funnel|rpc`` with ``--engine vllm``): vLLM's own
    in-place reload through ``collective_rpc`` (``initialize_layerwise_reload``,
    ``model.load_weights``, ``finalize_layerwise_reload`` + the tied-lm_head repack and the CPU
    MoE prepack vLLM 0.32 leaves out) gives the fresh engine's bytes and outputs, whether the
    tensors come in one call (funnel bucket) or one call each (rpc). Runs last: the reload puts
    the packed copies in new tensors, so the one-sided plan's addresses no longer hold."""
    from engines.vllm.checkpoint import checkpoint_tensors
    from engines.vllm.verify import compare_snapshots, snapshot

    live = world.live
    s0 = checkpoint_tensors(world.cfg, step=0, seed=0)
    live.pause()
    live.reload(list(s0.items()))                      # funnel-like: one load_weights call
    live.reset_prefix_cache()
    live.resume()
    assert live.generate(world.prompts, max_tokens=6) == world.before
    live.pause()
    live.reload_begin()                                # rpc-like: one load_weights call per tensor
    for name, t in world.sources.items():
        live.load_weights([(name, t)])
    live.reload_finish()
    live.reset_prefix_cache()
    live.resume()
    res = compare_snapshots(snapshot(live, world.updater.layouts, world.prompts), world.fresh)
    assert res["bytes_ok"], res["mismatches"]
    assert res["outputs_ok"], res["output_diffs"]
