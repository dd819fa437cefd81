"""analysis/: tidy CSV rows -> summary.md and PNG plots; never imports the transfer code."""
from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd

from tests.helpers import ROOT
from weight_transfer.analysis import plots


def synthetic_rows() -> list[dict]:
    """A small sweep's worth of rows: 3 sizes x 3 methods, 3 worlds x 2 methods, 3 watermarks."""
    rows, speed = [], {"reference": 0.5, "rank0_funnel": 0.3, "rpc": 0.2}  # GB/s

    def trial(method, layers, n_train, tp, dp, wm, key):
        nbytes = layers * 30_000_000 * dp * 2 // 2
        for step in (1, 2, 3, 4):
            rows.append({"run_id": key, "git_sha": "abc", "timestamp": f"2026-01-01T00:00:0{step}", "host": "box",
                         "method": method, "model": f"qwen3-0.6b[num_hidden_layers={layers}]", "dtype": "bfloat16",
                         "train_dtype": "bfloat16", "n_train": n_train, "n_infer": tp * dp,
                         "layout": f"TP{tp}" + (f"xDP{dp}" if dp > 1 else ""), "watermark": wm, "transport": "cma",
                         "step": step, "warmup": step == 1, "bytes": nbytes,
                         "seconds": nbytes / (speed[method] * 1e9 * n_train ** 0.3) * (1 + 0.01 * step),
                         "verified": True, "peak_temp_bytes": (wm or 80 << 20) // 2, "trial_key": key,
                         "sweep": "s", "job_id": "1", "cluster": "local", "memcpy_gbps": 3.0})

    for layers in (2, 4, 8):
        for m in speed:
            trial(m, layers, 2, 2, 1, None, f"s{layers}{m}")
    for n, tp, dp in ((1, 1, 1), (4, 2, 1), (2, 2, 2)):
        for m in ("reference", "rank0_funnel"):
            trial(m, 4, n, tp, dp, None, f"w{n}{tp}{dp}{m}")
    for wm in (4 << 20, 16 << 20):
        trial("reference", 4, 2, 2, 1, wm, f"m{wm}")
    return rows


def test_summary_derives_p50_bandwidth_and_speedups():
    df = pd.DataFrame(synthetic_rows())
    df = df[~df["warmup"]]
    s = plots.summarize(df)
    assert len(s) == 9 + 6 + 2
    r = s[(s["method"] == "reference") & (s["layout"] == "TP2") & s["watermark"].isna()
          & (s["model"] == "qwen3-0.6b[num_hidden_layers=4]")].iloc[0]
    assert r["updates"] == 3 and abs(r["algbw_gbps"] - r["bytes"] / r["p50_s"] / 1e9) < 1e-12
    sp = plots.speedups(s)
    assert (sp["speedup"] > 1).all() and set(sp["baseline"]) == {"rank0_funnel", "rpc"}
    md = plots.summary_markdown(s, sources=["results/s.csv"], env="host: box")
    assert "| reference |" in md and "Speedup of the reference" in md and "4 MiB" in md


def test_cli_writes_plots_and_summary(tmp_path):
    csv = tmp_path / "s.csv"
    pd.DataFrame(synthetic_rows()).to_csv(csv, index=False)
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "pid": r, "tid": 1, "cat": st, "name": f"t{i}", "ts": 1000 * i + 300 * j, "dur": 250}
        for r in (0, 1) for i in range(3) for j, st in enumerate(("prepare", "write", "release"))]}))
    from weight_transfer.analysis.__main__ import main

    assert main([str(csv), "-o", str(tmp_path / "out"), "--timeline", str(trace)]) == 0
    out = tmp_path / "out"
    for name in ("latency_vs_size.png", "bandwidth_vs_ranks.png", "watermark.png", "timeline.png", "summary.md"):
        assert (out / name).exists() and (out / name).stat().st_size > 1000, name
    assert (out / "latency_vs_size.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "summary.md").read_text()
    assert "host: box" in md and "(latency_vs_size.png)" in md


def test_missing_data_skips_a_plot_instead_of_failing(tmp_path):
    rows = [r for r in synthetic_rows() if r["run_id"].startswith("s") and "num_hidden_layers=2" in r["model"]]
    csv = tmp_path / "one.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    from weight_transfer.analysis.__main__ import main

    assert main([str(csv), "-o", str(tmp_path)]) == 0
    assert not (tmp_path / "latency_vs_size.png").exists() and (tmp_path / "summary.md").exists()


def test_analysis_imports_no_transfer_code():
    code = ("import sys, weight_transfer.analysis.__main__, weight_transfer.analysis.plots; "
            "bad = sorted(m for m in sys.modules if m.startswith('weight_transfer.') and not "
            "m.startswith('weight_transfer.analysis')); print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_phases_plot_is_a_stacked_bar_per_method_and_model(tmp_path):
    df = pd.DataFrame([{"method": m, "model": "tiny", "seconds": 1.0, "phase_prepare_s": 0.4, "phase_write_s": 0.5,
                        "phase_publish_s": 0.01} for m in ("reference", "rank0_funnel")])
    assert plots.plot_phases(df, tmp_path / "phases.png").stat().st_size > 1000
    assert plots.plot_phases(df.drop(columns=[c for c in df if c.startswith("phase_")]), tmp_path / "none.png") is None
