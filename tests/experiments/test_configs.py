"""CI regression on a small model: every method verified, and the reference's speedup over the
rank-0 funnel, measured in the same run, stays above a threshold.

The sweep is :func:`weight_transfer.experiments.configs.ci_cpu_regression` (Qwen3 architecture, 2 layers, 8k
vocabulary, 80 MB; 2 training ranks -> TP2; 5 measured updates; watermark 16 MiB) run through
the sweep machinery (debug executor: each trial's ranks spawned as local processes), so the
tidy rows and trial keys are checked too.

Threshold. Only a ratio is checked, never an absolute time: ``speedup = funnel p50 /
reference p50`` over the measured updates of the same run. On the 2-core development VM the
ratio was 1.17, 1.19, 1.31 (load ~3) and 1.23 (load ~7); 4 layers gave 1.06 / 1.15,
so a larger model does not separate them more here. On 2 CPU cores both methods are bound by
the same cores copying bytes: the reference's point-to-point advantage (no single sending NIC,
no relaying) is small, and under heavy foreign load (load average 10-15) single runs ranged
from 0.5 to 3 either way. :data:`MIN_SPEEDUP` = 1.0 ("the reference is not slower than the
funnel") keeps ~15 % margin below the quiet-machine measurements; a run below it is measured
once more (reference and funnel only) and the better ratio counts, so one load spike does not
fail CI while a reference that really became slower than the funnel does. Run with ``-s`` to
see the ratios.
"""
from __future__ import annotations

import dataclasses
import statistics

import pandas as pd
import pytest

from tests.helpers import ROOT

MIN_SPEEDUP = 1.0
"""Funnel p50 / reference p50 must stay above this (see the module docstring)."""


def _run(sweep, tmp_path):
    from weight_transfer.experiments import sweep as S

    s = S.run_sweep(sweep, S.LaunchOptions(cluster="debug", folder=tmp_path / "jobs"), results_dir=tmp_path,
                    progress=False)
    assert not s.failed, "; ".join(f"{S.describe(o.cfg)}: {o.error} (log {o.log})" for o in s.failed)
    return pd.read_csv(tmp_path / f"{sweep.name}.csv")


def _speedup(df) -> tuple[float, dict]:
    meas = df[~df["warmup"].astype(bool)]
    p50 = {m: statistics.median(g["seconds"]) for m, g in meas.groupby("method")}
    return p50["rank0_funnel"] / p50["reference"], p50


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_every_method_verified_and_reference_beats_the_funnel(tmp_path):
    from weight_transfer.experiments import configs as C
    from weight_transfer.experiments import sweep as S

    sweep = C.ci_cpu_regression()
    df = _run(sweep, tmp_path / "a")
    assert set(df["method"]) == set(C.METHODS)
    assert df["verified"].astype(bool).all() and len(df) == 3 * 6
    assert df["bytes"].nunique() == 1  # the same bytes land, whatever the method
    assert df["trial_key"].nunique() == 3 and set(df["trial_key"]) == {S.trial_key(t) for t in sweep.trials}
    # the columns of a CSV written before the config was composed are all still written
    old = pd.read_csv(ROOT / "results" / "qwen3_cpu_small.csv", nrows=1)
    assert set(old.columns) <= set(df.columns), set(old.columns) - set(df.columns)
    speedup, p50 = _speedup(df)
    print(f"\n# p50 (s): {p50}; funnel / reference = {speedup:.2f} (threshold {MIN_SPEEDUP})")
    if speedup <= MIN_SPEEDUP:  # one re-measurement of the pair (see the module docstring)
        again = dataclasses.replace(sweep, trials=[t for t in sweep.trials if t.run.method != "rpc"])
        speedup2, p50b = _speedup(_run(again, tmp_path / "b"))
        print(f"# again: p50 (s): {p50b}; funnel / reference = {speedup2:.2f}")
        speedup, p50 = max((speedup, p50), (speedup2, p50b), key=lambda x: x[0])
    assert speedup > MIN_SPEEDUP, (f"reference p50 {p50['reference']:.3f} s vs funnel {p50['rank0_funnel']:.3f} s: "
                                   f"speedup {speedup:.2f} <= {MIN_SPEEDUP}")
