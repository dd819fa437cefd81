"""Results files (C25): a bad output path is refused before any work, and rows already in a
file are never lost, also when the disk fills while rows are being appended."""
from __future__ import annotations

import os
import subprocess

import pandas as pd
import pytest

from weight_transfer.experiments.report import append_csv, check_output_dir, check_output_file


def _row(i: int, **extra) -> dict:
    return {"run_id": "r", "step": i, "seconds": 0.1 * i, "verified": True, **extra}


def test_append_keeps_every_row_and_unions_columns(tmp_path):
    p = tmp_path / "rows.csv"
    append_csv([_row(1), _row(2)], p)
    append_csv([_row(3)], p)  # same columns: appended in place
    append_csv([_row(4, verify_error="x")], p)  # a new column: the file is rewritten whole
    append_csv([_row(5)], p)  # fewer columns than the file: appended, the missing one empty
    df = pd.read_csv(p)
    assert list(df["step"]) == [1, 2, 3, 4, 5]
    assert df["verify_error"].isna().tolist() == [True, True, True, False, True]
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.parametrize("path,why", [("/dev/full", "not a regular file"), ("{tmp}", "is a directory"),
                                      ("{tmp}/f/rows.csv", "cannot be written")])
def test_c25_bad_results_paths_refused_naming_the_option(tmp_path, path, why):
    (tmp_path / "f").write_text("a file, not a directory")
    with pytest.raises(ValueError, match=why) as e:
        check_output_file(path.format(tmp=tmp_path), "--results")
    assert str(e.value).startswith("--results ")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        check_output_dir(tmp_path / "f", "--results-dir")
    assert check_output_dir(tmp_path / "new" / "dir", "--results-dir").is_dir()


@pytest.fixture()
def small_tmpfs(tmp_path):
    """A 64 KiB tmpfs (root only; skipped with the reason elsewhere)."""
    d = tmp_path / "tmpfs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    yield d
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_c25_a_full_file_system_refused_before_work(small_tmpfs):
    with pytest.raises(ValueError, match="bytes free on its file system"):
        check_output_file(small_tmpfs / "rows.csv", "--results")


def test_c25_disk_fills_mid_run_rows_before_are_all_there(small_tmpfs):
    """Rows are appended until the tmpfs is full: the append that fails raises naming the file,
    and the file holds exactly the rows appended before, whole (no torn last line); a rewrite
    for a new column that does not fit leaves the old file as it was."""
    p = small_tmpfs / "rows.csv"
    written = 0
    with pytest.raises(OSError, match="intact in"):
        for i in range(100_000):
            append_csv([_row(i, pad="x" * 200)], p)
            written += 1
    df = pd.read_csv(p)
    assert len(df) == written > 10 and list(df["step"]) == list(range(written))
    before = p.read_bytes()
    with pytest.raises(OSError, match="intact in"):
        append_csv([_row(10**6, new_column="y" * 50_000)], p)
    assert p.read_bytes() == before and not [f for f in os.listdir(small_tmpfs) if f.endswith(".tmp")]
