"""scripts/bench_apply.py: the commit's check and scatter on 1 and 2 threads prints one row per
thread count with every record applied; bad arguments are one error line and exit status 2."""
from __future__ import annotations

import sys

import pytest

from tests.helpers import ROOT
from weight_transfer.delta.runs import native_status

sys.path.insert(0, str(ROOT / "scripts"))
import bench_apply


@pytest.mark.skipif(native_status() != "ok", reason="the native delta kernel is unavailable")
def test_bench_apply_prints_a_row_per_thread_count(capsys, monkeypatch):
    import weight_transfer.delta.packed as dp

    monkeypatch.setattr(dp, "APPLY_THREADS", dp.APPLY_THREADS)
    monkeypatch.setattr(dp, "_POOL", None)
    assert bench_apply.main(["--threads", "1,2", "--repeats", "1"]) == 0
    rows = [l.split() for l in capsys.readouterr().out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["1", "2"]
    assert all(r[1] == str(len(bench_apply.SIZES)) and int(r[2]) > 100_000 and float(r[3]) > 0 for r in rows)


@pytest.mark.parametrize("args", [["--threads", "0"], ["--threads", "x"], ["--repeats", "0"]])
def test_bench_apply_refuses_bad_arguments(args, capsys):
    assert bench_apply.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
