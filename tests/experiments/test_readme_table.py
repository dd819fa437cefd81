"""``weight-transfer report``'s load cell (weight_transfer.experiments.readme_table): rows measured
under load are marked, quiet rows show the others' share of the CPUs, rows of CSVs without the
load columns say ``not recorded``. Synthetic CSVs; the README's own table is
tests/project/test_readme.py's."""
from __future__ import annotations

import pandas as pd

from weight_transfer.experiments.readme_table import Group, group_rows

NAN = float("nan")


def _trial_rows(method: str, run_id: str, stamp: str, seconds: list[float], **load) -> list[dict]:
    return [dict(run_id=run_id, timestamp=stamp, method=method, n_train=2, layout="TP2", engine="stand-in",
                 transport="shm", step=i + 1, warmup=i == 0, bytes=1000, seconds=s, verified=True, **load)
            for i, s in enumerate(seconds)]


def _load_cells(lines: list[str]) -> list[str]:
    return [line.split(" | ")[8] for line in lines]  # result | method | ... | verified | load | rows | command


def test_trial_rows_loaded_quiet_and_not_recorded(tmp_path):
    rows = (_trial_rows("reference", "a", "2026-01-01T00:00:00", [9.0, 1.0, 1.0], load_avg_1m=0.3, cpus=2,
                        other_cpu=0.02, own_cpu=0.9)
            + _trial_rows("rank0_funnel", "b", "2026-01-01T00:01:00", [9.0, 2.0, 2.0], load_avg_1m=0.4, cpus=2,
                          other_cpu=0.35, own_cpu=0.6)
            + _trial_rows("rpc", "c", "2026-01-01T00:02:00", [9.0, 3.0, 3.0], load_avg_1m=NAN, cpus=NAN,
                          other_cpu=NAN, own_cpu=NAN))
    rows[0]["other_cpu"] = 0.9  # the warm-up update's load does not count
    pd.DataFrame(rows).to_csv(tmp_path / "t.csv", index=False)
    g = Group(title="t", csv="t.csv", kind="trial", command="weight-transfer run")
    lines = group_rows(g, tmp_path)
    assert _load_cells(lines) == ["0.02 (loadavg 0.30)", "**0.35 (loadavg 0.40) loaded**", "not recorded"]
    assert lines[1].split(" | ")[6] == "2.00"  # the ratio is still there, the row marked beside it


def test_a_csv_without_the_load_columns_reads_as_not_recorded(tmp_path):
    pd.DataFrame(_trial_rows("reference", "a", "2026-01-01T00:00:00", [1.0, 1.0])).to_csv(tmp_path / "old.csv",
                                                                                      index=False)
    g = Group(title="t", csv="old.csv", kind="trial", command="weight-transfer run")
    assert _load_cells(group_rows(g, tmp_path)) == ["not recorded"]


def test_the_load_average_alone_judges_a_row_with_its_cpu_count(tmp_path):
    rows = (_trial_rows("reference", "a", "2026-01-01T00:00:00", [1.0, 1.0], load_avg_1m=0.4, cpus=2, other_cpu=NAN)
            + _trial_rows("rpc", "b", "2026-01-01T00:01:00", [1.0, 2.0], load_avg_1m=3.0, cpus=2, other_cpu=NAN))
    pd.DataFrame(rows).to_csv(tmp_path / "t.csv", index=False)
    g = Group(title="t", csv="t.csv", kind="trial", command="weight-transfer run")
    assert _load_cells(group_rows(g, tmp_path)) == ["loadavg 0.40 / 2 CPUs", "**loadavg 3.00 / 2 CPUs loaded**"]


def test_peer_rows(tmp_path):
    base = dict(run_id="r", timestamp="2026-01-01T00:00:00", n_train=2, n_infer=2, bytes=1000, verified=True)
    rows = ([dict(base, peer="reference", transport="shm", step=i, seconds=1.0, load_avg_1m=0.2, cpus=2,
                  other_cpu=0.01) for i in range(2)]
            + [dict(base, peer="torchstore", transport="shm", step=i, seconds=2.0, load_avg_1m=1.8, cpus=2,
                    other_cpu=0.45) for i in range(2)])
    pd.DataFrame(rows).to_csv(tmp_path / "p.csv", index=False)
    g = Group(title="p", csv="p.csv", kind="peers", command="weight-transfer bench-peers")
    assert _load_cells(group_rows(g, tmp_path)) == ["0.01 (loadavg 0.20)", "**0.45 (loadavg 1.80) loaded**"]


def test_trl_rows_fall_back_to_the_load_average_they_kept(tmp_path):
    base = dict(run_id="r", timestamp="2026-01-01T00:00:00", ranks=1, update_bytes=1000, tok_s_during=1.0,
                during_over_between=0.5, busy_during=0.5, busy_between=0.8, verified=True, error=NAN)
    rows = [dict(base, mode="off", sync_s_p50=0.2, load1_start=1.09, load_avg_1m=NAN, cpus=NAN, other_cpu=NAN),
            dict(base, mode="auto", sync_s_p50=0.3, load1_start=0.5, load_avg_1m=0.5, cpus=2, other_cpu=0.2)]
    pd.DataFrame(rows).to_csv(tmp_path / "trl.csv", index=False)
    g = Group(title="trl", csv="trl.csv", kind="trl", command="weight-transfer bench-trl")
    assert _load_cells(group_rows(g, tmp_path)) == ["not recorded (loadavg 1.09)", "**0.20 (loadavg 0.50) loaded**"]
