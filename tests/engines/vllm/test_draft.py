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


def test_c33_an_engine_serving_a_draft_is_refused_at_init_not_left_stale(tmp_path):
    """The backend registers the target's memory only: a vLLM engine started with an MTP draft
    (``--speculative-config '{"method": "mtp"}'``, vLLM's real config for a GLM-4.5 checkpoint with its
    MTP layer) is refused at ``init_transfer_engine``, naming the draft, before anything is registered:
    an update would otherwise leave the draft stale (C33). The same engine without a draft passes."""
    from weight_transfer.engines.vllm.backend_worker import refuse_draft
    from weight_transfer.engines.vllm.checkpoint import hf_config
    from weight_transfer.engines.vllm.trace import engine_config
    from weight_transfer.testing.catalog import load_config
    from weight_transfer.testing.tiny import TINY_TRACED

    cfg = load_config("glm-4.5-air", **TINY_TRACED["glm-4.5-air"])
    (tmp_path / "config.json").write_text(json.dumps(hf_config(cfg, draft="mtp")))
    refuse_draft(engine_config(str(tmp_path)), "inference 0")  # no draft: nothing to refuse
    with pytest.raises(RuntimeError, match=r"inference 0: this engine serves a speculative-decoding draft "
                                           r"\(Glm4MoeMTPModel, speculative_config method 'mtp'\).*stale.*C33"):
        refuse_draft(engine_config(str(tmp_path), draft="mtp"), "inference 0")
