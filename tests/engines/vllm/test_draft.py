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
