"""``weight-transfer bench-pipeline``: the trial every row of the bench starts from (no processes)."""
from __future__ import annotations

from weight_transfer.experiments.bench.pipeline import PipelineBenchConfig, base_trial
from weight_transfer.experiments.config import TrialConfig, main_job_default


def test_default_bench_is_the_main_job_with_overrides_on_top():
    """Without ``--model`` the bench runs the main job's model (its overrides, FP8) and the
    given overrides on top; the trial builds, over the transport ``auto`` picks for it."""
    main = main_job_default()
    base = base_trial(PipelineBenchConfig())
    assert (base["model"], base["overrides"], base["quant"]) == (main.model.name, main.model.overrides, "fp8")
    cfg = TrialConfig.from_flat(**base)
    assert cfg.model == main.model and cfg.transport == "shm"
    more = base_trial(PipelineBenchConfig(override=("num_experts=8",), quant="none"))
    assert more["overrides"] == {**main.model.overrides, "num_experts": 8} and more["quant"] is None
    own = base_trial(PipelineBenchConfig(model="qwen3-0.6b", override=("num_hidden_layers=2",)))
    assert (own["model"], own["overrides"]) == ("qwen3-0.6b", {"num_hidden_layers": 2}) and "quant" not in own
    assert TrialConfig.from_flat(**own).model.overrides == {"num_hidden_layers": 2}
