"""``weight-transfer bench-transports``: the size sweep covers its window with distinct,
non-overlapping writes, threads split a batch, and a small run writes verified rows of every
table (sizes x threads, cases, registration) into the CSV."""
from __future__ import annotations

import pandas as pd
import pytest

from weight_transfer.experiments.bench import transports as T


def test_size_cases_cover_the_window_without_overlap():
    sizes = T.size_cases(4, 1, 2)
    assert list(sizes) == [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]
    for size, ops in sizes.items():
        assert all(n == size for *_, n in ops) and sum(n for *_, n in ops) == max(2 << 20, size)
        assert [so for so, *_ in ops] == [i * size for i in range(len(ops))]
    assert T.size_cases(1024, 4, 1) == {1 << 20: [(0, 0, 1 << 20)], 4 << 20: [(0, 0, 4 << 20)]}
    parts = T._split(list(range(7)), 2)
    assert parts == [[0, 1, 2, 3], [4, 5, 6]] and T._split([1], 2) == [[1]]


def test_config_refuses_bad_ranges():
    with pytest.raises(ValueError, match="min_kib KiB <= max_mib MiB"):
        T.TransportBenchConfig(min_kib=2048, max_mib=1)
    with pytest.raises(ValueError, match="threads"):
        T.TransportBenchConfig(threads=(0,))


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_small_run_writes_verified_rows_of_every_table(tmp_path, capsys):
    csv = tmp_path / "t.csv"
    cfg = T.TransportBenchConfig(transports=("memcpy", "cma"), min_kib=64, max_mib=1, window_mib=2, mib=4,
                                 model="qwen3-0.6b", repeats=1, csv=str(csv))
    assert T.main(cfg) == 0
    out = capsys.readouterr().out
    assert "[1] message sizes" in out and "[2] cases" in out and "[3] registration" in out
    df = pd.read_csv(csv)
    assert df["verified"].all()
    sizes = df[df["case"] == "size"]
    assert len(sizes) == 2 * 3 * 2  # transports x sizes (64 KiB, 256 KiB, 1 MiB) x threads
    assert set(sizes["threads"]) == {1, 2} and set(sizes["msg_bytes"]) == {64 << 10, 256 << 10, 1 << 20}
    reg = df[df["case"] == "register"]
    assert set(reg["transport"]) == {"cma"} and set(reg["msg_bytes"]) == {1 << 20, 4 << 20, 64 << 20}
    assert set(df[df["case"].isin(["large", "qwen3-0.6b"])]["transport"]) == {"memcpy", "cma"}
